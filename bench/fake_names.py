"""A shared ledger directory strewn with names: what they cost.

Any member of a shared ledger may create `ledger.<n>.json` and `wake.<n>.json` for any n.
Such a file stands for nobody (its owner is not uid n), but every listing of the directory
(each user's ledger file, the wake-up summaries, the fingerprint a waiter compares) meets the
name and has to learn that: a member's script making `--names` of each kind (20,000 by
default) makes every gpuwait of every member do so on each look. With `--kind own` (root
only: the names are made as another uid, OWNER), the names are that member's own instead,
as their gpuwait makes them beside a name another took first: `ledger.OWNER.<hex>.json`,
`wake.OWNER.<hex>.json` and `alive.OWNER.<hex>/`, and as many of no kind (`junk.<hex>`).

Printed for both runs, in the same process, one after the other, on two simulated 24 GiB cards
in a shared ledger directory, a 16 GiB job running on GPU0:
- the CPU one waiter (20 GiB on GPU0, behind that job) uses over `--seconds`, in % of a core;
- the wall time and CPU of a launch that fits (`gpuwait --vram 1G --devices 1 -- true`), the
  median of `--launches`, and the wall time of `gpuwait status`, the median of as many;
first with no such names (the baseline), then with them. The ratios names / baseline are the
figures to watch.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from _common import GPUWAIT, cpu_seconds, median, sandbox, wait_until

#: The uid that makes the names of `--kind own`: no user's.
OWNER = 47299


def strew_own(directory: Path, names: int) -> None:
    """`names` of each of one member's own kinds, and as many of no kind, all made as OWNER."""
    for n in range(names):
        random = f"{n:016x}"
        for name in (f"ledger.{OWNER}.{random}.json", f"wake.{OWNER}.{random}.json"):
            fd = os.open(directory / name, os.O_CREAT | os.O_WRONLY, 0o644)
            os.fchown(fd, OWNER, OWNER)
            os.close(fd)
        fd = os.open(directory / f"junk.{random}", os.O_CREAT | os.O_WRONLY, 0o644)
        os.fchown(fd, OWNER, OWNER)
        os.close(fd)
        lock_dir = directory / f"alive.{OWNER}.{random}"
        lock_dir.mkdir(mode=0o700)
        os.chown(lock_dir, OWNER, OWNER)


def strew(directory: Path, names: int) -> None:
    """`names` ledger files and as many summaries, each under a uid other than its owner's."""
    own = os.getuid()
    made = 0
    n = 100_000
    while made < names:
        n += 1
        if n == own:
            continue
        for kind in ("ledger", "wake"):
            fd = os.open(directory / f"{kind}.{n}.json", os.O_CREAT | os.O_WRONLY, 0o644)
            os.close(fd)
        made += 1


def running(env: dict[str, str], name: str) -> bool:
    done = subprocess.run(
        [*GPUWAIT, "status", "--json"], env=env, capture_output=True, text=True, check=False
    )
    return f'"name": "{name}"' in done.stdout and '"state": "running"' in done.stdout


def waiting(env: dict[str, str]) -> bool:
    done = subprocess.run(
        [*GPUWAIT, "status", "--json"], env=env, capture_output=True, text=True, check=False
    )
    return '"state": "waiting"' in done.stdout


def launch(env: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU seconds of one launch that fits at once."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(
        [*GPUWAIT, "-q", "--vram", "1G", "--devices", "1", "--", "true"], env=env, check=True
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return wall, cpu


def status(env: dict[str, str]) -> float:
    """Wall seconds of one `gpuwait status`."""
    start = time.perf_counter()
    subprocess.run([*GPUWAIT, "status"], env=env, check=True, capture_output=True)
    return time.perf_counter() - start


def run(args: argparse.Namespace, names: int) -> tuple[float, float, float, float]:
    """(waiter CPU %, launch wall s, launch CPU s, status wall s) with `names` names of each
    kind."""
    env = sandbox(gpus=2, memory="24GiB")
    root = Path(env["XDG_STATE_HOME"]).parent
    shared = root / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    env["GPUWAIT_LEDGER_DIR"] = str(shared)
    (strew_own if args.kind == "own" else strew)(shared, names)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        argv = [
            *GPUWAIT,
            "-q",
            "--vram",
            "16G",
            "--devices",
            "0",
            "--name",
            "full",
            "--",
            "sleep",
            "3600",
        ]
        procs.append(subprocess.Popen(argv, env=env))
        wait_until(lambda: running(env, "full"), 120, poll=0.5)
        argv = [*GPUWAIT, "-q", "--vram", "20G", "--devices", "0", "--", "true"]
        procs.append(subprocess.Popen(argv, env=env))
        wait_until(lambda: waiting(env), 120, poll=0.5)
        time.sleep(3.0)  # past start-up, and the 2 s a directory changed may change unseen
        before = cpu_seconds(procs[1].pid)
        time.sleep(args.seconds)
        cpu = 100 * (cpu_seconds(procs[1].pid) - before) / args.seconds
        launches = [launch(env) for _ in range(args.launches)]
        looks = [status(env) for _ in range(args.launches)]
        return (
            cpu,
            median([w for w, _ in launches]),
            median([c for _, c in launches]),
            median(looks),
        )
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--names", type=int, default=20_000, help="of each kind")
    parser.add_argument("--seconds", type=float, default=5.0, help="waiter CPU measured over this")
    parser.add_argument("--launches", type=int, default=3)
    parser.add_argument(
        "--kind",
        choices=("others", "own"),
        default="others",
        help="names for uids not their maker's, or one member's own and junk (root only)",
    )
    args = parser.parse_args()
    if args.kind == "own" and os.geteuid() != 0:
        raise SystemExit("fake_names: --kind own makes names as another uid, which needs root")
    # Killed (by timeout(1)): the processes are reaped all the same.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    what = (
        f"one member's own ledger files, summaries, lock directories and junk (uid {OWNER})"
        if args.kind == "own"
        else "ledger files and summaries under uids not their owner's"
    )
    print(
        f"{args.names} {what}; waiter CPU over {args.seconds:g}s, median of {args.launches} "
        "launches and of as many looks of status"
    )
    results = {}
    for names in (0, args.names):
        results[names] = run(args, names)
        cpu, wall, launch_cpu, look = results[names]
        print(
            f"{'names' if names else 'baseline':>9}: waiter CPU {cpu:6.2f} % of a core; "
            f"launch {wall * 1000:7.0f} ms, CPU {launch_cpu * 1000:7.0f} ms; "
            f"status {look * 1000:7.0f} ms",
            flush=True,
        )
    base, strewn = results[0], results[args.names]
    print(
        f"names / baseline: waiter CPU {strewn[0] / max(base[0], 0.01):.1f}x, "
        f"launch {strewn[1] / base[1]:.1f}x, launch CPU {strewn[2] / base[2]:.1f}x, "
        f"status {strewn[3] / base[3]:.1f}x"
    )


if __name__ == "__main__":
    main()
