"""Where gpuwait trusts the file system and other users, and where it does not.

- State paths: a ledger or state directory that is a symlink, that is writable by others without
  the sticky bit, or (for a private one) that belongs to another non-root user is refused.
- State files: every one is opened without following symlinks and without waiting on it (a
  FIFO or a device in its place never hangs gpuwait), must be a plain file of whom it should
  be, and is read up to a cap (`open_readable`, `read_state_file`); files are created with
  their modes whatever the umask (`open_state_file`).
- A shared ledger directory (group- or world-writable with the sticky bit, set up by an
  administrator) holds one file of each kind per user, which every member of its group reads
  (0640, the directory's group) and only its owner writes: the sticky bit keeps members from
  deleting or replacing each other's files, and an owner replaces their own by rename. What a
  file says about its owner counts as far as the kernel proves it (`proven_entry`).
- Control of jobs: only a job's owner (or root) may cancel, pause or resume it, and only when the
  entry really names that owner's gpuwait process (`control_refusal`).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import stat
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol, TypeVar

from gpuwait.core.text import MAX_TEXTS, entry_command, shell_word, whole_number
from gpuwait.linux import dirs, proc, userns
from gpuwait.linux.outlived import looks_like_gpuwait as looks_like_gpuwait
from gpuwait.linux.proc import read_at_most

_T = TypeVar("_T")


class UnsafePath(OSError):
    """A state path gpuwait refuses to use; `strerror` says why and what to do, `what` (when
    set) what is wrong with the file, for a message that names it otherwise."""

    def __init__(self, path: Path | str, why: str, what: str = "") -> None:
        super().__init__(errno.EPERM, why, str(path))
        self.what = what or why


# --- directories -------------------------------------------------------------------------------


def _writable_by_others(mode: int) -> bool:
    return bool(mode & (stat.S_IWGRP | stat.S_IWOTH))


def check_dir(path: Path, st: os.stat_result, *, private: bool) -> None:
    """Raise UnsafePath unless `st` (an lstat of `path`) is a directory gpuwait may trust."""
    uid = os.getuid()
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(path, f"{path} is a symlink; gpuwait refuses symlinked state paths")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(path, f"{path} is not a directory")
    if st.st_uid not in (uid, 0):
        if private:
            raise UnsafePath(path, f"{path} belongs to another user (uid {st.st_uid})")
        if _writable_by_others(st.st_mode):
            # Its owner may delete or replace any file in it, the lock file included.
            raise UnsafePath(
                path,
                f"{path} belongs to uid {st.st_uid}, not to root; a shared ledger directory "
                "must be owned by root",
            )
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise UnsafePath(
            path, f"{path} is writable by every user and has no sticky bit (chmod +t or o-w)"
        )
    if not private and st.st_mode & stat.S_IWGRP and not st.st_mode & stat.S_ISVTX:
        raise UnsafePath(
            path,
            f"{path} is group-writable without the sticky bit, so any member could replace "
            "the lock file: chmod 700 it for yourself, or chmod +t to share it",
        )


def is_shared_dir(st: os.stat_result) -> bool:
    """A directory that other users may write into: the shared-ledger layout applies."""
    return _writable_by_others(st.st_mode)


def ensure_private_dir(path: Path) -> None:
    """Create `path` (and parents) so that the last component is 0700; check an existing one.

    The parents it creates are 0700 too: under a state dir, `machines` holds every machine's
    ledger directory (gpuwait.linux.netfs).

    Root makes none in a directory of another user's: that is `sudo -E gpuwait` or `su`
    keeping a user's HOME or XDG_RUNTIME_DIR, and root's 0700 directories there (a
    `~/.local` among them) would lock the user out of their own files (UnsafePath)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        _make_private_dirs(path)
        st = os.lstat(path)
    check_dir(path, st, private=True)


