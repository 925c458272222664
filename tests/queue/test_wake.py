"""Whom a ledger change wakes: only the waiters it concerns, never the whole queue."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers.jobs import live_job

from gpuwait.queue import wake
from gpuwait.queue.entries import RUNNING, WAITING, Job
from gpuwait.queue.ledger import Ledger

# A stand-in waiter: SIGCHLD blocked as gpuwait blocks it, then it reports whether one came.
WAITER = r"""
import signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
print("ready", flush=True)
got = signal.sigtimedwait({signal.SIGCHLD}, float(sys.argv[1]))
print("woken" if got is not None else "slept", flush=True)
"""


def entry(job_id: str, pid: int, order: int, state: str = WAITING, **extra: object) -> Job:
    return live_job(
        job_id, pid, command=["true"], request={"bytes": 2**30}, order=order, state=state, **extra
    )


def test_a_change_concerns_the_admitted_the_cancelled_their_dependents_and_the_head() -> None:
    before = {
        "run": (RUNNING, 10),
        "head": (WAITING, 11),
        "second": (WAITING, 12),
        "third": (WAITING, 13),
        "admitted": (WAITING, 14),
        "cancelled": (WAITING, 15),
        "dead": (WAITING, 16),
        "after-cancelled": (WAITING, 17),
    }
    after = [
        entry("head", 11, 1),
        entry("second", 12, 2),
        entry("third", 13, 3),
        entry("admitted", 14, 4, state=RUNNING),
        entry("after-cancelled", 17, 7, after_ok=["cancelled"]),
    ]
    quiet = frozenset({"dead"})
    # "run" was taken out (by another process: the one leaving is never signalled), so room was
    # freed: the first two in line plan (the second as a stand-in).
    assert wake.concerned(before, after, quiet, release=True) == {10, 11, 12, 14, 15, 17}
    # Without a release only the admitted, the removed and their dependents are woken.
    assert wake.concerned(before, after, quiet, release=False) == {10, 14, 15, 17}
    # Nothing but a sample of a running job's memory: nobody.
    same = {"head": (WAITING, 11), "run": (RUNNING, 10)}
    unchanged = [entry("head", 11, 1), entry("run", 10, 0, RUNNING)]
    assert wake.concerned(same, unchanged, quiet, release=False) == set()


def test_the_releasing_transaction_wakes_the_head_and_not_the_rest(tmp_path: Path) -> None:
    waiters = [
        subprocess.Popen([sys.executable, "-c", WAITER, "3"], stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    try:
        for w in waiters:
            assert w.stdout is not None and w.stdout.readline() == "ready\n"
        holder = subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
        )
        ledger = Ledger(tmp_path)
        with ledger.transaction() as data:
            data.jobs.append(entry("holder", holder.pid, 0, state=RUNNING))
            data.jobs.extend(entry(f"w{i}", w.pid, i + 1) for i, w in enumerate(waiters))
        with ledger.transaction() as data:
            data.remove("holder")  # the holder's job ended: its room is free
        holder.kill()
        holder.wait()
        said = [w.communicate(timeout=30)[0].strip() for w in waiters]
        assert said == ["woken", "woken", "slept", "slept"]
    finally:
        for w in waiters:
            w.kill()
            w.wait()
