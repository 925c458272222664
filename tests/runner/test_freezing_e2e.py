"""Freezing end to end, on a simulated card: real gpuwait processes and simulated jobs, frozen
and thawed by the stand-in `cuda-checkpoint` (tests/helpers/fake_cuda_checkpoint), which moves a
simulated job's memory record aside as the driver moves device memory to host memory."""

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
from conftest import REPO
from helpers.fixtures_sim import hold_card, start_sim_job, start_wrapped_sim_job, wrapped_sim_job
from helpers.waiting import ledger_entries, sleeping_in, wait_for

from gpuwait.gpu.sim import (
    Allocation,
    live_allocations,
    load_sim_file,
    sim_lock,
    state_dir_for,
    write_allocation,
)
from gpuwait.linux import proc
from gpuwait.queue.ledger import Ledger

GiB = 2**30

FAKE_TOOL = REPO / "tests" / "helpers" / "fake_cuda_checkpoint" / "cuda-checkpoint"
#: pause_min_runtime here: a job younger than this is never asked to step aside.
MIN_RUNTIME = 1.0


@pytest.fixture
def tool_log(tmp_path: Path) -> Path:
    return tmp_path / "cuda-checkpoint.log"


@pytest.fixture
def one_card(
    sim_file: object, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tool_log: Path
) -> Path:
    """One simulated 24 GiB card, and the stand-in cuda-checkpoint first on PATH (run by this
    interpreter, so that it can read the simulation)."""
    path: Path = sim_file(gpus=1, memory="24GiB")  # type: ignore[operator]
    monkeypatch.setenv("GPUWAIT_PAUSE_MIN_RUNTIME", f"{MIN_RUNTIME:g}s")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "cuda-checkpoint"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE_TOOL} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_CUDA_CHECKPOINT_LOG", str(tool_log))
    return path


def events() -> list[dict[str, object]]:
    path = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def kinds() -> list[object]:
    return [e["kind"] for e in events()]


def low_job(gpuwait_cmd: list[str], report: Path, hold: str = "3s") -> subprocess.Popen[str]:
    """A low-priority --freezable simulated job holding 16 GiB, reporting what it held."""
    return start_wrapped_sim_job(
        gpuwait_cmd,
        ["--priority", "1", "--freezable", "--vram", "16G"],
        *("--vram", "16G", "--hold", hold, "--report", str(report)),
    )


def grown_low_job(
    gpuwait_cmd: list[str], vram: str, took: str, hold: str, report: Path, seen: str
) -> subprocess.Popen[str]:
    """A low-priority --freezable simulated job of `vram` that took `took` for `hold`, once it
    may be asked to step aside and its ledger entry has `seen` (past its reservation)."""
    low = start_wrapped_sim_job(
        gpuwait_cmd,
        ["--priority", "1", "--freezable", "--vram", vram],
        *("--vram", took, "--hold", hold, "--report", str(report)),
    )
    try:
        wait_until_old_enough()
        wait_for(
            lambda: any(j.get(seen) for j in ledger_entries()),
            timeout=60,
            message=lambda: f"never seen past its reservation: {ledger_entries()}",
        )
    except BaseException:
        reap(low)
        raise
    return low


def wait_until_old_enough(min_runtime: float = MIN_RUNTIME) -> dict[str, object]:
    """The one running job, once it may be asked to step aside and holds its memory."""

    def ready() -> dict[str, object] | None:
        running = [j for j in ledger_entries() if j["state"] == "running"]
        if len(running) != 1 or not running[0].get("child_pid"):
            return None
        job = running[0]
        record = Path(str(os.environ["GPUWAIT_SIM"]) + ".d") / f"{job['child_pid']}.json"
        old = time.time() - float(job["started_at"]) > min_runtime
        return job if old and record.exists() else None

    job: dict[str, object] = wait_for(
        ready, timeout=60, interval=0.05, message=lambda: f"never ready: {ledger_entries()}"
    )
    return job


def process_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


def reap(*jobs: subprocess.Popen[str]) -> None:
    for job in jobs:
        if job.poll() is None:
            job.kill()
        job.wait(timeout=30)


