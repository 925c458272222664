"""The ledger's fingerprint (`Ledger.change_token`) on a file system with a coarse clock.

A running job's gpuwait looks at the ledger only when its fingerprint changed: to put back its
entry where the ledger was replaced without it (else others plan into the room it holds), and
to see a request to pause or freeze it. On a file system whose clock ticks coarsely (kernels
before 6.13, NFS and many others), every change within one tick has the same times, and ext4
gives a file written by rename the inode of the one it replaced two writes before: a ledger
changed twice in a tick, back to its first size, looks unchanged by its metadata alone.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from helpers.jobs import live_job

from gpuwait.linux.stamp import FileStamp
from gpuwait.queue import ledger as ledger_module
from gpuwait.queue.ledger import Ledger


def coarse_clock(monkeypatch: pytest.MonkeyPatch, tick: float) -> None:
    """Every file's stamp as a file system would give it that ticks once in this test (at
    `tick`, a moment ago) and reuses each freed inode at once: the same inode and times for
    every version, the size alone telling them apart."""
    tick_ns = int(tick * 1e9)

    def stamp_of(st: os.stat_result) -> FileStamp:
        return FileStamp(12, st.st_size, tick_ns, tick_ns)

    def file_stamp(path: Path, **_: object) -> FileStamp | None:
        try:
            return stamp_of(os.stat(path))
        except OSError:
            return None

    monkeypatch.setattr(ledger_module, "stamp_of", stamp_of)
    monkeypatch.setattr(ledger_module, "file_stamp", file_stamp)


def ledger_in(tmp_path: Path, shared: bool) -> Ledger:
    """A private ledger, or a shared one (a directory the group may write into, a file per
    user)."""
    directory = tmp_path / "state"
    if shared:
        directory.mkdir(mode=0o700)
        directory.chmod(0o3770)
    return Ledger(directory)


@pytest.mark.parametrize("shared", [False, True], ids=["private", "shared"])
def test_a_ledger_changed_within_one_tick_back_to_its_size_is_seen_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared: bool
) -> None:
    """The entry of job a1 is replaced by job b2's, of the same size, within the tick in
    which the fingerprint was taken: the job whose entry was lost must see the change."""
    coarse_clock(monkeypatch, time.time())
    ledger = ledger_in(tmp_path, shared)
    with ledger.transaction() as data:
        data.jobs.append(live_job("a1", pid=os.getpid()))
    before = ledger.change_token()
    with ledger.transaction() as data:
        data.jobs.clear()
    with ledger.transaction() as data:
        data.jobs.append(live_job("b2", pid=os.getpid()))
    assert [job.id for job in ledger.read().jobs] == ["b2"]
    assert ledger.shared is shared
    assert ledger.change_token() != before


@pytest.mark.parametrize("shared", [False, True], ids=["private", "shared"])
def test_a_ledger_written_long_ago_keeps_its_fingerprint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared: bool
) -> None:
    """Once a tick has passed since the ledger's last change, a later change falls in a later
    tick: the fingerprint stays the same as long as nothing is written, and is cheap."""
    coarse_clock(monkeypatch, time.time() - 60)
    ledger = ledger_in(tmp_path, shared)
    with ledger.transaction() as data:
        data.jobs.append(live_job("a1", pid=os.getpid()))
    assert ledger.change_token() == ledger.change_token()
