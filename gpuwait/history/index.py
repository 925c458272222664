"""Per-key summaries of the history, so that an estimate reads a few small files, not the history.

    history.index/
        meta.v4.json {"schema", "dev", "ino", "offset", "tail"}: the history file it was
                     built from (device and inode), how many of its bytes it has taken in,
                     and a digest of the last of those (a file written over in place keeps
                     its inode, not those bytes)
        .writing     there while an update writes: found by the next one, its writer was
                     killed halfway, and the temporary files it left are removed
        b000.json ... bfff.json
                     4096 buckets by key hash: {key hash: {"n": runs ever, "runs": [...]}} with
                     the newest KEEP_RUNS runs of each key, oldest first; "n" counts the runs
                     compaction left out too (a record's "earlier_runs"). A year of one-off
                     lines (a seed, a date or a temp path each) leaves some ten keys in each
                     bucket, so a launch reads and writes a few kilobytes of them

It is a cache. When the history file grew, the new lines are taken in (under the history lock);
when it was replaced (compaction: another inode), written over in place or shrank, or the
index is missing or damaged, it is rebuilt from the history. Each run carries its byte offset in the history, so taking in
the same lines twice (a process killed between writing buckets and meta) adds nothing.

Each schema of the index has files of its own names (schema 3 and before: meta.json and b00.json
... bff.json), so that two versions of gpuwait used in turn (one in each of two environments)
each keep their own index up to date, rather than each rebuilding the whole of it, seconds on a
long history, every time it follows the other. A schema that changes the buckets' form changes
their names too. Another schema's files are removed only once they describe a history that is
gone (after a compaction, which makes every version rebuild its own anyway).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from gpuwait.core.digest import sha256_hex
from gpuwait.core.estimate import RunStat
from gpuwait.core.record import Record
from gpuwait.core.sizes import MAX_SIZE
from gpuwait.history.record import MAX_RECORDED_SECONDS, earlier_runs, figure, record_keys
from gpuwait.history.store import (
    KEEP_PER_KEY,
    LOCK_WAIT,
    HistoryBusy,
    Parsed,
    history_lock,
    history_path,
    read_from,
    read_limit,
)
from gpuwait.linux import signals
from gpuwait.linux.atomic import ensure_private_dir, keep_damaged, remove_left_temp_files
from gpuwait.linux.lock import Patience
from gpuwait.linux.security import mine, open_readable, read_state_file

#: 2: each run also names its GPUs (per-GPU run times). 3: and what it held on all of them.
#: 4: 4096 buckets, not 256.
SCHEMA = 4
DIRNAME = "history.index"
#: This schema's files: the meta and the buckets (`bucket_of`).
META = f"meta.v{SCHEMA}.json"
_BUCKET_RE = re.compile(r"^b[0-9a-f]{3}\.json\Z")
#: The files of the index's schemas 1-3, kept for an older gpuwait while they describe the
#: history as it is (`_remove_stale_legacy`).
_LEGACY_META = "meta.json"
_LEGACY_BUCKET_RE = re.compile(r"^b[0-9a-f]{2}\.json\Z")
#: The temporary files of the index's writes (`_write_cache`).
_TEMP_RE = re.compile(r"^\..+\.[0-9]+\.tmp\Z")
#: There while an update writes (`_writing`): found by the next, its writer was killed halfway.
_WRITING = ".writing"
KEEP_RUNS = KEEP_PER_KEY
_OK, _OOM, _APPROX, _SIZED, _UNSEEN = 1, 2, 4, 8, 16
#: A bucket file larger than this is not one (4096 buckets of KEEP_RUNS runs per key).
MAX_BUCKET_BYTES = 64 << 20
#: How long a launch waits for the history lock to bring the index up to date (another process
#: compacting, say); after that it goes on with the index as it is: a cache a few runs behind.
LAUNCH_LOCK_WAIT = 1.0

#: One run as stored: [offset, started_at, peak (-1: unknown), reserved, flags, run s, wait s,
#: time to peak (-1: unknown), [GPU UUIDs], held on all of them (-1: unknown)].
Row = list[Any]


class KeySummary(Record, frozen=True):
    """What the index knows about one key."""

    total_runs: int
    runs: list[RunStat]


class Lookup:
    """Summaries for the keys asked about, and what went wrong on the way (for the CLI)."""

    def __init__(self) -> None:
        self.keys: dict[str, KeySummary] = {}
        self.warnings: list[str] = []


def index_dir(state_dir: Path) -> Path:
    return state_dir / DIRNAME


def bucket_of(key: str) -> str:
    return f"b{key[:3]}.json"


def _row(offset: int, stat: RunStat) -> Row:
    flags = (
        (_OK if stat.ok else 0)
        | (_OOM if stat.oom else 0)
        | (_APPROX if stat.approximate else 0)
        | (_SIZED if stat.sized_by_reservation else 0)
        | (_UNSEEN if stat.unseen else 0)
    )
    return [
        offset,
        stat.started_at,
        -1 if stat.peak_bytes is None else stat.peak_bytes,
        stat.reserved_bytes,
        flags,
        round(stat.run_seconds, 3),
        round(stat.wait_seconds, 3),
        -1 if stat.time_to_peak is None else round(stat.time_to_peak, 3),
        list(stat.gpu_uuids),
        -1 if stat.held_bytes is None else stat.held_bytes,
        # Last, so that a row of an index written before it stays one: read as "not said".
        -1 if stat.oom_wanted_bytes is None else stat.oom_wanted_bytes,
    ]


def _stat(row: Sequence[Any]) -> RunStat:
    flags = int(figure(row[4]))
    uuids = row[8]
    if not isinstance(uuids, list) or not all(isinstance(u, str) for u in uuids):
        raise ValueError("GPUs must be a list of UUIDs")
    # Figures past any real one were taken in before they were read as damage
    # (history.record.run_stat); others are a damaged or hand-edited index.
    peak, reserved, held = (figure(row[i], MAX_SIZE) for i in (2, 3, 9))
    run, wait, to_peak = (figure(row[i], MAX_RECORDED_SECONDS) for i in (5, 6, 7))
    wanted = figure(row[10], MAX_SIZE) if len(row) > 10 else -1
    return RunStat(
        started_at=figure(row[1]),
        peak_bytes=None if peak < 0 else int(peak),
        reserved_bytes=max(0, int(reserved)),
        ok=bool(flags & _OK),
        oom=bool(flags & _OOM),
        unseen=bool(flags & _UNSEEN),
        approximate=bool(flags & _APPROX),
        run_seconds=max(0.0, run),
        wait_seconds=max(0.0, wait),
        time_to_peak=None if to_peak < 0 else to_peak,
        gpu_uuids=tuple(uuids),
        held_bytes=None if held < 0 else int(held),
        sized_by_reservation=bool(flags & _SIZED),
        oom_wanted_bytes=int(wanted) if wanted > 0 else None,
    )


class _Damaged(Exception):
    pass


def _write_cache(path: Path, value: Any) -> None:
    """Atomic replace without fsync: a cache lost in a crash is rebuilt, not trusted half-written."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, json.dumps(value, separators=(",", ":")).encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _read_json(path: Path) -> Any:
    try:
        raw = read_state_file(path, MAX_BUCKET_BYTES, mine())
        return None if raw is None else json.loads(raw)
    except OSError as exc:
        raise _Damaged(f"{path.name}: {exc.strerror or exc}") from None
    except (ValueError, RecursionError) as exc:
        raise _Damaged(f"{path.name}: {exc}") from None


