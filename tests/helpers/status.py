"""What `gpuwait status --json` shows, as a user's script reads it."""

from __future__ import annotations

import json
import subprocess
from typing import Any


def status_json(gpuwait_cmd: list[str]) -> dict[str, Any]:
    done = subprocess.run(
        [*gpuwait_cmd, "status", "--json"], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def listed_jobs(gpuwait_cmd: list[str]) -> list[dict[str, Any]]:
    return list(status_json(gpuwait_cmd)["jobs"])


def job_named(gpuwait_cmd: list[str], name: str) -> dict[str, Any] | None:
    return next((j for j in listed_jobs(gpuwait_cmd) if j["name"] == name), None)


def job_of_pid(gpuwait_cmd: list[str], pid: int) -> dict[str, Any] | None:
    return next((j for j in listed_jobs(gpuwait_cmd) if j["pid"] == pid), None)


def state_of(gpuwait_cmd: list[str], name: str) -> str | None:
    """The named job's state ("waiting", "running"), or None when it is not in the queue."""
    job = job_named(gpuwait_cmd, name)
    return None if job is None else str(job["state"])
