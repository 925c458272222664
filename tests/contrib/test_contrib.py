"""contrib/: each integration run the way its README says, against simulated GPUs."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO
from helpers import docs
from helpers.fixtures_sim import hold_card
from helpers.ports import free_ports
from helpers.processes import can_unshare, children
from helpers.shellbin import env_with_bin, make_bin
from helpers.users import clean_up, shared_root
from helpers.waiting import asleep_waiting, catches_signal, ledger_entries, wait_for

CONTRIB = REPO / "contrib"
GiB = 2**30


@pytest.fixture
def user_env(tmp_path: Path, sim_file: Any) -> dict[str, str]:
    """Two simulated 24 GiB GPUs, and gpuwait on PATH as an installed one would be."""
    sim_file(gpus=2, memory="24GiB")
    return env_with_bin(make_bin(tmp_path / "bin"))


def sim_uuids() -> list[str]:
    from gpuwait.gpu.sim import SimBackend

    return [g.uuid for g in SimBackend(os.environ["GPUWAIT_SIM"]).snapshot().gpus]


def history(state_home: Path) -> list[dict[str, Any]]:
    path = state_home / "gpuwait" / "history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def holder(
    env: dict[str, str], vram: str, device: str, seconds: str = "30s"
) -> subprocess.Popen[str]:
    """A gpuwait job holding `vram` of one simulated GPU until killed."""
    return hold_card(
        ["gpuwait"], vram, seconds, "--devices", device, "-q", env=env, output=subprocess.DEVNULL
    )


def wait_running(count: int) -> None:
    ledger = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "ledger.json"

    def running() -> bool:
        if not ledger.exists():
            return False
        jobs = json.loads(ledger.read_text())["jobs"]
        return sum(j["state"] == "running" for j in jobs) >= count

    wait_for(running, timeout=30)


def flock_held(path: Path) -> bool:
    """Someone holds an flock(2) lock on `path` (tried without waiting, and let go at once)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing it lets go of the lock, if it was taken here
    return False


def stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# make -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_make_j8_runs_eight_8g_steps_on_two_24g_gpus_without_oom(
    user_env: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    train = f"gpuwait sim job --vram 8G --hold 0.5s --report {out}/$*.json"
    done = subprocess.run(
        ["make", "-j8", "-f", str(CONTRIB / "make" / "Makefile"), f"OUT={out}", f"TRAIN={train}"],
        env=user_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "out of memory" not in done.stderr
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("s*.json"))]
    assert len(reports) == 8 and len(list(out.glob("*.done"))) == 8
    assert all(r["oom"] is False and r["peak_bytes"] == 8 * GiB for r in reports)
    assert {r["gpu_uuid"] for r in reports} <= set(sim_uuids())
    records = history(Path(user_env["XDG_STATE_HOME"]))
    assert len(records) == 8
    # Two 8 GiB steps per 24 GiB card under the 0.9 safety factor; three would still fit the
    # simulated card without an OOM, so count how many ran side by side on each card.
    for uuid in sim_uuids():
        assert max_overlap([r for r in records if r["gpus"][0]["uuid"] == uuid]) <= 2


def max_overlap(records: list[dict[str, Any]], slack: float = 0.02) -> int:
    """Most runs going at one moment (their ends trimmed by `slack` for clock noise)."""
    events = []
    for r in records:
        events += [(r["started_at"], 1), (r["started_at"] + r["run_seconds"] - slack, -1)]
    most = going = 0
    for _, step in sorted(events, key=lambda e: (e[0], e[1])):
        going += step
        most = max(most, going)
    return most


def test_make_failing_step_fails_make_as_it_would_bare(
    user_env: dict[str, str], tmp_path: Path
) -> None:
    def make(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                "make",
                "-f",
                str(CONTRIB / "make" / "Makefile"),
                f"OUT={tmp_path}/out",
                "STEPS=s1",
                "TRAIN=gpuwait sim job --vram 1G --hold 0s --exit 3",
                *extra,
            ],
            env=user_env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )

    wrapped, bare = make(), make("GPU=")
    assert wrapped.returncode == bare.returncode == 2
    assert "Error 3" in wrapped.stderr and "Error 3" in bare.stderr
    assert not (tmp_path / "out" / "s1.done").exists()


def test_make_readme_commands_run(tmp_path: Path) -> None:
    docs.assert_page_runs(CONTRIB / "make" / "README.md", tmp_path)


