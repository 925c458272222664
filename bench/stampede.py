"""Stampede: N gpuwait launches at once of ramping simulated jobs on two simulated cards.

Free-memory pollers lose this race: every job looks at the card before the others have
allocated. Prints the OOM count (goal 0) and the wall time against two references measured
in the same run: a perfect launcher (as many fixed slots as the cards hold, each running the
same jobs back to back with no scheduler at all: the floor on this machine, process start-up
included) and the same stampede without gpuwait (each job started bare, which OOMs). The
ratio to the floor is the figure to watch: what gpuwait's CPU costs (30 waiting Python
processes start, plan and wake) on top of the jobs themselves; the CPU line says how much that
is (every process's user and system time, the floor's taken from the gpuwait run's).
"""

from __future__ import annotations

import argparse
import math
import resource
import subprocess
import time

from _common import GPUWAIT, sandbox


def children_cpu() -> float:
    """User + system CPU seconds of every child (and their children) reaped so far."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def stampede(env: dict[str, str], jobs: int, job: list[str], wrap: bool) -> tuple[int, int, float]:
    cmd = [*GPUWAIT, "--vram", "4G", "-q", "--", *job] if wrap else job
    started = time.monotonic()
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for _ in range(jobs)
    ]
    results = [(p.wait(), p.stderr.read() if p.stderr else "") for p in procs]
    wall = time.monotonic() - started
    ooms = sum("out of memory" in err for _, err in results)
    failed = sum(code != 0 for code, _ in results)
    return ooms, failed, wall


def slots(env: dict[str, str], jobs: int, job: list[str], width: int) -> float:
    """Wall time of `width` fixed slots (half on each card) running `jobs` jobs back to back:
    a launcher that knows the answer and spends nothing on deciding it."""
    left = [jobs // width + (1 if n < jobs % width else 0) for n in range(width)]
    started = time.monotonic()
    running: dict[int, subprocess.Popen[bytes]] = {}
    while any(left) or running:
        for n in range(width):
            if n not in running and left[n]:
                left[n] -= 1
                gpu_env = {**env, "CUDA_VISIBLE_DEVICES": str(n % 2)}
                running[n] = subprocess.Popen(job, env=gpu_env, stdout=subprocess.DEVNULL)
        time.sleep(0.005)
        for n, proc in list(running.items()):
            if proc.poll() is not None:
                del running[n]
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=40)
    parser.add_argument("--ramp", type=float, default=1.0)
    parser.add_argument("--hold", type=float, default=1.0)
    args = parser.parse_args()
    job = [
        *GPUWAIT,
        "sim",
        "job",
        "--vram",
        "4G",
        "--ramp",
        f"{args.ramp}s",
        "--hold",
        f"{args.hold}s",
    ]
    per_card = int(24 * 0.9 // 4)  # five 4 GiB jobs fit under safety 0.9 on a 24 GiB card
    waves = math.ceil(args.jobs / (2 * per_card))
    ideal = waves * (args.ramp + args.hold)

    before = children_cpu()
    floor = slots(sandbox(), args.jobs, job, 2 * per_card)
    floor_cpu = children_cpu() - before
    before = children_cpu()
    ooms, failed, wall = stampede(sandbox(), args.jobs, job, wrap=True)
    cpu = children_cpu() - before
    print(f"gpuwait:  {args.jobs} jobs of 4 GiB (ramp {args.ramp}s, hold {args.hold}s) on 2x24 GiB")
    print(
        f"          OOM {ooms}, failed {failed}, wall {wall:.1f}s, ideal {ideal:.1f}s "
        f"({waves} waves), ratio {wall / ideal:.2f}"
    )
    print(
        f"floor:    {2 * per_card} fixed slots back to back, no scheduler: wall {floor:.1f}s; "
        f"gpuwait / floor {wall / floor:.2f} (goal <= 1.15)"
    )
    # The jobs' own CPU is in both figures: the difference is what gpuwait spends.
    print(
        f"CPU:      gpuwait run {cpu:.1f}s, floor {floor_cpu:.1f}s (user + system, every process): "
        f"gpuwait's own {cpu - floor_cpu:.1f}s, {1000 * (cpu - floor_cpu) / args.jobs:.0f} ms a launch"
    )
    ooms, failed, wall = stampede(sandbox(), args.jobs, job, wrap=False)
    print(
        f"bare:     OOM {ooms}, failed {failed}, wall {wall:.1f}s (all started at once, no admission)"
    )


if __name__ == "__main__":
    main()
