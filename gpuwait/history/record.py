"""The history record, defined once: what a finished run leaves in history.jsonl, and every way
of reading one back (the figures estimates use, the keys it counts under, how it ended).

A record is one JSON object per line:

    job_id, name, batch              the job (--name and --batch, for `--after NAME`)
    command, command_hash, program   the command line (None in `hash` mode), its hash, the program
    key, keys, cwd                   --key (None in `hash` mode); level -> key hash; where it ran
    request, request_source          what was asked ({"bytes": n} ...) and where that came from
    reserved_bytes, gpus             what it got: per GPU; [{uuid, index, name, total_bytes}]
    peak_bytes, peak_by_gpu          the process tree's peak, overall and per GPU UUID (a
                                     --pausable job's: of all its runs)
    peak_approximate                 the peak came from the card's used memory
    time_to_peak_seconds, samples    how long it took to load (90 % of the peak); readings taken
    free_at_peak_bytes               free memory per GPU at the peak
    wait_seconds, run_seconds        the wait before its first start; its run time (a
                                     --pausable job's: its last run's)
    started_at                       Unix time of its start (a --pausable job's: of its last
                                     run, whose run_seconds it has: it ended at their sum)
    exit_status, signal              how it ended (one of them is None; both where nobody saw
                                     it: an adopted process, a reservation's exit unseen, a
                                     lost run)
    adopted, lost                    only when true: a process given a place with `gpuwait
                                     adopt`; a run whose gpuwait was killed, recorded when its
                                     entry was reaped (its peak the last one published)
    stopped_by                       only when a signal asking it to stop (TERM, INT, HUP, QUIT)
                                     reached it during the run: its number. Such a run may have
                                     ended early, so estimates do not count it as a success
    oom, oom_evidence                an out-of-memory failure, told by "message", "card full" or
                                     "at its limit" (an enforced budget's peak near its limit,
                                     stderr not watched)
    oom_cause                        how it came about: "own limit" (its budget refused it),
                                     "card full", "unknown"
    oom_wanted_bytes                 only when its out-of-memory message said: what it needed
                                     at the least (what it had plus what it tried to allocate)
    budget                           how its reservation was held: {enforce, held_by,
                                     limit_bytes} (absent with enforce = off and for whole GPUs)
    stderr_watched                   how its stderr was watched ("pipe", "file", "off")
    pauses, paused_seconds           --pausable jobs: how often it stepped aside, and for how long
    paused_runs_seconds              --pausable jobs: the run time of the runs that ended by
                                     stepping aside; estimates count it with run_seconds, since
                                     a run that is not paused does all that work
    sized_by_reservation             only when its command line sizes it from its reservation
                                     (names GPUWAIT_VRAM_FRACTION or GPUWAIT_VRAM_BYTES): true.
                                     Its peak is what it was given, not what it needs
    over_reservation                 only when its peak passed its reservation by more than the
                                     margin: {gpu, used_bytes, cause, advice}

Compaction may cut a record down to what estimates read (`slim`).
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from gpuwait.core.budget import Budget, sizes_itself
from gpuwait.core.cmdkey import EXPLICIT, command_key, key_hash
from gpuwait.core.digest import sha256_hex
from gpuwait.core.estimate import DEFAULT_MARGIN, RunStat
from gpuwait.core.overuse import overuse
from gpuwait.core.policy import reserved_on
from gpuwait.core.record import Record
from gpuwait.core.sizes import MAX_SIZE
from gpuwait.core.snapshot import GpuSnapshot

SCHEMA = 2
#: Marks a record compaction cut down to what estimates read (see slim()).
SLIM = "slim"
#: {key hash: runs of that key compaction left out before this record}.
EARLIER = "earlier_runs"
#: What run_stat() reads, with the value that reading a missing field amounts to.
_STAT_FIELDS: dict[str, Any] = {
    "started_at": None,
    "peak_bytes": None,
    "reserved_bytes": 0,
    "exit_status": None,
    "signal": None,
    "stopped_by": None,
    "oom": False,
    "peak_approximate": False,
    "run_seconds": 0,
    "paused_runs_seconds": 0,
    "wait_seconds": 0,
    "time_to_peak_seconds": None,
    "sized_by_reservation": False,
    "oom_wanted_bytes": None,
}


class Measured(Record, frozen=True):
    """What a run's supervision measured, for its record."""

    peak_by_gpu: Mapping[str, int]
    peak_approximate: bool
    time_to_peak: float | None
    samples: int
    free_at_peak_bytes: Mapping[str, int]
    run_seconds: float
    #: As RunResult's; None: how the run ended is unknown (exit_status and signal are None).
    returncode: int | None
    oom: bool
    oom_evidence: str | None
    stderr_watched: str
    oom_cause: str | None = None
    #: What the out-of-memory message said the command needed at the least, where it said.
    oom_wanted_bytes: int | None = None
    #: The signal that asked the command to stop during the run (TERM, INT ...), if one did.
    stopped_by: int | None = None


