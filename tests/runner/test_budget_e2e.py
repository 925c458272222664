"""Budgets as a user meets them, on simulated GPUs with real processes: a job that grows past its
reservation fails alone under `--enforce limit` (and takes a neighbour with it without), the
command gets the documented variables, `status` says how each budget is held, and an OOM at a
job's own limit is recorded and retried as one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import fixtures_sim
from helpers.fixtures_sim import SimFileFactory, wrapped_sim_job
from helpers.history import recorded_runs
from helpers.processes import unshare_prefix
from helpers.waiting import ledger_entries, wait_for

GPUWAIT = [sys.executable, "-m", "gpuwait"]
SHOW_ENV = "import json, os; print(json.dumps(dict(os.environ)))"
GiB = 2**30


def gpuwait(*args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*GPUWAIT, *args], capture_output=True, text=True, timeout=120, **kw)


def run_sim_job(
    options: list[str], *job: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return fixtures_sim.run_sim_job(GPUWAIT, options, *job, env={**(env or {})})


def limited(
    vram: str, *job: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`gpuwait --enforce limit --vram VRAM -- gpuwait sim job JOB...`."""
    return run_sim_job(["--enforce", "limit", "--vram", vram], *job, env=env)


def job_env(*options: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a command gets from `gpuwait OPTIONS`."""
    done = gpuwait(
        *options, "--", sys.executable, "-c", SHOW_ENV, env={**os.environ, **(env or {})}
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


FRAMEWORK_VARS = (
    "GPUWAIT_VRAM_FRACTION",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "XLA_CLIENT_MEM_FRACTION",
    "TF_FORCE_GPU_ALLOW_GROWTH",
    "GPUWAIT_TORCH_MEMORY_FRACTION",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
)


def exported(env: dict[str, str]) -> dict[str, str]:
    return {name: env[name] for name in FRAMEWORK_VARS if name in env}


def test_each_mode_exports_what_the_docs_say(sim_file: SimFileFactory) -> None:
    sim_file(gpus=1, memory="8GiB")
    assert exported(job_env("--vram", "2G", "--enforce", "off")) == {
        "GPUWAIT_VRAM_FRACTION": "0.25"
    }
    assert exported(job_env("--vram", "2G")) == {  # hint is the default
        "GPUWAIT_VRAM_FRACTION": "0.25",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.25",
        "XLA_CLIENT_MEM_FRACTION": "0.25",
        "TF_FORCE_GPU_ALLOW_GROWTH": "true",
    }
    limited = job_env("--vram", "2G", "--enforce", "limit", env={"PYTHONPATH": "/mine"})
    assert exported(limited) == {
        "GPUWAIT_VRAM_FRACTION": "0.25",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.25",
        "XLA_CLIENT_MEM_FRACTION": "0.25",
        "TF_FORCE_GPU_ALLOW_GROWTH": "true",
        "GPUWAIT_TORCH_MEMORY_FRACTION": "0.25",
    }
    hook, mine = limited["PYTHONPATH"].split(":")
    assert Path(hook, "sitecustomize.py").is_file()
    assert mine == "/mine"
    # The setting works as every other does: from the environment and the config file too.
    assert "GPUWAIT_TORCH_MEMORY_FRACTION" in job_env(
        "--vram", "2G", env={"GPUWAIT_ENFORCE": "limit"}
    )
    shown = gpuwait("config")
    assert any(line.split()[:2] == ["enforce", "hint"] for line in shown.stdout.splitlines()), (
        shown.stdout
    )


ON_THE_SECOND_CARD = (
    "import os, subprocess, sys\n"
    "first, second = os.environ['CUDA_VISIBLE_DEVICES'].split(',')\n"
    "job = ['gpuwait', 'sim', 'job', '--vram', '5G', '--hold', '0s']\n"
    "env = {**os.environ, 'CUDA_VISIBLE_DEVICES': second + ',' + first}\n"
    "sys.exit(subprocess.run([sys.executable, '-m', *job], env=env).returncode)"
)


def test_each_card_of_a_mixed_gang_lets_the_job_have_its_reservation(
    sim_file: SimFileFactory,
) -> None:
    # A gang on a 16 GiB and an 8 GiB card: the fraction is of the larger one (0.375 for 6 GiB),
    # which on the smaller card is 3 GiB. The rank there must still get its whole 6 GiB.
    sim_file(gpus=2, memory=["16GiB", "8GiB"])
    done = gpuwait(
        *("--gpus", "2", "--vram", "6G", "--enforce", "limit"),
        *("--", sys.executable, "-c", ON_THE_SECOND_CARD),
    )
    assert done.returncode == 0, done.stderr


TWO_PROCESSES = (
    "import subprocess, sys\n"
    "job = [sys.executable, '-m', 'gpuwait', 'sim', 'job', '--vram', '1.5G', '--hold', '0.8s']\n"
    "both = [subprocess.Popen(job) for _ in range(2)]\n"
    "sys.exit(max(p.wait() for p in both))"
)


def test_several_processes_past_a_per_process_cap_are_called_out(
    sim_file: SimFileFactory,
) -> None:
    # The PyTorch cap holds each process to the 2 GiB reservation: two of them take 3 GiB.
    sim_file(gpus=1, memory="8GiB")
    done = gpuwait(
        *("--vram", "2G", "--enforce", "limit"), *("--", sys.executable, "-c", TWO_PROCESSES)
    )
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if "not all of them together" in line]
    assert len(said) == 1, done.stderr
    assert "2 processes of the command" in said[0] and "PyTorch allocator cap" in said[0]


def test_variables_the_user_set_are_kept(sim_file: SimFileFactory) -> None:
    sim_file(gpus=1, memory="8GiB")
    mine = {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".6", "TF_FORCE_GPU_ALLOW_GROWTH": "false"}
    env = job_env("--vram", "2G", "--enforce", "limit", env=mine)
    for name, value in mine.items():
        assert env[name] == value
    assert "XLA_CLIENT_MEM_FRACTION" not in env


@pytest.mark.parametrize("pythonpath", [":/mine", "/mine:", "/mine::/lib"])
def test_a_pythonpath_that_names_the_current_directory_still_does_under_a_limit(
    sim_file: SimFileFactory, tmp_path: Path, pythonpath: str
) -> None:
    """An empty entry of PYTHONPATH is the current directory to Python: what
    `export PYTHONPATH=$PYTHONPATH:/mine` leaves with nothing before it. A script in a
    subdirectory that imports a module of the project's top directory works so bare, and does
    under `--enforce limit` too, which puts its hook first on PYTHONPATH."""
    sim_file(gpus=1, memory="8GiB")
    (tmp_path / "tools").mkdir()
    (tmp_path / "mylib.py").write_text("ANSWER = 42\n")
    (tmp_path / "tools" / "train.py").write_text("import mylib\nprint(mylib.ANSWER)\n")
    done = gpuwait(
        "--vram",
        "1G",
        "--enforce",
        "limit",
        "--",
        sys.executable,
        "tools/train.py",
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": pythonpath},
    )
    assert (done.returncode, done.stdout) == (0, "42\n"), done.stderr


def over_grower_beside_a_neighbour(
    enforce: str,
) -> tuple[subprocess.Popen[str], subprocess.Popen[str]]:
    """An 8 GiB card: a neighbour that asked for 4 GiB ramps up to it over 2 s, while a job
    that asked for 2 GiB grows to 5 GiB at once."""
    neighbour = subprocess.Popen(
        wrapped_sim_job(GPUWAIT, ["--vram", "4G"], "--vram", "4G", "--ramp", "2s", "--hold", "1s"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: any(e.get("child_pid") for e in ledger_entries()), timeout=30)
    grower = subprocess.Popen(
        wrapped_sim_job(
            GPUWAIT, ["--enforce", enforce, "--vram", "2G"], "--vram", "5G", "--hold", "3s"
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return neighbour, grower


def test_under_limit_a_job_over_its_reservation_fails_alone(sim_file: SimFileFactory) -> None:
    sim_file(gpus=1, memory="8GiB")
    neighbour, grower = over_grower_beside_a_neighbour("limit")
    _, grower_err = grower.communicate(timeout=60)
    _, neighbour_err = neighbour.communicate(timeout=60)
    assert neighbour.returncode == 0, neighbour_err
    assert grower.returncode == 1
    assert "torch.OutOfMemoryError: CUDA out of memory" in grower_err
    assert "limited to 2.00 GiB" in grower_err
    records = {r["request"].get("bytes"): r for r in recorded_runs()}
    failed = records[2 * GiB]
    assert failed["oom"] is True
    assert failed["oom_cause"] == "own limit"
    assert failed["budget"] == {
        "enforce": "limit",
        "held_by": ["PyTorch allocator cap"],
        "limit_bytes": 2 * GiB,
    }
    assert records[4 * GiB]["oom"] is False
    log = gpuwait("log").stdout
    assert "out of memory at its own 2.0 GiB limit" in log
    assert "OOM at limit" in gpuwait("history").stdout


def test_without_a_limit_the_same_job_kills_its_neighbour(sim_file: SimFileFactory) -> None:
    """The control: what the limit prevents really happens without it."""
    sim_file(gpus=1, memory="8GiB")
    neighbour, grower = over_grower_beside_a_neighbour("hint")
    _, neighbour_err = neighbour.communicate(timeout=60)
    grower.communicate(timeout=60)
    assert neighbour.returncode == 1
    assert "CUDA out of memory" in neighbour_err
    assert grower.returncode == 0


@pytest.mark.parametrize(
    ("enforce", "held"), [("limit", "PyTorch allocator cap"), ("hint", "hint only")]
)
def test_status_says_how_each_budget_is_held(
    sim_file: SimFileFactory, enforce: str, held: str
) -> None:
    sim_file(gpus=1, memory="8GiB")
    job = subprocess.Popen(
        wrapped_sim_job(
            GPUWAIT, ["--enforce", enforce, "--vram", "1G"], "--vram", "1G", "--hold", "30s"
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: any(e.get("held_by") for e in ledger_entries()), timeout=30)
        status = gpuwait("status", env={**os.environ, "COLUMNS": "80"})
        assert f"budget held by: {held}" in status.stdout, status.stdout
        report = json.loads(gpuwait("status", "--json").stdout)
        assert [j["held_by"] for j in report["jobs"]] == [[held]]
    finally:
        job.terminate()
        job.wait(timeout=30)


def test_an_oom_at_its_own_limit_is_retried_larger(sim_file: SimFileFactory) -> None:
    sim_file(gpus=1, memory="8GiB")
    done = run_sim_job(
        ["--enforce", "limit", "--vram", "2G", "--retry-oom", "2"], "--vram", "4G", "--hold", "0.2s"
    )
    assert done.returncode == 0, done.stderr
    # Its message said it tried to allocate 4 GiB: retried once with that and the margin, not
    # 1.5 times the 2 GiB limit (3 GiB, which ran out again) and then 1.5 times that.
    assert "ran out at its own 2.0 GiB limit; retrying with 4.5 GiB" in done.stderr
    runs = recorded_runs()
    assert [(r["oom"], r.get("oom_cause"), r["reserved_bytes"] / GiB) for r in runs] == [
        (True, "own limit", 2.0),
        (False, None, 4.5),
    ]


def test_an_oom_at_its_limit_is_told_without_its_message(sim_file: SimFileFactory) -> None:
    """A terminal's stderr is not watched; the card keeps room. The peak at the limit tells."""
    sim_file(gpus=1, memory="8GiB")
    done = limited(
        "2G",
        "--vram",
        "4G",
        "--ramp",
        "2s",
        env={"GPUWAIT_WATCH_STDERR": "off", "GPUWAIT_SAMPLE_INTERVAL": "0.05"},
    )
    assert done.returncode == 1
    record = recorded_runs()[-1]
    assert (record["oom"], record["oom_cause"], record["oom_evidence"]) == (
        True,
        "own limit",
        "at its limit",
    )


def test_a_failure_near_its_limit_that_printed_no_oom_is_no_oom(sim_file: SimFileFactory) -> None:
    """Its stderr watched, a job that fails without an out-of-memory message did not run out,
    however close to its limit it held (a server that took its whole reservation, then hit a
    bug): its next run is not given half as much again."""
    sim_file(gpus=1, memory="8GiB")
    done = limited("2G", "--vram", "1.9G", "--exit", "3", "--hold", "0.3s")
    assert done.returncode == 3
    record = recorded_runs()[-1]
    assert record["peak_bytes"] >= 0.9 * 2 * GiB and record["stderr_watched"] == "pipe"
    assert record["oom"] is False
    assert "out of memory" not in done.stderr


def test_a_server_on_a_whole_card_is_given_a_fraction_it_can_start_with(
    sim_file: SimFileFactory,
) -> None:
    """vLLM refuses to start where the card's free memory is short of its fraction of the
    total, and some is always taken (the driver's, its own CUDA context): told 1 on a whole
    card, `vllm serve --gpu-memory-utilization "$GPUWAIT_VRAM_FRACTION"` never started."""
    sim_file(gpus=1, memory="24GiB", driver_reserved="500MiB")
    env = job_env("--exclusive")
    fraction = float(env["GPUWAIT_VRAM_FRACTION"])
    assert fraction * 24 * GiB <= 23 * GiB
    assert fraction * 24 * GiB == pytest.approx(int(env["GPUWAIT_VRAM_BYTES"]), abs=24 * GiB / 1e4)
    # JAX still takes memory as it needs it, up to the whole card.
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "1"


def test_a_share_of_a_card_is_told_to_the_command_as_that_share(sim_file: SimFileFactory) -> None:
    """`--vram 30%` reserves 30 % of the card rounded down to whole bytes, a fraction of a byte
    short of it: the frameworks and a server given "$GPUWAIT_VRAM_FRACTION" were told 0.2999,
    and a whole idle card 0.8999 rather than the 0.9 the docs promise."""
    sim_file(gpus=1, memory="24GiB")
    share = job_env("--vram", "30%")
    assert share["GPUWAIT_VRAM_FRACTION"] == share["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.3"
    assert job_env("--vram", "10%", "--enforce", "limit")["GPUWAIT_TORCH_MEMORY_FRACTION"] == "0.1"
    assert job_env("--exclusive")["GPUWAIT_VRAM_FRACTION"] == "0.9"


def test_an_oom_at_its_limit_on_the_smaller_of_two_cards_is_told_without_its_message(
    sim_file: SimFileFactory,
) -> None:
    # Half of an 8 GiB and of a 24 GiB card: held to 4 GiB on the small card (GPU 0, the
    # command's first), where it stops growing. Measured against the big card's 12 GiB, that
    # was no OOM at all: no retry, and history learned nothing of it.
    sim_file(gpus=2, memory=["8GiB", "24GiB"])
    done = run_sim_job(
        ["--enforce", "limit", "--vram", "50%", "--gpus", "2", "--devices", "0,1"],
        *("--vram", "6G", "--ramp", "1s"),
        env={"GPUWAIT_WATCH_STDERR": "off", "GPUWAIT_SAMPLE_INTERVAL": "0.05"},
    )
    assert done.returncode == 1, done.stderr
    assert "ran out at its own limit, 4.0 GiB on GPU0" in done.stderr
    record = recorded_runs()[-1]
    assert (record["oom"], record["oom_cause"], record["oom_evidence"]) == (
        True,
        "own limit",
        "at its limit",
    )
    log = gpuwait("log").stdout
    assert "4.0 GiB on GPU0, 12.0 GiB on GPU1 reserved" in log
    assert "out of memory at its own limit, 4.0 GiB on GPU0, 12.0 GiB on GPU1" in log


def test_limit_without_a_way_says_so_once(sim_file: SimFileFactory) -> None:
    sim_file(gpus=1, memory="8GiB")
    # A shell script is no Python program: nothing gpuwait can claim holds its budget. It runs
    # a simulated PyTorch job that grows past the reservation, is stopped by the PyTorch cap
    # (the hook's variable reaches it), and is retried twice.
    script = f"exec {' '.join(GPUWAIT)} sim job --vram 4G --hold 0.1s"
    done = gpuwait(
        "--enforce", "limit", "--vram", "1G", "--retry-oom", "2", "--", "sh", "-c", script
    )
    said = [line for line in done.stderr.splitlines() if "enforce = limit" in line]
    assert len(said) == 1, done.stderr
    assert "only hinted here" in said[0]
    assert "MPS" in said[0] and "dmem" in said[0]
    assert recorded_runs()[0]["budget"]["held_by"] == ["hint only"]


def test_an_mps_limit_holds_any_cuda_program(sim_file: SimFileFactory, mps_daemon: Path) -> None:
    sim_file(gpus=1, memory="8GiB")
    pipes = {"CUDA_MPS_PIPE_DIRECTORY": str(mps_daemon)}
    env = job_env("--vram", "2G", "--enforce", "limit", env=pipes)
    uuid = env["CUDA_VISIBLE_DEVICES"]
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{uuid}=2048MB"
    assert "GPUWAIT_TORCH_MEMORY_FRACTION" not in env  # no second cap on the driver's
    # A plain CUDA program (no framework cap) past the limit fails with CUDA's own error.
    done = limited("2G", "--framework", "cuda", "--vram", "3G", env=pipes)
    assert done.returncode == 1
    assert "CUDA error: out of memory (MPS pinned device memory limit)" in done.stderr
    record = recorded_runs()[-1]
    assert record["budget"]["held_by"] == ["MPS limit"]
    assert record["oom_cause"] == "own limit"


def test_a_server_sized_by_its_reservation_failing_at_a_terminal_is_no_oom(
    sim_file: SimFileFactory, mps_daemon: Path
) -> None:
    """A server told its reservation (vLLM given "$GPUWAIT_VRAM_FRACTION") holds all of it by
    design: under an MPS limit, at a terminal, its peak at the limit says nothing of why it
    failed, and its next run is not given half as much again."""
    sim_file(gpus=1, memory="8GiB")
    sim = " ".join(GPUWAIT)
    server = f'exec {sim} sim job --framework cuda --vram "${{GPUWAIT_VRAM_BYTES}}B" --exit 3 --hold 0.3s'
    done = gpuwait(
        *("--enforce", "limit", "--vram", "2G", "--", "sh", "-c", server),
        env={
            **os.environ,
            "CUDA_MPS_PIPE_DIRECTORY": str(mps_daemon),
            "GPUWAIT_WATCH_STDERR": "off",
        },
    )
    assert done.returncode == 3, done.stderr
    record = recorded_runs()[-1]
    assert record["budget"]["held_by"] == ["MPS limit"] and record["peak_bytes"] == 2 * GiB
    assert record["oom"] is False


def test_a_jax_job_under_an_mps_limit_may_use_all_of_its_reservation(
    sim_file: SimFileFactory, mps_daemon: Path
) -> None:
    """JAX told only not to preallocate still stops at its default 75 % of the card: 7 GiB
    reserved on an 8 GiB card, it ran out at 6 GiB under the MPS limit, where the fraction a
    hint gives it (0.875) lets it run."""
    sim_file(gpus=1, memory="8GiB")
    pipes = {"CUDA_MPS_PIPE_DIRECTORY": str(mps_daemon)}
    done = limited("7G", "--framework", "jax", "--vram", "6.5G", "--hold", "0.3s", env=pipes)
    assert done.returncode == 0, done.stderr
    assert recorded_runs()[-1]["budget"]["held_by"] == ["MPS limit"]


def test_a_job_in_a_container_gets_the_limit_of_the_hosts_mps_daemon(
    sim_file: SimFileFactory, mps_daemon: Path
) -> None:
    # In a container with pids of its own (the host's pipe directory mounted in, as MPS
    # clients in containers have it), the daemon's pid file names it by the host's pid: gpuwait
    # said no MPS daemon served and ran the job without its limit, though CUDA there is the
    # daemon's client.
    prefix = unshare_prefix()
    sim_file(gpus=1, memory="8GiB")
    pipes = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(mps_daemon)}
    show = [sys.executable, "-c", SHOW_ENV]
    argv = [*prefix, sys.executable, "-m", "gpuwait", "--vram", "2G", "--enforce", "limit"]
    done = subprocess.run([*argv, "--", *show], env=pipes, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    env = json.loads(done.stdout)
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{env['CUDA_VISIBLE_DEVICES']}=2048MB"


def test_an_mps_limit_holds_with_gpus_named_by_index(
    sim_file: SimFileFactory, mps_daemon: Path
) -> None:
    # The limit names the card by UUID, which CUDA resolves whatever CUDA_VISIBLE_DEVICES holds.
    sim_file(gpus=2, memory="8GiB")
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(mps_daemon), "GPUWAIT_VISIBLE_DEVICES": "index"}
    done = run_sim_job(
        ["--enforce", "limit", "--vram", "2G", "--devices", "1"],
        *("--framework", "cuda", "--vram", "3G"),
        env=env,
    )
    assert done.returncode == 1
    assert "CUDA error: out of memory (MPS pinned device memory limit)" in done.stderr


def test_jax_told_its_share_takes_its_reservation_and_untold_three_quarters(
    sim_file: SimFileFactory, tmp_path: Path
) -> None:
    sim_file(gpus=1, memory="8GiB")

    def jax_peak(enforce: str) -> float:
        report = tmp_path / f"{enforce}.json"
        done = run_sim_job(
            ["--enforce", enforce, "--vram", "2G"],
            *("--framework", "jax", "--vram", "1G", "--hold", "0.1s", "--report", str(report)),
        )
        assert done.returncode == 0, done.stderr
        return json.loads(report.read_text())["peak_bytes"] / GiB  # type: ignore[no-any-return]

    # Told its share, JAX allocates on demand up to it; untold, it takes its pool at the start,
    # 75 % of the card, which a neighbour admitted beside it would not survive.
    assert jax_peak("hint") == 1.0
    assert jax_peak("off") == 6.0
    assert recorded_runs()[-1]["over_reservation"]["used_bytes"] == 6 * GiB


def test_a_jax_job_is_learned_at_what_it_uses_not_at_the_room_it_was_given(
    sim_file: SimFileFactory,
) -> None:
    # Preallocating, JAX took all the room it was told of at its first operation: a 1 GiB job
    # with no history (a whole card's room) was learned at the card's 7.2 GiB, for good, and a
    # job of known size at its reservation, 10 % more at every run.
    sim_file(gpus=1, memory="8GiB")
    job = ("--framework", "jax", "--vram", "1G", "--hold", "0.1s")
    for _ in range(3):
        done = run_sim_job(["-v"], *job)
        assert done.returncode == 0, done.stderr
    peaks = [run["peak_bytes"] / GiB for run in recorded_runs()]
    assert peaks == [1.0, 1.0, 1.0]
    assert "1.1 GiB reserved" in done.stderr


#: Stand-ins for `apptainer exec --nv --cleanenv IMAGE CMD...`: the command runs with the
#: APPTAINERENV_ copies alone (PATH kept), so no PYTHONPATH of the host's reaches it. One is a
#: Python script, as a site's front to Apptainer may be, the other a shell script, as a program
#: that is no Python one.
CLEANENV_PY = """#!/usr/bin/env python3
import os, sys
prefix = "APPTAINERENV_"
env = {k[len(prefix):]: v for k, v in os.environ.items() if k.startswith(prefix)}
os.execve(sys.argv[5], sys.argv[5:], {"PATH": os.environ["PATH"], **env})
"""
CLEANENV_SH = """#!/bin/sh
shift 4
exec env -i PATH="$PATH" $(env | grep '^APPTAINERENV_' | sed 's/^APPTAINERENV_//') "$@"
"""


@pytest.mark.parametrize("stand_in", [CLEANENV_PY, CLEANENV_SH])
def test_a_python_program_in_a_clean_container_is_not_said_to_be_capped_by_the_hook(
    sim_file: SimFileFactory, tmp_path: Path, stand_in: str
) -> None:
    # The hook's PYTHONPATH does not reach a container that cleans its environment: a job
    # there was recorded as held by the "PyTorch allocator cap", or hinted only as "not a
    # Python program", though it runs one. It is hinted only, and the line says why.
    sim_file(gpus=1, memory="8GiB")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "apptainer").write_text(stand_in)
    (bin_dir / "apptainer").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    script = "import os; print(os.environ.get('GPUWAIT_TORCH_MEMORY_FRACTION', 'none'))"
    container = ["apptainer", "exec", "--nv", "--cleanenv", "img.sif"]
    done = gpuwait(
        *("--enforce", "limit", "--vram", "1G", "--"),
        *(*container, sys.executable, "-c", script),
        env=env,
    )
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if "enforce = limit" in line]
    assert len(said) == 1 and "Apptainer" in said[0], done.stderr
    assert "not a Python program" not in said[0]
    assert recorded_runs()[0]["budget"]["held_by"] == ["hint only"]


