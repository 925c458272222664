"""The event log: one JSON line per thing that happened to the queue, in events.jsonl.

Each line carries `schema`, `time` (Unix seconds), `kind`, and the kind's fields. The kinds, all
written by gpuwait.queue.lifecycle once the change they report is in the ledger:

    submit            a job entered the queue: job, name, batch, priority, command
    admit             a plan gave it GPUs: job, name, gpus, reserved_bytes, waited, backfill
    start             its command started: job, name, pid
    finish            a job that ran left the queue: job, name, outcome, exit_status, signal,
                      gpus, run_seconds (and pauses, paused_seconds for --pausable jobs)
    leave             a job left without running (gave up, interrupted, a dependency failed):
                      job, name, outcome, and what `finish` has where it applies
    cancel            `gpuwait cancel` named it: job, name, state, by_uid, refused
    orphaned          its gpuwait process is gone but its command runs on; the entry keeps the
                      command's room until the command ends: job, pid, child_pid, gpus
    reap              its gpuwait process (and its command) were gone, so its entry was removed:
                      job, pid, state, gpus
    gpu_lost          a GPU stopped answering: gpu, index, detail
    gpu_back          a lost GPU answers again: gpu, index
    gpu_added         a GPU not seen before answers: gpu, index
    over-reservation  a running job uses more than its reservation (said once, when first seen):
                      job, name, gpu, reserved_bytes, used_bytes, cause, advice
    pause-request     a waiter asked running jobs to step aside: job (the waiter), victims, gpu
    pause-signal      a job was sent its checkpoint signal: job, pids
    paused            a job checkpointed and queues to resume: job, pauses, ran_seconds
    pause-grace-kill  a job did not step aside within its grace and got TERM: job
    freeze            a --freezable job was frozen and waits to be thawed: job, pids, gpus
    freeze-failed     freezing failed, the job runs on: job, error
    thaw              a frozen job got its memory back and runs on: job, frozen_seconds
    thaw-failed       thawing failed, tried again: job, error

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
from typing import Any, Literal, get_args

from gpuwait.linux import signals
from gpuwait.linux.atomic import (
    end_of_cut_line,
    ensure_private_dir,
    open_private_append,
    read_tail,
)
from gpuwait.linux.lock import LockTimeout, exclusive
from gpuwait.linux.security import UnsafePath, is_shared_dir, mine, open_readable

SCHEMA = 1
FILENAME = "events.jsonl"
MAX_BYTES = 4 * 2**20
KEEP = 3

Kind = Literal[
    "submit",
    "admit",
    "start",
    "finish",
    "leave",
    "cancel",
    "orphaned",
    "reap",
    "gpu_lost",
    "gpu_back",
    "gpu_added",
    "over-reservation",
    "pause-request",
    "pause-signal",
    "paused",
    "pause-grace-kill",
    "freeze",
    "freeze-failed",
    "thaw",
    "thaw-failed",
    "adopt",
]
#: Every kind, in the order above (`gpuwait log --help` lists them).
KINDS: tuple[str, ...] = get_args(Kind)


def events_path(state_dir: Path) -> Path:
    return state_dir / FILENAME


def emit(state_dir: Path, kind: Kind, **fields: Any) -> None:
    """Append one event; never raises."""
    record = {"schema": SCHEMA, "time": round(time.time(), 6), "kind": kind, **fields}
    line = (json.dumps(record, separators=(",", ":"), sort_keys=True) + "\n").encode()
    path = events_path(state_dir)
    try:
        # A shared ledger directory keeps no event log (docs/queue-and-status.md): a log there would be one
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
            line = end_of_cut_line(path, os.fstat(fd).st_size) + line
            os.write(fd, line)
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        if size > MAX_BYTES:
            _rotate(state_dir, path)
    except (LockTimeout, signals.SignalPending):
        # Another writer holds its lock: rotating it, or leaving it to the next writer. (A
        # signal waiting for gpuwait's loop stays pending for it.)
        pass
    except OSError as exc:
        if signals.raised_by_a_handler(exc):
            raise  # the timeout of a program that reserves from Python (gpuwait.reserve)


def _rotate(state_dir: Path, path: Path) -> None:
    """Rotate the log past MAX_BYTES; LockTimeout where another writer holds the lock: it is
    rotating it (a log a little past its size does no harm), or keeps the lock (stopped, hung),
    and waiting for it would hold up every job's every step."""
    with (
        exclusive(state_dir / "events.lock", timeout=0),
        contextlib.suppress(FileNotFoundError),
    ):
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
    except (ValueError, RecursionError):  # damaged, or nested thousands deep
        return None
    if (
        not isinstance(record, dict)
        or not isinstance(record.get("kind"), str)
        or not isinstance(record.get("time"), (int, float))
    ):
        return None
    return record