def own_name(
    directory: Path,
    stem: str,
    suffix: str = "",
    uid: int | None = None,
    kuid: int | None = None,
    listed: Iterable[str] | None = None,
) -> Path:
    """`directory`/`stem`.<uid>`suffix`, a user's name in a shared directory (this user's, or
    `uid`'s); where another member made something under that name first (any member may: the
    directory is theirs to write in too), one of the user's own beside it,
    `stem`.<uid>.<random>`suffix`, found again by them and by others, even once that member
    has taken theirs away (what the user keeps there stays where it is); a new such name where
    there is none yet. `kuid`: the uid the machine knows `uid` by, where another user namespace
    wrote it (a rootless container's root, whose files this one shows as its user's).
    `listed`: the names in `directory`, where the caller listed it already."""
    uid = os.getuid() if uid is None else uid
    canonical = directory / f"{stem}.{uid}{suffix}"
    try:
        if owned_by(os.lstat(canonical).st_uid, uid, kuid):
            return canonical
        taken = True
    except OSError:
        taken = False
    beside = _names_beside(directory, stem, suffix, [uid], kuid, listed).get(uid)
    if beside is not None:
        return beside
    return directory / f"{stem}.{uid}.{os.urandom(8).hex()}{suffix}" if taken else canonical


def own_names(
    directory: Path,
    stem: str,
    suffix: str,
    uids: Iterable[int],
    listed: Iterable[str] | None = None,
) -> dict[int, Path]:
    """`own_name` of each of `uids` that has a file there, by uid: the directory listed once
    for all those whose canonical name is not theirs (`own_name` would list it for each), or
    not at all where the caller did (`listed`: the names in it)."""
    found: dict[int, Path] = {}
    rest: list[int] = []
    for uid in uids:
        canonical = directory / f"{stem}.{uid}{suffix}"
        try:
            if owned_by(os.lstat(canonical).st_uid, uid):
                found[uid] = canonical
                continue
        except OSError:
            pass
        rest.append(uid)
    found.update(_names_beside(directory, stem, suffix, rest, None, listed))
    return found


def _names_beside(
    directory: Path,
    stem: str,
    suffix: str,
    uids: list[int],
    kuid: int | None,
    listed: Iterable[str] | None = None,
) -> dict[int, Path]:
    """The first of each of `uids`'s own names beside their canonical one in `directory`,
    `stem`.<uid>.<random>`suffix` (`own_name`), by uid, from one listing of it (`listed`,
    where the caller has one)."""
    if not uids:
        return {}
    if listed is None:
        try:
            listed = os.listdir(directory)
        except OSError:
            listed = []
    prefix = f"{stem}."
    names = sorted(name for name in listed if name.startswith(prefix))
    wanted = set(uids)
    chosen = choose_own_names(
        names,
        stem,
        suffix,
        lambda name, uid: uid in wanted and _owned(directory / name, uid, kuid),
    )
    return {uid: directory / name for uid, name in chosen.items()}


def choose_own_names(
    listed: Iterable[str],
    stem: str,
    suffix: str,
    theirs: Callable[[str, int], bool],
    most: int | None = None,
) -> dict[int, str]:
    """Each user's own name in a shared directory (`own_name`), by uid, among the names
    `listed` there: `stem`.<uid>`suffix`, else the first by sort order of their own beside
    it, `stem`.<uid>.<random>`suffix`, as gpuwait writes them (a uid of leading zeros names
    nobody's: gpuwait neither writes nor reads it). `theirs(name, uid)`: is the file of that
    name the user's (looked at only for a name that would be chosen, in any order of
    `listed`); `most`: the number of users after which the rest of `listed` is passed over."""
    chosen: dict[int, str] = {}
    for name in listed:
        uid = _uid_named(name, stem, suffix)
        if uid is None:
            continue
        held = chosen.get(uid)
        canonical = f"{stem}.{uid}{suffix}"
        if held is not None and (held == canonical or held < name != canonical):
            continue
        if theirs(name, uid):
            chosen[uid] = name
            if most is not None and len(chosen) >= most:
                break
    return chosen


def _uid_named(name: str, stem: str, suffix: str) -> int | None:
    """The uid whose own name `name` is (`own_name`): `stem`.<uid>`suffix` or
    `stem`.<uid>.<random>`suffix`, the uid in digits as str() writes it, the random part up to
    32 lowercase hex digits; None for any other name. Told by one match of a pattern: a member
    may make tens of thousands of names, and every listing meets each of them."""
    found = _own_name_pattern(stem, suffix).fullmatch(name)
    return None if found is None else int(found[1])


@functools.cache
def _own_name_pattern(stem: str, suffix: str) -> re.Pattern[str]:
    return re.compile(
        re.escape(stem) + r"\.(0|[1-9][0-9]{0,9})(?:\.[0-9a-f]{1,32})?" + re.escape(suffix)
    )


