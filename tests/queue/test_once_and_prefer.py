"""`--once KEY` (a submission that may fire twice queues once) and `--prefer` (preferred GPUs
with spill-over), with real gpuwait processes on simulated GPUs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.fixtures_sim import Run, SimFileFactory
from helpers.waiting import ledger_entries, wait_for

from gpuwait.core.errors import EXIT_ALREADY_QUEUED

PRINT_VISIBLE = [sys.executable, "-c", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"]


def uuids() -> list[str]:
    from gpuwait.gpu.sim import SimBackend

    return [g.uuid for g in SimBackend(os.environ["GPUWAIT_SIM"]).snapshot().gpus]


def until_go(tmp_path: Path) -> list[str]:
    """A command that notes it ran, then runs until the test creates `go`."""
    script = f"echo ran >> {tmp_path}/ran; while [ ! -e {tmp_path}/go ]; do sleep 0.05; done"
    return ["sh", "-c", script]


def hold_card(
    procs: Callable[..., subprocess.Popen[Any]], gpuwait_cmd: list[str], *options: str
) -> subprocess.Popen[Any]:
    """A gpuwait job whose reservation takes 20 GiB of a simulated card for a minute."""
    return procs([*gpuwait_cmd, "--vram", "20G", *options, "--", "sleep", "60"])


# --- --once -----------------------------------------------------------------------------------


def test_five_simultaneous_submits_with_one_key_queue_exactly_once(
    sim_file: SimFileFactory,
    gpuwait_cmd: list[str],
    tmp_path: Path,
    procs: Callable[..., subprocess.Popen[Any]],
) -> None:
    sim_file(gpus=1)
    argv = [*gpuwait_cmd, "--once", "nightly", "--vram", "4G", "--", *until_go(tmp_path)]
    # As cron or make firing several times at once: no process waits for another to start.
    submits = [procs(argv) for _ in range(5)]
    deadline = time.monotonic() + 60
    while sum(p.poll() is not None for p in submits) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    refused = [p for p in submits if p.poll() is not None]
    assert len(refused) == 4, [p.communicate()[1] for p in refused]
    (kept,) = [p for p in submits if p.poll() is None]
    wait_for(lambda: (tmp_path / "ran").exists())
    (entry,) = ledger_entries()
    assert entry["once"] == "nightly"
    for p in refused:
        err = p.communicate()[1]
        assert p.returncode == EXIT_ALREADY_QUEUED, err
        assert err.startswith(f"gpuwait: error: --once nightly: job {entry['id']} ")
        assert "nothing was queued" in err.splitlines()[0]
    (tmp_path / "go").touch()
    assert kept.wait(60) == 0
    assert (tmp_path / "ran").read_text() == "ran\n"


def test_a_waiting_job_keeps_its_key_and_the_key_is_free_once_it_ended(
    sim_file: SimFileFactory,
    gpuwait_cmd: list[str],
    run_gpuwait: Run,
    procs: Callable[..., subprocess.Popen[Any]],
) -> None:
    sim_file(gpus=1)
    holder = hold_card(procs, gpuwait_cmd, "--name", "holder")
    wait_for(lambda: any(j.get("state") == "running" for j in ledger_entries()))
    waiting = procs(
        [*gpuwait_cmd, "--once", "sync", "--name", "first", "--vram", "8G", "--", "true"]
    )
    wait_for(lambda: any(j.get("name") == "first" for j in ledger_entries()))
    status = json.loads(run_gpuwait("status", "--json").stdout)
    (first,) = [j for j in status["jobs"] if j["name"] == "first"]
    assert (first["state"], first["once"]) == ("waiting", "sync")

    again = run_gpuwait("--once", "sync", "--vram", "1G", "--", "true")
    assert again.returncode == EXIT_ALREADY_QUEUED
    assert f"job {first['id']} (first) with this key is already waiting" in again.stderr
    # Another key, or none, is not held back by it.
    other = procs([*gpuwait_cmd, "--once", "other", "--name", "other", "--", "true"])
    wait_for(lambda: any(j.get("name") == "other" for j in ledger_entries()))

    holder.send_signal(signal.SIGTERM)
    holder.communicate()
    assert waiting.wait(60) == 0, waiting.communicate()[1]
    assert other.wait(60) == 0, other.communicate()[1]
    later = run_gpuwait("--once", "sync", "--vram", "1G", "--", "true")
    assert later.returncode == 0, later.stderr


def test_once_key_must_be_a_plain_name(run_gpuwait: Run, sim_file: SimFileFactory) -> None:
    sim_file(gpus=1)
    done = run_gpuwait("--once", "a b", "--vram", "1G", "--", "true")
    assert done.returncode == 2
    assert done.stderr.startswith("gpuwait: error: --once 'a b'")


# --- --prefer ---------------------------------------------------------------------------------


def test_the_preferred_gpu_is_taken_when_the_job_fits_there(
    sim_file: SimFileFactory, run_gpuwait: Run
) -> None:
    sim_file(gpus=3)
    gpus = uuids()
    # Without a preference, best-fit takes the first of equally empty cards.
    plain = run_gpuwait("--vram", "4G", "--", *PRINT_VISIBLE)
    assert plain.stdout.strip() == gpus[0], plain.stderr
    preferred = run_gpuwait("--prefer", "2", "--vram", "4G", "--", *PRINT_VISIBLE)
    assert preferred.stdout.strip() == gpus[2], preferred.stderr
    # The setting says the same, by UUID here.
    by_setting = run_gpuwait(
        "--vram", "4G", "--", *PRINT_VISIBLE, env={"GPUWAIT_PREFER": f"1,{gpus[2]}"}
    )
    assert by_setting.stdout.strip() == gpus[1], by_setting.stderr


def test_spills_over_at_once_when_no_preferred_gpu_fits(
    sim_file: SimFileFactory,
    gpuwait_cmd: list[str],
    run_gpuwait: Run,
    procs: Callable[..., subprocess.Popen[Any]],
) -> None:
    sim_file(gpus=2)
    gpus = uuids()
    holder = hold_card(procs, gpuwait_cmd, "--devices", "1")
    wait_for(lambda: any(j.get("state") == "running" for j in ledger_entries()))
    started = time.monotonic()
    spilled = run_gpuwait("--prefer", "1", "--vram", "8G", "--", *PRINT_VISIBLE)
    assert spilled.returncode == 0, spilled.stderr
    assert spilled.stdout.strip() == gpus[0]
    # It did not wait for the preferred card, which stays full for a minute.
    assert time.monotonic() - started < 30
    assert holder.poll() is None


def test_a_preferred_gpu_that_is_not_here_is_a_usage_error(
    sim_file: SimFileFactory, run_gpuwait: Run
) -> None:
    sim_file(gpus=2)
    done = run_gpuwait("--prefer", "7", "--vram", "1G", "--", "true")
    assert done.returncode == 2
    assert done.stderr.startswith("gpuwait: error: prefer '7': no GPU '7' here")
    bad = run_gpuwait("--vram", "1G", "--", "true", env={"GPUWAIT_PREFER": "fast"})
    assert bad.returncode == 2
    assert "GPUWAIT_PREFER" in bad.stderr


@pytest.mark.parametrize("setting", ["GPUWAIT_PREFER=0", "GPUWAIT_PREFER=GPU-1111aaaa"])
def test_a_preferred_gpu_that_does_not_answer_keeps_no_job_waiting(
    sim_file: SimFileFactory, run_gpuwait: Run, setting: str
) -> None:
    # GPU 0, preferred in the user's settings, fell off the bus: every launch was retried as if
    # it needed that GPU, for gpuwait_timeout (5 min), then ended with exit 4, GPU 1 free.
    sim_file(gpus=2, uuid=["GPU-1111aaaa", "GPU-2222bbbb"], lost=[True, False])
    name, _, value = setting.partition("=")
    done = run_gpuwait(
        "--vram", "1G", "--", *PRINT_VISIBLE, env={name: value, "GPUWAIT_GPU_ERROR_TIMEOUT": "3s"}
    )
    assert (done.returncode, done.stdout) == (0, "GPU-2222bbbb\n"), done.stderr
    weighted = run_gpuwait(
        *("--pick", "weighted", "--vram", "1G", "--", *PRINT_VISIBLE),
        env={"GPUWAIT_GPU_WEIGHTS": f"{value}=3", "GPUWAIT_GPU_ERROR_TIMEOUT": "3s"},
    )
    assert (weighted.returncode, weighted.stdout) == (0, "GPU-2222bbbb\n"), weighted.stderr


def test_gpu_weights_name_gpus_as_devices_and_prefer_do(
    sim_file: SimFileFactory, run_gpuwait: Run
) -> None:
    # A UUID prefix, as the docs' example gives, was taken for no GPU and silently weighed
    # nothing: both cards stayed at weight 1 and the job went to GPU 0.
    sim_file(gpus=2)
    gpus = uuids()
    weighted = ["--pick", "weighted", "--vram", "1G", "--", *PRINT_VISIBLE]
    by_prefix = run_gpuwait(*weighted, env={"GPUWAIT_GPU_WEIGHTS": f"{gpus[1][:12]}=3"})
    assert by_prefix.stdout.strip() == gpus[1], by_prefix.stderr
    # A GPU that is not here is a usage error, by UUID as by index.
    for key in ("7", "GPU-00000000"):
        done = run_gpuwait(*weighted, env={"GPUWAIT_GPU_WEIGHTS": f"{key}=3"})
        assert done.returncode == 2, done.stderr
        assert f"no GPU '{key}' here" in done.stderr
