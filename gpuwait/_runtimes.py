"""Expected run times of commands: the one place gpuwait asks for them.

Backfill (a job may start on a GPU held for the queue's head only if it is expected to end
before the head can start), the ETAs of `gpuwait status` and the adaptive-throughput strategy
all read run times through `RunTimeEstimates`. The history-based estimator plugs in at
`run_time_estimates`; until one answers, every run time is unknown (None), and gpuwait then
never backfills onto a held GPU, shows no ETA, and adaptive-throughput falls back to best-fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol


class RunTimeEstimates(Protocol):
    def expected_seconds(
        self, command: Sequence[str], cwd: str, gpu_uuid: str | None = None
    ) -> float | None:
        """Expected run time of `command` started in `cwd` (on that GPU, if given); None: unknown."""
        ...


class NoEstimates:
    """Knows nothing: every run time is unknown."""

    def expected_seconds(
        self, command: Sequence[str], cwd: str, gpu_uuid: str | None = None
    ) -> float | None:
        return None


def run_time_estimates(state_dir: Path) -> RunTimeEstimates:
    """The estimates for jobs of this state dir (its history)."""
    return NoEstimates()
