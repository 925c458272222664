"""Whether a process outlived the job its variables name, asked the same of the three that ask
it: gpuwait.checkpoint inside a training program (is it pausable?), the shell hook (does a
command of this shell run bare inside the job, or wrap as a job of its own?) and
contrib/docker/gpuwait-docker-run in sh (does it start the container?)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKER_RUN = REPO / "contrib" / "docker" / "gpuwait-docker-run"

#: A process above the one asked, running what it is given and waiting for it: the name of its
#: script tells whether its command line looks like a gpuwait's.
ABOVE = '#!/bin/sh\n"$@"\nexit $?\n'

JOB = "0a1b2c3d"


def _gone_pid() -> int:
    gone = subprocess.Popen(["true"])
    gone.wait()
    return gone.pid


def _ended_job() -> dict[str, str]:
    """Variables naming a job whose gpuwait is gone."""
    return {"GPUWAIT_JOB_PID": str(_gone_pid()), "GPUWAIT_JOB_START": "1"}


def _start_of(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()[19].decode()


def _answers(
    tmp_path: Path,
    above: list[str],
    given: dict[str, str],
    as_user: Sequence[str] = (),
    python: str = sys.executable,
) -> tuple[bool, bool, bool]:
    """Whether the job runs, as each of the three tells it, run under the processes `above`
    (`as_user` starting it as another user) with the job's variables `given`: (pausable, the
    hook runs bare, the container starts)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWAIT_")}
    # No configuration: a folder with no gpuwait/ in it, and one that any user may read.
    config = str(Path(__file__).parent)
    env |= {"XDG_CONFIG_HOME": config, "XDG_CONFIG_DIRS": config, "PYTHONPATH": str(REPO)}
    env["DOCKER"] = "true"
    given = {"GPUWAIT_JOB_ID": JOB, "GPUWAIT_PAUSABLE": "1", "GPUWAIT_GPU_UUIDS": "GPU-x", **given}
    variables = ["env", *(f"{k}={v}" for k, v in given.items())]
    asked = "from gpuwait import checkpoint; print(checkpoint.is_pausable())"
    probes = [
        [python, "-c", asked],
        [python, "-m", "gpuwait", "shell-hook", "--explain", "--", "python", "-c", ""],
        ["sh", str(DOCKER_RUN), "img"],
    ]
    done = [
        subprocess.run(
            [*above, *as_user, *variables, *probe],
            env=env,
            cwd="/",
            capture_output=True,
            text=True,
            timeout=60,
        )
        for probe in probes
    ]
    for run in done:
        assert "Traceback" not in run.stderr, run.stderr
    pausable, hook, docker = done
    assert pausable.returncode == 0 and pausable.stdout in ("True\n", "False\n"), pausable
    assert hook.returncode in (0, 1), hook
    assert hook.stdout.startswith("bare: " if hook.returncode else "wrap: "), hook
    assert docker.returncode in (0, 2), docker
    return pausable.stdout == "True\n", hook.returncode == 1, docker.returncode == 0


def _above(tmp_path: Path, *names: str) -> list[str]:
    """The command that runs a process under scripts of these names, outermost first; a name
    ending in "+job" is started in the job (GPUWAIT_JOB_ID in its own environment)."""
    argv: list[str] = []
    for name in names:
        script = tmp_path / name.removesuffix("+job")
        script.write_text(ABOVE)
        if name.endswith("+job"):
            argv += ["env", f"GPUWAIT_JOB_ID={JOB}"]
        argv += ["sh", str(script)]
        if "gpuwait" not in name:
            argv += ["env", "-u", "NONE"]  # no gpuwait in its first four words
    return argv


@pytest.mark.parametrize(
    ("case", "runs"),
    [
        ("its gpuwait runs", True),
        ("its gpuwait's pid is another process's", False),
        ("its gpuwait is gone, no start named", False),
        ("its gpuwait runs, no start named", True),
        ("no gpuwait named", True),
        ("its gpuwait is gone, a gpuwait of its own above", True),
        ("its gpuwait is gone, a gpuwait of its own above one started in it", True),
        ("its gpuwait is gone, a gpuwait started in it above", False),
        ("its gpuwait's pid longer than any", False),
        ("its gpuwait's pid longer than any, no start named", False),
    ],
)
def test_the_hook_the_checkpoint_and_docker_run_tell_an_ended_job_alike(
    tmp_path: Path, case: str, runs: bool
) -> None:
    me, ended = str(os.getpid()), _ended_job()
    given, above = {
        "its gpuwait runs": (
            {"GPUWAIT_JOB_PID": me, "GPUWAIT_JOB_START": _start_of(os.getpid())},
            ["shell"],
        ),
        "its gpuwait's pid is another process's": (
            {"GPUWAIT_JOB_PID": me, "GPUWAIT_JOB_START": "1"},
            ["shell"],
        ),
        "its gpuwait is gone, no start named": (
            {"GPUWAIT_JOB_PID": ended["GPUWAIT_JOB_PID"]},
            ["shell"],
        ),
        "its gpuwait runs, no start named": ({"GPUWAIT_JOB_PID": me}, ["shell"]),
        # Set by hand: more digits than Python turns into a number, which said so in a
        # traceback, the shell hook's and the training program's importing gpuwait.checkpoint.
        "its gpuwait's pid longer than any": (
            {"GPUWAIT_JOB_PID": "1" * 5000, "GPUWAIT_JOB_START": "1"},
            ["shell"],
        ),
        "its gpuwait's pid longer than any, no start named": (
            {"GPUWAIT_JOB_PID": "1" * 5000},
            ["shell"],
        ),
        "no gpuwait named": ({}, ["shell"]),
        "its gpuwait is gone, a gpuwait of its own above": (
            ended,
            ["gpuwait-old"],
        ),
        "its gpuwait is gone, a gpuwait of its own above one started in it": (
            ended,
            ["gpuwait-old", "shell+job"],
        ),
        "its gpuwait is gone, a gpuwait started in it above": (
            ended,
            ["shell", "gpuwait-inner+job"],
        ),
    }[case]
    assert _answers(tmp_path, _above(tmp_path, *above), given) == (runs, runs, runs)


