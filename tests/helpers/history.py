"""History records for tests, as gpuwait writes them (gpuwait.history.record.build), with
plain defaults for what a test does not care about."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gpuwait.core.snapshot import GpuSnapshot
from gpuwait.history import record


def a_run(
    command: Sequence[str],
    cwd: str,
    started_at: float,
    *,
    job_id: str = "j",
    key: str | None = None,
    history_commands: str = "full",
    request: Mapping[str, float | int] | None = None,
    request_source: str | None = None,
    reserved_bytes: int = 0,
    gpus: Sequence[GpuSnapshot] = (),
    peak_by_gpu: Mapping[str, int] | None = None,
    run_seconds: float = 1.0,
    wait_seconds: float = 0.0,
    returncode: int = 0,
    **measured: Any,
) -> dict[str, Any]:
    """One run's record. `measured`: the rest of record.Measured (peak_approximate,
    time_to_peak, samples, free_at_peak_bytes, oom, oom_evidence, stderr_watched)."""
    figures: dict[str, Any] = {
        "peak_approximate": False,
        "time_to_peak": None,
        "samples": 3,
        "free_at_peak_bytes": {},
        "oom": False,
        "oom_evidence": None,
        "stderr_watched": "off",
        **measured,
    }
    return record.build(
        job_id=job_id,
        name=None,
        batch=None,
        command=command,
        cwd=cwd,
        key=key,
        history_commands=history_commands,
        request=request if request is not None else {},
        request_source=request_source or ("flag" if request else "default"),
        reserved_bytes=reserved_bytes,
        gpus=gpus,
        measured=record.Measured(
            peak_by_gpu=peak_by_gpu if peak_by_gpu is not None else {},
            run_seconds=run_seconds,
            returncode=returncode,
            **figures,
        ),
        wait_seconds=wait_seconds,
        started_at=started_at,
    )


def recorded_runs() -> list[dict[str, Any]]:
    """The records in this test's history.jsonl (the state dir the test's environment names)."""
    path = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
