"""What several commands build from the settings, as the layers below take it."""

from __future__ import annotations

from gpuwait.commands import output
from gpuwait.config import Settings
from gpuwait.queue.ledger import Ledger


def ledger_for(settings: Settings) -> Ledger:
    """The ledger the settings name: `ledger_dir` when set (it must exist), else the state dir."""
    return Ledger(
        settings.ledger_path,
        must_exist=settings.ledger_dir is not None,
        lock_timeout=settings.lock_timeout,
        on_slow_lock=output.warn,
    )
