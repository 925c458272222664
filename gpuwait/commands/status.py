"""`gpuwait status`: GPUs, what runs, what waits."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from gpuwait import _output
from gpuwait._backend import open_backend
from gpuwait._config import load_settings
from gpuwait._errors import BackendUnavailable
from gpuwait._fairness import FairShare, claims_for, user_usage
from gpuwait._ledger import RUNNING, Job, ledger_for
from gpuwait._policy import gpu_rooms, plan
from gpuwait._security import printable
from gpuwait._sizes import format_duration, format_size
from gpuwait._snapshot import MachineSnapshot

STATUS_SCHEMA = 1


def main(argv: list[str], parser_class: type[argparse.ArgumentParser]) -> int:
    parser = parser_class(
        prog="gpuwait status", description="Show GPUs, running jobs and the queue."
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output (schema 1)")
    args = parser.parse_args(argv)
    settings = load_settings({})
    snapshot: MachineSnapshot | None = None
    problem = None
    try:
        backend = open_backend(settings["sim"] or None, settings["nvml_timeout"])
        try:
            snapshot = backend.snapshot()
        finally:
            backend.close()
    except BackendUnavailable as exc:
        problem = exc
    ledger = ledger_for(settings)
    fair = FairShare.from_settings(settings)
    now = time.time()
    with ledger.transaction() as data:
        usage = user_usage(data, now, fair.half_life)
        gpus = snapshot.gpus if snapshot else ()
        pairs = list(zip(data.jobs, claims_for(data, gpus, fair, now), strict=True))
    pairs.sort(key=lambda jc: (jc[0].state != RUNNING, jc[1].sort_key()))
    jobs = [j for j, _ in pairs]
    claims = [c for _, c in pairs]
    rooms = gpu_rooms(gpus, claims, settings["safety"])
    reasons = plan(gpus, claims, settings["safety"], limits=fair.limits).waiting
    index = {g.uuid: g.index for g in gpus}
    report: dict[str, Any] = {
        "schema": STATUS_SCHEMA,
        "backend": snapshot.backend if snapshot else None,
        "backend_error": problem.message if problem else None,
        "safety": settings["safety"],
        "warnings": list(snapshot.warnings if snapshot else ()) + ledger.warnings,
        "gpus": [
            {
                "index": r.gpu.index,
                "uuid": r.gpu.uuid,
                "name": r.gpu.name,
                "total_bytes": r.gpu.total_bytes,
                "used_bytes": r.gpu.used_bytes,
                "external_bytes": r.external,
                "committed_bytes": r.committed,
                "room_bytes": max(0, r.room),
                "utilization_pct": r.gpu.utilization_pct,
                "running_jobs": r.running_jobs,
            }
            for r in rooms.values()
        ],
        "jobs": [
            {
                "id": j.id,
                "state": j.state,
                "pid": j.pid,
                "uid": j.uid,
                "command": j.command,
                "priority": j.priority,
                "request": j.request,
                "gpus": j.gpus,
                "gpu_uuids": j.gpu_uuids,
                "reserved_bytes": j.reserved_bytes,
                "observed_bytes": sum(c.observed.values()),
                "submitted_at": j.submitted_at,
                "started_at": j.started_at,
                "waiting_reason": reasons[j.id].describe() if j.id in reasons else None,
            }
            for j, c in zip(jobs, claims, strict=False)
        ],
        "users": _users(jobs, usage, fair),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    if problem:
        _output.error(problem.message, problem.hint)
    for message in report["warnings"]:
        _output.warn(message)
    print(f"GPUs ({report['backend'] or 'unavailable'}, safety {settings['safety']:g}):")
    print(f"  {'GPU':<4} {'name':<20} {'total':>9} {'used':>9} {'reserved':>9} {'room':>9} jobs")
    for g in report["gpus"]:
        print(
            f"  {g['index']:<4} {g['name'][:20]:<20} {format_size(g['total_bytes']):>9} "
            f"{format_size(g['used_bytes']):>9} {format_size(g['committed_bytes']):>9} "
            f"{format_size(g['room_bytes']):>9} {g['running_jobs']}"
        )
    running = [j for j in report["jobs"] if j["state"] == RUNNING]
    waiting = [j for j in report["jobs"] if j["state"] != RUNNING]
    print(f"\nRunning ({len(running)}):")
    for j in running:
        where = ",".join(f"GPU{index.get(u, '?')}" for u in j["gpu_uuids"])
        elapsed = format_duration(now - (j["started_at"] or now))
        print(
            f"  {printable(j['id'], 16)}  {where:<6} {format_size(j['reserved_bytes']):>9} reserved "
            f"{format_size(j['observed_bytes']):>9} used  {elapsed:>7}  {_short(j['command'])}"
        )
    print(f"\nWaiting ({len(waiting)}):")
    for position, j in enumerate(waiting, 1):
        print(
            f"  {position:>2}. {printable(j['id'], 16)}  p{j['priority']}  {_short(j['command'])}"
        )
        if j["waiting_reason"]:
            print(f"      {j['waiting_reason']}")
    _print_users(report["users"], fair)
    return 0


def _users(jobs: list[Job], usage: dict[int, float], fair: FairShare) -> list[dict[str, Any]]:
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


def _print_users(users: list[dict[str, Any]], fair: FairShare) -> None:
    if not users:
        return
    limits = fair.limits
    caps = []
    if limits and limits.max_gpus is not None:
        caps.append(f"at most {limits.max_gpus} GPUs")
    if limits and limits.max_vram is not None:
        caps.append(f"at most {format_size(limits.max_vram)}")
    share = "off" if fair.half_life is None else f"half-life {format_duration(fair.half_life)}"
    extra = f"; per user {', '.join(caps)}" if caps else ""
    print(f"\nUsers (fair share {share}{extra}):")
    for u in users:
        print(
            f"  {printable(u['user'], 16):<16} {u['running']:>3} running {u['waiting']:>3} "
            f"waiting  {u['gpus_held']} GPUs {format_size(u['vram_held_bytes']):>9} held  "
            f"usage {u['usage_vram_seconds'] / 2**30 / 3600:.2f} GiB·h"
        )


def _user_name(uid: int) -> str:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return str(uid)


def _short(command: list[str], width: int = 40) -> str:
    # Another user's entry may hold anything: never print their escape sequences.
    return printable(" ".join(command), width)
