"""`gpuwait history`: recent runs with their peak VRAM, load, wait and run times, and exit."""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuwait.commands import output
from gpuwait.commands.common import load_settings, unreadable
from gpuwait.commands.parsing import MAX_LINES, Parser, terminal_columns, whole_number
from gpuwait.core.budget import OOM_CARD_FULL, OOM_OWN_LIMIT
from gpuwait.core.cmdkey import EXPLICIT, PROGRAM, SCRIPT, CommandKey, key_hash, runs_other_code
from gpuwait.core.estimate import spread
from gpuwait.core.sizes import format_duration, format_size
from gpuwait.core.text import command_line, printable
from gpuwait.history.learn import key_for
from gpuwait.history.record import is_slim, record_keys, run_stat
from gpuwait.history.store import Parsed, history_path, read_from, read_limit, tail
from gpuwait.linux.signals import signal_name


def build_parser() -> Parser:
    parser = Parser(
        prog="gpuwait history",
        usage="gpuwait history [-n N | --all] [--json] [--key NAME] [-- COMMAND ...]",
        description="Recent runs in the order they ended, the latest last: when it ended, GPU, "
        "peak VRAM, time to reach 90% of the peak (model load), wait, run time, exit. Given a COMMAND, only runs of its script "
        "(other arguments too), or of its program where it names none. "
        "Runs that compaction kept only for estimates are shown with --all.",
    )
    # `--all` shows every run, so a count beside it would be ignored: refused instead.
    amount = parser.add_mutually_exclusive_group()
    amount.add_argument(
        "-n",
        type=whole_number(0, MAX_LINES),
        default=20,
        metavar="N",
        help="show the last N runs to end (default: 20)",
    )
    amount.add_argument(
        "--all",
        action="store_true",
        help="show every run in the history, also those compaction kept only for estimates",
    )
    parser.add_argument("--key", metavar="NAME", help="only runs made with --key NAME")
    parser.add_argument("--json", action="store_true", help="the records as a JSON array")
    parser.add_argument("command", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    settings = load_settings({})
    path = history_path(settings.state_path)
    wanted = _wanted_hash(command, args.key)
    # Only the newest lines are read unless the whole file must be filtered or shown; and
    # filtered, only the lines of the runs asked for are decoded (a year of other runs would
    # take seconds).
    limit = read_limit(settings.history_max_size)
    parsed = _read(
        lambda: (
            tail(path, args.n, limit)
            if wanted is None and not args.all
            else read_from(path, 0, limit, key=wanted)
        ),
        path,
    )
    records = [r for _, r in parsed.records]
    if not args.all:
        # Older than the runs kept whole, and without command line or GPU: `history` would
        # show them as rows of question marks.
        records = [r for r in records if not is_slim(r)]
    if wanted is not None:
        records = [r for r in records if wanted in record_keys(r).values()]
    if not args.all:
        records = records[-args.n :] if args.n else []
    message = parsed.damage.message(path)
    if message:
        output.warn(message)
    if args.json:
        print(output.json_text(records))
        return 0
    if not records:
        # `-n 0` asks for no rows and gets none, as from `log -n 0` and `tail -n 0`.
        if args.all or args.n:
            # Where the runs are, from every run in the history: worth its seconds here. It
            # echoes the key or the command asked for: an escape sequence pasted with one is
            # shown as '?', as in every message.
            every = parsed if wanted is None else _read(lambda: read_from(path, 0, limit), path)
            print(printable(_nothing_shown([r for _, r in every.records], command, args.key), 4000))
        return 0
    _show(records)
    return 0


def _read(reading: Callable[[], Parsed], path: Path) -> Parsed:
    try:
        return reading()
    except OSError as exc:
        raise unreadable(f"history {path}", path, exc) from None


def _nothing_shown(read: list[dict[str, Any]], command: list[str], key: str | None) -> str:
    """Why no run is shown, and where the runs are: "no runs recorded yet" only when true."""
    whole = [r for r in read if not is_slim(r)]
    plural = "s" if len(whole) != 1 else ""
    others = f"`gpuwait history` shows the {len(whole)} run{plural} of other commands"
    if key:
        return f"no runs with --key {key} are recorded; {others}"
    if command:
        cwd = os.getcwd()
        ckey = key_for(command, cwd, None)
        what = ckey.text(_shown_level(ckey))
        # A script is known by its full path: the same line typed in another directory is
        # another script. Say where it did run, so that the answer is one `cd` away.
        elsewhere = sorted(
            {
                r["cwd"]
                for r in whole
                if r.get("command") == command and isinstance(r.get("cwd"), str)
            }
            - {cwd}
        )
        if elsewhere:
            where = ", ".join(elsewhere[:3]) + (" ..." if len(elsewhere) > 3 else "")
            return (
                f"no runs of {what} are recorded; `{shlex.join(command)}` ran from {where} "
                "(a script is known by its full path: ask there)"
            )
        if whole:
            return f"no runs of {what} are recorded; {others}"
        return "no runs recorded yet"
    slim = len(read) - len(whole)
    if slim:
        return f"no runs to show; {slim} older runs kept only for estimates are shown with --all"
    return "no runs recorded yet"


def _shown_level(ckey: CommandKey) -> str:
    """The level whose runs `history -- COMMAND` shows: the script's (other arguments too);
    for a program that is its own script (a tool run with the day's date, a frame number),
    the program's; else, for what runs other code with no script named (`make train`), the
    line's alone."""
    if ckey.text(SCRIPT) is not None:
        return SCRIPT
    program = ckey.text(PROGRAM)
    if program is not None and not ckey.typed_in and not runs_other_code(program):
        return PROGRAM
    return ckey.levels[0][0]


def _wanted_hash(command: list[str], key: str | None) -> str | None:
    if key:
        return key_hash(EXPLICIT, key)
    if not command:
        return None
    ckey = key_for(command, os.getcwd(), None)
    return ckey.hashes()[_shown_level(ckey)]


def _exit(record: dict[str, Any], short: bool = False) -> str:
    number = record.get("signal")
    if isinstance(number, int):
        text = signal_name(number)
    elif record.get("exit_status") is None:
        # Nobody saw how it ended: an adopted process, a reservation's unseen exit, a job
        # whose gpuwait was killed (lost).
        text = "? lost" if record.get("lost") is True else "?"
    else:
        text = str(record.get("exit_status"))
        stopped = record.get("stopped_by")
        if isinstance(stopped, int) and not isinstance(stopped, bool):
            # Told to stop (Ctrl-C, TERM): an early end, which estimates do not learn from.
            text += f" ({signal_name(stopped)})"
    if record.get("oom"):
        text += _OOM_WORDS.get(str(record.get("oom_cause")), " OOM")
    return text + _paused(record, short)


#: How an out-of-memory run shows in the exit column, by its cause (else plain " OOM").
_OOM_WORDS = {OOM_OWN_LIMIT: " OOM at limit", OOM_CARD_FULL: " OOM card full"}


def _paused(record: dict[str, Any], short: bool = False) -> str:
    """ ", paused 2× (5m lost)" for a run that stepped aside for more urgent work; `short`:
    without the time lost."""
    pauses = record.get("pauses")
    if not isinstance(pauses, int) or isinstance(pauses, bool) or pauses <= 0:
        return ""
    lost = record.get("paused_seconds")
    cost = f" ({format_duration(lost)} lost)" if isinstance(lost, (int, float)) else ""
    return f", paused {pauses}×{'' if short else cost}"


#: What a peak without a figure, or with an approximate one, means (the table's notes).
_UNMEASURED_SHARED = (
    "peak -: not measured: others used or freed memory on its GPU meanwhile, and NVML listed "
    "none of its processes with a figure"
)
_UNMEASURED_SHORT = "peak -: not measured: the run ended before the first reading"
_UNMEASURED_LOST = "peak -: not measured: its gpuwait was killed before it kept a reading"
_APPROXIMATE = (
    "peak ~: the growth of its GPU's used memory (NVML listed none of its processes with a "
    "figure: it used no GPU memory, or it ran in a container without --pid=host)"
)


def _peak(record: dict[str, Any]) -> str:
    """The peak; '-' where none was measured (as the other columns say what is unknown), and
    '~' before one read from the card's used memory. The notes under the table say why."""
    peak = record.get("peak_bytes")
    if not isinstance(peak, (int, float)):
        return "-"
    return ("~" if record.get("peak_approximate") else "") + format_size(peak)


def _peak_notes(records: list[dict[str, Any]]) -> list[str]:
    notes = []
    unmeasured = [r for r in records if _peak(r) == "-" and not is_slim(r)]
    # A run whose gpuwait was killed (`? lost`) ran on unwatched: its length says nothing.
    if any(r.get("lost") is True for r in unmeasured):
        notes.append(_UNMEASURED_LOST)
    unmeasured = [r for r in unmeasured if r.get("lost") is not True]
    if any(r.get("samples") == 0 for r in unmeasured):
        notes.append(_UNMEASURED_SHORT)
    if any(r.get("samples") != 0 for r in unmeasured):
        notes.append(_UNMEASURED_SHARED)
    if any(_peak(r).startswith("~") for r in records):
        notes.append(_APPROXIMATE)
    return notes


def _seconds(value: Any) -> str:
    return format_duration(value) if isinstance(value, (int, float)) else "-"


def _command(record: dict[str, Any], width: int | None) -> str:
    command = record.get("command")
    if is_slim(record):
        text = "(compacted: kept for estimates only)"
    elif isinstance(command, list):
        text = command_line(command)
    else:
        # Kept as its hash: the program's name, any file's (an escape sequence in it too).
        text = printable(
            f"{record.get('program', '?')} [{str(record.get('command_hash', ''))[:12]}]"
        )
    return text if width is None else printable(text, width)


def _ended(record: dict[str, Any], short: bool = False) -> str:
    """When the run ended, the order the rows are in (each is written as its run ends): its
    start (a --pausable job's last run's) and its run time. A record cut down by compaction
    has no run time where it was 0."""
    started, ran = record.get("started_at"), record.get("run_seconds", 0)
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (started, ran))
    if numbers and math.isfinite(ran):
        started += ran
    return output.local_time(started, "%m-%d %H:%M" if short else "%Y-%m-%d %H:%M")


