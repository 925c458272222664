"""gpuwait in a private pid namespace (a container without --pid=host): NVML names processes by
the host's pids, which are not this namespace's. gpuwait says so once and counts memory per card.

Real pynvml over the fake libnvidia-ml.so.1; the end-to-end test runs gpuwait in a pid namespace
of its own (unshare), as a container does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from helpers.fixtures_nvml import GIB, FakeGpu, FakeNvml
from helpers.history import recorded_runs
from helpers.processes import unshare_prefix
from helpers.waiting import ledger_entries, wait_for

from gpuwait.gpu.nvml import NvmlBackend
from gpuwait.linux import pidns

GPUWAIT = [sys.executable, "-m", "gpuwait"]
WARNING = "a container without --pid=host"


def absent_pid() -> int:
    """A pid no process here has."""
    pid = 4_000_000
    while os.path.exists(f"/proc/{pid}"):
        pid += 1
    return pid


@pytest.fixture
def backend(fake_nvml: FakeNvml) -> Iterator[NvmlBackend]:
    fake_nvml.set_gpus([FakeGpu(uuid="GPU-aaaa", total=24 * GIB), FakeGpu(uuid="GPU-bbbb")])
    b = NvmlBackend()
    yield b
    b.close()


@pytest.fixture
def in_container(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process taken for one in a private pid namespace."""
    monkeypatch.setattr(pidns, "in_initial_namespace", lambda: False)


def test_host_pids_are_noticed_once_and_memory_is_counted_per_card(
    fake_nvml: FakeNvml, backend: NvmlBackend, in_container: None
) -> None:
    fake_nvml.update_gpu(0, used=6 * GIB)
    fake_nvml.add_process(0, absent_pid(), 6 * GIB)
    first = backend.snapshot()
    said = [w for w in first.warnings if WARNING in w]
    assert len(said) == 1, first.warnings
    for gpu in first.gpus:
        assert gpu.processes == () and not gpu.per_process
    assert first.gpus[0].used_bytes == 6 * GIB  # the card's figure still holds
    # Said once: later readings keep to the card's figures without saying it again.
    fake_nvml.add_process(1, os.getpid(), GIB)
    later = backend.snapshot()
    assert not any(WARNING in w for w in later.warnings)
    assert all(g.processes == () and not g.per_process for g in later.gpus)
    # NVML accounting is kept by host pid too: no figure for this namespace's pids.
    assert backend.accounting_peak("GPU-aaaa", frozenset({os.getpid()})) is None


def test_a_host_pid_that_is_a_process_here_without_the_gpu_is_noticed(
    fake_nvml: FakeNvml, backend: NvmlBackend, in_container: None
) -> None:
    # The pid exists in this namespace, but names a process that has no NVIDIA device open:
    # the number is another process's on the host.
    fake_nvml.add_process(0, os.getpid(), 6 * GIB)
    snapshot = backend.snapshot()
    assert any(WARNING in w and f"pid {os.getpid()}" in w for w in snapshot.warnings)
    assert snapshot.gpus[0].processes == ()


