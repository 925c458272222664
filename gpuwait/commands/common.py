"""What several commands build from the settings, as the layers below take it."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuwait import config
from gpuwait.commands import output
from gpuwait.core.errors import StateError
from gpuwait.core.text import shell_word
from gpuwait.linux import proc
from gpuwait.linux.security import UnsafePath, taken_over_hint

if TYPE_CHECKING:
    from gpuwait.queue.ledger import Ledger


def load_settings(cli: Mapping[str, Any]) -> config.Settings:
    """The effective settings (gpuwait.config.load_settings), with what they say of the files
    they come from (a site setting this gpuwait does not know) said on stderr."""
    settings = config.load_settings(cli)
    for note in settings.notes:
        output.warn(note)
    return settings


def ledger_for(settings: config.Settings) -> Ledger:
    """The ledger the settings name: `ledger_dir` when set (it must exist), else the state dir."""
    from gpuwait.queue.ledger import Ledger  # the shell hook's bare runs never need it

    return Ledger(
        settings.ledger_path,
        must_exist=settings.ledger_dir is not None,
        lock_timeout=settings.lock_timeout,
        on_slow_lock=output.warn,
        fair_half_life=settings.fair_share_half_life,
    )


def unreadable(what: str, path: Path, exc: OSError) -> StateError:
    """`WHAT cannot be read` (exit 5) for the history or the event log at `path` that `exc`
    kept from being read, with what to do about it."""
    where = Path(exc.filename) if exc.filename else path
    hint: str | None = None
    if isinstance(exc, UnsafePath) and _someone_elses_file(where):
        # `sudo gpuwait ...` with this user's HOME: the runs in it are still this user's.
        hint = f"make it yours again: sudo chown {proc.user_name(os.getuid())} {shell_word(where)}"
    elif isinstance(exc, UnsafePath):  # a directory, a link
        hint = f"move it out of the way: mv {shell_word(where)} {shell_word(f'{where}.old')}"
    elif exc.errno in (errno.EACCES, errno.EPERM):
        hint = taken_over_hint(where) or f"make it readable to you: chmod u+rw {shell_word(where)}"
    elif exc.errno in (errno.ENOTDIR, errno.ELOOP):
        hint = "set GPUWAIT_STATE_DIR to a safe, writable directory"
    return StateError(f"{what} cannot be read: {exc.strerror or exc}", hint=hint)


def _someone_elses_file(path: Path) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid != os.getuid()
