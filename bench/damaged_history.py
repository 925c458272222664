"""What a damaged history costs a launch: junk in front of a history of real runs.

    python bench/damaged_history.py [--junk-mib 1024] [--records 20000] [--against REV]

A history of `--records` runs (a few MiB), then the same runs behind `--junk-mib` MiB of junk
lines ("y", the worst kind: the most lines per byte). For each, with the history index removed
so the launch must read the history:
- the first launch, `gpuwait -- true` learning its size (it rebuilds the index from the
  history, runs, records the run and, the junk file being over history_max_size, compacts it);
- the launch after it (the index is up to date again);
- `gpuwait estimate -- true` with the index removed again (a rebuild, and nothing else).
Printed in seconds, and the ratio damaged / clean of each, in the same run: a launch's cost must
not grow with the damage (the bound is what a history at its size limit costs).
`--against REV` times the gpuwait of another revision (or checkout) the same way.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _common import GPUWAIT, sandbox
from estimate_speed import synthetic_history
from launch_overhead import checkout

REPO = Path(__file__).resolve().parent.parent


def timed(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, env=env, check=True, capture_output=True, timeout=3600)
    return time.perf_counter() - started


def prepare(tree: Path, records: int, junk_mib: int) -> dict[str, str]:
    env = sandbox()
    env["PYTHONPATH"] = str(tree)
    state = Path(env["XDG_STATE_HOME"]) / "gpuwait"
    synthetic_history(state, records)
    os.chmod(state, 0o700)
    history = state / "history.jsonl"
    os.chmod(history, 0o600)
    if junk_mib:
        runs = history.read_bytes()
        with open(history, "wb") as f:
            block = b"y\n" * (1 << 19)  # 1 MiB
            for _ in range(junk_mib):
                f.write(block)
            f.write(runs)
    return env


def measure(tree: Path, records: int, junk_mib: int) -> tuple[float, float, float]:
    env = prepare(tree, records, junk_mib)
    state = Path(env["XDG_STATE_HOME"]) / "gpuwait"
    index = state / "history.index"
    shutil.rmtree(index, ignore_errors=True)
    launch = [*GPUWAIT, "-q", "--", "true"]
    first = timed(launch, env)
    second = timed(launch, env)
    shutil.rmtree(index, ignore_errors=True)
    estimate = timed([*GPUWAIT, "estimate", "--", "true"], env)
    shutil.rmtree(Path(env["XDG_STATE_HOME"]).parent, ignore_errors=True)
    return first, second, estimate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--junk-mib", type=int, default=1024)
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--against", metavar="REV", help="also time this revision (or directory)")
    args = parser.parse_args()
    trees = {"this": REPO}
    if args.against:
        trees[args.against] = checkout(args.against)
    print(f"history: {args.records} runs; damaged: the same behind {args.junk_mib} MiB of junk")
    print(f"{'':28}{'first launch':>14}{'next launch':>14}{'estimate':>12}")
    for name, tree in trees.items():
        clean = measure(tree, args.records, 0)
        damaged = measure(tree, args.records, args.junk_mib)
        for label, figures in ((f"{name}, clean", clean), (f"{name}, damaged", damaged)):
            print(
                f"{label:28}" + "".join(f"{v:13.2f}s" for v in figures[:2]) + f"{figures[2]:11.2f}s"
            )
        ratios = [d / c for d, c in zip(damaged, clean, strict=True)]
        print(
            f"{name + ', damaged / clean':28}"
            + "".join(f"{r:13.1f}×" for r in ratios[:2])
            + f"{ratios[2]:11.1f}×"
        )


if __name__ == "__main__":
    sys.exit(main())
