"""Crash torture: many gpuwait processes, SIGKILLed at random moments, against one ledger.

The same engine as bench/torture.py (which runs 200+ peers and prints the figures), with fewer
peers so that it stays within a small machine's time.
"""

from __future__ import annotations

import os
import sys

import pytest
from conftest import REPO

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
