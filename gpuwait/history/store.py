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
  a whole record; a run on several GPUs keeps their UUIDs and its peak on each, which a job on
  fewer GPUs is sized by);
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
import errno
import json
import os
import re
import time
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

from gpuwait.core.estimate import (
    DEFAULT_HISTORY_MAX_BYTES,
    FUTURE_SLACK,
    MAX_AGE,
    MIN_RUNS,
    WINDOW,
    RunStat,
)
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
from gpuwait.linux import signals
from gpuwait.linux.atomic import (
    append_whole,
    damaged_name,
    end_of_cut_line,
    ensure_private_dir,
    open_private_append,
    prune_damaged,
    read_tail,
    remove_left_temp_files,
    write_atomic,
)
from gpuwait.linux.lock import LockTimeout, Patience, exclusive
from gpuwait.linux.security import mine, open_readable

FILENAME = "history.jsonl"
LOCK_NAME = "history.lock"
#: The temporary files a compaction writes, with the history lock held.
_TEMP_RE = re.compile(r"^\.history\.jsonl(?:\.1)?\.[0-9]+\.tmp\Z")
#: Runs kept per command key (at each level) by compaction: more than an estimate looks at.
KEEP_PER_KEY = 2 * WINDOW
#: The newest runs, kept by compaction whatever their key, for `gpuwait history`.
KEEP_RECENT = 1000
#: How long a writer (a finished run's record, a compaction) waits for the history lock.
LOCK_WAIT = 60.0
#: What is read of a history, at most, is this many times its size limit (history_max_size),
#: the newest part: a history compacts once it passes its limit, so only a damaged file (or
#: one written by something else) is larger, and such a file must not make every launch slower.
READ_FACTOR = 2
#: What compaction reads at least: a limit lowered below the history's size (history_max_size
#: set from 64MiB to 1MiB, say) still compacts the whole file, as long as it is no larger.
COMPACT_READ_BYTES = 2 * DEFAULT_HISTORY_MAX_BYTES
#: A line longer than this is not a record (records are about a kilobyte) but junk, even while
#: no newline ends it yet.
MAX_LINE = 1 << 20


def read_limit(max_bytes: int) -> int:
    """How much of a history whose size limit is `max_bytes` is ever read (see READ_FACTOR)."""
    return READ_FACTOR * max_bytes


def history_path(state_dir: Path) -> Path:
    return state_dir / FILENAME


class HistoryBusy(OSError):
    """The history lock was not had in time: another process holds it (compacting, or hung)."""


@contextlib.contextmanager
def history_lock(
    state_dir: Path, wait: float = LOCK_WAIT, patience: float | Patience = 0.0
) -> Iterator[None]:
    """Exclusive lock shared by appenders, compaction and index updates; HistoryBusy after
    `wait` seconds, SignalPending once a signal has waited `patience` seconds for gpuwait."""
    ensure_private_dir(state_dir)
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(exclusive(state_dir / LOCK_NAME, timeout=wait, patience=patience))
        except LockTimeout:
            raise HistoryBusy(
                errno.EWOULDBLOCK, f"another process held the history lock for {wait:g}s"
            ) from None
        yield


def append_record(
    state_dir: Path,
    record: dict[str, Any],
    max_bytes: int | None = None,
    patience: float | Patience = 0.0,
) -> Compaction | None:
    """Append one record as a single write; compact when the file passes `max_bytes`. The
    lock is waited for `patience` seconds more where a signal waits for gpuwait.

    Returns the compaction when there was one (the index must then be rebuilt); raises
    NotCompacted when the record was appended but the compaction failed.
    """
    line = encode(record)
    path = history_path(state_dir)
    with history_lock(state_dir, patience=patience):
        fd = open_private_append(path)
        try:
            size = os.fstat(fd).st_size
            line = end_of_cut_line(path, size) + line
            # One write, and none of it left behind if the disk fills up halfway.
            append_whole(fd, line)
            size += len(line)
        finally:
            os.close(fd)
        if max_bytes is not None and size > max_bytes:
            try:
                return compact(state_dir, max_bytes)
            except OSError as exc:
                if signals.raised_by_a_handler(exc):
                    raise  # the program's own timeout (gpuwait.reserve), no failure to compact
                raise NotCompacted(exc.errno, exc.strerror) from None
    return None


class NotCompacted(OSError):
    """The record is in the history, but the history, past its size limit, could not be
    compacted (the disk full, say): it is tried again with the next record."""


