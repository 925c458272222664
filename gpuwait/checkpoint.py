"""The application side of gpuwait's cooperative pausing protocol.

A job started with `gpuwait --pausable` may be asked to step aside for more urgent work. gpuwait
then sends it the checkpoint signal (GPUWAIT_CHECKPOINT_SIGNAL, USR1 by default). The job saves a
checkpoint at its next convenient point and exits with the resume status
(GPUWAIT_RESUME_EXIT, 75 by default); gpuwait queues it again and re-runs the same command line,
with GPUWAIT_RESUME_COUNT raised by one, so it resumes from its checkpoint.

    from gpuwait import checkpoint

    checkpoint.install()
    for step in range(start, steps):
        train_one_step()
        if checkpoint.requested():
            save(step)
            checkpoint.exit_for_resume()

Importing this module is cheap (standard library only). Without gpuwait, or when the job was not
started with `--pausable`, `install()` does nothing and `requested()` stays False.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import NoReturn

# DEFAULT_RESUME_EXIT: the exit status that means "checkpointed, resume me" unless gpuwait says
# otherwise. Re-exported: applications may read it from here.
from gpuwait.core.pausing import DEFAULT_CHECKPOINT_SIGNAL
from gpuwait.core.pausing import DEFAULT_RESUME_EXIT as DEFAULT_RESUME_EXIT

_requested = False
_installed: int | None = None


def is_pausable() -> bool:
    """True when this process runs under `gpuwait --pausable`, while that job lasts. A process
    that outlived it (a server it started, a tmux session opened in it) keeps its variables,
    but nothing would resume it once it stepped aside: its gpuwait, GPUWAIT_JOB_PID, is gone,
    or that pid is another process's (one that did not start at GPUWAIT_JOB_START)."""
    return os.environ.get("GPUWAIT_PAUSABLE") == "1" and not _job_ended()


def _job_ended() -> bool:
    """Has the job named by GPUWAIT_JOB_PID and GPUWAIT_JOB_START ended, as the shell hook
    tells it, with no gpuwait left above this process? False where they name none (set by
    hand, or by a gpuwait from before them). A gpuwait from before them, started in a process
    that outlived a job (a tmux session opened in it), passes that job's on beside what it sets
    itself: while a gpuwait this process runs under lasts, its job has not ended."""
    return _named_job_ended() and not _under_gpuwait()


def _named_job_ended() -> bool:
    pid = os.environ.get("GPUWAIT_JOB_PID", "")
    if not (pid.isascii() and pid.isdigit()):
        return False
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    started = os.environ.get("GPUWAIT_JOB_START")
    if not started:
        return False
    # Field 22, the start time; the name before it, in parentheses, may hold anything.
    fields = stat.rpartition(b")")[2].split()
    return len(fields) < 20 or fields[19] != started.encode()


def _under_gpuwait() -> bool:
    """Does the gpuwait that started the job GPUWAIT_JOB_ID names still run above this
    process? The nearest process above it that was not started in that job started it: a
    gpuwait, where the job runs; where this process outlived the job, what took it in (init,
    the user's service manager)."""
    job = os.environ.get("GPUWAIT_JOB_ID", "")
    if not job:
        return False
    pid = os.getppid()
    for _ in range(1024):  # more than any chain of processes; a bound costs nothing
        if pid <= 1:
            return False
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read().split(b"\0")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read(1 << 16).split(b"\0")
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            return False
        if f"GPUWAIT_JOB_ID={job}".encode() not in environ:
            # `gpuwait ...`, `python -m gpuwait ...`
            return any(b"gpuwait" in os.path.basename(arg) for arg in argv[:4])
        # Field 4, the parent's pid, after the name in parentheses.
        fields = stat.rpartition(b")")[2].split()
        pid = int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else 0
    return False


def checkpoint_signal() -> int | None:
    """The signal gpuwait sends to ask for a checkpoint, or None when not pausable."""
    if not is_pausable():
        return None
    # The same parsing as gpuwait's own (standard library only, so this import stays cheap).
    from gpuwait.linux.checkpoint_signal import parse_signal

    try:
        return parse_signal(os.environ.get("GPUWAIT_CHECKPOINT_SIGNAL", DEFAULT_CHECKPOINT_SIGNAL))
    except ValueError:
        return None


def resume_exit_status() -> int:
    """The exit status that tells gpuwait to resume this job later."""
    try:
        return int(os.environ.get("GPUWAIT_RESUME_EXIT", DEFAULT_RESUME_EXIT))
    except ValueError:
        return DEFAULT_RESUME_EXIT


def resume_count() -> int:
    """How many times this job was paused and started again (0 on the first run)."""
    try:
        return max(0, int(os.environ.get("GPUWAIT_RESUME_COUNT", "0")))
    except ValueError:
        return 0


def _on_signal(signum: int, frame: FrameType | None) -> None:
    global _requested
    _requested = True


def install(callback: Callable[[], None] | None = None) -> bool:
    """Start listening for the checkpoint signal; returns False when not under --pausable.

    `callback`, if given, is called from the signal handler (keep it tiny: set a flag).
    """
    global _installed
    signum = checkpoint_signal()
    if signum is None:
        return False

    def handler(received: int, frame: FrameType | None) -> None:
        _on_signal(received, frame)
        if callback is not None:
            callback()

    signal.signal(signum, handler)
    _installed = signum
    return True


def requested() -> bool:
    """True once gpuwait has asked this job to checkpoint and step aside."""
    return _requested


def exit_for_resume() -> NoReturn:
    """Exit with the resume status, after the checkpoint is safely saved.

    From the main thread as sys.exit does (its `finally` blocks and atexit handlers run);
    from another thread (a loop run in a worker thread), where SystemExit would end that thread
    alone and leave the job running on its memory, the process ends there and then."""
    sys.stdout.flush()
    sys.stderr.flush()
    import threading  # here: importing this module stays cheap

    status = resume_exit_status()
    if threading.current_thread() is not threading.main_thread():
        os._exit(status)
    raise SystemExit(status)
