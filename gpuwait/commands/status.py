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
from gpuwait._ledger import RUNNING, Ledger
from gpuwait._policy import gpu_rooms, plan
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
        backend = open_backend(settings["sim"] or None)
        try:
            snapshot = backend.snapshot()
        finally:
            backend.close()
    except BackendUnavailable as exc:
        problem = exc
    ledger = Ledger(settings.state_dir)
    with ledger.transaction() as data:
        jobs = sorted(data.jobs, key=lambda j: (j.state != RUNNING, -j.priority, j.order))
    gpus = snapshot.gpus if snapshot else ()
    claims = [j.claim(gpus) for j in jobs]
    rooms = gpu_rooms(gpus, claims, settings["safety"])
    reasons = plan(gpus, claims, settings["safety"]).waiting
    index = {g.uuid: g.index for g in gpus}
    now = time.time()
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
            f"  {j['id']}  {where:<6} {format_size(j['reserved_bytes']):>9} reserved "
            f"{format_size(j['observed_bytes']):>9} used  {elapsed:>7}  {_short(j['command'])}"
        )
    print(f"\nWaiting ({len(waiting)}):")
    for position, j in enumerate(waiting, 1):
        print(f"  {position:>2}. {j['id']}  p{j['priority']}  {_short(j['command'])}")
        if j["waiting_reason"]:
            print(f"      {j['waiting_reason']}")
    return 0


def _short(command: list[str], width: int = 40) -> str:
    text = " ".join(command)
    return text if len(text) <= width else text[: width - 1] + "…"
