"""Ledger entries for tests: jobs of live processes, which every ledger transaction keeps; and
ledgers damaged as another process would damage them."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuwait.linux import proc
from gpuwait.linux.lock import exclusive
from gpuwait.queue.entries import Job


def live_job(job_id: str, pid: int | None = None, **fields: Any) -> Job:
    """An entry for `pid` (this process by default) with its real start time and uid."""
    pid = os.getpid() if pid is None else pid
    values: dict[str, Any] = {
        "id": job_id,
        "pid": pid,
        "start_time": proc.start_time(pid) or 0,
        "uid": os.getuid(),
        "command": ["x"],
        "cwd": "/",
        "request": {"bytes": 1},
    }
    values.update(fields)
    return Job(**values)


#: A ledger cut short in the middle of an entry.
TRUNCATED_LEDGER = b'{"schema": 1, "jobs": [{"id": "a", "pid"'


def replace_ledger(path: Path, content: bytes) -> None:
    """Replace the ledger file at `path` with `content`, as another process would: by rename."""
    temp = path.with_name(f"{path.name}.tmp-test")
    temp.write_bytes(content)
    os.replace(temp, path)


def damage_ledger(path: Path, damage: Callable[[bytes], bytes]) -> None:
    """Replace the ledger file at `path` by rename with `damage` of what it holds, between two
    transactions (its lock held meanwhile): one in flight, having read the file before, would
    write its own over the damage, which nobody would ever see."""
    with exclusive(path.with_name("ledger.lock")):
        replace_ledger(path, damage(path.read_bytes()))
