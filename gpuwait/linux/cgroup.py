"""This process's cgroups, as /proc and the mounted hierarchies show them: where cgroup v2 is
mounted, which cgroup the process is in, and how many CPUs its CPU quota lets it use.

A container run with `--cpus 2`, or a Kubernetes pod with a CPU limit, may run on every core
of the machine (its affinity names them all) yet get two CPUs' time in every period: the
kernel throttles it beyond (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`,
in its own cgroup or in one above it).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from gpuwait.core.text import whole_number
from gpuwait.linux.security import read_state_file

CGROUP_ROOTS = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")
#: Where the v1 cpu controller is mounted (alone, or with cpuacct).
CPU_ROOTS = ("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct")
PROC_CGROUP = "/proc/self/cgroup"
_SMALL = 1 << 16


def read(path: str) -> str | None:
    """A small cgroup (or /proc) file's text; None where it cannot be read."""
    try:
        raw = read_state_file(path, _SMALL, None)
    except OSError:
        return None
    return None if raw is None else raw.decode("utf-8", "replace")


def unified_root(roots: Sequence[str] = CGROUP_ROOTS) -> str | None:
    """Where the cgroup v2 hierarchy is mounted (alone, or beside v1 in a hybrid layout)."""
    for root in roots:
        if os.path.exists(os.path.join(root, "cgroup.controllers")):
            return root
    return None


def memberships(proc_cgroup: str = PROC_CGROUP) -> list[tuple[str, list[str], str]]:
    """This process's cgroups, one a hierarchy, as /proc/self/cgroup lists them: (hierarchy
    number, controllers, path). Cgroup v2's is hierarchy 0, with no controllers named."""
    found = []
    for line in (read(proc_cgroup) or "").splitlines():
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        found.append((number, [c for c in controllers.split(",") if c], path))
    return found


def own_cgroup(proc_cgroup: str = PROC_CGROUP) -> str | None:
    """This process's cgroup v2 path ("/user.slice/..."), from the "0::" line."""
    for number, controllers, path in memberships(proc_cgroup):
        if number == "0" and not controllers:
            return path.strip() or "/"
    return None


def cpu_limit(
    roots: Sequence[str] = CGROUP_ROOTS,
    cpu_roots: Sequence[str] = CPU_ROOTS,
    proc_cgroup: str = PROC_CGROUP,
) -> float | None:
    """How many CPUs' time this process may have at most, by the CPU quota of its cgroup or
    of one above it (quota / period, the smallest on the way up); None where none is set or
    none can be read."""
    limits: list[float] = []
    for number, controllers, path in memberships(proc_cgroup):
        if number == "0" and not controllers:
            root = unified_root(roots)
            if root is not None:
                limits += _up(root, path, _quota_v2)
        elif "cpu" in controllers:
            root = next(
                (r for r in cpu_roots if os.path.exists(os.path.join(r, "cpu.cfs_quota_us"))),
                None,
            )
            if root is not None:
                limits += _up(root, path, _quota_v1)
    return min(limits) if limits else None


def _up(root: str, path: str, quota: Callable[[str], float | None]) -> list[float]:
    """The quotas of the cgroup at `path` under `root` and of every one above it there (in a
    cgroup namespace, a container's own cgroup is the root)."""
    found = []
    parts = [p for p in path.strip().split("/") if p]
    while True:
        directory = os.path.join(root, *parts)
        if os.path.isdir(directory):
            limit = quota(directory)
            if limit is not None:
                found.append(limit)
        if not parts:
            return found
        parts.pop()


def _quota_v2(directory: str) -> float | None:
    fields = (read(os.path.join(directory, "cpu.max")) or "").split()
    return _ratio(fields[0], fields[1]) if len(fields) == 2 else None


def _quota_v1(directory: str) -> float | None:
    quota = (read(os.path.join(directory, "cpu.cfs_quota_us")) or "").strip()
    period = (read(os.path.join(directory, "cpu.cfs_period_us")) or "").strip()
    return _ratio(quota, period)


def _ratio(quota: str, period: str) -> float | None:
    """quota / period, where both are counts of microseconds ("max", "-1": no quota)."""
    microseconds, every = whole_number(quota), whole_number(period)
    if microseconds is None or not every:
        return None
    return microseconds / every
