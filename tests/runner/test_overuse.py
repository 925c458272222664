"""A running job far above its reservation is called out: in `status`, the event log and its
history record, with the likely cause and what to do."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.fixtures_nvml import FakeGpu, FakeNvml
from helpers.fixtures_sim import SIMJOB, SimFileFactory
from helpers.history import recorded_runs
from helpers.waiting import asleep_waiting, ledger_entries, named_entry, wait_for

from gpuwait.core.overuse import overuse
from gpuwait.queue import events as event_log

GPUWAIT = [sys.executable, "-m", "gpuwait"]
GiB = 2**30


def state_dir() -> Path:
    return Path(os.environ["XDG_STATE_HOME"]) / "gpuwait"


def status_once_called_out() -> str:
    """`gpuwait status` (its words on one line) once the entry has noted the overuse."""
    wait_for(
        lambda: any(e.get("overuse_since") for e in ledger_entries()),
        timeout=30,
        message="the entry never noted the overuse",
    )
    status = subprocess.run(
        [*GPUWAIT, "status"], capture_output=True, text=True, timeout=30, check=True
    )
    flat = " ".join(status.stdout.split())
    assert "over its reservation" in flat, status.stdout
    return flat


@pytest.mark.parametrize(
    ("allocates", "words"),
    [
        # An under-declared --vram: reserve what it uses.
        ("8G", "--vram 8G"),
        # 18 of 24 GiB: a framework that preallocates, as JAX does (75 %).
        ("18G", "XLA_PYTHON_CLIENT_MEM_FRACTION=0.0833"),
    ],
)
def test_a_job_above_its_reservation_is_called_out(
    sim_file: SimFileFactory, monkeypatch: pytest.MonkeyPatch, allocates: str, words: str
) -> None:
    sim_file(gpus=1, memory="24G")
    monkeypatch.setenv("GPUWAIT_SAMPLE_INTERVAL", "0.1s")
    job = subprocess.Popen(
        [
            *GPUWAIT,
            *("--vram", "2G", "--name", "greedy", "--"),
            *SIMJOB,
            *("--vram", allocates, "--hold", "30s"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert words in status_once_called_out()
        said = [e for e in event_log.read_events(state_dir()) if e["kind"] == "over-reservation"]
        assert len(said) == 1 and said[0]["name"] == "greedy"
        assert said[0]["reserved_bytes"] == 2 * GiB
        log = subprocess.run(
            [*GPUWAIT, "log"], capture_output=True, text=True, timeout=30, check=True
        )
        assert "greedy) uses" in log.stdout and "of its 2.0 GiB reservation" in log.stdout
    finally:
        job.terminate()
        job.wait(timeout=30)
    (record,) = recorded_runs()
    assert record["over_reservation"]["used_bytes"] >= 8 * GiB
    assert words in record["over_reservation"]["advice"]


def test_a_job_inside_its_reservation_is_not_called_out(
    sim_file: SimFileFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    sim_file(gpus=1, memory="24G")
    monkeypatch.setenv("GPUWAIT_SAMPLE_INTERVAL", "0.1s")
    done = subprocess.run(
        [*GPUWAIT, "--vram", "4G", "--", *SIMJOB, "--vram", "4G", "--hold", "1s"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert not [e for e in event_log.read_events(state_dir()) if e["kind"] == "over-reservation"]
    assert "over_reservation" not in recorded_runs()[0]


def test_the_rule() -> None:
    # Within the margin, or a few MiB over a small reservation: nothing to say.
    assert overuse(4 * GiB, int(4.3 * GiB), 24 * GiB, 0.1) is None
    assert overuse(256 * 2**20, 300 * 2**20, 24 * GiB, 0.1) is None
    # An exclusive job holds the whole card: it cannot pass it.
    assert overuse(0, 20 * GiB, 24 * GiB, 0.1) is None
    found = overuse(4 * GiB, 18 * GiB, 24 * GiB, 0.1)
    assert found is not None and found.preallocated
    # 4 of 24 GiB, rounded down as gpuwait rounds its own fraction: 0.17 would let JAX take
    # 4.08 GiB, past the reservation the advice is meant to keep it in.
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.1666 " in found.advice()
    grown = overuse(4 * GiB, 6 * GiB, 24 * GiB, 0.1)
    assert grown is not None and not grown.preallocated and "--vram 6G" in grown.advice()


def greedy_job_through_nvml(
    fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch, options: list[str], used: int
) -> str:
    """`gpuwait OPTIONS --name greedy -- sleep 30`, its command then seen by NVML using `used`
    on GPU 0: `status` once it is called out. The job is ended, and its history record says
    it used that much over its reservation."""
    # The real pynvml on the tests' fake driver: the figure comes from NVML's process list.
    monkeypatch.delenv("GPUWAIT_SIM", raising=False)
    monkeypatch.setenv("GPUWAIT_SAMPLE_INTERVAL", "0.1s")
    job = subprocess.Popen(
        [*GPUWAIT, *options, "--name", "greedy", "--", "sleep", "30"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        child = wait_for(
            lambda: next((e["child_pid"] for e in ledger_entries() if e.get("child_pid")), None),
            timeout=30,
        )
        fake_nvml.update_gpu(0, used=used)
        fake_nvml.add_process(0, child, used)
        status = status_once_called_out()
    finally:
        job.terminate()
        job.wait(timeout=30)
    (record,) = recorded_runs()
    assert record["over_reservation"]["used_bytes"] == used
    return status


def test_through_nvml_a_process_above_its_reservation_is_called_out(
    fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The real pynvml on the tests' fake driver: the figure comes from NVML's process list.
    fake_nvml.set_gpus([FakeGpu(total=24 * GiB)])
    status = greedy_job_through_nvml(fake_nvml, monkeypatch, ["--vram", "2G"], 10 * GiB)
    assert "--vram" in status


def test_past_its_share_of_the_smaller_of_two_cards_is_called_out(
    fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Half of a 24 GiB and of an 80 GiB card: 12 GiB on the small one. 16 GiB there eats the
    # room of the small card's other jobs, though it is well within the big card's 40 GiB.
    fake_nvml.set_gpus([FakeGpu(total=24 * GiB), FakeGpu(total=80 * GiB)])
    options = ["--vram", "50%", "--gpus", "2"]
    status = greedy_job_through_nvml(fake_nvml, monkeypatch, options, 16 * GiB)
    assert "uses 16.0 GiB of its 12.0 GiB reservation" in status
    said = [e for e in event_log.read_events(state_dir()) if e["kind"] == "over-reservation"]
    assert [e["reserved_bytes"] for e in said] == [12 * GiB]


def test_a_job_that_grew_past_its_reservation_keeps_that_room_while_it_runs(
    sim_file: SimFileFactory, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A job of 2 GiB that took 18 GiB, let it go (an evaluation in a process of its own, a
    cache emptied) and takes it again: a waiter started into the 18 GiB in between would run
    out of memory, or make it run out."""
    sim_file(gpus=1, memory="24G")
    monkeypatch.setenv("GPUWAIT_SAMPLE_INTERVAL", "0.1s")
    gap, go = tmp_path / "gap", tmp_path / "go"
    simjob = shlex.join(SIMJOB)
    phases = (
        f"{simjob} --vram 18G --hold 1s && touch {gap} && "
        f"while [ ! -f {go} ]; do sleep 0.05; done && exec {simjob} --vram 18G --hold 2s"
    )
    greedy = subprocess.Popen(
        [*GPUWAIT, "--vram", "2G", "--name", "greedy", "--", "sh", "-c", phases],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    mine: subprocess.Popen[str] | None = None
    try:
        wait_for(gap.exists, timeout=60, message="the first phase never ended")
        entry = named_entry("greedy")
        assert entry is not None and entry.get("overuse_bytes", 0) >= 16 * GiB, entry
        mine = subprocess.Popen(
            [
                *(*GPUWAIT, "--vram", "12G", "--name", "mine", "--"),
                *(*SIMJOB, "--vram", "12G", "--ramp", "1.5s", "--hold", "0.5s"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        waiter = mine
        wait_for(
            lambda: (
                asleep_waiting(waiter.pid) or (named_entry("mine") or {}).get("state") == "running"
            ),
            timeout=60,
            message="the waiter neither waited nor started",
        )
        go.touch()
        _, mine_err = mine.communicate(timeout=120)
        _, greedy_err = greedy.communicate(timeout=120)
        assert "out of memory" not in mine_err + greedy_err, mine_err + greedy_err
        assert (mine.returncode, greedy.returncode) == (0, 0), mine_err + greedy_err
    finally:
        go.touch()
        for proc in (greedy, mine):
            if proc is not None and proc.poll() is None:
                proc.kill()
            if proc is not None:
                proc.communicate()
