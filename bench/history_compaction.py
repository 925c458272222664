"""What compaction keeps of a sweep-heavy history, and whether estimates survive it.

    python bench/history_compaction.py [--records 110000,250000] [--limit 64MiB] [--sample 300]

For each size: a synthetic history of that many runs within the last 100 days (nothing ages
out), 90 % of them sweeps where every command line differs, over 40 scripts, with OOMs,
failures and approximate peaks, written as gpuwait writes records. It is compacted at the
limit (history_max_size) and prints: records and file size before and after, the size of a
typical whole record and of its slim form, how long compaction took, and how many of the
sampled commands' estimates changed: the VRAM estimate, and any figure `gpuwait estimate` shows
(level, runs behind it, run/wait/load times, run counts per level). The goal is 0 while the
slim records fit in half the limit; beyond it, the figures say which commands pay.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# The history records the tests build, from tests/helpers.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from helpers.history import a_run

from gpuwait.core.estimate import MIN_RUNS, recent
from gpuwait.core.sizes import parse_size
from gpuwait.core.snapshot import GpuSnapshot
from gpuwait.history import record, store
from gpuwait.history.learn import learn

GiB = 2**30
DAY = 86400.0
CWD = "/home/me/proj"
GPU = GpuSnapshot(
    index=0,
    uuid="GPU-8f3c2a1e-7d4b-4c1a-9e2f-0b6d5a4c3e21",
    name="NVIDIA H100 80GB HBM3",
    total_bytes=80 * GiB,
    used_bytes=0,
)
Probe = tuple[tuple[str, ...], str | None]


def run_record(rng: random.Random, argv: list[str], at: float, key: str | None) -> dict[str, Any]:
    outcome = rng.random()
    oom = outcome < 0.03
    returncode = 1 if outcome < 0.08 else (-15 if outcome < 0.1 else 0)
    peak = int(rng.uniform(1, 70) * GiB)
    job_id = f"{rng.getrandbits(48):012x}"
    approximate = rng.random() < 0.05
    to_peak = rng.uniform(1, 120) if rng.random() > 0.1 else None
    samples = rng.randrange(10, 3000)
    wait, ran = rng.uniform(0, 3600), rng.uniform(30, 36000)
    return a_run(
        argv,
        CWD,
        at,
        job_id=job_id,
        key=key,
        request={"bytes": peak},
        request_source="estimate",
        reserved_bytes=int(peak * 1.1),
        gpus=[GPU],
        peak_by_gpu={GPU.uuid: peak},
        run_seconds=ran,
        wait_seconds=wait,
        returncode=returncode,
        peak_approximate=approximate,
        time_to_peak=to_peak,
        samples=samples,
        free_at_peak_bytes={GPU.uuid: 80 * GiB - peak},
        oom=oom,
        oom_evidence="torch.OutOfMemoryError: CUDA out of memory. Tried to allocate"
        if oom
        else None,
        stderr_watched="file",
    )


def sweep_history(state: Path, runs: int, sample: int, seed: int = 11) -> tuple[list[Probe], float]:
    rng = random.Random(seed)
    scripts = [f"experiments/exp{i:02d}/train.py" for i in range(40)]
    repeated = [["python", s, "--config", f"configs/{c}.yaml"] for s in scripts[:10] for c in "ab"]
    start = time.time() - 100 * DAY
    lines: list[bytes] = []
    every: list[Probe] = []
    at = start
    for n in range(runs):
        at = start + 100 * DAY * n / runs
        key = None
        if rng.random() < 0.1:
            argv = rng.choice(repeated)
        else:
            argv = [
                "python",
                rng.choice(scripts),
                "--lr",
                f"{10 ** rng.uniform(-5, -2):.3e}",
                "--batch-size",
                str(rng.choice([16, 32, 64, 128])),
                "--seed",
                str(n),
                "--output",
                f"/scratch/me/runs/sweep-{n // 1000:03d}/{n:06d}",
            ]
            if rng.random() < 0.02:
                key = "nightly-eval"
        lines.append(record.encode(run_record(rng, argv, at, key)))
        every.append((tuple(argv), key))
    state.mkdir(parents=True, exist_ok=True)
    store.history_path(state).write_bytes(b"".join(lines))
    probes = random.Random(seed + 1).sample(sorted(set(every)), sample)
    probes += [(("python", s), None) for s in scripts]
    return probes, at + 60


def figures(state: Path, probe: Probe, now: float) -> tuple[Any, ...]:
    """Everything `gpuwait estimate` shows for the command."""
    learned = learn(state, list(probe[0]), CWD, key=probe[1], now=now)
    return (
        learned.estimate,
        learned.basis(),
        learned.run_time,
        learned.wait_time,
        learned.load_time,
        [
            (lv.total_runs, sum(1 for r in recent(lv.runs, now) if r.ok and not r.oom))
            for lv in learned.levels
        ],
    )


def measure(runs: int, limit: int, sample: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp)
        path = store.history_path(state)
        probes, now = sweep_history(state, runs, sample)
        size_before = path.stat().st_size
        before = {p: figures(state, p, now) for p in probes}
        parsed = store.read_from(path)
        whole = parsed.records[-1][1]
        print(f"\n{runs:,} runs, {len(probes)} sampled commands, limit {limit / 2**20:g} MiB")
        print(
            f"  a whole record {len(record.encode_existing(whole))} bytes, "
            f"its slim form {len(record.encode_existing(record.slim(whole)))} bytes"
        )
        if size_before <= limit:
            print(f"  history {size_before / 2**20:.1f} MiB: below the limit, no compaction")
            return
        started = time.perf_counter()
        with store.history_lock(state):
            result = store.compact(state, limit)
        took = time.perf_counter() - started
        size_after = path.stat().st_size
        print(
            f"  records: {result.records_before:,} before, {result.whole + result.slim:,} after "
            f"({result.whole:,} whole, {result.slim:,} slim; left out for the budget: "
            f"{result.dropped_unprotected:,} of keys with < {MIN_RUNS} runs, "
            f"{result.dropped_protected:,} others)"
        )
        print(
            f"  file: {size_before / 2**20:.1f} MiB before, {size_after / 2**20:.1f} MiB after "
            f"(budget {limit // 2 / 2**20:g} MiB); compaction took {took:.1f} s"
        )
        after = {p: figures(state, p, now) for p in probes}
        vram = sum(1 for p in probes if after[p][0].bytes != before[p][0].bytes)
        anything = sum(1 for p in probes if after[p] != before[p])
        print(f"  sampled estimates changed: VRAM {vram} of {len(probes)}, any figure {anything}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", default="110000,250000", help="comma-separated run counts")
    parser.add_argument("--limit", default="64MiB", help="history_max_size (64MiB)")
    parser.add_argument("--sample", type=int, default=300)
    args = parser.parse_args()
    limit = parse_size(args.limit)
    for runs in (int(n) for n in args.records.split(",")):
        measure(runs, limit, args.sample)


if __name__ == "__main__":
    main()
