"""`lock_within`'s waiting loop against a tick of its own timer that lands as the lock comes, and
against SIGALRMs that are not its own."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.waiting import wait_for

from gpuwait.linux.lock import LockTimeout, Patience, flock_within, lock_within
from gpuwait.linux.signals import SignalPending


def _alarms_to_the_caller(monkeypatch: pytest.MonkeyPatch, setitimer: Any, take: Any) -> list[int]:
    """Wait for a lock with `take`, the timer set through `setitimer` (the real one, made to
    act at a chosen moment); the SIGALRMs the caller's own handler had meanwhile."""
    rang: list[int] = []
    before = signal.signal(signal.SIGALRM, lambda signum, frame: rang.append(signum))
    try:
        monkeypatch.setattr(signal, "setitimer", setitimer)
        lock_within(take, timeout=5.0)
        monkeypatch.undo()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
    return rang


def test_a_tick_that_falls_due_as_a_slice_ends_is_not_passed_to_the_caller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The interval timer can fire just as a slice of the wait ends, after SIGALRM is shut out
    again and before the timer is stopped: the tick then waits, pending, and would reach the
    caller's handler (or kill a caller that has none) once the wait gives SIGALRM back. It
    must be taken as the wait's own. Here the timer is made to fall due exactly there."""
    real = signal.setitimer

    def late_stop(which: int, seconds: float, interval: float = 0.0) -> Any:
        if seconds == 0:
            time.sleep(max(0.0, signal.getitimer(which)[0]) + 0.02)  # it falls due, shut out
        return real(which, seconds, interval)

    def take(block: bool) -> None:
        if not block:
            raise BlockingIOError  # held: the caller waits, under its timer
        # blocking: granted at once

    rang = _alarms_to_the_caller(monkeypatch, late_stop, take)
    assert rang == []
    assert signal.SIGALRM not in signal.sigpending()


def _held_elsewhere(path: Path, seconds: float) -> subprocess.Popen[bytes]:
    """Another process holds an flock on `path` for `seconds`, and has it before this returns."""
    ready = path.with_suffix(".held")
    holder = subprocess.Popen(["flock", str(path), "sh", "-c", f": > {ready}; sleep {seconds}"])
    wait_for(ready.exists, timeout=20, message="the other process never took the lock")
    return holder


@contextlib.contextmanager
def _timed_wait(path: Path, held: float, handler: Any) -> Iterator[int]:
    """A descriptor of `path`, whose lock another process holds for `held` seconds, with
    `handler` taking SIGALRM meanwhile; the timer stopped and all put back afterwards."""
    holder = _held_elsewhere(path, held)
    fd = os.open(path, os.O_RDWR)
    before = signal.signal(signal.SIGALRM, handler)
    try:
        yield fd
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
        os.close(fd)
        holder.kill()
        holder.wait()


def test_a_callers_alarm_falls_due_on_time_during_a_wait_for_a_lock(tmp_path: Path) -> None:
    """A program that uses gpuwait's Python API and its own SIGALRM timer (`signal.alarm`,
    pytest-timeout's signal method) keeps it: the wait for a contended lock must neither cancel
    the timer nor swallow its signal, and a handler that raises ends the wait, as a timeout
    should."""

    def timed_out(signum: int, frame: object) -> None:
        raise TimeoutError

    with _timed_wait(tmp_path / "lock", 20, timed_out) as fd:
        started = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, 0.4)
        with pytest.raises(TimeoutError):
            flock_within(fd, fcntl.LOCK_EX, timeout=10.0)
        assert time.monotonic() - started < 5.0


def test_a_callers_alarm_handled_during_a_wait_lets_the_wait_go_on(tmp_path: Path) -> None:
    rang: list[float] = []
    with _timed_wait(
        tmp_path / "lock", 1.5, lambda signum, frame: rang.append(time.monotonic())
    ) as fd:
        started = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, 0.4, 10.0)
        flock_within(fd, fcntl.LOCK_EX, timeout=30.0)
        # The lock is this process's now; the caller's timer rang once, and runs on.
        assert len(rang) == 1 and rang[0] - started < 1.4
        assert signal.getitimer(signal.ITIMER_REAL)[1] == 10.0


