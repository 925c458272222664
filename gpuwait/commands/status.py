"""`gpuwait status`: GPUs, running jobs, the queue and batches; `--json`, `--watch`.

The JSON report (`--json`) is versioned by its `schema` field and documented in README.md
("Queue, priorities and status"); fields are only ever added within a schema version.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import textwrap
import time
from typing import Any

from gpuwait import _output
from gpuwait._backend import open_backend
from gpuwait._bookkeeping import GPU_OK, Book
from gpuwait._config import Settings, load_settings
from gpuwait._errors import EXIT_NO_GPU, BackendUnavailable, UsageError
from gpuwait._fairness import FairShare, claims_for, user_usage
from gpuwait._ledger import RUNNING, Job, LedgerData, ledger_for
from gpuwait._policy import Conditions, estimate_starts, gpu_rooms, plan
from gpuwait._queue import name_processes, note_health
from gpuwait._security import printable
from gpuwait._sizes import format_duration, format_size, parse_duration
from gpuwait._snapshot import MachineSnapshot

STATUS_SCHEMA = 2
_MIN_WIDTH = 80
_MAX_WIDTH = 160


def main(argv: list[str], parser_class: type[argparse.ArgumentParser]) -> int:
    parser = parser_class(
        prog="gpuwait status",
        description="Show GPUs, running jobs, the queue and batches.",
    )
    parser.add_argument(
        "--json", action="store_true", help=f"machine-readable output (schema {STATUS_SCHEMA})"
    )
    parser.add_argument(
        "--watch",
        nargs="?",
        const="2s",
        metavar="INTERVAL",
        help="refresh every INTERVAL (default 2s) until Ctrl-C; in place on a terminal",
    )
    args = parser.parse_args(argv)
    interval = None
    if args.watch is not None:
        try:
            interval = parse_duration(args.watch)
        except ValueError as exc:
            raise UsageError(f"--watch {exc}") from None
        if interval < 0.1:
            raise UsageError("--watch: refresh at most every 0.1s")
    settings = load_settings({})
    if interval is None:
        report = build_report(settings)
        _show(report, args.json, in_place=False, watching=False)
        # The queue is still shown, but a script asking whether the GPUs can be read must hear no.
        return EXIT_NO_GPU if report["backend_error"] else 0
    in_place = sys.stdout.isatty() and not args.json
    try:
        while True:
            _show(build_report(settings), args.json, in_place, watching=True)
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0


def _show(report: dict[str, Any], as_json: bool, in_place: bool, watching: bool) -> None:
    if as_json:
        # Watching, one report per line (JSON Lines), so a reader can take them one by one.
        print(json.dumps(report, indent=None if watching else 2))
        sys.stdout.flush()
        return
    text = render(report, _width())
    if in_place:
        # Home and clear, then the whole report: one write, so the screen never shows half.
        sys.stdout.write("\033[H\033[2J" + text)
    else:
        for message in report["warnings"]:
            _output.warn(message)
        if report["backend_error"]:
            _output.error(report["backend_error"])
        sys.stdout.write(text)
    sys.stdout.flush()


def _width() -> int:
    columns = shutil.get_terminal_size((_MIN_WIDTH, 24)).columns
    return min(max(columns, _MIN_WIDTH), _MAX_WIDTH)


# --- the report --------------------------------------------------------------------------------


def build_report(settings: Settings) -> dict[str, Any]:
    """Read the GPUs and the ledger once; the whole dashboard as plain data."""
    snapshot: MachineSnapshot | None = None
    problem: BackendUnavailable | None = None
    try:
        backend = open_backend(settings["sim"] or None, settings["nvml_timeout"])
        try:
            snapshot = backend.snapshot()
        finally:
            backend.close()
    except BackendUnavailable as exc:
        problem = exc
    ignore = frozenset(settings["ignore_processes"])
    if snapshot is not None and ignore:
        snapshot = name_processes(snapshot)
    ledger = ledger_for(settings)
    now = time.time()
    with ledger.transaction() as data:
        if snapshot is not None:
            note_health(ledger.directory, data, snapshot, now)
    return report_from(settings, snapshot, data, now, ledger.warnings, problem)


def report_from(
    settings: Settings,
    snapshot: MachineSnapshot | None,
    data: LedgerData,
    now: float,
    ledger_warnings: list[str] = [],  # noqa: B006 - read only
    problem: BackendUnavailable | None = None,
) -> dict[str, Any]:
    safety: float = settings["safety"]
    gpus = snapshot.gpus if snapshot else ()
    # One reading only: utilization is taken as measured, so --max-util waiters get a reason.
    conditions = Conditions(
        utilization={g.uuid: g.utilization_pct for g in gpus},
        ignore_processes=frozenset(settings["ignore_processes"]),
    )
    fair = FairShare.from_settings(settings)
    usage = user_usage(data, now, fair.half_life)
    claims = claims_for(data, gpus, fair, now)
    by_id = {c.job_id: c for c in claims}
    # Running first, then the queue in the order the policy serves it (fair share included).
    jobs = sorted(data.jobs, key=lambda j: (j.state != RUNNING, by_id[j.id].sort_key(), j.order))
    rooms = gpu_rooms(gpus, claims, safety, conditions.ignore_processes)
    decided = plan(gpus, claims, safety, data.rr_cursor, conditions, fair.limits)
    etas = estimate_starts(gpus, claims, safety, data.rr_cursor, conditions, limits=fair.limits)
    held_for = {u: decided.hold.job_id for u in decided.hold.gpu_uuids} if decided.hold else {}
    index = {g.uuid: g.index for g in gpus}
    index.update({u: h.index for u, h in data.book.health.items() if u not in index})
    lost = data.book.lost_gpus()
    waiting_ids = [j.id for j in jobs if j.state != RUNNING]
    report: dict[str, Any] = {
        "schema": STATUS_SCHEMA,
        "generated_at": now,
        "backend": snapshot.backend if snapshot else None,
        "backend_error": problem.message if problem else None,
        "safety": safety,
        "ledger_created_at": data.created_at,
        "warnings": list(snapshot.warnings if snapshot else ()) + list(ledger_warnings),
        "gpus": [],
        "jobs": [],
        "batches": _batches(data.jobs, data.book),
        "users": _users(data.jobs, usage),
        "fair_share": {
            "half_life_seconds": fair.half_life,
            "user_max_gpus": fair.limits.max_gpus if fair.limits else None,
            "user_max_vram_bytes": fair.limits.max_vram if fair.limits else None,
        },
    }
    for room in rooms.values():
        report["gpus"].append(
            _gpu_entry(
                room.gpu.index,
                room.gpu.uuid,
                room.gpu.name,
                room.gpu.total_bytes,
                data.book,
                {
                    "health": GPU_OK,
                    "health_since": _since(data.book, room.gpu.uuid),
                    "health_detail": None,
                    "used_bytes": room.gpu.used_bytes,
                    "external_bytes": room.external,
                    "ignored_bytes": room.ignored_bytes,
                    "reserved_bytes": room.committed,
                    "free_bytes": max(0, room.room),
                    "utilization_pct": room.gpu.utilization_pct,
                    "compute_capability": _capability(room.gpu.compute_capability),
                    "running_jobs": [j.id for j in jobs if room.gpu.uuid in j.gpu_uuids],
                    "held_for": held_for.get(room.gpu.uuid),
                },
            )
        )
    for uuid, health in sorted(lost.items(), key=lambda uh: uh[1].index):
        if uuid in rooms:
            continue
        report["gpus"].append(
            _gpu_entry(
                health.index,
                uuid,
                health.name,
                health.total_bytes,
                data.book,
                {
                    "health": health.state,
                    "health_since": health.since,
                    "health_detail": health.detail,
                    "used_bytes": None,
                    "external_bytes": None,
                    "ignored_bytes": None,
                    "reserved_bytes": None,
                    "free_bytes": None,
                    "utilization_pct": None,
                    "compute_capability": None,
                    "running_jobs": [j.id for j in jobs if uuid in j.gpu_uuids],
                    "held_for": None,
                },
            )
        )
    report["gpus"].sort(key=lambda g: (g["index"], g["uuid"]))
    for job in jobs:
        claim = by_id[job.id]
        reason = decided.waiting.get(job.id)
        running = job.state == RUNNING
        report["jobs"].append(
            {
                "id": job.id,
                "name": job.name,
                "batch": job.batch,
                "state": job.state,
                "position": None if running else waiting_ids.index(job.id) + 1,
                "pid": job.pid,
                "uid": job.uid,
                "command": job.command,
                "cwd": job.cwd,
                "priority": job.priority,
                "request": job.request,
                "exclusive": job.request == {},
                "gpus": job.gpus,
                "gpu_uuids": job.gpu_uuids,
                "gpu_indices": [index.get(u) for u in job.gpu_uuids],
                "lost_gpus": [u for u in job.gpu_uuids if u in lost],
                "reserved_bytes": job.reserved_bytes,
                "observed_bytes": sum(claim.observed.values()),
                "submitted_at": job.submitted_at,
                "started_at": job.started_at,
                "elapsed_seconds": now - job.started_at if running and job.started_at else None,
                "expected_remaining_seconds": claim.expected_seconds if running else None,
                "expected_seconds": job.expected_seconds,
                "waiting_reason": reason.describe() if reason else None,
                "blocked": claim.blocked,
                "eta_seconds": None if running else etas.get(job.id),
                "held_gpus": job.held_gpus
                if decided.hold and decided.hold.job_id == job.id
                else [],
                "after": job.after,
                "after_ok": job.after_ok,
                "requirements": job.requirements,
            }
        )
    return report


def _gpu_entry(
    index: int, uuid: str, name: str, total: int, book: Book, fields: dict[str, Any]
) -> dict[str, Any]:
    counters = book.gpus.get(uuid)
    return {
        "index": index,
        "uuid": uuid,
        "name": name,
        "total_bytes": total,
        **fields,
        "counters": {
            "dispatched": counters.dispatched if counters else 0,
            "completed": counters.completed if counters else 0,
            "failed": counters.failed if counters else 0,
            "throughput_per_hour": counters.per_hour() if counters else None,
        },
    }


def _since(book: Book, uuid: str) -> float | None:
    health = book.health.get(uuid)
    return health.since if health else None


def _capability(value: tuple[int, int] | None) -> str | None:
    return None if value is None else f"{value[0]}.{value[1]}"


def _batches(jobs: list[Job], book: Book) -> list[dict[str, Any]]:
    names = {j.batch for j in jobs if j.batch} | set(book.batches)
    rows = []
    for name in sorted(n for n in names if n is not None):
        counts = book.batches.get(name)
        tally = {
            "done": counts.done if counts else 0,
            "running": sum(1 for j in jobs if j.batch == name and j.state == RUNNING),
            "waiting": sum(1 for j in jobs if j.batch == name and j.state != RUNNING),
            "failed": counts.failed if counts else 0,
            "cancelled": counts.cancelled if counts else 0,
        }
        rows.append({"name": name, **tally, "total": sum(tally.values())})
    return rows


# --- text --------------------------------------------------------------------------------------


def _size(n: int | None) -> str:
    """Compact: 24.0G, 512M, 1.5T; '-' when unknown."""
    if n is None:
        return "-"
    for unit, scale in (("T", 2**40), ("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= scale:
            value = n / scale
            return f"{value:.1f}{unit}" if value < 100 else f"{value:.0f}{unit}"
    return f"{n}B"


def _ago(seconds: float) -> str:
    return format_duration(max(0.0, seconds)) + " ago"


def _clip(text: str, width: int) -> str:
    # Another user's entry may hold anything: never print their escape sequences.
    return printable(text, max(1, width))


def render(report: dict[str, Any], width: int = _MIN_WIDTH) -> str:
    """The dashboard as text, no line longer than `width` (at least 80)."""
    now = report["generated_at"]
    out: list[str] = []
    backend = report["backend"] or "unavailable"
    out.append(f"GPUs ({backend}, safety {report['safety']:g}; job counts since the ledger began)")
    out.append(
        f" {'GPU':>3} {'name':<16} {'total':>6} {'used':>6} {'extern':>6} {'reserv':>6} "
        f"{'free':>6} {'util':>4}  health"
    )
    for g in report["gpus"]:
        util = "-" if g["utilization_pct"] is None else f"{g['utilization_pct']}%"
        if g["health"] == GPU_OK:
            health = "ok" if not g["held_for"] else f"held for {g['held_for']}"
        else:
            health = f"LOST {_ago(now - g['health_since'])}"
        out.append(
            _clip(
                f" {g['index']:>3} {_clip(g['name'], 16):<16} {_size(g['total_bytes']):>6} "
                f"{_size(g['used_bytes']):>6} {_size(g['external_bytes']):>6} "
                f"{_size(g['reserved_bytes']):>6} {_size(g['free_bytes']):>6} {util:>4}  {health}",
                width,
            )
        )
        c = g["counters"]
        rate = c["throughput_per_hour"]
        line = (
            f"jobs: {len(g['running_jobs'])} running, {c['dispatched']} dispatched, "
            f"{c['completed']} completed, {c['failed']} failed"
        )
        if rate is not None:
            line += f", {rate:.1f}/h"
        out.append(_clip("     " + line, width))
        if g["health"] != GPU_OK:
            detail = f" ({g['health_detail']})" if g["health_detail"] else ""
            jobs = ", ".join(g["running_jobs"]) or "none"
            out.append(_clip(f"     not answering{detail}; jobs still on it: {jobs}", width))
    running = [j for j in report["jobs"] if j["state"] == RUNNING]
    waiting = [j for j in report["jobs"] if j["state"] != RUNNING]
    out.append("")
    out.append(f"Running ({len(running)})")
    if running:
        fixed = f" {'ID':<8} {'NAME':<12} {'GPU':<5} {'RESERV':>6} {'USED':>6} {'ELAPSED':>7} {'LEFT':>6}  "
        out.append(fixed + "COMMAND")
    for j in running:
        gpus = ",".join("?" if i is None else str(i) for i in j["gpu_indices"])
        left = j["expected_remaining_seconds"]
        left_text = "-" if left is None else "~" + format_duration(left)
        line = (
            f" {printable(j['id'], 16):<8} {_clip(j['name'] or '-', 12):<12} {_clip(gpus, 5):<5} "
            f"{_size(j['reserved_bytes']):>6} {_size(j['observed_bytes']):>6} "
            f"{format_duration(j['elapsed_seconds'] or 0):>7} {left_text:>6}  "
        )
        out.append(line + _clip(" ".join(j["command"]), width - len(line)))
        if j["lost_gpus"]:
            out.append(_clip("     on a GPU that is not answering now", width))
    out.append("")
    out.append(f"Queue ({len(waiting)})")
    if waiting:
        fixed = f" {'#':>3} {'ID':<8} {'NAME':<12} {'PRI':<3} {'NEEDS':<11} {'ETA':>6}  "
        out.append(fixed + "COMMAND")
    for j in waiting:
        eta = j["eta_seconds"]
        eta_text = "-" if eta is None else "~" + format_duration(eta)
        line = (
            f" {j['position']:>3} {printable(j['id'], 16):<8} {_clip(j['name'] or '-', 12):<12} "
            f"p{j['priority']:<2} {_clip(_needs(j), 11):<11} {eta_text:>6}  "
        )
        out.append(line + _clip(" ".join(j["command"]), width - len(line)))
        if j["waiting_reason"]:
            out.extend(
                textwrap.wrap(
                    printable(j["waiting_reason"], 1000),
                    width=width,
                    initial_indent="      ",
                    subsequent_indent="        ",
                )
            )
    if report["batches"]:
        out.append("")
        out.append(f"Batches ({len(report['batches'])})")
        tallies = []
        for b in report["batches"]:
            extra = f", {b['cancelled']} cancelled" if b["cancelled"] else ""
            tallies.append(
                f"{b['done']}/{b['total']} done, {b['running']} running, "
                f"{b['waiting']} waiting, {b['failed']} failed{extra}"
            )
        # Names as long as the lines leave room for: batches named alike (by date, by run)
        # often differ only at the end.
        longest = max(len(b["name"]) for b in report["batches"])
        room = width - 2 - max(len(t) for t in tallies)
        column = max(20, min(longest, room))
        for b, tally in zip(report["batches"], tallies, strict=True):
            out.append(_clip(f" {_clip(b['name'], column):<{column}} {tally}", width))
    out.extend(_render_users(report["users"], report["fair_share"], width))
    return "\n".join(out) + "\n"


def _needs(job: dict[str, Any]) -> str:
    request = job["request"]
    if job["exclusive"]:
        per = "whole"
    elif "bytes" in request:
        per = _size(int(request["bytes"]))
    else:
        per = f"{float(request['fraction']) * 100:g}%"
    return per if job["gpus"] == 1 else f"{per} x{job['gpus']}"


def _users(jobs: list[Job], usage: dict[int, float]) -> list[dict[str, Any]]:
    """Per user: what they hold, wait for, and their fair-share usage (lower goes first)."""
    uids = sorted({j.uid for j in jobs} | set(usage))
    rows = []
    for uid in uids:
        mine = [j for j in jobs if j.uid == uid]
        running = [j for j in mine if j.state == RUNNING]
        rows.append(
            {
                "uid": uid,
                "user": _user_name(uid),
                "running": len(running),
                "waiting": len(mine) - len(running),
                "gpus_held": sum(len(j.gpu_uuids) for j in running),
                "vram_held_bytes": sum(j.reserved_bytes * len(j.gpu_uuids) for j in running),
                "usage_vram_seconds": round(usage.get(uid, 0.0), 1),
            }
        )
    return rows


def _render_users(users: list[dict[str, Any]], fair_share: dict[str, Any], width: int) -> list[str]:
    if not users:
        return []
    caps = []
    if fair_share["user_max_gpus"] is not None:
        caps.append(f"at most {fair_share['user_max_gpus']} GPUs")
    if fair_share["user_max_vram_bytes"] is not None:
        caps.append(f"at most {format_size(fair_share['user_max_vram_bytes'])}")
    half_life = fair_share["half_life_seconds"]
    share = "off" if half_life is None else f"half-life {format_duration(half_life)}"
    extra = f"; per user {', '.join(caps)}" if caps else ""
    out = ["", _clip(f"Users (fair share {share}{extra})", width)]
    for u in users:
        out.append(
            _clip(
                f" {printable(u['user'], 12):<12} {u['running']:>3} running {u['waiting']:>3} "
                f"waiting {u['gpus_held']:>2} GPUs {format_size(u['vram_held_bytes']):>8} held "
                f"usage {u['usage_vram_seconds'] / 2**30 / 3600:.2f} GiB·h",
                width,
            )
        )
    return out


def _user_name(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return str(uid)
