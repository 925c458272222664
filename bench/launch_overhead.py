"""Launch overhead: `gpuwait --vram 1G -- true` on a free simulated GPU against bare `true`.

Prints the median of N runs of each, interleaved so machine noise hits both alike, the
difference in milliseconds, and the ratio. Goal: at most 60 ms over bare.

`--nvml` runs the same through the NVML backend instead, with the fake libnvidia-ml.so.1 the
tests build (gcc needed): the real pynvml and its import cost, without a driver's own start-up.

`--against REV` also times the gpuwait of another revision (a git revision of this repository,
or a directory holding a checkout), interleaved with this one in the same run, and prints the
ratio of the two overheads: a change must not make a launch slower.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tarfile
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


#: The CPU (user and system) each timed command used, by the command: seconds, in run order.
CPU: dict[str, list[float]] = {}


def timed(cmd: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, env=env, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    used = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    CPU.setdefault(f"{env.get('PYTHONPATH')} {cmd}", []).append(used)
    return time.perf_counter() - started


def nvml_env(env: dict[str, str]) -> dict[str, str]:
    """`env` with the simulation off and the tests' fake NVIDIA driver (one free 80 GiB GPU)."""
    sys.path.insert(0, str(REPO / "tests"))
    from helpers.fixtures_nvml import LIB_NAME, FakeGpu, FakeNvml, _compile

    root = Path(tempfile.mkdtemp(prefix="gpuwait-bench-nvml-"))
    _compile(root / LIB_NAME, LIB_NAME)
    fake = FakeNvml(root, root / "state", root / "log")
    fake.set_gpus([FakeGpu()])
    env = fake.env({k: v for k, v in env.items() if k != "GPUWAIT_SIM"})
    env.pop("FAKE_NVML_LOG")  # no call log: it would only add file writes to every NVML call
    return env


def checkout(revision: str, *more: str) -> Path:
    """A directory holding gpuwait as of `revision`: the directory itself, or the revision's
    tree unpacked from this repository (with the directories `more` names beside it: `shell`,
    where gpuwait/shell leads)."""
    if Path(revision).is_dir():
        return Path(revision).resolve()
    root = Path(tempfile.mkdtemp(prefix="gpuwait-bench-rev-"))
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", revision, "gpuwait", *more],
        capture_output=True,
        check=True,
    ).stdout
    archive_path = root / "tree.tar"
    archive_path.write_bytes(archive)
    with tarfile.open(archive_path) as tar:
        tar.extractall(root, filter="data")
    return root


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--nvml", action="store_true", help="the NVML backend, on a fake driver")
    parser.add_argument("--against", metavar="REV", help="also time this revision (or directory)")
    args = parser.parse_args()
    runs = args.runs
    env = nvml_env(sandbox()) if args.nvml else sandbox()
    bare_cmd = ["true"]
    python_cmd = [GPUWAIT[0], "-c", "pass"]
    gpuwait = launcher()
    wrapped_cmd = [*gpuwait, "--vram", "1G", "-q", "--", "true"]
    # Each tree its own state, so neither ledger grows with the other's runs.
    trees = {"this": (REPO, env)}
    if args.against:
        other = nvml_env(sandbox()) if args.nvml else sandbox()
        trees["other"] = (checkout(args.against), other)
    for tree, tree_env in trees.values():
        tree_env["PYTHONPATH"] = str(tree)
        timed(wrapped_cmd, tree_env)  # warm the page cache, the bytecode and the ledger
    bare, python = [], []
    wrapped: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(runs):
        bare.append(timed(bare_cmd, env))
        python.append(timed(python_cmd, env))
        for name, (_, tree_env) in trees.items():
            wrapped[name].append(timed(wrapped_cmd, tree_env))
    b, p = median(bare) * 1000, median(python) * 1000
    w = median(wrapped["this"]) * 1000
    print(f"runs:                          {runs}")
    print(f"gpuwait started as:            {' '.join(gpuwait)}")
    print(f"GPUs:                          {'NVML (fake driver)' if args.nvml else 'simulated'}")
    print(f"bare `true`:                   {b:7.1f} ms (median)")
    print(f"bare python interpreter start: {p:7.1f} ms (median, for reference)")
    print(f"gpuwait --vram 1G -- true:     {w:7.1f} ms (median)")
    print(f"overhead:                      {w - b:7.1f} ms   ratio {w / b:5.1f}x   goal <= 60 ms")
    if args.against:
        o = median(wrapped["other"]) * 1000
        print(f"the same, as of {args.against}:".ljust(31) + f"{o:7.1f} ms (median)")
        print(
            f"overhead, this / {args.against}:".ljust(31)
            + f"{(w - b) / (o - b):7.2f}   (below 1: this launch is faster)"
        )
        # Less moved than the clock by what else the machine runs.
        cpu = {
            name: CPU[f"{tree_env.get('PYTHONPATH')} {wrapped_cmd}"]
            for name, (_, tree_env) in trees.items()
        }
        c, d = median(cpu["this"][1:]) * 1000, median(cpu["other"][1:]) * 1000
        print(
            f"CPU of a launch:               {c:7.1f} ms (median), as of {args.against} {d:.1f} ms"
        )
        print(f"CPU, this / {args.against}:".ljust(31) + f"{c / d:7.2f}")


if __name__ == "__main__":
    main()