def _files(state_dir: Path) -> list[Path]:
    """The log's files, oldest first (rotated files included)."""
    path = events_path(state_dir)
    return [path.with_name(f"{path.name}.{n}") for n in range(KEEP, 0, -1)] + [path]


def _parsed(data: bytes) -> list[dict[str, Any]]:
    text = data.decode("utf-8", errors="replace")
    return [e for e in map(parse_line, text.splitlines()) if e is not None]


def read_events(state_dir: Path) -> list[dict[str, Any]]:
    """Every event still kept, oldest first (rotated files included).

    Each file is read up to its last 2 × MAX_BYTES (a log is rotated at MAX_BYTES, so only a
    damaged one is larger). Raises OSError (UnsafePath) for a file there that is not a plain
    file of this user's, which is never waited on.
    """
    events: list[dict[str, Any]] = []
    for file in _files(state_dir):
        fd = open_readable(file, mine())
        if fd is None:
            continue
        try:
            size = os.fstat(fd).st_size
            start = max(0, size - 2 * MAX_BYTES)
            data = os.pread(fd, size - start, start)
        finally:
            os.close(fd)
        if start:
            data = data[data.find(b"\n") + 1 :]  # the line the cut fell into
        events.extend(_parsed(data))
    return events


def read_last(state_dir: Path, count: int) -> list[dict[str, Any]]:
    """The last `count` events kept, oldest first, as `read_events` has them: read backwards
    from the end of the newest file, so that a long log (a busy machine's four files) costs
    what the events asked for do, not a reading of all of it. Raises as `read_events`."""
    chunks: list[list[dict[str, Any]]] = []
    needed = count
    for file in reversed(_files(state_dir)):
        if needed <= 0:
            break
        fd = open_readable(file, mine())
        if fd is None:
            continue
        try:
            found = _last_of(fd, needed)
        finally:
            os.close(fd)
        chunks.append(found)
        needed -= len(found)
    return [event for chunk in reversed(chunks) for event in chunk][-count:] if count else []


def _last_of(fd: int, count: int) -> list[dict[str, Any]]:
    """The last `count` events of one file (fewer where it has fewer), within its last
    2 × MAX_BYTES; lines that are no events are passed over."""
    limit = 2 * MAX_BYTES
    floor = max(0, os.fstat(fd).st_size - limit)
    lines = count
    while True:
        data, start = read_tail(fd, lines, limit)
        if start:
            data = data[data.find(b"\n") + 1 :]  # the line the cut fell into
        events = _parsed(data)
        if len(events) >= count or start <= floor:
            return events[len(events) - min(count, len(events)) :]
        lines *= 2  # lines that were no events: read further back


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
            new = _rest_of(path, identity, offset)
            offset += len(new)
            chunk += new
        if not chunk:
            time.sleep(interval)
            continue
        pending += chunk
        *lines, pending = pending.split(b"\n")
        if len(pending) > MAX_BYTES:
            pending = b""  # no event is that long: junk, passed over
        for raw in lines:
            event = parse_line(raw.decode("utf-8", errors="replace"))
            if event is not None:
                yield event


def _rest_of(path: Path, identity: tuple[int, int] | None, offset: int) -> bytes:
    """What was appended to the file `identity` after `offset` (at most MAX_BYTES at a time),
    if `path` is still that file."""
    try:
        fd = open_readable(path, mine())
    except UnsafePath:
        raise
    except OSError:
        return b""
    if fd is None:
        return b""
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != identity:
            return b""
        return os.pread(fd, MAX_BYTES, offset)
    except OSError:
        return b""
    finally:
        os.close(fd)
