"""What several commands build from the settings, as the layers below take it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gpuwait import config
from gpuwait.commands import output

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
