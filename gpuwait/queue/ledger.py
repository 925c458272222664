"""The ledger's storage: one JSON file that every gpuwait process of a user (or, in a shared ledger
directory, of a group of users) shares, and the lock that orders their changes. The queue *is*
the ledger.

This module reads and writes the file and nothing else: under an exclusive lock on a sidecar
lock file it loads the file (recovering damage, keeping the evidence), hands the content to the
caller, and writes it back if it changed, so readers never see half a file. What an entry means
and how it may change is not its business: the format is gpuwait.queue.entries, and every change
of a job's state is made by gpuwait.queue.lifecycle, the only caller of `transaction`. The file
holds data only, never anything executed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gpuwait.core.errors import StateError
from gpuwait.linux import proc
from gpuwait.linux.atomic import ensure_private_dir, keep_damaged, write_atomic, write_in_place
from gpuwait.linux.lock import LockTimeout, flock_within
from gpuwait.linux.security import check_dir, is_shared_dir, open_state_file
from gpuwait.queue import entries, wake
from gpuwait.queue.entries import LedgerData

#: A ledger file larger than this is not read: any member of a shared ledger's group can write
#: it, so nothing in it may cost unbounded time or memory.
MAX_FILE_BYTES = 16 << 20

_TEMP_RE = re.compile(r"^\.(?:ledger|wake)\.json\.([0-9]+)\.tmp$")
_CRC_PREFIX = b'{"crc":'


class Ledger:
    """The ledger file and its lock, in one directory.

    A private ledger (the default: the user's state dir, 0700) is replaced by rename on every
    change. A shared ledger (`ledger_dir` naming a group-writable directory with the sticky bit)
    cannot be: the sticky bit forbids renaming over another user's file. It is rewritten in
    place under the lock instead, into two copies in turn (`ledger.json.journal`, then
    `ledger.json`), each carrying a checksum; a copy torn by a writer killed halfway is told by
    its checksum and the other copy is used, by writers and by lock-free readers alike.
    """

    def __init__(
        self, directory: Path, *, must_exist: bool = False, lock_timeout: float | None = 60.0
    ) -> None:
        self.directory = directory
        self.path = directory / "ledger.json"
        self.journal_path = directory / "ledger.json.journal"
        self.lock_path = directory / "ledger.lock"
        #: An explicitly configured ledger dir must exist (an administrator creates a shared one).
        self.must_exist = must_exist
        self.lock_timeout = lock_timeout
        #: None until the directory was looked at; then whether it is a shared ledger dir.
        self.shared: bool | None = None
        self._group: int | None = None
        #: Messages about damaged files and dropped entries, for the CLI to show once.
        self.warnings: list[str] = []
        #: The last lock-free `read` found the file damaged (a transaction repairs it).
        self.damaged = False

    def change_token(self) -> tuple[int, int, int] | None:
        """Cheap fingerprint of the file: it changes whenever the ledger is rewritten."""
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def take_warnings(self) -> list[str]:
        """The warnings gathered so far, once."""
        taken, self.warnings = self.warnings, []
        return taken

    def read(self) -> LedgerData:
        """The current ledger, without locking and without repairing it."""
        try:
            self._prepare(create=False)
        except FileNotFoundError:
            return LedgerData()
        except OSError as exc:
            raise self._unusable(exc) from None
        data, raw, rewrite = self._load(repair=False)
        # A shared ledger is rewritten in place, one copy at a time and each with a checksum,
        # so at least one copy is whole at any moment and _load takes it. Only when both
        # changed under this reader (two writers in a row) are both torn: read again. (A
        # shared lock would be simpler, but hundreds of polling readers would starve writers.)
        for _ in range(2):
            if not self.shared or raw is not None or not self.path.exists():
                break
            data, raw, rewrite = self._load(repair=False)
        self.damaged = rewrite
        return data

    @contextmanager
    def transaction(self, quiet: set[str] | None = None) -> Iterator[LedgerData]:
        """Lock, load (recovering damage), yield; write back if changed, then wake whom the
        change concerns. In gpuwait, only gpuwait.queue.lifecycle calls this.

        `quiet`: filled by the caller, before the block ends, with the ids of entries it removed
        whose process must not be woken: it is gone, or the entry named a process it had no
        business naming (see gpuwait.queue.wake.concerned).
        """
        try:
            self._prepare(create=True)
        except OSError as exc:
            raise self._unusable(exc) from None
        to_wake: set[int] = set()
        with self._locked(fcntl.LOCK_EX):
            try:
                data, raw, rewrite = self._load(repair=True)
                before = wake.fingerprint(data.jobs)
                present = {j.id: (j.state, j.pid) for j in data.jobs}
                if not self.shared:
                    self._prune_temp_files()
                yield data
                release = wake.released(before, wake.fingerprint(data.jobs))
                if release:
                    data.release_seq += 1
                document = entries.to_document(data)
                summary_path = wake.wake_path(self.directory)
                if rewrite or document != raw or not summary_path.exists():
                    self._write(document)
                    wake.write_summary(
                        self.directory, wake.summary(data.jobs, data.release_seq), self._group
                    )
                    gone_quietly = frozenset(quiet or ())
                    to_wake = wake.concerned(present, data.jobs, gone_quietly, release)
            except OSError as exc:
                raise StateError(
                    f"ledger {self.path} cannot be written: {exc.strerror}",
                    hint="free disk space or set GPUWAIT_STATE_DIR to a writable directory",
                ) from None
        # Once the lock is free: a woken waiter's first move may be to take it.
        wake.kick(to_wake)

    # -- the directory and the lock ----------------------------------------------------------

    def _unusable(self, exc: OSError) -> StateError:
        if isinstance(exc, FileNotFoundError) and self.must_exist:
            return StateError(
                f"ledger directory {self.directory} does not exist",
                hint="an administrator creates a shared one (see README, 'Shared servers'), "
                "or unset ledger_dir to use your own",
            )
        return StateError(
            f"ledger directory {self.directory} is not usable: {exc.strerror}",
            hint="set GPUWAIT_STATE_DIR (or ledger_dir) to a safe, writable directory",
        )

    def _prepare(self, create: bool) -> None:
        """Look at the directory once: refuse an unsafe one, tell private from shared."""
        if self.shared is not None:
            return
        try:
            st = os.lstat(self.directory)
        except FileNotFoundError:
            if self.must_exist or not create:
                raise
            ensure_private_dir(self.directory)
            st = os.lstat(self.directory)
        shared = is_shared_dir(st)
        check_dir(self.directory, st, private=not shared)
        self.shared = shared
        self._group = st.st_gid if shared else None

    @contextmanager
    def _locked(self, operation: int) -> Iterator[None]:
        mode = 0o660 if self.shared else 0o600
        try:
            fd = open_state_file(self.lock_path, mode, shared_gid=self._group)
        except OSError as exc:
            raise self._unusable(exc) from None
        try:
            try:
                flock_within(fd, operation, self.lock_timeout)
            except LockTimeout:
                raise StateError(
                    f"the ledger lock {self.lock_path} was held by another process for "
                    f"{self.lock_timeout:g}s; giving up",
                    hint="a hung or stopped gpuwait holds it: find it with `fuser "
                    f"{self.lock_path}` (lock_timeout sets the wait)",
                ) from None
            yield
        finally:
            os.close(fd)

    def _prune_temp_files(self) -> None:
        """Temporary files of writers killed halfway through a write."""
        try:
            names = os.listdir(self.directory)
        except OSError:
            return
        for name in names:
            match = _TEMP_RE.match(name)
            if match and proc.start_time(int(match.group(1))) is None:
                with contextlib.suppress(OSError):
                    os.unlink(self.directory / name)

    # -- reading -----------------------------------------------------------------------------

    def _read_bytes(self, path: Path) -> bytes | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise StateError(
                    f"ledger {path} is a symlink; gpuwait refuses it",
                    hint=f"remove the link ({path}) so gpuwait can write a real file",
                ) from None
            raise StateError(f"ledger {path} cannot be read: {exc.strerror}") from None
        try:
            chunks = []
            size = 0
            while size <= MAX_FILE_BYTES:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
            return b"".join(chunks)
        except OSError as exc:
            raise StateError(f"ledger {path} cannot be read: {exc.strerror}") from None
        finally:
            os.close(fd)

    def _load(self, repair: bool) -> tuple[LedgerData, Any, bool]:
        """(data, the raw JSON it was read from, whether the file must be rewritten anyway)."""
        text = self._read_bytes(self.path)
        problem: str | None = None
        if text is not None:
            try:
                return (*self._decode(text, repair), False)
            except ValueError as exc:
                problem = str(exc)
        if self.shared:
            # A writer killed halfway through ledger.json leaves the journal whole, and the
            # reverse: the journal is always written completely before ledger.json is touched.
            journal = self._read_bytes(self.journal_path)
            if journal is not None:
                try:
                    data, raw = self._decode(journal, repair)
                    return data, raw, True
                except ValueError:
                    pass
        if text is None:
            return LedgerData(), None, False
        if repair:
            kept = self._keep_damaged(text)
            self.warnings.append(
                f"ledger {self.path} was damaged ({problem}); kept it as {kept} and started afresh"
            )
        return LedgerData(), None, True

    def _decode(self, text: bytes, repair: bool) -> tuple[LedgerData, Any]:
        """Parse and validate a whole file; ValueError when it is damaged."""
        if len(text) > MAX_FILE_BYTES:
            raise ValueError(f"larger than {MAX_FILE_BYTES >> 20} MiB")
        text = _check_crc(text)
        try:
            raw = json.loads(text)
        except (UnicodeDecodeError, RecursionError) as exc:
            raise ValueError(type(exc).__name__) from None
        data = entries.from_document(raw, self.warnings if repair else None, str(self.path))
        return data, raw

    def _keep_damaged(self, text: bytes) -> str:
        """Keep the damaged bytes beside the ledger as evidence; return the copy's name."""
        if not self.shared:
            return keep_damaged(self.path).name
        # In a sticky directory the damaged file may be another user's: copy, never rename.
        name = f"{self.path.name}.damaged-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        fd = os.open(
            self.directory / name,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o640,
        )
        try:
            os.fchmod(fd, 0o640)
            os.write(fd, text)
        finally:
            os.close(fd)
        return name

    # -- writing -----------------------------------------------------------------------------

    def _write(self, document: dict[str, Any]) -> None:
        body = entries.encode(document)
        if not self.shared:
            write_atomic(self.path, body)
            return
        data = b'{"crc":%d,' % zlib.crc32(body) + body[1:]
        for path in (self.journal_path, self.path):
            write_in_place(path, data, self._group)


def _check_crc(text: bytes) -> bytes:
    """A file written with a checksum must match it (a torn in-place write does not)."""
    if not text.startswith(_CRC_PREFIX):
        return text
    comma = text.find(b",", len(_CRC_PREFIX), len(_CRC_PREFIX) + 12)
    if comma < 0:
        raise ValueError("checksum unreadable")
    try:
        expected = int(text[len(_CRC_PREFIX) : comma])
    except ValueError:
        raise ValueError("checksum unreadable") from None
    body = b"{" + text[comma + 1 :]
    if zlib.crc32(body) != expected:
        raise ValueError("checksum mismatch: a write was cut short")
    return body