def command_hash(command: Sequence[str]) -> str:
    return sha256_hex(shlex.join(command))[:20]


def build(
    *,
    job_id: str,
    name: str | None,
    batch: str | None,
    command: Sequence[str],
    cwd: str,
    key: str | None,
    history_commands: str,
    request: Mapping[str, float | int],
    request_source: str,
    reserved_bytes: int,
    gpus: Sequence[GpuSnapshot],
    measured: Measured,
    wait_seconds: float,
    started_at: float,
    pauses: tuple[int, float] | None = None,
    margin: float = DEFAULT_MARGIN,
    held: Budget | None = None,
    paused_runs_seconds: float = 0.0,
    reserved_by_gpu: Mapping[str, int] | None = None,
    shown: Sequence[str] | None = None,
) -> dict[str, Any]:
    """One history record (see the module docstring). In `hash` mode the command line and an
    explicit key are left out; their hashes (which estimates match on anyway) stay.
    `shown`: the command line as the record keeps it, where it is not `command` (the ledger's,
    each argument within its limits); keys and hashes always come from `command`, whole, as
    the next launch of it looks them up.
    `pauses`: a --pausable job's pauses and the seconds it spent stepped aside;
    `paused_runs_seconds`: the run time of its runs before the last (each ended stepping aside)."""
    ckey = command_key(command, cwd)
    keys = ckey.hashes()
    if key:
        keys[EXPLICIT] = key_hash(EXPLICIT, key)
    full = history_commands == "full"
    peaks = measured.peak_by_gpu
    returncode = measured.returncode
    record: dict[str, Any] = {
        "job_id": job_id,
        "name": name,
        "batch": batch,
        "command": list(command if shown is None else shown) if full else None,
        "command_hash": command_hash(command),
        "program": ckey.program,
        "key": key if full else None,
        "keys": keys,
        "cwd": cwd,
        "request": dict(request),
        "request_source": request_source,
        "reserved_bytes": reserved_bytes,
        "gpus": [
            {"uuid": g.uuid, "index": g.index, "name": g.name, "total_bytes": g.total_bytes}
            for g in gpus
        ],
        "peak_bytes": max(peaks.values()) if peaks else None,
        "peak_by_gpu": dict(peaks),
        "peak_approximate": measured.peak_approximate,
        "time_to_peak_seconds": None
        if measured.time_to_peak is None
        else round(measured.time_to_peak, 3),
        "samples": measured.samples,
        "free_at_peak_bytes": dict(measured.free_at_peak_bytes),
        "wait_seconds": round(wait_seconds, 3),
        "run_seconds": round(measured.run_seconds, 3),
        "started_at": started_at,
        "exit_status": returncode if returncode is not None and returncode >= 0 else None,
        "signal": -returncode if returncode is not None and returncode < 0 else None,
        "oom": measured.oom,
        "oom_evidence": measured.oom_evidence,
        "stderr_watched": measured.stderr_watched,
    }
    if measured.oom:
        record["oom_cause"] = measured.oom_cause
        if measured.oom_wanted_bytes is not None:
            record["oom_wanted_bytes"] = measured.oom_wanted_bytes
    if measured.stopped_by is not None:
        record["stopped_by"] = measured.stopped_by
    if sizes_itself(command):
        record["sized_by_reservation"] = True
    if held is not None and held.held_by:
        record["budget"] = {
            "enforce": held.mode,
            "held_by": list(held.held_by),
            "limit_bytes": reserved_bytes if held.enforced else None,
        }
    if pauses is not None:
        record["pauses"], record["paused_seconds"] = pauses[0], round(pauses[1], 3)
        record["paused_runs_seconds"] = round(paused_runs_seconds, 3)
    totals = {g.uuid: g.total_bytes for g in gpus}
    for uuid, peak in sorted(peaks.items(), key=lambda item: -item[1]):
        # On cards of different sizes it reserved less on some (`reserved_by_gpu`).
        reserved = reserved_on(reserved_bytes, reserved_by_gpu or {}, uuid)
        found = overuse(reserved, peak, totals.get(uuid, 0), margin)
        if found is not None:
            # Its neighbours had less room than the plan gave them: the record says so and why.
            record["over_reservation"] = {
                "gpu": uuid,
                "used_bytes": peak,
                "cause": found.cause(),
                "advice": found.advice(),
            }
            break
    return record