def test_a_gpuwait_that_is_a_containers_first_process_is_its_jobs(tmp_path: Path) -> None:
    # `docker run IMAGE gpuwait ... -- python train.py`: the gpuwait above the program is the
    # container's pid 1. gpuwait.checkpoint and gpuwait-docker-run stopped short of it and took
    # a job whose variables an older gpuwait passed on for ended, the program for no longer
    # pausable; the shell hook looked at it, and ran a command inside it bare.
    isolated = ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc"]
    if subprocess.run([*isolated, "true"], capture_output=True).returncode != 0:
        pytest.skip("no user and pid namespaces here")
    above = [*isolated, *_above(tmp_path, "gpuwait-old")]
    assert _answers(tmp_path, above, _ended_job()) == (True, True, True)


def test_a_gpuwait_of_another_user_above_is_told_by_its_command_line(tmp_path: Path) -> None:
    # A gpuwait whose environment this process may not read (root's, running the program as
    # another user): the shell hook and gpuwait-docker-run told it by its command line, and
    # the job ran; gpuwait.checkpoint took it for none and the program for no longer pausable.
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all"]
    if os.getuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root, to run the program as another user")
    # A Python that user may run (this one may be under root's home), gpuwait taken from here.
    imports = "import gpuwait.checkpoint, gpuwait.commands.shell_hook"
    runnable = [
        python
        for python in (sys.executable, shutil.which("python3", path=os.defpath))
        if python is not None
        and subprocess.run(
            [*nobody, "env", f"PYTHONPATH={REPO}", python, "-c", imports],
            cwd="/",
            capture_output=True,
        ).returncode
        == 0
    ]
    if not runnable:
        pytest.skip("no Python and checkout here that another user may run")
    above = _above(tmp_path, "gpuwait-old")
    assert _answers(tmp_path, above, _ended_job(), nobody, runnable[0]) == (True, True, True)


#: Runs its arguments with GPUWAIT_JOB_ID twice in their environment: another job's first,
#: then the one asked about (execve takes any list; `env` and shells keep one of each name).
TWICE = (
    "import ctypes, os, sys\n"
    "env = [f'{k}={v}'.encode() for k, v in os.environ.items() if k != 'GPUWAIT_JOB_ID']\n"
    "env += [b'GPUWAIT_JOB_ID=' + sys.argv[1].encode(), b'GPUWAIT_JOB_ID=' + sys.argv[2].encode()]\n"
    "args = [a.encode() for a in sys.argv[3:]]\n"
    "argv = (ctypes.c_char_p * (len(args) + 1))(*args, None)\n"
    "envp = (ctypes.c_char_p * (len(env) + 1))(*env, None)\n"
    "ctypes.CDLL(None, use_errno=True).execvpe(args[0], argv, envp)\n"
)


@pytest.mark.parametrize(("first", "runs"), [(JOB, True), ("0f0f0f0f", False)])
def test_a_process_with_the_job_named_twice_is_read_as_getenv_reads_it(
    tmp_path: Path, first: str, runs: bool
) -> None:
    # A process above whose environment names GPUWAIT_JOB_ID twice, with different values:
    # getenv, and gpuwait.checkpoint and the shell hook, read the first; gpuwait-docker-run
    # took it as started in the job where any of the two named it, walked on past it to the
    # gpuwait above, and started the container where the others took the job for ended.
    second = "0f0f0f0f" if first == JOB else JOB
    shell = tmp_path / "shell"
    shell.write_text(ABOVE)
    above = [
        *_above(tmp_path, "gpuwait-old"),
        *[sys.executable, "-c", TWICE, first, second],
        *["sh", str(shell), "env", "-u", "NONE"],
    ]
    assert _answers(tmp_path, above, _ended_job()) == (runs, runs, runs)
