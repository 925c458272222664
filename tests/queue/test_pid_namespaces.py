"""Jobs in other pid namespaces (containers without --pid=host) sharing one state directory.

A pid names a process only in its own pid namespace: an entry written in a container names, on
the host or in another container, no process or somebody else's. Taken for dead, such an entry
would be reaped and its room handed out while its job allocates. Each job's gpuwait holds a lock
that its command inherits, and an entry of another namespace lives while that lock is held.
Real namespaces (unshare), real processes, simulated GPUs: an over-admission shows up as an
out-of-memory error, a job stuck for good as a timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.fixtures_sim import SIMJOB, SimFileFactory
from helpers.jobs import live_job
from helpers.processes import children, unshare_prefix
from helpers.waiting import named_entry, process_state, wait_for

from gpuwait.core.snapshot import GpuSnapshot, MachineSnapshot, ProcessUsage
from gpuwait.gpu.sim import load_sim_file
from gpuwait.linux import alive, pidns
from gpuwait.linux.proc import start_time
from gpuwait.queue import events as event_log
from gpuwait.queue import lifecycle
from gpuwait.queue.conditions import claim_of
from gpuwait.queue.entries import RUNNING
from gpuwait.queue.ledger import Ledger

GPUWAIT = [sys.executable, "-m", "gpuwait"]

GiB = 2**30
CARD = GpuSnapshot(0, "GPU-0", "Test GPU", 24 * GiB, 0)


@pytest.fixture
def elsewhere(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Call to read the ledger from here on as a process of another pid namespace does."""

    def move() -> None:
        monkeypatch.setattr(pidns, "current", lambda: 4026500000)

    return move


# --- the ledger, read from another namespace (in this process) ------------------------------


def test_an_entry_of_another_namespace_lives_while_its_lock_is_held(
    tmp_path: Path, elsewhere: Callable[[], None]
) -> None:
    ledger = Ledger(tmp_path)
    job = lifecycle.submit(ledger, live_job("0a0b"), [], [], tmp_path, ["x"])
    assert job.pidns == pidns.current()
    elsewhere()
    # Its pid is looked up nowhere: taken as this namespace's, a dead one would be reaped.
    assert lifecycle.tidy(ledger, None).find("0a0b") is not None
    alive.release(tmp_path, "0a0b")  # as its gpuwait's death would
    assert lifecycle.tidy(ledger, None).find("0a0b") is None
    assert list((tmp_path / f"alive.{os.getuid()}").iterdir()) == []


def test_another_namespaces_pids_are_not_taken_for_its_jobs_memory(
    tmp_path: Path, elsewhere: Callable[[], None]
) -> None:
    # Read in a container (not the host's namespace, where NVML's pids could be looked up):
    # NVML's pid 4242 is some process of the host; the entry's own pid 4242 is its
    # container's. Taken as the job's, 10 GiB of the card would be lent to its reservation.
    card = CARD._replace(used_bytes=10 * GiB, processes=(ProcessUsage(4242, 10 * GiB),))
    ledger = Ledger(tmp_path)
    job = lifecycle.submit(
        ledger, live_job("0c0d", pids=[4242], child_pid=4242), [], [], tmp_path, ["x"]
    )
    job = job._replace(state=RUNNING, gpu_uuids=["GPU-0"], reserved_bytes=12 * GiB)
    assert claim_of(job, [card]).observed == {"GPU-0": 10 * GiB}
    elsewhere()
    assert claim_of(job, [card]).observed == {"GPU-0": 0}
    assert claim_of(job, [card]).pids == frozenset()
    alive.release(tmp_path, "0c0d")


def test_another_namespaces_running_job_is_not_cancelled_by_pid(
    tmp_path: Path, elsewhere: Callable[[], None]
) -> None:
    ledger = Ledger(tmp_path)
    running = lifecycle.submit(ledger, live_job("0e02", name="r"), [], [], tmp_path, ["x"])
    running, _ = lifecycle.admit(ledger, running, MachineSnapshot("sim", (CARD,)), 0.9)
    assert running.state == RUNNING
    waiting = lifecycle.submit(ledger, live_job("0e01", name="w"), [], [], tmp_path, ["x"])
    elsewhere()
    done = lifecycle.cancel(ledger, ["w", "r"], None, os.getuid())
    assert [j.id for j in done.cancelled] == [waiting.id]
    assert [(j.id, why) for j, why in done.refused] == [
        (
            running.id,
            f"job {running.id} runs in another pid namespace (a container without --pid=host); "
            "cancel it from there",
        )
    ]
    assert done.stopped == []
    for job_id in ("0e01", "0e02"):
        alive.release(tmp_path, job_id)


