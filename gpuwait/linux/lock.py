"""Exclusive locks between processes, on a sidecar lock file.

flock(2) is what a locking library would call on Linux (and gpuwait is Linux-only: it reads
/proc). Calling it directly keeps a launch fast: portalocker reads its package metadata when
imported, which alone costs tens of milliseconds, most of a launch's budget. The kernel releases
the lock when the holder dies, even by SIGKILL, so a crashed gpuwait never leaves it held.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from gpuwait.linux import proc
from gpuwait.linux.security import open_state_file
from gpuwait.linux.signals import (
    STOPPING,
    SignalPending,
    hold_stops,
    raise_if_pending,
    resume_stops,
)

#: How long a wait for a lock goes on with a signal waiting for gpuwait, in seconds from when
#: it first saw one: `stop` for one that asks it to end (TERM, INT, HUP, QUIT), `other` for the
#: rest of those it passes on to its command (USR1, ALRM ...). A float is both. Its fields are
#: given as types, not as a class's annotations: those are strings here, which typing compiles,
#: and the first compile() of a process sets up its whole syntax tree module (0.9 ms).
Patience = NamedTuple("Patience", [("stop", float), ("other", float)])  # noqa: UP014


@contextmanager
def exclusive(
    path: Path, mode: int = 0o600, timeout: float | None = None, patience: float | Patience = 0.0
) -> Iterator[int]:
    """Hold an exclusive lock on `path` (created with `mode`) for the block; yield its fd.

    The lock file is opened as any state file (no symlink followed, nothing but a plain file of
    this user's). Waits at most `timeout` seconds (LockTimeout), and gives up when a signal has
    waited for gpuwait `patience` seconds (SignalPending; 0: at once).
    """
    # os.open descriptors are not inherited by the commands gpuwait starts, so a child can never
    # end up holding the lock.
    fd = open_state_file(path, mode)
    previous = None
    try:
        flock_within(fd, fcntl.LOCK_EX, timeout, patience)
        previous = hold_stops()
        yield fd
    finally:
        os.close(fd)
        if previous is not None:
            resume_stops(previous)  # once the lock is free: Ctrl-Z meanwhile stops us now


class LockTimeout(Exception):
    """The lock was not granted within the time allowed."""


class _Tick(Exception):
    """The interval timer's signal, raised out of a blocking flock to look around."""


#: How often a blocked wait for a lock looks for a signal waiting for gpuwait.
TICK = 0.1


#: How long a wait for a lock goes on before `slow` may tell: far longer than a transaction,
#: which takes milliseconds (and under a stampede of launches on a busy machine up to a second).
#: `slow` looks every half of it, from half of it on, until it has told.
SLOW_AFTER = 2.0


def flock_within(
    fd: int,
    operation: int,
    timeout: float | None,
    patience: float | Patience = 0.0,
    slow: Callable[[], bool] | None = None,
) -> None:
    """flock(fd, operation), waiting at most `timeout` seconds (None: as long as it takes), as
    `lock_within` waits."""

    def take(block: bool) -> None:
        fcntl.flock(fd, operation if block else operation | fcntl.LOCK_NB)

    lock_within(take, timeout, patience, slow)


def lock_within(
    take: Callable[[bool], None],
    timeout: float | None,
    patience: float | Patience = 0.0,
    slow: Callable[[], bool] | None = None,
) -> None:
    """Take a lock by calling `take(block)`, waiting at most `timeout` seconds (None: as long as
    it takes). `take(False)` must raise BlockingIOError when the lock is held; `take(True)`
    waits for it. `slow` is called every SLOW_AFTER / 2 seconds of waiting, the first time once
    the wait has lasted that long, until it returns True (it has told whoever waits why, and
    for whom, long before the timeout): a lock held by one process all along is worth a word,
    one passed from hand to hand among a hundred launches is not.

    A lock that another process holds forever (hung, stopped, or hostile) must not hang every
    gpuwait behind it, nor keep TERM or Ctrl-C from ending one: the signals gpuwait handles are
    blocked (they queue for its loop), so they would not interrupt the wait by themselves. The
    uncontended case costs one non-blocking call; a contended wait sleeps in the kernel (woken
    the moment the lock is free) in slices of TICK under an interval timer, looking for a
    pending signal between slices (SignalPending) once it has waited `patience` seconds, counted
    from when the wait first saw it (a wait may begin long before the signal comes), a signal
    asking gpuwait to end as long as `Patience.stop`, another `Patience.other`. Threads
    other than the main one, which cannot take signals, poll instead.
    """
    try:
        take(False)
        return
    except BlockingIOError:
        pass
    import threading

    if threading.current_thread() is not threading.main_thread():
        _poll(take, timeout, slow)
        return
    import time

    started = time.monotonic()
    deadline = None if timeout is None else started + timeout
    looks = _Looks(slow, started)
    signalled = _Signalled(patience)
    while not _wait_under_timer(take, deadline, signalled, looks):
        # A SIGALRM that was not the wait's own has just been delivered to the caller's handler
        # (its own timer fell due, or one was sent): the handler returned, so the wait goes on.
        pass


def _wait_under_timer(
    take: Callable[[bool], None],
    deadline: float | None,
    signalled: _Signalled,
    looks: _Looks,
) -> bool:
    """`lock_within`'s wait in the main thread: True once the lock is taken; False where a
    SIGALRM that is not the wait's own came and the caller takes SIGALRM with a handler (or
    dies of it): it has been delivered, as it would have been had no lock been waited for.

    The wait's timer is the process's one real-time interval timer, which the caller may be
    using (`signal.alarm` in a program that uses the Python API, pytest-timeout): its time is
    kept and the timer given back as it would have run, and its signal delivered when it falls
    due. A SIGALRM that comes while the wait's timer still runs was sent by someone else
    (`kill -ALRM` at gpuwait, which passes it on to its command, or a thread of the program's);
    so is one sent between two slices, kept out until the next one. Where the caller holds SIGALRM
    blocked (gpuwait's own loop takes it from there) such a signal is put back pending once the
    wait ends, and ends it like any other signal waiting for gpuwait (SignalPending)."""
    import signal
    import time

    in_take = False
    foreign = False
    #: Whether this slice's timer has rung, its tick handled.
    rang = False

    def tick(signum: int, frame: object) -> None:
        nonlocal foreign, rang
        # Ours when our timer is spent (it ran out just now).
        if signal.getitimer(signal.ITIMER_REAL)[0] > 0:
            foreign = True
        else:
            rang = True
        if in_take:
            raise _Tick

    # SIGALRM is let in during a slice only, while the wait's timer runs: between two slices
    # the timer is stopped, and one let in then would pass for the wait's own tick.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    try:
        held = signal.SIGALRM in mask
        callers = signal.getitimer(signal.ITIMER_REAL)
        # Due that long from now: the wait may have begun long before (this is its next turn,
        # a tick of the caller's own just handled), and the timer counts down from now.
        caller_due = time.monotonic() + callers[0] if callers[0] > 0 else None
        previous = signal.signal(signal.SIGALRM, tick)
    except BaseException:
        # A handler of the caller's that raised just now (its alarm's, a Ctrl-C) ends the
        # wait: SIGALRM must not stay blocked in the caller, its later alarms never rung.
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        raise
    try:
        while True:
            # One waiting, shut out, is not the wait's own (a tick that fell due as its slice
            # ended is taken there): sent between two slices, or before the wait began and
            # left blocked for gpuwait's loop. Taken here, it is put back when the wait ends.
            if signal.sigtimedwait({signal.SIGALRM}, 0) is not None:
                foreign = True
            now = time.monotonic()
            if caller_due is not None and now >= caller_due:
                foreign = True
                caller_due = caller_due + callers[1] if callers[1] > 0 else None
            if foreign and not held:
                return False
            try:
                raise_if_pending()  # one asking gpuwait to end first (`FORWARDED`)
                if foreign:
                    raise SignalPending(signal.SIGALRM)
            except SignalPending as exc:
                if signalled.waited_out(now, exc.signum):
                    raise
            looks.at(now)
            step = TICK
            if deadline is not None:
                step = min(step, deadline - time.monotonic())
                if step <= 0:
                    raise LockTimeout
            if caller_due is not None:
                step = max(0.001, min(step, caller_due - time.monotonic()))
            try:
                in_take, rang = True, False
                signal.setitimer(signal.ITIMER_REAL, step)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})
                take(True)
            except _Tick:
                # Also when the timer fired just after the lock was granted: asking again for
                # a lock this process holds returns at once.
                continue
            finally:
                in_take = False
                # A tick run here, as SIGALRM is shut out again, is judged with the timer as
                # it stands, and raises nothing.
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
                if signal.setitimer(signal.ITIMER_REAL, 0)[0] == 0 and not rang:
                    # The timer fell due only now, SIGALRM shut out: its tick waits, and is
                    # taken here (one sent meanwhile merged with it, as two SIGALRMs do).
                    signal.sigtimedwait({signal.SIGALRM}, 0)
            return True
    finally:
        # A tick whose handler Python runs only now (it looks for signals before it replaces
        # a handler) finds in_take False and is dropped: there is nothing left to interrupt.
        signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if caller_due is not None:
            signal.setitimer(
                signal.ITIMER_REAL, max(1e-6, caller_due - time.monotonic()), callers[1]
            )
        if foreign:
            os.kill(os.getpid(), signal.SIGALRM)


