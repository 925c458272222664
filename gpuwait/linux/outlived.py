"""Whether a process outlived the gpuwait job its variables name: the one rule of the shell
hooks (a command of a shell that outlived its job is a job of its own) and of gpuwait.checkpoint
(a program that outlived its job is no longer pausable). contrib/docker/gpuwait-docker-run says
the same in sh. Read inside every training program that imports gpuwait.checkpoint: the
standard library and gpuwait.linux.proc only, so that import stays cheap."""

from __future__ import annotations

import os
from collections.abc import Mapping

from gpuwait.linux import proc

#: Names the job in its command's environment (and in that of every process it starts).
JOB_ID_VARIABLE = "GPUWAIT_JOB_ID"
#: The process whose life is the job's (its gpuwait, or the one holding room for itself): a
#: process that outlives the job (a tmux server started inside it) keeps GPUWAIT_JOB_ID, and the
#: shell hooks tell by this one whether the job still runs.
JOB_PID_VARIABLE = "GPUWAIT_JOB_PID"
#: When that process started, as its /proc/PID/stat says: once the job has ended, its pid may
#: be given to another process (a shared server's pids come round again), which the hooks must
#: not take for the job.
JOB_START_VARIABLE = "GPUWAIT_JOB_START"


def job_ended(environ: Mapping[str, str], pid: int) -> bool:
    """Has the job `environ` names (GPUWAIT_JOB_PID gone, or that pid another process's now: its
    start is not GPUWAIT_JOB_START) ended, with no gpuwait of it left above process `pid`? A
    process that outlived its job keeps its variables. False where they name none (set by hand,
    or by a gpuwait from before them). A gpuwait from before GPUWAIT_JOB_PID or
    GPUWAIT_JOB_START, started in a process that outlived a job (a tmux session opened in it),
    passes that job's on beside what it sets itself: while a gpuwait `pid` runs under lasts,
    its job has not ended."""
    return _named_job_ended(environ) and not _under_gpuwait(environ, pid)


def _named_job_ended(environ: Mapping[str, str]) -> bool:
    pid = environ.get(JOB_PID_VARIABLE, "")
    if not (pid.isascii() and pid.isdigit()):
        return False
    if len(pid.lstrip("0")) > 10:
        # More digits than any pid (pid_max is at most 2^22): no process's, as a gone one is;
        # int() of thousands of them would raise.
        return True
    started = environ.get(JOB_START_VARIABLE)
    if not started:  # given by a gpuwait from before GPUWAIT_JOB_START
        return not os.path.exists(f"/proc/{int(pid)}")
    return proc.start_field(int(pid)) != started


def _under_gpuwait(environ: Mapping[str, str], pid: int) -> bool:
    """Does the gpuwait that started the job GPUWAIT_JOB_ID names still run above process
    `pid`? The nearest process above it that was not started in that job started it: a
    gpuwait, where the job runs (in a container, its pid 1 too); where `pid` outlived the job,
    what took it in (init, the user's service manager). One whose environment cannot be read
    (another user's) is told by its command line."""
    job = environ.get(JOB_ID_VARIABLE, "")
    if not job:
        return False
    for _ in range(1024):  # more than any chain of processes; a bound costs nothing
        parent = proc.parent_pid(pid)
        if parent is None or parent <= 0:
            return False
        pid = parent
        if proc.environ_value(pid, JOB_ID_VARIABLE.encode()) != job:
            return looks_like_gpuwait(pid)
    return False


def looks_like_gpuwait(pid: int) -> bool:
    """True when the process's command line runs gpuwait (`gpuwait ...`, `python -m gpuwait`)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read(1 << 16).split(b"\0")
    except OSError:
        return False
    return any(b"gpuwait" in os.path.basename(arg) for arg in argv[:4])
