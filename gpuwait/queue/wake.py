"""What waiters watch instead of the ledger: a small summary, rewritten with every ledger change.

With a hundred waiters, having each of them read and re-plan the whole ledger whenever it
changes costs more than the jobs' own work on a small machine. So every ledger transaction that
changes the file also writes `wake.json` beside it (under the same lock, atomically):

    {"schema": 1, "release": 41, "running": ["id", ...], "waiting": ["id", ...]}

(in a shared ledger directory, or with several users' entries, also "owned": ["id@uid", ...],
each entry by its owner).

`waiting` is in queue order. `release` counts the transactions that freed room: an entry left
(finished, cancelled, reaped), a running job's reservation shrank, the queue's head let go of a
GPU it held, or an entry lost with a damaged ledger was put back (waiters were held for it). A
waiter reads only this file when woken and acts on what concerns it:
- its id is in `running`: a plan admitted it (any planner admits every waiter that fits);
- it is first in `waiting` and `release` moved: it plans, for everybody;
- its id is in neither: it was cancelled (or the ledger was recovered), so it looks closer;
- a dependency of it is in neither (another member's, `ID@UID`: not in `owned`): it settles
  its dependencies.
Everything else waits for the waiter's periodic re-read of the GPUs, which is shared too: a
waiter skips its own when any waiter planned less than an interval ago (`plan.stamp`'s mtime).
If the first waiter does not plan after a release within a moment (it may be suspended), the
second one does; so it does where the first is stopped, though a plan was noted as late as the
release (one noted in the release's tick may have been made before it, one noted after it may
have read the queue before it).

In a shared ledger directory each user writes a summary of their own, `wake.<uid>.json` (the
whole queue as their transaction left it), which nobody else can replace or remove (the sticky
bit): a member who breaks their own summary, or writes lies in it, costs the others no wake-up
that the other members' summaries give. A waiter reads one summary per user (more files of a
member's own are passed over), acts on each that changed, and on one user's at most every
SOURCE_GAP seconds, so that no member can make every waiter plan at the rate they write files;
one that is not a summary is passed over (the waiters' timers remain).

How a waiter learns that a summary changed: in a shared ledger directory, by watching the
directory (inotify), its wake-ups taken at most every SOURCE_GAP seconds and searched for the
names of summaries alone (`EVENT_NAMES`): any member can rename files there in a loop. In a
private one every writer is the same user, so the transaction itself signals (SIGCHLD: harmless
to any process, and blocked by gpuwait from its start, so never lost) only the waiters a change
concerns - those it admitted, removed, or whose dependency left, and after a release the first
two in line - once the lock is let go (`concerned`). A watch would wake every waiter on every
write, and with a hundred of them those wake-ups alone starve the process that is trying to
release its room. A waiter so woken reads the summary whatever its metadata says
(`Summaries.written`): replaced twice within one tick of a coarse file system clock, its inode
reused, it can look unchanged. Polling (`wake = poll`) goes by the metadata alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from gpuwait.core.record import Record
from gpuwait.linux.atomic import holds, write_atomic
from gpuwait.linux.security import (
    ANYONE,
    choose_own_names,
    is_shared_dir,
    own_name,
    own_names,
    read_state_file,
)
from gpuwait.linux.stamp import (
    RACY_SECONDS,
    FileStamp,
    NotTheirs,
    file_stamp,
    may_change_unseen,
    stamp_of,
)
from gpuwait.queue.entries import RUNNING, Job, elsewhere, plain_id

SCHEMA = 1
FILENAME = "wake.json"
#: A summary names every entry's id once: far below this for any ledger gpuwait reads.
MAX_SUMMARY_BYTES = 4 << 20
STAMP = "plan.stamp"
#: In a shared ledger directory: one user's summary makes a waiter act at most this often.
SOURCE_GAP = 0.05
#: A summary's name (wake.json, or any user's) as inotify's events hold it, after the NUL that
#: ends its event's length and padded with NULs; and what every such name has in it.
EVENT_NAMES = (
    b"wake",
    re.compile(rb"\0(wake(?:\.[0-9]{1,10}(?:\.[0-9a-f]{1,32})?)?\.json)\0"),
)
#: In a shared ledger directory: one user's summary is acted on again no sooner than this many
#: times the CPU time its last reading took in the thread that read it (SOURCE_GAP at least).
READ_COST_SPACING = 10.0
#: Users whose summaries are looked at, at most (one per user who ever used the directory).
MAX_SUMMARIES = 4096

Fingerprint = Mapping[str, tuple[str, int, tuple[str, ...]]]


def fingerprint(jobs: Iterable[Job]) -> Fingerprint:
    """What about each entry decides whether room was freed."""
    return {j.id: (j.state, j.reserved_bytes, tuple(j.held_gpus)) for j in jobs}


def released(before: Fingerprint, after: Fingerprint) -> bool:
    """True when `after` may offer room that `before` did not."""
    for job_id, (state, reserved, held) in before.items():
        now = after.get(job_id)
        if now is None:
            return True
        if state == RUNNING and (now[0] != RUNNING or now[1] < reserved):
            return True
        if held and not set(held) <= set(now[2]):
            return True
    return False


def concerned(
    before: Mapping[str, tuple[str, int]],
    jobs: Iterable[Job],
    gone_quietly: frozenset[str],
    release: bool,
) -> set[int]:
    """The processes to signal after a transaction turned `before` ({id: (state, pid)}) into
    `jobs`: those it admitted, those it removed (cancelled) unless `gone_quietly` (dead or
    forged), waiters whose dependency left, and after a `release` the first two waiters."""
    all_entries = list(jobs)
    live = {j.id for j in all_entries}
    # Entries of other pid namespaces name no process of this one: they watch the summary.
    entries = [j for j in all_entries if not elsewhere(j)]
    left = {i for i in before if i not in live}
    pids = {pid for i, (_, pid) in before.items() if i in left and i not in gone_quietly}
    for j in entries:
        was = before.get(j.id)
        admitted = j.state == RUNNING and was is not None and was[0] != RUNNING
        unblocked = j.state != RUNNING and bool(left.intersection((*j.after, *j.after_ok)))
        if admitted or unblocked:
            pids.add(j.pid)
    if release:
        waiting = sorted(
            (j for j in entries if j.state != RUNNING), key=lambda j: (-j.priority, j.order)
        )
        pids.update(j.pid for j in waiting[:2])
    pids.discard(os.getpid())
    return pids


def kick(pids: Iterable[int]) -> None:
    """Wake these waiters (SIGCHLD ends their sleep; its default action is to do nothing)."""
    for pid in pids:
        with contextlib.suppress(OSError):  # gone meanwhile, or another user's (shared dir)
            os.kill(pid, signal.SIGCHLD)


def summary(
    jobs: Iterable[Job], release: int, starting: Iterable[str] = (), shared: bool = False
) -> dict[str, Any]:
    """`starting`: other users' waiters the writer's plan starts; listed as running, so that
    their own gpuwait looks (and, finding itself still waiting, plans and starts). A shared
    ledger's queue (`shared`), or one of several users' entries, lists each also by its owner,
    `ID@UID` (`owned`), as a dependency on another member's job is kept: the ids the writer's
    view shows say not whose (a plain one may be a third member's job with the same id, and
    a queue of one member's entries may be another's than the writer's)."""
    entries = list(jobs)
    starts = set(starting)
    waiting = sorted(
        (j for j in entries if j.state != RUNNING and j.id not in starts),
        key=lambda j: (-j.priority, j.order),
    )
    content: dict[str, Any] = {
        "schema": SCHEMA,
        "release": release,
        "running": [j.id for j in entries if j.state == RUNNING or j.id in starts],
        "waiting": [j.id for j in waiting],
    }
    if shared or len({j.uid for j in entries}) > 1:
        content["owned"] = [f"{plain_id(j.id)}@{j.uid}" for j in entries]
    return content


def write_summary(
    state_dir: Path,
    content: dict[str, Any],
    shared_gid: int | None,
    listed: Iterable[str] | None = None,
) -> None:
    """Replace this user's summary with `content` (`summary()`), unless it holds that already:
    wake.json, or in a shared ledger directory (`shared_gid` set) wake.<uid>.json, the user's
    own, 0640 and the directory's group. No fsync: it is derived from the ledger and rewritten
    constantly; it is replaced by rename, so a reader never sees half of one. `listed`: the
    names in `state_dir`, where the caller listed it already."""
    path = summary_path(state_dir, shared_gid is not None, listed)
    body = json.dumps(content, separators=(",", ":")).encode()
    # Waiters act on the summary's content alone, and most changes (a job's new sample, a
    # waiter's reason) leave it as it was: rewriting it then would cost a rename (and wake
    # every watching waiter) for nothing.
    if holds(path, body):
        return
    # Waiters whose summary is missing fall back to reading the GPUs on their timer.
    with contextlib.suppress(OSError):
        write_atomic(path, body, 0o600 if shared_gid is None else 0o640, shared_gid, sync=False)


def summary_path(state_dir: Path, shared: bool, listed: Iterable[str] | None = None) -> Path:
    """The summary this user writes: wake.json, or in a shared directory wake.<uid>.json; where
    another member made a file under that name first, one of the user's own beside it,
    wake.<uid>.<random>.json (found again by its owner). `listed`: the names in `state_dir`,
    where the caller listed it already."""
    if not shared:
        return state_dir / FILENAME
    return own_name(state_dir, "wake", ".json", listed=listed)


class Summary(Record, frozen=True):
    release: int
    running: frozenset[str]
    waiting: tuple[str, ...]
    #: The file it was read from, and that file's modification time (ns).
    source: str = FILENAME
    written_ns: int = 0
    #: Every entry as `ID@UID` (a shared ledger's summary); None from an older gpuwait.
    owned: frozenset[str] | None = None

    def shows(self, job_id: str, uid: int) -> str | None:
        """The id this summary shows the job `job_id` of the user `uid` by (its own plain id,
        kept in its owner's file), or None where it shows it nowhere. Another member's view
        shows it as `ID@UID` where a job of theirs has that id too, waiting, running or ended
        (in their book); the plain id is then theirs, not this one. A summary that lists no
        owners (an older gpuwait's, or one of a single user's entries) shows it by its plain
        id, if at all."""
        listed = self.running.union(self.waiting)
        owned = f"{job_id}@{uid}"
        if owned in listed:
            return owned
        if job_id not in listed:
            return None
        return job_id if self.owned is None or owned in self.owned else None

    def lacks_any(self, dependencies: Iterable[str]) -> bool:
        """Does the queue this summary shows lack one of these jobs (it ended, or was taken
        out), so that a job waiting for them must look closer? A dependency on another
        member's job is kept as `ID@UID`, which the summary's writer lists by the id its own
        view shows: the plain one, or `ID@UID` where another member's job has that id too. So
        the plain one may be a third member's job with that id: where the summary lists its
        entries by owner too (`owned`), the dependency is looked for there."""
        listed = self.running.union(self.waiting)
        for dependency in dependencies:
            if dependency in listed:
                continue
            if "@" in dependency and self.owned is not None:
                if dependency not in self.owned:
                    return True
            elif plain_id(dependency) not in listed:
                return True
        return False


class Summaries:
    """The summaries a waiter reads: wake.json, or in a shared ledger directory each user's."""

    def __init__(self, state_dir: Path, shared: bool) -> None:
        self.state_dir = state_dir
        self.shared = shared
        self._tokens: dict[str, FileStamp | None] = {}
        #: Monotonic time before which a user's summary is not acted on again (shared).
        self._quiet_until: dict[str, float] = {}
        #: What each summary held when last read, and the summaries said to have been written
        #: since (`written`) that are still to be read.
        self._seen: dict[str, Summary | None] = {}
        self._told: set[str] = set()
        #: Names in a shared directory found to be no summary of the uid they name.
        self._not_theirs = NotTheirs()

    def written(self, names: Iterable[str] | None = None) -> None:
        """A wake-up (the writer's signal, inotify's events) said that these summaries were
        written (None: any may have been): the next `changed` reads them whatever their
        metadata says, and counts each as changed if what it holds did.

        Metadata alone can miss a change: a summary replaced twice within one tick of a coarse
        file system clock, the inode of the first reused by the last (as ext4 does), the two of
        one size, looks as it was."""
        self._told.update(self._current_tokens() if names is None else names)

    def changed(self, now: float) -> tuple[list[Summary | None], float | None]:
        """The summaries that changed since the last call (None: one that changed into no
        summary, in a private ledger, where it is this user's own: then plan to be safe), and
        when to look again for one held back by SOURCE_GAP (None: none was)."""
        found: list[Summary | None] = []
        later: float | None = None
        current = self._current_tokens()
        self._told.intersection_update(current)
        for name, token in current.items():
            same = token == self._tokens.get(name, ())
            if same and name not in self._told:
                continue
            if self.shared and token is None:
                self._tokens[name] = token  # another user's name on it: nobody's summary
                continue
            if self.shared:
                quiet = self._quiet_until.get(name, 0.0)
                if now < quiet:
                    later = quiet if later is None else min(later, quiet)
                    continue  # its token stays unseen: looked at again then
            self._tokens[name] = token
            self._told.discard(name)
            began = time.thread_time()
            seen = read_summary(self.state_dir / name, token)
            if self.shared:
                # Its next change is acted on once its reading has cost at most a tenth of
                # the time: one of megabytes, rewritten in a loop, would keep every waiter
                # of every member parsing it.
                cost = time.thread_time() - began
                self._quiet_until[name] = now + max(SOURCE_GAP, READ_COST_SPACING * cost)
            if same and seen == self._seen.get(name, ()):
                continue  # written again, as it was
            self._seen[name] = seen
            if seen is not None or not self.shared:
                found.append(seen)
        return found, later

    def current(self) -> list[Summary]:
        """Every summary as it stands (what a plan just made has seen)."""
        found = []
        now = time.monotonic()
        for name, token in self._current_tokens().items():
            if self.shared and now < self._quiet_until.get(name, 0.0) and name in self._seen:
                # Read a moment ago, and not to be read again so soon (`changed`): as it was
                # then. A release since is seen later, as one after this plan.
                seen = self._seen[name]
            else:
                seen = None if token is None else read_summary(self.state_dir / name, token)
            if seen is not None:
                found.append(seen)
        return found

    def _current_tokens(self) -> dict[str, FileStamp | None]:
        if not self.shared:
            return {FILENAME: file_stamp(self.state_dir / FILENAME, follow=False)}
        self._not_theirs.begin(self.state_dir)
        kept = self._not_theirs.listed
        if kept is not None:
            # The same names as at the last look, each of the same file: their stamps alone
            # are taken again.
            tokens: dict[str, FileStamp | None] = {}
            for name, uid in kept:
                token = file_stamp(self.state_dir / name, follow=False, owner=uid)
                if token is not None:
                    tokens[name] = token
            return tokens
        try:
            with os.scandir(self.state_dir) as listing:
                items = list(listing)
        except OSError:
            return {}
        # One summary per user, as one ledger file per user: theirs under their canonical
        # name, else the first of their own beside it (where another member squatted that
        # name). More files of theirs would be more wake-ups for everyone, one per file.
        # Counted by the users found, not by the names: any member can make names for uids
        # that are nobody's (or another's), and those counted would hide the real ones listed
        # after them, whose waiters would then be woken by no summary of theirs.
        # Each name looked at by its directory entry, no path built for it, and not again while
        # the directory is as it was: a member may make thousands for uids not theirs.
        listed = {item.name: item for item in items}
        stamps: dict[str, FileStamp] = {}
        whole = True

        def theirs(name: str, uid: int) -> bool:
            nonlocal whole
            if name in self._not_theirs:
                return False
            try:
                st = listed[name].stat(follow_symlinks=False)
            except OSError:
                whole = False  # gone, or not to be looked at now: looked at again next time
                return False
            if st.st_uid != uid:  # another user's file under this uid's name
                self._not_theirs.add(name)
                return False
            stamps[name] = stamp_of(st)
            return True

        # In sort order, as the ledger's: each user's first name of their own is the one
        # taken, and the names of theirs after it are passed over unlooked at. In the
        # directory's order, each of theirs sorting before the one taken so far was looked at.
        chosen = choose_own_names(sorted(listed), "wake", ".json", theirs, MAX_SUMMARIES)
        if whole:
            self._not_theirs.keep([(name, uid) for uid, name in chosen.items()])
        return {name: stamps[name] for name in chosen.values()}


def runs_a_job_of(
    state_dir: Path, uids: Iterable[int], listed: Iterable[str] | None = None
) -> set[int]:
    """Those of `uids` the summary each wrote last in the shared ledger directory `state_dir`
    (theirs, wake.<uid>.json, or theirs beside it where another member took that name; the
    directory listed once for them all) lists a job of theirs running. The word of a gpuwait
    older than the lock its jobs hold on their lock directory
    (gpuwait.linux.alive.jobs_run), a program's holding room through its gpuwait.reserve()
    among them, whose command line names no gpuwait: such a job's end is written there by its
    gpuwait, as any change of their queue is. `listed`: the names in `state_dir`, where the
    caller listed it already."""
    return {
        uid
        for uid, path in own_names(state_dir, "wake", ".json", uids, listed).items()
        if _runs_a_job(path, uid)
    }


def _runs_a_job(path: Path, uid: int) -> bool:
    """Does `uid`'s summary at `path` list a job of theirs running (`runs_a_job_of`)?"""
    # Read again only where it may have changed: one of megabytes, asked of at each read of
    # the ledger within UNREAD_GRACE of the directory's last change (on a busy server,
    # always), would cost every waiter its parsing each second.
    stamp, now = file_stamp(path, follow=False, owner=uid), time.monotonic()
    known = _RUNS_A_JOB.get(path)
    if stamp is None or known is None or known[0] != stamp:
        known = (stamp, now, None)  # first seen as it is now
    elif known[2] is not None:
        return known[2]
    found = _lists_a_job_of(path, uid)
    # Kept only once its stamp has stood for RACY_SECONDS, by its clock and by this one's: a
    # change within one tick of a coarse clock may leave the same stamp.
    steady = stamp is not None and now - known[1] >= RACY_SECONDS and not may_change_unseen(stamp)
    if len(_RUNS_A_JOB) > MAX_SUMMARIES:
        _RUNS_A_JOB.clear()
    _RUNS_A_JOB[path] = (known[0], known[1], found if steady else None)
    return found


#: By summary: (its stamp, when, on the monotonic clock, this process first saw it so, and
#: `_runs_a_job`'s answer, where kept).
_RUNS_A_JOB: dict[Path, tuple[FileStamp | None, float, bool | None]] = {}


def _lists_a_job_of(path: Path, uid: int) -> bool:
    """Does the summary at `path` list a job of `uid`'s running (`runs_a_job_of`)?"""
    found = read_summary(path, owners=frozenset({uid}))
    if found is None:
        return False
    if found.owned is None:  # an older gpuwait's summary of a queue of one user's entries
        return bool(found.running)
    return any(
        job.endswith(f"@{uid}") or ("@" not in job and f"{job}@{uid}" in found.owned)
        for job in found.running
    )


def read_summary(
    path: Path, token: FileStamp | None = None, owners: frozenset[int] | None = ANYONE
) -> Summary | None:
    """The summary in `path`, or None when it is missing or not one (then the caller plans to
    be safe, or, for another user's, passes it over); `owners`: whose it must be."""
    # In a shared directory a summary is its writer's: never followed as a link, never waited
    # on as a FIFO, and never read past what a summary can be.
    try:
        text = read_state_file(path, MAX_SUMMARY_BYTES, owners)
        raw = None if text is None else json.loads(text)
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(raw, dict) or raw.get("schema") != SCHEMA:
        return None
    release, running, waiting = raw.get("release"), raw.get("running"), raw.get("waiting")
    if (
        not isinstance(release, int)
        or not isinstance(running, list)
        or not isinstance(waiting, list)
        or not all(isinstance(i, str) for i in [*running, *waiting])
    ):
        return None
    written = 0 if token is None else token.mtime_ns
    owned = raw.get("owned")
    # Not listed, or not as a list of ids: the ids it shows alone are gone by, as an older
    # gpuwait's summary is.
    by_owner = (
        frozenset(owned)
        if isinstance(owned, list) and all(isinstance(i, str) for i in owned)
        else None
    )
    return Summary(release, frozenset(running), tuple(waiting), path.name, written, by_owner)


def note_planned(state_dir: Path) -> None:
    """Say that the GPUs were just read and the queue planned (plan.stamp's mtime)."""
    path = state_dir / STAMP
    with contextlib.suppress(OSError):
        if os.path.lexists(path):
            os.utime(path, follow_symlinks=False)
            return
        # In a shared ledger directory every member's waiters touch it: the group's, 0660.
        mode = 0o660 if is_shared_dir(os.lstat(state_dir)) else 0o600
        # Made only where nothing is yet, and never waited on: another member may have put a
        # FIFO there since it was looked for, whose open would wait for a reader for ever.
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fd = os.open(path, flags, mode)
        try:
            os.fchmod(fd, mode)  # whatever the umask
        finally:
            os.close(fd)


def planned_since(state_dir: Path, moment_ns: int) -> bool:
    """Has any waiter planned since `moment_ns` (Unix time in nanoseconds, as file times are)?

    A stamp dated ahead of the clock says no: any member may set the time of a shared one, and
    one set far ahead would otherwise make every waiter skip its readings of the GPUs."""
    try:
        stamped = os.stat(state_dir / STAMP).st_mtime_ns
    except OSError:
        return False
    return moment_ns <= stamped <= time.time_ns() + 1_000_000_000
