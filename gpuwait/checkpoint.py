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
    """Has the job its variables name ended, with no gpuwait of it left above this process?
    (gpuwait.linux.outlived: the shell hooks' rule too.)"""
    # Here: a program that imports this module outside a --pausable job never walks, and
    # loads nothing for it.
    from gpuwait.linux import outlived

    return outlived.job_ended(os.environ, os.getpid())


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
    """The exit status that tells gpuwait to resume this job later: GPUWAIT_RESUME_EXIT as
    gpuwait reads the `resume_exit` setting (1 to 125), else the default, 75."""
    # The same parsing as gpuwait's own: 999 would end the process with 231, and -1 with 255,
    # statuses gpuwait never takes for "resume me" (the job would be taken for failed).
    from gpuwait.core.sizes import parse_whole

    try:
        return parse_whole(os.environ.get("GPUWAIT_RESUME_EXIT", str(DEFAULT_RESUME_EXIT)), 1, 125)
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
