"""What a running --pausable job's gpuwait spends on each change of the ledger, with a sweep of
1000 entries of its user's queued beside it (1000 gpuwait processes).

Every change of the ledger (a sample published, a waiter admitted) has the job's gpuwait look
its own entry up again (gpuwait.runner.paused.PauseResponder.check): has a more urgent waiter
asked it to step aside? One round is one change made by another process's transaction (not
timed), then one check (timed). Each entry names a live process of its own whose command line
is gpuwait's (`exec -a gpuwait sleep`), as a sweep's waiting gpuwait processes are. Also timed,
as the floor: a read of the same changed ledger alone, which any look makes.

`--against REV` also times another revision (a git revision of this repository, or a directory
holding a checkout), each in a process of its own, alternating, on the same ledger, and prints
the ratio of its median to this tree's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _common import REPO, median, sandbox
from launch_overhead import checkout

#: Run in a fresh interpreter with one tree on PYTHONPATH: time `rounds` checks, each after
#: a change of the ledger, and as many reads of it; print their medians in ms as JSON.
MEASURE = r"""
import json, os, sys, time
from pathlib import Path
from gpuwait.queue.ledger import Ledger
from gpuwait.runner.paused import PauseResponder

rounds = int(sys.argv[1])
ledger = Ledger(Path(os.environ["XDG_STATE_HOME"]) / "gpuwait")
job = ledger.read().jobs[0]
responder = PauseResponder(ledger, job)
responder.check(job.child_pid)


def change(i):
    with ledger.transaction() as data:
        data.jobs[1 + i % (len(data.jobs) - 1)].updated_at = time.time()


checks, reads = [], []
for i in range(rounds):
    change(i)
    started = time.perf_counter()
    responder.check(job.child_pid)
    checks.append(time.perf_counter() - started)
    change(i)
    started = time.perf_counter()
    ledger.read()
    reads.append(time.perf_counter() - started)
assert not responder.requested
checks.sort()
reads.sort()
print(json.dumps({"check": checks[len(checks) // 2] * 1e3, "read": reads[len(reads) // 2] * 1e3}))
"""


def fill(env: dict[str, str], pids: list[int], child: int) -> None:
    """The sandbox's ledger: the pausable job running (its gpuwait this process, its command
    `child`), then one waiting entry of the same user's per pid."""
    sys.path.insert(0, str(REPO))
    from gpuwait.linux import proc
    from gpuwait.queue import entries
    from gpuwait.queue.ledger import Ledger

    now = time.time()
    uuid = "GPU-5e1a1d1e-0000-4a4a-8b8b-000000000000"
    state = Path(env["XDG_STATE_HOME"]) / "gpuwait"
    with Ledger(state).transaction() as data:
        data.jobs.clear()
        data.jobs.append(
            entries.Job(
                id="00000fff",
                pid=os.getpid(),
                start_time=proc.start_time(os.getpid()),
                uid=os.getuid(),
                command=["python", "serve.py"],
                cwd="/home/someone/sweep",
                request={"bytes": 8 << 30},
                order=1,
                state=entries.RUNNING,
                gpu_uuids=[uuid],
                reserved_bytes=8 << 30,
                pids=[child],
                child_pid=child,
                submitted_at=now - 60,
                started_at=now - 50,
                updated_at=now,
                pausable=True,
                checkpoint_signal="USR1",
            )
        )
        for i, pid in enumerate(pids):
            data.jobs.append(
                entries.Job(
                    id=f"{0x1000 + i:08x}",
                    pid=pid,
                    start_time=proc.start_time(pid),
                    uid=os.getuid(),
                    command=["python", "train.py", f"--seed={i}"],
                    cwd="/home/someone/sweep",
                    request={"bytes": 4 << 30},
                    order=i + 2,
                    state=entries.WAITING,
                    submitted_at=now - 30 + i * 0.01,
                    updated_at=now,
                    batch="sweep",
                )
            )
        data.next_order = len(pids) + 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--entries", type=int, default=1000, help="entries of the sweep")
    parser.add_argument("--rounds", type=int, default=41, help="ledger changes timed per run")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each tree, alternating")
    parser.add_argument("--against", metavar="REV", help="also time this revision (or directory)")
    args = parser.parse_args()
    trees = {"this": REPO}
    if args.against:
        trees[args.against] = checkout(args.against)
    sweep = ["bash", "-c", "exec -a gpuwait sleep 3600"]
    procs = [subprocess.Popen(sweep) for _ in range(args.entries)]
    child = subprocess.Popen(["sleep", "3600"])
    try:
        env = sandbox(gpus=1)
        deadline = time.monotonic() + 60
        while any(
            Path(f"/proc/{p.pid}/cmdline").read_bytes().split(b"\0")[0] != b"gpuwait" for p in procs
        ):
            if time.monotonic() > deadline:
                raise SystemExit("the sweep's processes never took gpuwait's name")
            time.sleep(0.05)
        fill(env, [p.pid for p in procs], child.pid)
        results: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        for _ in range(args.repeat):
            for name, tree in trees.items():
                run = subprocess.run(
                    [sys.executable, "-c", MEASURE, str(args.rounds)],
                    env=dict(env, PYTHONPATH=str(tree)),
                    cwd=tree,
                    capture_output=True,
                    text=True,
                    check=True,
                )
                results[name].append(json.loads(run.stdout))
        print(
            f"{args.entries} entries of one user's; per ledger change, ms: medians of "
            f"{args.rounds} rounds, median over {args.repeat} runs"
        )
        print(f"{'tree':>12} {'check':>8} {'read':>8}")
        checks = {}
        for name, runs in results.items():
            checks[name] = median([r["check"] for r in runs])
            read = median([r["read"] for r in runs])
            print(f"{name:>12} {checks[name]:>8.2f} {read:>8.2f}")
        if args.against:
            print(f"check, {args.against} / this: {checks[args.against] / checks['this']:.1f}x")
    finally:
        for p in [*procs, child]:
            p.kill()
        for p in [*procs, child]:
            p.wait()


if __name__ == "__main__":
    main()
