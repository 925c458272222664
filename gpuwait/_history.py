"""The run history: one JSON line per finished run, appended to history.jsonl in the state dir.

The history always stays in the user's own state dir, also when the ledger is a shared one.
Damage (a line cut short by a full disk or a crash, garbage, a line of another schema) is found
when the history is read, and at every append by a look at its tail: the damaged file is kept
beside it (history.jsonl.damaged-...), the good records are written back, and one warning says
so.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from gpuwait._atomic import append_whole, ensure_private_dir, open_private_append, write_atomic

SCHEMA = 1
FILENAME = "history.jsonl"
#: How much of the file's end an append looks at for damage.
_TAIL_BYTES = 64 << 10


def history_path(state_dir: Path) -> Path:
    return state_dir / FILENAME


def append_record(state_dir: Path, record: dict[str, Any]) -> list[str]:
    """Append one record as a single write, so concurrent writers never interleave lines.

    Returns warnings (a damaged history was repaired first). Raises OSError when the record
    cannot be written; then nothing of it is left in the file.
    """
    ensure_private_dir(state_dir)
    path = history_path(state_dir)
    warnings: list[str] = []
    if _tail_damaged(path):
        warnings += _repair(path)
    line = json.dumps({"schema": SCHEMA, **record}, separators=(",", ":"), sort_keys=True) + "\n"
    fd = open_private_append(path)
    try:
        append_whole(fd, line.encode())
    finally:
        os.close(fd)
    return warnings


def read_history(state_dir: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Every record, oldest first, and warnings. A damaged history is repaired on the way."""
    path = history_path(state_dir)
    raw = _read(path)
    if raw is None:
        return [], []
    records, bad = _parse(raw)
    if not bad:
        return records, []
    return records, _repair(path)


def _read(path: Path) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _valid(line: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if isinstance(value, dict) and value.get("schema") == SCHEMA:
        return value
    return None


def _parse(raw: bytes) -> tuple[list[dict[str, Any]], int]:
    """(good records, number of bad lines); a last line without its newline counts as bad."""
    lines = raw.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    records: list[dict[str, Any]] = []
    bad = 1 if tail else 0
    for line in lines:
        record = _valid(line)
        if record is None:
            bad += 1
        else:
            records.append(record)
    return records, bad


def _tail_damaged(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return False
        tail = os.pread(fd, _TAIL_BYTES, max(0, size - _TAIL_BYTES))
    finally:
        os.close(fd)
    if not tail.endswith(b"\n"):
        return True
    last = tail[:-1].rsplit(b"\n", 1)[-1]
    return _valid(last) is None


def _repair(path: Path) -> list[str]:
    """Keep the damaged file beside it and write back only its good records."""
    raw = _read(path)
    if raw is None:
        return []
    records, bad = _parse(raw)
    if not bad:
        return []
    kept = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
    write_atomic(kept, raw)
    good = b"".join(
        json.dumps(r, separators=(",", ":"), sort_keys=True).encode() + b"\n" for r in records
    )
    write_atomic(path, good)
    return [
        f"history {path} was damaged ({bad} bad line{'s' if bad != 1 else ''}); kept it as "
        f"{kept.name} and kept its {len(records)} good records"
    ]
