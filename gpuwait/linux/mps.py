"""Is a CUDA MPS control daemon serving this user? (docs/budgets.md, 'CUDA MPS')

A CUDA program connects to the MPS control daemon through `control` (a UNIX socket; a named
pipe in older releases) in the pipe directory (CUDA_MPS_PIPE_DIRECTORY, default
/tmp/nvidia-mps) and, when that works, runs as an MPS client, where
CUDA_MPS_PINNED_DEVICE_MEM_LIMIT bounds its device memory. The daemon writes its
pid to nvidia-cuda-mps-control.pid there. A pipe left behind by a daemon that is gone serves
nobody, so the pid must name a live nvidia-cuda-mps-control process too.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping

from gpuwait.core.snapshot import MPS_COMM
from gpuwait.linux import pidns, proc
from gpuwait.linux.security import read_state_file

DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"
PIPE_DIRECTORY_VAR = "CUDA_MPS_PIPE_DIRECTORY"


def pipe_directory(env: Mapping[str, str]) -> str:
    return env.get(PIPE_DIRECTORY_VAR) or DEFAULT_PIPE_DIRECTORY


def daemon_serves(env: Mapping[str, str]) -> bool:
    """A live MPS control daemon listens in this user's pipe directory, and this user may
    write to its control pipe (as CUDA itself must)."""
    directory = pipe_directory(env)
    control = os.path.join(directory, "control")
    try:
        st = os.stat(control)
    except OSError:
        return False
    if not (stat.S_ISSOCK(st.st_mode) or stat.S_ISFIFO(st.st_mode)):
        return False
    # This user's daemon, or root's: another user's runs MPS servers for that user alone, and
    # the default pipe directory, in /tmp, is anyone's to make.
    if st.st_uid not in (os.getuid(), 0) or not os.access(control, os.W_OK):
        return False
    try:
        # /tmp is anybody's: whatever lies there is read as a stranger's file (never waited on).
        raw = read_state_file(os.path.join(directory, "nvidia-cuda-mps-control.pid"), 64, None)
        pid = int((raw or b"0").strip() or b"0")
    except (OSError, ValueError):
        return False
    if pid <= 0:
        return False
    name = proc.command_name(pid)
    # The daemon made its socket: one someone else put there next to a real daemon's pid
    # serves nobody.
    if name is not None and name.startswith(MPS_COMM) and proc.owner_uid(pid) == st.st_uid:
        return True
    # In a container with pids of its own, the pid file names the daemon by the host's pid: no
    # process here, or another one. Its socket, the host's pipe directory mounted in, still
    # tells: a live daemon takes a connection, a socket left by one that is gone refuses it.
    return pidns.in_initial_namespace() is False and stat.S_ISSOCK(st.st_mode) and _accepts(control)


def _accepts(path: str) -> bool:
    """Does something listen on the UNIX socket at `path` (a connection, at once closed)?"""
    import socket  # only a container's limit mode asks

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            return False
    return True
