"""`gpuwait history`: recent runs with their peak VRAM, load, wait and run times, and exit."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import sys
import time
from typing import Any

from gpuwait.commands import MAX_LINES, Parser, output, whole_number
from gpuwait.config import load_settings
from gpuwait.core.budget import OOM_OWN_LIMIT
from gpuwait.core.cmdkey import EXPLICIT, SCRIPT, key_hash
from gpuwait.core.errors import StateError
from gpuwait.core.estimate import spread
from gpuwait.core.sizes import format_duration, format_size
from gpuwait.history.learn import key_for
from gpuwait.history.record import is_slim, record_keys
from gpuwait.history.store import history_path, read_from, read_limit, tail


def build_parser() -> Parser:
    parser = Parser(
        prog="gpuwait history",
        usage="gpuwait history [-n N | --all] [--json] [--key NAME] [-- COMMAND [ARGS...]]",
        description="Recent runs, newest last: when, GPU, peak VRAM, time to reach 90% of the "
        "peak (model load), wait, run time, exit. Given a COMMAND, only runs of its script. "
        "Runs that compaction kept only for estimates are shown with --all.",
    )
    parser.add_argument(
        "-n", type=whole_number(0, MAX_LINES), default=20, metavar="N", help="show the last N (20)"
    )
    parser.add_argument(
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
    try:
        # Only the newest lines are read unless the whole file must be filtered or shown.
        limit = read_limit(settings.history_max_size)
        parsed = (
            tail(path, args.n, limit)
            if wanted is None and not args.all
            else read_from(path, 0, limit)
        )
    except OSError as exc:
        raise StateError(f"history {path} cannot be read: {exc.strerror or exc}") from None
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
        print(json.dumps(records, indent=2))
        return 0
    _show(records)
    return 0


def _wanted_hash(command: list[str], key: str | None) -> str | None:
    if key:
        return key_hash(EXPLICIT, key)
    if not command:
        return None
    ckey = key_for(command, os.getcwd(), None)
    hashes = ckey.hashes()
    return hashes.get(SCRIPT) or hashes[ckey.levels[0][0]]


def _exit(record: dict[str, Any]) -> str:
    number = record.get("signal")
    if isinstance(number, int):
        try:
            text = signal.Signals(number).name
        except ValueError:
            text = f"signal {number}"
    else:
        text = str(record.get("exit_status"))
    if record.get("oom"):
        text += " OOM at limit" if record.get("oom_cause") == OOM_OWN_LIMIT else " OOM"
    return text + _paused(record)


def _paused(record: dict[str, Any]) -> str:
    """ ", paused 2× (5m lost)" for a run that stepped aside for more urgent work."""
    pauses = record.get("pauses")
    if not isinstance(pauses, int) or isinstance(pauses, bool) or pauses <= 0:
        return ""
    lost = record.get("paused_seconds")
    cost = f" ({format_duration(lost)} lost)" if isinstance(lost, (int, float)) else ""
    return f", paused {pauses}×{cost}"


def _peak(record: dict[str, Any]) -> str:
    peak = record.get("peak_bytes")
    if not isinstance(peak, (int, float)):
        return "?"
    return ("~" if record.get("peak_approximate") else "") + format_size(peak)


def _seconds(value: Any) -> str:
    return format_duration(value) if isinstance(value, (int, float)) else "-"


def _command(record: dict[str, Any], width: int | None) -> str:
    command = record.get("command")
    if is_slim(record):
        text = "(compacted: kept for estimates only)"
    elif isinstance(command, list):
        text = shlex.join(str(a) for a in command)
    else:
        text = f"{record.get('program', '?')} [{str(record.get('command_hash', ''))[:12]}]"
    if width is None or len(text) <= width:
        return text
    return text[: width - 1] + "…"


def _command_width(columns_before: int) -> int | None:
    """Room left for the command on a terminal; None (never cut) when piped, for grep and scripts."""
    if not sys.stdout.isatty():
        return None
    columns = shutil.get_terminal_size().columns
    return max(20, columns - columns_before)


def _when(record: dict[str, Any]) -> str:
    started = record.get("started_at")
    if not isinstance(started, (int, float)):
        return "?"
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(started))


def _gpus(record: dict[str, Any]) -> str:
    gpus = record.get("gpus")
    if not isinstance(gpus, list):
        return "?"
    return ",".join(str(g.get("index", "?")) for g in gpus if isinstance(g, dict)) or "-"


def _show(records: list[dict[str, Any]]) -> None:
    if not records:
        print("no runs recorded yet")
        return
    header = (
        f"{'when':<16}  {'GPU':<3}  {'peak':>9}  {'load':>6}  {'wait':>6}  {'run':>7}  "
        f"{'exit':<9}  "
    )
    print(header + "command")
    width = _command_width(len(header))
    for r in records:
        print(
            f"{_when(r):<16}  {_gpus(r):<3}  {_peak(r):>9}  "
            f"{_seconds(r.get('time_to_peak_seconds')):>6}  {_seconds(r.get('wait_seconds')):>6}  "
            f"{_seconds(r.get('run_seconds')):>7}  {_exit(r):<9}  {_command(r, width)}"
        )
    done = [
        float(r["run_seconds"])
        for r in records
        if r.get("exit_status") == 0
        and not r.get("oom")
        and isinstance(r.get("run_seconds"), (int, float))
    ]
    times = spread(done)
    if times is not None and times.runs > 1:
        print(
            f"\nrun time of the {times.runs} successful runs shown: median "
            f"{format_duration(times.median)}, middle half {format_duration(times.low)}–"
            f"{format_duration(times.high)}"
        )
