"""What gpuwait learns from the history: the request for a command without --vram, the record
each run leaves, and expected run times (for the queue). Glue between the CLI, the history files
and the pure estimation math in gpuwait._estimate.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gpuwait import _histindex, _history
from gpuwait._cmdkey import EXPLICIT, CommandKey, command_key, explicit_key, key_hash
from gpuwait._digest import sha256_hex
from gpuwait._estimate import Estimate, RunStat, Spread, estimate, load_time, run_time, wait_time
from gpuwait._record import Record
from gpuwait._sizes import MemoryRequest
from gpuwait._snapshot import GpuSnapshot

FLAG = "flag"
ESTIMATE = "estimate"
DEFAULT = "default"

_LEVEL_WORDS = {
    "key": "runs with this --key",
    "command": "runs of this exact command",
    "script": "runs of this script",
    "program": "runs of this program",
}


class Level(Record, frozen=True):
    """One level of a command key and the runs the index has for it."""

    name: str
    text: str
    hash: str
    total_runs: int
    runs: tuple[RunStat, ...]


class Learned(Record, frozen=True):
    """Everything the history says about one command."""

    key: CommandKey
    levels: tuple[Level, ...]
    estimate: Estimate
    run_time: Spread | None
    wait_time: Spread | None
    load_time: Spread | None
    warnings: tuple[str, ...] = ()

    def basis(self) -> str:
        """`estimated from 3 runs of this exact command`, for the wait line and `estimate`."""
        est = self.estimate
        if est.bytes is None or est.level is None:
            return "no earlier runs"
        if est.runs == 0:
            return "raised after an out-of-memory failure"
        words = _LEVEL_WORDS.get(est.level, f"runs at level {est.level}")
        if est.runs == 1:
            words = words.replace("runs", "run", 1)
        text = f"estimated from {est.runs} {words}"
        if est.raised_by_oom:
            text += ", raised after an out-of-memory failure"
        return text


def key_for(command: Sequence[str], cwd: str, key: str | None) -> CommandKey:
    return explicit_key(key) if key else command_key(command, cwd)


def learn(
    state_dir: Path,
    command: Sequence[str],
    cwd: str,
    *,
    key: str | None = None,
    margin: float = 0.1,
    now: float | None = None,
) -> Learned:
    """Look the command up in the history index and estimate from what is found."""
    ckey = key_for(command, cwd, key)
    hashes = ckey.hashes()
    found = _histindex.lookup(state_dir, hashes.values())
    levels = []
    for name, text in ckey.levels:
        summary = found.keys.get(hashes[name])
        levels.append(
            Level(
                name=name,
                text=text,
                hash=hashes[name],
                total_runs=summary.total_runs if summary else 0,
                runs=tuple(summary.runs) if summary else (),
            )
        )
    clock = time.time() if now is None else now
    pairs = [(lv.name, lv.runs) for lv in levels]
    return Learned(
        key=ckey,
        levels=tuple(levels),
        estimate=estimate(pairs, clock, margin),
        run_time=run_time(pairs, clock),
        wait_time=wait_time(pairs, clock),
        load_time=load_time(pairs, clock),
        warnings=tuple(found.warnings),
    )


def expected_run_seconds(
    state_dir: Path, command: Sequence[str], cwd: str, key: str | None = None
) -> float | None:
    """Median run time of the command's successful runs, or None without history."""
    spread = learn(state_dir, command, cwd, key=key).run_time
    return None if spread is None else spread.median


class RequestChoice(Record, frozen=True):
    """The request a run waits for, where it came from, and what to tell the user about it."""

    request: MemoryRequest | None
    source: str
    note: str | None = None
    learned: Learned | None = None


def choose_request(
    vram_flag: MemoryRequest | None,
    default: MemoryRequest | None,
    state_dir: Path,
    command: Sequence[str],
    cwd: str,
    *,
    key: str | None,
    margin: float,
) -> RequestChoice:
    """--vram when given; else the estimate from earlier runs; else the default_vram setting."""
    if vram_flag is not None:
        return RequestChoice(vram_flag, FLAG)
    learned = learn(state_dir, command, cwd, key=key, margin=margin)
    if learned.estimate.bytes is not None:
        note = learned.basis()
        if learned.estimate.approximate:
            note += ", some measured approximately"
        return RequestChoice(MemoryRequest(bytes=learned.estimate.bytes), ESTIMATE, note, learned)
    what = "this --key" if key else "this command"
    return RequestChoice(default, DEFAULT, f"no earlier runs of {what}: default_vram", learned)


