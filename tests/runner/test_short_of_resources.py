"""A machine short of threads, processes or file descriptors must not cost the user's command its
output, its exit status or its life, and must not leave its room reserved."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.fixtures_sim import SimFileFactory
from helpers.processes import children, pending_signals, process_name
from helpers.status import listed_jobs
from helpers.trap import TRAP, wait_for_text
from helpers.waiting import process_state, sleeping_in, wait_for

#: The stand-in for NVIDIA's cuda-checkpoint, which `--freezable` needs to be there.
FAKE_CUDA_CHECKPOINT = (
    Path(__file__).resolve().parents[1] / "helpers" / "fake_cuda_checkpoint" / "cuda-checkpoint"
)


def last_record() -> dict[str, Any]:
    path = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "history.jsonl"
    return dict(json.loads(path.read_text().splitlines()[-1]))


def gpuwait_after(patch: str) -> list[str]:
    """argv prefix of this checkout's gpuwait, run once `patch` (Python code that stands in
    for what the machine is short of) has run in its interpreter."""
    main = "from gpuwait.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    return [sys.executable, "-c", textwrap.dedent(patch) + main]


#: gpuwait in a process that can start no thread (a pids cgroup or `ulimit -u` reached, address
#: space too small for a thread's stack): Python says so as "can't start new thread".
NO_THREADS = gpuwait_after(
    """
    import sys, threading
    def refuse(self):
        raise RuntimeError("can't start new thread")
    threading.Thread.start = refuse
    """
)


def test_no_thread_for_watching_stderr_leaves_the_command_running_to_its_end(
    sim_file: SimFileFactory,
) -> None:
    sim_file(gpus=1)
    command = ["sh", "-c", "echo out; echo err >&2; exit 3"]
    done = subprocess.run(
        [*NO_THREADS, "--vram", "1G", "--", *command],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
    record = last_record()
    assert record["exit_status"] == 3 and record["stderr_watched"] == "off"


#: Starts `sh -c 'echo err >&2'` the way a launch does, with stderr a pipe, while this process
#: has only 0, 1, 2, ... descriptors left (its parent leaked the rest to it, or `ulimit -n` is
#: low); prints how the command ended and whether its stderr was watched, for each.
FEW_DESCRIPTORS = textwrap.dedent(
    """
    import os, resource, sys
    from gpuwait.linux import signals
    from gpuwait.runner.launch import spawn
    from gpuwait.runner.stderrwatch import StderrWatch
    signals.block_handled()  # as gpuwait runs
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    for spare in range(7):
        taken = []
        while True:
            try:
                taken.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                break
        for fd in taken[len(taken) - spare:]:
            os.close(fd)
        watch = StderrWatch()
        child = spawn(["sh", "-c", "echo err >&2"], dict(os.environ), watch.file_actions())
        watch.started()
        _, status = os.waitpid(child, 0)
        watch.finish()
        for fd in taken[: len(taken) - spare]:
            os.close(fd)
        print(spare, os.waitstatus_to_exitcode(status), watch.mode, flush=True)
    """
)


def test_a_launch_left_few_file_descriptors_runs_its_command_with_its_output() -> None:
    done = subprocess.run(
        [sys.executable, "-c", FEW_DESCRIPTORS], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    ended = [line.split() for line in done.stdout.splitlines()]
    assert [spare for spare, _, _ in ended] == [str(n) for n in range(7)]
    # Every command ran to its end (none killed by a broken pipe) and said its word.
    assert all(code == "0" for _, code, _ in ended), ended
    assert done.stderr == "err\n" * 7
    # Watched once the pipes fit; unwatched, not failed, before.
    assert ended[-1][2] == "pipe"


#: gpuwait where starting a process fails with EAGAIN, as fork does when the user's process
#: limit (`ulimit -u`) or a pids cgroup is reached. Its first argument says for how long: for
#: the first N starts (-1: all), or, `child`, while gpuwait has a child process (the stderr
#: relay, its only one before the command, holding the last place until it is reaped).
NO_PROCESSES = gpuwait_after(
    """
    import errno, os, sys
    when = sys.argv.pop(1)
    left = [0 if when == "child" else int(when)]
    real = os.posix_spawnp
    def short():
        if when == "child":
            with open(f"/proc/self/task/{os.getpid()}/children") as listed:
                return bool(listed.read().split())
        left[0] -= 1
        return left[0] >= 0 or when == "-1"
    def spawnp(*args, **kwargs):
        if short():
            raise BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN))
        return real(*args, **kwargs)
    os.posix_spawnp = spawnp
    """
)


@pytest.mark.parametrize("short", ["2", "child"])
def test_a_command_that_cannot_start_for_a_moment_for_want_of_processes_runs_after_all(
    sim_file: SimFileFactory, short: str
) -> None:
    # For two tries; or one process short, the stderr relay holding the last place. The relay
    # makes way for the command, whose stderr then goes unwatched.
    sim_file(gpus=1)
    command = ["sh", "-c", "echo out; echo err >&2; exit 3"]
    started = time.monotonic()
    done = subprocess.run(
        [*NO_PROCESSES, short, "--vram", "1G", "--", *command],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout) == (3, "out\n"), done.stderr
    assert "Resource temporarily unavailable" in done.stderr
    assert done.stderr.endswith("err\n") and "Traceback" not in done.stderr
    # Not after the half minute of trying again that a shortage lasting that long gets.
    assert time.monotonic() - started < 10
    record = last_record()
    assert (record["exit_status"], record["stderr_watched"]) == (3, "off")


def test_a_command_that_started_after_a_moment_short_of_processes_gets_a_group_signal_once(
    sim_file: SimFileFactory, tmp_path: Path, procs: Callable[..., subprocess.Popen[Any]]
) -> None:
    # The witness of group signals made way for the command; a signal sent to the whole group
    # later in the run (`kill %1`, `timeout`, systemd) must still reach the command once.
    # The first two starts fail (the witness's, then the command's).
    sim_file(gpus=1)
    flag, go = tmp_path / "flag", tmp_path / "go"
    command = [sys.executable, "-c", TRAP, str(flag), str(go)]
    launch = procs([*NO_PROCESSES, "2", "--vram", "1G", "--", *command])
    wait_for_text(flag, "ready")
    trap = next(p for p in children(launch.pid) if process_name(p) != "cat")
    # gpuwait slow to take the signal (a loaded machine): the command has taken the group's
    # first, so a second passed on by gpuwait would not merge into it but be counted.
    os.kill(launch.pid, signal.SIGSTOP)
    wait_for(lambda: process_state(launch.pid) == "T")
    os.killpg(launch.pid, signal.SIGTERM)
    wait_for(lambda: signal.SIGTERM not in pending_signals(trap))
    os.kill(launch.pid, signal.SIGCONT)
    # gpuwait waits again once it has dealt with the signal (passed it on or not): only then
    # does the command count what it got.
    wait_for(lambda: sleeping_in(launch.pid, "sigtimedwait") or launch.poll() is not None)
    go.touch()
    assert launch.wait(timeout=30) == 41, flag.read_text()


def signalled_while_retrying_its_start(signum: int, *options: str) -> tuple[int, str]:
    """(exit status, what it said after) of a launch with `options` that no process can be
    started for, sent `signum` once its first start failed."""
    launch = subprocess.Popen(
        [*NO_PROCESSES, "-1", "--vram", "1G", *options, "--", "true"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert launch.stderr is not None
        said = launch.stderr.readline()  # said once the first start failed
        assert "Resource temporarily unavailable" in said
        launch.send_signal(signum)
        return launch.wait(timeout=10), launch.stderr.read()
    finally:
        launch.kill()
        launch.communicate()


def test_a_launch_retrying_its_start_ends_by_term_and_leaves_the_queue(
    sim_file: SimFileFactory, gpuwait_cmd: list[str]
) -> None:
    sim_file(gpus=1)
    code, _ = signalled_while_retrying_its_start(signal.SIGTERM)
    assert code == -signal.SIGTERM
    assert listed_jobs(gpuwait_cmd) == []


def test_a_pausable_launch_retrying_its_start_asked_to_checkpoint_ends_with_the_resume_status(
    sim_file: SimFileFactory, gpuwait_cmd: list[str]
) -> None:
    # Slurm's warning before the time limit (--signal=B:USR1@N) while the command could not
    # start yet: nothing to save, and the batch script must see the resume status to requeue
    # the job, as where the signal comes while it waits.
    sim_file(gpus=1)
    code, said = signalled_while_retrying_its_start(signal.SIGUSR1, "--pausable")
    assert code == 75, said
    assert "resume status 75" in said
    assert listed_jobs(gpuwait_cmd) == []


#: gpuwait whose ledger cannot be written at the moment its command starts (a disk full for a
#: moment, the ledger lock held past lock_timeout): the command runs on, unrecorded as yet.
START_NOT_RECORDED = gpuwait_after(
    """
    import sys
    from gpuwait.core.errors import StateError
    from gpuwait.queue import lifecycle
    def started(*args, **kwargs):
        raise StateError("ledger cannot be written: No space left on device")
    lifecycle.started = started
    """
)


def test_a_command_whose_start_went_unrecorded_keeps_its_room_when_gpuwait_is_killed(
    sim_file: SimFileFactory, gpuwait_cmd: list[str]
) -> None:
    # The kernel's OOM killer takes gpuwait (not its command) a while after the start.
    sim_file(gpus=1, memory="24GiB")
    launch = subprocess.Popen(
        [*START_NOT_RECORDED, "--vram", "15G", "--", "sleep", "60"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    command: list[int] = []
    try:
        command = wait_for(
            lambda: [p for p in children(launch.pid) if process_name(p) == "sleep"],
            message="the command never started",
        )
        # Its first sample is taken, and gpuwait sleeps until the next.
        wait_for(lambda: sleeping_in(launch.pid, "sigtimedwait"))
        launch.kill()
        launch.wait(timeout=10)
        jobs = listed_jobs(gpuwait_cmd)
        assert [(j["child_pid"], j["orphaned"]) for j in jobs] == [(command[0], True)]
        # Its room is still its own: a second 15 GiB job does not fit beside it.
        done = subprocess.run(
            [*gpuwait_cmd, "--vram", "15G", "--timeout", "0.5s", "--", "true"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 124, done.stderr
    finally:
        launch.kill()
        launch.wait(timeout=10)
        for pid in command:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def sleeps(pid: int) -> int:
    """How often the main thread of `pid` has gone to sleep (its voluntary context switches)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/status").read_text()
    except OSError:
        return 0
    return next(
        int(line.split()[1]) for line in text.splitlines() if line.startswith("voluntary_ctxt")
    )