class Damage:
    """Damaged lines met while reading; reported once per read as a single warning."""

    def __init__(self) -> None:
        self.lines = 0
        self.first_offset: int | None = None
        #: Bytes at the file's start left unread because the file is far over its size limit.
        self.unread = 0

    def note(self, offset: int) -> None:
        """A damaged line at `offset`, met in file order."""
        if self.first_offset is None:
            self.first_offset = offset

    def describe(self) -> str | None:
        """What was passed over, or None when nothing was."""
        parts = []
        if self.lines:
            parts.append(
                f"skipped {self.lines} damaged line(s) (the first at byte {self.first_offset})"
            )
        if self.unread:
            parts.append(f"left its first {_mib(self.unread)} unread (far over history_max_size)")
        return "; ".join(parts) or None

    def message(self, path: Path) -> str | None:
        what = self.describe()
        return None if what is None else f"history {path}: {what}; the rest of the history is used"


def _mib(count: int) -> str:
    return f"{count / 2**20:.1f} MiB"


class Parsed:
    """Records read from a stretch of the file, each with the byte offset of its line."""

    def __init__(self) -> None:
        self.records: list[tuple[int, dict[str, Any]]] = []
        #: The figures of each record, in the same order.
        self.stats: list[RunStat] = []
        #: Where the stretch read ends in the file: after its last whole line (a line still
        #: being written is read next time), or after junk longer than any record.
        self.end = 0
        self.damage = Damage()


#: Every byte but the newline, as "X"; with the whitespace bytes.strip() takes left out, a line
#: that is not blank ends in "X\n". So the lines are counted at the speed of bytes.translate.
_NOT_NEWLINE = bytes(10 if b == 10 else 88 for b in range(256))
_WHITESPACE = b" \t\r\x0b\x0c"
#: How much of the data is translated at a time (a copy of this size at most).
_CHUNK = 8 << 20


#: What every record that names its keys holds (records written before keys existed have
#: theirs computed from their command line).
_KEYS_FIELD = b'"keys"'


def parse_lines(data: bytes, base_offset: int = 0, key: str | None = None) -> Parsed:
    """Every whole line of `data` (which starts at `base_offset` in the file).

    A record is a JSON object: only lines whose first byte past spaces is "{" are decoded, and
    they are found by searching for "{" (memchr, in C), so a history full of junk costs a scan
    of its bytes, not a step of Python per line. With `key` (a key hash), only records that
    may count for it are decoded: a line that names its keys without that one is passed over
    undecoded, as neither a record nor damage.
    """
    needle = None if key is None else f'"{key}"'.encode()
    passed_over = 0
    parsed = Parsed()
    end = data.rfind(b"\n") + 1
    # Junk that no newline ends (yet): no record is that long, so it is passed over for good.
    junk_tail = len(data) - end > MAX_LINE
    parsed.end = base_offset + (len(data) if junk_tail else end)
    damage = parsed.damage
    position = 0  # where the line after the last record starts
    search = 0
    while True:
        brace = data.find(b"{", search, end)
        if brace < 0:
            break
        start = data.rfind(b"\n", search, brace) + 1 or search
        stop = data.index(b"\n", brace, end)
        search = stop + 1
        if data[start:brace].strip(b" \t\r"):
            continue  # not a JSON object: counted with the other damaged lines below
        if damage.first_offset is None and start > position:
            _note_junk(data, position, start, base_offset, damage)
        if (
            needle is not None
            and data.find(needle, brace, stop) < 0
            and data.find(_KEYS_FIELD, brace, stop) >= 0
        ):
            passed_over += 1
            position = stop + 1
            continue
        decoded = _decode(data[start:stop])
        if decoded is None:
            damage.note(base_offset + start)
        else:
            parsed.records.append((base_offset + start, decoded[0]))
            parsed.stats.append(decoded[1])
        position = stop + 1
    if damage.first_offset is None and position < end:
        _note_junk(data, position, end, base_offset, damage)
    damage.lines = _lines_not_blank(data, end) - len(parsed.records) - passed_over
    if junk_tail:
        damage.note(base_offset + end)
        damage.lines += 1
    return parsed


def _lines_not_blank(data: bytes, end: int) -> int:
    """How many of the lines before `end` (which follows a newline) are not blank."""
    count = 0
    start = 0
    while start < end:
        stop = data.index(b"\n", min(start + _CHUNK, end) - 1, end) + 1
        count += data[start:stop].translate(_NOT_NEWLINE, _WHITESPACE).count(b"X\n")
        start = stop
    return count


def _note_junk(data: bytes, start: int, stop: int, base_offset: int, damage: Damage) -> None:
    """Note the first line between `start` and `stop` (no record among them) that is not blank."""
    while start < stop:
        newline = data.find(b"\n", start, stop)
        line_end = stop if newline < 0 else newline
        if data[start:line_end].strip():
            damage.note(base_offset + start)
            return
        start = line_end + 1


