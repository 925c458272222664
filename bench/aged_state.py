"""A launch, and `gpuwait log`, on a state dir after a year of use against a fresh one.

    python bench/aged_state.py [--records 300000] [--events 60000] [--runs 30]

Builds a year-old state dir with gpuwait's own writers: `--records` runs over 365 days (a
cron job with the day's date, a frequent command, sweeps with seeds, temp output paths, a tool
with a frame number), appended one by one with compaction at the default size limit; a full
event log (`--events` jobs' events, rotated); a ledger that has seen its hundred finished jobs.
Then it times, interleaved with the same on a state dir that has seen one run: `gpuwait --vram
1G -- true`, the same command learning its size (`gpuwait -- true`), and `gpuwait log`, and
prints the medians and the ratio of each to the fresh baseline. Goal: a launch at most a few
ms slower than on a fresh state dir.
"""

from __future__ import annotations

import argparse
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# The history records the tests build, from tests/helpers.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from _common import GPUWAIT, median, sandbox
from helpers.history import a_run

from gpuwait.core.estimate import DEFAULT_HISTORY_MAX_BYTES
from gpuwait.core.snapshot import GpuSnapshot
from gpuwait.history import index, store
from gpuwait.queue import events

GiB = 2**30
DAY = 86400.0
GPUS = [
    GpuSnapshot(index=i, uuid=f"GPU-{i:08x}-0000-0000-0000-000000000000", name="A100",
                total_bytes=80 * GiB, used_bytes=0)
    for i in range(4)
]  # fmt: skip


def a_year_of_history(state: Path, records: int, rng: random.Random) -> int:
    """Append `records` runs spread over the last year; returns the compactions."""
    scripts = [f"/home/u{u}/p{p}/{s}.py" for u in range(10) for p in range(5) for s in "te"]
    peaks = {s: rng.uniform(2, 60) * GiB for s in scripts}
    at = time.time() - 365 * DAY
    compactions = 0
    for n in range(records):
        at += rng.uniform(0.5, 1.5) * 365 * DAY / records
        day = time.strftime("%Y-%m-%d", time.gmtime(at))
        draw = rng.random()
        script = rng.choice(scripts)
        argv, cwd, peak = {
            0: (["python", "/srv/ingest.py", "--date", day], "/srv", 6 * GiB),
            1: (["python", "infer.py"], "/home/u0/serve", 10 * GiB),
            2: (["python", script, "--seed", str(rng.randrange(10**6))], "/home/x", peaks[script]),
            3: (["python", script, "--out", f"/tmp/tmp{rng.getrandbits(40):x}/o"], "/", peaks[script]),
            4: (["/opt/render", "--frame", str(n), "--date", day], "/data", 3 * GiB),
        }[min(4, int(draw * 5))]  # fmt: skip
        gpu = rng.choice(GPUS)
        peak = int(peak * rng.uniform(0.9, 1.05))
        run = a_run(
            argv,
            cwd,
            at,
            job_id=f"{rng.getrandbits(48):012x}",
            request={"bytes": peak},
            request_source="estimate",
            reserved_bytes=int(peak * 1.1),
            gpus=[gpu],
            peak_by_gpu={gpu.uuid: peak},
            run_seconds=rng.uniform(10, 3600),
            wait_seconds=rng.uniform(0, 100),
            returncode=0 if rng.random() > 0.05 else 1,
            time_to_peak=rng.uniform(1, 30),
            samples=rng.randrange(10, 500),
            free_at_peak_bytes={gpu.uuid: 80 * GiB - peak},
        )
        compactions += store.append_record(state, run, DEFAULT_HISTORY_MAX_BYTES) is not None
    index.refresh(state, DEFAULT_HISTORY_MAX_BYTES)
    return compactions


def a_full_event_log(state: Path, jobs: int, rng: random.Random) -> None:
    gpu = [GPUS[0].uuid]
    for n in range(jobs):
        job = f"{rng.getrandbits(32):08x}"
        argv = ["python", "train.py", "--seed", str(n)]
        events.emit(state, "submit", job=job, name=None, batch=None, priority=0, command=argv)
        events.emit(state, "admit", job=job, name=None, gpus=gpu, reserved_bytes=GiB, waited=1.0)
        events.emit(state, "start", job=job, name=None, pid=rng.randrange(2, 4_000_000))
        events.emit(state, "finish", job=job, name=None, outcome="ok", exit_status=0,
                    signal=None, gpus=gpu, run_seconds=rng.uniform(1, 3000))  # fmt: skip


def timed(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run([*GPUWAIT, *argv], env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=300_000)
    parser.add_argument("--events", type=int, default=60_000)
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    env = sandbox(gpus=2)
    root = Path(env["XDG_STATE_HOME"]).parent
    fresh, aged = root / "fresh", root / "aged"
    fresh_env, aged_env = (dict(env, GPUWAIT_STATE_DIR=str(d)) for d in (fresh, aged))
    rng = random.Random(1)
    started = time.perf_counter()
    aged.mkdir(mode=0o700)
    compactions = a_year_of_history(aged, args.records, rng)
    a_full_event_log(aged, args.events // 4, rng)
    for _ in range(100):
        timed(["--vram", "1G", "--", "true"], aged_env)
    print(
        f"year-old state: {args.records:,} runs ({compactions} compactions), "
        f"{args.events:,} events, built in {time.perf_counter() - started:.0f} s"
    )
    timed(["--vram", "1G", "--", "true"], fresh_env)
    snapshot = root / "fresh-after-one-run"
    shutil.copytree(fresh, snapshot)
    cases = {
        "gpuwait --vram 1G -- true": ["--vram", "1G", "--", "true"],
        "gpuwait -- true (learned size)": ["--", "true"],
        "gpuwait log": ["log"],
    }
    for name, argv in cases.items():
        times: dict[str, list[float]] = {"fresh": [], "aged": []}
        for turn in range(args.runs):
            # The fresh state dir as after its one run, whatever the runs before it added.
            shutil.rmtree(fresh)
            shutil.copytree(snapshot, fresh)
            # Each goes first in every other pair, so that neither pays for going first.
            for which in ("fresh", "aged")[:: 1 if turn % 2 else -1]:
                times[which].append(timed(argv, fresh_env if which == "fresh" else aged_env))
        new, old = median(times["fresh"]) * 1000, median(times["aged"]) * 1000
        print(
            f"{name:32s} fresh {new:6.1f} ms   year-old {old:6.1f} ms   "
            f"+{old - new:5.1f} ms   ratio {old / new:.3f}   (medians of {args.runs})"
        )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