def test_a_job_of_another_namespace_is_no_stage_of_a_pipeline_here(
    sim_file: SimFileFactory,
    tmp_path: Path,
    elsewhere: Callable[[], None],
    procs: Callable[..., subprocess.Popen[str]],
) -> None:
    # Containers number their processes alike from 1. A running job of another container whose
    # pids a pipeline here also has was taken for a stage of it: the pipeline's 13 GiB waiter
    # was refused at once ("is in a pipeline with gpuwait job ...", exit 3), as if the job
    # waited for its output, instead of waiting for the job to end.
    sim = sim_file(gpus=1, memory="24G")
    done = tmp_path / "done"
    waiter = [*GPUWAIT, "-q", "--vram", "13G", "--timeout", "0.5s", "--", "true"]
    script = f"""
        while [ ! -e {done} ]; do sleep 0.05; done | {{
            while [ ! -e {tmp_path}/go ]; do sleep 0.05; done; exec {_sh(waiter)}
        }}
        echo rc=$?
    """
    pipeline = procs(["sh", "-c", script])
    stages = wait_for(lambda: len(children(pipeline.pid)) == 2 and children(pipeline.pid))
    writer, reader = sorted(stages)
    # The other container's job: its gpuwait and its command have these stages' numbers there.
    elsewhere()
    ledger = Ledger(Path(os.environ["XDG_STATE_HOME"]) / "gpuwait")
    theirs = live_job(
        "0f01",
        pid=writer,
        child_pid=reader,
        child_start_time=start_time(reader),
        request={"bytes": 13 * GiB},
    )
    theirs = lifecycle.submit(ledger, theirs, [], [], tmp_path, ["x"])
    card = CARD._replace(uuid=load_sim_file(sim).gpus[0].uuid)
    theirs, _ = lifecycle.admit(ledger, theirs, MachineSnapshot("sim", (card,)), 0.9)
    assert theirs.state == RUNNING
    (tmp_path / "go").touch()
    wait_for(lambda: process_state(reader) in (None, "Z"), timeout=30)
    done.touch()
    out, err = pipeline.communicate(timeout=30)
    assert "rc=124" in out, err  # waited for the job, until its timeout
    alive.release(ledger.directory, "0f01")


# --- real namespaces ------------------------------------------------------------------------


def _sh(argv: list[str]) -> str:
    return " ".join(f"'{a}'" for a in argv)


def events_of(name: str) -> list[dict[str, Any]]:
    """The event log's events of the job named `name` (written by every namespace)."""
    log = event_log.read_events(Path(os.environ["XDG_STATE_HOME"]) / "gpuwait")
    job = next(e["job"] for e in log if e["kind"] == "submit" and e.get("name") == name)
    return [e for e in log if e.get("job") == job]


def held_room(name: str) -> tuple[float, float]:
    """When the job named `name` was admitted, and when its room was given back (its finish,
    or its entry reaped), from the event log every namespace writes to.

    The simulated GPUs tell allocations apart by pid, so across pid namespaces a job admitted
    into taken memory need not run out of it there: the times are the evidence.
    """
    mine = events_of(name)
    admitted = next(e["time"] for e in mine if e["kind"] == "admit")
    ended = next(e["time"] for e in mine if e["kind"] in ("finish", "reap"))
    return admitted, ended


def started(name: str) -> bool:
    """The job named `name` runs, and its admission is in the event log: killed any sooner, the
    log may lack it (the events of a transaction are written once it has committed)."""
    return running(name) and any(e["kind"] == "admit" for e in events_of(name))


def one_after_the_other(first: str, second: str) -> bool:
    """Did `second` get its room only once `first` had given its own back?"""
    return held_room(first)[1] <= held_room(second)[0]


def sim_job(name: str, hold: str, report: Path | None = None, *options: str) -> list[str]:
    """gpuwait running a simulated job of 13 GiB (two never fit on the card together)."""
    argv = [*GPUWAIT, "--vram", "13G", "--name", name, *options, "--", *SIMJOB]
    argv += ["--vram", "13G", "--hold", hold]
    return argv + (["--report", str(report)] if report is not None else [])


