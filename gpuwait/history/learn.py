"""What gpuwait learns from the history, in one place: the VRAM request of a command run without
--vram, and how long it runs (overall, and on each GPU it ran on).

Backfill (a job may start on a GPU held for the queue's head only if it is expected to end
before the head can start), the ETAs of `gpuwait status`, the cost of pausing a job and the
adaptive-throughput strategy all read run times from `learn()`. Where there is no history a
figure is unknown (None): gpuwait then never backfills that job onto a held GPU and shows no ETA
for what waits behind it. The estimation rules themselves are pure: gpuwait.core.estimate.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from gpuwait.core.cmdkey import PROGRAM, CommandKey, command_key, explicit_key, runs_other_code
from gpuwait.core.estimate import (
    DEFAULT_HISTORY_MAX_BYTES,
    DEFAULT_MARGIN,
    Estimate,
    RunStat,
    Spread,
    estimate,
    load_time,
    run_time,
    run_time_on,
    usable_levels,
    wait_time,
)
from gpuwait.core.policy import Requirements, prohibited, whole_card_room
from gpuwait.core.record import Record
from gpuwait.core.sizes import MemoryRequest
from gpuwait.core.snapshot import GpuSnapshot
from gpuwait.history import index, store
from gpuwait.history.record import command_hash
from gpuwait.linux.lock import Patience
from gpuwait.linux.signals import SignalPending

FLAG = "flag"
ESTIMATE = "estimate"
DEFAULT = "default"

LEVEL_WORDS = {
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
    #: The moment the runs were judged at (runs age).
    now: float = 0.0

    def basis(self) -> str:
        """`estimated from 3 runs of this exact command`, for the wait line and `estimate`."""
        est = self.estimate
        if self.key.typed_in:
            return "its code is typed or piped in"
        if est.bytes is None or est.level is None:
            return "no earlier runs"
        if est.runs == 0:
            return "raised after an out-of-memory failure"
        words = LEVEL_WORDS.get(est.level, f"runs at level {est.level}")
        if est.runs == 1:
            words = words.replace("runs", "run", 1)
        if est.rule == "largest":
            # Coarser than the exact command: other arguments may need more than any one run.
            other = " (other arguments)" if est.level == "script" else ""
            text = f"largest peak of {est.runs} {words}{other}"
        else:
            text = f"estimated from {est.runs} {words}"
        if est.spread_over_fewer:
            text += ", those on more GPUs for what they held in all"
        if est.raised_by_oom:
            text += ", raised after an out-of-memory failure"
        return text

    def run_seconds_on(self, gpu_uuids: Iterable[str]) -> dict[str, float]:
        """Median run time of the command on each of these GPUs where it ran before (from the
        same runs as `run_time`); GPUs it never ran on are left out."""
        pairs = _usable(self.key, self.levels, self.now)
        found = {}
        for uuid in gpu_uuids:
            spread = run_time_on(pairs, self.now, uuid)
            if spread is not None:
                found[uuid] = spread.median
        return found


def _usable(ckey: CommandKey, levels: Sequence[Level], now: float) -> list[tuple[str, Any]]:
    """The levels whose runs may teach this command anything (gpuwait.core.estimate): none
    where its code is typed or piped in, which no earlier session's runs tell anything of."""
    if ckey.typed_in:
        return []
    program = ckey.text(PROGRAM)
    return usable_levels(
        [(lv.name, lv.runs) for lv in levels],
        now,
        program_runs_other_code=program is None or runs_other_code(program),
    )


def key_for(command: Sequence[str], cwd: str, key: str | None) -> CommandKey:
    return explicit_key(key) if key else command_key(command, cwd)


def learn(
    state_dir: Path,
    command: Sequence[str],
    cwd: str,
    *,
    key: str | None = None,
    margin: float = DEFAULT_MARGIN,
    now: float | None = None,
    max_bytes: int = DEFAULT_HISTORY_MAX_BYTES,
    gpus: int = 1,
) -> Learned:
    """Look the command up in the history index and estimate from what is found, per GPU for a
    job on `gpus` GPUs.

    `max_bytes`: the history's size limit (history_max_size), which bounds what is read."""
    ckey = key_for(command, cwd, key)
    hashes = ckey.hashes()
    found = index.lookup(state_dir, hashes.values(), max_bytes)
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
    pairs = _usable(ckey, levels, clock)
    return Learned(
        key=ckey,
        levels=tuple(levels),
        estimate=estimate(pairs, clock, margin, gpus=gpus),
        run_time=run_time(pairs, clock),
        wait_time=wait_time(pairs, clock),
        load_time=load_time(pairs, clock),
        warnings=tuple(found.warnings),
        now=clock,
    )


class RequestChoice(Record, frozen=True):
    """The request a run waits for, where it came from, and what to tell the user about it."""

    request: MemoryRequest | None
    source: str
    note: str | None = None
    learned: Learned | None = None
    #: An estimate capped (cap_to_cards): at what, as its note says it (LARGEST_CARD,
    #: USER_LIMIT, or what N cards hold).
    capped_at: str | None = None


#: The caps of an estimate, as a note says them (cap_to_cards).
LARGEST_CARD = "the largest card"
USER_LIMIT = "your per-user limit"