@contextlib.contextmanager
def _alarm_held(path: Path, held: float) -> Iterator[int]:
    """A descriptor on `path`, whose lock another process holds for `held` seconds, with
    SIGALRM blocked, as gpuwait holds it to pass it on to its command; one
    still pending at the end is taken away."""
    holder = _held_elsewhere(path, held)
    fd = os.open(path, os.O_RDWR)
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    try:
        yield fd
    finally:
        signal.sigtimedwait({signal.SIGALRM}, 0)
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
        os.close(fd)
        holder.kill()
        holder.wait()


def test_an_alarm_sent_to_gpuwait_waiting_for_a_lock_ends_the_wait_and_stays_pending(
    tmp_path: Path,
) -> None:
    """gpuwait holds SIGALRM blocked to pass it on to its command (`kill -ALRM` at its pid): one
    that comes while it waits for a lock another process holds must not be taken for the
    wait's own timer, nor leave the wait deaf to its timer.

    One that lands as the wait's own timer runs out merges with its tick, as two SIGALRMs do
    (on a busy machine, also one whose handler Python runs only after the timer ran out too):
    it is sent again every 0.3 s until the wait ends, as a sender of a signal that went
    unanswered would."""
    stop = threading.Event()

    def send() -> None:
        while not stop.wait(0.3):
            os.kill(os.getpid(), signal.SIGALRM)

    with _alarm_held(tmp_path / "lock", 20) as fd:
        started = time.monotonic()
        # Started with SIGALRM blocked, as the wait holds it: only the wait's slices take it.
        sender = threading.Thread(target=send)
        sender.start()
        try:
            with pytest.raises(SignalPending) as raised:
                flock_within(fd, fcntl.LOCK_EX, timeout=10.0)
        finally:
            stop.set()
            sender.join()
        assert raised.value.signum == signal.SIGALRM
        assert time.monotonic() - started < 5.0
        assert signal.SIGALRM in signal.sigpending()


def test_an_alarm_already_waiting_for_gpuwait_is_not_lost_to_a_wait_for_a_lock(
    tmp_path: Path,
) -> None:
    """A `kill -ALRM` that came while gpuwait was busy waits, blocked, for its loop, which
    passes it on to the command: a wait for a lock that begins meanwhile must leave it there."""
    with _alarm_held(tmp_path / "lock", 0.5) as fd:
        os.kill(os.getpid(), signal.SIGALRM)
        flock_within(fd, fcntl.LOCK_EX, timeout=10.0, patience=float("inf"))
        assert signal.SIGALRM in signal.sigpending()


def test_a_signal_for_the_command_lets_a_wait_patient_with_it_take_the_lock(
    tmp_path: Path,
) -> None:
    """A wait given no patience for a signal asking gpuwait to end and all for the others (the
    record of a run) takes the lock once it is let go, with an ALRM and a USR1 sent to
    gpuwait meanwhile, the command's to take, left pending for its loop: it gave up at once."""
    with _alarm_held(tmp_path / "lock", 1.0) as fd:
        before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        try:
            os.kill(os.getpid(), signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGALRM)
            flock_within(fd, fcntl.LOCK_EX, timeout=30.0, patience=Patience(0.0, float("inf")))
            assert {signal.SIGALRM, signal.SIGUSR1} <= signal.sigpending()
        finally:
            signal.sigtimedwait({signal.SIGUSR1}, 0)
            signal.pthread_sigmask(signal.SIG_SETMASK, before)


def test_a_stop_ends_a_wait_patient_with_the_signals_for_the_command(tmp_path: Path) -> None:
    """As above, a TERM that comes after the USR1 ends the wait, as it would alone."""
    with _alarm_held(tmp_path / "lock", 20) as fd:
        before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGTERM})
        try:
            os.kill(os.getpid(), signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGTERM)
            with pytest.raises(SignalPending) as raised:
                flock_within(fd, fcntl.LOCK_EX, timeout=30.0, patience=Patience(0.0, float("inf")))
            assert raised.value.signum == signal.SIGTERM
        finally:
            signal.sigtimedwait({signal.SIGUSR1}, 0)
            signal.sigtimedwait({signal.SIGTERM}, 0)
            signal.pthread_sigmask(signal.SIG_SETMASK, before)