def _owned(path: Path, uid: int, kuid: int | None) -> bool:
    """`owned_by` of the name `path` itself (a link is not followed); False where it is gone:
    another member's name can be taken away between the listing and this look at it, and the
    names after it must still be looked at."""
    try:
        return owned_by(os.lstat(path).st_uid, uid, kuid)
    except OSError:
        return False


def owned_by(owner: int, uid: int, kuid: int | None = None) -> bool:
    """Is a file whose owner this process sees as `owner` the user `uid`'s (as the namespace
    that wrote `uid` knows them: `kuid` where it said what they are outside)? A rootless
    container's root and its user on the host are one user, each seeing the other's files as
    their own uid's."""
    return owner == uid or userns.same_user(owner, uid, kuid)


def taken_over(path: Path) -> tuple[Path, int] | None:
    """The highest directory on the way to `path`, just below one of this user's own, that
    belongs to another user (root's 0700 `~/.local`, made by a program run as root with this
    user's HOME), and its owner; None when there is none."""
    me = os.getuid()
    found = None
    for directory in (path, *path.parents):
        try:
            owner = os.lstat(directory).st_uid
        except OSError:
            continue  # inside a directory this user cannot enter
        if owner == me:
            return found
        found = (directory, owner)
    return None


def taken_over_hint(path: Path) -> str | None:
    """How to give back the directory of another user's on the way to `path` in this user's
    own (`taken_over`), in words; None when there is none."""
    taken = taken_over(path)
    if taken is None:
        return None
    directory, owner = taken
    whose = "root" if owner == 0 else f"uid {owner}"
    # A command to paste: the path quoted as the shell needs it (a home with a space in it).
    return (
        f"{directory} belongs to {whose}, not to you (a program run as {whose} with your "
        f"HOME, `sudo -E` say, made it): `sudo chown -R {proc.user_name(os.getuid())} "
        f"{shell_word(directory)}` gives it back"
    )


def _make_private_dirs(path: Path) -> None:
    missing = [path]
    while not os.path.lexists(missing[-1].parent) and missing[-1].parent != missing[-1]:
        missing.append(missing[-1].parent)
    home = dirs.home_or_none()
    if home is not None and any(str(d) == home for d in missing):
        # A home that does not exist is often one that must not (HOME=/nonexistent, a service
        # user's): made by root's gpuwait, the next program would take it for a real one.
        raise UnsafePath(
            path,
            f"your home directory {home} does not exist, and gpuwait makes none",
        )
    if os.getuid() == 0:
        inside = missing[-1].parent
        owner = os.lstat(inside).st_uid
        if owner != 0:
            raise UnsafePath(
                path,
                f"root makes no directory in {inside}, which belongs to uid {owner} (run "
                "gpuwait as that user, or sudo -H)",
            )
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            # Made 0700 (or less, by the umask) at once: made as the umask has it and only
            # then closed, it would be open for a moment to the group of a shared directory
            # it is made in (a setgid one gives it its own), where a member could put a file.
            directory.mkdir(mode=0o700)
            os.chmod(directory, 0o700)


# --- files -------------------------------------------------------------------------------------


def open_state_file(path: Path, mode: int, *, shared_gid: int | None = None) -> int:
    """An O_RDWR descriptor on `path`, created with exactly `mode` if missing.

    Symlinks are not followed, and a FIFO or device is not waited on. A file that is not a
    plain file, has other hard links, or is writable by users it should not be is refused
    (UnsafePath). In a shared directory (`shared_gid` set) the file is given the directory's
    group so every member can open it.
    """
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    for _ in range(3):
        try:
            # Open an existing file without O_CREAT first: Linux's protected_regular refuses
            # O_CREAT opens of another user's file in a sticky directory.
            fd = os.open(path, flags)
            break
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _refused(path, "is a symlink") from None
            # Said of the file, as a FIFO is: the kernel's words alone ("Is a directory", "No
            # such device or address" for a socket) name none.
            if exc.errno == errno.EISDIR:
                raise _refused(path, "is a directory, not a file") from None
            if exc.errno == errno.ENXIO:
                raise _refused(path, "is not a plain file (a FIFO, device or socket)") from None
            raise
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, mode)
            break
        except FileExistsError:
            continue  # another process created it just now: open theirs
    else:  # pragma: no cover - a file that keeps appearing and vanishing
        raise UnsafePath(path, f"{path} keeps changing; refusing to use it")
    try:
        _check_file(path, fd, mode, shared_gid)
    except BaseException:
        os.close(fd)
        raise
    return fd