def _poll(
    take: Callable[[bool], None], timeout: float | None, slow: Callable[[], bool] | None
) -> None:
    import time

    started = time.monotonic()
    deadline = None if timeout is None else started + timeout
    looks = _Looks(slow, started)
    delay = 0.001
    while True:
        try:
            take(False)
            return
        except BlockingIOError:
            looks.at(time.monotonic())
            remaining = TICK if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                raise LockTimeout from None
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 0.05)


class _Signalled:
    """How long a wait for a lock goes on with a signal pending: `patience` seconds from when
    it first saw one of its kind (`Patience`)."""

    def __init__(self, patience: float | Patience) -> None:
        #: Each kind counted from its own first signal; a float, from the first of any.
        self.apart = isinstance(patience, Patience)
        self.patience = patience if isinstance(patience, Patience) else Patience(patience, patience)
        #: When the wait first saw a signal asking gpuwait to end, and one of the others.
        self.since: dict[bool, float] = {}

    def waited_out(self, now: float, signum: int) -> bool:
        stop = signum in STOPPING
        since = self.since.setdefault(stop if self.apart else True, now)
        return now - since >= (self.patience.stop if stop else self.patience.other)


class _Looks:
    """Calls `slow` every SLOW_AFTER / 2 seconds of a wait begun at `started`, the first time
    once it has lasted that long, until `slow` returns True (it has told)."""

    def __init__(self, slow: Callable[[], bool] | None, started: float) -> None:
        self.slow = slow
        self.next = started + SLOW_AFTER / 2

    def at(self, now: float) -> None:
        if self.slow is not None and now >= self.next:
            self.next = now + SLOW_AFTER / 2
            if self.slow():
                self.slow = None