def test_a_callers_periodic_timer_falls_due_on_time_and_the_wait_still_times_out(
    tmp_path: Path,
) -> None:
    """A program's heartbeat on a short periodic SIGALRM timer (Python API, the lock's wait
    taking SIGALRM with its handler): each tick once, on time, and the wait gives up at its
    timeout. From the second tick on, the wait took the timer as already due at every turn,
    ran the handler in a tight loop and never looked at its timeout."""
    rang: list[float] = []

    def ring(signum: int, frame: object) -> None:
        rang.append(time.monotonic())
        if len(rang) > 200:
            raise RuntimeError("the handler ran in a loop")

    with _timed_wait(tmp_path / "lock", 20, ring) as fd:
        started = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)
        with pytest.raises(LockTimeout):
            flock_within(fd, fcntl.LOCK_EX, timeout=1.0)
        assert time.monotonic() - started < 5.0
        # One tick per period, give or take the slow machine's delays: not hundreds.
        assert 3 <= len(rang) <= 40, len(rang)
        assert signal.getitimer(signal.ITIMER_REAL)[1] == 0.05


def test_an_alarm_sent_between_two_slices_of_the_wait_reaches_the_callers_handler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A SIGALRM sent to a program (by a thread of its own, or `kill -ALRM`) that lands while
    the wait for a lock is between two slices, its timer stopped, was taken for the wait's own
    tick and dropped: the program's handler never ran. Here it is sent exactly there."""
    real = signal.setitimer
    sent: list[bool] = []

    def between_slices(which: int, seconds: float, interval: float = 0.0) -> Any:
        done = real(which, seconds, interval)
        if seconds == 0 and not sent:
            # The first slice is over and its timer stopped: the signal lands now.
            sent.append(True)
            os.kill(os.getpid(), signal.SIGALRM)
        return done

    slices: list[bool] = []

    def take(block: bool) -> None:
        if not block:
            raise BlockingIOError  # held: the caller waits, under its timer
        slices.append(block)
        if len(slices) == 1:
            time.sleep(5)  # the first slice lasts until its tick; then the lock is granted

    rang = _alarms_to_the_caller(monkeypatch, between_slices, take)
    assert sent and rang == [signal.SIGALRM], rang


def test_a_stop_after_a_signal_for_the_command_is_given_its_own_patience(tmp_path: Path) -> None:
    """A wait patient with the signals for the command and 3 s with one asking gpuwait to end
    (the record of a run, `Patience`): a USR1 pending from its start, and a TERM sent 3.5 s
    in, half a second before the lock is let go. The TERM's 3 s count from the TERM: the wait
    takes the lock, the TERM left pending for gpuwait's loop, and does not give up at once for
    the USR1's 3.5 s."""
    path = tmp_path / "lock"
    ready = path.with_suffix(".held")
    script = f": > {ready}; sleep 3.5; kill -TERM {os.getpid()}; sleep 0.5"
    holder = subprocess.Popen(["flock", str(path), "sh", "-c", script])
    fd = -1
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGTERM})
    try:
        wait_for(ready.exists, timeout=20, message="the other process never took the lock")
        fd = os.open(path, os.O_RDWR)
        os.kill(os.getpid(), signal.SIGUSR1)
        flock_within(fd, fcntl.LOCK_EX, timeout=60.0, patience=Patience(3.0, float("inf")))
        assert {signal.SIGUSR1, signal.SIGTERM} <= signal.sigpending()
    finally:
        holder.wait()
        signal.sigtimedwait({signal.SIGUSR1}, 0)
        signal.sigtimedwait({signal.SIGTERM}, 0)
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
        if fd >= 0:
            os.close(fd)