def _gpus(record: dict[str, Any]) -> str:
    gpus = record.get("gpus")
    if not isinstance(gpus, list):
        return "?"
    return ",".join(str(g.get("index", "?")) for g in gpus if isinstance(g, dict)) or "-"


#: The table's columns: heading, and whether its values are aligned to the right.
_COLUMNS = (
    ("ended", False),
    ("GPU", False),
    ("peak", True),
    ("load", True),
    ("wait", True),
    ("run", True),
    ("exit", False),
)
#: The least room for the command on a terminal before the other columns take shorter forms.
_COMMAND_ROOM = 24


def table(records: list[dict[str, Any]], columns: int | None) -> list[str]:
    """The runs as rows of text: on a terminal `columns` wide, every row fits (the date
    without its year, a pause without its cost, then the command cut short, as needed); with
    `columns` None (piped), every value whole, for grep and scripts."""
    for short in (False, True):
        cells = [
            [
                _ended(r, short),
                _gpus(r),
                _peak(r),
                _seconds(r.get("time_to_peak_seconds")),
                _seconds(r.get("wait_seconds")),
                _seconds(r.get("run_seconds")),
                _exit(r, short),
            ]
            for r in records
        ]
        widths = [
            max([len(heading), *(len(row[i]) for row in cells)])
            for i, (heading, _) in enumerate(_COLUMNS)
        ]
        before = sum(width + 2 for width in widths)
        if columns is None or columns - before >= _COMMAND_ROOM:
            break
    room = None if columns is None else max(1, columns - before)

    def line(values: list[str], command: str) -> str:
        shown = [
            value.rjust(width) if right else value.ljust(width)
            for value, width, (_, right) in zip(values, widths, _COLUMNS, strict=True)
        ]
        return "  ".join([*shown, command])

    rows = [line([heading for heading, _ in _COLUMNS], "command")]
    rows += [line(row, _command(r, room)) for row, r in zip(cells, records, strict=True)]
    notes = _peak_notes(records)
    # The runs that estimates count as successes: exit 0, no out-of-memory failure, and not
    # told to stop (a run stopped with Ctrl-C that exits 0 ended early).
    done = [
        float(r["run_seconds"])
        for r, stat in zip(records, map(run_stat, records), strict=True)
        if stat is not None
        and stat.ok
        and not stat.oom
        and isinstance(r.get("run_seconds"), (int, float))
    ]
    times = spread(done)
    if times is not None and times.runs > 1:
        notes.append(
            f"run time of the {times.runs} successful runs shown: median "
            f"{format_duration(times.median)}, middle half {format_duration(times.low)}–"
            f"{format_duration(times.high)}"
        )
    if notes:
        rows.append("")
    for note in notes:
        rows += [note] if columns is None else textwrap.wrap(note, columns, subsequent_indent="  ")
    return rows


def _show(records: list[dict[str, Any]]) -> None:
    # On a terminal, the rows fit its width; piped, nothing is cut.
    for row in table(records, terminal_columns() if sys.stdout.isatty() else None):
        print(row)