def test_a_job_started_inside_another_is_told_its_own_reservation_not_the_outer_ones(
    sim_file: SimFileFactory,
) -> None:
    # A sweep holding 4 GiB starts a job of its own that reserves 10 GiB beside it: JAX in that
    # job may use its 10 GiB, not the share the sweep was told.
    sim_file(gpus=1, memory="24GiB")
    job = ("--framework", "jax", "--vram", "8G", "--hold", "0.1s")
    done = run_sim_job(["--vram", "4G", "--", *GPUWAIT, "--vram", "10G"], *job)
    assert done.returncode == 0, done.stderr
    assert "out of memory" not in done.stderr.lower()
    inner = [sys.executable, "-c", SHOW_ENV]
    for mode in ("hint", "limit"):
        shown = gpuwait(
            "--vram",
            "4G",
            "--enforce",
            "limit",
            "--",
            *GPUWAIT,
            "--vram",
            "10G",
            "--enforce",
            mode,
            "--",
            *inner,
        )
        assert shown.returncode == 0, shown.stderr
        env = json.loads(shown.stdout)
        assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == env["XLA_CLIENT_MEM_FRACTION"] == "0.4166"
        # The PyTorch cap the sweep's hook would put on it is its own, or none.
        assert env.get("GPUWAIT_TORCH_MEMORY_FRACTION") == ("0.4166" if mode == "limit" else "")
    # A fraction the user set before either is still theirs.
    mine = gpuwait(
        "--vram",
        "4G",
        "--",
        *GPUWAIT,
        "--vram",
        "10G",
        "--",
        *inner,
        env={**os.environ, "XLA_PYTHON_CLIENT_MEM_FRACTION": ".6"},
    )
    assert json.loads(mine.stdout)["XLA_PYTHON_CLIENT_MEM_FRACTION"] == ".6"


