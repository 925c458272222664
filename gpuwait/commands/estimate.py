"""`gpuwait estimate -- COMMAND`: the VRAM gpuwait would ask for without --vram, and why."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from gpuwait.commands import output
from gpuwait.commands.common import ledger_for, load_settings, unreadable
from gpuwait.commands.parsing import Parser, add_gpus_option, terminal_columns
from gpuwait.config import Settings
from gpuwait.core.cmdkey import PROGRAM, runs_other_code
from gpuwait.core.devices import parse_inherited_visible
from gpuwait.core.errors import GpuwaitError, UsageError
from gpuwait.core.estimate import (
    MAX_AGE,
    MIN_RUNS,
    QUANTILE,
    WINDOW,
    Spread,
    recent,
    runs_agree,
    successes,
)
from gpuwait.core.sizes import MemoryRequest, format_duration, format_size
from gpuwait.core.snapshot import GpuSnapshot
from gpuwait.core.text import command_line, printable
from gpuwait.gpu import read_once
from gpuwait.history.index import KEEP_RUNS
from gpuwait.history.learn import (
    ESTIMATE,
    LARGEST_CARD,
    LEVEL_WORDS,
    USER_LIMIT,
    Learned,
    RequestChoice,
    cap_to_cards,
    learn,
)
from gpuwait.history.store import history_path
from gpuwait.linux.security import mine, open_readable
from gpuwait.queue.conditions import vram_of_user

ESTIMATE_SCHEMA = 1
USAGE = "gpuwait estimate [--key NAME] [--gpus N] [--json] [--] COMMAND [ARGS...]"


def build_parser() -> Parser:
    parser = Parser(
        prog="gpuwait estimate",
        usage=USAGE,
        description="Show the VRAM that `gpuwait COMMAND` (without --vram) would ask for, the "
        "runs it is learned from, and the command's usual run time.",
    )
    parser.add_argument("--key", metavar="NAME", help="the name given with `gpuwait --key NAME`")
    add_gpus_option(
        parser, "the size per GPU for a run on N GPUs, as `gpuwait --gpus N` asks (default: 1)"
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output (schema 1)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command and not args.key:
        raise UsageError(f"no command given (nor --key); usage: {USAGE}")
    settings = load_settings({})
    _check_readable(history_path(settings.state_path))
    learned = learn(
        settings.state_path,
        command or ["-"],
        os.getcwd(),
        key=args.key,
        margin=settings.estimate_margin,
        max_bytes=settings.history_max_size,
        gpus=args.gpus,
    )
    for message in learned.warnings:
        output.warn(message)
    default = settings.shown("default_vram")
    launched = _as_launched(settings, learned, args.gpus)
    if args.json:
        print(output.json_text(_report(learned, default, launched)))
        return 0
    _show(learned, default, command, launched, terminal_columns() if sys.stdout.isatty() else None)
    return 0


class _Launched(NamedTuple):
    """What a launch of the command asks for, from the estimate."""

    #: The estimate as a launch asks for it: capped at the largest card's usable memory.
    bytes: int | None
    #: That usable memory, where the cap applied.
    capped_at: int | None = None
    #: Why the GPUs could not be read (the estimate is then shown as learned).
    problem: str | None = None
    #: What the cap is, and what the estimate is more than, as `estimate` says them.
    cap: str = LARGEST_CARD
    gives: str = "any GPU here gives"
    #: What the figure the cap names is counted under.
    under: str = "under the safety factor"
    #: Capped at the per-user limit: what the user's running jobs hold of it as it counts
    #: them, and what they reserve, where the two differ (None: they do not, or unknown).
    held: tuple[int, int] | None = None


def _as_launched(settings: Settings, learned: Learned, gpus: int) -> _Launched:
    """The learned estimate capped as a launch on `gpus` GPUs caps it
    (history.learn.cap_to_cards): never more than the largest usable memory of the cards the
    command may use, or for several, than that many of them all hold."""
    learned_bytes = learned.estimate.bytes
    if learned_bytes is None:
        return _Launched(None)
    try:
        snapshot = read_once(settings.sim, settings.nvml_timeout)
    except GpuwaitError as exc:
        return _Launched(learned_bytes, problem=exc.message)
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    candidates = (
        None
        if inherited is None
        else parse_inherited_visible(
            inherited, snapshot.gpus, snapshot.in_mig_mode, snapshot.hidden
        )
    )
    choice = RequestChoice(MemoryRequest(bytes=learned_bytes), ESTIMATE)
    capped = cap_to_cards(
        choice, snapshot.gpus, candidates, settings.safety, gpus, settings.user_max_vram
    )
    asked = capped.request
    if asked is None or asked.bytes is None or asked.bytes == learned_bytes:
        return _Launched(learned_bytes)
    if capped.capped_at == LARGEST_CARD:
        return _Launched(asked.bytes, capped_at=asked.bytes)
    if capped.capped_at == USER_LIMIT:
        return _Launched(
            asked.bytes,
            capped_at=asked.bytes,
            cap=USER_LIMIT,
            gives="the site's per-user limit allows",
            under="user_max_vram",
            held=_held_past_reserved(settings, snapshot.gpus),
        )
    return _Launched(
        asked.bytes,
        capped_at=asked.bytes,
        cap=f"what {gpus} cards hold",
        gives=f"{gpus} GPUs here all give",
    )


def _held_past_reserved(settings: Settings, gpus: Sequence[GpuSnapshot]) -> tuple[int, int] | None:
    """What this user's running jobs hold of their VRAM limit and what they reserve, where
    they hold more (a job that uses more than it reserved); None where not, or where the
    ledger cannot be read (the estimate is shown without it)."""
    try:
        data = ledger_for(settings).read()
    except (GpuwaitError, OSError):
        return None
    held, reserved = vram_of_user(data, gpus, os.getuid())
    return (held, reserved) if held != reserved else None


def _check_readable(path: Path) -> None:
    """An estimate is what the history says: a history that cannot be read is a state error
    (exit 5), as for `gpuwait history`, not an estimate of 'no earlier runs'."""
    try:
        fd = open_readable(path, mine())
    except OSError as exc:  # not a plain file of the user's, or a state dir not to be entered
        raise unreadable(f"history {path}", path, exc) from None
    if fd is not None:
        os.close(fd)


def _spread_json(spread: Spread | None) -> dict[str, Any] | None:
    if spread is None:
        return None
    return {"median": spread.median, "low": spread.low, "high": spread.high, "runs": spread.runs}


def _report(learned: Learned, default: str, launched: _Launched) -> dict[str, Any]:
    est = learned.estimate
    now = time.time()
    return {
        "schema": ESTIMATE_SCHEMA,
        # What a launch asks for; learned_bytes before the cap at the largest card.
        "estimate_bytes": launched.bytes,
        "learned_bytes": est.bytes,
        "capped": launched.capped_at is not None,
        "gpus_unread": launched.problem,
        "source": "estimate" if est.bytes is not None else "default",
        "default_vram": default,
        "based_on": learned.basis(),
        "level": est.level,
        "runs": est.runs,
        "rule": est.rule,
        "quantile": QUANTILE,
        "quantile_bytes": est.quantile_bytes,
        "low_bytes": est.low_bytes,
        "high_bytes": est.high_bytes,
        "margin": est.margin,
        "finer_floor_bytes": est.finer_floor_bytes,
        "second_lowest_bytes": est.second_lowest_bytes,
        "oom_floor_bytes": est.oom_floor_bytes,
        "approximate": est.approximate,
        "spread_over_fewer_gpus": est.spread_over_fewer,
        "levels": [
            {
                "level": lv.name,
                "key": lv.text,
                "hash": lv.hash,
                "runs": lv.total_runs,
                # Runs past MAX_AGE count for nothing (and compaction drops them).
                "successful_recent": sum(1 for r in recent(lv.runs, now) if r.ok and not r.oom),
            }
            for lv in learned.levels
        ],
        "run_seconds": _spread_json(learned.run_time),
        "wait_seconds": _spread_json(learned.wait_time),
        "load_seconds": _spread_json(learned.load_time),
    }


def _timing(spread: Spread | None, suffix: str = "") -> str:
    if spread is None:
        return "unknown"
    median = format_duration(spread.median)
    if spread.runs == 1:
        return f"{median}{suffix} (1 run)"
    return (
        f"{median}{suffix} (median; {format_duration(spread.low)} to "
        f"{format_duration(spread.high)} for the middle half of {spread.runs} runs)"
    )


def _fitted(columns: int | None) -> Callable[[str], None]:
    """print, but on a terminal `columns` wide a longer line goes on in rows under its text
    (after the 10 columns of `estimate: `), broken between words; piped, each line whole."""

    def say(line: str) -> None:
        if columns is None or len(line) <= columns:
            print(line)
            return
        indent = " " * 10
        for row in textwrap.wrap(
            line,
            max(columns, 20),
            subsequent_indent=indent,
            break_long_words=False,
            break_on_hyphens=False,
        ):
            print(row)

    return say


def _show(
    learned: Learned,
    default: str,
    command: list[str],
    launched: _Launched,
    columns: int | None = None,
) -> None:
    say = _fitted(columns)
    est = learned.estimate
    first = learned.levels[0]
    if first.name == "key":
        say(f"key:      {printable(first.text)}")
    else:
        say(f"command:  {command_line(command)}")
    if est.bytes is None:
        fallback = "a whole GPU" if default == "exclusive" else default
        # "no earlier runs" only where there are none: runs that do not count are said below.
        why = (
            f"{learned.basis()} (name it with --key to learn its size)"
            if learned.key.typed_in
            else "no earlier run counts"
            if any(lv.total_runs for lv in learned.levels)
            else "no earlier runs"
        )
        say(f"estimate: none, {why}: gpuwait asks for {fallback} (default_vram)")
    else:
        say(f"estimate: {format_size(launched.bytes or est.bytes)} per GPU, {learned.basis()}")
        if est.runs and est.rule == "largest":
            say(
                f"          largest peak {format_size(est.quantile_bytes)} + "
                f"{est.margin * 100:g}% margin, rounded up (runs of the {est.level}, not of "
                "this exact command)"
            )
        elif est.runs == 1:
            # One figure: no percentile of it, no range from it to itself.
            say(
                f"          its one run's peak {format_size(est.quantile_bytes)} + "
                f"{est.margin * 100:g}% margin, rounded up"
            )
        elif est.runs:
            low, high = format_size(est.low_bytes), format_size(est.high_bytes)
            spread = f"every peak {low}" if low == high else f"peaks {low} to {high}"
            say(
                f"          {QUANTILE * 100:g}th percentile of the peaks "
                f"{format_size(est.quantile_bytes)} + {est.margin * 100:g}% margin, rounded up; "
                f"{spread}"
            )
        if est.sized_by_reservation:
            say(
                "          no margin: the command sizes itself from its reservation "
                "(GPUWAIT_VRAM_FRACTION or GPUWAIT_VRAM_BYTES), so it takes what it is given"
            )
        if est.second_lowest_bytes:
            say(
                f"          not below {format_size(est.second_lowest_bytes)}, the second-lowest "
                "peak: one run alone does not lower the size"
            )
        if est.finer_floor_bytes:
            say(
                f"          not below {format_size(est.finer_floor_bytes)}, "
                "the highest peak of the runs closer to this command"
            )
        if est.oom_floor_bytes:
            say(
                f"          at least {format_size(est.oom_floor_bytes)} after an "
                "out-of-memory failure (until a run succeeds)"
            )
        if est.spread_over_fewer:
            say(
                "          runs on more GPUs count for what they held in all, spread over "
                "this run's"
            )
        if est.approximate:
            peaks = "its peak is" if est.runs == 1 else "some peaks are"
            say(f"          {peaks} approximate (no per-process figures from NVML)")
        if launched.capped_at is not None:
            say(
                f"          capped at {launched.cap}: {format_size(est.bytes)} learned, more "
                f"than {launched.gives} ({format_size(launched.capped_at)} "
                f"{launched.under})"
            )
            if launched.held is not None:
                held, reserved = (format_size(n) for n in launched.held)
                say(f"          your running jobs hold {held} of it now ({reserved} reserved)")
        elif launched.problem is not None:
            say(
                f"          not checked against the GPUs ({launched.problem}): a launch asks "
                "for no more than the largest card gives"
            )
    levels = " · ".join(f"{lv.name} {lv.total_runs}" for lv in learned.levels)
    say(f"runs:     {levels}")
    left_out = _left_out(learned, time.time())
    if left_out:
        say(f"          {left_out}")
    say(f"run time: {_timing(learned.run_time)}")
    say(f"wait:     {_timing(learned.wait_time)}")
    say(f"load:     {_timing(learned.load_time, ' to reach 90% of the peak')}")


def _left_out(learned: Learned, now: float) -> str | None:
    """Why the estimate counts fewer runs than the level it comes from has: `2 of the 3 runs
    of this script count: 1 has no measured peak`."""
    est = learned.estimate
    # Without an estimate, the finest level that has runs: why none of them counts.
    chosen = [lv for lv in learned.levels if lv.name == est.level and est.runs]
    level = next(iter(chosen or [lv for lv in learned.levels if lv.total_runs]), None)
    used = est.runs if est.level == (level.name if level else None) else 0
    if level is None or used >= level.total_runs:
        return None
    young = recent(level.runs, now)
    done = [r for r in young if r.ok and not r.oom]
    measured = successes(young)
    no_peak = len(done) - len(measured)
    # Never among `done`: nobody saw them end, so none ended with 0.
    unseen = sum(1 for r in young if r.unseen)
    words = LEVEL_WORDS.get(level.name, f"runs at level {level.name}")
    program = learned.key.program
    if level.name == PROGRAM and runs_other_code(program):
        # The program level never counts here, whatever its runs are (usable_levels).
        said = f"runs of {program} size only their own script"
        return f"0 of the {level.total_runs} {words} count: {said}"
    beyond = f"beyond the newest {WINDOW}"
    if level.name == PROGRAM and used == 0 and not runs_agree(measured):
        # Another program's runs count only where MIN_RUNS of them agree (usable_levels).
        beyond = (
            "with peaks too far apart"
            if len(measured) >= MIN_RUNS
            else f"with a peak, of the {MIN_RUNS} that must agree"
        )
    reasons = [
        # The index keeps each command's newest KEEP_RUNS runs, all that estimates look at.
        (level.total_runs - len(level.runs), f"before the newest {KEEP_RUNS}"),
        (len(level.runs) - len(young), f"older than {MAX_AGE / 86400:.0f} days"),
        (len(young) - len(done) - unseen, "failed"),
        (unseen, "ended unseen"),
        (no_peak, "have no measured peak" if no_peak > 1 else "has no measured peak"),
        (len(measured) - used, beyond),
    ]
    said = ", ".join(f"{n} {why}" for n, why in reasons if n > 0)
    return f"{used} of the {level.total_runs} {words} count" + (f": {said}" if said else "")