#: `owners` for a file that anyone may have written (another member's, in a shared directory).
ANYONE: frozenset[int] | None = None


def mine() -> frozenset[int]:
    """`owners` for a file of this user's own: theirs, or root's (made on their behalf)."""
    return frozenset((os.getuid(), 0))


def open_readable(path: Path | str, owners: frozenset[int] | None) -> int | None:
    """A read-only descriptor on the plain file at `path`; None when there is none.

    Every state file is opened this way: a symlink is not followed, a FIFO or device is never
    waited on (O_NONBLOCK), and a file that is not a plain file or that belongs to someone
    outside `owners` (ANYONE: no check) is refused (UnsafePath), so no file anyone put there can
    hang gpuwait or make it read without end.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refused(path, "is a symlink") from None
        raise
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise _refused(path, "is a directory, not a file")
        if not stat.S_ISREG(st.st_mode):
            raise _refused(path, "is not a plain file (a FIFO, device or socket)")
        if owners is not None and st.st_uid not in owners:
            raise _refused(path, f"belongs to another user (uid {st.st_uid})")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _refused(path: Path | str, what: str) -> UnsafePath:
    return UnsafePath(path, f"{path} {what}; gpuwait refuses it", what)


def read_capped(fd: int, path: Path | str, cap: int) -> bytes:
    """The rest of `fd`, the file at `path`; UnsafePath when it is larger than `cap` bytes
    (told by its size when it is so already: nothing of it is read then)."""
    # Its size first: a file far too large is refused without a byte of it read; then no more
    # than one byte past the cap, for a file that grows meanwhile.
    if os.fstat(fd).st_size > cap or len(data := read_at_most(fd, cap)) > cap:
        raise _refused(path, f"is larger than {_bytes(cap)}")
    return data


def read_state_file(path: Path | str, cap: int, owners: frozenset[int] | None) -> bytes | None:
    """The whole plain file at `path` (see `open_readable`), at most `cap` bytes; None when
    there is none. UnsafePath says, naming the file, why one is refused."""
    fd = open_readable(path, owners)
    if fd is None:
        return None
    try:
        return read_capped(fd, path, cap)
    finally:
        os.close(fd)


def _bytes(count: int) -> str:
    return f"{count >> 20} MiB" if count >= 1 << 20 else f"{count >> 10} KiB"


def _check_file(path: Path, fd: int, mode: int, shared_gid: int | None) -> None:
    st = os.fstat(fd)
    uid = os.getuid()
    if not stat.S_ISREG(st.st_mode):
        raise _refused(path, "is not a plain file")
    if st.st_nlink != 1:
        raise UnsafePath(path, f"{path} has other hard links; refusing to use it")
    if st.st_uid == uid:
        if shared_gid is not None and st.st_gid != shared_gid:
            try:
                os.fchown(fd, -1, shared_gid)
            except PermissionError:
                raise UnsafePath(
                    path,
                    f"cannot give {path} the group of its directory (gid {shared_gid}): "
                    "you are not a member of it",
                ) from None
        if stat.S_IMODE(st.st_mode) != mode:
            # The umask filtered O_CREAT's mode, or someone loosened it: set it exactly.
            os.fchmod(fd, mode)
        return
    if shared_gid is None and uid != 0:
        raise UnsafePath(path, f"{path} belongs to another user (uid {st.st_uid})")
    if st.st_mode & stat.S_IWOTH:
        raise UnsafePath(path, f"{path} is writable by every user; its owner must chmod o-w it")


# --- processes and jobs ------------------------------------------------------------------------


class _JobLike(Protocol):
    id: str
    pid: int
    start_time: int
    uid: int
    kuid: int | None


def _owns(uid: int, job: _JobLike) -> bool:
    """Is `uid` (as this user namespace knows it) the user whose entry `job` is? One user may
    have two numbers: a rootless container's uid 0 is, outside, the user who started it."""
    return userns.same_user(uid, job.uid, job.kuid)


