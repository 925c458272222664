"""gpuwait.checkpoint, the job's side of cooperative pausing, as a program under gpuwait uses it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.fixtures_sim import SimFileFactory


@pytest.mark.parametrize("where", ["main", "thread"])
def test_exit_for_resume_ends_the_process_with_the_resume_status(where: str) -> None:
    # A training loop run in a thread of its own (a web app's worker, a service): its
    # exit_for_resume() must end the job, not that thread alone, or the job would run on
    # holding its memory and never be resumed.
    call = (
        "checkpoint.exit_for_resume()"
        if where == "main"
        else "t = threading.Thread(target=checkpoint.exit_for_resume); t.start(); t.join()"
    )
    script = f"import threading\nfrom gpuwait import checkpoint\n{call}\nprint('ran on')\n"
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "GPUWAIT_RESUME_EXIT": "80"},
    )
    assert (done.returncode, done.stdout) == (80, ""), done.stderr


def test_a_process_that_outlived_its_pausable_job_is_not_pausable(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # A --pausable job's variables stay with a process that outlives it (a server it started,
    # a tmux session opened in it). checkpoint.install() there listened for the checkpoint
    # signal and had the program checkpoint and exit with the resume status, once any USR1
    # came, where no gpuwait was left to resume it. Inside the job it listens, as before.
    sim_file(gpus=1)
    listens = "from gpuwait import checkpoint; print(checkpoint.install())"
    saved = tmp_path / "env.json"
    dump = f"import json, os; json.dump(dict(os.environ), open({str(saved)!r}, 'w')); {listens}"
    inside = subprocess.run(
        [*gpuwait_cmd, "-q", "--pausable", "--vram", "1G", "--", sys.executable, "-c", dump],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (inside.returncode, inside.stdout) == (0, "True\n"), inside.stderr
    left = json.loads(saved.read_text())
    assert left["GPUWAIT_PAUSABLE"] == "1"
    after = subprocess.run(
        [sys.executable, "-c", listens], capture_output=True, text=True, timeout=60, env=left
    )
    assert (after.returncode, after.stdout) == (0, "False\n"), after.stderr


@pytest.mark.parametrize("before", ["GPUWAIT_JOB_PID", "GPUWAIT_JOB_START"])
def test_a_job_an_older_gpuwait_runs_in_a_process_that_outlived_a_job_steps_aside(
    sim_file: SimFileFactory,
    gpuwait_cmd: list[str],
    monkeypatch: pytest.MonkeyPatch,
    before: str,
) -> None:
    # In a tmux session opened inside a job that has ended, a --pausable job is started by an
    # older gpuwait, from before it set `before` (a venv's own copy): the ended job's variable
    # is passed on beside those it sets. Its program, with this checkpoint module, took the
    # job for ended: install() answered False, and it never listened for the checkpoint
    # signal, so an urgent job could not ask it to step aside and waited for as long as it
    # ran (here until its own 30 s timeout, exit 124). It steps aside, and runs again resumed.
    sim_file(gpus=1)
    monkeypatch.setenv("GPUWAIT_PAUSE_MIN_RUNTIME", "300ms")
    gone = subprocess.Popen(["true"])
    gone.wait()
    given = [f"GPUWAIT_JOB_PID={gone.pid}", "GPUWAIT_JOB_START=1"]
    if before == "GPUWAIT_JOB_START":
        given = given[1:]  # that gpuwait names itself as the job's process
    program = (
        "import sys, time\n"
        "from gpuwait import checkpoint\n"
        "if checkpoint.resume_count():\n"
        "    sys.exit(print('resumed'))\n"
        "print(checkpoint.install(), flush=True)\n"
        "for _ in range(1200):\n"
        "    if checkpoint.requested():\n"
        "        checkpoint.exit_for_resume()\n"
        "    time.sleep(0.05)\n"
    )
    python = [sys.executable, "-c", program]
    urgent_job = ["--vram", "16G", "--", "echo", "urgent"]
    victim = subprocess.Popen(
        [*gpuwait_cmd, "-q", "--pausable", "--vram", "16G", "--", "env", *given, *python],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert victim.stdout is not None
        first = victim.stdout.readline()
        urgent = subprocess.run(
            [*gpuwait_cmd, "-q", "--priority", "5", "--timeout", "30s", *urgent_job],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert (urgent.returncode, urgent.stdout) == (0, "urgent\n"), urgent.stderr
        out, err = victim.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(victim.pid, signal.SIGKILL)  # its command too, where the check failed
        victim.communicate()
    assert (victim.returncode, first + out) == (0, "True\nresumed\n"), err


@pytest.mark.parametrize(
    ("start", "pausable"),
    [
        ("its own", True),  # the job's gpuwait, still running
        ("another", False),  # that pid is now another process's: the job has ended
        (None, True),  # a gpuwait that named no start: its job is taken for running
    ],
)
def test_a_process_is_pausable_while_the_gpuwait_its_variables_name_runs(
    procs: Callable[..., subprocess.Popen[str]], start: str | None, pausable: bool
) -> None:
    # A program whose variables name its job's gpuwait by pid and start time, and no job id
    # (its gpuwait from before GPUWAIT_JOB_ID): pausable as long as that very process runs.
    job = procs(["sleep", "60"])
    fields = Path(f"/proc/{job.pid}/stat").read_bytes().rpartition(b")")[2].split()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWAIT_")}
    env |= {"GPUWAIT_PAUSABLE": "1", "GPUWAIT_JOB_PID": str(job.pid)}
    if start is not None:
        env["GPUWAIT_JOB_START"] = fields[19].decode() if start == "its own" else "1"
    asked = "from gpuwait import checkpoint; print(checkpoint.is_pausable())"
    done = subprocess.run(
        [sys.executable, "-c", asked], capture_output=True, text=True, timeout=60, env=env
    )
    assert (done.returncode, done.stdout) == (0, f"{pausable}\n"), done.stderr


def test_importing_checkpoint_outside_a_pausable_job_loads_no_process_walk() -> None:
    # Every training program imports gpuwait.checkpoint, most of them never under
    # gpuwait --pausable: the walk up the processes (gpuwait.linux.outlived and .proc) is
    # loaded only where a job's variables ask for it.
    script = (
        "import sys; from gpuwait import checkpoint; "
        "print(sorted(m for m in sys.modules if m.startswith('gpuwait'))); "
        "print(checkpoint.is_pausable()); "
        "print('gpuwait.linux.outlived' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWAIT_")}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True
    )
    loaded, pausable, walked = done.stdout.splitlines()
    assert eval(loaded) == [
        "gpuwait",
        "gpuwait.checkpoint",
        "gpuwait.core",
        "gpuwait.core.pausing",
        "gpuwait.core.record",
    ]
    assert (pausable, walked) == ("False", "False")
    # Under a job's variables, the walk is loaded and asked.
    env.update(GPUWAIT_PAUSABLE="1", GPUWAIT_JOB_ID="7", GPUWAIT_JOB_PID=str(os.getpid()))
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True
    )
    assert done.stdout.splitlines()[1:] == ["True", "True"]


@pytest.mark.parametrize("given", ["999", "-1", "0", "126", "٣", "8_0"])
def test_a_resume_status_that_is_no_exit_status_is_the_default(
    given: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An exit status is 0-255, and the setting's is 1 to 125 (docs/configuration.md): a job
    # that exited with 999 would exit with 231, one gpuwait never takes for "resume me".
    from gpuwait import checkpoint

    monkeypatch.setenv("GPUWAIT_RESUME_EXIT", given)
    assert checkpoint.resume_exit_status() == checkpoint.DEFAULT_RESUME_EXIT
    monkeypatch.setenv("GPUWAIT_RESUME_EXIT", "80")
    assert checkpoint.resume_exit_status() == 80