def cap_to_cards(
    choice: RequestChoice,
    gpus: Sequence[GpuSnapshot],
    candidates: Sequence[str] | None,
    safety: float,
) -> RequestChoice:
    """An estimate above every candidate card's usable memory asks for the largest one instead:
    the learned size must never make a command impossible that --vram would not."""
    request = choice.request
    if choice.source != ESTIMATE or request is None or request.bytes is None:
        return choice
    usable = [
        int(g.total_bytes * safety) for g in gpus if candidates is None or g.uuid in candidates
    ]
    if not usable or request.bytes <= max(usable):
        return choice
    note = f"{choice.note}; capped at the largest card"
    return RequestChoice(MemoryRequest(bytes=max(usable)), ESTIMATE, note, choice.learned)


def command_hash(command: Sequence[str]) -> str:
    return sha256_hex(shlex.join(command))[:20]


def kept_command(command: Sequence[str], cwd: str, history_commands: str) -> list[str]:
    """The command as files that outlive the run keep it: whole, or in `hash` mode only the
    program and a hash of the line (`python [3f2a...]`), as `history` shows it."""
    if history_commands == "full":
        return list(command)
    return [command_key(command, cwd).program, f"[{command_hash(command)[:12]}]"]


def build_record(
    *,
    job_id: str,
    command: Sequence[str],
    cwd: str,
    key: str | None,
    history_commands: str,
    choice: RequestChoice,
    request_json: Mapping[str, float | int],
    reserved_bytes: int,
    gpus: Sequence[GpuSnapshot],
    peak_by_gpu: Mapping[str, int],
    peak_approximate: bool,
    time_to_peak: float | None,
    samples: int,
    free_at_peak_bytes: Mapping[str, int],
    wait_seconds: float,
    run_seconds: float,
    started_at: float,
    returncode: int,
    oom: bool,
    oom_evidence: str | None,
    stderr_watched: str,
) -> dict[str, Any]:
    """One history record. In `hash` mode the command line and an explicit key are left out;
    their hashes (which estimates match on anyway) stay."""
    ckey = command_key(command, cwd)
    keys = ckey.hashes()
    if key:
        keys[EXPLICIT] = key_hash(EXPLICIT, key)
    full = history_commands == "full"
    return {
        "job_id": job_id,
        "command": list(command) if full else None,
        "command_hash": command_hash(command),
        "program": ckey.program,
        "key": key if full else None,
        "keys": keys,
        "cwd": cwd,
        "request": dict(request_json),
        "request_source": choice.source,
        "reserved_bytes": reserved_bytes,
        "gpus": [
            {"uuid": g.uuid, "index": g.index, "name": g.name, "total_bytes": g.total_bytes}
            for g in gpus
        ],
        "peak_bytes": max(peak_by_gpu.values()) if peak_by_gpu else None,
        "peak_by_gpu": dict(peak_by_gpu),
        "peak_approximate": peak_approximate,
        "time_to_peak_seconds": None if time_to_peak is None else round(time_to_peak, 3),
        "samples": samples,
        "free_at_peak_bytes": dict(free_at_peak_bytes),
        "wait_seconds": round(wait_seconds, 3),
        "run_seconds": round(run_seconds, 3),
        "started_at": started_at,
        "exit_status": returncode if returncode >= 0 else None,
        "signal": -returncode if returncode < 0 else None,
        "oom": oom,
        "oom_evidence": oom_evidence,
        "stderr_watched": stderr_watched,
    }


def save_record(state_dir: Path, record: dict[str, Any], max_bytes: int) -> list[str]:
    """Append the record and bring the index up to date, so the next launch reads no history.

    Returns warnings for the CLI; raises OSError when the history cannot be written.
    """
    _history.append_record(state_dir, record, max_bytes)
    return _histindex.refresh(state_dir)


def describe_request(choice: RequestChoice) -> str:
    if choice.request is None:
        return "a whole GPU"
    return choice.request.describe()