def choose_request(
    vram_flag: MemoryRequest | None,
    default: MemoryRequest | None,
    state_dir: Path,
    command: Sequence[str],
    cwd: str,
    *,
    key: str | None,
    margin: float,
    max_bytes: int,
    gpus: int = 1,
) -> RequestChoice:
    """--vram when given; else the estimate from earlier runs (for `gpus` GPUs); else the
    default_vram setting."""
    if vram_flag is not None:
        return RequestChoice(vram_flag, FLAG)
    learned = learn(state_dir, command, cwd, key=key, margin=margin, max_bytes=max_bytes, gpus=gpus)
    if learned.estimate.bytes is not None:
        note = learned.basis()
        if learned.estimate.approximate:
            note += (
                ", measured approximately"
                if learned.estimate.runs == 1
                else ", some measured approximately"
            )
        return RequestChoice(MemoryRequest(bytes=learned.estimate.bytes), ESTIMATE, note, learned)
    what = "this --key" if key else "this command"
    why = learned.basis() if learned.key.typed_in else f"no earlier runs of {what}"
    return RequestChoice(default, DEFAULT, f"{why}: default_vram", learned)


def cap_to_cards(
    choice: RequestChoice,
    gpus: Sequence[GpuSnapshot],
    candidates: Sequence[str] | None,
    safety: float,
    wanted: int = 1,
    max_vram: int | None = None,
    *,
    requirements: Requirements | None = None,
) -> RequestChoice:
    """An estimate above every candidate card's usable memory asks for the largest one instead,
    and for a job on `wanted` GPUs, one above what the `wanted` largest all hold asks for that;
    one above the per-user VRAM limit (`max_vram`, over all its GPUs) asks for what the limit
    allows: the learned size must never make a command impossible that --vram would not.
    Candidates are the cards the job may ever have: among `candidates`, those that take CUDA
    work and match its `requirements` (--gpu-name and co.); a larger card it may not use
    (where the runs that taught the size ran, say) caps nothing."""
    request = choice.request
    if choice.source != ESTIMATE or request is None or request.bytes is None:
        return choice
    usable = sorted(
        (
            # As impossible_reason counts it: less what the driver keeps for itself.
            whole_card_room(g, safety)
            for g in gpus
            if (candidates is None or g.uuid in candidates)
            and not prohibited(g)
            and (requirements is None or requirements.mismatch(g) is None)
        ),
        reverse=True,
    )
    if not usable:
        return choice
    # Fewer cards than it wants: the count refuses it, said as such, whatever the size.
    most = usable[wanted - 1] if len(usable) >= wanted else usable[0]
    allowed = None if max_vram is None else max_vram // wanted
    if allowed is not None and allowed < most:
        most = allowed
    if request.bytes <= most:
        return choice
    if most == allowed:
        which = USER_LIMIT
    else:
        which = LARGEST_CARD if most == usable[0] else f"what {wanted} cards hold"
    note = f"{choice.note}; capped at {which}"
    return RequestChoice(MemoryRequest(bytes=most), ESTIMATE, note, choice.learned, which)


def kept_command(command: Sequence[str], cwd: str, history_commands: str) -> list[str]:
    """The command as files that outlive the run keep it: whole, or in `hash` mode only the
    program and a hash of the line (`python [3f2a...]`), as `history` shows it."""
    if history_commands == "full":
        return list(command)
    return [command_key(command, cwd).program, f"[{command_hash(command)[:12]}]"]


def save_record(
    state_dir: Path, record: dict[str, Any], max_bytes: int, patience: float | Patience = 0.0
) -> list[str]:
    """Append the record and bring the index up to date, so the next launch reads no history.
    Where a signal waits for gpuwait, the history lock is waited for `patience` seconds more
    (SignalPending after that).

    Returns warnings for the CLI (an index that could not be brought up to date among them);
    raises OSError when the history cannot be written, RecordedThenSignalled where the record
    was written but the index's update gave up for a signal.
    """
    not_compacted = None
    try:
        compaction = store.append_record(state_dir, record, max_bytes, patience)
    except store.NotCompacted as exc:
        compaction, not_compacted = None, exc
    signalled = None
    try:
        warnings = index.refresh(state_dir, max_bytes, patience=patience)
    except (OSError, SignalPending) as exc:
        # A cache: the next launch brings it up to date, or reads it as it is.
        if isinstance(exc, SignalPending):
            signalled, why = exc, str(exc)
        else:
            why = str(exc.strerror or exc)
        warnings = [
            f"history {store.history_path(state_dir)}: the run is recorded, but the history "
            f"index could not be brought up to date: {why}"
        ]
    if not_compacted is not None:
        warnings.append(
            f"history {store.history_path(state_dir)}: the run is recorded, but the history, "
            f"past its size limit (history_max_size), could not be compacted: "
            f"{not_compacted.strerror}"
        )
    if compaction is not None and compaction.kept_as is not None:
        warnings.append(
            f"history {store.history_path(state_dir)}: compacted it without what was damaged "
            f"({compaction.damage}); the old file is kept as {compaction.kept_as}"
        )
    if signalled is not None:
        raise RecordedThenSignalled(signalled.signum, warnings)
    return warnings


class RecordedThenSignalled(SignalPending):
    """`save_record`'s SignalPending where the record was written and only the index's update
    was given up: `warnings` says so (a signal's caller that goes on shows them, not that the
    run was lost)."""

    def __init__(self, signum: int, warnings: list[str]) -> None:
        super().__init__(signum)
        self.warnings = warnings
