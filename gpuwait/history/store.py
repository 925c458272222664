"""The run history: one JSON line per finished run, appended to history.jsonl in the state dir.

The file is append-only and private (0600). Writers take history.lock for the append, so that
compaction (which replaces the file) never loses a record written meanwhile. A damaged line (a
disk filling up mid-write, an edit by hand) is skipped and reported, never fatal.

Compaction: once the file passes its size limit, it is rewritten with what estimates still use,
and the old file stays as history.jsonl.1:
- the newest KEEP_RECENT runs whole, for `gpuwait history`;
- the newest KEEP_PER_KEY runs of every command key, at every level, younger than MAX_AGE (the
  runs an estimate looks at, twice over), as slim records: only the fields run_stat() and
  record_keys() read, marked "slim" (no command line, cwd, GPUs or evidence; about a third of
  a whole record);
- how many runs of each key were left out, as "earlier_runs" {key hash: count} on the oldest
  record kept for that key, so the run counts `gpuwait estimate` shows stay the same (a key
  none of whose runs is kept, e.g. all older than MAX_AGE, is forgotten, count and all).
Estimates therefore come out the same before and after while those records fit in half the
limit (about 100,000 slim records at the default 64 MiB). Beyond that, the runs kept only for
keys with fewer than MIN_RUNS runs in their window (mostly sweeps: command lines run once) go
first, oldest first, so estimates of those exact lines fall back to their script's; the windows
of keys with MIN_RUNS or more runs go only after all of those, oldest first, and never the
newest KEEP_RECENT unless the limit is too small even for them.

Per-key summaries for fast estimates live in gpuwait.history.index, a cache rebuilt from this file.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpuwait.core.estimate import MAX_AGE, MIN_RUNS, WINDOW, RunStat
from gpuwait.history.record import (
    EARLIER,
    RunOutcome,
    earlier_runs,
    encode,
    encode_existing,
    outcome,
    record_keys,
    run_stat,
    slim,
)
from gpuwait.linux.atomic import append_whole, ensure_private_dir, open_private_append, write_atomic
from gpuwait.linux.lock import exclusive

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


class Compaction:
    """What a compaction kept and left out, for tests and the benchmark."""

    def __init__(self) -> None:
        self.records_before = 0
        self.whole = 0
        self.slim = 0
        #: Records that estimates used but did not fit (see the module docstring).
        self.dropped_unprotected = 0
        self.dropped_protected = 0
        self.lines: list[bytes] = []


def compacted(parsed: Parsed, budget: int, now: float | None = None) -> Compaction:
    """The lines a compacted history keeps, in file order (see the module docstring)."""
    records = [record for _, record in parsed.records]
    count = len(records)
    result = Compaction()
    result.records_before = count
    newest = max((stat.started_at for stat in parsed.stats), default=0.0)
    clock = now if now is not None else max(newest, 0.0)
    keys = [record_keys(record) for record in records]
    in_window: dict[str, int] = {}
    #: The keys whose estimate window holds each record.
    windows: list[list[str]] = [[] for _ in records]
    for position in range(count - 1, -1, -1):
        if clock - parsed.stats[position].started_at > MAX_AGE:
            continue
        for key in keys[position].values():
            if in_window.get(key, 0) < KEEP_PER_KEY:
                in_window[key] = in_window.get(key, 0) + 1
                windows[position].append(key)
    first_recent = count - KEEP_RECENT
    whole = [position >= first_recent for position in range(count)]
    kept = [position for position in range(count) if whole[position] or windows[position]]
    encoded = {
        p: encode_existing(records[p] if whole[p] else slim(records[p], keys[p])) for p in kept
    }
    target = budget
    for _ in range(4):
        lines = _fit(dict(encoded), target, whole, windows, in_window, result)
        _carry_counts(records, keys, lines, whole, count)
        # The counts carried make a few records longer: fit again to a target smaller by that.
        over = sum(len(line) for line in lines.values()) - budget
        if over <= 0 or len(lines) <= 1:
            break
        target -= over
    result.lines = [lines[p] for p in sorted(lines)]
    result.whole = sum(1 for p in lines if whole[p])
    result.slim = len(lines) - result.whole
    return result


def _fit(
    lines: dict[int, bytes],
    budget: int,
    whole: list[bool],
    windows: list[list[str]],
    in_window: dict[str, int],
    result: Compaction,
) -> dict[int, bytes]:
    """Leave out records, least needed first, until the rest fit in `budget` bytes."""
    result.dropped_unprotected = result.dropped_protected = 0
    total = sum(len(line) for line in lines.values())
    if total <= budget:
        return lines
    kept = sorted(lines)
    # Runs only keys with fewer than MIN_RUNS runs need (a sweep's lines, run once) go first.
    for p in kept:
        if total <= budget:
            break
        if not whole[p] and not any(in_window[key] >= MIN_RUNS for key in windows[p]):
            total -= len(lines.pop(p))
            result.dropped_unprotected += 1
    # Then the oldest of the rest, whatever they are for; the newest run always stays.
    for p in kept:
        if total <= budget or len(lines) <= 1:
            break
        if p in lines:
            total -= len(lines.pop(p))
            result.dropped_protected += 1
    return lines


def _carry_counts(
    records: list[dict[str, Any]],
    keys: list[dict[str, str]],
    lines: dict[int, bytes],
    whole: list[bool],
    count: int,
) -> None:
    """Note on the oldest kept record of each key how many of its runs were left out."""
    left_out: dict[str, int] = {}
    for position in range(count):
        if position in lines:
            continue
        earlier = earlier_runs(records[position])
        for key in keys[position].values():
            left_out[key] = left_out.get(key, 0) + 1 + earlier.get(key, 0)
    for position in sorted(lines):
        if not left_out:
            break
        carried = {key: left_out.pop(key) for key in keys[position].values() if key in left_out}
        if carried:
            record = (
                records[position] if whole[position] else slim(records[position], keys[position])
            )
            earlier = earlier_runs(record)
            for key, n in carried.items():
                earlier[key] = earlier.get(key, 0) + n
            lines[position] = encode_existing({**record, EARLIER: earlier})


def compact(state_dir: Path, max_bytes: int, now: float | None = None) -> Compaction:
    """Rewrite the history keeping what estimates use (see the module docstring). Call it while
    holding history_lock."""
    path = history_path(state_dir)
    result = compacted(read_from(path), max_bytes // 2, now)
    previous = path.with_name(FILENAME + ".1")
    link = path.with_name(f".{FILENAME}.1.{os.getpid()}.tmp")
    # The old file stays as history.jsonl.1, and readers always find a history.jsonl.
    with contextlib.suppress(FileNotFoundError):
        link.unlink()
    os.link(path, link)
    os.replace(link, previous)
    write_atomic(path, b"".join(result.lines))
    return result


#: How much of the history's end `find_run` searches: a dependency named by `--after` is one
#: of the latest runs.
FIND_TAIL_BYTES = 2**20


def find_outcome(state_dir: Path, ref: str) -> RunOutcome | None:
    """How the latest run in the history's end whose job id or name is `ref` ended; None if
    there is none."""
    path = history_path(state_dir)
    try:
        with path.open("rb") as handle:
            handle.seek(max(0, os.fstat(handle.fileno()).st_size - FIND_TAIL_BYTES))
            lines = handle.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict) or ref not in (record.get("job_id"), record.get("name")):
            continue
        found = outcome(record)
        if found is not None:
            return found
    return None
