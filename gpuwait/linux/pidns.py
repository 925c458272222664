"""Whether the process ids the NVIDIA driver reports are this pid namespace's.

The driver knows no pid namespaces: NVML names every GPU process by its pid in the initial
namespace, the host's. Inside a container with a private pid namespace (docker without
`--pid=host`) those numbers name no process here, or another one. Pids are trusted as they
come in the initial namespace; elsewhere a pid counts as this namespace's only while a process
of that pid here has an NVIDIA device open, which every process using the GPU has.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

#: The initial pid namespace's inode, a constant of the kernel (PROC_PID_INIT_INO), and how
#: /proc names that namespace (readlink of /proc/self/ns/pid).
INITIAL_PID_NAMESPACE_INODE = 4026531836
INITIAL_PID_NAMESPACE = f"pid:[{INITIAL_PID_NAMESPACE_INODE}]"

#: Device files of the NVIDIA driver (nvidiactl, nvidia0, nvidia-uvm, ...).
NVIDIA_DEVICES = "/dev/nvidia"

_CURRENT: list[int | None] = []


def current() -> int | None:
    """This process's pid namespace, as the inode of /proc/self/ns/pid (None where /proc cannot
    tell). A process never changes its own: read once."""
    if not _CURRENT:
        try:
            _CURRENT.append(os.stat("/proc/self/ns/pid").st_ino)
        except OSError:
            _CURRENT.append(None)
    return _CURRENT[0]


def in_initial_namespace() -> bool | None:
    """Is this process in the host's pid namespace? None where /proc cannot tell."""
    here = current()
    return None if here is None else here == INITIAL_PID_NAMESPACE_INODE


def pid_within(pid: int, namespace: int) -> int | None:
    """What the pid namespace `namespace` calls process `pid` (of this namespace), when the
    process lives there: the last of its NSpid line. None for a process of another namespace,
    one gone, or one not ours to look at."""
    try:
        if os.stat(f"/proc/{pid}/ns/pid").st_ino != namespace:
            return None
        with open(f"/proc/{pid}/status", "rb") as f:
            status = f.read(1 << 16)
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith(b"NSpid:"):
            fields = line.split()[1:]
            return int(fields[-1]) if fields else None
    return None


def _has_nvidia_device(pid: int) -> bool | None:
    """Does process `pid` have an NVIDIA device open? None where it is not ours to look at."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except FileNotFoundError:
        return False
    except OSError:
        return None  # another user's process: no evidence either way
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(NVIDIA_DEVICES):
                return True
        except OSError:
            continue
    return False


def strangers(pids: Iterable[int]) -> list[int]:
    """The pids, as NVML reported them, that name no GPU process of this pid namespace: none
    here, or one without an NVIDIA device open. Asked only outside the initial namespace,
    where NVML's pids are never in doubt."""
    return [pid for pid in sorted(set(pids)) if _has_nvidia_device(pid) is False]