def entry_owner_mismatch(job: _JobLike) -> int | None:
    """The real owner of the entry's process when it is not the uid the entry claims.

    A genuine entry is written by the gpuwait process it names, so both always agree; an entry
    that names another user's process was forged. None when they agree or the owner cannot be
    told (a process hidden by /proc's hidepid).
    """
    return _owner_mismatch(job, job.pid)


def command_owner_mismatch(job: _JobLike, pid: int) -> int | None:
    """The real owner of process `pid`, named as `job`'s command, when it is not the job's
    user: another user's entry that names your process as its command was forged. None when
    they agree or the owner cannot be told (gone, or hidden by /proc's hidepid)."""
    return _owner_mismatch(job, pid)


def _owner_mismatch(job: _JobLike, pid: int) -> int | None:
    owner = proc.owner_uid(pid)
    if owner is None or _owns(owner, job):
        return None
    return owner


def _kept_as(argv: list[str] | None, command: object) -> bool:
    """Is `command`, an entry's, the command line `argv` as an entry keeps it (each argument,
    their number and what they take, cut: `entry_command`), or as another version of gpuwait
    kept it: a member's who has not upgraded yet, whose gpuwait measured what to keep
    otherwise (before an entry kept only MAX_COMMAND_BYTES of arguments, or before they were
    measured as the ledger writes them), but kept the line's first words, each whole or its
    start with "…", and said how many more there were?"""
    if argv is None or not isinstance(command, list) or not command:
        return False
    if entry_command(argv) == command:
        return True
    kept, more = len(command), 0
    count = _more_arguments(command[-1])
    if count is not None:
        kept, more = kept - 1, count
    return (
        kept + more == len(argv)
        and kept > 0
        and all(
            _word_kept(word, entry) for word, entry in zip(argv[:kept], command[:kept], strict=True)
        )
    )


def _word_kept(word: str, entry: object) -> bool:
    """Is `entry` the argument `word` as some version of gpuwait kept it: whole, or a start of
    it followed by "…"?"""
    if not isinstance(entry, str):
        return False
    return entry == word or (
        entry.endswith("…") and len(entry) <= len(word) and word.startswith(entry[:-1])
    )


def _more_arguments(last: object) -> int | None:
    """N, where `last` (an entry's command's last item) says "… N more arguments"."""
    if not isinstance(last, str) or not last.startswith("… "):
        return None
    count = last.removeprefix("… ").removesuffix(" more arguments")
    return whole_number(count) if count != last[2:] else None


def proven_entry(
    uid: int,
    pid: int,
    start_time: int,
    state: object,
    child_pid: int | None,
    child_start: int | None,
    command: object = None,
) -> bool:
    """Does the kernel show that an entry in the file of the user `uid`, naming the gpuwait
    process `pid` (started at `start_time`), stands for a job of theirs: that is a live gpuwait
    process of that user, or (its gpuwait gone, a running job) its command still runs as that
    user? Another user's entry counts only then. A waiting entry counts only where that
    gpuwait runs its `command` (`runs_command`): nothing else will ever start it. A program
    holding room from Python (gpuwait.api) is no gpuwait: its entry names it, with its command
    line as its `command`, which the kernel shows, waiting and once admitted, until the next
    transaction names it as its own command too (as an adopted process is)."""
    process = (pid, start_time)
    if (uid, *process) in _REFUTED:
        return False
    if process not in _GONE:
        if proc.is_alive(*process):
            owner = proc.owner_uid(pid)
            if owner == uid and _is_gpuwait(*process):
                # Not remembered where it runs another command: that tells of the entry.
                return state != "waiting" or runs_command(pid, command)
            if (
                owner == uid
                and (state == "waiting" or child_pid is None)
                and runs_as_kept(pid, command)
            ):
                return True  # not remembered either way: it tells of the entry, not the process
            # An adopted process (`gpuwait adopt`) is its own entry's gpuwait and command.
            if state == "running" and (child_pid, child_start) == process and owner == uid:
                return True
            if _hidden_as(pid, owner, uid):
                return True
            if owner != uid:
                # A process of the entry's user that is no gpuwait may yet be proven by what
                # the entry says (a program holding room from Python, once its entry names it
                # as its own command): only another user's is refuted for good.
                _remember(_REFUTED, (uid, *process))
            return False
        _remember(_GONE, process)
    if state != "running" or child_pid is None or child_start is None:
        return False
    if not proc.is_alive(child_pid, child_start):
        return False
    owner = proc.owner_uid(child_pid)
    return owner == uid or _hidden_as(child_pid, owner, uid)


