"""Whether a directory is on a file system that several machines share, and this machine's name.

A ledger is one machine's: its entries name this machine's processes (a pid means nothing on
another machine), its GPUs and their health. The default state directory is in the home
directory, and on clusters and in many labs the home directory is shared over the network by
every machine (NFS, Lustre, GPFS, ...). A ledger there would be read and written by gpuwait on
all of them, each taking the others' entries for those of dead processes and removing them:
a job's reservation could vanish before it has allocated. So where the state directory is on
such a file system, each machine keeps its ledger in a directory of its own under it,
`machines/<name>` (see `ledger_home`).

The type is read from the mount table (/proc/self/mountinfo), not asked of the file system
(Python has no statfs), so it costs one read of a small file, once per process and directory.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from gpuwait.linux.proc import read_at_most

#: The mount table of this process's mount namespace.
MOUNTINFO = "/proc/self/mountinfo"
#: File systems that several machines mount at once.
NETWORK_TYPES = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "ceph",
        "glusterfs",
        "lustre",
        "gpfs",
        "beegfs",
        "afs",
        "ocfs2",
        "gfs2",
        "panfs",
        "pvfs2",
        "orangefs",
        "wekafs",
        "fuse.sshfs",
        "fuse.glusterfs",
        "fuse.ceph",
        "fuse.cephfs",
        "fuse.juicefs",
        "fuse.beegfs",
    }
)
#: Where, under a shared state directory, each machine's ledger directory is.
MACHINES = "machines"
#: More than any real mount table; a larger one is not read (the answer is then "not shared").
_MAX_BYTES = 4 << 20
_OCTAL = re.compile(r"\\([0-7]{3})")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")

_known: dict[str, str | None] = {}


def _unescape(field: str) -> str:
    """A mount point as the kernel writes it: space, tab, newline and backslash as octal."""
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def filesystem_type(path: str, mountinfo: str) -> str | None:
    """The type of the file system holding `path` (absolute, links resolved), as the mount
    table `mountinfo` says; None when no mount holds it."""
    longest, found = -1, None
    for line in mountinfo.splitlines():
        left, dash, right = line.partition(" - ")
        fields = left.split(" ")
        if not dash or len(fields) < 5 or not right:
            continue
        point = _unescape(fields[4])
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        # `>=`: the table lists mounts in the order they were made, and one made later on the
        # same point hides the earlier.
        if inside and len(point) >= longest:
            longest, found = len(point), right.split(" ", 1)[0]
    return found


def network_type(path: Path) -> str | None:
    """The type of the network file system that holds `path`, several machines sharing it;
    None when it is local or that cannot be told."""
    key = str(path)
    if key not in _known:
        try:
            fd = os.open(MOUNTINFO, os.O_RDONLY | os.O_CLOEXEC)
            try:
                text = read_at_most(fd, _MAX_BYTES)
            finally:
                os.close(fd)
        except OSError:
            text = b""
        kind = None
        if len(text) <= _MAX_BYTES:
            # realpath resolves the links as far as the path exists (a state dir may not yet).
            kind = filesystem_type(os.path.realpath(path), text.decode("utf-8", "surrogateescape"))
        _known[key] = kind if kind in NETWORK_TYPES else None
    return _known[key]


def machine_name() -> str:
    """This machine's host name, as a file name (anything but letters, digits, `.`, `_` and
    `-` as `_`)."""
    name = _UNSAFE.sub("_", os.uname().nodename)
    return name if name.strip(".") else "localhost"


def ledger_home(state_dir: Path) -> Path:
    """Where this machine keeps its ledger when no `ledger_dir` is set: the state directory, or
    `machines/<host name>` under it where that is on a network file system."""
    if network_type(state_dir) is None:
        return state_dir
    return state_dir / MACHINES / machine_name()
