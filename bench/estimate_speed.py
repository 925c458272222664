"""How fast an estimate is with a 100,000-record history.

    python bench/estimate_speed.py [--records 100000]

Prints, all measured in this one process on the same synthetic history:
- the first estimate, which builds the index from the history (once, after compaction or damage);
- a warm estimate (the launch path): stat, a small meta file and up to three small buckets;
- a naive estimate that parses the whole history and filters it, as a baseline, and the ratio;
- with --launch N: whole launches of `gpuwait -- true` on a simulated GPU, once with --vram and
  once learning the size from that history, interleaved, to show what the estimate adds to a
  launch (and a bare `true` for reference).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpuwait.core.cmdkey import command_key
from gpuwait.core.estimate import estimate
from gpuwait.history import record as run_record
from gpuwait.history import store
from gpuwait.history.learn import learn

GiB = 2**30
CWD = "/home/me/proj"


def synthetic_history(state: Path, records: int, seed: int = 1) -> list[list[str]]:
    """`records` runs of 40 scripts with varied arguments (about 4,000 distinct lines)."""
    rng = random.Random(seed)
    scripts = [f"exp{i}/train.py" for i in range(40)]
    now = time.time()
    commands: list[list[str]] = []
    lines = []
    for n in range(records):
        argv = ["python", rng.choice(scripts), "--bs", str(rng.choice([8, 16, 32])), "--lr"]
        argv.append(str(rng.randrange(33)))
        commands.append(argv)
        peak = int(rng.uniform(2, 40) * GiB)
        record = {
            "job_id": f"{n:08x}",
            "command": argv,
            "cwd": CWD,
            "keys": command_key(argv, CWD).hashes(),
            "peak_bytes": peak,
            "peak_by_gpu": {"GPU-0": peak},
            "reserved_bytes": peak,
            "request": {"bytes": peak},
            "request_source": "flag",
            "gpus": [{"uuid": "GPU-0", "index": 0, "name": "H100", "total_bytes": 80 * GiB}],
            "started_at": now - (records - n) * 60,
            "exit_status": 0 if rng.random() > 0.05 else 1,
            "signal": None,
            "oom": False,
            "run_seconds": rng.uniform(10, 3600),
            "wait_seconds": rng.uniform(0, 60),
            "time_to_peak_seconds": rng.uniform(1, 60),
            "samples": 100,
        }
        lines.append(run_record.encode(record))
    state.mkdir(parents=True, exist_ok=True)
    store.history_path(state).write_bytes(b"".join(lines))
    return commands


def naive(state: Path, argv: list[str]) -> int | None:
    parsed = store.read_from(store.history_path(state))
    key = command_key(argv, CWD)
    hashes = key.hashes()
    levels = []
    for name, _ in key.levels:
        runs = []
        for _, record in parsed.records:
            if hashes[name] in run_record.record_keys(record).values():
                stat = run_record.run_stat(record)
                if stat is not None:
                    runs.append(stat)
        levels.append((name, runs))
    return estimate(levels, time.time()).bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--launch", type=int, default=0, metavar="N", help="time N launches")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "state"
        commands = synthetic_history(state, args.records)
        size = store.history_path(state).stat().st_size
        print(f"history: {args.records} records, {size / 2**20:.1f} MiB")
        probes = [commands[-1], commands[len(commands) // 2], ["python", "unseen.py"]]

        started = time.perf_counter()
        learn(state, probes[0], CWD)
        print(
            f"first estimate, building the index: {(time.perf_counter() - started) * 1e3:8.1f} ms"
        )

        warm = []
        for i in range(args.repeat):
            argv = probes[i % len(probes)]
            started = time.perf_counter()
            learned = learn(state, argv, CWD)
            warm.append(time.perf_counter() - started)
            assert learned.estimate.bytes is not None
        warm_ms = statistics.median(warm) * 1e3
        print(
            f"warm estimate (launch path), median of {args.repeat}: {warm_ms:8.2f} ms "
            f"(max {max(warm) * 1e3:.2f} ms)"
        )

        naive_times = []
        for argv in probes:
            started = time.perf_counter()
            expected = naive(state, argv)
            naive_times.append(time.perf_counter() - started)
            # The index keeps the newest runs of each key, which is all an estimate looks at.
            assert expected == learn(state, argv, CWD).estimate.bytes, argv
        naive_ms = statistics.median(naive_times) * 1e3
        print(f"naive full scan of the history (baseline), median of 3: {naive_ms:8.1f} ms")
        print(f"ratio baseline / warm estimate: {naive_ms / warm_ms:,.0f}x")
        print(f"target: warm estimate <= 20 ms: {'met' if warm_ms <= 20 else 'NOT met'}")
        if args.launch:
            launches(Path(tmp), state, args.launch)


def launches(tmp: Path, state: Path, count: int) -> None:
    sim = tmp / "sim.toml"
    sim.write_text('[[gpu]]\nmemory = "80GiB"\n')
    env = {
        **os.environ,
        "GPUWAIT_SIM": str(sim),
        "GPUWAIT_STATE_DIR": str(state),
        "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
    }
    gpuwait = [sys.executable, "-m", "gpuwait", "-q"]
    variants = {
        "bare `true`": ["true"],
        "gpuwait --vram 1G true": [*gpuwait, "--vram", "1G", "--", "true", "exp1/train.py"],
        "gpuwait true (estimate)": [*gpuwait, "--", "true", "exp1/train.py"],
    }
    # Three runs of that line, so its estimate is learned; the index holds the 100,000 others.
    for _ in range(3):
        subprocess.run(variants["gpuwait --vram 1G true"], env=env, check=True)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(count):
        for name, argv in variants.items():
            started = time.perf_counter()
            subprocess.run(argv, env=env, check=True)
            times[name].append(time.perf_counter() - started)
    for name, values in times.items():
        print(f"launch {name:<26} median of {count}: {statistics.median(values) * 1e3:7.1f} ms")
    added = statistics.median(times["gpuwait true (estimate)"]) - statistics.median(
        times["gpuwait --vram 1G true"]
    )
    print(f"the estimate adds {added * 1e3:.1f} ms to a launch")


if __name__ == "__main__":
    main()
