"""Expected run times of commands: the one place gpuwait asks for them.

Backfill (a job may start on a GPU held for the queue's head only if it is expected to end
before the head can start), the ETAs of `gpuwait status` and the adaptive-throughput strategy
all read run times through `RunTimeEstimates`. The history-based estimator plugs in at
`run_time_estimates`: the median of the command's earlier successful runs (gpuwait._learn).
Where there is no history, a run time is unknown (None): gpuwait then never backfills that job
onto a held GPU and shows no ETA for what waits behind it. Per-GPU run times are not kept yet,
so adaptive-throughput falls back to best-fit.
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


class HistoryEstimates:
    """Run times learned from the history in one state dir."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        #: What reading the history had to say (damaged lines), for the CLI to show once.
        self.warnings: list[str] = []

    def expected_seconds(
        self, command: Sequence[str], cwd: str, gpu_uuid: str | None = None
    ) -> float | None:
        if gpu_uuid is not None:
            return None
        from gpuwait._learn import learn

        try:
            learned = learn(self.state_dir, command, cwd)
        except Exception:  # an unreadable history must not stop a launch
            return None
        self.warnings.extend(learned.warnings)
        return None if learned.run_time is None else learned.run_time.median


def run_time_estimates(state_dir: Path) -> HistoryEstimates:
    """The estimates for jobs of this state dir (its history)."""
    return HistoryEstimates(state_dir)