#: gpuwait whose ledger cannot be read once the file MARK exists (the system's file table full,
#: or gpuwait out of descriptors, for a while).
NO_LEDGER_READS_AFTER = gpuwait_after(
    """
    import errno, os, sys
    from gpuwait.queue import ledger
    mark, real = sys.argv.pop(1), ledger.open_readable
    def open_readable(*args, **kwargs):
        if os.path.exists(mark):
            raise OSError(errno.ENFILE, os.strerror(errno.ENFILE))
        return real(*args, **kwargs)
    ledger.open_readable = open_readable
    """
)


@pytest.mark.parametrize("kind", ["--pausable", "--freezable"])
def test_a_job_that_steps_aside_is_supervised_to_its_end_when_the_ledger_cannot_be_read(
    sim_file: SimFileFactory,
    gpuwait_cmd: list[str],
    tmp_path: Path,
    kind: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sim_file(gpus=1, memory="24GiB")
    if kind == "--freezable":  # a machine that can freeze CUDA jobs (docs/freezing.md)
        tool = tmp_path / "bin" / "cuda-checkpoint"
        tool.parent.mkdir()
        tool.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE_CUDA_CHECKPOINT} "$@"\n')
        tool.chmod(0o755)
        monkeypatch.setenv("PATH", f"{tool.parent}:{os.environ['PATH']}")
    mark, go = tmp_path / "mark", tmp_path / "go"
    # The command stops the ledger being read, then ends once told to: meanwhile another job
    # changes the ledger, which a job that may be asked to step aside reads at once.
    script = f"touch {mark}; while [ ! -e {go} ]; do sleep 0.01; done; echo finished; exit 7"
    gpuwait = [*NO_LEDGER_READS_AFTER, str(mark), kind, "--vram", "1G"]
    launch = subprocess.Popen(
        [*gpuwait, "--", "sh", "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(mark.exists, message="the command never started")
        other = subprocess.run(
            [*gpuwait_cmd, "--vram", "1G", "--", "true"], capture_output=True, timeout=60
        )
        assert other.returncode == 0
        # The change is looked at before the command ends: gpuwait has gone to sleep twice
        # since, so one round of its supervising loop (which looks) came wholly after it.
        slept = sleeps(launch.pid)
        wait_for(lambda: launch.poll() is not None or sleeps(launch.pid) >= slept + 2)
        go.touch()
        out, err = launch.communicate(timeout=30)
    finally:
        launch.kill()
        launch.communicate()
    assert (launch.returncode, out) == (7, "finished\n"), err
    assert "Traceback" not in err


def test_the_import_machinery_short_of_memory_is_said_as_any_shortage() -> None:
    # Near the limit, Python's import machinery fails to list a package's directory with
    # OSError ENOMEM (not a MemoryError) as gpuwait loads a module: that gave a traceback.
    script = (
        "import errno, gpuwait.cli as cli\n"
        "def load():\n"
        "    raise OSError(errno.ENOMEM, 'Cannot allocate memory', '/x/gpuwait/core')\n"
        "cli._entry_point = load\n"
        "cli.entry_point()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 126, done.stderr
    assert done.stderr.startswith("gpuwait: error: gpuwait ran out of memory"), done.stderr
    assert "Traceback" not in done.stderr


def test_a_launch_short_of_memory_says_so_in_one_line_and_runs_nothing(
    sim_file: SimFileFactory, tmp_path: Path
) -> None:
    # With its address space limited (`ulimit -v`) to what Python starts in but gpuwait cannot
    # load itself or read its files in, gpuwait died with a MemoryError traceback.
    import resource

    sim_file(gpus=1)
    ran = tmp_path / "ran"
    refused = []
    for megabytes in range(13, 28):
        limit = megabytes << 20

        def limited(limit: int = limit) -> None:
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

        def launch(*argv: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, *argv],
                preexec_fn=limited,
                capture_output=True,
                text=True,
                timeout=60,
            )

        if launch("-c", "import gpuwait.cli").returncode != 0:
            # Python itself does not start in so little, or cannot load the module its
            # console script starts from, before any of gpuwait runs.
            continue
        done = launch("-m", "gpuwait", "--vram", "1G", "--", "touch", str(ran))
        assert "Traceback" not in done.stderr, (megabytes, done.stderr)
        if done.returncode == 0:
            break  # enough for gpuwait
        assert done.returncode == 126, (megabytes, done.stderr)
        assert done.stderr.startswith("gpuwait: error: gpuwait ran out of memory"), done.stderr
        assert not ran.exists()
        refused.append(megabytes)
    assert ran.exists(), "gpuwait never ran its command"
    assert refused, "no limit let Python start but not gpuwait"


def no_memory_at(where: str) -> str:
    """`python -c` code of gpuwait (the console script) that finds no memory left when it
    calls `where` (in gpuwait.runner: `module.name`, or `module.Class.name`)."""
    module = where.split(".")[0]
    return textwrap.dedent(
        f"""
        from gpuwait.cli import entry_point
        from gpuwait.runner import {module}

        def no_memory_left(*args, **kwargs):
            raise MemoryError

        {where} = no_memory_left
        entry_point()
        """
    )


def test_a_run_whose_record_finds_no_memory_left_ends_with_its_commands_status(
    sim_file: SimFileFactory, tmp_path: Path
) -> None:
    # Out of memory only once its command had ended (the history's compaction under a
    # `ulimit -v` the command fitted in), gpuwait said that it ran out of memory and that a
    # command not yet started is not run, and exited 126: the command's own status was lost.
    sim_file(gpus=1)
    ran = tmp_path / "ran"
    patch = no_memory_at("session.save_record")
    done = subprocess.run(
        [sys.executable, "-c", patch, "--vram", "1G", "--", "sh", "-c", f"touch {ran}; exit 3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.exists()
    assert done.returncode == 3, done.stderr
    assert "could not record the run in the history: out of memory" in done.stderr, done.stderr
    assert "not run" not in done.stderr


#: gpuwait whose supervision of its command finds no memory left: at its first sample.
NO_MEMORY_WHILE_IT_RUNS = no_memory_at("supervise.UsageSampler.sample_if_due")


def test_gpuwait_out_of_memory_while_its_command_runs_waits_for_it_and_ends_with_its_status(
    sim_file: SimFileFactory, tmp_path: Path
) -> None:
    # It said it ran out of memory and exited 126 at once, its command left running unwaited
    # for: a script went on (or gave up) while the command still used the GPU.
    sim_file(gpus=1)
    ran = tmp_path / "ran"
    done = subprocess.run(
        [
            *(sys.executable, "-c", NO_MEMORY_WHILE_IT_RUNS, "--vram", "1G", "--"),
            *("sh", "-c", f"sleep 0.3; touch {ran}; exit 3"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.exists(), "gpuwait ended before its command"
    assert done.returncode == 3, done.stderr
    assert "ran out of memory" in done.stderr and "Traceback" not in done.stderr


def test_gpuwait_out_of_memory_still_passes_a_signal_on_to_its_command(
    sim_file: SimFileFactory, tmp_path: Path
) -> None:
    sim_file(gpus=1)
    err = tmp_path / "err"
    with err.open("w") as stderr:
        launch = subprocess.Popen(
            [sys.executable, "-c", NO_MEMORY_WHILE_IT_RUNS, "--vram", "1G", "--", "sleep", "30"],
            stderr=stderr,
            start_new_session=True,
        )
    try:
        wait_for(lambda: "ran out of memory" in err.read_text(), timeout=30)
        launch.send_signal(signal.SIGTERM)  # to gpuwait alone, as `kill PID` sends it
        assert launch.wait(timeout=10) == -signal.SIGTERM  # its command ended by it, so it
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launch.pid, signal.SIGKILL)  # the command too, should the test fail
        launch.wait()