@pytest.mark.parametrize("keep_going", [False, True], ids=["stop", "keep-going"])
def test_make_failure_stops_only_steps_make_had_not_started(
    user_env: dict[str, str], tmp_path: Path, keep_going: bool
) -> None:
    """As the make README says: with -j8, the steps already handed to gpuwait (running or
    waiting for a GPU) still run after a failure; the ninth, never started, does not (-k: it
    does)."""
    out = tmp_path / "out"
    steps = [f"s{i}" for i in range(1, 10)]
    small_s1 = "$(if $(filter $*,s1),1G,8G)"
    done = subprocess.run(
        [
            "make",
            "-j8",
            *(["-k"] if keep_going else []),
            "-f",
            str(CONTRIB / "make" / "Makefile"),
            f"OUT={out}",
            f"STEPS={' '.join(steps)}",
            "FAIL=s1",
            # s1 is small, so it starts at once whatever the order the steps reach gpuwait in,
            # and fails while three of the others still wait for a GPU.
            f"GPU=gpuwait --vram {small_s1} --",
            f"TRAIN=gpuwait sim job --vram {small_s1} --hold $(if $(filter $*,s1),0s,2s) "
            "$(if $(filter $*,$(FAIL)),--exit 3)",
        ],
        env=user_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and "Error 3" in done.stderr, done.stderr
    finished = sorted(p.stem for p in out.glob("*.done"))
    assert finished == (steps[1:] if keep_going else steps[1:8])
    records = history(Path(user_env["XDG_STATE_HOME"]))
    assert len(records) == (9 if keep_going else 8)
    # Of the seven 8 GiB steps make had started, four ran at once and three waited for a GPU:
    # those started after s1 had failed.
    failed = next(r for r in records if r["exit_status"] == 3)
    failed_at = failed["started_at"] + failed["run_seconds"]
    assert sum(r["started_at"] > failed_at for r in records if r is not failed) >= 3
    assert "Waiting for unfinished jobs" in done.stderr or keep_going


# checkpoint -----------------------------------------------------------------------------------


def test_checkpoint_readme_pauses_and_resumes_in_its_own_directory(tmp_path: Path) -> None:
    """The README's tries, run as written: the PyTorch loop is paused and resumes at the same
    step, the shell job too, and nothing is left in the clone (all of it in mktemp's directory)."""
    probe = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("PyTorch is not installed (pip install torch to run this example)")
    before = set(os.listdir(CONTRIB / "checkpoint"))
    started = time.monotonic()
    out = docs.assert_page_runs(CONTRIB / "checkpoint" / "README.md", tmp_path)
    assert time.monotonic() - started < 120, "the README's try should take well under a minute"
    paused = re.search(r"^run 0 paused at step ([0-9]+)$", out, re.M)
    assert paused, out
    assert f"run 1 starts at step {paused.group(1)}" in out
    assert "run 1 finished at step 500" in out
    assert re.search(r"chunk 49 done \(run 1\)", out), out
    assert set(os.listdir(CONTRIB / "checkpoint")) == before
    clone = tmp_path / "clone"
    assert sorted(p.name for p in clone.iterdir() if not p.is_symlink()) == sorted(docs.STANDINS)


# cron -----------------------------------------------------------------------------------------

CRON_PROBE = (
    "import json, os, sys; print(json.dumps({'cuda': os.environ.get('CUDA_VISIBLE_DEVICES'), "
    "'home': os.environ.get('HOME'), 'tty': sys.stdin.isatty(), 'stdin': os.path.realpath("
    "'/proc/self/fd/0'), 'timeout': os.environ.get('GPUWAIT_TIMEOUT'), "
    "'umask': os.umask(0)}))"
)


@pytest.fixture
def cron_home(tmp_path: Path) -> Path:
    """A home directory as after the README's install: gpuwait and gpuwait-cron in ~/.local/bin."""
    home = tmp_path / "cronhome"
    make_bin(home / ".local" / "bin")
    shutil.copy(CONTRIB / "cron" / "gpuwait-cron", home / ".local" / "bin" / "gpuwait-cron")
    (home / "probe.py").write_text(CRON_PROBE)
    return home


def cron_argv(line: str, env: dict[str, str]) -> list[str]:
    """A crontab command line as cron runs it: in a bare environment (`env -i`)."""
    return ["env", "-i", *[f"{k}={v}" for k, v in env.items()], "/bin/sh", "-c", line]


def cron_run(
    line: str, env: dict[str, str], machine: list[str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a crontab command line in cron's bare environment, with no terminal; `machine`: what
    to start it with (another machine's namespaces)."""
    return subprocess.run(
        [*(machine or []), *cron_argv(line, env)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,  # no controlling terminal
    )


def cron_env(home: Path) -> dict[str, str]:
    # What cron sets, plus a variable from a crontab line.
    return {
        "HOME": str(home),
        "LOGNAME": "user",
        "SHELL": "/bin/sh",
        "PATH": "/usr/bin:/bin",
        "GPUWAIT_SIM": os.environ["GPUWAIT_SIM"],
    }


def test_cron_wrapper_under_env_i(cron_home: Path, sim_file: Any) -> None:
    sim_file(gpus=2)
    line = (
        "umask 022; cd $HOME && $HOME/.local/bin/gpuwait-cron nightly --vram 4G -- python3 probe.py"
    )
    done = cron_run(line, cron_env(cron_home))
    assert done.returncode == 0, done.stderr
    assert done.stdout == done.stderr == ""  # success is silent: cron mails nothing
    log_dir = cron_home / ".local" / "state" / "gpuwait" / "cron"
    # The log holds command lines and output: private; the job keeps cron's umask.
    assert stat.S_IMODE(log_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((log_dir / "nightly.log").stat().st_mode) == 0o600
    log = (log_dir / "nightly.log").read_text()
    assert re.search(r"nightly: start: gpuwait --vram 4G -- python3 probe.py\n", log)
    assert re.search(r"nightly: end: exit status 0\n", log)
    (probe,) = [json.loads(x) for x in log.splitlines() if x.startswith("{")]
    assert probe["cuda"] in sim_uuids()
    assert probe == {**probe, "home": str(cron_home), "tty": False, "stdin": "/dev/null"}
    assert probe["timeout"] == "23h"
    assert probe["umask"] == 0o022
    # The job went through gpuwait's own ledger and history under this HOME.
    assert len(history(cron_home / ".local" / "state")) == 1


def test_cron_log_names_a_command_with_backslashes_as_it_was_given(
    cron_home: Path, sim_file: Any
) -> None:
    # /bin/sh's echo (dash) reads backslashes: a Windows path or a regex in the command was
    # logged with its \n as a line break and its \t as a tab, and \c cut the line short.
    sim_file(gpus=1)
    line = (
        "cd $HOME && $HOME/.local/bin/gpuwait-cron nightly --vram 1G -- "
        "python3 -c pass 'C:\\new\\table' '\\d+\\c'"
    )
    done = cron_run(line, cron_env(cron_home))
    assert done.returncode == 0, done.stderr
    log = (cron_home / ".local" / "state" / "gpuwait" / "cron" / "nightly.log").read_text()
    assert (
        "nightly: start: gpuwait --vram 1G -- python3 -c pass 'C:\\new\\table' '\\d+\\c'\n" in log
    )


def test_cron_log_names_a_command_so_that_it_can_be_pasted_back(
    cron_home: Path, sim_file: Any
) -> None:
    # Logged as the words joined by spaces, `sh -c 'echo HOME=$HOME'` read as
    # `sh -c echo HOME=$HOME`: pasted back, it ran another command.
    sim_file(gpus=1)
    words = ["sh", "-c", 'echo HOME=$HOME; echo "it\'s"', "", "a  b", "x\ny"]
    line = "cd $HOME && $HOME/.local/bin/gpuwait-cron nightly --vram 1G -- " + shlex.join(words)
    done = cron_run(line, cron_env(cron_home))
    assert done.returncode == 0, done.stderr
    log = (cron_home / ".local" / "state" / "gpuwait" / "cron" / "nightly.log").read_text()
    start = re.search(r"nightly: start: (gpuwait .*?)\nHOME=/", log, re.DOTALL)
    assert start, log
    assert start[1].startswith("gpuwait --vram 1G -- sh -c '")
    assert shlex.split(start[1]) == ["gpuwait", "--vram", "1G", "--", *words]


def test_cron_wrapper_without_home_and_with_gpuwait_named(
    cron_home: Path, sim_file: Any, tmp_path: Path
) -> None:
    sim_file(gpus=2)
    env = {
        "PATH": "/usr/bin:/bin",
        "GPUWAIT": str(cron_home / ".local" / "bin" / "gpuwait"),
        "GPUWAIT_SIM": os.environ["GPUWAIT_SIM"],
        "XDG_STATE_HOME": str(tmp_path / "state"),
    }
    line = f"{cron_home}/.local/bin/gpuwait-cron job1 --vram 1G -- /usr/bin/env python3 {cron_home}/probe.py"
    done = cron_run(line, env)
    assert done.returncode == 0, done.stderr
    log = (tmp_path / "state" / "gpuwait" / "cron" / "job1.log").read_text()
    (probe,) = [json.loads(x) for x in log.splitlines() if x.startswith("{")]
    assert probe["home"] == pwd.getpwuid(os.getuid()).pw_dir
    assert probe["cuda"] in sim_uuids()


def test_cron_wrapper_makes_no_home_that_does_not_exist(
    cron_home: Path, sim_file: Any, tmp_path: Path
) -> None:
    # A service user's HOME=/nonexistent (cron takes it from the password file): the log
    # directory under it would make that home, for gpuwait and the next program to take for a
    # real one. Refused with one line saying what to set; a log dir elsewhere runs the job.
    sim_file(gpus=2)
    missing = tmp_path / "nonexistent"
    env = {**cron_env(missing), "GPUWAIT": str(cron_home / ".local" / "bin" / "gpuwait")}
    line = f"{cron_home}/.local/bin/gpuwait-cron job1 --vram 1G -- true"
    done = cron_run(line, env)
    assert done.returncode == 73
    assert not os.path.lexists(missing)
    assert done.stderr.count("\n") == 1, done.stderr
    assert f"home directory {missing} does not exist" in done.stderr
    assert "GPUWAIT_CRON_LOG_DIR" in done.stderr and "GPUWAIT_STATE_DIR" in done.stderr
    logs, state = tmp_path / "logs", tmp_path / "state"
    elsewhere = {**env, "GPUWAIT_CRON_LOG_DIR": str(logs), "GPUWAIT_STATE_DIR": str(state)}
    done = cron_run(line, elsewhere)
    assert done.returncode == 0, done.stderr
    assert "end: exit status 0" in (logs / "job1.log").read_text()
    assert not os.path.lexists(missing)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to act as two users")
def test_cron_wrapper_writes_no_log_in_a_directory_another_user_can_write_in() -> None:
    # An rc file shared by a group sets XDG_STATE_HOME to a scratch directory every user may
    # write in. Bob made gpuwait/cron there first, writable by all, and put in it a link named
    # as Alice's nightly log that leads to a file of hers: her cron job appended its log to
    # that file. The run now stops at once (exit 73) with one line saying what to set, and
    # her file is as it was.
    alice, bob = 2001, 2002
    root = shared_root()
    try:
        scratch = root / "scratch"
        scratch.mkdir()
        os.chmod(scratch, 0o1777)
        home = root / "alice"
        home.mkdir()
        os.chown(home, alice, alice)
        notes = home / "notes.txt"
        notes.write_text("mine\n")
        os.chown(notes, alice, alice)
        logs = scratch / "gpuwait" / "cron"
        logs.mkdir(parents=True)
        for directory in (logs.parent, logs):
            os.chown(directory, bob, bob)
            os.chmod(directory, 0o777)
        (logs / "nightly.log").symlink_to(notes)
        os.lchown(logs / "nightly.log", bob, bob)
        script = root / "gpuwait-cron"
        shutil.copy(CONTRIB / "cron" / "gpuwait-cron", script)
        os.chmod(script, 0o755)
        env = {
            "HOME": str(home),
            "PATH": "/usr/bin:/bin",
            "XDG_STATE_HOME": str(scratch),
            "GPUWAIT": "/bin/true",
        }
        as_alice = ["setpriv", f"--reuid={alice}", f"--regid={alice}", "--clear-groups"]
        done = cron_run(f"cd / && {script} nightly --vram 1G -- true", env, machine=as_alice)
        assert notes.read_text() == "mine\n"
        assert done.returncode == 73, done.stderr
        assert done.stderr.count("\n") == 1, done.stderr
        assert str(logs) in done.stderr and "GPUWAIT_CRON_LOG_DIR" in done.stderr
    finally:
        clean_up(root, [])


def test_cron_wrapper_says_how_to_make_a_log_directory_of_ones_own_private(
    cron_home: Path, sim_file: Any, tmp_path: Path
) -> None:
    # GPUWAIT_CRON_LOG_DIR set to a directory of the user's own, made under umask 002 (0775):
    # the run stopped with 'set GPUWAIT_CRON_LOG_DIR to a directory of yours', which it was.
    # The line now says what makes it one: taking the others' write permission away.
    sim_file(gpus=1)
    logs = tmp_path / "logs"
    logs.mkdir()
    os.chmod(logs, 0o775)
    env = {**cron_env(cron_home), "GPUWAIT_CRON_LOG_DIR": str(logs)}
    line = "$HOME/.local/bin/gpuwait-cron nightly --vram 1G -- true"
    done = cron_run(line, env)
    assert done.returncode == 73, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert f"chmod go-w {logs}" in done.stderr
    assert not (logs / "nightly.log").exists()
    os.chmod(logs, 0o755)
    done = cron_run(line, env)
    assert done.returncode == 0, done.stderr
    assert "end: exit status 0" in (logs / "nightly.log").read_text()


def test_cron_wrapper_gives_up_after_timeout_and_says_so(
    cron_home: Path, sim_file: Any, tmp_path: Path
) -> None:
    sim_file(gpus=1)
    env = cron_env(cron_home)
    job = holder(
        {
            **env_with_bin(cron_home / ".local" / "bin"),
            "HOME": str(cron_home),
            "XDG_STATE_HOME": str(cron_home / ".local" / "state"),
        },
        "20G",
        "0",
    )
    try:
        ledger = cron_home / ".local" / "state" / "gpuwait" / "ledger.json"
        wait_for(lambda: ledger.exists() and '"running"' in ledger.read_text(), timeout=30)
        line = "$HOME/.local/bin/gpuwait-cron late --vram 10G --timeout 0.5s -- true"
        started = time.monotonic()
        done = cron_run(line, env)
        assert done.returncode == 124
        assert time.monotonic() - started < 60
        assert (
            len(done.stderr.splitlines()) == 1 and "late failed with exit status 124" in done.stderr
        )
        log = (cron_home / ".local" / "state" / "gpuwait" / "cron" / "late.log").read_text()
        assert "gave up after waiting" in log and "exit status 124" in log
        # A run of the same name while one is going is skipped, not stacked.
        (cron_home / ".local" / "state" / "gpuwait" / "cron").mkdir(parents=True, exist_ok=True)
        # The lock is this machine's (another's, sharing the home, has one of its own).
        lock = cron_home / f".local/state/gpuwait/cron/late@{os.uname().nodename}.lock"
        blocker = subprocess.Popen(["flock", str(lock), "sleep", "30"])
        try:
            # flock(1) creates the file before it takes the lock: wait for the lock itself.
            wait_for(lambda: flock_held(lock), timeout=30, message=f"{lock} was never locked")
            done = cron_run(line, env)
            assert done.returncode == 75 and "still going" in done.stderr
        finally:
            stop(blocker)  # type: ignore[arg-type]
    finally:
        stop(job)


def test_cron_mail_says_why_a_run_failed(cron_home: Path, sim_file: Any) -> None:
    # The one line cron mails said "(124: no GPU room in time)" whatever the status: a
    # misspelt size (gpuwait's exit 2) and a script that failed (1) read as runs that found no
    # GPU room. It now says gpuwait's own error where gpuwait gave one, and nothing of a wait
    # for any status but 124.
    sim_file(gpus=1)
    env = cron_env(cron_home)
    done = cron_run("cd $HOME && $HOME/.local/bin/gpuwait-cron typo --vram 8GG -- true", env)
    assert done.returncode == 2
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert "typo failed with exit status 2: --vram '8GG' is not a size" in done.stderr
    assert "GPU room" not in done.stderr
    line = "cd $HOME && $HOME/.local/bin/gpuwait-cron broken --vram 1G -- python3 -c 'exit(1)'"
    done = cron_run(line, env)
    assert done.returncode == 1
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert "broken failed with exit status 1; see " in done.stderr
    assert "GPU room" not in done.stderr
    # gpuwait's error as the log has it, backslashes and all, which /bin/sh's echo (dash)
    # would read as escapes.
    line = "cd $HOME && $HOME/.local/bin/gpuwait-cron slash --vram '6\\c\\nG' -- true"
    done = cron_run(line, env)
    assert done.returncode == 2
    log = (cron_home / ".local" / "state" / "gpuwait" / "cron" / "slash.log").read_text()
    (error,) = [x for x in log.splitlines() if x.startswith("gpuwait: error: ")]
    assert "\\" in error
    assert f"slash failed with exit status 2: {error.removeprefix('gpuwait: error: ')}; see " in (
        done.stderr
    )
    assert len(done.stderr.splitlines()) == 1, done.stderr


def test_cron_mail_says_a_run_ran_out_of_gpu_memory(cron_home: Path, sim_file: Any) -> None:
    """A nightly job that needs more than its --vram: the one line cron mails says it ran out
    of GPU memory and what the next run asks for, as gpuwait told the log, not only `exit
    status 1` (which a script that failed for any other reason ends with too)."""
    sim_file(gpus=1)
    line = (
        "cd $HOME && $HOME/.local/bin/gpuwait-cron big --vram 4G -- "
        "gpuwait sim job --vram 30G --hold 0.1s"
    )
    done = cron_run(line, cron_env(cron_home))
    assert done.returncode == 1
    assert len(done.stderr.splitlines()) == 1, done.stderr
    log = (cron_home / ".local" / "state" / "gpuwait" / "cron" / "big.log").read_text()
    (told,) = [x for x in log.splitlines() if x.startswith("gpuwait: warning: the command ran")]
    assert done.stderr.startswith(
        f"gpuwait-cron: big failed with exit status 1: {told.removeprefix('gpuwait: warning: ')}"
        "; see "
    ), done.stderr
    assert "the next run without --vram asks for" in done.stderr
    # Retried and then failed for another reason, the mail says no out-of-memory failure.
    line = (
        "cd $HOME && $HOME/.local/bin/gpuwait-cron again --vram 4G --retry-oom 1 -- "
        "sh -c 'test -e ran && exit 3; touch ran; gpuwait sim job --vram 30G --hold 0.1s'"
    )
    done = cron_run(line, cron_env(cron_home))
    assert done.returncode == 3
    assert done.stderr.startswith("gpuwait-cron: again failed with exit status 3; see "), (
        done.stderr
    )


def test_cron_wrapper_is_not_kept_locked_by_what_a_finished_run_left_running(
    cron_home: Path, sim_file: Any, tmp_path: Path
) -> None:
    # A job that leaves a helper behind (a server, a `nohup ... &`): the run has ended, so the
    # next night's run must go ahead, not be skipped for as long as the helper lives.
    sim_file(gpus=1)
    pid_file = tmp_path / "helper.pid"
    helper = f"sleep 30 </dev/null >/dev/null 2>&1 & echo $! > {pid_file}"
    line = f"$HOME/.local/bin/gpuwait-cron nightly --vram 1G -- sh -c '{helper}'"
    try:
        done = cron_run(line, cron_env(cron_home))
        assert done.returncode == 0, done.stderr
        done = cron_run(
            "$HOME/.local/bin/gpuwait-cron nightly --vram 1G -- true", cron_env(cron_home)
        )
        assert done.returncode == 0, done.stderr
    finally:
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


@pytest.mark.skipif(not can_unshare(), reason="needs root and unshare(1) for a host name")
def test_cron_runs_of_one_name_on_two_machines_sharing_the_home_do_not_skip_each_other(
    cron_home: Path, sim_file: Any, tmp_path: Path, procs: Any
) -> None:
    # The same crontab on two machines that share the home directory (and with it the cron
    # logs' directory): each machine's run is its own, on its own GPUs. Both start at 03:00;
    # machine B's must not be skipped as if machine A's were its own previous run.
    sim_file(gpus=1)
    env = cron_env(cron_home)
    go = tmp_path / "go"
    wait_go = f"while [ ! -e {go} ]; do sleep 0.05; done"
    a = procs(
        cron_argv(f"$HOME/.local/bin/gpuwait-cron nightly --vram 1G -- sh -c '{wait_go}'", env)
    )
    log = cron_home / ".local" / "state" / "gpuwait" / "cron" / "nightly.log"
    wait_for(lambda: log.exists() and "nightly: start:" in log.read_text(), timeout=30)
    other = ["unshare", "--uts", "/bin/sh", "-c", 'hostname gpu-b && exec "$@"', "-"]
    b = cron_run("$HOME/.local/bin/gpuwait-cron nightly --vram 1G -- true", env, machine=other)
    assert b.returncode == 0, b.stderr
    go.touch()
    assert a.wait(timeout=60) == 0
    # On one machine, a run still going makes the next one skip, as ever.
    go.unlink()
    a = procs(
        cron_argv(f"$HOME/.local/bin/gpuwait-cron nightly --vram 1G -- sh -c '{wait_go}'", env)
    )
    wait_for(lambda: log.read_text().count("nightly: start:") == 3, timeout=30)
    again = cron_run("$HOME/.local/bin/gpuwait-cron nightly --vram 1G -- true", env)
    assert again.returncode == 75 and "still going" in again.stderr
    go.touch()
    assert a.wait(timeout=60) == 0


def test_cron_wrapper_usage_errors(cron_home: Path) -> None:
    script = cron_home / ".local" / "bin" / "gpuwait-cron"
    for args, message in (([], "usage"), (["bad name", "true"], "NAME must be")):
        done = subprocess.run([str(script), *args], capture_output=True, text=True, timeout=30)
        assert done.returncode == 2 and message in done.stderr


# systemd --------------------------------------------------------------------------------------


def unit_values(path: Path, key: str) -> list[str]:
    return [
        line.split("=", 1)[1]
        for line in path.read_text().splitlines()
        if line.startswith(f"{key}=")
    ]


def test_systemd_units_verify_and_the_service_runs_its_job(tmp_path: Path, sim_file: Any) -> None:
    sim_file(gpus=2)
    home = tmp_path / "sdhome"
    bin_dir = make_bin(home / ".local" / "bin")
    report = tmp_path / "report.json"
    job = bin_dir / "nightly-job"
    job.write_text(
        f"#!/bin/sh\nexec {bin_dir}/gpuwait sim job --vram 2G --hold 0.2s --report {report}\n"
    )
    job.chmod(0o755)
    service = CONTRIB / "systemd" / "gpuwait-nightly.service"
    timer = CONTRIB / "systemd" / "gpuwait-nightly.timer"

    if shutil.which("systemd-analyze") is None:
        verified = "systemd-analyze is not installed"
    else:
        runtime = tmp_path / "runtime"
        runtime.mkdir(mode=0o700)
        done = subprocess.run(
            ["systemd-analyze", "verify", "--user", str(service), str(timer)],
            env={**os.environ, "HOME": str(home), "XDG_RUNTIME_DIR": str(runtime)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert done.stderr == "", done.stderr  # warnings (unknown keys, bad values) too
        verified = ""

    # What systemd would run: ExecStart with %h expanded, in a user manager's bare environment.
    (exec_start,) = unit_values(service, "ExecStart")
    argv = shlex.split(exec_start.replace("%h", str(home)))
    env = {"HOME": str(home), "PATH": "/usr/local/bin:/usr/bin:/bin"}
    env.update(v.split("=", 1) for v in unit_values(service, "Environment"))  # type: ignore[arg-type]
    env["GPUWAIT_SIM"] = os.environ["GPUWAIT_SIM"]
    done = subprocess.run(argv, env=env, cwd=home, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(report.read_text())
    assert result["gpu_uuid"] in sim_uuids() and result["oom"] is False
    if verified:
        pytest.skip(f"units not verified: {verified} (the service's command did run)")


#: A training run that saves its work when told to stop (SIGTERM), as a program that
#: checkpoints does: writes "ready" to FLAG, then "saved" once it has its first TERM.
SAVES_ON_TERM = """
import signal, sys, time
def save(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # saving: a second TERM changes nothing
    open(sys.argv[1], "w").write("saved")
    sys.exit(0)
signal.signal(signal.SIGTERM, save)
open(sys.argv[1], "w").write("ready")
time.sleep(60)
"""


def session_processes(sid: int) -> list[int]:
    """The live processes of session `sid`: here, the processes of one service."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:
            found.append(int(entry.name))
    return found


def stop_service(main: subprocess.Popen[Any], kill_mode: str) -> None:
    """`systemctl stop` of a service whose processes are `main`'s session, as systemd does it
    (src/core/service.c and unit_kill_context): with KillMode=control-group (the default),
    SIGTERM to every process of the unit, and once the main process has ended, SIGTERM again
    to each one left (SIGKILL only after TimeoutStopSec); with KillMode=mixed, SIGTERM to the
    main process alone, and once it has ended, SIGKILL to every process left at once."""
    first = session_processes(main.pid) if kill_mode == "control-group" else [main.pid]
    for pid in first:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    main.wait(timeout=60)
    final = signal.SIGTERM if kill_mode == "control-group" else signal.SIGKILL
    for pid in session_processes(main.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, final)
    wait_for(lambda: not session_processes(main.pid), timeout=60)


def test_systemctl_stop_lets_a_nightly_script_s_program_save_its_work(
    tmp_path: Path, sim_file: Any, procs: Any
) -> None:
    # "The job: any executable": a script that runs its program without `exec`, the program a
    # grandchild of gpuwait. Stopped bare, in a unit of the default kill mode, the program gets
    # SIGTERM from systemd and saves; through the contrib unit it must too, not be killed
    # unwarned (SIGKILL) once the script's shell, and so gpuwait, have ended.
    sim_file(gpus=1)
    home = tmp_path / "sdhome"
    bin_dir = make_bin(home / ".local" / "bin")
    flag = tmp_path / "flag"
    train = home / "train.py"
    train.write_text(SAVES_ON_TERM)
    job = bin_dir / "nightly-job"
    job.write_text(
        f'#!/bin/sh\ncd "$HOME" || exit 1\n{sys.executable} {train} {flag}\necho "ended: $?"\n'
    )
    job.chmod(0o755)
    service = CONTRIB / "systemd" / "gpuwait-nightly.service"
    (exec_start,) = unit_values(service, "ExecStart")
    env = {"HOME": str(home), "PATH": "/usr/local/bin:/usr/bin:/bin"}
    env.update(v.split("=", 1) for v in unit_values(service, "Environment"))  # type: ignore[arg-type]
    env["GPUWAIT_SIM"] = os.environ["GPUWAIT_SIM"]
    main = procs(shlex.split(exec_start.replace("%h", str(home))), env=env, cwd=home)
    wait_for(lambda: flag.exists() and flag.read_text() == "ready", timeout=60)
    stop_service(main, (unit_values(service, "KillMode") or ["control-group"])[0])
    assert flag.read_text() == "saved"


# Slurm ----------------------------------------------------------------------------------------


def pack_steps(
    steps: Path, env: dict[str, str], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """contrib/slurm/pack-steps.sbatch run on `steps` as Slurm would start it (bash, `env`)."""
    return subprocess.run(
        ["bash", str(CONTRIB / "slurm" / "pack-steps.sbatch"), str(steps)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_slurm_packs_steps_on_the_allocated_gpu_only(
    user_env: dict[str, str], tmp_path: Path
) -> None:
    reports = tmp_path / "reports"
    reports.mkdir()
    steps = tmp_path / "steps.txt"
    lines = ["# six small steps", ""]
    lines += [
        f"gpuwait sim job --vram 4G --hold 0.3s --report {reports}/{i}.json" for i in range(6)
    ]
    where = tmp_path / "where"
    lines.append(f'ls "$GPUWAIT_STATE_DIR" > {where}; echo "$GPUWAIT_STATE_DIR" >> {where}')
    steps.write_text("\n".join(lines))
    env = {
        **user_env,
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_GPUS": "1",
        "SLURM_CPUS_PER_TASK": "6",
        "CUDA_VISIBLE_DEVICES": "1",
        "TMPDIR": str(tmp_path),
    }
    done = pack_steps(steps, env, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "7 step(s), 0 failed" in done.stdout
    results = [json.loads(p.read_text()) for p in reports.glob("*.json")]
    assert len(results) == 6
    assert {r["gpu_uuid"] for r in results} == {sim_uuids()[1]}
    assert not any(r["oom"] for r in results)
    # The allocation's own ledger on node-local disk, not the home directory's; removed once
    # the script has ended, where nothing would ever read it again.
    *listed, state = where.read_text().splitlines()
    assert Path(state).parent == tmp_path and Path(state).name.startswith("gpuwait-4242.")
    assert "ledger.json" in listed
    assert not Path(state).exists()
    assert history(Path(user_env["XDG_STATE_HOME"])) == []


def test_slurm_script_steps_run_whatever_another_user_made_in_tmp(
    user_env: dict[str, str], tmp_path: Path
) -> None:
    # Job ids are sequential and shown by squeue: another user of the node can make the
    # directory the next allocation's ledger would be in, before it starts. Its steps must run.
    taken = tmp_path / "gpuwait-4243"
    taken.mkdir(mode=0o777)
    if os.geteuid() == 0:
        os.chown(taken, 65534, 65534)
    steps = tmp_path / "steps.txt"
    steps.write_text("true\ntrue\n")
    env = {**user_env, "SLURM_JOB_ID": "4243", "CUDA_VISIBLE_DEVICES": "0", "TMPDIR": str(tmp_path)}
    done = pack_steps(steps, {**env, "STEP_VRAM": "1G"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 step(s), 0 failed" in done.stdout
    assert list(taken.iterdir()) == []


def test_slurm_script_reports_failed_steps(user_env: dict[str, str], tmp_path: Path) -> None:
    steps = tmp_path / "steps.txt"
    steps.write_text("true\nexit 3\ntrue\n")
    env = {**user_env, "SLURM_JOB_ID": "7", "CUDA_VISIBLE_DEVICES": "0", "TMPDIR": str(tmp_path)}
    done = pack_steps(steps, {**env, "STEP_VRAM": "1G"})
    assert done.returncode == 1
    assert "3 step(s), 1 failed" in done.stdout


@pytest.mark.parametrize(
    "share",
    ["SLURM_SHARDS_ON_NODE=2", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50"],
    ids=["shard", "mps"],
)
def test_slurm_allocations_given_shares_of_one_gpu_pack_their_steps_together(
    user_env: dict[str, str], tmp_path: Path, share: str
) -> None:
    # Shards (--gres=shard:N) or MPS shares (--gres=mps:N) of one GPU go to several allocations
    # at once, each with that GPU in CUDA_VISIBLE_DEVICES and one of these variables set (so on
    # try-cluster's Slurm). With a ledger each, both allocations' steps started together and
    # ran out of memory.
    reports = tmp_path / "reports"
    reports.mkdir()
    scripts = []
    for job in ("51", "52"):
        steps = tmp_path / f"steps-{job}.txt"
        steps.write_text(
            "".join(
                f"gpuwait sim job --vram 8G --ramp 0.2s --hold 0.2s --report {reports}/{job}-{i}\n"
                for i in range(2)
            )
        )
        env = {
            **user_env,
            "SLURM_JOB_ID": job,
            "SLURM_JOB_GPUS": "0",
            "CUDA_VISIBLE_DEVICES": "0",
            "TMPDIR": str(tmp_path),
            "STEP_VRAM": "8G",
            share.split("=")[0]: share.split("=")[1],
        }
        script = ["bash", str(CONTRIB / "slurm" / "pack-steps.sbatch"), str(steps)]
        scripts.append(subprocess.Popen(script, env=env, stdout=subprocess.PIPE, text=True))
    outs = [script.communicate(timeout=120)[0] for script in scripts]
    assert all("2 step(s), 0 failed" in out for out in outs), outs
    results = [json.loads(p.read_text()) for p in reports.iterdir()]
    assert len(results) == 4 and not any(r["oom"] for r in results)
    # Two 8 GiB steps at a time on the 24 GiB card, whichever allocation they came from.
    assert max_overlap(history(Path(user_env["XDG_STATE_HOME"]))) == 2


def test_pausable_jobs_given_shards_of_one_gpu_take_turns(
    user_env: dict[str, str], tmp_path: Path
) -> None:
    # Two pausable.sbatch jobs, each given shards of GPU 0, each 16 GiB of its 24: one at a time.
    env = {
        **user_env,
        "SLURM_JOB_GPUS": "0",
        "SLURM_SHARDS_ON_NODE": "2",
        "CUDA_VISIBLE_DEVICES": "0",
        "TMPDIR": str(tmp_path),
        "JOB_VRAM": "16G",
    }
    job = ["gpuwait", "sim", "job", "--vram", "16G", "--ramp", "0.2s", "--hold", "0.2s"]
    scripts = [
        subprocess.Popen(
            ["bash", str(CONTRIB / "slurm" / "pausable.sbatch"), *job],
            env={**env, "SLURM_JOB_ID": job_id},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for job_id in ("61", "62")
    ]
    outs = [script.communicate(timeout=120)[0] for script in scripts]
    assert [script.returncode for script in scripts] == [0, 0], outs
    records = history(Path(user_env["XDG_STATE_HOME"]))
    assert len(records) == 2 and not any(r["oom"] for r in records)
    assert max_overlap(records) == 1


def test_pausable_script_requeues_on_the_resume_status_gpuwait_uses(
    sim_file: Any, tmp_path: Path, procs: Any
) -> None:
    # resume_exit set in the user's config (their programs say "resume me" with 99): the
    # script must requeue on the status gpuwait and the program use, not on 75 regardless.
    sim_file(gpus=1, base_used="20GiB")  # 10G never fits while the card stays this full
    config = Path(os.environ["XDG_CONFIG_HOME"]) / "gpuwait" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text("resume_exit = 99\n")
    bin_dir = make_bin(tmp_path / "bin")
    requeued = tmp_path / "requeued"
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$*" >> {requeued}\n')
    scontrol.chmod(0o755)
    env = {
        **env_with_bin(bin_dir),
        "SLURM_JOB_ID": "77",
        "JOB_VRAM": "10G",
        "GPUWAIT_STATE_DIR": str(Path(os.environ["XDG_STATE_HOME"]) / "gpuwait"),
    }
    script = procs(["bash", str(CONTRIB / "slurm" / "pausable.sbatch"), "true"], env=env)
    # Its gpuwait, once it waits (its signals handled): not `gpuwait config` before it.
    wait_for(lambda: any(asleep_waiting(pid) for pid in children(script.pid)), timeout=30)
    script.send_signal(signal.SIGUSR1)  # Slurm's --signal=B:USR1@N, to the batch shell
    out, err = script.communicate(timeout=60)
    assert script.returncode == 99, out + err
    assert "checkpointed; requeueing allocation 77" in out, out + err
    assert requeued.read_text() == "requeue 77\n"
    # A state dir the user gave is theirs: the script removes only one it made itself.
    assert (Path(env["GPUWAIT_STATE_DIR"]) / "ledger.json").exists()


def test_the_time_limit_signal_at_the_scripts_start_is_a_checkpoint_not_an_end(
    sim_file: Any, tmp_path: Path, procs: Any
) -> None:
    # `--signal=B:USR1@N` with N at or past the time limit (`--time=5 --signal=B:USR1@300`) is
    # due at once, and slurmctld may send it in the script's first second: before its gpuwait
    # catches USR1 (a Python program's first tenth of a second), where USR1 ended gpuwait (exit
    # 138: no checkpoint, no requeue), or while `gpuwait config` ran, where it ended the script.
    sim_file(gpus=1, base_used="20GiB")  # 10G never fits: the job waits
    bin_dir = make_bin(tmp_path / "bin")
    requeued = tmp_path / "requeued"
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$*" >> {requeued}\n')
    scontrol.chmod(0o755)
    env = {
        **env_with_bin(bin_dir),
        "SLURM_JOB_ID": "78",
        "JOB_VRAM": "10G",
        "TMPDIR": str(tmp_path),
    }
    script = procs(["bash", str(CONTRIB / "slurm" / "pausable.sbatch"), "true"], env=env)
    # As soon as the script takes USR1 as Slurm's warning, the earliest it can be sent one.
    wait_for(lambda: catches_signal(script.pid, signal.SIGUSR1), timeout=30, interval=0.002)
    script.send_signal(signal.SIGUSR1)
    out, err = script.communicate(timeout=60)
    assert script.returncode == 75, out + err
    assert "checkpointed; requeueing allocation 78" in out, out + err
    assert requeued.read_text() == "requeue 78\n"


def test_the_time_limit_signal_after_gpuwait_ended_asks_nobody(
    sim_file: Any, tmp_path: Path, procs: Any
) -> None:
    # The command checkpointed (exit 75) and the script requeues the allocation; Slurm's warning
    # comes meanwhile. gpuwait has ended and been reaped: the script said 'asking for a
    # checkpoint' and sent USR1 to its pid, no process of its any more (or another's since).
    sim_file(gpus=1)
    bin_dir = make_bin(tmp_path / "bin")
    requeuing, go = tmp_path / "requeuing", tmp_path / "go"
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f"#!/bin/sh\ntouch {requeuing}\nwhile [ ! -e {go} ]; do sleep 0.02; done\n")
    scontrol.chmod(0o755)
    env = {**env_with_bin(bin_dir), "SLURM_JOB_ID": "79", "JOB_VRAM": "1G", "TMPDIR": str(tmp_path)}
    script = procs(
        ["bash", str(CONTRIB / "slurm" / "pausable.sbatch"), "sh", "-c", "exit 75"], env=env
    )
    try:
        wait_for(requeuing.exists, timeout=60, message="the script never requeued")
        script.send_signal(signal.SIGUSR1)
    finally:
        go.touch()
    out, err = script.communicate(timeout=60)
    assert script.returncode == 75, out + err
    assert "checkpointed; requeueing allocation 79" in out, out + err
    assert "asking for a checkpoint" not in out and "kill" not in err, out + err


def test_gpuwait_around_srun_is_refused(user_env: dict[str, str], tmp_path: Path) -> None:
    # slurmstepd starts an srun step's tasks with Slurm's CUDA_VISIBLE_DEVICES (the job's GPUs,
    # or the step's), whatever gpuwait set: wrapped around srun, the reservation would bind
    # nothing (on try-cluster's Slurm the step saw "0,1" where gpuwait had reserved GPU 1).
    # Refused before waiting.
    ran = tmp_path / "ran"
    srun = tmp_path / "bin" / "srun"
    srun.write_text(f"#!/bin/sh\ntouch {ran}\n")
    srun.chmod(0o755)
    env = {**user_env, "SLURM_JOB_ID": "7", "CUDA_VISIBLE_DEVICES": "0,1"}
    done = subprocess.run(
        ["gpuwait", "--vram", "4G", "--", "srun", "-n1", "python", "train.py"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "srun starts its tasks with Slurm's own CUDA_VISIBLE_DEVICES" in done.stderr
    assert "srun ... gpuwait --vram SIZE -- COMMAND" in done.stderr
    assert not ran.exists()
    assert history(Path(env["XDG_STATE_HOME"])) == []


def test_a_slurm_job_given_no_gpus_is_refused_where_slurm_hands_gpus_out(
    user_env: dict[str, str], tmp_path: Path
) -> None:
    # A batch script or step that Slurm gave no GPU has no CUDA_VISIBLE_DEVICES at all: every
    # GPU of the node looked free to it, including those Slurm gave other jobs, whose own
    # allocations would then die of out-of-memory. Where slurm.conf hands GPUs out as GRES it
    # is refused, with what to ask Slurm for.
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=c\n# GresTypes=none\ngrestypes=mps, gpu  # GPUs are GRES\n")
    env = {**user_env, "SLURM_JOB_ID": "7", "SLURMD_NODENAME": "n1", "SLURM_CONF": str(conf)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    ran = tmp_path / "ran"
    command = ["gpuwait", "--vram", "1G", "--", "touch", str(ran)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert "Slurm gave this job no GPU" in done.stderr
    assert "--gres=gpu:1" in done.stderr
    assert "Traceback" not in done.stderr
    assert not ran.exists()
    # `srun --gres=none` (or --gpus=0) inside a GPU job starts the step with no
    # CUDA_VISIBLE_DEVICES but with the job's SLURM_JOB_GPUS (seen on a real Slurm): it ran on
    # any GPU of the node, another job's too.
    on_1 = ["gpuwait", "--vram", "1G", "--devices", "1", "--", "touch", str(ran)]
    gres_none = {**env, "SLURM_JOB_GPUS": "0"}
    step = subprocess.run(on_1, env=gres_none, capture_output=True, text=True, timeout=60)
    assert step.returncode == 3, step.stderr
    assert "this Slurm job has GPUs (SLURM_JOB_GPUS=0) but this step none of them" in step.stderr
    assert "CUDA_VISIBLE_DEVICES=0" in step.stderr
    assert not ran.exists()
    # A step given GPUs of its own runs on them.
    own = {**env, "SLURM_JOB_GPUS": "1", "SLURM_STEP_GPUS": "1", "CUDA_VISIBLE_DEVICES": "1"}
    echo = ["gpuwait", "--vram", "1G", "--", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES"]
    step = subprocess.run(echo, env=own, capture_output=True, text=True, timeout=60)
    assert step.returncode == 0, step.stderr
    assert step.stdout.strip() == sim_uuids()[1]
    # Where Slurm does not hand GPUs out, or the job has GPUs of its own, it runs as before.
    conf.write_text("ClusterName=c\nGresTypes=mps\n")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert ran.exists()


def test_a_slurm_job_given_no_gpus_is_told_how_to_run_a_command_on_the_cpu(
    user_env: dict[str, str], tmp_path: Path
) -> None:
    # In an `srun --pty bash` of a job given no GPU, the shell hook's `python prep.py` is refused
    # (every GPU here may be another job's), and the hint named only ways to get a GPU: the
    # line that runs such a command on the CPU was nowhere.
    conf = tmp_path / "slurm.conf"
    conf.write_text("GresTypes=gpu\n")
    env = {**user_env, "SLURM_JOB_ID": "7", "SLURMD_NODENAME": "n1", "SLURM_CONF": str(conf)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    (tmp_path / "prep.py").write_text(
        "import os; print(repr(os.environ['CUDA_VISIBLE_DEVICES']))\n"
    )
    hooked = ["gpuwait", "shell-hook", "--", "python3", "prep.py"]
    done = subprocess.run(hooked, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    hint = done.stderr.splitlines()[-1]
    assert hint.startswith("gpuwait: hint: "), done.stderr
    assert hint.endswith("; or on the CPU: CUDA_VISIBLE_DEVICES= python3 prep.py"), hint
    # That line, typed where the hook runs, runs the command on the CPU.
    cpu = {**env, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(hooked, env=cpu, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "''\n"), done.stderr


# Docker ---------------------------------------------------------------------------------------

FAKE_DOCKER = """#!/bin/sh
python3 -c 'import json, os, sys; json.dump({"argv": sys.argv[2:], "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}, open(sys.argv[1] + "/docker.json", "w"))' "$FAKE_DOCKER_DIR" "$@"
exit 5
"""


def test_docker_run_gets_the_gpu_gpuwait_picked(user_env: dict[str, str], tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    (bin_dir / "docker").write_text(FAKE_DOCKER)
    (bin_dir / "docker").chmod(0o755)
    shutil.copy(CONTRIB / "docker" / "gpuwait-docker-run", bin_dir / "gpuwait-docker-run")
    env = {**user_env, "FAKE_DOCKER_DIR": str(tmp_path)}
    done = subprocess.run(
        ["gpuwait", "--devices", "1", "--", "gpuwait-docker-run", "-it", "img", "python", "a b"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 5, done.stderr  # the container's status
    seen = json.loads((tmp_path / "docker.json").read_text())
    uuid = sim_uuids()[1]
    assert seen["argv"] == [
        "run",
        "--rm",
        "--init",
        "--gpus",
        f'"device={uuid}"',
        "-it",
        "img",
        "python",
        "a b",
    ]
    bare = subprocess.run(
        ["gpuwait-docker-run", "img"], env=env, capture_output=True, text=True, timeout=30
    )
    assert bare.returncode == 2 and "run me through gpuwait" in bare.stderr


def test_docker_run_from_a_shell_that_outlived_its_job_starts_no_container(
    user_env: dict[str, str], tmp_path: Path
) -> None:
    # A shell started inside a job (a tmux server) keeps the job's variables once the job has
    # ended: gpuwait-docker-run there started a container on the ended job's GPU, which gpuwait
    # may have given to someone else since. So too where the job's gpuwait pid is another
    # process's since. Refused (exit 2) as outside gpuwait.
    bin_dir = tmp_path / "bin"
    (bin_dir / "docker").write_text(FAKE_DOCKER)
    (bin_dir / "docker").chmod(0o755)
    shutil.copy(CONTRIB / "docker" / "gpuwait-docker-run", bin_dir / "gpuwait-docker-run")
    saved = tmp_path / "job.json"
    dump = f"import json, os; json.dump(dict(os.environ), open({str(saved)!r}, 'w'))"
    job = ["gpuwait", "--vram", "1G", "--", sys.executable, "-c", dump]
    done = subprocess.run(job, env=user_env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    kept = {**json.loads(saved.read_text()), "FAKE_DOCKER_DIR": str(tmp_path)}
    assert kept["GPUWAIT_GPU_UUIDS"]
    for pid in (kept["GPUWAIT_JOB_PID"], str(os.getpid())):
        stale = subprocess.run(
            ["gpuwait-docker-run", "img"],
            env={**kept, "GPUWAIT_JOB_PID": pid},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert not (tmp_path / "docker.json").exists(), pid
        assert stale.returncode == 2, stale.stderr
        assert stale.stderr.count("\n") == 1 and "has ended" in stale.stderr, stale.stderr


@pytest.mark.parametrize("before", ["GPUWAIT_JOB_PID", "GPUWAIT_JOB_START"])
def test_docker_run_in_a_job_an_older_gpuwait_runs_from_a_shell_that_outlived_one_starts(
    user_env: dict[str, str], tmp_path: Path, before: str
) -> None:
    # From a tmux session opened inside a job that has ended, an older gpuwait (a venv's own
    # copy, from before it set `before`) runs gpuwait-docker-run, and passes the ended job's
    # variable on beside those it sets: the script took its own job for ended and refused to
    # start the container (exit 2, 'the gpuwait job ID has ended'), while that job ran.
    bin_dir = tmp_path / "bin"
    (bin_dir / "docker").write_text(FAKE_DOCKER)
    (bin_dir / "docker").chmod(0o755)
    shutil.copy(CONTRIB / "docker" / "gpuwait-docker-run", bin_dir / "gpuwait-docker-run")
    gone = subprocess.Popen(["true"])
    gone.wait()
    given = [f"GPUWAIT_JOB_PID={gone.pid}", "GPUWAIT_JOB_START=1"]
    if before == "GPUWAIT_JOB_START":
        given = given[1:]  # that gpuwait names itself as the job's process
    job = ["gpuwait", "-q", "--vram", "1G", "--", "env", *given, "gpuwait-docker-run", "img"]
    env = {**user_env, "FAKE_DOCKER_DIR": str(tmp_path)}
    done = subprocess.run(job, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 5, done.stderr  # the container's status
    seen = json.loads((tmp_path / "docker.json").read_text())
    assert seen["argv"][:4] == ["run", "--rm", "--init", "--gpus"], seen


def shell_blocks(readme: Path) -> list[str]:
    return re.findall(r"```sh\n(.*?)```", readme.read_text(), flags=re.DOTALL)


def test_docker_readme_commands_are_consistent() -> None:
    readme = CONTRIB / "docker" / "README.md"
    blocks = shell_blocks(readme)
    assert blocks
    commands = []
    for block in blocks:
        done = subprocess.run(["bash", "-n"], input=block, capture_output=True, text=True)
        assert done.returncode == 0, (block, done.stderr)
        commands += [c for c in block.replace("\\\n", " ").splitlines() if c.strip()]
    inside = [c for c in commands if c.startswith("docker run") and " gpuwait " in c]
    assert inside, "the README shows gpuwait run inside a container"
    for command in inside:
        words = shlex.split(command)
        assert "--pid=host" in words, command
        mounts = [words[i + 1] for i, w in enumerate(words) if w == "-v"]
        state = next(w.split("=", 1)[1] for w in words if w.startswith("GPUWAIT_STATE_DIR="))
        assert any(m.endswith(":" + state) for m in mounts), command
        assert "--user" in words, command
    around = [c for c in commands if c.startswith("gpuwait ") and "gpuwait-docker-run" in c]
    assert around and (CONTRIB / "docker" / "gpuwait-docker-run").exists()
    for command in around:
        # Whole GPUs: without --vram, a command with history gets its learned size instead.
        assert "--exclusive" in shlex.split(command), command


# Prometheus -----------------------------------------------------------------------------------

SAMPLE = re.compile(
    r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?P<labels>\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*",?)*\})? '
    r"(?P<value>[-+]?(?:\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|Inf|NaN))$"
)


def parse_exposition(text: str) -> dict[tuple[str, str], float]:
    """Samples of a text exposition, checking the format strictly on the way."""
    assert text.endswith("\n")
    samples: dict[tuple[str, str], float] = {}
    typed: dict[str, str] = {}
    finished: set[str] = set()
    current = None
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            name = line.split()[2]
            if line.startswith("# TYPE "):
                assert line.split()[3] in ("gauge", "counter", "untyped"), line
                assert name not in typed, f"second TYPE for {name}"
                typed[name] = line.split()[3]
            continue
        match = SAMPLE.match(line)
        assert match, f"not a sample line: {line!r}"
        name = match["name"]
        assert name in typed, f"{name} has no TYPE line before it"
        if name != current:
            assert name not in finished, f"samples of {name} are not together"
            if current:
                finished.add(current)
            current = name
        key = (name, match["labels"] or "")
        assert key not in samples, f"duplicate sample {key}"
        samples[key] = float(match["value"])
    return samples


EXPORTER = [sys.executable, str(CONTRIB / "prometheus" / "gpuwait-exporter")]


def exporter(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*EXPORTER, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_prometheus_exporter_writes_valid_metrics_of_a_running_job(
    user_env: dict[str, str], tmp_path: Path
) -> None:
    job = holder(user_env, "6G", "1")
    try:
        wait_running(1)
        metrics = tmp_path / "textfile"
        proc = exporter("--output-dir", str(metrics), env=user_env)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
    finally:
        stop(job)
    path = metrics / "gpuwait.prom"
    samples = parse_exposition(path.read_text())
    uuid0, uuid1 = sim_uuids()
    gpu1 = f'{{gpu="1",uuid="{uuid1}",name="Simulated GPU"}}'
    gpu0 = f'{{gpu="0",uuid="{uuid0}",name="Simulated GPU"}}'
    assert samples[("gpuwait_up", "")] == 1
    assert samples[("gpuwait_gpus_readable", "")] == 1
    assert samples[("gpuwait_gpu_total_bytes", gpu1)] == 24 * GiB
    assert samples[("gpuwait_gpu_reserved_bytes", gpu1)] == 6 * GiB
    assert samples[("gpuwait_gpu_reserved_bytes", gpu0)] == 0
    assert samples[("gpuwait_gpu_running_jobs", gpu1)] == 1
    assert samples[("gpuwait_gpu_room_bytes", gpu1)] < samples[("gpuwait_gpu_room_bytes", gpu0)]
    assert samples[("gpuwait_jobs", '{state="running"}')] == 1
    assert samples[("gpuwait_jobs", '{state="waiting"}')] == 0
    assert samples[("gpuwait_warnings", "")] == 0
    assert path.stat().st_mode & 0o777 == 0o644  # node_exporter runs as another user
    assert [p.name for p in metrics.iterdir()] == ["gpuwait.prom"]


def test_prometheus_exporter_counts_the_warnings_gpuwait_status_gave(
    user_env: dict[str, str], tmp_path: Path
) -> None:
    ledger = Path(user_env["XDG_STATE_HOME"]) / "gpuwait" / "ledger.json"
    ledger.parent.mkdir(parents=True, exist_ok=True)
    ledger.write_text('{"schema": 1, "jobs": [')  # torn: gpuwait sets it aside, and warns
    metrics = tmp_path / "textfile"
    proc = exporter("--output-dir", str(metrics), env=user_env)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    samples = parse_exposition((metrics / "gpuwait.prom").read_text())
    assert samples[("gpuwait_up", "")] == 1
    assert samples[("gpuwait_warnings", "")] == 1


def test_prometheus_exporter_shows_a_lost_gpu_as_unhealthy(
    user_env: dict[str, str], tmp_path: Path
) -> None:
    uuid0, uuid1 = sim_uuids()
    # A run while both answer: gpuwait then knows the GPU that goes missing after.
    subprocess.run(["gpuwait", "-q", "--vram", "1G", "true"], env=user_env, check=True, timeout=60)
    sim = Path(user_env["GPUWAIT_SIM"])
    first, second = sim.read_text().split("[[gpu]]")[1:]
    sim.write_text(f"[[gpu]]{first}[[gpu]]{second.rstrip()}\nlost = true\n")
    proc = exporter("--output-dir", str(tmp_path), env=user_env)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    samples = parse_exposition((tmp_path / "gpuwait.prom").read_text())
    assert samples[("gpuwait_gpu_healthy", f'{{gpu="0",uuid="{uuid0}",name="Simulated GPU"}}')] == 1
    lost = f'{{gpu="1",uuid="{uuid1}",name="Simulated GPU"}}'
    assert samples[("gpuwait_gpu_healthy", lost)] == 0
    # As the README says: its total and running jobs stay, the figures it cannot give go.
    assert samples[("gpuwait_gpu_total_bytes", lost)] == 24 * GiB
    assert samples[("gpuwait_gpu_running_jobs", lost)] == 0
    assert [n for n, labels in samples if labels == lost] == [
        "gpuwait_gpu_total_bytes",
        "gpuwait_gpu_running_jobs",
        "gpuwait_gpu_healthy",
    ]


def test_prometheus_exporter_replaces_the_file_atomically_and_a_term_ends_it_cleanly(
    user_env: dict[str, str], tmp_path: Path
) -> None:
    metrics = tmp_path / "textfile"
    path = metrics / "gpuwait.prom"
    proc = exporter("--output-dir", str(metrics), "--every", "0.05s", env=user_env)
    try:
        wait_for(path.exists, timeout=60)
        inodes = set()
        deadline = time.monotonic() + 60
        while len(inodes) < 4 and time.monotonic() < deadline:
            # Every read is a whole file, although a writer keeps replacing it.
            with path.open() as f:
                inodes.add(os.fstat(f.fileno()).st_ino)
                parse_exposition(f.read())
        assert len(inodes) >= 4  # each write is a new file renamed over the old one
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    # A stop is no failure: systemd counts exit status 143 as one (a unit left "failed").
    assert proc.returncode == 0
    assert [p.name for p in metrics.iterdir()] == ["gpuwait.prom"]  # no temporary file left
    parse_exposition(path.read_text())


def test_prometheus_exporter_keeps_writing_after_a_write_that_failed(
    user_env: dict[str, str], tmp_path: Path
) -> None:
    # A full disk for a moment, a directory swapped by a deployment: the long-running exporter
    # says so and writes again at its next turn, instead of ending for good (the file would
    # then stand still until someone restarted it).
    metrics = tmp_path / "textfile"
    path = metrics / "gpuwait.prom"
    errors = tmp_path / "stderr"
    with errors.open("w") as err:
        proc = subprocess.Popen(
            [*EXPORTER, "--output-dir", str(metrics), "--every", "0.05s"],
            env=user_env,
            stdout=subprocess.DEVNULL,
            stderr=err,
            text=True,
        )
    try:
        wait_for(path.exists, timeout=60)
        metrics.rename(tmp_path / "away")
        metrics.write_text("not a directory")
        wait_for(lambda: "cannot write" in errors.read_text(), timeout=60)
        assert proc.poll() is None, errors.read_text()
        metrics.unlink()
        wait_for(path.exists, timeout=60)
        parse_exposition(path.read_text())
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert len(errors.read_text().splitlines()) >= 1


@pytest.mark.parametrize("every", ["0", "-5s", "soon", "nan", "inf", "1e400s", "2d"])
def test_prometheus_exporter_refuses_an_interval_it_cannot_keep_in_one_line(
    user_env: dict[str, str], tmp_path: Path, every: str
) -> None:
    # A value that parses as a float but is no interval (nan, inf) must be refused at once,
    # not end the exporter with a traceback after its first write.
    proc = exporter("--output-dir", str(tmp_path / "textfile"), "--every", every, env=user_env)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert "Traceback" not in err and "--every" in err.splitlines()[-1]
    assert not (tmp_path / "textfile").exists()


def test_prometheus_exporter_reports_down_when_gpuwait_fails(
    user_env: dict[str, str], tmp_path: Path
) -> None:
    proc = exporter("--output-dir", str(tmp_path), "--gpuwait", "false", env=user_env)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "exit status 1" in err
    samples = parse_exposition((tmp_path / "gpuwait.prom").read_text())
    assert samples[("gpuwait_up", "")] == 0
    assert not any(name.startswith("gpuwait_gpu_") for name, _ in samples)


def test_prometheus_exporter_says_when_the_gpus_cannot_be_read(
    user_env: dict[str, str], tmp_path: Path
) -> None:
    # gpuwait answers (its jobs are still there), but without a GPU figure: an alert on the
    # GPUs must have a metric that says so, not only missing series.
    env = {**user_env, "GPUWAIT_SIM": str(tmp_path / "missing.toml")}
    proc = exporter("--output-dir", str(tmp_path), env=env)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    samples = parse_exposition((tmp_path / "gpuwait.prom").read_text())
    assert samples[("gpuwait_up", "")] == 1
    assert samples[("gpuwait_gpus_readable", "")] == 0
    assert not any(name.startswith("gpuwait_gpu_") for name, _ in samples)


@pytest.fixture
def busy_metrics(user_env: dict[str, str], tmp_path: Path) -> Iterator[str]:
    """The exporter's file while real jobs run on both simulated GPUs and one waits."""
    jobs = [holder(user_env, "16G", "0"), holder(user_env, "6G", "1")]
    try:
        wait_running(2)
        jobs.append(holder(user_env, "20G", "1"))  # 6 + 20 GiB > 90 % of 24: it waits
        wait_for(lambda: sum(j["state"] == "waiting" for j in ledger_entries()) == 1, timeout=30)
        proc = exporter("--output-dir", str(tmp_path / "textfile"), env=user_env)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
    finally:
        for job in jobs:
            stop(job)
    text = (tmp_path / "textfile" / "gpuwait.prom").read_text()
    samples = parse_exposition(text)
    assert samples[("gpuwait_jobs", '{state="running"}')] == 2
    assert samples[("gpuwait_jobs", '{state="waiting"}')] == 1
    yield text


def test_prometheus_exporter_output_passes_promtool(busy_metrics: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    # Parses the text format as Prometheus does, and lints names, units, types and HELP.
    done = subprocess.run(
        [promtool, "check", "metrics"], input=busy_metrics, capture_output=True, text=True
    )
    assert done.returncode == 0 and not done.stdout + done.stderr, done.stdout + done.stderr


def test_prometheus_exporter_output_is_read_by_prometheus_client(busy_metrics: str) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(busy_metrics)}
    assert set(families) == {
        "gpuwait_up",
        "gpuwait_gpus_readable",
        "gpuwait_last_update_timestamp_seconds",
        "gpuwait_gpu_total_bytes",
        "gpuwait_gpu_used_bytes",
        "gpuwait_gpu_reserved_bytes",
        "gpuwait_gpu_room_bytes",
        "gpuwait_gpu_running_jobs",
        "gpuwait_gpu_healthy",
        "gpuwait_warnings",
        "gpuwait_jobs",
    }
    for family in families.values():
        assert family.type == "gauge" and family.documentation, family
        if "VRAM" in family.documentation:
            assert family.name.endswith("_bytes") and "in bytes" in family.documentation
    reserved = {s.labels["gpu"]: s.value for s in families["gpuwait_gpu_reserved_bytes"].samples}
    assert reserved == {"0": 16 * GiB, "1": 6 * GiB}  # the waiting job reserves nothing yet
    running = {s.labels["gpu"]: s.value for s in families["gpuwait_gpu_running_jobs"].samples}
    assert running == {"0": 1, "1": 1}
    (stamp,) = families["gpuwait_last_update_timestamp_seconds"].samples
    assert abs(stamp.value - time.time()) < 120


def test_prometheus_exporter_units_verify_and_the_service_writes_the_file(
    user_env: dict[str, str], tmp_path: Path
) -> None:
    home = tmp_path / "sdhome"
    bin_dir = make_bin(home / ".local" / "bin")
    shutil.copy(CONTRIB / "prometheus" / "gpuwait-exporter", bin_dir)
    service = CONTRIB / "prometheus" / "gpuwait-exporter.service"
    timer = CONTRIB / "prometheus" / "gpuwait-exporter.timer"
    if shutil.which("systemd-analyze") is None:
        verified = "systemd-analyze is not installed"
    else:
        runtime = tmp_path / "runtime"
        runtime.mkdir(mode=0o700)
        done = subprocess.run(
            ["systemd-analyze", "verify", "--user", str(service), str(timer)],
            env={**os.environ, "HOME": str(home), "XDG_RUNTIME_DIR": str(runtime)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0 and done.stderr == "", done.stderr
        verified = ""
    # What systemd would run: %h and ${TEXTFILE_DIR} expanded, in a user manager's bare
    # environment (no ~/.local/bin on PATH).
    textfile = tmp_path / "textfile"
    (exec_start,) = unit_values(service, "ExecStart")
    (setting,) = unit_values(service, "Environment")
    assert setting.startswith("TEXTFILE_DIR=/")
    command = exec_start.replace("%h", str(home)).replace("${TEXTFILE_DIR}", str(textfile))
    env = {"HOME": str(home), "PATH": "/usr/local/bin:/usr/bin:/bin"}
    env["GPUWAIT_SIM"] = user_env["GPUWAIT_SIM"]
    done = subprocess.run(shlex.split(command), env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    samples = parse_exposition((textfile / "gpuwait.prom").read_text())
    assert samples[("gpuwait_up", "")] == 1
    if verified:
        pytest.skip(f"units not verified: {verified} (the service's command did run)")


def test_node_exporter_serves_the_metrics_with_the_documented_flags(
    busy_metrics: str, tmp_path: Path
) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    binary = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
    if binary is None:
        pytest.skip("node_exporter is not installed (Debian: apt-get install prometheus)")
    textfile = tmp_path / "textfile"  # where busy_metrics's exporter wrote gpuwait.prom
    port = free_ports()
    server = subprocess.Popen(
        [
            binary,
            "--collector.disable-defaults",
            "--collector.textfile",
            f"--collector.textfile.directory={textfile}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )

    def scrape() -> str | None:
        assert server.poll() is None, server.communicate()[1]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                return str(r.read().decode())
        except OSError:
            return None

    try:
        text = wait_for(scrape, timeout=30)
    finally:
        stop(server)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    (error,) = families["node_textfile_scrape_error"].samples
    assert error.value == 0
    (mtime,) = families["node_textfile_mtime_seconds"].samples
    assert mtime.labels["file"].endswith("/gpuwait.prom")  # the temporary file is never read
    waiting = [s for s in families["gpuwait_jobs"].samples if s.labels["state"] == "waiting"]
    assert [s.value for s in waiting] == [1]
    assert families["gpuwait_gpu_total_bytes"].documentation == "Total VRAM of the GPU, in bytes."