@pytest.mark.parametrize("flags", [["-I"], ["-E"], ["-S"], ["-uE"], ["-X", "dev", "-s", "-I"]])
def test_a_python_that_ignores_the_hook_is_not_said_to_be_capped_by_it(
    sim_file: SimFileFactory, flags: list[str]
) -> None:
    # `python -I` (or -E) ignores PYTHONPATH and -S imports no sitecustomize: the hook never
    # runs, and nothing caps PyTorch, though the run was recorded as held by the cap.
    sim_file(gpus=1, memory="8GiB")
    script = "import sys; print('pyhook' in str(sys.modules.get('sitecustomize')))"
    done = gpuwait(
        *("--enforce", "limit", "--vram", "1G", "--", sys.executable, *flags, "-c", script)
    )
    assert (done.returncode, done.stdout) == (0, "False\n"), done.stderr
    said = [line for line in done.stderr.splitlines() if "enforce = limit" in line]
    assert len(said) == 1 and "PYTHONPATH" in said[0], done.stderr
    assert recorded_runs()[0]["budget"]["held_by"] == ["hint only"]


def test_a_python_run_plainly_is_still_capped_by_the_hook(sim_file: SimFileFactory) -> None:
    sim_file(gpus=1, memory="8GiB")
    script = "import sys; print(sys.modules['sitecustomize'].__file__)"
    done = gpuwait(
        *("--enforce", "limit", "--vram", "1G", "--", sys.executable, "-u", "-W", "ignore"),
        *("-c", script, "-I"),
    )
    assert done.returncode == 0, done.stderr
    assert "pyhook" in done.stdout
    assert recorded_runs()[0]["budget"]["held_by"] == ["PyTorch allocator cap"]


