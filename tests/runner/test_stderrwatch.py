"""Watching stderr for OOM messages must not change what the command's output looks like."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from helpers.fixtures_sim import SimFileFactory

from gpuwait.runner.stderrwatch import OOM_MARKERS, OomScanner


def last_record() -> dict[str, Any]:
    path = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "history.jsonl"
    return dict(json.loads(path.read_text().splitlines()[-1]))


def says_oom(text: bytes) -> bool:
    scanner = OomScanner()
    scanner.feed(text)
    return scanner.found


@pytest.mark.parametrize(
    "text",
    [
        b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        b"RuntimeError: CUDA error: out of memory\nCUDA_ERROR_OUT_OF_MEMORY",
        b"jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying",
        b"tensorflow ... OOM when allocating tensor with shape[4096,4096]",
        b"cupy.cuda.memory.OutOfMemoryError: Out of memory allocating 1,024 bytes",
        b"RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate",
    ],
)
def test_oom_messages_of_the_usual_frameworks(text: bytes) -> None:
    assert says_oom(text)


def test_ordinary_failures_are_not_oom() -> None:
    assert not says_oom(b"Traceback ...\nValueError: bad config\nKilled: out of host memory?")
    assert not says_oom(b"gpuwait: the command ran out of GPU memory; retrying with 3.0 GiB")


def test_a_marker_split_between_two_reads_is_found() -> None:
    marker = OOM_MARKERS[0]
    for cut in range(1, len(marker)):
        scanner = OomScanner()
        scanner.feed(b"x" * 5000 + marker[:cut].upper())
        assert not scanner.found
        scanner.feed(marker[cut:] + b" more")
        assert scanner.found


def test_an_oom_message_split_between_reads_says_what_it_needed() -> None:
    said = (
        b"Traceback ...\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 15.00 "
        b"GiB. GPU 0 has a total capacity of 24.00 GiB of which 8.00 GiB is free. Including "
        b"non-PyTorch memory, this process has 15.00 GiB memory in use.\n"
    )
    for cut in (10, 45, 80, 160):
        scanner = OomScanner()
        scanner.feed(b"x" * 5000 + said[:cut])
        scanner.feed(said[cut:])
        assert scanner.wanted_bytes == 30 * 2**30, cut


INTERLEAVED = textwrap.dedent(
    """
    import os, sys
    for i in range(200):
        os.write(1, b"out %d\\n" % i)
        os.write(2, b"err %d\\n" % i)
    os.write(2, bytes(range(256)) * 40 + b"no newline at the end")
    """
)


def test_stdout_and_stderr_on_one_pipe_keep_their_order(
    sim_file: SimFileFactory, gpuwait_cmd: list[str]
) -> None:
    sim_file(gpus=1, memory="24GiB")
    command = [sys.executable, "-c", INTERLEAVED]
    bare = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)
    wrapped = subprocess.run(
        [*gpuwait_cmd, "-q", "--vram", "1G", "--", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=60,
    )
    assert wrapped.returncode == 0
    assert wrapped.stdout == bare.stdout
    assert last_record()["stderr_watched"] == "pipe"


def test_stderr_bytes_pass_unchanged(sim_file: SimFileFactory, gpuwait_cmd: list[str]) -> None:
    sim_file(gpus=1, memory="24GiB")
    code = "import os\nfor _ in range(64): os.write(2, bytes(range(256)) * 256)\n"
    done = subprocess.run(
        [*gpuwait_cmd, "-q", "--vram", "1G", "--", sys.executable, "-c", code],
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 0 and done.stdout == b""
    assert done.stderr == bytes(range(256)) * 256 * 64


def test_output_of_a_process_left_behind_is_not_lost(
    sim_file: SimFileFactory, gpuwait_cmd: list[str]
) -> None:
    sim_file(gpus=1, memory="24GiB")
    script = "echo early >&2; (sleep 1; echo late >&2) & exit 0"
    done = subprocess.run(
        [*gpuwait_cmd, "--vram", "1G", "--", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0
    assert done.stderr == "early\nlate\n"


def test_a_terminal_is_left_alone(sim_file: SimFileFactory, gpuwait_cmd: list[str]) -> None:
    pexpect = pytest.importorskip("pexpect")
    sim_file(gpus=1, memory="24GiB")
    probe = "import os, sys; print('tty' if os.isatty(2) else 'not a tty')"
    child = pexpect.spawn(
        gpuwait_cmd[0],
        [*gpuwait_cmd[1:], "--vram", "1G", "--", sys.executable, "-c", probe],
        env=dict(os.environ),
        timeout=30,
    )
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    assert child.before.decode().strip() == "tty"
    assert last_record()["stderr_watched"] == "off"


def test_watching_can_be_switched_off(sim_file: SimFileFactory, gpuwait_cmd: list[str]) -> None:
    sim_file(gpus=1, memory="24GiB")
    done = subprocess.run(
        [*gpuwait_cmd, "--vram", "1G", "--", "sh", "-c", "echo CUDA out of memory >&2; exit 1"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "GPUWAIT_WATCH_STDERR": "off"},
    )
    assert done.returncode == 1 and done.stderr == "CUDA out of memory\n"
    record = last_record()
    assert record["stderr_watched"] == "off" and record["oom"] is False


WATCHER = textwrap.dedent(
    """
    import os, sys, threading
    from gpuwait.linux import signals
    from gpuwait.runner.launch import spawn
    from gpuwait.runner.stderrwatch import StderrWatch
    signals.block_handled()  # as gpuwait runs
    busy = threading.Event()
    if sys.argv[1] == "thread":  # e.g. an NVML reading still under way
        threading.Thread(target=busy.wait, daemon=True).start()
    watch = StderrWatch()
    script = "echo before >&2; echo 'CUDA out of memory' >&2; echo after >&2"
    child = spawn(["sh", "-c", script], dict(os.environ), watch.file_actions())
    watch.started()
    os.waitpid(child, 0)
    print(watch.mode, watch.finish())
    """
)


@pytest.mark.parametrize("threads", ["thread", "alone"])
def test_the_relay_passes_output_on_and_finds_an_oom_whether_or_not_threads_run(
    threads: str,
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", WATCHER, threads], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "pipe True\n"
    assert done.stderr == "before\nCUDA out of memory\nafter\n"


READS_A_NUMBER = (
    "import os\n"
    "device_ids = os.environ['CUDA_VISIBLE_DEVICES'].split(',')\n"
    "physical_device_id = int(device_ids[0])\n"
)


@pytest.mark.parametrize("where", ["pipe", "file"])
def test_a_program_that_reads_gpu_numbers_is_told_the_setting(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], tmp_path: Path, where: str
) -> None:
    # vLLM's int() of a CUDA_VISIBLE_DEVICES entry: the crash names a UUID, and the user is told
    # how to give such a program numbers.
    sim_file(gpus=1)
    log = tmp_path / "err.log"
    with open(log, "w") as err:
        done = subprocess.run(
            [*gpuwait_cmd, "--vram", "1G", "--", sys.executable, "-c", READS_A_NUMBER],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if where == "pipe" else err,
            text=True,
            timeout=60,
        )
    said = done.stderr if where == "pipe" else log.read_text()
    assert done.returncode == 1
    assert "invalid literal for int() with base 10: 'GPU-" in said
    assert "visible_devices = index" in said.splitlines()[-1]


#: Once nobody reads its stderr any more (it polls the pipe for the error a pipe whose reader
#: is gone shows, for 5 s at most), says a last word there, as the default SIGPIPE has it.
LAST_WORD_AFTER_THE_READER_LEFT = textwrap.dedent(
    """
    import os, select, signal
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    poller = select.poll()
    poller.register(2, 0)
    poller.poll(5000)
    os.write(2, b"done\\n")
    """
)


def test_a_command_whose_stderr_reader_has_gone_dies_of_sigpipe_at_its_next_write_as_bare(
    sim_file: SimFileFactory, gpuwait_cmd: list[str]
) -> None:
    """`gpuwait ... 2>&1 | head`: once the reader has gone, the command's next write breaks
    its pipe as it would bare (SIGPIPE, 141 in a pipeline's status), rather than land in the
    relay's pipe and pass for written."""
    sim_file(gpus=1, memory="24GiB")
    command = [sys.executable, "-c", LAST_WORD_AFTER_THE_READER_LEFT]
    script = '"$@" 2>&1 | true; echo "${PIPESTATUS[0]}"'
    for argv in (command, [*gpuwait_cmd, "-q", "--vram", "1G", "--", *command]):
        done = subprocess.run(
            ["bash", "-c", script, "bash", *argv], capture_output=True, text=True, timeout=60
        )
        assert done.stdout == "141\n", (argv, done.stderr)


def test_what_a_program_needed_is_what_the_out_of_memory_that_ended_it_said() -> None:
    # A program that caught an out-of-memory failure and went on (a server refusing one huge
    # request, a batch size halved) ran out later for good: what it needed is what the last
    # message said, not the first.
    caught = (
        b"request refused: CUDA out of memory. Tried to allocate 300.00 GiB. Including "
        b"non-PyTorch memory, this process has 2.00 GiB memory in use.\n"
    )
    ended = (
        b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB. Including "
        b"non-PyTorch memory, this process has 7.00 GiB memory in use.\n"
    )
    for pieces in ([caught + b"serving\n" * 10 + ended], [caught, b"serving\n" * 10, ended]):
        scanner = OomScanner()
        for piece in pieces:
            scanner.feed(piece)
        assert scanner.wanted_bytes == 8 * 2**30
    # A last message that says no size leaves the one before that did.
    scanner = OomScanner()
    scanner.feed(ended + b"x" * 3000 + b"RuntimeError: CUDA error: out of memory\n")
    assert scanner.wanted_bytes == 8 * 2**30
