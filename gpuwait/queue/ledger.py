"""The ledger's storage, and the lock that orders its changes. The queue *is* the ledger.

A private ledger (the default: the user's state dir, 0700) is one file, `ledger.json`, locked
through the sidecar `ledger.lock`. A shared ledger directory (`ledger_dir` naming a
group-writable directory with the sticky bit, set up by an administrator) holds one file per
user, `ledger.<uid>.json`: each user writes only their own (0640, the directory's group), and
the ledger everyone plans from is all of them together. What a file says about its owner is
not taken at its word: its owner is the file system's (fstat), so its entries and requests are
that user's whatever uid they claim, and another user's entry counts only while the kernel shows
a live gpuwait of that user behind it (see gpuwait.queue.entries.combine). The sticky bit keeps
anyone but the owner (and root) from replacing or removing a user's file; its owner replaces
it by rename, so readers never see half a file. The shared lock is the directory itself, which
belongs to root: no member can take it away from the others by changing a file's mode.

This module reads and writes the files and nothing else: under the exclusive lock it loads the
ledger (recovering damage, keeping the evidence), hands it to the caller, and writes this
user's part back if it changed. What an entry means and how it may change is not its business:
the format is gpuwait.queue.entries, and every change of a job's state is made by
gpuwait.queue.lifecycle, the only caller of `transaction`. The files hold data only, never
anything executed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import json
import math
import os
import re
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gpuwait.core.errors import StateError, StateShortage
from gpuwait.core.sizes import format_setting_duration
from gpuwait.core.text import shell_word
from gpuwait.linux import alive, proc, signals
from gpuwait.linux.atomic import (
    damaged_name,
    ensure_private_dir,
    keep_damaged,
    prune_damaged,
    remove_left_temp_files,
    write_atomic,
)
from gpuwait.linux.lock import LockTimeout, flock_within, holders
from gpuwait.linux.proc import read_at_most
from gpuwait.linux.security import (
    ANYONE,
    RUNS_GPUWAIT_FOR,
    UnsafePath,
    check_dir,
    choose_own_names,
    is_shared_dir,
    open_readable,
    open_state_file,
    proven_entry,
    runs_gpuwait,
    taken_over_hint,
)
from gpuwait.linux.stamp import (
    FileStamp,
    NotTheirs,
    file_stamp,
    may_change_unseen,
    stamp_of,
)
from gpuwait.queue import entries, wake
from gpuwait.queue.entries import Job, LedgerData, copy_job

#: A ledger file larger than this is not read: any member of a shared ledger's group can write
#: one, so nothing in it may cost unbounded time or memory.
MAX_FILE_BYTES = 16 << 20
#: Users' files read from a shared ledger directory, at most (one per user who ever used it).
MAX_USER_FILES = 4096
#: How long a process about to end waits for the lock with a signal pending: many times a
#: transaction's length under contention, short enough that TERM still ends it at once to a user.
LEAVE_PATIENCE = 1.0
#: How long after its last change another member's file that cannot be used keeps everyone
#: from being admitted while a gpuwait of theirs runs (see `Ledger._load_other`); and one
#: started afresh after damage, its owner's jobs' entries still to come back.
UNREAD_GRACE = 30.0
#: Stand-ins for a content that could not be read: each unlike any other.
_UNTOLD = itertools.count()

#: The temporary files of the ledger, of the copy of a damaged one kept as evidence, and of the
#: wake-up summary: all written with the ledger lock held.
_TEMP_RE = re.compile(
    r"^\.(?:ledger(?:\.[0-9]+(?:\.[0-9a-f]+)?)?\.json(?:\.damaged-[0-9]{8}T[0-9]{6}-[0-9]+-[0-9a-f]+)?"
    r"|wake(?:\.[0-9]+)?\.json)\.[0-9]+(?:-[0-9a-f]+)?\.tmp\Z"
)
#: A member's lock directory, which their gpuwait makes at their first job: alive.<uid>, or
#: one of theirs beside it where another member took that name first.
_LOCK_DIR_RE = re.compile(r"^alive\.([0-9]{1,10})(?:\.[0-9a-f]{1,32})?\Z")
_USER_FILE_RE = re.compile(r"^ledger\.([0-9]{1,10})(?:\.([0-9a-f]{1,32}))?\.json\Z")
_CRC_PREFIX = b'{"crc":'


#: Errors that say the machine (or gpuwait) is short of something for a moment, not that a
#: file is bad: a file that cannot be opened so is neither damaged nor to be passed over.
_SHORT_OF = frozenset(
    {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS, errno.EAGAIN, errno.EINTR}
)
#: What to do about it.
_SHORT_OF_HINT = (
    "the system is short of open files or memory: try again once it is not (a process left "
    "with few file descriptors can be given more: ulimit -n)"
)


def _short_of(path: Path, exc: OSError, doing: str = "read") -> None:
    """Raise StateShortage where `exc`, reading (or `doing` else) `path`, is a shortage:
    nothing is decided (nobody admitted into room a file not read holds, no file of a user's
    moved aside as damaged)."""
    if exc.errno in _SHORT_OF:
        raise StateShortage(
            f"ledger {path} cannot be {doing} now: {exc.strerror}", hint=_SHORT_OF_HINT
        ) from None


class _Unreadable(Exception):
    """A file that is not read: a link, not a plain file, too large, or (`unreadable`) one
    the file system refuses to read."""

    def __init__(self, message: str, unreadable: bool = False) -> None:
        super().__init__(message)
        self.unreadable = unreadable


def _recovered_now(data: LedgerData, raw: Any, rewrite: bool) -> bool:
    """Did this transaction's read recover this user's file from damage: start it afresh
    (`raw` None, to be written), or drop entries it could not read (a new `repaired_at`)?"""
    if raw is None:
        return rewrite
    before = raw.get("repaired_at") if isinstance(raw, dict) else None
    return data.repaired_at is not None and data.repaired_at != before


def _settle_afresh(directory: Path, data: LedgerData) -> None:
    """Take the mark of this user's file started afresh (`Ledger._afresh`) away once no entry
    is still to come back: every job of theirs whose lock a live process holds has its entry
    again, or has ended (its outcome in the book), or UNREAD_GRACE has passed. While it
    stands, the other members' gpuwait admit nobody (`Ledger._recovered_others`). A job of
    this process's own counts too: it may not have put its entry back yet. No lock is told
    by its file's time: on a file server whose clock is ahead of this machine's, one taken
    before the file was started afresh looks taken since, and its job's entry was not waited
    for; a job of the new file's has its entry from its lock on (both in one transaction)."""
    if data.repaired_at is None or data.repaired_at != data.created_at:
        return
    ago = entries.since(data.repaired_at, data.repaired_boot, time.time(), proc.boot_clock())
    if 0 <= ago < UNREAD_GRACE:
        listed = {j.id for j in data.jobs if data.mine(j)} | {f.id for f in data.book.finished}
        try:
            if alive.held_here(directory) - listed or alive.unlisted(directory, listed, math.inf):
                return
        except OSError:
            return  # not to be told now: the mark stands, until UNREAD_GRACE has passed
    data.repaired_at = data.repaired_boot = None


