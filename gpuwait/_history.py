"""The run history: one JSON line per finished run, appended to history.jsonl in the state dir."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from gpuwait._atomic import ensure_private_dir, open_private_append

SCHEMA = 1
FILENAME = "history.jsonl"


def history_path(state_dir: Path) -> Path:
    return state_dir / FILENAME


def append_record(state_dir: Path, record: dict[str, Any]) -> None:
    """Append one record as a single write, so concurrent writers never interleave lines."""
    ensure_private_dir(state_dir)
    line = json.dumps({"schema": SCHEMA, **record}, separators=(",", ":"), sort_keys=True) + "\n"
    fd = open_private_append(history_path(state_dir))
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
