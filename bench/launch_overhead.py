"""Launch overhead: `gpuwait --vram 1G -- true` on a free simulated GPU against bare `true`.

Prints the median of N runs of each, interleaved so machine noise hits both alike, the
difference in milliseconds, and the ratio. Goal: at most 60 ms over bare.

`--nvml` runs the same through the NVML backend instead, with the fake libnvidia-ml.so.1 the
tests build (gcc needed): the real pynvml and its import cost, without a driver's own start-up.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import GPUWAIT, REPO, median, sandbox


def launcher() -> list[str]:
    """The `gpuwait` console script beside this Python, as users run it; else `python -m`."""
    script = Path(sys.executable).parent / "gpuwait"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return GPUWAIT


def timed(cmd: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(cmd, env=env, check=True)
    return time.perf_counter() - started


def nvml_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with the simulation off and the tests' fake NVIDIA driver (one free 80 GiB GPU)."""
    sys.path.insert(0, str(REPO / "tests"))
    from _fixtures_nvml import LIB_NAME, FakeGpu, FakeNvml, _compile

    root = Path(tempfile.mkdtemp(prefix="gpuwait-bench-nvml-"))
    _compile(root / LIB_NAME, LIB_NAME)
    fake = FakeNvml(root, root / "state", root / "log")
    fake.set_gpus([FakeGpu()])
    env = fake.env({k: v for k, v in env.items() if k != "GPUWAIT_SIM"})
    env.pop("FAKE_NVML_LOG")  # no call log: it would only add file writes to every NVML call
    return env


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--nvml", action="store_true", help="the NVML backend, on a fake driver")
    args = parser.parse_args()
    runs = args.runs
    env = nvml_env(sandbox()) if args.nvml else sandbox()
    bare_cmd = ["true"]
    python_cmd = [GPUWAIT[0], "-c", "pass"]
    gpuwait = launcher()
    wrapped_cmd = [*gpuwait, "--vram", "1G", "-q", "--", "true"]
    timed(wrapped_cmd, env)  # warm the page cache and the ledger
    bare, python, wrapped = [], [], []
    for _ in range(runs):
        bare.append(timed(bare_cmd, env))
        python.append(timed(python_cmd, env))
        wrapped.append(timed(wrapped_cmd, env))
    b, p, w = median(bare) * 1000, median(python) * 1000, median(wrapped) * 1000
    print(f"runs:                          {runs}")
    print(f"gpuwait started as:            {' '.join(gpuwait)}")
    print(f"GPUs:                          {'NVML (fake driver)' if args.nvml else 'simulated'}")
    print(f"bare `true`:                   {b:7.1f} ms (median)")
    print(f"bare python interpreter start: {p:7.1f} ms (median, for reference)")
    print(f"gpuwait --vram 1G -- true:     {w:7.1f} ms (median)")
    print(f"overhead:                      {w - b:7.1f} ms   ratio {w / b:5.1f}x   goal <= 60 ms")


if __name__ == "__main__":
    main()
