"""The cgroup v2 device-memory controller, dmem (Linux 6.14+; docs/budgets.md, 'cgroup dmem').

The kernel lists the device memory regions it can account in `dmem.capacity` of the root
cgroup, one "NAME BYTES" line each, where the GPU's driver registers them. A child cgroup whose
`dmem.max` names a region and a size refuses its processes' allocations past that size.

gpuwait may use it only where it may make cgroups: a cgroup above its own that it can write
(root, or a subtree delegated to the user, e.g. by systemd), with dmem already enabled for its
children (`cgroup.subtree_control`). Nothing is changed in cgroups that are not gpuwait's own:
it adds `gpuwait-<job>` there, sets its dmem.max, moves only itself in for the moment it starts
the command (which is then born inside), and removes it after the job (or, where that gpuwait
was killed, the next job's gpuwait does, once it is empty). Every failure is a reason
not to use dmem, never a reason to fail the launch.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import time
from collections.abc import Mapping, Sequence

from gpuwait.core.record import Record
from gpuwait.core.text import whole_number
from gpuwait.linux.cgroup import CGROUP_ROOTS, own_cgroup, read, unified_root

NVIDIA_GPUS = "/proc/driver/nvidia/gpus"

#: A job's cgroup, as `create` is given its name (gpuwait-<job id>).
_JOB_CGROUP = re.compile(r"gpuwait-[0-9a-f]{1,64}")

#: How long ago a job's empty cgroup must have been made for another gpuwait to remove it, in
#: seconds: far longer than the moment between its making and its own gpuwait stepping in.
LEFT_AGE = 60.0


class Place(Record, frozen=True):
    """Where a job's dmem cgroup can go, and the region of each of its GPUs."""

    #: The cgroup (a directory) the job's cgroup is made in.
    parent: str
    #: GPU UUID -> dmem region name.
    regions: Mapping[str, str]
    #: gpuwait's own cgroup, to step back into once the command has started.
    home: str


def capacity(root: str) -> dict[str, int]:
    """{region: bytes} from the root cgroup's dmem.capacity; {} without the controller."""
    regions: dict[str, int] = {}
    for line in (read(os.path.join(root, "dmem.capacity")) or "").splitlines():
        name, _, size = line.strip().partition(" ")
        number = whole_number(size.strip())
        if name and number is not None:
            regions[name] = number
    return regions


def nvidia_pci_addresses(base: str = NVIDIA_GPUS) -> dict[str, str]:
    """GPU UUID -> PCI address ("0000:01:00.0"), from the NVIDIA driver's /proc files."""
    found: dict[str, str] = {}
    try:
        names = os.listdir(base)
    except OSError:
        return found
    for pci in names:
        for line in (read(os.path.join(base, pci, "information")) or "").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "GPU UUID" and value.strip():
                found[value.strip()] = pci.lower()
    return found


def region_of(regions: Mapping[str, int], pci: str) -> str | None:
    """The video-memory region a driver registered for the GPU at `pci` (drm/PCI/vram0 for TTM
    drivers; the NVIDIA driver's own name has the PCI address and 'vidmem')."""
    pci = pci.lower()
    for name in sorted(regions):
        parts = name.lower().split("/")
        if pci in parts and parts[-1].startswith(("vram", "vidmem")):
            return name
    return None


def find_parent(root: str, own: str) -> str | None:
    """The nearest cgroup at or above `own` that gpuwait may add a child to with dmem enabled:
    writable by this user, with dmem in its cgroup.subtree_control."""
    path = own.strip("/")
    while True:
        directory = os.path.join(root, path) if path else root
        controls = (read(os.path.join(directory, "cgroup.subtree_control")) or "").split()
        if (
            "dmem" in controls
            and os.access(directory, os.W_OK | os.X_OK)
            and os.access(os.path.join(directory, "cgroup.procs"), os.W_OK)
        ):
            return directory
        if not path:
            return None
        path = path.rpartition("/")[0]


def locate(
    gpu_uuids: Sequence[str],
    *,
    roots: Sequence[str] = CGROUP_ROOTS,
    proc_cgroup: str = "/proc/self/cgroup",
    nvidia_gpus: str = NVIDIA_GPUS,
) -> tuple[Place | None, str]:
    """Where the job's cgroup can go, or None and why not (one phrase)."""
    root = unified_root(roots)
    if root is None:
        return None, "no cgroup v2 hierarchy is mounted"
    regions = capacity(root)
    if not regions:
        return None, "no cgroup dmem controller with a GPU in it (Linux 6.14+, a driver for it)"
    addresses = nvidia_pci_addresses(nvidia_gpus)
    mapped: dict[str, str] = {}
    for uuid in gpu_uuids:
        pci = addresses.get(uuid)
        region = None if pci is None else region_of(regions, pci)
        if region is None:
            return None, "no cgroup dmem region for this GPU (a driver that registers one)"
        mapped[uuid] = region
    own = own_cgroup(proc_cgroup)
    if own is None:
        return None, "gpuwait is in no cgroup v2"
    parent = find_parent(root, own)
    if parent is None:
        return None, "no cgroup with dmem enabled for its children is yours to add to"
    home = os.path.join(root, own.strip("/")) if own.strip("/") else root
    return Place(parent=parent, regions=mapped, home=home), ""


def create(
    place: Place, name: str, limit_bytes: int, by_gpu: Mapping[str, int] | None = None
) -> str:
    """Make the job's cgroup with dmem.max = `limit_bytes` on each of its GPUs' regions (or
    what `by_gpu` says for a GPU); its path. Raises OSError (the caller then does without)."""
    limits: dict[str, int] = {}
    for uuid, region in place.regions.items():
        limit = (by_gpu or {}).get(uuid, limit_bytes)
        limits[region] = max(limits.get(region, 0), limit)
    path = os.path.join(place.parent, name)
    os.mkdir(path)
    try:
        for region in sorted(limits):
            _write(os.path.join(path, "dmem.max"), f"{region} {limits[region]}\n")
    except OSError:
        remove(path)
        raise
    return path


def remove_left(parent: str, older_than: float = LEFT_AGE) -> None:
    """Take away this user's job cgroups in `parent` left by a gpuwait that was killed (it
    removes its own after the job): those made longer than `older_than` seconds ago that hold
    no process (the kernel refuses to remove one that does)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    now, uid = time.time(), os.getuid()
    for name in names:
        if _JOB_CGROUP.fullmatch(name) is None:
            continue
        path = os.path.join(parent, name)
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == uid and now - st.st_mtime > older_than:
                os.rmdir(path)


def move(path: str, pid: int) -> None:
    """Move process `pid` (all its threads) into the cgroup at `path`."""
    _write(os.path.join(path, "cgroup.procs"), f"{pid}\n")


def remove(path: str) -> None:
    """Take the job's cgroup away once empty; one still busy (a stray child) is left."""
    with contextlib.suppress(OSError):
        os.rmdir(path)


def _write(path: str, text: str) -> None:
    # One write(2) per value: cgroup files take one value a write. O_APPEND for the same reason
    # on a plain file (a test's stand-in tree), where it adds a line as the kernel would.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
