"""`lock_within`'s waiting loop against a tick of its own timer that lands as the lock comes."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from gpuwait.linux.lock import lock_within


def test_a_tick_still_pending_when_the_wait_ends_is_not_raised_to_the_caller(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The interval timer can fire just as the lock is granted, and Python runs a handler only
    at the next point that looks for signals: that can be the call that puts the caller's
    SIGALRM handler back (`signal.signal` looks first). The lock is held by then, so the tick
    has nothing left to interrupt; raised, it would fail a transaction that had its lock (seen
    once in CI, in a test of sixty processes writing one ledger). Here the tick is made to be
    pending exactly there."""
    real = signal.signal
    calls: list[Any] = []

    def put_back_late(signum: int, handler: Any) -> Any:
        calls.append(handler)
        if len(calls) == 2:
            # The wait is over and its handler is being replaced: the tick arrives now.
            os.kill(os.getpid(), signal.SIGALRM)
        return real(signum, handler)

    def take(block: bool) -> None:
        if not block:
            raise BlockingIOError  # held: the caller waits, under its timer
        # blocking: granted at once

    before = signal.getsignal(signal.SIGALRM)
    monkeypatch.setattr(signal, "signal", put_back_late)
    lock_within(take, timeout=5.0)
    monkeypatch.undo()
    assert len(calls) >= 2
    assert signal.getsignal(signal.SIGALRM) == before