def test_a_script_whose_interpreter_ignores_the_hook_is_not_said_to_be_capped_by_it(
    sim_file: SimFileFactory, tmp_path: Path
) -> None:
    sim_file(gpus=1, memory="8GiB")
    script = tmp_path / "job.py"
    script.write_text(
        f"#!{sys.executable} -Es\nimport sys\nprint('pyhook' in str(sys.modules.get('sitecustomize')))\n"
    )
    script.chmod(0o755)
    done = gpuwait("--enforce", "limit", "--vram", "1G", "--", str(script))
    assert (done.returncode, done.stdout) == (0, "False\n"), done.stderr
    assert "python -E runs without the PyTorch hook" in done.stderr
    assert recorded_runs()[0]["budget"]["held_by"] == ["hint only"]


def test_a_job_started_inside_another_under_an_mps_limit_is_limited_at_its_own_reservation(
    sim_file: SimFileFactory, mps_daemon: Path
) -> None:
    # Each MPS client is limited on its own: the sweep's limit, inherited, stopped the job's
    # CUDA program at the sweep's 4 GiB though the job had reserved 10 GiB.
    sim_file(gpus=1, memory="24GiB")
    pipes = {"CUDA_MPS_PIPE_DIRECTORY": str(mps_daemon)}
    inner = ["--", *GPUWAIT, "--enforce", "limit", "--vram", "10G"]
    job = ("--framework", "cuda", "--vram", "8G", "--hold", "0.1s")
    done = run_sim_job(["--enforce", "limit", "--vram", "4G", *inner], *job, env=pipes)
    assert done.returncode == 0, done.stderr
    assert [r["budget"]["held_by"] for r in recorded_runs()] == [["MPS limit"]] * 2
    # A limit the user set before either is still theirs.
    mine = {**pipes, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=6G"}
    done = run_sim_job(["--enforce", "limit", "--vram", "4G", *inner], *job, env=mine)
    assert done.returncode == 1
    assert "MPS pinned device memory limit" in done.stderr


def test_a_job_started_inside_another_from_python_that_imported_torch_gets_its_own_cap(
    sim_file: SimFileFactory, tmp_path: Path
) -> None:
    # A PyTorch that reads its cap from its allocator settings (2.10+) gets it there from the
    # hook, in the process's own environment: a sweep that imported torch passed the key on to
    # the job it started, whose gpuwait took it for the user's and left the job's PyTorch at
    # the sweep's 4 GiB though the job had reserved 10 GiB.
    sim_file(gpus=1, memory="24GiB")
    torch = tmp_path / "lib" / "torch"
    torch.mkdir(parents=True)
    (torch / "__init__.py").write_text("")
    (torch / "version.py").write_text("__version__ = '2.10.0'\n")
    env = {
        **os.environ,
        "PYTHONPATH": f"{tmp_path / 'lib'}",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    }
    inner = [*GPUWAIT, "--enforce", "limit", "--vram", "10G", "--", sys.executable, "-c"]
    sweep = f"import subprocess, torch; subprocess.run({[*inner, SHOW_ENV]!r}, check=True)"
    done = gpuwait(
        *("--enforce", "limit", "--vram", "4G", "--", sys.executable, "-c", sweep), env=env
    )
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert shown["GPUWAIT_TORCH_MEMORY_FRACTION"] == "0.4166"
    # The user's own settings stay; the job's PyTorch is capped by the hook at its own share.
    assert shown["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert [r["budget"]["held_by"] for r in recorded_runs()] == [["PyTorch allocator cap"]] * 2


def test_a_job_started_with_enforce_off_inside_a_limited_one_carries_none_of_its_caps(
    sim_file: SimFileFactory,
) -> None:
    # A sweep under --enforce limit holding 4 GiB starts a job of 10 GiB with --enforce off:
    # JAX in that job was held at the sweep's share, told to it as if the user had set it.
    sim_file(gpus=1, memory="24GiB")
    inner = ["--", *GPUWAIT, "--vram", "10G", "--enforce", "off"]
    job = ("--framework", "jax", "--vram", "8G", "--hold", "0.1s")
    done = run_sim_job(["--vram", "4G", "--enforce", "limit", *inner], *job)
    assert done.returncode == 0, done.stderr
    assert "out of memory" not in done.stderr.lower()
    shown = gpuwait(
        "--vram", "4G", "--enforce", "limit", *inner, "--", sys.executable, "-c", SHOW_ENV
    )
    assert shown.returncode == 0, shown.stderr
    env = json.loads(shown.stdout)
    assert exported(env) == {"GPUWAIT_VRAM_FRACTION": "0.4166", "GPUWAIT_TORCH_MEMORY_FRACTION": ""}
    assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in env


@pytest.mark.parametrize("mode", ["off", "hint"])
def test_a_job_started_inside_another_under_an_mps_limit_without_one_of_its_own_is_not_held_at_the_outer_one(
    sim_file: SimFileFactory, mps_daemon: Path, mode: str
) -> None:
    # Under --enforce off or hint the job asks for no MPS limit: the sweep's 4 GiB, inherited,
    # stopped its CUDA program though the job had reserved 10 GiB.
    sim_file(gpus=1, memory="24GiB")
    pipes = {"CUDA_MPS_PIPE_DIRECTORY": str(mps_daemon)}
    inner = ["--", *GPUWAIT, "--enforce", mode, "--vram", "10G"]
    job = ("--framework", "cuda", "--vram", "8G", "--hold", "0.1s")
    done = run_sim_job(["--enforce", "limit", "--vram", "4G", *inner], *job, env=pipes)
    assert done.returncode == 0, done.stderr
    assert "MPS pinned device memory limit" not in done.stderr
