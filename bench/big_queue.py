"""A big queue: what one admission costs under the ledger's lock, with 100 to 1024 entries on
16 simulated GPUs (a sweep of hundreds of jobs submitted at once; 1024 is the most one user may
queue).

Each entry names a live process of its own (a `sleep`), so reaping reads /proc for real and
keeps every entry: two run on each GPU (one in five of the first entries), the rest wait, of 2-12 GiB and one to ten
minutes expected, some of the sweep's steps `--after` the one before. One admission is
`lifecycle.admit` for the last waiter, the transaction a waiter runs when the queue changed:
read and check the file, reap, plan the whole queue (its claims, then the lookahead plan) and
write back. The ledger is put back as it was before each round, so every round plans the same
queue; the first (unmeasured) round leaves the waiters their wait budgets and the plan's order,
as the queue's earlier plans would have. Also printed: the planning stages alone, on a read of
the same ledger (`claims_for`, then `plan_ledger`).

`--against REV` also times another revision (a git revision of this repository, or a directory
holding a checkout), each in a process of its own, alternating, on the same ledgers.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from _common import GPUWAIT, REPO, median, sandbox
from launch_overhead import checkout

#: Run in a fresh interpreter with one tree on PYTHONPATH: time `rounds` admissions and the
#: planning stages of the sandbox's ledger; print their medians in ms as JSON.
MEASURE = r"""
import json, os, sys, time
from pathlib import Path
from gpuwait import config
from gpuwait.gpu import open_backend
from gpuwait.linux import proc
from gpuwait.queue import conditions, lifecycle
from gpuwait.queue.entries import WAITING
from gpuwait.queue.ledger import Ledger
from gpuwait.core.policy import NO_CONDITIONS as NO

rounds = int(sys.argv[1])
state = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait"
ledger = Ledger(state)
path = state / "ledger.json"
snapshot = open_backend(os.environ["GPUWAIT_SIM"]).snapshot()
fair = config.load_settings({}).fair_share()
job = [j for j in ledger.read().jobs if j.state == WAITING][-1]
lifecycle.admit(ledger, job, snapshot, 0.9, NO, fair)  # budgets and the plan's order, as kept
kept = path.read_bytes()
admit, claims, plan = [], [], []
for _ in range(rounds):
    path.write_bytes(kept)
    started = time.perf_counter()
    lifecycle.admit(ledger, job, snapshot, 0.9, NO, fair)
    admit.append(time.perf_counter() - started)
    path.write_bytes(kept)
    data = ledger.read()
    now, boot = time.time(), proc.boot_clock()
    started = time.perf_counter()
    found = conditions.claims_for(data, snapshot.gpus, fair, now, boot)
    claims.append(time.perf_counter() - started)
    started = time.perf_counter()
    conditions.plan_ledger(data, snapshot.gpus, found, 0.9, NO, fair)
    plan.append(time.perf_counter() - started)
med = lambda xs: sorted(xs)[len(xs) // 2] * 1000
print(json.dumps({"admit": med(admit), "claims": med(claims), "plan": med(plan)}))
"""


def fill(env: dict[str, str], count: int, pids: list[int], seed: int = 1) -> None:
    """The ledger of the sandbox: one entry per pid, as `count` jobs of a sweep."""
    sys.path.insert(0, str(REPO))
    from gpuwait.linux import proc
    from gpuwait.queue import entries
    from gpuwait.queue.ledger import Ledger

    status = subprocess.run(
        [*GPUWAIT, "status", "--json"], env=env, capture_output=True, text=True, check=True
    )
    uuids = [g["uuid"] for g in json.loads(status.stdout)["gpus"]]
    rng = random.Random(seed)
    now = time.time()
    state = Path(env["XDG_STATE_HOME"]) / "gpuwait"
    with Ledger(state).transaction() as data:
        data.jobs.clear()
        for i, pid in enumerate(pids[:count]):
            size = rng.choice([2, 4, 6, 8, 12]) << 30
            running = i % 5 == 0 and i < 10 * len(uuids)
            uuid = uuids[(i // 5) % len(uuids)]
            job_id = f"{0x1000 + i:08x}"
            chained = not running and i % 7 == 1
            data.jobs.append(
                entries.Job(
                    id=job_id,
                    pid=pid,
                    start_time=proc.start_time(pid),
                    uid=os.getuid(),
                    command=["python", "train.py", f"--seed={i}"],
                    cwd="/home/someone/sweep",
                    request={"bytes": size},
                    order=i + 1,
                    priority=rng.choice([2, 3, 3, 4]),
                    state=entries.RUNNING if running else entries.WAITING,
                    gpu_uuids=[uuid] if running else [],
                    reserved_bytes=size if running else 0,
                    pids=[pid] if running else [],
                    child_pid=pid if running else None,
                    submitted_at=now - 30 + i * 0.01,
                    started_at=now - 20 if running else None,
                    updated_at=now,
                    name=f"run{i}",
                    batch="sweep",
                    after=[f"{0x1000 + i - 1:08x}"] if chained else [],
                    expected_seconds=rng.choice([60.0, 120.0, 600.0]) + 600,
                )
            )
        data.next_order = count + 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="100,300,1024", help="queue lengths (entries)")
    parser.add_argument("--gpus", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=9, help="admissions timed per run")
    parser.add_argument("--repeat", type=int, default=2, help="runs of each tree, alternating")
    parser.add_argument("--against", metavar="REV", help="also time this revision (or directory)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    trees = {"this": REPO}
    if args.against:
        trees[args.against] = checkout(args.against)
    procs = [subprocess.Popen(["sleep", "3600"]) for _ in range(max(sizes))]
    try:
        print(f"{args.gpus} simulated 24 GiB GPUs; medians of {args.rounds} rounds, ms")
        print(f"{'entries':>8} {'tree':>12} {'admission':>10} {'claims':>8} {'plan':>8}")
        for size in sizes:
            env = sandbox(gpus=args.gpus)
            fill(env, size, [p.pid for p in procs])
            state = Path(env["XDG_STATE_HOME"]) / "gpuwait" / "ledger.json"
            original = state.read_bytes()
            results: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
            for _ in range(args.repeat):
                for name, tree in trees.items():
                    state.write_bytes(original)
                    run = subprocess.run(
                        [sys.executable, "-c", MEASURE, str(args.rounds)],
                        env=dict(env, PYTHONPATH=str(tree)),
                        cwd=tree,
                        capture_output=True,
                        text=True,
                        check=True,
                    )
                    results[name].append(json.loads(run.stdout))
            for name, runs in results.items():
                figures = [median([r[k] for r in runs]) for k in ("admit", "claims", "plan")]
                print(f"{size:>8} {name:>12} " + " ".join(f"{f:>8.1f}" for f in figures))
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


if __name__ == "__main__":
    main()
