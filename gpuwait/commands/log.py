"""`gpuwait log`: the event log (events.jsonl beside the ledger), last lines or followed."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from gpuwait.commands.common import ledger_for, load_settings, unreadable
from gpuwait.commands.output import json_text, local_time
from gpuwait.commands.parsing import MAX_LINES, Parser, whole_number
from gpuwait.core.budget import OOM_OWN_LIMIT
from gpuwait.core.errors import StateError, UsageError
from gpuwait.core.sizes import format_duration, format_size, sizes_on_gpus
from gpuwait.core.text import command_line, printable, shell_word
from gpuwait.queue.events import KINDS, events_path, follow, read_events, read_last


def build_parser() -> Parser:
    parser = Parser(
        prog="gpuwait log",
        description=f"Show the event log: {', '.join(KINDS)}.",
    )
    parser.add_argument(
        "-n",
        "--lines",
        type=whole_number(0, MAX_LINES),
        default=20,
        metavar="N",
        help="last N events (default: 20)",
    )
    parser.add_argument("-f", "--follow", action="store_true", help="keep showing new events")
    parser.add_argument("--json", action="store_true", help="the events as JSON lines")
    parser.add_argument("--job", metavar="ID", help="only events of this job (id or name)")
    return parser


def run(args: argparse.Namespace) -> int:
    settings = load_settings({})
    ledger = ledger_for(settings)
    # Events are written beside the ledger (a shared ledger's log is its users' common log).
    directory = ledger.directory
    indices = {u: h.index for u, h in ledger.read().book.health.items()}
    if ledger.shared:
        # None is kept there (docs/queue-and-status.md): an empty log would read as "nothing
        # happened", --job as a job that never was, and -f would wait for ever.
        raise StateError(
            f"the shared ledger directory {directory} keeps no event log; "
            "`gpuwait status` shows its queue"
        )

    # The ids the asked-for name was given to: not every event names its job (a `leave` of a
    # failed dependency, a `reap`, a `paused` carry its id alone). Events come oldest first,
    # so a job's `submit`, which names it, comes before the rest of its events.
    named: set[str] = set()

    def wanted(event: dict[str, Any]) -> bool:
        if args.job is None:
            return True
        job = event.get("job")
        if event.get("name") == args.job:
            if isinstance(job, str):
                named.add(job)
            return True
        return job == args.job or job in named

    def show(event: dict[str, Any]) -> None:
        print(
            json_text(event, indent=None, sort_keys=True)
            if args.json
            else printable(describe(event, indices), 4000)
        )

    try:
        # Without --job only the last events are read: a busy machine's log holds some
        # 60,000, which would take half a second to read for the 20 shown.
        events = (
            read_last(directory, args.lines)
            if args.job is None
            else [e for e in read_events(directory) if wanted(e)]
        )
    except OSError as exc:
        raise unreadable(f"event log in {directory}", events_path(directory), exc) from None
    if args.job is not None and not events and not args.follow:
        # As `cancel` answers a job it does not know: not an empty log, which reads as "fine".
        raise UsageError(
            f"no job matches {printable(shell_word(args.job))} in the event log; see `gpuwait log`"
        )
    # max(0, …): with fewer events than asked for, a negative start would drop some.
    for event in events[max(0, len(events) - args.lines) :] if args.lines else []:
        show(event)
    if not events and args.lines and not args.json and not args.follow:
        print("no events recorded yet")  # as `history` says it: an empty screen reads as broken
    sys.stdout.flush()
    if not args.follow:
        return 0
    try:
        for event in follow(directory):
            if wanted(event):
                show(event)
                sys.stdout.flush()
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        raise unreadable(f"event log in {directory}", events_path(directory), exc) from None
    return 0


def _gpus(uuids: Any, indices: dict[str, int]) -> str:
    if not isinstance(uuids, list) or not uuids:
        return "-"
    return ",".join(f"GPU{indices[u]}" if u in indices else str(u)[:12] for u in uuids)


def _reserved_each(event: dict[str, Any], indices: dict[str, int]) -> str | None:
    """`12.0 GiB on GPU0, 40.0 GiB on GPU1`: what the event's job reserves on each of its GPUs,
    where the event says that differs between them; else None."""
    each, uuids = event.get("reserved_by_gpu_bytes"), event.get("gpus")
    if not (
        isinstance(each, list)
        and isinstance(uuids, list)
        and len(each) == len(uuids)
        and all(type(n) is int for n in each)
    ):
        return None
    return sizes_on_gpus((n, _gpus([u], indices)) for n, u in zip(each, uuids, strict=True))


def describe(event: dict[str, Any], indices: dict[str, int]) -> str:
    """One event as one line of text."""
    stamp = local_time(event["time"], "%Y-%m-%d %H:%M:%S")
    kind = event["kind"]
    job = event.get("job")
    who = f"{job} ({event['name']})" if event.get("name") else str(job)
    if kind == "submit":
        command = event.get("command")
        shown = command_line(command) if isinstance(command, list) else "?"
        text = f"{who} p{event.get('priority')}: {shown}"
    elif kind == "admit":
        reserved = event.get("reserved_bytes")
        size = _reserved_each(event, indices) or (
            format_size(reserved) if isinstance(reserved, int) else "?"
        )
        waited = event.get("waited")
        after = f" after {format_duration(waited)}" if isinstance(waited, (int, float)) else ""
        text = f"{who} on {_gpus(event.get('gpus'), indices)}, {size} reserved{after}"
    elif kind == "start":
        text = f"{who} pid {event.get('pid')}"
    elif kind in ("finish", "leave"):
        how = str(event.get("outcome"))
        if event.get("signal") is not None:
            how += f", signal {event['signal']}"
        elif event.get("exit_status") is not None:
            how += f", exit {event['exit_status']}"
        oom, reserved = event.get("oom"), event.get("reserved_bytes")
        each = _reserved_each(event, indices)
        if oom == OOM_OWN_LIMIT and each is not None:
            how += f", out of memory at its own limit, {each}"
        elif oom == OOM_OWN_LIMIT and isinstance(reserved, int):
            how += f", out of memory at its own {format_size(reserved)} limit"
        elif isinstance(oom, str):
            how += f", out of memory ({printable(oom, 20)})"
        ran = event.get("run_seconds")
        if isinstance(ran, (int, float)):
            how += f", ran {format_duration(ran)} on {_gpus(event.get('gpus'), indices)}"
        pauses, lost = event.get("pauses"), event.get("paused_seconds")
        if isinstance(pauses, int) and pauses > 0:
            how += f", paused {pauses}×"
            if isinstance(lost, (int, float)):
                how += f" ({format_duration(lost)} lost)"
        if event.get("retry") is True:
            how += "; queued again (--retry-oom)"
        text = f"{who} {how}"
    elif kind == "pause-request":
        victims = event.get("victims")
        names = ", ".join(map(str, victims)) if isinstance(victims, list) else "?"
        where = _gpus([event.get("gpu")], indices)
        text = f"{who} asks {names} to checkpoint and step aside on {where}"
    elif kind == "pause-signal":
        pids = event.get("pids")
        pids = ", ".join(map(str, pids)) if isinstance(pids, list) else "?"
        text = f"{who} sent the checkpoint signal (pid {pids})"
    elif kind == "paused":
        ran = event.get("ran_seconds")
        after = f" after running {format_duration(ran)}" if isinstance(ran, (int, float)) else ""
        text = f"{who} stepped aside{after}; pause {event.get('pauses')}, queued to resume"
    elif kind == "pause-grace-kill":
        text = f"{who} did not step aside within its grace: sent TERM (--grace-kill)"
    elif kind == "freeze":
        pids = event.get("pids")
        pids = ", ".join(map(str, pids)) if isinstance(pids, list) else "?"
        where = _gpus(event.get("gpus"), indices)
        text = f"{who} frozen on {where} (pid {pids}): its GPU memory in host memory"
    elif kind == "thaw":
        frozen = event.get("frozen_seconds")
        after = f" after {format_duration(frozen)}" if isinstance(frozen, (int, float)) else ""
        text = f"{who} thawed{after}: its GPU memory back, running on"
    elif kind in ("freeze-failed", "thaw-failed"):
        doing = "could not be frozen, runs on" if kind == "freeze-failed" else "not thawed yet"
        text = f"{who} {doing}: {printable(str(event.get('error')), 300)}"
    elif kind == "cancel":
        text = f"{who} ({event.get('state')}) by uid {event.get('by_uid')}"
        if event.get("refused"):
            why = event.get("why")  # none in the events of an older gpuwait
            text += f": refused: {printable(why, 300)}" if isinstance(why, str) else ": refused"
    elif kind == "orphaned":
        text = (
            f"{who} (gpuwait pid {event.get('pid')} gone; command pid {event.get('child_pid')} "
            "runs on and keeps its room)"
        )
    elif kind == "over-reservation":
        reserved, used = event.get("reserved_bytes"), event.get("used_bytes")
        sizes = (
            f"uses {format_size(used)} of its {format_size(reserved)} reservation"
            if isinstance(reserved, int) and isinstance(used, int)
            else "uses more than its reservation"
        )
        text = f"{who} {sizes}: {event.get('cause')}; {event.get('advice')}"
    elif kind == "adopt":
        reserved = event.get("reserved_bytes")
        size = format_size(reserved) if isinstance(reserved, int) else "?"
        where = _gpus(event.get("gpus"), indices)
        text = f"{who} pid {event.get('pid')} on {where}, {size} reserved"
    elif kind == "reap":
        text = f"{who} (pid {event.get('pid')} gone while {event.get('state')})"
    elif kind.startswith("gpu_"):
        detail = f": {event['detail']}" if event.get("detail") else ""
        text = f"GPU{event.get('index')} {event.get('gpu')}{detail}"
    else:
        text = json.dumps({k: v for k, v in event.items() if k not in ("time", "kind", "schema")})
    return f"{stamp}  {kind:<9} {text}"