class Ledger:
    """The ledger in one directory: private (one file) or shared (one file per user)."""

    def __init__(
        self,
        directory: Path,
        *,
        must_exist: bool = False,
        lock_timeout: float | None = 60.0,
        on_slow_lock: Callable[[str], None] | None = None,
        fair_half_life: float | None = None,
    ) -> None:
        self.directory = directory
        #: The file this process writes: ledger.json, or in a shared directory this user's own.
        self.path = directory / "ledger.json"
        self.lock_path = directory / "ledger.lock"
        #: An explicitly configured ledger dir must exist (an administrator creates a shared one).
        self.must_exist = must_exist
        self.lock_timeout = lock_timeout
        #: None until the directory was looked at; then whether it is a shared ledger dir.
        self.shared: bool | None = None
        self._group: int | None = None
        self._uid = os.getuid()
        #: Messages about damaged files and dropped entries, for the CLI to show once.
        self.warnings: list[str] = []
        #: The last lock-free `read` found this user's file damaged (a transaction repairs it).
        self.damaged = False
        #: How long a wait for the lock goes on with a signal pending (see `leaving`).
        self._patience = 0.0
        #: When, on the boot clock, a wait for the lock gives up whatever lock_timeout says (see
        #: `lock_deadline`); None: none.
        self._deadline: float | None = None
        #: Told who holds the lock once one process has held it all through a wait (SLOW_AFTER).
        self.on_slow_lock = on_slow_lock
        #: The fair-share half-life (None: off) with which what a job found gone had held is
        #: charged to its user when its entry is reaped (gpuwait.queue.lifecycle).
        self.fair_half_life = fair_half_life
        #: Names in a shared directory found to be no file of the uid they name (`_user_files`).
        self._not_theirs = NotTheirs()
        #: The users whose lock directory is in the shared directory, and those of them whose
        #: summary is there too.
        self._members: frozenset[int] = frozenset()
        #: The members whose file this process found gone, unusable or started afresh lately
        #: at its last read, and when (the monotonic clock) it first found it so since it was
        #: last none of these (`_held_until`).
        self._holding_since: dict[int, float] = {}
        self._holding_before: dict[int, float] = {}
        #: The shared directory's entries, listed once for the read or transaction under way
        #: (None: not yet): every look at its names there is at this one listing, however
        #: many names members made.
        self._listed: list[os.DirEntry[str]] | None = None
        self._listed_names: list[str] | None = None

    def change_token(self) -> tuple[Any, ...] | None:
        """Cheap fingerprint of the ledger: it changes whenever a file of it is rewritten.

        A file's metadata tells its versions apart but for those written within one tick of a
        coarse file system clock (kernels before 6.13, NFS): the inode of one replaced by
        rename is reused two writes later, and the size may come back. A file changed less
        than RACY_SECONDS ago (gpuwait.linux.stamp) may change again unseen in its tick, so
        its content counts too.
        """
        if not self.shared:
            stamp = file_stamp(self.path)
            return None if stamp is None else (*stamp, self._racy_digest(self.path, stamp))
        # Every user's file is replaced by rename, so a new inode number marks every change.
        token = []
        try:
            with os.scandir(self.directory) as found:
                for item in found:
                    if _USER_FILE_RE.match(item.name):
                        with contextlib.suppress(OSError):
                            stamp = stamp_of(item.stat(follow_symlinks=False))
                            digest = self._racy_digest(item.path, stamp)
                            token.append((item.name, *stamp, digest))
        except OSError:
            return None
        return tuple(sorted(token))

    def _racy_digest(self, path: Path | str, stamp: FileStamp) -> tuple[int] | int | None:
        """A checksum of the content of the file at `path` (a 1-tuple) where its stamp was
        taken within RACY_SECONDS of its last change (or its change time is ahead of this
        clock); None where the stamp alone tells it; a number never given before where the
        file cannot be read now."""
        if not may_change_unseen(stamp):
            return None
        try:
            read = self._read_file(Path(path))
        except (_Unreadable, StateShortage):
            return next(_UNTOLD)  # looked at again next time, and by the reader now
        return None if read is None else (zlib.crc32(read[1]),)

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
        self._listed = self._listed_names = None
        try:
            data, _, rewrite = self._load(repair=False)
        finally:
            self._listed = self._listed_names = None
        self.damaged = rewrite
        return data

    def _listing(self) -> list[os.DirEntry[str]]:
        """The shared directory's entries, as listed once in this read or transaction (OSError
        where it cannot be listed)."""
        if self._listed is None:
            with os.scandir(self.directory) as found:
                self._listed = list(found)
        return self._listed

    def listed_names(self) -> list[str] | None:
        """The names in the shared directory, as listed once in the transaction under way;
        None where it cannot be listed, or the ledger is no shared one."""
        if not self.shared:
            return None
        if self._listed_names is None:
            try:
                self._listed_names = [item.name for item in self._listing()]
            except OSError:
                return None
        return self._listed_names

    @contextmanager
    def lock_wait(self, seconds: float) -> Iterator[None]:
        """Meanwhile, wait at most `seconds` for the lock: for a reader that can do without
        it (LockBusy once they have passed)."""
        before = self.lock_timeout
        self.lock_timeout = seconds if before is None else min(before, seconds)
        try:
            yield
        finally:
            self.lock_timeout = before

    @contextmanager
    def lock_deadline(self, deadline: float | None) -> Iterator[None]:
        """Meanwhile, wait for the lock until `deadline` (the boot clock: a launch's --timeout)
        and at least LEAVE_PATIENCE, however long lock_timeout is (LockPastDeadline once they
        have passed); None: as lock_timeout says."""
        before, self._deadline = self._deadline, deadline
        try:
            yield
        finally:
            self._deadline = before

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
        with self._locked():
            self._listed = self._listed_names = None
            try:
                data, raw, rewrite = self._load(repair=True)
                before = wake.fingerprint(data.jobs)
                # Pids of other pid namespaces' entries name nobody to wake here.
                present = {j.id: (j.state, j.pid) for j in data.jobs if not entries.elsewhere(j)}
                # The ledger's and the summaries' temporary files are only written with the
                # lock held; in a shared directory only this user's are this user's to remove.
                remove_left_temp_files(self.directory, _TEMP_RE, self._uid, self.listed_names())
                yield data
                if self.shared:
                    _settle_afresh(self.directory, data)
                release = data.put_back or wake.released(before, wake.fingerprint(data.jobs))
                if release:
                    data.release_seq += 1
                document = entries.to_document(data)
                listed = self.listed_names()
                summary_path = wake.summary_path(self.directory, bool(self.shared), listed)
                changed = rewrite or document != raw or not summary_path.exists()
                if changed:
                    writing, began = time.time(), time.monotonic()
                    write_atomic(
                        self.path,
                        entries.encode(document),
                        0o640 if self.shared else 0o600,
                        self._group,
                    )
                    if self.shared:
                        _clock_told(self.directory, self.path, writing, began)
                    gone_quietly = frozenset(quiet or ())
                    to_wake = wake.concerned(present, data.jobs, gone_quietly, release)
                    if _recovered_now(data, raw, rewrite):
                        # Started afresh or repaired: the waiters whose entries the damage lost
                        # are listed nowhere, and each puts its entry back only once woken.
                        mine = {j.id for j in data.jobs if data.mine(j)}
                        to_wake |= alive.holders_unlisted(self.directory, mine)
                if changed or data.starting:
                    # Other members' waiters this plan starts are told so even where nothing
                    # of this user's changed: their own gpuwait starts them.
                    content = wake.summary(
                        data.jobs, data.release_seq, data.starting, bool(self.shared)
                    )
                    wake.write_summary(self.directory, content, self._group, listed)
            except OSError as exc:
                _short_of(self.path, exc, "written")
                raise StateError(
                    f"ledger {self.path} cannot be written: {exc.strerror}",
                    hint=self._write_hint(exc),
                ) from None
            finally:
                self._listed = self._listed_names = None
        # Once the lock is free: a woken waiter's first move may be to take it.
        wake.kick(to_wake)

    def _write_hint(self, exc: OSError) -> str:
        """What to do about a ledger that cannot be written, by why."""
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return "free disk space (or quota), or set GPUWAIT_STATE_DIR to another directory"
        if exc.errno in _SHORT_OF:
            return _SHORT_OF_HINT
        if self.shared and self._group is not None and exc.errno in (errno.EPERM, errno.EACCES):
            # Files in a shared directory go to its group, which takes being a member of it.
            group = _group_name(self._group)
            if self._group != os.getgid() and self._group not in os.getgroups():
                return (
                    f"the shared ledger directory {self.directory} is for group {group}, which"
                    " you are not in: an administrator adds you (then log in again), or set"
                    " ledger_dir to a directory of your own"
                )
        return "set GPUWAIT_STATE_DIR (or ledger_dir) to a directory you can write"

    # -- the directory and the lock ----------------------------------------------------------

    def _unusable(self, exc: OSError) -> StateError:
        if isinstance(exc, FileNotFoundError) and self.must_exist:
            return StateError(
                f"ledger directory {self.directory} does not exist",
                hint="an administrator creates a shared one (see docs/shared-servers.md), "
                "or unset ledger_dir to use your own",
            )
        hint = "set GPUWAIT_STATE_DIR (or ledger_dir) to a safe, writable directory"
        if isinstance(exc, PermissionError):
            hint = taken_over_hint(self.directory) or hint
        return StateError(
            f"ledger directory {self.directory} is not usable: {exc.strerror}", hint=hint
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
        if shared:
            self.path = self.directory / f"ledger.{self._uid}.json"

    @contextmanager
    def leaving(self) -> Iterator[None]:
        """For the transactions of a process that is about to end (a signal may be why).

        A pending signal gives up a wait for the lock at once anywhere else, so that TERM or
        Ctrl-C acts whatever holds it. Here the wait goes on for LEAVE_PATIENCE first: scancel,
        `systemctl stop` or Ctrl-C on `make -j` ends every gpuwait at once, and each finds the
        lock held by a neighbour's transaction of a few milliseconds; giving up there leaves
        the entry for the next gpuwait to reap instead of taking it out.
        """
        previous, self._patience = self._patience, LEAVE_PATIENCE
        try:
            yield
        finally:
            self._patience = previous

    @contextmanager
    def _locked(self) -> Iterator[None]:
        timeout = self.lock_timeout
        by_deadline = False
        if self._deadline is not None:
            until = max(LEAVE_PATIENCE, self._deadline - proc.boot_clock())
            if timeout is None or until < timeout:
                timeout, by_deadline = until, True
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            fd = self._lock_file()
            _LOCK_FDS.add(fd)
            try:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                flock_within(fd, fcntl.LOCK_EX, left, self._patience, self._slow(fd))
            except LockTimeout:
                who = _who(holders(fd))
                _close_lock(fd)
                place = self.directory if self.shared else self.lock_path
                if by_deadline:
                    raise LockPastDeadline(
                        f"the ledger lock on {place} was held by {who} all the while"
                    ) from None
                raise LockBusy(
                    f"the ledger lock on {place} was held by {who} for "
                    f"{format_setting_duration(timeout)}; giving up",
                    hint="a hung, stopped or misbehaving process holds it "
                    f"(lock_timeout = {format_setting_duration(timeout)} sets the wait)",
                ) from None
            except OSError as exc:
                _close_lock(fd)
                if signals.raised_by_a_handler(exc):
                    raise
                # ENOLCK: an NFS mount whose lock daemon does not answer, say.
                raise StateError(
                    f"the ledger lock on {self.directory if self.shared else self.lock_path} "
                    f"cannot be taken: {exc.strerror}",
                    hint="the file system does not lock files here: set GPUWAIT_STATE_DIR (or "
                    "ledger_dir) to a directory on one that does (a local disk)",
                ) from None
            except BaseException:
                _close_lock(fd)
                raise
            if self.shared or self._still_the_lock(fd):
                break
            # The lock file was removed (a tmp cleaner, a person) or replaced while this
            # process waited: whoever came since holds the file there now, so take that one.
            _close_lock(fd)
        # Ctrl-Z stops this process once the lock is free, not while everyone waits for it.
        previous = signals.hold_stops()
        try:
            yield
        finally:
            _close_lock(fd)
            signals.resume_stops(previous)

    def _slow(self, fd: int) -> Callable[[], bool] | None:
        """What tells `on_slow_lock` who holds the lock on `fd`, and how long it is waited for."""
        tell = self.on_slow_lock
        if tell is None:
            return None
        place = self.directory if self.shared else self.lock_path
        limit = (
            ""
            if self.lock_timeout is None
            else f" (lock_timeout = {format_setting_duration(self.lock_timeout)})"
        )

        #: Who held the lock at the last look (None: not looked at yet), and for how many looks.
        seen: list[Any] = [None, 0]

        def slow() -> bool:
            # Told only when one process held it at three looks in a row (over SLOW_AFTER):
            # under a sweep's hundred launches the lock changes hands for seconds on end.
            now = holders(fd)
            seen[1] = seen[1] + 1 if now == seen[0] else 1
            seen[0] = now
            if seen[1] < 3:
                return False
            tell(
                f"waiting for the ledger lock on {place}, held by {_who(now)}; a "
                f"transaction takes milliseconds, so it may be hung or stopped{limit}"
            )
            return True

        return slow

    def _lock_file(self) -> int:
        try:
            if self.shared:
                # The directory is root's: a member can hold its lock (and is then named in
                # the error below), but cannot make it unusable for the others.
                return os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            return open_state_file(self.lock_path, 0o600)
        except OSError as exc:
            _short_of(self.directory if self.shared else self.lock_path, exc, "locked")
            raise self._unusable(exc) from None

    def _still_the_lock(self, fd: int) -> bool:
        """Is the file locked through `fd` still the one at the lock's path?"""
        try:
            there = os.lstat(self.lock_path)
        except FileNotFoundError:
            return False
        except OSError:
            return True  # not to be told: as before
        st = os.fstat(fd)
        return (there.st_dev, there.st_ino) == (st.st_dev, st.st_ino)

    # -- reading -----------------------------------------------------------------------------

    def _read_file(self, path: Path) -> tuple[int, bytes] | None:
        """(owner uid, content) of a plain file; None when missing. Opened without following
        links and without blocking (a FIFO put there must not hang a reader that holds the
        lock), and read only up to just past the cap (`_decode` refuses what is longer)."""
        try:
            fd = open_readable(path, ANYONE)
        except UnsafePath as exc:
            raise _Unreadable(f"it {exc.what}") from None
        except OSError as exc:
            _short_of(path, exc)
            raise _Unreadable(f"it cannot be read: {exc.strerror}", unreadable=True) from None
        if fd is None:
            return None
        try:
            st = os.fstat(fd)
            if st.st_size > MAX_FILE_BYTES and st.st_uid != self._uid:
                # Another member's, refused unread: everyone plans from every file, often.
                raise _Unreadable(f"it is larger than {MAX_FILE_BYTES >> 20} MiB")
            return st.st_uid, read_at_most(fd, MAX_FILE_BYTES)
        except OSError as exc:
            _short_of(path, exc)
            raise _Unreadable(f"it cannot be read: {exc.strerror}") from None
        finally:
            os.close(fd)

    def _load(self, repair: bool) -> tuple[LedgerData, Any, bool]:
        """(data, the raw JSON of this user's file, whether that file must be rewritten)."""
        if not self.shared:
            return self._load_own(self.path, repair, owned=False)
        names = self._user_files()
        data, raw, rewrite = self._load_own(self.path, repair, owned=True)
        others: dict[int, LedgerData] = {}
        unread: dict[int, tuple[str, float]] = {}
        # Those found gone, unusable or started afresh at this read, from those found so at
        # the last.
        self._holding_before, self._holding_since = self._holding_since, {}
        for uid, name in names.items():
            if uid == self._uid:
                continue
            part = self._load_other(self.directory / name, uid, repair, unread)
            if part is not None:
                others[uid] = part
        self._gone(sorted(self._members - names.keys() - {self._uid}), unread)
        combined = entries.combine(data, list(others.items()), self._uid, self._counts)
        combined.unread = {uid: why for uid, (why, _) in unread.items()}
        combined.unread_until = {uid: until for uid, (_, until) in unread.items()}
        combined.recovered = self._recovered_others(others)
        combined.listed = None if self._listed is None else self.listed_names()
        return combined, raw, rewrite

    def _recovered_others(self, others: dict[int, LedgerData]) -> dict[int, float | None]:
        """The other users whose file was started afresh after damage (`_afresh`) less than
        UNREAD_GRACE ago while a gpuwait of theirs runs, and when (on the boot clock, to the
        hundredth of a second; None where it is not known) that is UNREAD_GRACE ago (or this
        process first found it so, `_held_until`). Their
        jobs' entries come back only as each one's gpuwait puts it back, and until then the
        room those jobs hold is counted nowhere."""
        now, boot_now = time.time(), proc.boot_clock()
        found: dict[int, float | None] = {}
        for uid, part in others.items():
            if part.repaired_at is None or part.repaired_at != part.created_at:
                continue  # never started afresh (one repaired in part keeps its live entries)
            ago = entries.since(part.repaired_at, part.repaired_boot, now, boot_now)
            if not 0 <= ago < UNREAD_GRACE:
                continue
            # No longer than UNREAD_GRACE from this process's first finding it so, either: a
            # loop of theirs writing such a file again and again would hold everyone for good.
            lapses = self._held_until(uid, now - ago + UNREAD_GRACE)
            if lapses is not None and (
                runs_gpuwait(uid) or _holds_a_lock(uid, self.directory, self.listed_names())
            ):
                found[uid] = None if boot_now is None else round(boot_now + lapses - now, 2)
        return found

    def _user_files(self) -> dict[int, str]:
        """Each user's file in the shared directory, by owner; chooses this user's own."""
        # Any member may make names for uids not theirs, thousands of them: each is looked at
        # by its directory entry (no path built for it), only where its uid has no file found
        # that it could replace, and not again while the directory is as it was.
        self._not_theirs.begin(self.directory)
        canonical = f"ledger.{self._uid}.json"
        listed = self._not_theirs.listed
        if listed is None:
            listed, whole = self._list_user_files(canonical)
            if whole:
                self._not_theirs.keep(listed)
        # Else the same names as at the last look, each of the same file (a file is replaced,
        # made or removed only by a change of the directory).
        found, said, self._members = dict(listed[0]), listed[1], listed[2]
        self.warnings.extend(said)
        mine = found.get(self._uid)
        if mine is not None:
            self.path = self.directory / mine
        elif os.path.lexists(self.directory / canonical):
            # Squatted: a name nobody can guess, found again by its owner (and the pattern).
            self.path = self.directory / f"ledger.{self._uid}.{os.urandom(8).hex()}.json"
        else:
            self.path = self.directory / canonical
        return found

    def _list_user_files(
        self, canonical: str
    ) -> tuple[tuple[dict[int, str], list[str], frozenset[int]], bool]:
        """Each user's file in the shared directory, by owner, looked up afresh, what to warn
        of (this user's own name taken by another), and the users with no file whose lock
        directory (alive.<uid>) of their own is there; and whether every name could be looked
        at (one that could not is looked at again next time)."""
        # Whose lock directory each name is, looked at only for a uid with no file.
        marks: list[tuple[int, os.DirEntry[str]]] = []
        try:
            named: dict[str, os.DirEntry[str]] = {}
            for item in self._listing():
                if item.name in self._not_theirs and item.name != canonical:
                    continue
                if item.name.startswith("ledger."):
                    named[item.name] = item
                elif (of := _LOCK_DIR_RE.match(item.name)) is not None:
                    marks.append((int(of[1]), item))
        except OSError as exc:
            raise StateError(
                f"ledger directory {self.directory} cannot be read: {exc.strerror}"
            ) from None
        said: list[str] = []
        whole = True

        def theirs(name: str, uid: int) -> bool:
            nonlocal whole
            try:
                owner = named[name].stat(follow_symlinks=False).st_uid
            except OSError:
                whole = False
                return False
            if owner != uid:
                self._not_theirs.add(name)
                # Made by someone else under another user's name: it stands for nobody.
                if name == canonical:
                    said.append(
                        f"ledger {self.directory / name} belongs to uid {owner}, not to you; "
                        "using a file of your own beside it (an administrator may remove it)"
                    )
                return False
            return True

        # Each user's as their summary and their lock directory are chosen: their canonical
        # name, else the first of theirs beside it.
        found = choose_own_names(sorted(named), "ledger", ".json", theirs, MAX_USER_FILES)
        # Members: a lock directory of their own (whether a job of theirs runs is told by a
        # lock on it, `_holds_a_lock`).
        owned: set[int] = set()
        for uid, item in marks:
            if uid in found or uid in owned:
                continue
            try:
                owner = item.stat(follow_symlinks=False).st_uid
            except OSError:
                whole = False
                continue
            if owner == uid:
                owned.add(uid)
            else:
                self._not_theirs.add(item.name)
        return (found, said, frozenset(owned)), whole

    def _load_own(self, path: Path, repair: bool, owned: bool) -> tuple[LedgerData, Any, bool]:
        try:
            found = self._read_file(path)
        except _Unreadable as exc:
            if repair and self.shared:
                # This user's own name: move the thing aside and start the file afresh.
                kept = keep_damaged(path)
                self.warnings.append(f"ledger {path}: {exc}; moved it to {kept.name}")
                return self._afresh(), None, True
            elif not self.shared:
                raise StateError(
                    f"ledger {path}: {exc}; gpuwait refuses it",
                    hint=f"make it a readable file of yours again (chmod u+rw {shell_word(path)}); remove it"
                    " only if it is no ledger (the queue it holds goes with it)"
                    if exc.unreadable
                    else f"remove it ({path}) so gpuwait can write a real file",
                ) from None
            return LedgerData(), None, True
        if found is None:
            # Removed (a cleaner, a person) while jobs of this user's live, their entries are
            # still to come back, as after damage (or those of launches of the same moment, a
            # sweep's first in the directory, which come at once).
            return self._afresh() if repair and self.shared else LedgerData(), None, False
        text = found[1]
        try:
            before = len(self.warnings)
            data, raw = self._decode(text, repair, self._uid, owned)
            if repair and len(self.warnings) > before:
                # Damaged in part (a malformed entry, the record of finished jobs): the rest
                # is used, and this transaction writes the file without the damage, so a copy
                # of it as found is kept as evidence.
                with contextlib.suppress(OSError):
                    kept = damaged_name(path)
                    write_atomic(kept, text, 0o600, self._group)
                    prune_damaged(path, kept)
                    self.warnings[-1] += f"; kept the file as found as {kept.name}"
            return data, raw, False
        except entries.NewerSchema as exc:
            problem = str(exc)
            if repair and self._live_jobs_elsewhere():
                # Started afresh, it would lose the entries the newer gpuwait keeps for jobs
                # that run or wait now: their room would be given to others.
                raise StateError(
                    f"ledger {path} was written by a newer gpuwait (schema {exc.schema}, this "
                    f"one reads {entries.SCHEMA}), and jobs of yours run or wait under it",
                    hint="install in this environment the gpuwait your other jobs run; this "
                    "one can use the ledger again (starting it afresh) once none of them runs",
                ) from None
        except ValueError as exc:
            problem = str(exc)
        if repair:
            kept_name = keep_damaged(path).name
            self.warnings.append(
                f"ledger {path} was damaged ({problem}); kept it as {kept_name} and started afresh"
            )
            if self.shared:
                return self._afresh(), None, True
        return LedgerData(), None, True

    def _afresh(self) -> LedgerData:
        """This user's file of a shared directory started afresh (after damage, or made anew
        after its removal): where jobs of theirs live (their liveness locks held by processes
        other than this one), marked repaired when it began, so that the other members' gpuwait
        tell it from a file new to the directory, the entries of those jobs still to come back
        (`_recovered_others`). Under the ledger's lock, as each job takes its lock, every
        lock held now was taken before (told by no file's time: a file server's clock ahead of
        this machine's stamps one taken a moment ago later than now)."""
        data = LedgerData()
        if self._live_jobs_elsewhere():
            data.repaired_at, data.repaired_boot = data.created_at, data.created_boot
        return data

    def _live_jobs_elsewhere(self) -> bool:
        """Does a live process, other than this one, hold the liveness lock of a job of this
        user's (told by the lock, whatever ledger schema its gpuwait writes)? Where that
        cannot be told (no file descriptor left), as if one did."""
        try:
            return bool(alive.unlisted(self.directory, set(), math.inf, self.listed_names()))
        except OSError:
            return True

    def _gone(self, uids: list[int], unread: dict[int, tuple[str, float]]) -> None:
        """The members whose files are gone (`uids`), each one's as follows. A member whose
        file is gone (removed by hand) while a job of theirs holds its
        liveness lock: the room their jobs hold is not known until it is written again, and
        nobody is admitted for UNREAD_GRACE from the directory's last change (`_load_other`),
        and no longer than UNREAD_GRACE from this process's first finding it gone: every
        member's write there changes the directory, and on a busy server it would hold
        everyone for good. A gpuwait of theirs that writes it again does so within moments (a
        waiter once woken, a job's between two samples); one that does not (none runs: the
        lock held by a process their job left running; one stopped with Ctrl-Z, or the parent
        of a command the shell hook runs bare) would hold everyone for as long as it lives.
        Whether a job of theirs runs is asked only of those who may hold this waiter still,
        /proc/locks read once for them all."""
        changed = _lapses(self.directory, self.directory) if uids else None
        holding = {uid: self._held_until(uid, changed) for uid in uids}
        held = [uid for uid, lapses in holding.items() if lapses is not None]
        if held:
            _learn_locks(held, self.directory, self.listed_names())
        for uid in held:
            lapses = holding[uid]
            if lapses is not None and _holds_a_lock(uid, self.directory, self.listed_names()):
                unread[uid] = ("it is not there", lapses)

    def _held_until(self, uid: int, lapses: float | None) -> float | None:
        """When a hold for `uid`'s file, found gone, unusable or started afresh lately by
        this read, lapses (None: it holds nobody): `lapses`, the end of UNREAD_GRACE from its
        last change (or its start afresh), but no later than UNREAD_GRACE from this process's
        first finding it so since it was last none of these (on the monotonic clock: a step
        of the wall clock changes nothing). A member who writes junk over their file (or takes
        it away, or writes one started afresh) again and again would else hold everyone for
        good, at no cost of theirs."""
        now, looked = time.time(), time.monotonic()
        since = self._holding_since[uid] = self._holding_before.get(uid, looked)
        if lapses is None:
            return None
        lapses = min(lapses, now + UNREAD_GRACE - (looked - since))
        return lapses if lapses > now else None

    def _load_other(
        self, path: Path, uid: int, repair: bool, unread: dict[int, tuple[str, float]]
    ) -> LedgerData | None:
        """Another user's file, or None (with a warning when transacting) when it is unusable:
        then that user's jobs are not counted until they run gpuwait again; where it changed
        less than UNREAD_GRACE ago and a gpuwait of theirs runs now, why it is not used goes in
        `unread`, by uid, with when it has been left so for UNREAD_GRACE, or found unusable
        by this process for as long (`_held_until`): nobody is admitted while the room their
        jobs hold is unknown, and no longer than that. A file
        left so for longer is not waited for: its owner's gpuwait, where it uses this ledger
        and runs, writes it again at its next change."""
        try:
            found = self._read_file(path)
            if found is None or found[0] != uid:
                self._gone([uid], unread)  # gone, or replaced, since the directory was listed
                return None
            # Root may write it back (`_reap_for`): then its owner's book must come back whole.
            tidies = repair and self._uid == 0
            data, raw = self._decode(
                found[1],
                False,
                uid,
                owned=True,
                foreign=True,
                with_book=tidies,
                proves=_proven_or_gone if tidies else proven_entry,
            )
        except (_Unreadable, ValueError) as exc:
            if repair:
                self.warnings.append(f"ledger {path} of uid {uid} is not used: {exc}")
            lapses = self._held_until(uid, _lapses(path, self.directory))
            if lapses is not None and (
                runs_gpuwait(uid) or _holds_a_lock(uid, self.directory, self.listed_names())
            ):
                unread[uid] = (str(exc), lapses)
            return None
        if tidies and raw.get("schema") == entries.SCHEMA:
            # A newer gpuwait's file is its owner's to tidy: written back by this one, it
            # would lose what only the newer one reads (its entries of a newer form).
            self._reap_for(path, uid, data, len(raw.get("jobs", ())))
        return data

    def _reap_for(self, path: Path, uid: int, data: LedgerData, entries_in_file: int) -> None:
        """Root takes out of another user's file the entries that stand for nobody of theirs
        (a live process of someone else's, pid 1, copies naming one gpuwait or one command
        twice); the file stays theirs. An entry whose processes are all gone is left to its
        owner's next gpuwait, which reaps it as its own: recorded as lost (what `--after` and
        `--after-ok` read), its run in the history, its usage charged; so is one naming a
        live process of theirs that the kernel does not prove (`_left_to_its_owner`)."""
        kept = entries.counted(
            [copy_job(j) for j in data.jobs],
            uid,
            lambda j: (
                self._counts(j)
                or _left_to_its_owner(uid, j.pid, j.start_time, j.child_pid, j.child_start_time)
            ),
        )
        if len(kept) == entries_in_file:
            return
        body = entries.encode(entries.to_document(data._replace(jobs=kept)))
        with contextlib.suppress(OSError):  # theirs to tidy as well
            write_atomic(path, body, 0o640, self._group, owner=uid)

    def _decode(
        self,
        text: bytes,
        repair: bool,
        owner: int | None = None,
        owned: bool = False,
        foreign: bool = False,
        with_book: bool = True,
        proves: Callable[
            [int, int, int, object, int | None, int | None, object], bool
        ] = proven_entry,
    ) -> tuple[LedgerData, Any]:
        """Parse and validate a whole file; ValueError when it is damaged.

        `foreign`: another user's file, whose entries count only as far as the kernel proves
        them (`proves`); those it does not are passed over before they are validated, so that a
        file of a thousand forged entries costs every reader no more than its parsing. Without
        `with_book`, its book (finished jobs, counters, batches: its owner's alone, which no
        other user's plan reads) is left out unread: a year of a hundred users' finished jobs
        would cost every reader the validation of each, at every look.
        """
        owner = self._uid if owner is None else owner
        if len(text) > MAX_FILE_BYTES:
            raise ValueError(f"larger than {MAX_FILE_BYTES >> 20} MiB")
        text = _check_crc(text)
        try:
            raw = json.loads(text)
        except (UnicodeDecodeError, RecursionError) as exc:
            raise ValueError(type(exc).__name__) from None
        checked = raw
        if foreign and isinstance(raw, dict) and isinstance(raw.get("jobs"), list):
            checked = {**raw, "jobs": entries.claims_proven(raw["jobs"], owner, proves)}
        if not with_book and isinstance(checked, dict):
            checked = {k: v for k, v in checked.items() if k != "book"}
        where = str(self.directory / f"ledger.{owner}.json") if owned else str(self.path)
        # Another user's file written by a newer gpuwait is read as far as this one can: its
        # jobs' reservations still count (they are passed over only where they cannot be read).
        data = entries.from_document(
            checked, self.warnings if repair else None, where, owner, owned, newer_ok=foreign
        )
        return data, raw

    @staticmethod
    def _counts(job: Job) -> bool:
        """Another user's entry counts while the kernel shows a job of theirs behind it."""
        if entries.of_an_earlier_boot(job.boot) or not proven_entry(
            job.uid,
            job.pid,
            job.start_time,
            job.state,
            job.child_pid,
            job.child_start_time,
            job.command,
        ):
            return False
        if job.orphaned_at is None and not proc.is_alive(job.pid, job.start_time):
            job.orphaned_at = time.time()  # its owner's next transaction says so for good
        return True


#: By (uid, ledger directory): (until when, on the monotonic clock, `_holds_a_lock`'s answer
#: stands; the answer). Asked at each read of a shared ledger where a member's file cannot be
#: used or is gone: /proc/locks is read once in RUNS_GPUWAIT_FOR seconds, however many locks
#: anyone holds.
_HOLDS_A_LOCK: dict[tuple[int, Path], tuple[float, bool]] = {}


def _holds_a_lock(uid: int, directory: Path, listed: list[str] | None) -> bool:
    """Does a job of `uid`'s hold its lock in the ledger `directory`, as a job's gpuwait (or a
    program holding room through gpuwait.reserve()) does (`alive.jobs_run`)? A lock of theirs
    on another file (a download's) tells nothing. A job of a gpuwait older than that lock, a
    member's venv's copy, holds none: the summary their gpuwait wrote last listing a job of
    theirs running tells it, with an exclusive flock of theirs on the directory's file system
    (that job's liveness lock; the summary alone may list a job that ran on, another's)."""
    _learn_locks([uid], directory, listed)
    return _HOLDS_A_LOCK[(uid, directory)][1]


def _learn_locks(uids: list[int], directory: Path, listed: list[str] | None) -> None:
    """`_holds_a_lock` of each of `uids` not known now, from one reading of /proc/locks for
    their lock directories: a shared ledger's members who left, whose files root removed, are
    looked at at every read within UNREAD_GRACE of the directory's last change (on a busy
    server, every read)."""
    now = time.monotonic()
    unknown = [
        uid
        for uid in uids
        if (known := _HOLDS_A_LOCK.get((uid, directory))) is None or now >= known[0]
    ]
    if not unknown:
        return
    if len(_HOLDS_A_LOCK) + len(unknown) > 4096:
        _HOLDS_A_LOCK.clear()
    running = alive.jobs_run_of(directory, unknown, listed)
    said = wake.runs_a_job_of(directory, [u for u in unknown if u not in running], listed)
    running |= alive.locks_exclusively(directory, said)
    for uid in unknown:
        _HOLDS_A_LOCK[(uid, directory)] = (now + RUNS_GPUWAIT_FOR, uid in running)


#: By shared ledger directory: how far the clock its file system stamps change times by is
#: ahead of this machine's wall clock (an NFS server's may be off by minutes), as this process's
#: last write of its own file there told. The same clock as gpuwait.linux.alive._AHEAD's, told
#: apart on purpose: a hold of UNREAD_GRACE either way of a change wants the middle, taken
#: from this process's own writes, made anyway, rather than from a file made at reads (every
#: waiter reads at every change); alive's is an upper bound (a lock taken before a moment is
#: never told taken after it), told by a file made for it, for a ledger started afresh.
_AHEAD: dict[Path, float] = {}


#: How long, at most, a write of this user's file may take, by this machine's wall clock and
#: by its monotonic clock, to tell the file system's clock (`_clock_told`): its change time is
#: taken for the middle of the write, off by half of it at most.
CLOCK_TOLD_WITHIN = 2.0


def _clock_told(directory: Path, path: Path, writing: float, began: float) -> None:
    """Keep how far `directory`'s file system's clock is ahead of this machine's: `path`, this
    user's file there, was written just now, from the wall-clock time `writing` on (`began`
    on the monotonic clock). A write that took longer than CLOCK_TOLD_WITHIN (the server not
    answering, this process frozen, the machine suspended, the clock stepped meanwhile) tells
    nothing: its change time may be anywhere in it."""
    written, ended = time.time(), time.monotonic()
    if not (0 <= written - writing <= CLOCK_TOLD_WITHIN and ended - began <= CLOCK_TOLD_WITHIN):
        return
    with contextlib.suppress(OSError):
        _AHEAD[directory] = os.lstat(path).st_ctime - (writing + written) / 2


def _lapses(path: Path, directory: Path) -> float | None:
    """Where the file at `path` in the ledger `directory` changed (its inode: a time nobody can
    set) less than UNREAD_GRACE ago, on its file system's clock: when (on this machine's wall
    clock) that is no longer so; None where it did not."""
    try:
        changed = os.lstat(path).st_ctime
    except OSError:
        return None
    return lapse(changed, time.time(), _AHEAD.get(directory, 0.0))


def lapse(changed: float, now: float, ahead: float) -> float | None:
    """Where the change time `changed` (on a file system's clock, `ahead` seconds ahead of
    this machine's: 0 where it is not known) is less than UNREAD_GRACE from this machine's
    wall-clock time `now`, either way of the clock: when, on this machine's clock, the grace
    ends; None where it does not hold."""
    age = now + ahead - changed
    return changed - ahead + UNREAD_GRACE if abs(age) < UNREAD_GRACE else None


def _nothing_runs(pid: int, start: int | None, child: int | None, child_start: int | None) -> bool:
    """Are a job's gpuwait and its command both gone?"""
    return not proc.is_alive(pid, start) and (
        child is None or not proc.is_alive(child, child_start)
    )


def _left_to_its_owner(
    uid: int, pid: int, start: int, child: int | None, child_start: int | None
) -> bool:
    """Is an entry of `uid`'s file that the kernel does not prove theirs to judge, not root's:
    its processes are all gone (its owner's gpuwait reaps it, recording it as lost), or it
    names a live process of theirs (a program waiting for room from Python under a process
    title of its own: taken out, it would be cancelled)? Root takes out only an entry naming
    someone else's process."""
    return _nothing_runs(pid, start, child, child_start) or (
        proc.is_alive(pid, start) and proc.owner_uid(pid) == uid
    )


def _proven_or_gone(
    uid: int,
    pid: int,
    start: int,
    state: object,
    child: int | None,
    child_start: int | None,
    command: object = None,
) -> bool:
    """An entry of another user's that root's gpuwait keeps when it tidies their file: one the
    kernel proves, or one left to its owner (`_left_to_its_owner`)."""
    return proven_entry(uid, pid, start, state, child, child_start, command) or _left_to_its_owner(
        uid, pid, start, child, child_start
    )


def _group_name(gid: int) -> str:
    import grp

    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


#: The descriptors of the ledger's lock this process has open (one a transaction, in any
#: thread): none of them is a child's to keep (`_drop_inherited_locks`).
_LOCK_FDS: set[int] = set()


def _close_lock(fd: int) -> None:
    _LOCK_FDS.discard(fd)
    os.close(fd)


def _drop_inherited_locks() -> None:
    """In a child forked while another thread of its parent held the ledger's lock, or waited
    for it (gpuwait.reserve's sampling thread, as a data loader forks its workers): the
    child's copy of the lock's descriptor would keep the lock for as long as the child lives,
    every gpuwait on the machine waiting for it, and the thread that would let it go is not in
    the child."""
    for fd in _LOCK_FDS:
        with contextlib.suppress(OSError):
            os.close(fd)
    _LOCK_FDS.clear()


os.register_at_fork(after_in_child=_drop_inherited_locks)


class LockBusy(StateError):
    """The ledger lock was held by another process for longer than this one would wait."""


class LockPastDeadline(LockBusy):
    """The ledger lock was held by another process until the deadline set (`lock_deadline`)."""


def _who(pids: list[int]) -> str:
    if not pids:
        return "another process"
    pid = pids[0]
    owner = proc.owner_uid(pid)
    return f"process {pid} (uid {owner})" if owner is not None else f"process {pid}"


def _check_crc(text: bytes) -> bytes:
    """A file written with a checksum must match it (a torn in-place write does not). Only
    ledgers written by earlier versions, in place, have one."""
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
