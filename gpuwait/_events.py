"""The event log: one JSON line per thing that happened to the queue, in events.jsonl.

Kinds: admit, start, finish, leave (gave up or interrupted while waiting), cancel, reap (an
entry whose process was gone), gpu_lost, gpu_back, gpu_added. Each line carries `schema`,
`time` (Unix seconds), `kind`, and the kind's fields (`job`, `gpus`, ...).

Lines are appended with one write each (O_APPEND), so concurrent writers never interleave. When
the file passes `MAX_BYTES` it is renamed to events.jsonl.1 (the older .1 to .2, and so on up to
`KEEP` files) under a lock, and a fresh file starts. Writing an event never fails a job: errors
are swallowed, the log is a record, not a source of truth.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpuwait._atomic import ensure_private_dir, open_private_append
from gpuwait._lock import exclusive
from gpuwait._security import is_shared_dir

SCHEMA = 1
FILENAME = "events.jsonl"
MAX_BYTES = 4 * 2**20
KEEP = 3


def events_path(state_dir: Path) -> Path:
    return state_dir / FILENAME


def emit(state_dir: Path, kind: str, **fields: Any) -> None:
    """Append one event; never raises."""
    record = {"schema": SCHEMA, "time": round(time.time(), 6), "kind": kind, **fields}
    line = (json.dumps(record, separators=(",", ":"), sort_keys=True) + "\n").encode()
    path = events_path(state_dir)
    try:
        # A shared ledger directory keeps no event log (README): a log there would be one
        # member's private file, which the others could neither append to nor read.
        if is_shared_dir(os.lstat(state_dir)):
            return
    except FileNotFoundError:
        pass
    except OSError:
        return
    try:
        ensure_private_dir(state_dir)
        fd = open_private_append(path)
        try:
            os.write(fd, line)
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if size > MAX_BYTES:
            _rotate(state_dir, path)
    except OSError:
        pass


def _rotate(state_dir: Path, path: Path) -> None:
    with exclusive(state_dir / "events.lock"), contextlib.suppress(FileNotFoundError):
        # Another writer may have rotated while this one waited for the lock.
        if path.stat().st_size <= MAX_BYTES:
            return
        for number in range(KEEP - 1, 0, -1):
            older = path.with_name(f"{path.name}.{number}")
            if older.exists():
                os.replace(older, path.with_name(f"{path.name}.{number + 1}"))
        os.replace(path, path.with_name(f"{path.name}.1"))


def parse_line(line: str) -> dict[str, Any] | None:
    """One event, or None for a line that is not one (a torn or foreign line is skipped)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if (
        not isinstance(record, dict)
        or not isinstance(record.get("kind"), str)
        or not isinstance(record.get("time"), (int, float))
    ):
        return None
    return record


def read_events(state_dir: Path) -> list[dict[str, Any]]:
    """Every event still kept, oldest first (rotated files included)."""
    path = events_path(state_dir)
    files = [path.with_name(f"{path.name}.{n}") for n in range(KEEP, 0, -1)] + [path]
    events: list[dict[str, Any]] = []
    for file in files:
        try:
            text = file.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        events.extend(e for e in map(parse_line, text.splitlines()) if e is not None)
    return events


def follow(state_dir: Path, interval: float = 0.2) -> Iterator[dict[str, Any]]:
    """Events appended from now on, across rotations, forever (the caller stops it)."""
    path = events_path(state_dir)
    identity: tuple[int, int] | None = None
    offset = 0
    pending = b""
    with contextlib.suppress(OSError):
        st = path.stat()
        identity, offset = (st.st_dev, st.st_ino), st.st_size
    while True:
        try:
            st = path.stat()
        except FileNotFoundError:
            time.sleep(interval)
            continue
        chunk = b""
        if (st.st_dev, st.st_ino) != identity:
            # Rotated (or created): finish the old file, now events.jsonl.1, then start anew.
            chunk = _rest_of(path.with_name(f"{path.name}.1"), identity, offset)
            identity, offset = (st.st_dev, st.st_ino), 0
        if st.st_size > offset:
            with path.open("rb") as handle:
                handle.seek(offset)
                new = handle.read()
            offset += len(new)
            chunk += new
        if not chunk:
            time.sleep(interval)
            continue
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for raw in lines:
            event = parse_line(raw.decode("utf-8", errors="replace"))
            if event is not None:
                yield event


def _rest_of(path: Path, identity: tuple[int, int] | None, offset: int) -> bytes:
    """What was appended to the file `identity` after `offset`, if `path` is still that file."""
    try:
        with path.open("rb") as handle:
            st = os.fstat(handle.fileno())
            if (st.st_dev, st.st_ino) != identity:
                return b""
            handle.seek(offset)
            return handle.read()
    except OSError:
        return b""
