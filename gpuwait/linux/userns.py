"""Which user of the machine a uid is, told across user namespaces.

A rootless container (podman's default, rootless docker) runs its user as uid 0 of a user
namespace whose 0 is, outside, the uid of the user who started it; the state directory it
shares with the host is that user's. /proc shows every process's owner as the reader's user
namespace maps it: the host sees the container's processes as the user's, and the container
sees the user's processes on the host as its root. Entries written on either side name the
same user by two numbers, and taken at their word each side's processes look another user's.

A uid is told as the machine knows it by this process's own map (/proc/self/uid_map: each
line maps a range of this namespace's uids onto the parent's), one level up: the machine's,
for a container on a host. In the machine's own namespace the map is the identity.
"""

from __future__ import annotations

_MAP: list[list[tuple[int, int, int]]] = []


def _uid_map() -> list[tuple[int, int, int]]:
    """(first uid here, first uid outside, count) for each range; read once. Empty where /proc
    cannot tell: every uid is then taken as it is."""
    if not _MAP:
        ranges: list[tuple[int, int, int]] = []
        try:
            with open("/proc/self/uid_map", "rb") as f:
                for line in f.read(1 << 16).split(b"\n"):
                    fields = line.split()
                    if len(fields) == 3:
                        inside, outside, count = (int(x) for x in fields)
                        ranges.append((inside, outside, count))
        except (OSError, ValueError):
            ranges = []
        _MAP.append(ranges)
    return _MAP[0]


def outer(uid: int) -> int | None:
    """`uid` (of this user namespace) as the parent namespace knows it; None for one this
    namespace does not map (a process of a user unknown here shows as the overflow uid)."""
    ranges = _uid_map()
    if not ranges:
        return uid
    for inside, outside, count in ranges:
        if inside <= uid < inside + count:
            return outside + (uid - inside)
    return None


def known_as(uid: int, said_outer: int | None = None) -> int | None:
    """The uid the machine knows the user `uid` by: `said_outer` where the namespace that wrote
    `uid` said what it is outside, else `uid` as this namespace maps it (None: unmapped)."""
    return outer(uid) if said_outer is None else said_outer


def same_user(uid: int, other: int, other_outer: int | None = None) -> bool:
    """Are `uid` (as this namespace knows it) and `other` (as the namespace that wrote it knows
    it: `other_outer` where that namespace said what it is outside, else this one's) one user
    of the machine?"""
    if uid == other and other_outer is None:
        return True
    mine = outer(uid)
    theirs = known_as(other, other_outer)
    return mine is not None and mine == theirs