def encode(record: dict[str, Any]) -> bytes:
    """A new record as its line (the schema added)."""
    return encode_existing({"schema": SCHEMA, **record})


def encode_existing(record: dict[str, Any]) -> bytes:
    """A record read back (it carries its schema) as its line."""
    return (json.dumps(record, separators=(",", ":"), sort_keys=True) + "\n").encode()


# --- reading --------------------------------------------------------------------------------


#: The longest run time or wait a record may hold: ten years. More is a damaged figure.
MAX_RECORDED_SECONDS = 10 * 365 * 86400.0


def figure(value: Any, most: float | None = None) -> float:
    """`value` as a finite number up to `most`; ValueError where it is none (a record's, or
    the history index's, damaged or edited by hand)."""
    # type() rather than isinstance(): bool is an int, and is no figure.
    if type(value) is not int and type(value) is not float:
        raise ValueError("not a number")
    if value != value or value in (math.inf, -math.inf):
        raise ValueError("not a finite number")
    if most is not None and value > most:
        # A size past any GPU's (1 PiB), a run of centuries: damaged, or edited by hand. Read
        # as a figure, it would ask for the largest card at every launch of the command.
        raise ValueError("beyond any real figure")
    return float(value)


def _bytes(value: Any) -> int:
    return max(0, int(figure(value, MAX_SIZE)))


def _seconds(value: Any) -> float:
    return max(0.0, figure(value, MAX_RECORDED_SECONDS))


def gpu_uuids(record: Mapping[str, Any]) -> tuple[str, ...]:
    """The GPUs a run had; () when the record does not say (a slim one never does)."""
    gpus = record.get("gpus")
    if not isinstance(gpus, list):
        return ()
    uuids = [g.get("uuid") for g in gpus if isinstance(g, dict)]
    return tuple(u for u in uuids if isinstance(u, str))


def held_bytes(record: Mapping[str, Any]) -> int | None:
    """What a run held on all its GPUs together (the sum of its peaks on each); None where
    the record does not say."""
    peaks = record.get("peak_by_gpu")
    if not isinstance(peaks, dict) or not peaks:
        return None
    return sum(_bytes(value) for value in peaks.values())


def _wanted(value: Any) -> int | None:
    """An OOM message's figure as recorded; None for none, or for one that cannot be right (a
    damaged record's: it would raise the estimate past any card, for good)."""
    try:
        wanted = None if value is None else _bytes(value)
    except (ValueError, TypeError, OverflowError):
        return None
    return wanted or None