def holders(fd: int) -> list[int]:
    """The pids that hold a flock on `fd`'s file, as /proc/locks tells (those waiting for it
    excluded); empty when it cannot be told."""
    file = (proc.lock_device(fd), os.fstat(fd).st_ino)
    return holders_of([file]).get(file, [])


def holders_of(files: list[tuple[int, int]]) -> dict[tuple[int, int], list[int]]:
    """`holders` of each of these files (device, as `proc.lock_device` tells it, and inode),
    read from /proc/locks once: those held by nobody (or where it cannot be told) are left
    out."""
    wanted = {
        b"%02x:%02x:%d" % (os.major(device), os.minor(device), inode): (device, inode)
        for device, inode in files
    }
    found: dict[tuple[int, int], list[int]] = {}
    if not wanted:
        return found
    for pid, _, file in flocks():
        if file in wanted:
            found.setdefault(wanted[file], []).append(pid)
    return found


def flocks() -> Iterator[tuple[int, bytes, bytes]]:
    """Each flock held (not waited for) as /proc/locks lists it: the pid of the process that
    took it (0 where that one is not seen from here: another pid namespace's), its kind
    (b"READ", shared, or b"WRITE", exclusive) and its file (b"major:minor:inode", in hex,
    hex and decimal)."""
    for line in proc.proc_locks():
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"; waiters have "->" after the number.
        if len(fields) >= 6 and fields[1] == b"FLOCK" and fields[4].isdigit():
            yield int(fields[4]), fields[3], fields[5]