def runs_as_kept(pid: int, command: object) -> bool:
    """Does process `pid` run with `command`, an entry's, as its command line: a program that
    holds room for itself from Python (gpuwait.api), whose entry keeps the line it was started
    with (`sys.orig_argv`, cut as an entry keeps it)?"""
    return (
        isinstance(command, list)
        and bool(command)
        and _kept_as(proc.command_line(pid, "surrogateescape"), command)
    )


def runs_command(pid: int, command: object) -> bool:
    """Does the gpuwait process `pid` run `command`, a waiting entry's (as an entry keeps it,
    cut where long): its command line ends with it, as the line of the gpuwait that waits to
    start it does? One of its user's that runs something else (their `gpuwait status --watch`)
    will never start that entry's job. A line longer than is read (`proc.command_line_read`)
    is taken as the entry's where as much of it as was read agrees."""
    read = proc.command_line_read(pid, "surrogateescape")
    if read is None or not isinstance(command, list) or not command:
        return False
    argv, whole = read
    if whole:
        # Where it ends with the command, the command begins as many words from the end as
        # the entry counts: looked at there alone, not from each word alike on (a line of a
        # hundred thousand, each compared with the rest, took every reader minutes).
        return any(
            0 <= at < len(argv) and _kept_as(argv[at:], command)
            for at in {len(argv) - words for words in _words_kept(command)}
        )
    for at, word in enumerate(argv):
        if entry_command([word]) != command[:1]:
            continue
        # Of a line read in part, the arguments read whole: the one cut off is not among them.
        kept = entry_command(argv[at : at + MAX_TEXTS + 1])
        agree = min(len(kept), len(command), MAX_TEXTS - 1)
        if kept[:agree] == command[:agree]:
            return True
    return False


def _words_kept(command: list[object]) -> tuple[int, ...]:
    """How many words of a command line an entry's `command` may stand for: as many as it
    has, or, where `entry_command` cut them (past MAX_TEXTS of them, or MAX_COMMAND_BYTES),
    as many as its last says were there."""
    more = _more_arguments(command[-1])
    return (len(command),) if more is None else (len(command), len(command) - 1 + more)


def _hidden_as(pid: int, owner: int | None, uid: int) -> bool:
    """Is `pid` a process that /proc keeps from this user (mounted with hidepid) and, as far as
    it shows an owner, `uid`'s? What cannot be read disproves nothing: taken for a forgery, a
    live job's room would be handed out while it allocates. Not remembered either way: the
    process may end at any moment, and its pid go to anyone."""
    return owner in (None, uid) and proc.hidden(pid)


#: What no later look can change, for entries that every member's gpuwait looks at in every
#: plan (a file may name a thousand processes): (uid, pid, start time) of a process that runs
#: but is no gpuwait of that user (gpuwait neither execs nor changes its user), and (pid, start
#: time) of a process that has ended.
_REFUTED: set[tuple[int, int, int]] = set()
_GONE: set[tuple[int, int]] = set()


def _remember(known: set[_T], item: _T) -> None:
    if len(known) > 4096:
        known.clear()
    known.add(item)


#: (pid, start time) -> whether that process runs gpuwait: it cannot become another program
#: without exec, and gpuwait never execs itself.
_GPUWAIT_PROCESSES: dict[tuple[int, int], bool] = {}


def _is_gpuwait(pid: int, start: int) -> bool:
    known = _GPUWAIT_PROCESSES.get((pid, start))
    if known is None:
        if len(_GPUWAIT_PROCESSES) > 4096:
            _GPUWAIT_PROCESSES.clear()
        known = _GPUWAIT_PROCESSES[(pid, start)] = looks_like_gpuwait(pid)
    return known


#: How long `runs_gpuwait`'s answer about a user stands: a look at every process of the
#: machine, asked at each read of a shared ledger where a file of theirs cannot be used.
RUNS_GPUWAIT_FOR = 1.0
#: By uid: (until when, on the monotonic clock, the answer stands; the answer).
_RUNS_GPUWAIT: dict[int, tuple[float, bool]] = {}