def succeeded(*jobs: subprocess.Popen[str]) -> list[str]:
    """What each of `jobs` said on stderr, once each has ended with status 0 (in this order)."""
    said = []
    for job in jobs:
        _, err = job.communicate(timeout=60)
        assert job.returncode == 0, err
        said.append(err)
    return said


def test_a_frozen_job_makes_room_and_is_thawed_on_its_gpu(
    one_card: Path, gpuwait_cmd: list[str], tmp_path: Path, tool_log: Path
) -> None:
    bare_report = tmp_path / "bare.json"
    bare = subprocess.run(
        [*gpuwait_cmd, "sim", "job", "--vram", "16G", "--hold", "0s", "--report", str(bare_report)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"},
    )
    assert bare.returncode == 0, bare.stderr
    report = tmp_path / "low.json"
    low = low_job(gpuwait_cmd, report)
    urgent = None
    try:
        job = wait_until_old_enough()
        child = int(str(job["child_pid"]))
        urgent = hold_card(gpuwait_cmd, "16G", "2s", "--priority", "5")
        wait_for(lambda: "freeze" in kinds(), timeout=60, message=lambda: f"{events()}")
        # Frozen: its memory is off the card (moved aside, as to host memory), it is stopped,
        # and its entry waits, pinned to its GPU.
        record = Path(str(one_card) + ".d") / f"{child}.json"
        assert not record.exists()
        assert process_state(child) in ("T", "t")
        (frozen,) = [j for j in ledger_entries() if j["id"] == job["id"]]
        assert frozen["frozen_gpus"] == job["gpu_uuids"] and frozen["frozen_at"]
        status = subprocess.run(
            [*gpuwait_cmd, "status", "--json"], capture_output=True, text=True, timeout=60
        )
        shown = next(j for j in json.loads(status.stdout)["jobs"] if j["id"] == job["id"])
        assert shown["frozen"]["gpu_uuids"] == job["gpu_uuids"]
        text = subprocess.run([*gpuwait_cmd, "status"], capture_output=True, text=True, timeout=60)
        assert "frozen" in text.stdout
        _, low_err = succeeded(urgent, low)
    finally:
        reap(low, *([urgent] if urgent else []))
    # The frozen job noticed nothing: it held what a bare run holds, with no OOM.
    held, bare_held = json.loads(report.read_text()), json.loads(bare_report.read_text())
    for key in ("peak_bytes", "oom", "gpu_uuid", "cap_bytes"):
        assert held[key] == bare_held[key]
    assert "frozen" in low_err and "thawed" in low_err
    # The order the driver needs, each step once; the thaw came after the urgent job ended,
    # through an admission on the same GPU.
    steps = [line.split()[0] for line in tool_log.read_text().splitlines()]
    assert steps == ["lock", "checkpoint", "restore", "unlock"]
    said = events()
    order = [e["kind"] for e in said if e.get("job") == job["id"]]
    assert order[-4:] == ["freeze", "admit", "thaw", "finish"], order
    urgent_end = next(e for e in said if e["kind"] == "finish" and e["job"] != job["id"])
    thaw = next(e for e in said if e["kind"] == "thaw")
    assert float(str(thaw["time"])) >= float(str(urgent_end["time"]))
    readmitted = [e for e in said if e["kind"] == "admit" and e["job"] == job["id"]]
    assert readmitted[-1]["gpus"] == job["gpu_uuids"]
    assert not any(e.get("oom") for e in said if e["kind"] == "finish")
    log = subprocess.run([*gpuwait_cmd, "log"], capture_output=True, text=True, timeout=60)
    assert " frozen on GPU0 " in log.stdout and " thawed after " in log.stdout


def test_a_failing_freeze_leaves_the_job_running_and_the_urgent_one_waits(
    one_card: Path,
    gpuwait_cmd: list[str],
    tmp_path: Path,
    tool_log: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FAKE_CUDA_CHECKPOINT_FAIL", "checkpoint")
    report = tmp_path / "low.json"
    low = low_job(gpuwait_cmd, report, hold="4s")
    urgent = None
    try:
        job = wait_until_old_enough()
        child = int(str(job["child_pid"]))
        urgent = hold_card(gpuwait_cmd, "16G", "1s", "--priority", "5")
        wait_for(lambda: "freeze-failed" in kinds(), timeout=60, message=lambda: f"{events()}")
        # Undone and running on: unlocked again, never stopped, its memory on the card.
        assert process_state(child) not in ("T", "t")
        assert (Path(str(one_card) + ".d") / f"{child}.json").exists()
        _, low_err = low.communicate(timeout=60)
        assert low.returncode == 0, low_err
        _, err = urgent.communicate(timeout=60)
        assert urgent.returncode == 0, err
    finally:
        reap(low, *([urgent] if urgent else []))
    assert "could not be frozen and runs on" in low_err
    steps = [line.split()[0] for line in tool_log.read_text().splitlines()]
    assert steps == ["lock", "checkpoint", "unlock"]
    said = events()
    failed = next(e for e in said if e["kind"] == "freeze-failed")
    assert "injected" in str(failed["error"]) and "\n" not in str(failed["error"])
    assert "freeze" not in kinds()
    # The urgent job started only once the low one had ended: no OOM anywhere.
    low_end = next(e for e in said if e["kind"] == "finish" and e["job"] == job["id"])
    urgent_start = next(e for e in said if e["kind"] == "start" and e["job"] != job["id"])
    assert float(str(urgent_start["time"])) >= float(str(low_end["time"]))
    assert not any(e.get("oom") for e in said if e["kind"] == "finish")
    log = subprocess.run([*gpuwait_cmd, "log"], capture_output=True, text=True, timeout=60)
    assert "could not be frozen, runs on: cuda-checkpoint --action checkpoint" in log.stdout


def test_refused_in_one_line_without_cuda_checkpoint(
    sim_file: object, gpuwait_cmd: list[str]
) -> None:
    sim_file(gpus=1)  # type: ignore[operator]
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [*gpuwait_cmd, "--freezable", "--vram", "1G", "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 2
    assert done.stderr == (
        "gpuwait: error: --freezable: this machine cannot freeze CUDA jobs (no cuda-checkpoint "
        "on PATH); use --pausable with a job that checkpoints itself (see docs/freezing.md)\n"
    )
    assert done.stdout == ""


def test_freezable_and_pausable_are_refused_together(
    one_card: Path, gpuwait_cmd: list[str]
) -> None:
    done = subprocess.run(
        [*gpuwait_cmd, "--freezable", "--pausable", "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr == (
        "gpuwait: error: --freezable and --pausable are two ways to step aside; give one (see "
        "docs/freezing.md)\n"
    )


def test_the_stand_in_keeps_the_drivers_state_machine(one_card: Path, tmp_path: Path) -> None:
    sleeper = subprocess.Popen(["sleep", "30"])
    try:

        def tool(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                ["cuda-checkpoint", *args, "--pid", str(sleeper.pid)],
                capture_output=True,
                text=True,
                timeout=30,
            )

        assert tool("--get-state").stdout == "running\n"
        for wrong in ("checkpoint", "restore", "unlock"):
            refused = tool("--action", wrong)
            assert refused.returncode == 1 and "it is running" in refused.stderr
        assert tool("--action", "lock", "--timeout", "1000").returncode == 0
        assert tool("--get-state").stdout == "locked\n"
        assert tool("--action", "lock").returncode == 1
        assert tool("--action", "checkpoint").returncode == 0
        assert tool("--get-state").stdout == "checkpointed\n"
        assert tool("--action", "unlock").returncode == 1
        assert tool("--action", "restore").returncode == 0
        assert tool("--action", "unlock").returncode == 0
        assert tool("--get-state").stdout == "running\n"
    finally:
        sleeper.kill()
        sleeper.wait(timeout=30)


def test_the_stand_in_restores_under_the_simulations_lock(one_card: Path) -> None:
    """As the driver's, the stand-in's restore and another process's allocation at the same
    instant cannot both succeed on a card too small for the two: one runs out of memory."""
    job = start_sim_job("--vram", "16G", "--hold", "60s")
    other = subprocess.Popen(["sleep", "60"])
    try:
        record = state_dir_for(one_card) / f"{job.pid}.json"
        wait_for(record.exists, timeout=30, message=lambda: f"{job.poll()} {job.stderr}")
        for action in ("lock", "checkpoint"):
            done = subprocess.run(["cuda-checkpoint", "--action", action, "--pid", str(job.pid)])
            assert done.returncode == 0
        config = load_sim_file(one_card)
        with sim_lock(config) as directory:  # as a job deciding on an allocation holds it
            restore = subprocess.Popen(
                ["cuda-checkpoint", "--action", "restore", "--pid", str(job.pid)],
                stderr=subprocess.PIPE,
                text=True,
            )
            wait_for(lambda: restore.poll() is not None or sleeping_in(restore.pid, "flock"))
            started = proc.start_time(other.pid)
            assert started is not None
            # The allocation decided under the lock: the card's room goes to it.
            write_allocation(
                directory, Allocation(other.pid, started, config.gpus[0].uuid, 16 * GiB)
            )
        _, err = restore.communicate(timeout=30)
        assert restore.returncode == 1 and "CUDA_ERROR_OUT_OF_MEMORY" in err, err
        used = sum(a.bytes for a in live_allocations(config))
        assert used == 16 * GiB
    finally:
        reap(job)
        other.kill()
        other.wait(timeout=30)


def test_a_job_the_stand_in_locked_allocates_nothing_until_unlocked(
    one_card: Path, tmp_path: Path
) -> None:
    """As the driver blocks a locked process's CUDA calls, a simulated job locked by the stand-in
    grows no more, so its memory moved to host memory stays off the card, and no stop sent
    then can catch it holding the simulation's lock; unlocked, it grows to its full size."""
    report = tmp_path / "report.json"
    job = start_sim_job("--vram", "8G", "--ramp", "0.6s", "--hold", "0", "--report", str(report))
    try:
        record = state_dir_for(one_card) / f"{job.pid}.json"
        wait_for(record.exists, timeout=30, message=lambda: f"{job.poll()} {job.stderr}")

        def tool(action: str) -> None:
            done = subprocess.run(["cuda-checkpoint", "--action", action, "--pid", str(job.pid)])
            assert done.returncode == 0

        tool("lock")
        tool("checkpoint")
        config = load_sim_file(one_card)
        deadline = time.monotonic() + 0.8  # past the end of its ramp
        while time.monotonic() < deadline:
            assert not record.exists(), "a locked job went on allocating"
            assert job.poll() is None
            with sim_lock(config):  # never held by the locked job
                pass
            time.sleep(0.02)
        tool("restore")
        tool("unlock")
        _, err = job.communicate(timeout=30)
    finally:
        reap(job)
    assert job.returncode == 0, err
    assert json.loads(report.read_text())["peak_bytes"] == 8 * GiB


def frozen_low_job(
    gpuwait_cmd: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    while_frozen: Callable[[], object] = lambda: None,
) -> tuple[subprocess.Popen[str], int]:
    """A long --freezable job, frozen for an urgent one that runs briefly, `while_frozen` done
    before that one ends: (its gpuwait, the command's pid). Its GPU errors are given half a
    second (gpu_error_timeout)."""
    monkeypatch.setenv("GPUWAIT_GPU_ERROR_TIMEOUT", "0.5s")
    monkeypatch.setenv("GPUWAIT_PAUSE_MIN_RUNTIME", "0.3s")
    low = low_job(gpuwait_cmd, tmp_path / "low.json", hold="60s")
    urgent = None
    try:
        child = int(str(wait_until_old_enough(0.3)["child_pid"]))
        urgent = hold_card(gpuwait_cmd, "16G", "0.3s", "--priority", "5")
        wait_for(lambda: "freeze" in kinds(), timeout=60, message=lambda: f"{events()}")
        while_frozen()
        urgent.communicate(timeout=60)
    except BaseException:
        reap(low, *([urgent] if urgent else []))
        raise
    return low, child


def ended_for_good(low: subprocess.Popen[str], child: int) -> str:
    """What the frozen job's gpuwait said, once it ended with exit 4, its command gone and its
    entry out of the ledger."""
    try:
        _, err = low.communicate(timeout=20)
    finally:
        reap(low)
    assert low.returncode == 4, err
    assert not Path(f"/proc/{child}").exists()
    assert ledger_entries() == []
    assert "Traceback" not in err
    return err


def test_a_frozen_job_whose_gpu_is_lost_is_ended_after_gpu_error_timeout(
    one_card: Path,
    sim_file: Any,
    gpuwait_cmd: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Its GPU lost while it was frozen, it waited for ever ("no usable GPU right now"), its
    # command stopped, its memory in host memory.
    low, child = frozen_low_job(
        gpuwait_cmd, tmp_path, monkeypatch, lambda: sim_file(gpus=1, memory="24GiB", lost=True)
    )
    err = ended_for_good(low, child)
    assert "could not be thawed: GPU0, where its memory can come back, has not answered" in err
    assert "(GPU is lost), longer than gpu_error_timeout = 500ms; its command was ended" in err


def test_a_frozen_job_that_cannot_be_thawed_is_ended_after_gpu_error_timeout(
    one_card: Path, gpuwait_cmd: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every restore failing (a GPU fallen off the bus answers so), the thaw was tried every 2 s
    # for ever, its room reserved all along.
    monkeypatch.setenv("FAKE_CUDA_CHECKPOINT_FAIL", "restore")
    low, child = frozen_low_job(gpuwait_cmd, tmp_path, monkeypatch)
    err = ended_for_good(low, child)
    assert "could not be thawed: cuda-checkpoint --action restore" in err, err
    assert "(injected) (failing for " in err
    assert "), longer than gpu_error_timeout = 500ms; its command was ended" in err


def test_the_time_a_job_was_frozen_is_no_run_time_of_its(
    one_card: Path, gpuwait_cmd: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Frozen, the job held no memory and did no work, yet its record counted the time as run
    # time: the run time its command's next runs were expected to take, and the VRAM-hours its
    # user was charged for (fair share), grew by every hour it spent frozen.
    monkeypatch.setenv("GPUWAIT_PAUSE_MIN_RUNTIME", "300ms")
    low = low_job(gpuwait_cmd, tmp_path / "low.json", hold="1s")
    urgent = None
    try:
        job = wait_until_old_enough(0.3)
        urgent = hold_card(gpuwait_cmd, "16G", "1.5s", "--priority", "5")
        _, low_err = low.communicate(timeout=60)
        assert low.returncode == 0, low_err
    finally:
        reap(low, *([urgent] if urgent else []))
    said = events()
    (thaw,) = [e for e in said if e["kind"] == "thaw"]
    (ended,) = [e for e in said if e["kind"] == "finish" and e["job"] == job["id"]]
    history = subprocess.run(
        [*gpuwait_cmd, "history", "--json"], capture_output=True, text=True, timeout=60
    )
    (record,) = [r for r in json.loads(history.stdout) if r["job_id"] == job["id"]]
    # From its start to its end, less the time it was frozen (the thaw's figure also counts
    # the restore, run time of the job's: half of it is left out here, whatever the machine).
    command_lived = float(str(ended["time"])) - record["started_at"]
    frozen = float(str(thaw["frozen_seconds"]))
    assert record["run_seconds"] <= command_lived - frozen / 2, (record, frozen)
    # Nor is it charged to its user's fair-share usage: both jobs reserve 16 GiB, and the low
    # one held it from its start to its end but for the freeze.
    starts = {str(e["job"]): float(str(e["time"])) for e in said if e["kind"] == "start"}
    ends = {str(e["job"]): float(str(e["time"])) for e in said if e["kind"] == "finish"}
    held = sum(ends[job] - starts[job] for job in ends) - frozen
    (usage,) = Ledger(Path(os.environ["XDG_STATE_HOME"]) / "gpuwait").read().usage.values()
    charged = usage.vram_seconds / (16 * GiB)
    # Charged the freeze, it would be `held + frozen` (the urgent job held the card 1.5 s). The
    # events' times and the charge are taken a few steps apart, further under load (0.43 s
    # seen on a busy machine): half the freeze is the margin, as for the run time above.
    assert held - 0.3 <= charged < held + frozen / 2, (charged, held, frozen)


def test_a_job_killed_after_a_thaw_is_charged_its_run_before_the_freeze(
    one_card: Path, gpuwait_cmd: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kill -9` of a job that was frozen and thawed: what it held before the freeze counts in
    its user's fair-share usage once its entry is reaped, as it would have had it ended on its
    own, and not only what it held since the thaw."""
    monkeypatch.setenv("GPUWAIT_PAUSE_MIN_RUNTIME", "300ms")
    options = ["--priority", "1", "--freezable", "--vram", "16G"]
    low = subprocess.Popen(
        wrapped_sim_job(gpuwait_cmd, options, "--vram", "16G", "--hold", "60s"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    urgent = None
    try:
        job = wait_until_old_enough(0.7)  # more than the slack below: its run to the freeze
        urgent = hold_card(gpuwait_cmd, "16G", "0.3s", "--priority", "5")
        urgent.communicate(timeout=60)
        entry = wait_for(
            lambda: (
                next(
                    (j for j in ledger_entries() if j["id"] == job["id"] and j.get("child_pid")),
                    None,
                )
                if "thaw" in kinds()
                else None
            ),
            timeout=60,
        )
        os.killpg(low.pid, 9)
        killed = time.time()
        low.wait(timeout=30)
        child = int(str(entry["child_pid"]))
        wait_for(lambda: not proc.is_alive(child, entry.get("child_start_time")), timeout=30)
    finally:
        reap(low, *([urgent] if urgent else []))
    subprocess.run([*gpuwait_cmd, "status"], capture_output=True, timeout=60, check=True)
    said = events()
    low_at = {str(e["kind"]): float(str(e["time"])) for e in said if e.get("job") == job["id"]}
    other = {str(e["kind"]): float(str(e["time"])) for e in said if e.get("job") != job["id"]}
    # The low job before its freeze and since its thaw until it was killed; the urgent one.
    held = (low_at["freeze"] - low_at["start"]) + (killed - low_at["thaw"])
    held += other["finish"] - other["start"]
    (usage,) = Ledger(Path(os.environ["XDG_STATE_HOME"]) / "gpuwait").read().usage.values()
    assert usage.vram_seconds / (16 * GiB) >= held - 0.3, (held, usage)


@pytest.mark.parametrize("vram", ["4G", "17%"])
def test_a_frozen_job_that_grew_past_its_reservation_is_thawed_only_into_room_for_all_it_held(
    one_card: Path, gpuwait_cmd: list[str], tmp_path: Path, vram: str
) -> None:
    # A --vram 4G job (or 17%, 4.1 GiB of the card) that holds 14 GiB is frozen for an urgent
    # 16 GiB job that loads over 2 s. Thawed into the 5.6 GiB left beside the urgent one (its
    # 4 GiB fit), it would bring its 14 GiB back while the urgent one is still loading (a thaw
    # is decided at the frozen job's next look, a fraction of a second after the urgent one
    # starts), and that one would run out.
    low = grown_low_job(gpuwait_cmd, vram, "14G", "4s", tmp_path / "low.json", "overuse_since")
    urgent = None
    try:
        urgent = start_wrapped_sim_job(
            gpuwait_cmd,
            ["--priority", "5", "--vram", "16G"],
            *("--vram", "16G", "--ramp", "2s", "--hold", "1s"),
        )
        succeeded(urgent, low)
    finally:
        reap(low, *([urgent] if urgent else []))
    assert "freeze" in kinds()
    assert not any(e.get("oom") for e in events() if e["kind"] == "finish"), events()


def test_a_frozen_job_that_took_nearly_all_its_card_is_thawed_once_the_card_is_free_again(
    one_card: Path, sim_file: Any, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # A --vram 4G job that took 23 GiB of the 24 GiB card (TensorFlow takes nearly all) beside
    # the 0.5 GiB the driver keeps is frozen for an urgent job. Once that has ended the card
    # is as it was before the freeze, but the frozen job waited for 21.6 GiB (its safety's
    # share) beside the driver's 0.5 GiB, which never comes: it was never thawed.
    sim_file(gpus=1, memory="24GiB", driver_reserved="512MiB", file=one_card)
    low = grown_low_job(gpuwait_cmd, "4G", "23G", "3s", tmp_path / "low.json", "grown")
    urgent = None
    try:
        urgent = start_wrapped_sim_job(
            gpuwait_cmd, ["--priority", "5", "--vram", "4G"], "--vram", "4G"
        )
        succeeded(urgent, low)
    finally:
        reap(low, *([urgent] if urgent else []))
    assert "freeze" in kinds() and "thaw" in kinds(), kinds()