def _decode(line: bytes) -> tuple[dict[str, Any], RunStat] | None:
    try:
        value = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("schema"), int):
        return None
    stat = run_stat(value)
    return None if stat is None else (value, stat)


def read_from(
    path: Path, offset: int = 0, limit: int | None = None, key: str | None = None
) -> Parsed:
    """Records from `offset` to the last whole line. A missing file has none.

    With `limit`, at most the newest `limit` bytes of that stretch are read (from the first
    line that starts in them); the older part is left unread (`damage.unread`). With `key`,
    only the records that may count for that key hash (`parse_lines`). Raises OSError
    (UnsafePath) for a file that is not a plain file of this user's.
    """
    fd = open_readable(path, mine())
    if fd is None:
        return Parsed()
    try:
        size = os.fstat(fd).st_size
        start = offset if limit is None else max(offset, size - limit)
        # Only what the file held when looked at: appends meanwhile are read next time.
        data = os.pread(fd, max(0, size - start), start)
    finally:
        os.close(fd)
    skipped = start - offset
    if skipped > 0:
        # The line the cut fell into is not whole: it belongs to the part left unread.
        cut = data.find(b"\n") + 1
        if cut == 0:
            cut = len(data)
        data, start, skipped = data[cut:], start + cut, skipped + cut
    parsed = parse_lines(data, start, key)
    parsed.damage.unread = skipped
    return parsed


def tail(path: Path, count: int, limit: int) -> Parsed:
    """The last `count` records (fewer if the file has fewer), reading backwards in blocks,
    never more than the last `limit` bytes."""
    fd = open_readable(path, mine())
    if fd is None:
        return Parsed()
    try:
        data, start = read_tail(fd, count, limit)
    finally:
        os.close(fd)
    if start > 0:
        # Skip the partial first line.
        cut = data.find(b"\n") + 1
        data, start = data[cut:] if cut else b"", start + (cut or len(data))
    parsed = parse_lines(data, start)
    keep = min(count, len(parsed.records))
    parsed.records = parsed.records[len(parsed.records) - keep :]
    parsed.stats = parsed.stats[len(parsed.stats) - keep :]
    return parsed


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
        #: The damage found, and the name the old file was kept under as evidence.
        self.damage: str | None = None
        self.kept_as: str | None = None


