"""The run history: one JSON line per finished run, appended to history.jsonl in the state dir.

The file is append-only and private (0600). Writers take history.lock for the append, so that
compaction (which replaces the file) never loses a record written meanwhile. A damaged line (a
disk filling up mid-write, an edit by hand) is skipped and reported, never fatal.

Compaction: once the file passes its size limit, it is rewritten with the records estimates still
use (the newest KEEP_PER_KEY runs of every command key, at every level, younger than MAX_AGE) and
the newest KEEP_RECENT for `gpuwait history`; the old file stays as history.jsonl.1. Estimates
therefore come out the same before and after. If even those records pass half the limit, the
oldest of them go first.

Per-key summaries for fast estimates live in gpuwait._histindex, a cache rebuilt from this file.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpuwait._atomic import append_whole, ensure_private_dir, open_private_append, write_atomic
from gpuwait._cmdkey import command_key
from gpuwait._estimate import MAX_AGE, WINDOW, RunStat
from gpuwait._lock import exclusive

SCHEMA = 2
FILENAME = "history.jsonl"
LOCK_NAME = "history.lock"
#: Runs kept per command key (at each level) by compaction: more than an estimate looks at.
KEEP_PER_KEY = 2 * WINDOW
#: The newest runs, kept by compaction whatever their key, for `gpuwait history`.
KEEP_RECENT = 1000


def history_path(state_dir: Path) -> Path:
    return state_dir / FILENAME


@contextlib.contextmanager
def history_lock(state_dir: Path) -> Iterator[None]:
    """Exclusive lock shared by appenders, compaction and index updates."""
    ensure_private_dir(state_dir)
    with exclusive(state_dir / LOCK_NAME):
        yield


def encode(record: dict[str, Any]) -> bytes:
    return (
        json.dumps({"schema": SCHEMA, **record}, separators=(",", ":"), sort_keys=True) + "\n"
    ).encode()


def append_record(state_dir: Path, record: dict[str, Any], max_bytes: int | None = None) -> bool:
    """Append one record as a single write; compact when the file passes `max_bytes`.

    Returns True when the file was compacted (its index must then be rebuilt).
    """
    line = encode(record)
    path = history_path(state_dir)
    with history_lock(state_dir):
        fd = open_private_append(path)
        try:
            size = os.fstat(fd).st_size
            if size and _last_byte(path, size) != b"\n":
                # A writer died mid-line: end that line, or this record would be glued onto it.
                line = b"\n" + line
            # One write, and none of it left behind if the disk fills up halfway.
            append_whole(fd, line)
            size += len(line)
        finally:
            os.close(fd)
        if max_bytes is not None and size > max_bytes:
            compact(state_dir, max_bytes)
            return True
    return False


def _last_byte(path: Path, size: int) -> bytes:
    try:
        with open(path, "rb") as handle:
            handle.seek(size - 1)
            return handle.read(1)
    except OSError:
        return b"\n"


class Damage:
    """Damaged lines met while reading; reported once per read as a single warning."""

    def __init__(self) -> None:
        self.lines = 0
        self.first_offset: int | None = None

    def add(self, offset: int) -> None:
        self.lines += 1
        if self.first_offset is None:
            self.first_offset = offset

    def message(self, path: Path) -> str | None:
        if not self.lines:
            return None
        return (
            f"history {path}: skipped {self.lines} damaged line(s) "
            f"(the first at byte {self.first_offset}); the rest of the history is used"
        )


class Parsed:
    """Records read from a stretch of the file, each with the byte offset of its line."""

    def __init__(self) -> None:
        self.records: list[tuple[int, dict[str, Any]]] = []
        #: The figures of each record, in the same order.
        self.stats: list[RunStat] = []
        #: Bytes consumed: whole lines only, so a line still being written is read next time.
        self.consumed = 0
        self.damage = Damage()


def parse_lines(data: bytes, base_offset: int = 0) -> Parsed:
    """Every whole line of `data` (which starts at `base_offset` in the file)."""
    parsed = Parsed()
    end = data.rfind(b"\n") + 1
    parsed.consumed = end
    position = 0
    while position < end:
        newline = data.index(b"\n", position)
        line = data[position:newline]
        if line.strip():
            decoded = _decode(line)
            if decoded is None:
                parsed.damage.add(base_offset + position)
            else:
                parsed.records.append((base_offset + position, decoded[0]))
                parsed.stats.append(decoded[1])
        position = newline + 1
    return parsed


def _decode(line: bytes) -> tuple[dict[str, Any], RunStat] | None:
    try:
        value = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("schema"), int):
        return None
    stat = run_stat(value)
    return None if stat is None else (value, stat)


def read_from(path: Path, offset: int = 0) -> Parsed:
    """Records from `offset` to the last whole line. A missing file has none."""
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            data = handle.read()
    except FileNotFoundError:
        return Parsed()
    return parse_lines(data, offset)


def tail(path: Path, count: int) -> Parsed:
    """The last `count` records (fewer if the file has fewer), reading backwards in blocks."""
    try:
        data, start = _read_tail(path, count)
    except FileNotFoundError:
        return Parsed()
    if start > 0:
        # Skip the partial first line.
        cut = data.index(b"\n") + 1
        data, start = data[cut:], start + cut
    parsed = parse_lines(data, start)
    keep = min(count, len(parsed.records))
    parsed.records = parsed.records[len(parsed.records) - keep :]
    parsed.stats = parsed.stats[len(parsed.stats) - keep :]
    return parsed


def _read_tail(path: Path, count: int) -> tuple[bytes, int]:
    """The end of the file holding more than `count` lines (or all of it), and where it starts."""
    with open(path, "rb") as handle:
        end = handle.seek(0, os.SEEK_END)
        start = end
        block = 1 << 16
        data = b""
        while start > 0:
            start = max(0, start - block)
            handle.seek(start)
            data = handle.read(end - start)
            if data.count(b"\n") > count:
                break
            block *= 2
    return data, start


def _number(value: Any) -> float:
    # type() rather than isinstance(): bool is an int, and is no figure.
    if type(value) is not int and type(value) is not float:
        raise ValueError("not a number")
    if value != value or value in (math.inf, -math.inf):
        raise ValueError("not a finite number")
    return float(value)


def run_stat(record: dict[str, Any]) -> RunStat | None:
    """The figures estimates use, or None if the record lacks them or they are malformed."""
    get = record.get
    try:
        peak = get("peak_bytes")
        to_peak = get("time_to_peak_seconds")
        return RunStat(
            started_at=_number(get("started_at")),
            peak_bytes=None if peak is None else max(0, int(_number(peak))),
            reserved_bytes=max(0, int(_number(get("reserved_bytes", 0)))),
            ok=get("exit_status") == 0 and get("signal") is None,
            oom=get("oom") is True,
            approximate=get("peak_approximate") is True,
            run_seconds=max(0.0, _number(get("run_seconds", 0))),
            wait_seconds=max(0.0, _number(get("wait_seconds", 0))),
            time_to_peak=None if to_peak is None else max(0.0, _number(to_peak)),
        )
    except (ValueError, TypeError, OverflowError):
        return None


def record_keys(record: dict[str, Any]) -> dict[str, str]:
    """Level -> key hash of a record. Records written before keys existed get them computed."""
    keys = record.get("keys")
    if isinstance(keys, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in keys.items()
    ):
        return dict(keys)
    command, cwd = record.get("command"), record.get("cwd")
    if (
        isinstance(command, list)
        and command
        and all(isinstance(a, str) for a in command)
        and isinstance(cwd, str)
    ):
        return command_key(command, cwd).hashes()
    return {}


def compact(state_dir: Path, max_bytes: int, now: float | None = None) -> None:
    """Rewrite the history keeping what estimates use (see the module docstring). Call it while
    holding history_lock."""
    path = history_path(state_dir)
    parsed = read_from(path)
    newest = max((r.get("started_at", 0) for _, r in parsed.records), default=0)
    clock = now if now is not None else max(newest, 0)
    kept_per_key: dict[str, int] = {}
    keep: list[bool] = [False] * len(parsed.records)
    for position in range(len(parsed.records) - 1, -1, -1):
        record, stat = parsed.records[position][1], parsed.stats[position]
        if position >= len(parsed.records) - KEEP_RECENT:
            keep[position] = True
        if clock - stat.started_at > MAX_AGE:
            continue
        for key in record_keys(record).values():
            if kept_per_key.get(key, 0) < KEEP_PER_KEY:
                kept_per_key[key] = kept_per_key.get(key, 0) + 1
                keep[position] = True
    lines = [encode_existing(r) for (_, r), k in zip(parsed.records, keep, strict=True) if k]
    budget = max_bytes // 2
    total = sum(len(line) for line in lines)
    first = 0
    while total > budget and first < len(lines) - 1:
        total -= len(lines[first])
        first += 1
    data = b"".join(lines[first:])
    previous = path.with_name(FILENAME + ".1")
    link = path.with_name(f".{FILENAME}.1.{os.getpid()}.tmp")
    # The old file stays as history.jsonl.1, and readers always find a history.jsonl.
    with contextlib.suppress(FileNotFoundError):
        link.unlink()
    os.link(path, link)
    os.replace(link, previous)
    write_atomic(path, data)


def encode_existing(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, separators=(",", ":"), sort_keys=True) + "\n").encode()