@pytest.fixture
def one_card(sim_file: SimFileFactory, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """One simulated 24 GiB card; how to start a command in a pid namespace of its own."""
    prefix = unshare_prefix()
    monkeypatch.setenv("GPUWAIT_SIM", str(sim_file(gpus=1, memory="24G")))
    monkeypatch.setenv("GPUWAIT_NVML_INTERVAL", "0.2s")
    return prefix


def running(name: str) -> bool:
    entry = named_entry(name)
    return entry is not None and entry["state"] == "running"


def assert_waits_for(waiter: str, holder: str) -> None:
    """`waiter` has queued, and a moment later still waits while `holder` keeps its entry."""
    wait_for(lambda: named_entry(waiter) is not None, timeout=30)
    time.sleep(1.0)
    assert running(holder), f"{holder}'s entry must stay"
    entry = named_entry(waiter)
    assert entry is not None and entry["state"] == "waiting"


@pytest.mark.slow
def test_a_job_in_a_container_keeps_its_room_against_a_job_on_the_host(
    one_card: list[str],
    tmp_path: Path,
    procs: Callable[..., subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The GPUs read every 30 s: the waiter must learn of the container's job's end from the
    # ledger's summary, as no signal of a process of another namespace can reach it.
    monkeypatch.setenv("GPUWAIT_NVML_INTERVAL", "30s")
    reports = {name: tmp_path / f"{name}.json" for name in "ab"}
    a = procs([*one_card, *sim_job("a", "3s", reports["a"])])
    wait_for(lambda: started("a"), timeout=30)
    b = procs(sim_job("b", "0.2s", reports["b"]))
    assert_waits_for("b", "a")
    status = subprocess.run(
        [*GPUWAIT, "status", "--json"], capture_output=True, text=True, timeout=30, check=True
    )
    shown = {j["name"]: j["other_pid_namespace"] for j in json.loads(status.stdout)["jobs"]}
    assert shown == {"a": True, "b": False}
    assert a.wait(timeout=60) == 0, a.communicate()[1]
    assert b.wait(timeout=60) == 0, b.communicate()[1]
    assert [json.loads(r.read_text())["oom"] for r in reports.values()] == [False, False]
    assert one_after_the_other("a", "b")
    assert held_room("b")[0] - held_room("a")[1] < 5.0, "b was not woken when a ended"


@pytest.mark.slow
def test_an_orphaned_command_in_a_container_keeps_its_room_until_it_ends(
    one_card: list[str], tmp_path: Path, procs: Callable[..., subprocess.Popen[str]]
) -> None:
    # A's gpuwait is killed with SIGKILL in its container while its command runs on; B, in a
    # container of its own, must wait for the command, and then start (not wait for good).
    kill, stop, b_report = tmp_path / "kill", tmp_path / "stop", tmp_path / "b.json"
    # sh is the container's init: it kills gpuwait when told to, and at `stop` every process
    # left in the container (kill -1 from pid 1 reaches all but itself).
    script = f"""
        {_sh(sim_job("a", "120s"))} & gw=$!
        while [ ! -e {kill} ]; do sleep 0.05; done
        kill -KILL $gw
        while [ ! -e {stop} ]; do sleep 0.05; done
        kill -TERM -1
        sleep 0.5
    """
    a = procs([*one_card, "sh", "-c", script])
    wait_for(lambda: started("a"), timeout=30)
    time.sleep(0.5)  # the command allocates
    kill.touch()
    b = procs([*one_card, *sim_job("b", "0.2s", b_report)])
    assert_waits_for("b", "a")
    stop.touch()
    assert b.wait(timeout=60) == 0, b.communicate()[1]
    assert json.loads(b_report.read_text())["oom"] is False
    a.wait(timeout=30)
    assert named_entry("a") is None
    assert one_after_the_other("a", "b")


@pytest.mark.slow
def test_a_container_gone_with_its_jobs_holds_no_room(
    one_card: list[str], procs: Callable[..., subprocess.Popen[str]]
) -> None:
    # A container killed whole (its init with SIGKILL takes every process in it): its entries
    # are reaped by the next job, which starts at once.
    a = procs([*one_card, *sim_job("a", "120s")])
    wait_for(lambda: started("a"), timeout=30)
    os.kill(a.pid, 9)  # unshare --kill-child: its child, the container's init, goes with it
    a.wait(timeout=10)
    done = subprocess.run(
        sim_job("b", "0s", None, "--timeout", "20s"), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert named_entry("a") is None
    assert one_after_the_other("a", "b")
    # Nor any trace: the lock file of a reaped entry goes with it.
    assert not list(Path(os.environ["XDG_STATE_HOME"]).rglob("alive.*/*"))
