"""Whether a file changed since it was last looked at, told by its metadata alone: the test
that spares re-reading the ledger, the wake-up summaries, the simulation file and the site
config when nothing was written.

A file replaced by rename (every state file gpuwait writes) has a new inode; one written in
place (an editor's save, `echo >>`) a new size or modification time, and a new change time
even where it was written twice within one tick of the file system's clock, or its time was
set back (`touch -d`).

But a file replaced twice within one tick of a coarse file system clock (kernels before 6.13,
NFS and many others) can come back with the inode of the first (ext4 reuses a freed inode at
once), its size and its times: a stamp taken less than RACY_SECONDS after its file's last change
(`may_change_unseen`) does not tell a later change, and the content must.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, NamedTuple

#: Seconds after a file's change within which another change may fall in the same tick of the
#: file system's clock (a jiffy locally, up to a second or two on NFS and FAT).
RACY_SECONDS = 2


#: What tells one version of a file from another (see the module docstring). Its fields are
#: given as types, not as a class's annotations, which typing would compile (as
#: gpuwait.linux.lock's Patience).
FileStamp = NamedTuple(  # noqa: UP014
    "FileStamp", [("ino", int), ("size", int), ("mtime_ns", int), ("ctime_ns", int)]
)


def stamp_of(st: os.stat_result) -> FileStamp:
    """The stamp of the file `st` describes."""
    return FileStamp(st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def file_stamp(path: Path, *, follow: bool = True, owner: int | None = None) -> FileStamp | None:
    """The stamp of the file at `path` (a link there followed only with `follow`); None where
    there is none, or (with `owner`) where it is not that user's."""
    try:
        st = os.stat(path, follow_symlinks=follow)
    except OSError:
        return None
    if owner is not None and st.st_uid != owner:
        return None
    return stamp_of(st)


def may_change_unseen(stamp: FileStamp) -> bool:
    """Was `stamp` taken within RACY_SECONDS of its file's last change (or of a change time
    ahead of this clock), so that a change in the same tick could leave the same stamp?"""
    return stamp.ctime_ns >= time.time_ns() - RACY_SECONDS * 1_000_000_000


class NotTheirs:
    """The names in a directory found to be no file of the uid they name (another user made
    them), kept while the directory is as it was: a member may make thousands of such names,
    and each listing would otherwise look at every one of them again.

    Kept only from a listing begun once the directory had not changed for RACY_SECONDS, by
    its own clock and by this process's (which has seen the same stamp that long: a file
    server's clock behind this machine's makes a change look old at once, and a second change
    in the same tick of its clock leaves the same stamp): any later change (a name made,
    removed or renamed, as every user's gpuwait writes its files) then gives the directory
    another stamp, and every name is looked at afresh. While it has none, what the caller made
    of the whole listing (`keep`) holds too: the same names are there, each of the same file.
    A user's file is always made, replaced and removed so, and never hidden by what is kept.
    An administrator's chown of such a file to the uid it names changes no stamp of the
    directory: it is seen at its next change.
    """

    def __init__(self) -> None:
        self._stamp: FileStamp | None = None
        #: When (monotonic) this process first saw the directory with `_stamp`.
        self._seen_since = 0.0
        self._names: set[str] = set()
        self._keeping = False
        #: What the caller made of the whole listing (`keep`), while the directory is as it
        #: was when it was made: the same names are there, each of the same file.
        self.listed: Any = None

    def begin(self, directory: Path) -> None:
        """Before a listing of `directory`: what is kept holds if it has not changed since."""
        stamp = file_stamp(directory)
        if stamp is None or may_change_unseen(stamp):
            # It may change within its clock's tick unseen: nothing kept, nor kept from now.
            self._stamp, self._names, self._keeping, self.listed = None, set(), False, None
            return
        now = time.monotonic()
        if stamp != self._stamp:
            self._stamp, self._seen_since, self._names, self.listed = stamp, now, set(), None
        self._keeping = now - self._seen_since >= RACY_SECONDS
        if not self._keeping:
            self._names, self.listed = set(), None

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def add(self, name: str) -> None:
        if self._keeping:
            self._names.add(name)

    def keep(self, listed: Any) -> None:
        """What the listing begun last came to, for `listed` until the directory changes."""
        if self._keeping:
            self.listed = listed