def test_pids_of_processes_here_that_hold_the_gpu_are_kept(
    fake_nvml: FakeNvml,
    backend: NvmlBackend,
    in_container: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A driver that named processes by this namespace's pids would list processes that have
    # the device open: those are taken as they come.
    monkeypatch.setattr(pidns, "NVIDIA_DEVICES", str(tmp_path / "nvidia"))
    (tmp_path / "nvidia0").write_text("")
    with open(tmp_path / "nvidia0"):
        fake_nvml.add_process(0, os.getpid(), 6 * GIB)
        snapshot = backend.snapshot()
    assert not snapshot.warnings
    assert [p.pid for p in snapshot.gpus[0].processes] == [os.getpid()]
    assert snapshot.gpus[0].per_process


def test_in_the_host_namespace_nvml_pids_are_taken_as_they_come(
    fake_nvml: FakeNvml, backend: NvmlBackend
) -> None:
    if not pidns.in_initial_namespace():
        pytest.skip("these tests run in a private pid namespace themselves")
    pid = absent_pid()  # gone since: a process that just ended
    fake_nvml.add_process(0, pid, 6 * GIB)
    snapshot = backend.snapshot()
    assert not snapshot.warnings
    assert [p.pid for p in snapshot.gpus[0].processes] == [pid] and snapshot.gpus[0].per_process


# In a pid namespace of its own -------------------------------------------------------------


@contextmanager
def started_inside(
    argv: list[str], fake_nvml: FakeNvml, stop: Path
) -> Iterator[subprocess.Popen[str]]:
    """`argv` started (with the fake driver); at the end `stop` is made, and it has a minute to
    end before it is killed."""
    env = fake_nvml.env()
    env["GPUWAIT_SAMPLE_INTERVAL"] = "0.1s"
    process = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        yield process
    finally:
        stop.touch()
        if process.poll() is None:
            try:
                process.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()


def running_entry() -> dict[str, Any]:
    """The first entry whose command runs; while there is none, one whose `child_pid` is None."""
    return next((e for e in ledger_entries() if e.get("child_pid")), {"child_pid": None})


@pytest.mark.slow
def test_in_a_container_without_host_pids_no_job_is_admitted_into_memory_that_is_taken(
    fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    # One 24 GiB card. Job A (4G) runs in the namespace; then a host process of 16 GiB shows up
    # in NVML under a pid that, in this namespace, is A's command. Taken at its word, that
    # memory would be A's, and B (5G) would be admitted into 16 + 4 + 5 > 24 GiB.
    prefix = unshare_prefix()
    fake_nvml.set_gpus([FakeGpu(uuid="GPU-aaaa", total=24 * GIB)])
    go, stop = tmp_path / "go", tmp_path / "stop"
    gpuwait = " ".join(GPUWAIT)
    script = f"""
        {gpuwait} -q --vram 4G --name a -- sh -c 'while [ ! -e {stop} ]; do sleep 0.05; done' &
        while [ ! -e {go} ]; do sleep 0.05; done
        {gpuwait} --vram 5G --timeout 2s -- true 2>{tmp_path}/b.err
        echo $? >{tmp_path}/b.rc
        {gpuwait} status --json >{tmp_path}/status.json 2>{tmp_path}/status.err
        touch {stop}
        wait
    """
    with started_inside([*prefix, "sh", "-c", script], fake_nvml, stop) as inside:
        child = wait_for(lambda: running_entry()["child_pid"], timeout=30)
        fake_nvml.update_gpu(0, used=16 * GIB)
        fake_nvml.add_process(0, child, 16 * GIB)
        go.touch()
        out, _ = inside.communicate(timeout=60)
    assert inside.returncode == 0, out
    b_err = (tmp_path / "b.err").read_text()
    assert (tmp_path / "b.rc").read_text().strip() == "124", b_err  # waited, never admitted
    assert b_err.count(WARNING) == 1, b_err
    status = json.loads((tmp_path / "status.json").read_text())
    (gpu,) = status["gpus"]
    assert gpu["per_process"] is False
    assert gpu["external_bytes"] == 16 * GIB and gpu["reserved_bytes"] == 4 * GIB
    assert any(WARNING in w for w in status["warnings"])
    # A's peak comes from the card's growth, marked approximate, not from the host's process.
    (record,) = [r for r in recorded_runs() if r["name"] == "a"]
    assert record["peak_approximate"] is True


def host_pid_of(pid: int, namespace: int) -> int:
    """The pid (here, in the host's namespace) of the process that `namespace` calls `pid`."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}/ns/pid").st_ino != namespace:
                continue
            status = Path(f"/proc/{name}/status").read_text()
        except OSError:
            continue
        line = next(x for x in status.splitlines() if x.startswith("NSpid:"))
        if int(line.split()[-1]) == pid:
            return int(name)
    raise AssertionError(f"no process {pid} in pid namespace {namespace}")


@pytest.mark.slow
def test_on_the_host_a_containers_job_is_credited_with_its_own_memory(
    fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    # Job A (4G) runs in a pid namespace of its own and uses 6 GiB, which NVML lists under its
    # command's host pid. gpuwait on the host maps that pid into A's namespace and counts the
    # memory as A's (not as someone else's besides A's reservation); a host process that merely
    # has the number A's command has in its namespace is not taken for it.
    prefix = unshare_prefix()
    fake_nvml.set_gpus([FakeGpu(uuid="GPU-aaaa", total=24 * GIB)])
    stop = tmp_path / "stop"
    waiting = f"while [ ! -e {stop} ]; do sleep 0.05; done"
    job = [*GPUWAIT, "-q", "--vram", "4G", "--name", "a", "--", "sh", "-c", waiting]
    with started_inside([*prefix, *job], fake_nvml, stop):
        entry = wait_for(lambda: running_entry()["child_pid"] and running_entry(), timeout=30)
        command = host_pid_of(entry["child_pid"], entry["pidns"])
        fake_nvml.update_gpu(0, used=9 * GIB)
        fake_nvml.add_process(0, command, 6 * GIB)
        fake_nvml.add_process(0, entry["child_pid"], 3 * GIB)  # the same number, on the host
        status = subprocess.run(
            [*GPUWAIT, "status", "--json"],
            env=fake_nvml.env(),
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    (job,) = report["jobs"]
    assert job["other_pid_namespace"] is True
    assert job["observed_bytes"] == 6 * GIB
    (gpu,) = report["gpus"]
    assert gpu["per_process"] is True
    assert (gpu["external_bytes"], gpu["reserved_bytes"]) == (3 * GIB, 6 * GIB)


def test_a_container_given_one_of_the_machines_gpus_loses_none_of_the_others(
    fake_nvml: FakeNvml, tmp_path: Path, procs: Callable[..., subprocess.Popen[str]]
) -> None:
    # The host has three cards; a container sharing its state dir is given the third
    # (NVIDIA_VISIBLE_DEVICES=2), which NVML there numbers 0. Each reading there marked the
    # host's other cards lost: its status showed them LOST and the host's job "on a GPU that
    # is not answering now", and the host's event log said they were lost and back, again and
    # again.
    cards = [FakeGpu(uuid=f"GPU-{card}", total=24 * GIB) for card in "abc"]
    fake_nvml.set_gpus(cards)
    view = FakeNvml(fake_nvml.lib_dir, tmp_path / "view.state", tmp_path / "view.log", [cards[2]])
    inside = {**view.env(), "NVIDIA_VISIBLE_DEVICES": "2"}
    job = [*GPUWAIT, "--vram", "4G", "--devices", "0", "--", "sleep", "30"]
    procs(job, env=fake_nvml.env())
    wait_for(lambda: running_entry()["child_pid"], timeout=30)

    def gpuwait(*args: str, env: dict[str, str]) -> str:
        done = subprocess.run(
            [*GPUWAIT, *args], env=env, capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    gpuwait("--vram", "2G", "--", "true", env=inside)
    status = json.loads(gpuwait("status", "--json", env=inside))
    assert [(g["uuid"], g["index"], g["health"]) for g in status["gpus"]] == [("GPU-c", 0, "ok")]
    (host_job,) = status["jobs"]
    assert host_job["lost_gpus"] == []
    # Its GPU has no number there (the host's 0 is not the container's 0, which is GPU-c).
    assert host_job["gpu_indices"] == [None]
    running = gpuwait("status", env=inside).split("Running (1)\n")[1].splitlines()[1]
    assert running.split()[2] == "?", running
    log = gpuwait("log", "--json", env=fake_nvml.env())
    assert not [e for e in map(json.loads, log.splitlines()) if e["kind"].startswith("gpu_")]


def test_readings_in_a_container_keep_the_hosts_evidence_of_idle_holders(
    fake_nvml: FakeNvml,
    tmp_path: Path,
    procs: Callable[..., subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two quiet cards on the host, a forgotten process holding 3 GiB on each. A container
    # sharing the state dir is given the first card only, and has pids of its own (NVML's are
    # the host's there). Each reading in it (its `status`, `idle`, a waiter's) dropped what the
    # host had seen of both, so the host's `gpuwait idle` never named either of them.
    prefix = unshare_prefix()
    monkeypatch.setenv("GPUWAIT_IDLE_AFTER", "1s")
    cards = [FakeGpu(uuid=f"GPU-{card}", total=24 * GIB, used=3 * GIB, util=0) for card in "ab"]
    fake_nvml.set_gpus(cards)
    holders = [procs(["sleep", "60"]) for _ in cards]
    for index, holder in enumerate(holders):
        fake_nvml.add_process(index, holder.pid, 3 * GIB)
    view = FakeNvml(fake_nvml.lib_dir, tmp_path / "view.state", tmp_path / "view.log", [cards[0]])
    view.add_process(0, holders[0].pid, 3 * GIB)

    def idle(*inside: str, env: dict[str, str]) -> dict[str, Any]:
        done = subprocess.run(
            [*inside, *GPUWAIT, "idle", "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 0, done.stderr
        found: dict[str, Any] = json.loads(done.stdout)
        return found

    first = idle(env=fake_nvml.env())
    seen = time.monotonic()
    assert sorted(h["pid"] for h in first["watching"]) == sorted(h.pid for h in holders)
    idle(*prefix, env=view.env())
    time.sleep(max(0.0, 1.1 - (time.monotonic() - seen)))  # the host's idle_after passes
    named = idle(env=fake_nvml.env())["idle"]
    assert sorted(h["pid"] for h in named) == sorted(h.pid for h in holders)
