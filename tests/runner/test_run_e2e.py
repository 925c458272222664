"""gpuwait end to end, through the simulation backend, with real processes."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.fixtures_sim import hold_card
from helpers.history import recorded_runs
from helpers.shellbin import with_program
from helpers.trap import TRAP, wait_for_text
from helpers.waiting import asleep_waiting, ledger_entries, sleeping_in, wait_for

from gpuwait.linux import dirs
from gpuwait.queue.bookkeeping import INTERRUPTED, TIMED_OUT
from gpuwait.queue.events import read_events

GiB = 2**30


def uuids(sim: Path) -> list[str]:
    from gpuwait.gpu.sim import SimBackend

    return [g.uuid for g in SimBackend(str(sim)).snapshot().gpus]


def run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kw)  # type: ignore[call-overload, no-any-return]


def env_of(gpuwait_cmd: list[str], *opts: str, env: dict[str, str] | None = None) -> dict[str, str]:
    script = "import json, os; print(json.dumps(dict(os.environ)))"
    # After the options and `--`, or after the start of a command they already hold.
    line = (
        [*opts, sys.executable, "-c", script]
        if "--" in opts
        else [*opts, "--", sys.executable, "-c", script]
    )
    done = run([*gpuwait_cmd, *line], env=env)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def test_sets_cuda_visible_devices_to_a_uuid(sim: Path, gpuwait_cmd: list[str]) -> None:
    seen = env_of(gpuwait_cmd, "--vram", "6G")
    assert seen["CUDA_VISIBLE_DEVICES"] in uuids(sim)
    assert seen["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert seen["GPUWAIT_VRAM_BYTES"] == str(6 * GiB)
    assert seen["GPUWAIT_JOB_ID"]


def test_inherited_cuda_visible_devices_restricts_candidates(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    second = uuids(sim)[1]
    for inherited in ("1", second, second[:12], "1,7,0"):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": inherited}
        assert env_of(gpuwait_cmd, "--vram", "1G", env=env)["CUDA_VISIBLE_DEVICES"] == second
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = run([*gpuwait_cmd, "--vram", "1G", "true"], env=env)
    assert done.returncode == 3
    assert "no GPU visible" in done.stderr


def test_a_gpuwait_started_where_cuda_sees_no_gpu_says_to_run_the_command_without_it(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    # `CUDA_VISIBLE_DEVICES=none gpuwait --vram 1G -- python prep.py`, CUDA's way to run on
    # the CPU, was told to "unset it, or list GPU indices or UUIDs that exist": the one thing
    # the line asks, the CPU, was no hint. A mistyped index keeps that hint.
    for hidden in ("", "-1", "none"):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": hidden}
        done = run([*gpuwait_cmd, "--vram", "1G", "true"], env=env)
        assert done.returncode == 3, done.stderr
        assert f"CUDA_VISIBLE_DEVICES={hidden!r} hides every GPU" in done.stderr, done.stderr
        assert "gpuwait: hint: run the command without gpuwait" in done.stderr, done.stderr
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "7"}
    done = run([*gpuwait_cmd, "--vram", "1G", "true"], env=env)
    assert done.returncode == 3, done.stderr
    assert "makes no GPU visible" in done.stderr and "list GPU indices" in done.stderr


def test_an_inherited_mig_instance_is_refused_as_one(sim: Path, gpuwait_cmd: list[str]) -> None:
    # A MIG instance (what Slurm or Kubernetes hand out on MIG cards) is not a whole GPU.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "MIG-377e0049-554c-540b-93c6-d0976f8426cb"}
    done = run([*gpuwait_cmd, "--vram", "1G", "true"], env=env)
    assert done.returncode == 3
    assert "MIG instance" in done.stderr and "whole GPUs" in done.stderr


def test_devices_option(sim: Path, gpuwait_cmd: list[str]) -> None:
    assert (
        env_of(gpuwait_cmd, "--vram", "1G", "--devices", "1")["CUDA_VISIBLE_DEVICES"]
        == uuids(sim)[1]
    )


#: A stand-in for `apptainer exec --nv --cleanenv IMAGE CMD...` (and singularity's): what the
#: command in the container gets of the caller's environment is every APPTAINERENV_ variable
#: (SINGULARITYENV_ for singularity), its prefix taken off, and nothing else of gpuwait's.
CLEANENV_CONTAINER = """#!/usr/bin/env python3
import os, sys
prefix = os.path.basename(sys.argv[0]).upper() + "ENV_"
command = sys.argv[5:]
env = {k[len(prefix):]: v for k, v in os.environ.items() if k.startswith(prefix)}
os.execve(command[0], command, {"PATH": os.environ["PATH"], **env})
"""


@pytest.mark.parametrize("engine", ["apptainer", "singularity"])
def test_a_container_that_cleans_its_environment_keeps_the_reserved_gpu(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, engine: str
) -> None:
    # `apptainer exec --nv --cleanenv` (or --containall), as many clusters advise, left out
    # CUDA_VISIBLE_DEVICES: the container's CUDA saw every GPU --nv binds in and took GPU 0,
    # whichever gpuwait had reserved, beside the jobs there.
    env = with_program(tmp_path / "bin", engine, CLEANENV_CONTAINER)
    opts = ("--vram", "1G", "--devices", "1", "--", engine, "exec", "--nv", "--cleanenv", "img.sif")
    seen = env_of(gpuwait_cmd, *opts, env=env)
    assert seen.get("CUDA_VISIBLE_DEVICES") == uuids(sim)[1], seen
    assert seen.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID"


def test_a_container_that_cleans_its_environment_keeps_the_frameworks_budget(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # Under `apptainer exec --nv --cleanenv`, JAX got no XLA_PYTHON_CLIENT_MEM_FRACTION and
    # no XLA_PYTHON_CLIENT_PREALLOCATE=false: it took 75 % of the card at its first operation
    # (18 GiB of 24) for a job that had reserved 1 GiB, beside the jobs given the rest.
    env = with_program(tmp_path / "bin", "apptainer", CLEANENV_CONTAINER)
    for name in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION"):
        env.pop(name, None)
    opts = ("--vram", "1G", "--", "apptainer", "exec", "--nv", "--cleanenv", "img.sif")
    seen = env_of(gpuwait_cmd, *opts, env=env)
    fraction = seen.get("GPUWAIT_VRAM_FRACTION")
    assert fraction and float(fraction) < 0.1, seen
    assert seen.get("XLA_PYTHON_CLIENT_MEM_FRACTION") == fraction
    assert seen.get("XLA_PYTHON_CLIENT_PREALLOCATE") == "false"
    assert seen.get("TF_FORCE_GPU_ALLOW_GROWTH") == "true"


def test_a_container_in_a_job_with_enforce_off_inside_a_limited_one_gets_none_of_its_caps(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # A sweep under --enforce limit holding 4 GiB starts `gpuwait --vram 10G --enforce off --
    # apptainer exec --cleanenv ...`: the sweep's APPTAINERENV_ copies of its caps reached the
    # container, whose JAX was held at the sweep's share, set as if by the user.
    env = with_program(tmp_path / "bin", "apptainer", CLEANENV_CONTAINER)
    for name in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION"):
        env.pop(name, None)
    container = ("apptainer", "exec", "--nv", "--cleanenv", "img.sif")
    inner = (*gpuwait_cmd, "--vram", "10G", "--enforce", "off", "--", *container)
    seen = env_of(gpuwait_cmd, "--vram", "4G", "--enforce", "limit", "--", *inner, env=env)
    assert seen.get("GPUWAIT_VRAM_FRACTION") == "0.4166", seen
    for name in (
        "XLA_PYTHON_CLIENT_MEM_FRACTION",
        "XLA_CLIENT_MEM_FRACTION",
        "XLA_PYTHON_CLIENT_PREALLOCATE",
        "TF_FORCE_GPU_ALLOW_GROWTH",
    ):
        assert name not in seen, (name, seen[name])


def test_visible_devices_index_gives_programs_that_parse_integers_nvml_indices(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    # vLLM, older dask-cuda and some launchers read CUDA_VISIBLE_DEVICES with int() and crash
    # on a UUID; visible_devices = index gives them the NVML index, in PCI order as CUDA then
    # numbers the cards too.
    env = {**os.environ, "GPUWAIT_VISIBLE_DEVICES": "index"}
    seen = env_of(gpuwait_cmd, "--vram", "1G", "--devices", "1", env=env)
    assert seen["CUDA_VISIBLE_DEVICES"] == "1"
    assert seen["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert seen["GPUWAIT_GPU_UUIDS"] == uuids(sim)[1]


def test_gpu_memory_a_command_left_behind_is_named_when_it_ends(
    sim: Path, gpuwait_cmd: list[str], procs: Callable[..., subprocess.Popen[Any]]
) -> None:
    # A server or worker the command started and did not end holds its memory on after the
    # job: outside any reservation from then on, and the user is told which process it is.
    stray = f"{sys.executable} -m gpuwait sim job --vram 1G --hold 20s >/dev/null 2>&1 &"
    proc = procs([*gpuwait_cmd, "--vram", "2G", "--", "sh", "-c", f"{stray} sleep 0.6"])
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    said = [line for line in err.splitlines() if "still hold" in line]
    assert len(said) == 1, err
    assert "1.0 GiB on GPU 0" in said[0] and "pid " in said[0]


SIM_JOB = f"{sys.executable} -m gpuwait sim job --vram 1G --hold 0.6s"


def test_a_command_on_gpus_it_was_not_given_is_called_out_while_it_runs(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    # deepspeed --num_gpus N (and any launcher that replaces CUDA_VISIBLE_DEVICES) runs on
    # GPUs 0..N-1 whatever gpuwait gave the job: into other jobs' room.
    replaced = f"CUDA_VISIBLE_DEVICES=0 {SIM_JOB}"
    done = run([*gpuwait_cmd, "--vram", "2G", "--devices", "1", "--", "sh", "-c", replaced])
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if "not given" in line]
    assert len(said) == 1, done.stderr
    assert "on GPU 0" in said[0] and "CUDA_VISIBLE_DEVICES" in said[0]


def test_a_job_of_its_own_that_the_command_starts_elsewhere_is_not_called_out(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    # A gpuwait inside the command, on a GPU of its own, runs there in its own reservation.
    nested = f"env -u CUDA_VISIBLE_DEVICES {sys.executable} -m gpuwait --vram 1G --devices 0 -- "
    outer = [*gpuwait_cmd, "--vram", "2G", "--devices", "1", "--", "sh", "-c", nested + SIM_JOB]
    done = run(outer, env={**os.environ, "GPUWAIT_SAMPLE_INTERVAL": "0.1"})
    assert done.returncode == 0, done.stderr
    assert "not given" not in done.stderr


@pytest.mark.parametrize("status", [0, 1, 7, 255])
def test_exit_status_passes_through(sim: Path, gpuwait_cmd: list[str], status: int) -> None:
    done = run([*gpuwait_cmd, "--vram", "1G", "--", "sh", "-c", f"exit {status}"])
    assert done.returncode == status


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL, signal.SIGSEGV, signal.SIGINT])
def test_command_killed_by_signal_kills_gpuwait_by_the_same_signal(
    sim: Path, gpuwait_cmd: list[str], signum: int
) -> None:
    done = run([*gpuwait_cmd, "--vram", "1G", "--", "sh", "-c", f"kill -{int(signum)} $$"])
    assert done.returncode == -signum
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "signum",
    [
        signal.SIGTERM,
        signal.SIGHUP,
        signal.SIGINT,
        signal.SIGQUIT,
        signal.SIGUSR1,
        signal.SIGUSR2,
        # Bare, each would end gpuwait and leave its command running unwatched.
        signal.SIGALRM,
        signal.SIGVTALRM,
        signal.SIGPROF,
        signal.SIGXCPU,
        signal.SIGPWR,
        signal.SIGRTMIN + 2,
    ],
)
def test_signals_to_gpuwait_reach_the_command_once(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, signum: int
) -> None:
    flag = tmp_path / "flag"
    proc = subprocess.Popen(
        [*gpuwait_cmd, "--vram", "1G", "--", sys.executable, "-c", TRAP, str(flag)]
    )
    try:
        wait_for_text(flag, "ready")
        proc.send_signal(signum)
        assert proc.wait(timeout=20) == 41
        assert flag.read_text() == str(int(signum))
    finally:
        proc.kill()
        proc.wait()


def test_ctrl_c_at_a_terminal_reaches_the_command_once(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    pexpect = pytest.importorskip("pexpect")
    flag = tmp_path / "flag"
    child = pexpect.spawn(
        gpuwait_cmd[0],
        [*gpuwait_cmd[1:], "--vram", "1G", "--", sys.executable, "-c", TRAP, str(flag)],
        env=dict(os.environ),
        timeout=20,
    )
    try:
        wait_for_text(flag, "ready")
        child.sendintr()
        child.expect(pexpect.EOF)
        child.close()
        assert flag.read_text() == str(int(signal.SIGINT))
        assert child.exitstatus == 41
    finally:
        child.terminate(force=True)


def ledger_jobs() -> list[dict[str, object]]:
    path = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "ledger.json"
    if not path.exists():
        return []
    return list(json.loads(path.read_text())["jobs"])


def wait_for_jobs(count: int, state: str | None = None, timeout: float = 90) -> None:
    wait_for(
        lambda: len([j for j in ledger_jobs() if state is None or j["state"] == state]) >= count,
        timeout=timeout,
        interval=0.02,
        message=lambda: f"never saw {count} {state or ''} jobs: {ledger_jobs()}",
    )


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_while_waiting_leaves_the_queue(
    sim: Path, gpuwait_cmd: list[str], signum: int
) -> None:
    holders = [hold_card(gpuwait_cmd, "20G", "20s", "--devices", str(i)) for i in (0, 1)]
    try:
        wait_for_jobs(2, "running")
        waiter = subprocess.Popen(
            [*gpuwait_cmd, "--vram", "10G", "true"], stderr=subprocess.PIPE, text=True
        )
        wait_for_jobs(3)
        waiter.send_signal(signum)
        # Ended by the signal, as the command would have been (a shell shows 130 / 143).
        assert waiter.wait(timeout=60) == -signum
        assert len(ledger_jobs()) == 2
    finally:
        for h in holders:
            h.terminate()
            h.wait()


def test_ctrl_c_while_waiting_stops_the_shell_loop_it_runs_in(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    # A script's loop of jobs, Ctrl-C at the terminal (INT to the foreground group): bash stops
    # the script only when its child died by SIGINT, not when it exited 130.
    holders = [hold_card(gpuwait_cmd, "20G", "20s", "--devices", str(i)) for i in (0, 1)]
    gw = " ".join([*gpuwait_cmd, "-q", "--vram", "10G", "--timeout", "5s", "--", "true"])
    script = f"for i in 1 2; do {gw}; echo status=$?; done; echo loop ended"
    try:
        wait_for_jobs(2, "running")
        loop = subprocess.Popen(
            ["bash", "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        wait_for_jobs(3)
        os.killpg(loop.pid, signal.SIGINT)
        out, _ = loop.communicate(timeout=30)
    finally:
        for h in holders:
            h.terminate()
            h.wait()
    assert (loop.returncode, out) == (-signal.SIGINT, "")


def test_ctrl_c_while_the_gpus_do_not_answer_yet_stops_the_shell_loop_it_runs_in(
    sim_file: Any, gpuwait_cmd: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C while a launch waits for a GPU that stopped answering, before it queues (`GPU 1
    did not answer ...; retrying for up to gpu_error_timeout`): gpuwait ends by SIGINT, as
    while waiting for room, so that a script's loop stops rather than go on to its next run."""
    sim_file(gpus=2, lost=[False, True])
    # A loop that went on would end its next run soon, rather than after 5 minutes.
    monkeypatch.setenv("GPUWAIT_GPU_ERROR_TIMEOUT", "10s")
    said = tmp_path / "said"
    gw = " ".join([*gpuwait_cmd, "--devices", "1", "--vram", "1G", "--", "true"])
    script = f'for i in 1 2; do {gw} 2>>"$0"; echo status=$?; done; echo loop ended'
    loop = subprocess.Popen(
        ["bash", "-c", script, str(said)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        wait_for(lambda: said.exists() and "retrying" in said.read_text(), timeout=30)
        os.killpg(loop.pid, signal.SIGINT)
        out, _ = loop.communicate(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(loop.pid, signal.SIGKILL)
        loop.wait(timeout=30)
    assert (loop.returncode, out) == (-signal.SIGINT, ""), said.read_text()
    assert "Traceback" not in said.read_text()


def test_timeout_gives_up_with_124(sim: Path, gpuwait_cmd: list[str]) -> None:
    holder = hold_card(gpuwait_cmd, "20G", "20s", "--devices", "0")
    try:
        wait_for_jobs(1, "running")
        started = time.monotonic()
        done = run([*gpuwait_cmd, "--vram", "10G", "--devices", "0", "--timeout", "0.5s", "true"])
        assert done.returncode == 124
        assert time.monotonic() - started < 10
        assert "gave up" in done.stderr and "waiting for 10.0 GiB" in done.stderr
        assert [j["state"] for j in ledger_jobs()] == ["running"]
    finally:
        holder.terminate()
        holder.wait()


@pytest.mark.parametrize("zero", ["0", "0s", "0ms"])
def test_a_timeout_of_zero_starts_only_what_fits_at_once(
    sim: Path, gpuwait_cmd: list[str], zero: str
) -> None:
    holder = hold_card(gpuwait_cmd, "20G", "20s", "--devices", "0")
    try:
        wait_for_jobs(1, "running")
        started = time.monotonic()
        full = run([*gpuwait_cmd, "--vram", "10G", "--devices", "0", "--timeout", zero, "true"])
        assert full.returncode == 124, full.stderr
        assert time.monotonic() - started < 10
        free = run([*gpuwait_cmd, "--vram", "10G", "--timeout", zero, "--", "echo", "ran"])
        assert free.returncode == 0, free.stderr
        assert free.stdout == "ran\n"
        assert [j["state"] for j in ledger_jobs()] == ["running"]
    finally:
        holder.terminate()
        holder.wait()


def test_external_load_is_respected(sim: Path, gpuwait_cmd: list[str], tmp_path: Path) -> None:
    """A simulated job started without gpuwait holds 18 GiB of GPU0: gpuwait must not place 8 GiB there."""
    external = subprocess.Popen(
        [*gpuwait_cmd, "sim", "job", "--vram", "18G", "--hold", "4s"],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"},
    )
    try:
        from gpuwait.gpu.sim import SimBackend

        wait_for(
            lambda: SimBackend(str(sim)).snapshot().gpus[0].used_bytes >= 18 * GiB,
            timeout=90,
            interval=0.05,
            message="the external job never allocated",
        )
        report = tmp_path / "report.json"
        done = run(
            [
                *gpuwait_cmd,
                "--vram",
                "8G",
                "--devices",
                "0",
                "-q",
                "--",
                *gpuwait_cmd,
                "sim",
                "job",
                "--vram",
                "8G",
                "--hold",
                "0.2s",
                "--report",
                str(report),
            ]
        )
        assert done.returncode == 0, done.stderr
        assert json.loads(report.read_text())["oom"] is False
        assert external.wait(timeout=60) == 0
    finally:
        external.kill()
        external.wait()


@pytest.mark.slow
def test_stampede_of_ramping_jobs_has_no_oom(sim: Path, gpuwait_cmd: list[str]) -> None:
    """40 launches at once of 4 GiB jobs that ramp up on two 24 GiB cards: every one fits."""
    started = time.monotonic()
    procs = [
        subprocess.Popen(
            [
                *gpuwait_cmd,
                "--vram",
                "4G",
                "-q",
                "--",
                *gpuwait_cmd,
                "sim",
                "job",
                "--vram",
                "4G",
                "--ramp",
                "0.5s",
                "--hold",
                "0.3s",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(40)
    ]
    results = [(p.wait(timeout=240), p.stderr.read() if p.stderr else "") for p in procs]
    failures = [err for code, err in results if code != 0]
    assert not failures, failures[:3]
    assert not any("out of memory" in err for _, err in results)
    assert ledger_jobs() == []
    history = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "history.jsonl"
    records = [json.loads(line) for line in history.read_text().splitlines()]
    assert len(records) == 40
    # Each card takes five 4 GiB jobs under the 0.9 safety factor, never more at once.
    assert time.monotonic() - started < 240


def test_history_records_the_peak(sim: Path, gpuwait_cmd: list[str]) -> None:
    done = run(
        [
            *gpuwait_cmd,
            "--vram",
            "3G",
            "--",
            *gpuwait_cmd,
            "sim",
            "job",
            "--vram",
            "2G",
            "--hold",
            "1s",
        ]
    )
    assert done.returncode == 0, done.stderr
    history = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "history.jsonl"
    record = json.loads(history.read_text().splitlines()[-1])
    assert record["peak_bytes"] == 2 * GiB
    assert record["exit_status"] == 0 and record["reserved_bytes"] == 3 * GiB
    assert record["gpus"][0]["uuid"] in uuids(sim)


def test_program_named_like_a_subcommand(sim: Path, gpuwait_cmd: list[str], tmp_path: Path) -> None:
    script = tmp_path / "bin" / "status"
    script.parent.mkdir()
    script.write_text("#!/bin/sh\necho I am the status program\n")
    script.chmod(0o755)
    env = {**os.environ, "PATH": f"{script.parent}:{os.environ['PATH']}"}
    done = run([*gpuwait_cmd, "--vram", "1G", "--", "status"], env=env)
    assert done.stdout.strip() == "I am the status program"


@pytest.mark.parametrize("readings", ["simulated", "none"])
def test_a_script_without_a_hash_bang_line_runs_as_a_shell_script(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, readings: str
) -> None:
    """As a shell, env, nohup or timeout runs it (execvp): with /bin/sh. A file that is neither
    a script nor a program the kernel runs is not executable (126), as in a shell."""
    script = tmp_path / "train.sh"
    script.write_text("echo ran-by-sh $1\nexit 6\n")
    garbage = tmp_path / "garbage"
    garbage.write_bytes(b"\x7fELF\x00\x00 not a program\n")
    # An ELF header without a NUL in its first line (cut short, or text that starts so): no
    # script either, as bash tells binary files, though /bin/sh would read it ("ELF: not
    # found", 127).
    no_nul = tmp_path / "no-nul"
    no_nul.write_bytes(b"\x7fELF not a program\n")
    for path in (script, garbage, no_nul):
        path.chmod(0o755)
    env = dict(os.environ)
    if readings == "none":  # run at once, uncoordinated, as on_no_gpu = "run" says
        env.pop("GPUWAIT_SIM")
        env["LD_LIBRARY_PATH"] = str(tmp_path)
    done = run([*gpuwait_cmd, "-q", "--vram", "1G", "--", str(script), "lr"], env=env)
    assert (done.returncode, done.stdout) == (6, "ran-by-sh lr\n"), done.stderr
    for path in (garbage, no_nul):
        done = run([*gpuwait_cmd, "-q", "--vram", "1G", "--", str(path)], env=env)
        assert done.returncode == 126, done.stderr
        assert "Exec format error" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("interpreter", ["/gone/venv/bin/python3", "python3"])
def test_a_script_whose_interpreter_is_gone_is_refused_before_waiting(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, interpreter: str
) -> None:
    """A console script (torchrun, accelerate) of a virtual environment moved or removed since:
    its #! line names a Python that is not there. Refused at once (127), not after the wait.
    So is one whose #! line names a relative path (`#!python3`), which the kernel looks for in
    the current directory, not in PATH, and does not find there."""
    holder = hold_card(gpuwait_cmd, "20G", "30s", "--gpus", "2")
    try:
        wait_for(lambda: "running" in run([*gpuwait_cmd, "status"]).stdout.lower())
        script = tmp_path / "torchrun"
        script.write_text(f"#!{interpreter}\nprint('ran')\n")
        script.chmod(0o755)
        command = [*gpuwait_cmd, "--vram", "20G", "--timeout", "3s", "--", str(script)]
        done = run(command, cwd=tmp_path)
    finally:
        holder.terminate()
        holder.communicate(timeout=30)
    assert done.returncode == 127, done.stderr
    assert f"names {interpreter}, which does not exist" in done.stderr, done.stderr
    assert "waiting" not in done.stderr and "Traceback" not in done.stderr


def test_a_script_whose_interpreter_cannot_run_is_refused_before_waiting(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    """A #! line naming a directory or a file that may not be executed: the kernel refuses the
    script whenever it starts (126, as a shell says `bad interpreter`), so at once, not after
    the wait."""
    text = tmp_path / "not-a-program"
    text.write_text("print('ran')\n")
    scripts = []
    # The last, relative, is looked for in the current directory (the kernel's way).
    for interpreter in (tmp_path, text, Path(text.name)):
        script = tmp_path / f"train-{len(scripts)}"
        script.write_text(f"#!{interpreter}\nprint('ran')\n")
        script.chmod(0o755)
        scripts.append((script, interpreter))
    holder = hold_card(gpuwait_cmd, "20G", "30s", "--gpus", "2")
    try:
        wait_for(lambda: "running" in run([*gpuwait_cmd, "status"]).stdout.lower())
        done = [
            run([*gpuwait_cmd, "--vram", "20G", "--timeout", "1s", "--", str(script)], cwd=tmp_path)
            for script, _ in scripts
        ]
    finally:
        holder.terminate()
        holder.communicate(timeout=30)
    for (_, interpreter), refused in zip(scripts, done, strict=True):
        assert refused.returncode == 126, refused.stderr
        assert f"{interpreter}, which is not executable" in refused.stderr
        assert "waiting" not in refused.stderr and "Traceback" not in refused.stderr


def test_without_gpu_readings_the_command_runs_with_one_warning(
    gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # No GPUWAIT_SIM, and no NVIDIA driver on the test machines: NVML cannot load.
    env = {**os.environ, "LD_LIBRARY_PATH": str(tmp_path)}
    done = run([*gpuwait_cmd, "--vram", "1G", "--", "sh", "-c", "echo ran; exit 3"], env=env)
    assert done.returncode == 3 and done.stdout == "ran\n"
    assert len(done.stderr.splitlines()) == 1 and "warning" in done.stderr
    env["GPUWAIT_ON_NO_GPU"] = "fail"
    done = run([*gpuwait_cmd, "--vram", "1G", "--", "sh", "-c", "echo ran"], env=env)
    assert done.returncode == 4 and done.stdout == ""
    assert "hint:" in done.stderr and "GPUWAIT_SIM" in done.stderr


def test_status_without_gpu_readings_shows_the_queue_and_exits_4(
    gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    env = {**os.environ, "LD_LIBRARY_PATH": str(tmp_path)}
    done = run([*gpuwait_cmd, "status"], env=env)
    assert done.returncode == 4
    assert "Queue (0)" in done.stdout
    assert done.stderr.startswith("gpuwait: error: ") and "driver" in done.stderr
    # And what to do about it, as a launch says.
    assert "\ngpuwait: hint: " in done.stderr
    as_json = run([*gpuwait_cmd, "status", "--json"], env=env)
    report = json.loads(as_json.stdout)
    assert as_json.returncode == 4 and report["backend_error"] and report["backend_hint"]


def test_status_and_idle_exit_4_when_no_gpu_answers(gpuwait_cmd: list[str], sim_file: Any) -> None:
    """Every GPU lost is a reading that failed, as a launch takes it (exit 4 at
    gpu_error_timeout): status said nothing of it and ended 0, and idle answered "No idle VRAM
    holders" of GPUs it could not read."""
    sim_file(gpus=2, lost=True)
    done = run([*gpuwait_cmd, "status"])
    assert done.returncode == 4, done.stderr
    assert "Queue (0)" in done.stdout  # the rest is shown
    assert "gpuwait: error: no GPU answers: GPU 0" in done.stderr
    assert "\ngpuwait: hint: " in done.stderr
    report = json.loads(run([*gpuwait_cmd, "status", "--json"]).stdout)
    assert report["backend_error"].startswith("no GPU answers") and report["backend_hint"]
    idle = run([*gpuwait_cmd, "idle"])
    assert idle.returncode == 4 and "No idle VRAM holders" not in idle.stdout
    assert "no GPU answers" in idle.stderr


BAD_INPUT = [
    (["--vram", "6X", "true"], 2, "not a size"),
    (["--vram", "0", "true"], 2, "larger than zero"),
    (["--vram=-4G", "true"], 2, "'-4G' is negative"),
    (["--vram", "-4G", "true"], 2, "'-4G' is negative"),
    (["--vram", "150%", "true"], 2, "percentage"),
    (["--vram", "1G"], 2, "no command"),
    (["--vram", "1G", "--"], 2, "no command"),
    (["--vrm", "1G", "true"], 2, "unrecognized arguments"),
    (["--gpus", "0", "true"], 2, "at least 1"),
    (["--gpus", "x", "true"], 2, "not a whole number"),
    (["--timeout", "soon", "true"], 2, "not a duration"),
    (["--pick", "fastest", "true"], 2, "best-fit"),
    (["--priority", "9", "true"], 2, "priority"),
    (["--safety", "1.5", "true"], 2, "fraction"),
    (["--devices", "7", "--vram", "1G", "true"], 2, "no GPU '7'"),
    (["--vram", "30G", "true"], 3, "can never fit"),
    (["--vram", "10G", "--gpus", "3", "true"], 3, "only 2 can be used"),
    (["--vram", "1G", "no-such-command-xyz"], 127, "command not found"),
    (["--vram", "1G", "", "x.py"], 127, "'': command not found: the command's name is empty"),
    (["--vram", "1G", "/etc/passwd"], 126, "not executable"),
    (["status", "--bogus"], 2, "unrecognized arguments"),
]


@pytest.mark.parametrize("python3", [True, False])
def test_python_not_installed_where_python3_is_is_answered_with_python3(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, python3: bool
) -> None:
    # Where only python3 is installed (Debian, Ubuntu), `gpuwait --vram 4G python x.py` ended
    # with exit 127, "python: command not found", and nothing more.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if python3:
        (bin_dir / "python3").symlink_to(sys.executable)
    env = {**os.environ, "PATH": str(bin_dir)}
    done = run([*gpuwait_cmd, "--vram", "4G", "python", "x.py"], env=env)
    assert done.returncode == 127, done.stderr
    lines = done.stderr.splitlines()
    assert lines[0] == "gpuwait: error: python: command not found"
    if python3:
        assert lines[1:] == ["gpuwait: hint: python3 is installed: gpuwait ... -- python3 x.py"]
    else:
        assert lines[1:] == []
    # A misspelling of it read "pyhton: command not found" alone.
    done = run([*gpuwait_cmd, "--vram", "4G", "pyhton", "x.py"], env=env)
    assert done.returncode == 127, done.stderr
    hint = ["gpuwait: hint: did you mean python3? gpuwait ... -- python3 x.py"]
    assert done.stderr.splitlines()[1:] == (hint if python3 else [])
    # A script here named as a program read "x.py: command not found" alone.
    (tmp_path / "x.py").write_text("")
    (tmp_path / "job.sh").write_text("")
    done = run([*gpuwait_cmd, "--vram", "4G", "x.py", "--lr", "1"], env=env, cwd=tmp_path)
    assert done.returncode == 127, done.stderr
    here = "gpuwait: hint: x.py is a file here, not a program on PATH: gpuwait ... -- "
    assert done.stderr.splitlines()[1:] == [
        here + ("python3 x.py --lr 1" if python3 else "./x.py --lr 1")
    ]
    done = run([*gpuwait_cmd, "--vram", "4G", "job.sh"], env=env, cwd=tmp_path)
    assert done.stderr.splitlines()[1:] == [here.replace("x.py", "job.sh") + "./job.sh"]
    assert ledger_jobs() == []


def path_with_python3(tmp_path: Path, *more: str) -> dict[str, str]:
    """The environment with PATH `tmp_path`/bin, which holds `python3` (this interpreter) alone,
    then the directories `more`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    return {**os.environ, "PATH": ":".join([str(bin_dir), *more])}


def test_a_file_not_executable_is_answered_with_the_line_that_runs_it(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # `gpuwait --vram 4G ./x.py` (a script never made executable, as the hint for `x.py` alone
    # has it typed) read "./x.py: not executable" alone.
    env = path_with_python3(tmp_path)
    (tmp_path / "x.py").write_text("")
    (tmp_path / "job.sh").write_text("#!/bin/sh\n")
    done = run([*gpuwait_cmd, "--vram", "4G", "./x.py", "--lr", "1"], env=env, cwd=tmp_path)
    assert done.returncode == 126, done.stderr
    assert done.stderr.splitlines() == [
        "gpuwait: error: ./x.py: not executable",
        "gpuwait: hint: a Python script: gpuwait ... -- python3 ./x.py --lr 1",
    ]
    done = run([*gpuwait_cmd, "--vram", "4G", "./job.sh"], env=env, cwd=tmp_path)
    assert done.returncode == 126, done.stderr
    assert done.stderr.splitlines() == [
        "gpuwait: error: ./job.sh: not executable",
        "gpuwait: hint: make it executable first: chmod +x ./job.sh",
    ]
    # A binary file named so is no Python script: python would not run it either.
    (tmp_path / "tool.py").write_bytes(b"\x7fELF\x02\x01\x01\0\0\0")
    done = run([*gpuwait_cmd, "--vram", "4G", "./tool.py"], env=env, cwd=tmp_path)
    assert done.returncode == 126, done.stderr
    assert done.stderr.splitlines() == ["gpuwait: error: ./tool.py: not executable"]
    # A directory has no line that runs it.
    done = run([*gpuwait_cmd, "--vram", "4G", str(tmp_path)], env=env)
    assert done.returncode == 126, done.stderr
    assert done.stderr.splitlines() == [f"gpuwait: error: {tmp_path}: not executable"]
    assert ledger_jobs() == []


def test_a_script_on_a_noexec_mount_is_answered_with_its_interpreter_not_chmod(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # A script already executable, on a file system mounted noexec (/tmp, /dev/shm, a home on
    # some servers), was told "make it executable first: chmod +x ./job.sh", which changes
    # nothing there.
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    inside = (
        f"mount -t tmpfs -o noexec tmpfs {mnt} && cd {mnt} && "
        "printf '#!/bin/sh -e\\necho ran\\n' > job.sh && printf 'echo ran\\n' > run.sh && "
        'chmod +x job.sh run.sh && "$@" ./job.sh; "$@" ./run.sh'
    )
    done = run(
        [
            "unshare",
            "--map-root-user",
            "--mount",
            "sh",
            "-c",
            inside,
            "sh",
            *gpuwait_cmd,
            "--vram",
            "4G",
        ]
    )
    if "mount" in done.stderr and "gpuwait" not in done.stderr:
        pytest.skip(f"no file system can be mounted noexec here: {done.stderr.strip()}")
    assert done.stderr.splitlines() == [
        "gpuwait: error: ./job.sh: not executable",
        "gpuwait: hint: its file system runs no program (mounted noexec): "
        "gpuwait ... -- /bin/sh -e ./job.sh",
        "gpuwait: error: ./run.sh: not executable",
        "gpuwait: hint: its file system runs no program (mounted noexec): "
        "gpuwait ... -- /bin/sh ./run.sh",
    ]


def test_a_python_script_without_a_hash_bang_line_is_refused_before_the_wait(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # `chmod +x x.py; gpuwait --vram 4G ./x.py`, its first line no #!: it waited for its GPU,
    # then /bin/sh read the Python, "./x.py: 1: Syntax error: word unexpected".
    env = path_with_python3(tmp_path, "/usr/bin", "/bin")
    script = tmp_path / "x.py"
    script.write_text('print("hi")\n')
    script.chmod(0o755)
    done = run([*gpuwait_cmd, "--vram", "4G", "./x.py", "--lr", "1"], env=env, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "gpuwait: error: ./x.py has no #! line: /bin/sh would run it once its GPU is free, "
        "not python",
        "gpuwait: hint: gpuwait ... -- python3 ./x.py --lr 1",
    ]
    assert ledger_jobs() == []
    # One found on PATH: the hint's python is given its path, not the name it has in no
    # directory here ("can't open file 'tool.py'").
    bin_dir = tmp_path / "bin"
    (bin_dir / "tool.py").write_text('print("hi")\n')
    (bin_dir / "tool.py").chmod(0o755)
    done = run([*gpuwait_cmd, "--vram", "4G", "tool.py"], env=env, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert (
        done.stderr.splitlines()[-1] == f"gpuwait: hint: gpuwait ... -- python3 {bin_dir}/tool.py"
    )
    # A shell script without one runs with /bin/sh, as in a shell.
    shell = tmp_path / "job.sh"
    shell.write_text("echo ran\n")
    shell.chmod(0o755)
    done = run([*gpuwait_cmd, "--vram", "4G", "./job.sh"], env=env, cwd=tmp_path)
    assert (done.returncode, done.stdout) == (0, "ran\n"), done.stderr


@pytest.mark.parametrize(
    ("typed", "meant"), [("trian.py", "train.py"), ("src/trian.py", "src/train.py")]
)
def test_a_misspelt_script_is_refused_before_the_wait(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, typed: str, meant: str
) -> None:
    # `gpuwait --vram 4G python trian.py` waited for its GPU, then python said "can't open
    # file": on a busy machine, hours later.
    (tmp_path / "src").mkdir()
    for script in ("train.py", "src/train.py"):
        (tmp_path / script).write_text("")
    done = run([*gpuwait_cmd, "--vram", "4G", "python", "-u", typed, "--lr", "1"], cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"gpuwait: error: no script {typed} here: python would wait for its GPU, then fail",
        f"gpuwait: hint: did you mean {meant}? gpuwait ... -- python -u {meant} --lr 1",
    ]
    assert ledger_jobs() == []


def test_a_missing_script_with_no_close_name_is_warned_of_and_the_run_goes_on(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # A script no name here is close to, or the next of a series (run_3.py beside run_2.py),
    # may be one a step outside gpuwait writes while this waits: the run is not lost, but the
    # user is told before the wait.
    (tmp_path / "run_2.py").write_text("")
    for script, guess in (("evaluate.py", ""), ("run_3.py", "; did you mean run_2.py?")):
        done = run([*gpuwait_cmd, "--vram", "4G", "python", script], cwd=tmp_path)
        assert done.stderr.splitlines()[0] == (
            f"gpuwait: warning: no script {script} here (yet{guess}): python fails unless it is "
            "there once its GPU is"
        ), done.stderr
        # python's own refusal, at once on a free card.
        assert done.returncode == 2 and "can't open file" in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("script", "beside"),
    [("train.py", "train.ipynb"), ("config.py", "config.py.in"), ("x.py", "b.py")],
)
def test_a_missing_script_beside_a_file_it_does_not_misspell_is_warned_of_not_refused(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, script: str, beside: str
) -> None:
    # `python train.py` beside train.ipynb (or config.py beside the config.py.in it is made
    # from) was refused, "did you mean train.ipynb? gpuwait ... -- python train.ipynb", a line
    # python cannot run, where the script may be one a step writes from that file while this
    # waits; and `python x.py` beside b.py was taken for a misspelling.
    (tmp_path / beside).write_text("")
    done = run([*gpuwait_cmd, "--vram", "4G", "python", script], cwd=tmp_path)
    assert done.stderr.splitlines()[0] == (
        f"gpuwait: warning: no script {script} here (yet): python fails unless it is there "
        "once its GPU is"
    ), done.stderr
    assert done.returncode == 2 and "can't open file" in done.stderr, done.stderr


def test_a_misspelt_script_of_a_job_that_waits_for_another_is_warned_of_not_refused(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # A job run --after another may run what that one writes: told, not refused.
    (tmp_path / "train.py").write_text("")
    first = hold_card(gpuwait_cmd, "1G", "0.3s", "--name", "prep")
    try:
        wait_for(lambda: [j["name"] for j in ledger_entries()] == ["prep"] or first.poll())
        argv = ["--after", "prep", "--vram", "1G", "python", "trian.py"]
        done = run([*gpuwait_cmd, *argv], cwd=tmp_path)
    finally:
        first.communicate(timeout=60)
    assert done.stderr.splitlines()[0] == (
        "gpuwait: warning: no script trian.py here (yet; did you mean train.py?): python fails "
        "unless it is there once its GPU is"
    ), done.stderr
    assert done.returncode == 2 and "can't open file" in done.stderr, done.stderr


def user_config(isolated_dirs: Path) -> Path:
    """The user's config file under the test's own dirs (its directory made, the file not)."""
    config = isolated_dirs / "config" / "gpuwait" / "config.toml"
    config.parent.mkdir(parents=True)
    return config


@pytest.mark.parametrize(("argv", "status", "message"), BAD_INPUT)
def test_bad_input_is_answered_at_once(
    sim: Path, gpuwait_cmd: list[str], argv: list[str], status: int, message: str
) -> None:
    started = time.monotonic()
    done = run([*gpuwait_cmd, *argv])
    assert done.returncode == status, done.stderr
    assert message in done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("gpuwait: error:")
    assert time.monotonic() - started < 10
    assert ledger_jobs() == []


def test_bad_config_file_is_one_line(
    sim: Path, gpuwait_cmd: list[str], isolated_dirs: Path
) -> None:
    config = user_config(isolated_dirs)
    for text, message in (
        ("safety = [", "config file"),
        ("safty = 0.5", "unknown setting 'safty'"),
        ("safety = 2", "fraction"),
    ):
        config.write_text(text)
        done = run([*gpuwait_cmd, "--vram", "1G", "true"])
        assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr


def test_a_misspelt_setting_in_the_config_file_is_told_the_one_meant_in_a_short_line(
    sim: Path, gpuwait_cmd: list[str], isolated_dirs: Path
) -> None:
    # `safty = 0.5` was refused with every setting's name after it, a line of some 700
    # characters (each wrapped `python` of the shell hook said it), the one meant only in the
    # hint below it. Where one is close, the line now names the file and the key alone.
    config = user_config(isolated_dirs)
    config.write_text("safty = 0.5\n")
    done = run([*gpuwait_cmd, "--vram", "1G", "true"])
    assert done.returncode == 2, done.stderr
    error, hint = done.stderr.splitlines()
    assert error == f"gpuwait: error: config file {config}: unknown setting 'safty'", error
    assert hint == "gpuwait: hint: did you mean safety?"
    # Nothing close: the names are the help there is.
    config.write_text("zzz = 1\n")
    done = run([*gpuwait_cmd, "--vram", "1G", "true"])
    assert done.returncode == 2 and "known settings: safety, pick," in done.stderr, done.stderr


def test_config_shows_sources_by_precedence(
    sim: Path, gpuwait_cmd: list[str], isolated_dirs: Path
) -> None:
    config = user_config(isolated_dirs)
    config.write_text('safety = 0.8\npick = "most-free"\n')
    env = {**os.environ, "GPUWAIT_PICK": "round-robin"}
    done = run([*gpuwait_cmd, "config", "--json"], env=env)
    settings = json.loads(done.stdout)["settings"]
    assert settings["safety"] == {
        "value": "0.8",
        "source": f"config file {config}",
        "parsed": 0.8,
    }
    assert settings["pick"] == {
        "value": "round-robin",
        "source": "environment GPUWAIT_PICK",
        "parsed": "round-robin",
    }
    assert settings["priority"]["source"] == "default"


def test_config_shows_pause_min_runtime_as_a_duration(sim: Path, gpuwait_cmd: list[str]) -> None:
    env = {**os.environ, "GPUWAIT_PAUSE_MIN_RUNTIME": "90s"}
    settings = json.loads(run([*gpuwait_cmd, "config", "--json"], env=env).stdout)["settings"]
    shown = settings["pause_min_runtime"]["value"]
    assert shown == "1m30s"  # as typed: a bare 90.0 would read as a count
    env["GPUWAIT_PAUSE_MIN_RUNTIME"] = shown
    again = json.loads(run([*gpuwait_cmd, "config", "--json"], env=env).stdout)["settings"]
    assert again["pause_min_runtime"]["value"] == shown


def test_config_shows_control_characters_as_question_marks(
    sim: Path, gpuwait_cmd: list[str], isolated_dirs: Path
) -> None:
    # Values and paths are anybody's text: an escape sequence in one must not reach the
    # terminal as one (it could retitle the window, or hide what follows).
    config = user_config(isolated_dirs)
    config.write_text('never_wrap = ["\\u001b]0;PWNED\\u0007"]\n')
    state = isolated_dirs / "state\x1b[31mred"
    env = {**os.environ, "GPUWAIT_STATE_DIR": str(state)}
    done = run([*gpuwait_cmd, "config"], env=env)
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout and "\x07" not in done.stdout
    assert "?]0;PWNED?" in done.stdout and "state?[31mred" in done.stdout


def test_status_json_shows_running_and_waiting(sim: Path, gpuwait_cmd: list[str]) -> None:
    holders = [hold_card(gpuwait_cmd, "20G", "20s", "--devices", str(i)) for i in (0, 1)]
    waiter = None
    try:
        # The waiter starts once both cards are taken; started together, it could be first in.
        wait_for_jobs(2, "running")
        waiter = subprocess.Popen([*gpuwait_cmd, "--vram", "10G", "-q", "true"])
        wait_for_jobs(3)
        report = json.loads(run([*gpuwait_cmd, "status", "--json"]).stdout)
        assert report["schema"] == 2 and report["backend"] == "sim"
        assert [j["state"] for j in report["jobs"]] == ["running", "running", "waiting"]
        assert "waiting for 10.0 GiB" in report["jobs"][2]["waiting_reason"]
        assert all(g["reserved_bytes"] >= 20 * GiB for g in report["gpus"])
        text = run([*gpuwait_cmd, "status"]).stdout
        assert "Queue (1)" in text and "Running (2)" in text
    finally:
        if waiter is not None:
            waiter.terminate()
            waiter.wait()
        for h in holders:
            h.terminate()
            h.wait()


def test_a_gpuwait_inside_a_job_that_keeps_its_room_is_refused_at_once(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    # The inner gpuwait could only start once the job it runs inside has ended, and that job
    # waits for it: refused at once (3), naming the job, and nothing queued meanwhile.
    inner = " ".join([*gpuwait_cmd, "--vram", "12G", "--", "echo", "inner"])
    started = time.monotonic()
    done = run([*gpuwait_cmd, "--vram", "12G", "--", "sh", "-c", f"{inner}; echo rc=$?"])
    assert time.monotonic() - started < 30
    assert done.returncode == 0, done.stderr
    assert done.stdout == "rc=3\n"
    assert "inside gpuwait job" in done.stderr and "Traceback" not in done.stderr
    assert len([line for line in done.stderr.splitlines() if "error" in line]) == 1
    # Beside it, a request that fits the card with the outer job's room kept waits and starts
    # as ever; and a whole GPU inside any job there can never start either.
    beside = " ".join([*gpuwait_cmd, "-q", "--vram", "8G", "--", "echo", "beside"])
    whole = " ".join([*gpuwait_cmd, "-q", "--", "echo", "whole"])
    done = run([*gpuwait_cmd, "--vram", "12G", "--", "sh", "-c", f"{beside}; {whole}; echo rc=$?"])
    assert done.stdout == "beside\nrc=3\n", done.stderr
    assert ledger_jobs() == []


def test_a_gpuwait_that_is_the_jobs_command_itself_is_refused_at_once(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # `gpuwait -- gpuwait ...`, or a job script that ends `exec gpuwait ...`: the inner gpuwait is
    # the outer job's command, no child of it, and waits for that job as any descendant would.
    # Its stdin and stdout are no pipes (a service's, a cron job's): nothing but the job ties it.
    inner = [*gpuwait_cmd, "--vram", "12G", "--timeout", "20s", "--", "echo", "inner"]
    out = tmp_path / "out"
    started = time.monotonic()
    with out.open("w") as stdout:
        done = subprocess.run(
            [*gpuwait_cmd, "--vram", "12G", "--", *inner],
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    assert time.monotonic() - started < 15, done.stderr
    assert done.returncode == 3, done.stderr
    assert "runs inside gpuwait job" in done.stderr and "Traceback" not in done.stderr
    assert out.read_text() == ""
    assert ledger_jobs() == []


def test_a_command_with_an_argument_that_is_no_utf8_runs_and_is_recorded(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    # A Latin-1 file name (old data sets, cron's C locale alike): Python holds it as surrogates;
    # the command gets the bytes, gpuwait its exit status, and the history a record.
    name = b"caf\xe9.txt"
    done = subprocess.run(
        [*gpuwait_cmd, "--vram", "1G", "--", "sh", "-c", 'printf "%s" "$1"; exit 5', "sh", name],
        capture_output=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout) == (5, name), done.stderr.decode(errors="replace")
    assert b"Traceback" not in done.stderr
    assert ledger_jobs() == []
    shown = run([*gpuwait_cmd, "history", "--json", "-n", "1"])
    assert shown.returncode == 0 and "Traceback" not in shown.stderr, shown.stderr
    (record,) = json.loads(shown.stdout)
    assert record["exit_status"] == 5


@pytest.mark.parametrize("given", [None, "C", "POSIX", "C.UTF-8"])
def test_the_command_gets_the_locale_gpuwait_was_started_with(
    sim: Path, gpuwait_cmd: list[str], given: str | None
) -> None:
    # As under cron or `env -i`: Python switches a C locale to UTF-8 for itself by setting
    # LC_CTYPE; the command, bare, would have none set, or the one given.
    env = {"PATH": os.environ["PATH"], "HOME": os.environ["HOME"]}
    env.update({k: v for k, v in os.environ.items() if k.startswith(("GPUWAIT_", "XDG_"))})
    if given is not None:
        env["LC_CTYPE"] = given
    show = ["sh", "-c", 'echo "${LC_CTYPE-unset}"']
    done = run([*gpuwait_cmd, "--vram", "1G", "--", *show], env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{given or 'unset'}\n"


@pytest.mark.parametrize("first", ["writer", "reader"])
def test_a_pipeline_of_jobs_that_cannot_share_the_cards_ends_at_once(
    sim: Path, gpuwait_cmd: list[str], first: str
) -> None:
    # The writer fills the pipe and waits for the reader, which would wait for the writer's
    # cards: whichever stage starts second is refused at once (3), and the pipeline ends.
    gw = " ".join([*gpuwait_cmd, "-q", "--vram", "20G", "--gpus", "2", "--"])
    write = f"{sys.executable} -c 'print(\"x\" * 200000)'"
    read = f"{sys.executable} -c 'import sys; print(len(sys.stdin.read()))'"
    late = {"writer": ("", "sleep 1; "), "reader": ("sleep 1; ", "")}[first]
    script = (
        f"({late[0]}exec {gw} {write}) | ({late[1]}exec {gw} {read}); echo rc=${{PIPESTATUS[*]}}"
    )
    started = time.monotonic()
    done = run(["bash", "-c", script])
    assert time.monotonic() - started < 30
    assert "is in a pipeline with gpuwait job" in done.stderr, done.stderr
    statuses = done.stdout.split("rc=")[1].split()
    assert (statuses[0] if first == "reader" else statuses[1]) == "3", done.stdout
    assert ledger_jobs() == []
    # Cards to share: both stages run, as bare.
    small = " ".join([*gpuwait_cmd, "-q", "--vram", "4G", "--"])
    done = run(["bash", "-c", f"{small} {write} | {small} {read}"])
    assert done.returncode == 0 and done.stdout == "200001\n", done.stderr


def test_stages_joined_through_another_program_are_a_pipeline_too(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    # `gen | tee log | filter`: the writer blocks on tee, which blocks on the reader.
    gw = " ".join([*gpuwait_cmd, "-q", "--vram", "20G", "--gpus", "2", "--"])
    write = f"{sys.executable} -c 'print(\"x\" * 200000)'"
    read = f"{sys.executable} -c 'import sys; print(len(sys.stdin.read()))'"
    script = f"{gw} {write} | cat | (sleep 1; exec {gw} {read}); echo rc=${{PIPESTATUS[*]}}"
    started = time.monotonic()
    done = run(["bash", "-c", script])
    assert time.monotonic() - started < 30
    assert "is in a pipeline with gpuwait job" in done.stderr, done.stderr
    assert done.stdout.split("rc=")[1].split()[2] == "3", done.stdout


def test_jobs_that_only_write_to_the_same_pipe_wait_for_each_other_as_ever(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    # `make -j8 2>&1 | tee log`: every recipe writes to tee, in the same process group, and
    # none waits for another's output: the second waits for the first's cards, then runs.
    gw = " ".join([*gpuwait_cmd, "-q", "--vram", "20G", "--gpus", "2", "--"])
    script = f"({gw} sleep 2 & sleep 0.5; {gw} echo second; wait) 2>&1 | cat"
    done = run(["bash", "-c", script])
    assert done.returncode == 0, done.stdout
    assert done.stdout.strip() == "second", done.stdout
    assert ledger_jobs() == []


def test_a_stage_whose_output_fits_the_pipe_is_waited_for_as_ever(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    # The writer's few lines fit the pipe: it ends without anyone reading, and the reader,
    # which needs the same cards, starts after it, as one would expect.
    gw = " ".join([*gpuwait_cmd, "-q", "--vram", "20G", "--gpus", "2", "--"])
    write = f"{sys.executable} -c 'import time; print(\"hello\", flush=True); time.sleep(2)'"
    read = f"{sys.executable} -c 'import sys; print(sys.stdin.read().upper(), end=\"\")'"
    done = run(["bash", "-c", f"{gw} {write} | (sleep 0.5; exec {gw} {read})"])
    assert done.returncode == 0, done.stderr
    assert done.stdout == "HELLO\n"
    assert "pipeline" not in done.stderr


@pytest.mark.parametrize(
    ("options", "helps"),
    [
        (["--gpu-name", "H100", "--vram", "1G"], "--gpu-name"),
        (["--min-total-vram", "30G", "--vram", "1G"], "--min-total-vram"),
        (["--min-compute-capability", "9.0", "--vram", "1G"], "--min-compute-capability"),
        (["--gpus", "3", "--vram", "1G"], "fewer GPUs (--gpus)"),
    ],
)
def test_a_request_that_can_never_fit_is_told_what_would_help(
    gpuwait_cmd: list[str], sim_file: Any, options: list[str], helps: str
) -> None:
    # Every such refusal said "ask for less (--vram), raise safety, or use other GPUs", which
    # does nothing for a GPU name, a capability, a card size or a count no GPU here offers.
    sim_file(gpus=2)
    done = run([*gpuwait_cmd, *options, "--", "true"])
    assert done.returncode == 3, done.stderr
    hint = done.stderr.splitlines()[-1]
    assert hint.startswith("gpuwait: hint: ") and helps in hint, done.stderr
    assert "raise safety" not in hint and "(--vram)" not in hint, hint


def test_a_whole_card_asked_as_a_share_is_told_of_exclusive(
    gpuwait_cmd: list[str], sim_file: Any
) -> None:
    # `--vram 100%`, the whole card, can never fit under the default safety of 0.9: the hint
    # said to ask for less or raise safety, not that --exclusive gives a whole GPU.
    sim_file(gpus=2)
    done = run([*gpuwait_cmd, "--vram", "100%", "--", "true"])
    assert done.returncode == 3, done.stderr
    hint = done.stderr.splitlines()[-1]
    assert hint.startswith("gpuwait: hint: for a whole GPU, --exclusive in place of --vram;"), (
        done.stderr
    )
    done = run([*gpuwait_cmd, "--vram", "30G", "--", "true"])
    assert done.returncode == 3 and "--exclusive" not in done.stderr, done.stderr


def test_a_request_too_large_for_any_card_is_told_where_safety_is_raised(
    gpuwait_cmd: list[str], sim_file: Any
) -> None:
    # `--vram 22G` on 24 GiB cards fits under safety 0.95, not the default 0.9: the hint said
    # "raise safety" and nothing of where safety is set.
    sim_file(gpus=2)
    done = run([*gpuwait_cmd, "--vram", "22G", "--", "true"])
    assert done.returncode == 3, done.stderr
    hint = done.stderr.splitlines()[-1]
    assert "raise safety (--safety, or `safety =` in the config file)" in hint, done.stderr


@pytest.mark.parametrize("slurm", [False, True])
def test_a_request_that_never_fits_the_gpus_an_inherited_cuda_visible_devices_leaves_says_so(
    gpuwait_cmd: list[str], sim_file: Any, slurm: bool
) -> None:
    # Inside a Slurm allocation given GPU 0 of two (or a container, or a shell that set it),
    # `--gpus 2` and `--vram 22G` were refused with "only 1 can be used" and "use other GPUs
    # (--devices, --gpu-name)": nothing said that CUDA_VISIBLE_DEVICES had left gpuwait the one
    # GPU, and --devices cannot reach past it.
    sim_file(gpus=2)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0"}
    if slurm:
        env["SLURM_JOB_ID"] = "7"
    for options in (["--gpus", "2", "--vram", "1G"], ["--vram", "22G"]):
        done = run([*gpuwait_cmd, *options, "--", "true"], env=env)
        assert done.returncode == 3, done.stderr
        hint = done.stderr.splitlines()[-1]
        assert hint.startswith("gpuwait: hint: "), done.stderr
        assert "CUDA_VISIBLE_DEVICES=0 leaves gpuwait 1 of this machine's 2 GPUs" in hint, hint
        assert ("ask Slurm for others" in hint) == slurm, hint
    # Without the variable, or where it leaves every GPU, the hint is as before.
    for given in (None, "0,1"):
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        if given is not None:
            env["CUDA_VISIBLE_DEVICES"] = given
        done = run([*gpuwait_cmd, "--vram", "30G", "--", "true"], env=env)
        assert done.returncode == 3 and "CUDA_VISIBLE_DEVICES" not in done.stderr, done.stderr


@pytest.mark.parametrize("safety", ["0.9", "1"])
def test_a_request_larger_than_any_card_is_not_told_to_raise_safety(
    gpuwait_cmd: list[str], sim_file: Any, safety: str
) -> None:
    # `--vram 30G` on 24 GiB cards fits at no safety (1 is the most): the hint said "raise
    # safety", a way out that never helps.
    sim_file(gpus=2)
    done = run([*gpuwait_cmd, "--safety", safety, "--vram", "30G", "--", "true"])
    assert done.returncode == 3, done.stderr
    hint = done.stderr.splitlines()[-1]
    assert hint.startswith("gpuwait: hint: ask for less (--vram)"), done.stderr
    assert "safety" not in hint and "--devices" in hint, done.stderr


def test_a_request_for_cards_that_take_no_cuda_work_is_told_what_would_help(
    gpuwait_cmd: list[str], sim_file: Any
) -> None:
    sim_file(gpus=1, compute_mode="prohibited")
    done = run([*gpuwait_cmd, "--vram", "1G", "--", "true"])
    assert done.returncode == 3, done.stderr
    hint = done.stderr.splitlines()[-1]
    assert "compute mode" in hint and "raise safety" not in hint, done.stderr


@pytest.mark.parametrize(
    "options", [["--vram", "40G"], ["--vram", "20G", "--gpus", "2"]], ids=["size", "gang"]
)
def test_a_request_that_only_a_card_in_prohibited_mode_could_serve_is_told_so(
    gpuwait_cmd: list[str], sim_file: Any, options: list[str]
) -> None:
    # The 80 GiB card is shut for maintenance (nvidia-smi -c PROHIBITED): 40G was refused as
    # a size that can never fit, naming the 24 GiB card as the largest, with no word of the
    # other one, and the hint said to ask for less; it now names the shut card and says what
    # would open it.
    sim_file(gpus=2, memory=["24GiB", "80GiB"], compute_mode=[None, "prohibited"])
    done = run([*gpuwait_cmd, *options, "--", "true"])
    assert done.returncode == 3, done.stderr
    error, hint = done.stderr.splitlines()[-2:]
    assert error.endswith("GPU1's compute mode is prohibited"), done.stderr
    assert "nvidia-smi -c DEFAULT" in hint, done.stderr


@pytest.mark.parametrize(
    ("gpus", "memory", "modes", "shut"),
    [
        (1, ["24GiB", "80GiB"], [None, "prohibited"], "GPU1"),
        (2, ["80GiB", "24GiB", "80GiB"], ["prohibited", "prohibited", None], "GPU0"),
    ],
    ids=["one", "gang"],
)
def test_a_requirement_that_only_a_card_in_prohibited_mode_meets_is_told_so(
    gpuwait_cmd: list[str], sim_file: Any, gpus: int, memory: list[str], modes: list[Any], shut: str
) -> None:
    # The 80 GiB cards are shut for maintenance: a job that needs a card of 40 GiB was told
    # that no GPU has that much (naming the 24 GiB one) and to change its requirement, with no
    # word of the card that has it; and a gang was told of every shut card, the 24 GiB one's
    # too, which meets nothing it asks.
    sim_file(gpus=len(memory), memory=memory, compute_mode=modes)
    options = ["--vram", "1G", "--min-total-vram", "40G", "--gpus", str(gpus)]
    done = run([*gpuwait_cmd, *options, "--", "true"])
    assert done.returncode == 3, done.stderr
    error, hint = done.stderr.splitlines()[-2:]
    assert error.endswith(f"; {shut}'s compute mode is prohibited"), done.stderr
    assert "nvidia-smi -c DEFAULT" in hint, done.stderr


def test_reserve_names_its_own_keywords_in_the_hint(sim_file: Any) -> None:
    import gpuwait

    sim_file(gpus=2)
    with pytest.raises(gpuwait.ReserveError) as refused:
        gpuwait.reserve("1G", gpus=3)
    assert refused.value.exit_code == 3
    assert refused.value.hint == "ask for fewer GPUs (gpus)"


def test_history_of_a_command_that_used_no_gpu_memory_blames_no_driver(
    gpuwait_cmd: list[str], sim_file: Any
) -> None:
    # The simulation lists every process with its memory, as NVML does on a host; a command
    # that allocated nothing was shown `~0 B`, "NVML gave no per-process figures".
    sim_file(gpus=1)
    assert run([*gpuwait_cmd, "--vram", "1G", "--", "sleep", "0.3"]).returncode == 0
    shown = run([*gpuwait_cmd, "history"])
    assert "~0 B" in shown.stdout
    assert "no per-process figures" not in shown.stdout
    assert "listed none of its processes" in shown.stdout


def ended_under_a_held_lock(
    gpuwait_cmd: list[str], command: list[str], end: Callable[[subprocess.Popen[str]], str]
) -> tuple[subprocess.Popen[str], str, str]:
    """Run `command` as a job; once it runs, keep the ledger's lock as another process would,
    and end the command with `end(launch)` (what it returns goes to its stdin). Returns the
    launch, its job's id and its stderr; fails where gpuwait does not end soon after."""
    launch = subprocess.Popen(
        [*gpuwait_cmd, "--vram", "1G", "--", *command],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    fd = -1
    try:
        wait_for(lambda: [j for j in ledger_entries() if j.get("child_pid")], timeout=30)
        (job_id,) = [j["id"] for j in ledger_entries()]
        fd = os.open(Path(dirs.user_state_dir()) / "ledger.lock", os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)  # another process's long transaction
        try:
            _, err = launch.communicate(end(launch), timeout=10)
        except subprocess.TimeoutExpired:
            pytest.fail("gpuwait kept the finished command's prompt waiting for the lock")
    finally:
        if fd >= 0:
            os.close(fd)
        launch.kill()
        launch.communicate()
    return launch, job_id, err


def test_a_run_that_ends_while_another_process_keeps_the_ledger_lock_ends_at_once(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    """The command ends while another process keeps the ledger's lock: gpuwait waited the
    whole lock_timeout (a minute) to take its entry out before giving the prompt back, and the
    next gpuwait then called the run lost: a job waiting for it with --after-ok never ran, and
    the history held the run twice. Now it ends at once, and the run counts as it ended."""
    # A command that starts no process of its own, so that no new one is published meanwhile.
    launch, job_id, err = ended_under_a_held_lock(
        gpuwait_cmd, ["sh", "-c", "read line"], lambda _: "go\n"
    )
    assert launch.returncode == 0, err
    assert "warning" not in err, err
    after = run([*gpuwait_cmd, "--vram", "1G", "--after-ok", job_id, "--", "echo", "ran"])
    assert (after.returncode, after.stdout) == (0, "ran\n"), after.stderr
    mine = [r for r in recorded_runs() if r.get("job_id") == job_id]
    assert len(mine) == 1 and mine[0]["exit_status"] == 0, mine
    ends = [e for e in read_events(Path(dirs.user_state_dir())) if e.get("job") == job_id]
    assert [(e["kind"], e.get("outcome")) for e in ends][-1] == ("finish", "ok"), ends


def test_a_run_that_ends_while_its_usage_waits_for_the_ledger_lock_ends_at_once(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    """The command's processes change (each a new pid to publish) while another process keeps
    the ledger's lock: the sample that publishes them waited the whole lock_timeout (a minute),
    and a command that ended meanwhile had its prompt back only then. A sample now waits a
    moment and tries again at the next, and the run ends as it ended."""
    go = tmp_path / "go"

    def end(launch: subprocess.Popen[str]) -> str:
        # A sample with new pids asks for the lock.
        wait_for(lambda: sleeping_in(launch.pid, "flock"), timeout=30)
        go.touch()
        return ""

    command = ["sh", "-c", f"until [ -e {go} ]; do sleep 0.01; done"]
    launch, _, err = ended_under_a_held_lock(gpuwait_cmd, command, end)
    assert launch.returncode == 0, err


def test_a_run_that_ended_under_a_held_lock_counts_as_it_ended_past_a_refused_launch(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    """A run ended while another process kept the ledger's lock, its gpuwait leaving word of
    how it ended. The next gpuwait was refused (--after naming no job): its transaction used
    the word up and wrote nothing, and the one after called the run lost (a job waiting on it
    with --after-ok never ran, the history held the run twice)."""
    launch, job_id, err = ended_under_a_held_lock(
        gpuwait_cmd, ["sh", "-c", "read line"], lambda _: "go\n"
    )
    assert launch.returncode == 0, err
    refused = run([*gpuwait_cmd, "--vram", "1G", "--after", "nosuchjob", "--", "true"])
    assert refused.returncode == 2, refused.stderr
    after = run([*gpuwait_cmd, "--vram", "1G", "--after-ok", job_id, "--", "echo", "ran"])
    assert (after.returncode, after.stdout) == (0, "ran\n"), after.stderr
    mine = [r for r in recorded_runs() if r.get("job_id") == job_id]
    assert len(mine) == 1 and mine[0]["exit_status"] == 0, mine


@pytest.mark.parametrize("how", ["timeout", "signal"])
def test_a_wait_given_up_while_another_process_keeps_the_ledger_lock_is_logged_as_it_ended(
    sim: Path, gpuwait_cmd: list[str], how: str
) -> None:
    """A launch gave up waiting (its --timeout, or a TERM) while another process kept the
    ledger's lock: it could not take its entry out, and the next gpuwait reaped it as lost (a
    `reap` in `gpuwait log`). It now leaves word of how it ended, as a run that ended does."""
    first = subprocess.Popen(
        [*gpuwait_cmd, "--vram", "1G", "--", "sh", "-c", "read line"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    fd = -1
    waiter: subprocess.Popen[str] | None = None
    try:
        wait_for(lambda: [j for j in ledger_entries() if j.get("child_pid")], timeout=30)
        (first_id,) = [j["id"] for j in ledger_entries()]
        timeout = ["--timeout", "1.5s"] if how == "timeout" else []
        waiter = subprocess.Popen(
            [*gpuwait_cmd, "--vram", "1G", "--after", first_id, *timeout, "--", "true"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        if how == "signal":
            wait_for(lambda: asleep_waiting(waiter.pid), timeout=30)
        else:
            # Its --timeout counts from its entry's submission: the lock is kept well before.
            wait_for(lambda: len(ledger_entries()) == 2, timeout=30)
        waiter_id = next(j["id"] for j in ledger_entries() if j["id"] != first_id)
        fd = os.open(Path(dirs.user_state_dir()) / "ledger.lock", os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)  # another process's long transaction
        if how == "signal":
            waiter.send_signal(signal.SIGTERM)
        _, err = waiter.communicate(timeout=20)
        assert waiter.returncode == (124 if how == "timeout" else -signal.SIGTERM), err
        os.close(fd)
        fd = -1
        first.communicate("go\n", timeout=30)
        assert first.returncode == 0
    finally:
        if fd >= 0:
            os.close(fd)
        for launch in (first, waiter):
            if launch is not None:
                launch.kill()
                launch.communicate()
    ends = [e for e in read_events(Path(dirs.user_state_dir())) if e.get("job") == waiter_id]
    outcome = TIMED_OUT if how == "timeout" else INTERRUPTED
    assert [(e["kind"], e.get("outcome")) for e in ends][-1] == ("leave", outcome), ends


def test_a_run_whose_word_of_its_end_is_damaged_shows_once_in_the_history(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    """A run ended while another process kept the ledger's lock, and its word of how it ended
    was damaged (or of another gpuwait's schema): the next gpuwait reaped the entry as lost
    and added a `lost` record of the run beside the one its gpuwait had written, so `gpuwait
    history` showed the run twice."""
    launch, job_id, err = ended_under_a_held_lock(
        gpuwait_cmd, ["sh", "-c", "read line"], lambda _: "go\n"
    )
    assert launch.returncode == 0, err
    word = Path(dirs.user_state_dir()) / "ended" / f"{job_id}.json"
    word.write_text('{"schema": 99}')
    assert run([*gpuwait_cmd, "--vram", "1G", "--", "true"]).returncode == 0
    mine = [r for r in recorded_runs() if r.get("job_id") == job_id]
    assert len(mine) == 1 and mine[0]["exit_status"] == 0, mine
    shown = run([*gpuwait_cmd, "history"]).stdout
    assert "lost" not in shown, shown


def test_a_word_of_a_runs_end_that_is_no_plain_file_hangs_no_gpuwait(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    """The word a run left of how it ended was replaced by a FIFO: the next gpuwait (every
    command that reaps the entry: `status`, a launch) hung for ever opening it. Now it is
    passed over as a damaged word is: the entry is reaped, the run shown once."""
    launch, job_id, err = ended_under_a_held_lock(
        gpuwait_cmd, ["sh", "-c", "read line"], lambda _: "go\n"
    )
    assert launch.returncode == 0, err
    word = Path(dirs.user_state_dir()) / "ended" / f"{job_id}.json"
    word.unlink()
    os.mkfifo(word)
    try:
        status = subprocess.run(
            [*gpuwait_cmd, "status"], capture_output=True, text=True, timeout=10
        )
    except subprocess.TimeoutExpired:
        pytest.fail("gpuwait status hung on the FIFO in the place of a word")
    assert status.returncode == 0, status.stderr
    assert ledger_entries() == []
    assert len([r for r in recorded_runs() if r.get("job_id") == job_id]) == 1


def test_a_job_started_inside_a_pausable_job_is_not_told_it_is_pausable(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    """A pipeline's step that calls gpuwait again, inside a --pausable job, inherited the outer
    job's GPUWAIT_PAUSABLE and checkpoint variables: its checkpoint.install() listened for a
    signal meant for the outer job, as if it could be asked to checkpoint."""
    nested = env_of(gpuwait_cmd, "--pausable", "--vram", "1G", "--", *gpuwait_cmd, "--vram", "1G")
    pausing = {"GPUWAIT_PAUSABLE", "GPUWAIT_CHECKPOINT_SIGNAL", "GPUWAIT_RESUME_COUNT"}
    assert not pausing & nested.keys(), nested
    inner = env_of(
        gpuwait_cmd,
        "--pausable",
        "--vram",
        "1G",
        "--",
        *gpuwait_cmd,
        "--pausable",
        "--checkpoint-signal",
        "USR2",
        "--vram",
        "1G",
    )
    assert (inner["GPUWAIT_PAUSABLE"], inner["GPUWAIT_CHECKPOINT_SIGNAL"]) == ("1", "USR2")


@pytest.mark.parametrize(
    ("given", "name"),
    [
        ("12", "USR2"),
        ("sigusr2", "USR2"),
        (" USR2", "USR2"),
        # A real-time one was its number ("36"), by the names `trap` and `kill -s` take.
        ("RTMIN+2", "RTMIN+2"),
        (str(signal.SIGRTMIN + 2), "RTMIN+2"),
        ("SIGRTMAX-3", "RTMAX-3"),
    ],
)
def test_the_checkpoint_signal_reaches_the_command_by_its_name(
    sim: Path, gpuwait_cmd: list[str], given: str, name: str
) -> None:
    """GPUWAIT_CHECKPOINT_SIGNAL is the signal's name, as the pausing page says: given as a
    number it was the number ("12"), and given with a space it was passed on with it, which a
    shell job's `trap ... "$GPUWAIT_CHECKPOINT_SIGNAL"` refuses (invalid signal specification),
    so that job never stepped aside."""
    env = env_of(gpuwait_cmd, "--pausable", "--checkpoint-signal", given, "--vram", "1G")
    assert env["GPUWAIT_CHECKPOINT_SIGNAL"] == name


def test_a_pausable_step_inside_a_job_keeps_the_users_resume_exit(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    """GPUWAIT_RESUME_EXIT is the `resume_exit` setting, set by a user whose program may end
    with 75 for a reason of its own: a --pausable step started inside a job that is not
    pausable (a pipeline's) lost it, and took a 75 for "checkpointed, resume me"."""
    env = {**os.environ, "GPUWAIT_RESUME_EXIT": "85"}
    inner = env_of(
        gpuwait_cmd, "--vram", "1G", "--", *gpuwait_cmd, "--pausable", "--vram", "1G", env=env
    )
    assert inner["GPUWAIT_RESUME_EXIT"] == "85", inner


def test_a_gpuwait_inside_a_job_in_a_container_that_cleans_its_environment_knows_its_job(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # `gpuwait --vram 12G -- apptainer exec --cleanenv img.sif sh -c 'gpuwait --vram 12G ...'`:
    # the container got the job's GPU but not its name, and the gpuwait inside (or a hooked
    # shell's) waited for that GPU as a new job, behind the job it runs in, for ever. Told of
    # its job as outside a container, it is refused at once (3), as there.
    env = with_program(tmp_path / "bin", "apptainer", CLEANENV_CONTAINER)
    # What the gpuwait inside needs to find the machine, passed in as a user would.
    for name, value in os.environ.items():
        if name.startswith(("GPUWAIT_", "XDG_")) or name in ("HOME", "PYTHONPATH"):
            env[f"APPTAINERENV_{name}"] = value
    inner = " ".join([*gpuwait_cmd, "--vram", "12G", "--timeout", "5s", "--", "echo", "inner"])
    container = ["apptainer", "exec", "--nv", "--cleanenv", "img.sif", "/bin/sh", "-c"]
    done = run([*gpuwait_cmd, "--vram", "12G", "--", *container, f"{inner}; echo rc=$?"], env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "rc=3\n", done.stderr
    assert "inside gpuwait job" in done.stderr and "Traceback" not in done.stderr