def runs_gpuwait(uid: int) -> bool:
    """Does a process of `uid`'s that this user can see run gpuwait? Looked at once in
    RUNS_GPUWAIT_FOR seconds, whatever the number of reads that ask. (A program holding room
    through gpuwait.reserve() names no gpuwait: its job's lock tells, gpuwait.linux.alive.)"""
    now = time.monotonic()
    known = _RUNS_GPUWAIT.get(uid)
    if known is not None and now < known[0]:
        return known[1]
    if len(_RUNS_GPUWAIT) > 4096:
        _RUNS_GPUWAIT.clear()
    found = _looks_for_gpuwait(uid)
    _RUNS_GPUWAIT[uid] = (now + RUNS_GPUWAIT_FOR, found)
    return found


def _looks_for_gpuwait(uid: int) -> bool:
    try:
        names = os.listdir("/proc")
    except OSError:
        return False
    for name in names:
        if not name.isdigit() or proc.owner_uid(int(name)) != uid:
            continue
        start = proc.start_time(int(name))
        if start is not None and _is_gpuwait(int(name), start):
            return True
    return False


def control_refusal(
    job: _JobLike, uid: int | None = None, own_process: Callable[[], bool] | None = None
) -> str | None:
    """Why the user `uid` (default: this process's) may not cancel, pause or resume `job`.

    None when they may. Root may control any job. Besides the uid written in the entry, the
    entry must name a live gpuwait process of that same user: an entry forged by another user
    (naming, say, your shell) must never make your own `cancel` signal that process. A process
    that runs no gpuwait counts where `own_process` proves it the job's own (it holds the job's
    liveness lock, gpuwait.linux.alive: a process holding room for itself, gpuwait.api).
    """
    caller = os.getuid() if uid is None else uid
    if caller != 0 and not _owns(caller, job):
        return f"job {job.id} belongs to uid {job.uid}; you can only control your own jobs"
    if not proc.is_alive(job.pid, job.start_time):
        return f"job {job.id}: its gpuwait process {job.pid} is gone"
    owner = proc.owner_uid(job.pid)
    if owner is not None and not _owns(owner, job):
        return (
            f"job {job.id} claims uid {job.uid}, but process {job.pid} belongs to uid {owner}; "
            "the entry is forged"
        )
    if caller != 0 and owner is not None and not userns.same_user(owner, caller):
        return f"job {job.id}: process {job.pid} belongs to uid {owner}, not to you"
    if not looks_like_gpuwait(job.pid) and not (own_process is not None and own_process()):
        return f"job {job.id}: process {job.pid} is not a gpuwait process; refusing to signal it"
    return None


def orphan_control_refusal(
    job: _JobLike,
    child_pid: int | None,
    child_start: int | None,
    uid: int | None = None,
    own_process: Callable[[], bool] | None = None,
) -> str | None:
    """`control_refusal` for an orphaned job, whose gpuwait is gone: the signal goes to its
    command, which must still run (same start time) as the entry's owner."""
    caller = os.getuid() if uid is None else uid
    if caller != 0 and not _owns(caller, job):
        return f"job {job.id} belongs to uid {job.uid}; you can only control your own jobs"
    return orphan_command_problem(job, child_pid, child_start, own_process)


def orphan_command_problem(
    job: _JobLike,
    child_pid: int | None,
    child_start: int | None,
    own_process: Callable[[], bool] | None = None,
) -> str | None:
    """Why the command an entry names is not running as the entry's owner (gone, its pid
    reused, or another user's process: a forged entry); None when it is.

    `own_process` proves the command the job's own where its environment no longer tells (it
    holds the job's liveness lock, gpuwait.linux.alive): a program that wrote over its
    environment's memory (setproctitle with a long title, as vLLM and Ray do) or exec'd with
    another environment (`env -i`) in the process gpuwait started."""
    if child_pid is None or child_start is None or not proc.is_alive(child_pid, child_start):
        return f"job {job.id}: its command is gone"
    owner = proc.owner_uid(child_pid)
    if owner is not None and not _owns(owner, job):
        return f"job {job.id}: process {child_pid} belongs to uid {owner}; the entry is forged"
    # Its owner (and root) can tell whether gpuwait started it: every command gets its job's id.
    # Another user cannot read it and takes the pid and start time on trust.
    started_as = proc.environ_value(child_pid, b"GPUWAIT_JOB_ID")
    if started_as == "" and own_process is not None and own_process():
        return None
    if started_as is not None and started_as != job.id:
        return f"job {job.id}: process {child_pid} is not its command; the entry is forged"
    return None