def _read_meta(path: Path, schema: int | None = SCHEMA) -> dict[str, Any] | None:
    """The meta at `path`, of `schema` (None: of any), or None where it is missing, damaged
    or of another schema."""
    try:
        meta = _read_json(path)
    except _Damaged:
        return None
    if not isinstance(meta, dict) or (schema is not None and meta.get("schema") != schema):
        return None
    if not all(type(meta.get(k)) is int and meta[k] >= 0 for k in ("dev", "ino", "offset")):
        return None
    return meta


def _describes(meta: dict[str, Any], history: os.stat_result) -> bool:
    """Was the index of `meta` built from this history file, taking in no more than it holds?"""
    same_file = (meta["dev"], meta["ino"]) == (history.st_dev, history.st_ino)
    return same_file and meta["offset"] <= history.st_size


def _read_bucket(path: Path) -> dict[str, dict[str, Any]]:
    data = _read_json(path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise _Damaged(f"{path.name}: not an object")
    return data


def _summary(entry: Any, name: str) -> KeySummary:
    try:
        return KeySummary(total_runs=int(entry["n"]), runs=[_stat(row) for row in entry["runs"]])
    except (KeyError, TypeError, ValueError, IndexError):
        raise _Damaged(f"{name}: malformed entry") from None


def lookup(state_dir: Path, keys: Iterable[str], max_bytes: int) -> Lookup:
    """Summaries of `keys`, bringing the index up to date with the history first if needed.

    `max_bytes`: the history's size limit (history_max_size), which bounds what is read."""
    wanted = sorted(set(keys))
    result = Lookup()
    history = history_path(state_dir)
    try:
        st = os.stat(history)
    except FileNotFoundError:
        return result
    except OSError as exc:  # a state dir that cannot be entered
        result.warnings.append(_unusable(state_dir, exc))
        return result
    directory = index_dir(state_dir)
    meta = _read_meta(directory / META)
    fresh = meta is not None and _describes(meta, st) and meta["offset"] == st.st_size
    try:
        for attempt in range(2):
            if not fresh:
                try:
                    result.warnings += refresh(
                        state_dir, max_bytes, rebuild=attempt > 0, wait=LAUNCH_LOCK_WAIT
                    )
                except (HistoryBusy, signals.SignalPending):
                    # Busy (compacting, say), or told to end meanwhile (a retry's estimate, a
                    # signal left pending for its caller): the index as it is serves.
                    pass
                except OSError as exc:
                    if meta is None or signals.raised_by_a_handler(exc):
                        raise  # no index to go on with, or the program's own timeout
                    # Not to be written (a full disk or quota): the index as it is serves
                    # too, a few runs behind, rather than no estimate at all (a whole GPU).
                    result.warnings.append(
                        f"history index {directory} could not be brought up to date "
                        f"({exc.strerror or exc}); estimates use it as it is, without the "
                        "newest runs"
                    )
            try:
                result.keys = _read_keys(directory, wanted)
                return result
            except _Damaged as exc:
                result.warnings.append(f"history index {directory} was damaged ({exc}); rebuilt it")
                fresh = False
    except OSError as exc:
        if signals.raised_by_a_handler(exc):
            raise  # the program's own timeout (gpuwait.reserve), to reach it
        # Learning is a help, never a reason for a run to fail: go on without history.
        result.warnings.append(_unusable(state_dir, exc))
    return result


def _unusable(state_dir: Path, exc: OSError) -> str:
    return (
        f"history in {state_dir} cannot be used ({exc.strerror or exc}); "
        "going on without what earlier runs used"
    )


def _read_keys(directory: Path, keys: Sequence[str]) -> dict[str, KeySummary]:
    found: dict[str, KeySummary] = {}
    buckets: dict[str, dict[str, Any]] = {}
    for key in keys:
        name = bucket_of(key)
        if name not in buckets:
            buckets[name] = _read_bucket(directory / name)
        entry = buckets[name].get(key)
        if entry is not None:
            found[key] = _summary(entry, name)
    return found


def refresh(
    state_dir: Path,
    max_bytes: int,
    rebuild: bool = False,
    wait: float = LOCK_WAIT,
    patience: float | Patience = 0.0,
) -> list[str]:
    """Take in what the history gained since the index was written; rebuild when it must.

    Reads at most `read_limit(max_bytes)` bytes, the newest: a history far over its size limit
    (damaged, or written by something else) costs what a whole history would, and its older
    part waits for the next compaction. Returns warnings (damaged history lines, a damaged
    index) for the CLI to show. HistoryBusy when the history lock is not had within `wait`,
    SignalPending once a signal has waited `patience` seconds for gpuwait.
    """
    directory = index_dir(state_dir)
    history = history_path(state_dir)
    warnings: list[str] = []
    limit = read_limit(max_bytes)
    with history_lock(state_dir, wait, patience):
        try:
            st = os.stat(history)
        except FileNotFoundError:
            return warnings
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISDIR(os.lstat(directory).st_mode):
                # A file written over it, or a link: the index is a cache, so what is there
                # is kept as evidence and the index is made anew.
                kept = keep_damaged(directory)
                warnings.append(
                    f"history index {directory} was not a directory; kept it as {kept.name}"
                    " and rebuilt the index"
                )
        ensure_private_dir(directory)
        meta = _read_meta(directory / META)
        if rebuild or meta is None or not _describes(meta, st) or not _same_tail(meta, history):
            _writing(directory)
            parsed = read_from(history, 0, limit)
            _rebuild(directory, parsed)
            _remove_stale_legacy(directory, st)
        else:
            if meta["offset"] == st.st_size:
                return warnings
            _writing(directory)
            parsed = read_from(history, meta["offset"], limit)
            try:
                _take_in(directory, parsed)
            except _Damaged as exc:
                warnings.append(f"history index {directory} was damaged ({exc}); rebuilt it")
                parsed = read_from(history, 0, limit)
                _rebuild(directory, parsed)
        message = parsed.damage.message(history)
        if message:
            warnings.append(message)
        _write_cache(
            directory / META,
            {
                "schema": SCHEMA,
                "dev": st.st_dev,
                "ino": st.st_ino,
                "offset": parsed.end,
                "tail": _tail(history, parsed.end),
            },
        )
        with contextlib.suppress(OSError):
            os.unlink(directory / _WRITING)
    return warnings


#: How much of the history before what the index took in it keeps a digest of (`_tail`).
_TAIL_BYTES = 256


def _tail(history: Path, offset: int) -> str | None:
    """A digest of the history's last bytes before `offset`, the end of what the index took
    in; None where they cannot be read."""
    try:
        fd = open_readable(history, mine())
    except OSError:
        return None
    if fd is None:
        return None
    try:
        start = max(0, offset - _TAIL_BYTES)
        return sha256_hex(os.pread(fd, offset - start, start).decode("latin-1"))[:20]
    except OSError:
        return None
    finally:
        os.close(fd)


def _same_tail(meta: dict[str, Any], history: Path) -> bool:
    """Does the history still hold what the index took in? A file written over in place (`cp
    history.jsonl.1 history.jsonl` keeps its inode) may be as long or longer, but its bytes
    before the offset differ: taken in from there, the index would start in the middle of a
    line and never know the runs before it. A meta that keeps no digest (an earlier gpuwait's)
    is taken at its word."""
    kept = meta.get("tail")
    return not isinstance(kept, str) or _tail(history, meta["offset"]) in (kept, None)


def _writing(directory: Path) -> None:
    """Mark the index as being written (the history lock held), first removing the files of
    the last writer where it was killed halfway: its mark is still there. Each one therefore
    goes with the next update, and an update lists the directory, 4,096 buckets a year on,
    only then, not after every run."""
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        os.close(os.open(directory / _WRITING, flags, 0o600))
    except OSError:
        # FileExistsError: a writer killed halfway. Any other failure: looked at every time.
        remove_left_temp_files(directory, _TEMP_RE)


def _group(parsed: Parsed) -> dict[str, dict[str, list[tuple[Row, int]]]]:
    """bucket -> key -> new rows, in file order, each with the runs left out before it."""
    grouped: dict[str, dict[str, list[tuple[Row, int]]]] = {}
    for (offset, record), run_stat in zip(parsed.records, parsed.stats, strict=True):
        row = _row(offset, run_stat)
        earlier = earlier_runs(record)
        for key in record_keys(record).values():
            grouped.setdefault(bucket_of(key), {}).setdefault(key, []).append(
                (row, earlier.get(key, 0))
            )
    return grouped


def _merge(bucket: dict[str, dict[str, Any]], key: str, rows: list[tuple[Row, int]]) -> None:
    entry = bucket.setdefault(key, {"n": 0, "runs": []})
    last = entry["runs"][-1][0] if entry["runs"] else -1
    new = [(row, earlier) for row, earlier in rows if row[0] > last]
    entry["n"] += sum(1 + earlier for _, earlier in new)
    entry["runs"] = (entry["runs"] + [row for row, _ in new])[-KEEP_RUNS:]


def _take_in(directory: Path, parsed: Parsed) -> None:
    for name, keys in _group(parsed).items():
        bucket = _read_bucket(directory / name)
        try:
            for key, rows in keys.items():
                _merge(bucket, key, rows)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError):
            raise _Damaged(f"{name}: malformed entry") from None
        _write_cache(directory / name, bucket)


def _rebuild(directory: Path, parsed: Parsed) -> None:
    # Those of a writer killed halfway go with the rest of the old index.
    remove_left_temp_files(directory, _TEMP_RE)
    grouped = _group(parsed)
    for name, keys in grouped.items():
        bucket: dict[str, dict[str, Any]] = {}
        for key, rows in keys.items():
            _merge(bucket, key, rows)
        _write_cache(directory / name, bucket)
    for name in os.listdir(directory):
        if _BUCKET_RE.match(name) and name not in grouped:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(directory / name)


def _remove_stale_legacy(directory: Path, history: os.stat_result) -> None:
    """Remove the index an older gpuwait kept (schemas 1-3) where it no longer describes the
    history: that gpuwait, if it is still used, would rebuild it anyway."""
    meta = _read_meta(directory / _LEGACY_META, schema=None)
    if meta is not None and _describes(meta, history):
        return
    for name in os.listdir(directory):
        if name == _LEGACY_META or _LEGACY_BUCKET_RE.match(name):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(directory / name)