def compacted(parsed: Parsed, budget: int, now: float | None = None) -> Compaction:
    """The lines a compacted history keeps, in file order (see the module docstring)."""
    records = [record for _, record in parsed.records]
    count = len(records)
    result = Compaction()
    result.records_before = count
    newest = max((stat.started_at for stat in parsed.stats), default=0.0)
    # The newest run's date, so that a history compacts alike whenever it does; but not one
    # recorded while the wall clock was ahead (a wrong date, put right since): against that,
    # every run of today would look older than MAX_AGE and go.
    clock = now if now is not None else min(max(newest, 0.0), time.time() + FUTURE_SLACK)
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
    holding history_lock.

    Only the newest `read_limit(max_bytes)` or COMPACT_READ_BYTES bytes, whichever is more,
    are read, so compacting a file that grew far past any limit (junk) costs no more than
    compacting a large history. The old file stays beside the new one: as history.jsonl.1, or,
    when it held damaged lines or was left partly unread, as history.jsonl.damaged-TIME-PID
    (the evidence, until the user removes it).
    """
    path = history_path(state_dir)
    parsed = read_from(path, 0, max(read_limit(max_bytes), COMPACT_READ_BYTES))
    result = compacted(parsed, max_bytes // 2, now)
    damaged = bool(parsed.damage.lines or parsed.damage.unread)
    if damaged:
        result.damage = parsed.damage.describe()
    # Those of a compaction killed halfway, which would otherwise stay: the new history (up to
    # half the size limit) and a link keeping the whole old one on disk.
    remove_left_temp_files(state_dir, _TEMP_RE)
    # The old file is linked to its new name, not moved: readers always find a history.jsonl.
    previous = damaged_name(path) if damaged else path.with_name(FILENAME + ".1")
    link = path.with_name(f".{FILENAME}.1.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        link.unlink()
    try:
        os.link(path, link)
    except OSError as exc:
        if exc.errno not in _NO_HARD_LINKS:
            raise
        # A file system without hard links (FAT, many FUSE ones): the old file is copied.
        _copy(path, link)
    os.replace(link, previous)
    if damaged:
        result.kept_as = previous.name
        prune_damaged(path, previous)
    write_atomic(path, b"".join(result.lines))
    return result


#: What link(2) says on a file system that has no hard links.
_NO_HARD_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS)


def _copy(source: Path, target: Path) -> None:
    """Copy the file `source` to a new file `target` (0600), removed again should it fail."""
    fd_in = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd_out = os.open(target, flags, 0o600)
        try:
            while chunk := os.read(fd_in, 1 << 20):
                while chunk:
                    chunk = chunk[os.write(fd_out, chunk) :]
        except BaseException:
            with contextlib.suppress(OSError):
                target.unlink()
            raise
        finally:
            os.close(fd_out)
    finally:
        os.close(fd_in)


#: How much of the history's end is read at a time, and all that `latest_outcomes` reads
#: without jobs it must find.
FIND_TAIL_BYTES = 2**20
#: How much of it is searched, as far as it must, for a job named by `--after` (`find_outcome`),
#: for the jobs a waiter still depends on (`latest_outcomes`' `wanted`), and for a batch's
#: failure the ledger no longer names (`batch_outcomes`): a sweep's runs each keep a command
#: of up to 8 KiB of arguments (a thousand file names), and a thousand of them take ten times
#: FIND_TAIL_BYTES.
DEPENDENCY_TAIL_BYTES = 2**24


def find_outcome(state_dir: Path, ref: str) -> RunOutcome | None:
    """How the latest run in the history's end whose job id or name is `ref` ended; None if
    there is none (read back as far as DEPENDENCY_TAIL_BYTES)."""
    for record in _latest_records(state_dir, DEPENDENCY_TAIL_BYTES):
        if ref not in (record.get("job_id"), record.get("name")):
            continue
        found = outcome(record)
        if found is not None:
            return found
    return None


def batch_outcomes(state_dir: Path, batch: str) -> Iterator[RunOutcome]:
    """How each job of `batch` with a run in the history's end ended, by its latest run;
    newest first, read back a piece at a time as far as DEPENDENCY_TAIL_BYTES as long as the
    caller asks for more (a sweep's runs may each keep 8 KiB of arguments)."""
    return _job_outcomes(state_dir, batch, DEPENDENCY_TAIL_BYTES)


def _job_outcomes(state_dir: Path, batch: str | None, tail: int) -> Iterator[RunOutcome]:
    """How each job with a run in the history's last `tail` bytes (of `batch`, where given)
    ended, by its latest run (a job run again after running out of memory ends as its last
    run did); newest first, read as far as the caller asks."""
    seen: set[str] = set()
    for record in _latest_records(state_dir, tail):
        if batch is not None and record.get("batch") != batch:
            continue
        ran = outcome(record)
        if ran is not None and ran.job_id not in seen:
            seen.add(ran.job_id)
            yield ran


def latest_outcomes(
    state_dir: Path, batch: str | None = None, wanted: Collection[str] = ()
) -> dict[str, RunOutcome]:
    """How each job with a run in the history's end (of `batch`, where given) ended, by job
    id (`_job_outcomes`). With `wanted` (job ids), read back as far as DEPENDENCY_TAIL_BYTES
    until each of those is found."""
    found: dict[str, RunOutcome] = {}
    missing = set(wanted)
    tail = DEPENDENCY_TAIL_BYTES if missing else FIND_TAIL_BYTES
    for ran in _job_outcomes(state_dir, batch, tail):
        found[ran.job_id] = ran
        missing.discard(ran.job_id)
        if wanted and not missing:
            break
    return found


def _latest_records(state_dir: Path, tail: int = FIND_TAIL_BYTES) -> Iterator[dict[str, Any]]:
    """The records in the history's last `tail` bytes, newest first, read back a
    FIND_TAIL_BYTES at a time as far as they are asked for; damaged lines passed over."""
    path = history_path(state_dir)
    try:
        fd = open_readable(path, mine())
    except OSError:
        return
    if fd is None:
        return
    try:
        end = os.fstat(fd).st_size
        limit = max(0, end - tail)
        cut = b""  # the start of the last line read, which began before the bytes read
        while end > limit:
            start = max(limit, end - FIND_TAIL_BYTES)
            lines = (os.pread(fd, end - start, start) + cut).split(b"\n")
            end = start
            if start > limit:
                cut = lines.pop(0)
            for line in reversed(lines):
                try:
                    record = json.loads(line.decode("utf-8", "replace"))
                except (ValueError, RecursionError):  # damaged, or nested thousands deep
                    continue
                if isinstance(record, dict):
                    yield record
    except OSError:
        return
    finally:
        os.close(fd)
