"""Crash torture: many gpuwait processes, SIGKILLed at random moments, against one ledger.

The same engine as bench/torture.py (which runs 200+ peers and prints the figures), with fewer
peers so that it stays within a small machine's time.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO
from helpers.waiting import wait_for

sys.path.insert(0, str(REPO / "bench"))

from torture import Figures, torture


def assert_survived(figures: Figures) -> None:
    report = figures.report() + "\n" + "\n".join(figures.failures[:10])
    assert figures.ok(), report
    assert figures.kills > 0, report


@pytest.mark.slow
def test_sixty_peers_killed_at_random_lose_and_leak_nothing() -> None:
    figures = torture(peers=60, launches=120, users=1, kill_every=0.05, kill_chance=0.5, seed=7)
    assert_survived(figures)
    # The final operation had dead entries to reap, so "0 leaked" means something.
    assert figures.dead_before_reap > 0


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="runs peers as other users: needs root")
def test_a_hostile_member_forges_swaps_and_locks_while_two_users_work() -> None:
    # Two users' peers share one ledger directory under kills, as they would without the
    # hostile member; it attacks besides.
    figures = torture(
        peers=40, launches=80, users=2, kill_every=0.05, kill_chance=0.5, seed=9, hostile=True
    )
    assert_survived(figures)
    assert figures.dead_before_reap > 0
    done = figures.hostile
    # It did attack: forged entries and requests, swapped files, held the lock.
    assert done["forged_entries"] > 0 and done["forged_requests"] > 0, done
    assert done["swaps"] > 0 and done["lock_holds"] > 0, done
    assert figures.forgeries_counted == 0 and figures.hangs == 0


def test_the_checker_reads_processes_whose_names_are_not_text() -> None:
    # Another program on the machine named itself with bytes that are no UTF-8 (a name cut
    # mid-character, as the kernel's 15 bytes do): the checker's look at /proc crashed the run.
    import subprocess

    import torture

    name = "import ctypes, time; ctypes.CDLL(None).prctl(15, b'run_\\xe5\\xad', 0, 0, 0); "
    odd = subprocess.Popen([sys.executable, "-c", name + "time.sleep(30)"])
    comm = Path(f"/proc/{odd.pid}/comm")
    try:
        wait_for(lambda: comm.read_bytes() == b"run_\xe5\xad\n")
        assert odd.pid in torture._children()[os.getpid()]
        assert torture._alive(odd.pid)
    finally:
        odd.kill()
        odd.wait()


def test_the_checker_counts_an_over_admission_in_a_private_ledger_rewritten_as_read() -> None:
    # A private ledger is one file, read whole: what a reading shows is what the planners
    # saw. The checker set aside every reading during which a peer rewrote it, as it must for
    # a shared ledger's files read one after another: 5 to 9 of a 30-peer run's 16 to 26, an
    # over-admission in them uncounted.
    import torture
    from helpers.jobs import live_job, replace_ledger

    machine = torture.Machine(users=1, gpus=2, memory_gib=24)
    try:
        each = machine.gpu_usable * 6 // 10
        with machine.ledger.transaction() as data:
            for name in ("a", "b"):
                data.jobs.append(
                    live_job(name, state="running", gpu_uuids=["GPU-0"], reserved_bytes=each)
                )
        read = machine.ledger.read

        def read_as_a_peer_writes() -> Any:
            seen = read()
            path = machine.ledger.path
            replace_ledger(path, path.read_bytes())  # a peer's write, by rename, meanwhile
            return seen

        machine.ledger.read = read_as_a_peer_writes  # type: ignore[method-assign]
        figures = torture.Figures()
        torture.Checker(machine, figures).check({})
        assert figures.over_admissions == 1, figures.report()
    finally:
        machine.cleanup()