def run_stat(record: dict[str, Any]) -> RunStat | None:
    """The figures estimates use, or None if the record lacks them or they are malformed."""
    get = record.get
    try:
        peak = get("peak_bytes")
        to_peak = get("time_to_peak_seconds")
        return RunStat(
            started_at=figure(get("started_at")),
            peak_bytes=None if peak is None else _bytes(peak),
            reserved_bytes=_bytes(get("reserved_bytes", 0)),
            # A run told to stop (TERM, Ctrl-C) may have ended before its peak, exit 0 or not.
            ok=get("exit_status") == 0 and get("signal") is None and get("stopped_by") is None,
            oom=get("oom") is True,
            unseen=get("exit_status") is None and get("signal") is None,
            approximate=get("peak_approximate") is True,
            # A run that stepped aside did its work in several runs: a fresh one does it all.
            run_seconds=_seconds(get("run_seconds", 0)) + _seconds(get("paused_runs_seconds", 0)),
            wait_seconds=_seconds(get("wait_seconds", 0)),
            time_to_peak=None if to_peak is None else _seconds(to_peak),
            gpu_uuids=gpu_uuids(record),
            held_bytes=None if peak is None else held_bytes(record),
            sized_by_reservation=get("sized_by_reservation") is True,
            oom_wanted_bytes=_wanted(get("oom_wanted_bytes")) if get("oom") is True else None,
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


def earlier_runs(record: dict[str, Any]) -> dict[str, int]:
    """Key hash -> runs of that key that compaction left out before this record (malformed
    entries are ignored: they only make a count shown by `estimate` smaller)."""
    value = record.get(EARLIER)
    if not isinstance(value, dict):
        return {}
    return {
        k: n for k, n in value.items() if isinstance(k, str) and type(n) is int and 0 < n < 2**53
    }


def is_slim(record: dict[str, Any]) -> bool:
    return record.get(SLIM) is True


def slim(record: dict[str, Any], keys: dict[str, str] | None = None) -> dict[str, Any]:
    """The record cut down to what estimates read: run_stat() and record_keys() (given as
    `keys` when known) give the same for it as for the whole record, but for the GPU of a run
    on one, which is left out: only per-GPU run times read it, and those come from the newest
    runs, which compaction keeps whole. A run on several GPUs keeps their UUIDs and its peak
    on each: a job on fewer counts it for what it held on all of them (a model split across
    its cards), not for its peak on one. Fields whose absence reads the same are left out."""
    cut: dict[str, Any] = {
        "schema": SCHEMA,
        SLIM: True,
        "keys": record_keys(record) if keys is None else keys,
    }
    for name, absent in _STAT_FIELDS.items():
        value = record.get(name, absent)
        # `is` for False: 0 == False, and an exit status of 0 must stay.
        if name in record and not (value is absent or (absent is not False and value == absent)):
            cut[name] = value
    uuids = gpu_uuids(record)
    if len(uuids) > 1:
        cut["gpus"] = [{"uuid": uuid} for uuid in uuids]
        if isinstance(record.get("peak_by_gpu"), dict):
            cut["peak_by_gpu"] = record["peak_by_gpu"]
    earlier = earlier_runs(record)
    if earlier:
        cut[EARLIER] = earlier
    return cut


class RunOutcome(Record, frozen=True):
    """How a run ended, as `--after` needs it of a job that left the ledger's own record."""

    job_id: str
    name: str | None
    ended_at: float
    exit_status: int | None
    signal: int | None


def outcome(record: dict[str, Any]) -> RunOutcome | None:
    """The run's outcome, or None when the record does not name its job."""
    job_id = record.get("job_id")
    if not isinstance(job_id, str):
        return None
    status, signal = record.get("exit_status"), record.get("signal")
    started, ran = record.get("started_at"), record.get("run_seconds")
    ended = 0.0
    if isinstance(started, (int, float)) and isinstance(ran, (int, float)):
        ended = float(started) + float(ran)
    name = record.get("name")
    return RunOutcome(
        job_id=job_id,
        name=name if isinstance(name, str) else None,
        ended_at=ended if 0 <= ended < 1e11 else 0.0,
        exit_status=status if isinstance(status, int) else None,
        signal=signal if isinstance(signal, int) else None,
    )
