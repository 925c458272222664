"""What the bash hook of `gpuwait shell-init` adds to starting a wrapped command.

    python bench/shell_hook_overhead.py [RUNS] [--against REV]

Runs `python -c pass` through the hook in bash against simulated GPUs (a temporary sim file
and state dir), bare, disabled, sent bare by a never_wrap rule, and wrapped, and prints the
milliseconds per run and the ratio to the bare run measured in the same process; last,
`gpuwait shell-hook` deciding alone on a `true` it sends bare, without a Python command's start.

`--against REV` also runs each case through the hook of another revision (a git revision of
this repository, or a directory holding a checkout), the two taking turns in the same run, and
prints the ratio of what the hook adds over bare for each: below 1, this tree's hook is faster.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from launch_overhead import checkout

REPO = Path(__file__).resolve().parent.parent

CASES = [
    ("bare (command python)", "command python -c pass"),
    ("GPUWAIT_DISABLE=1", "GPUWAIT_DISABLE=1 python -c pass"),
    ("sent bare by never_wrap", "python -c pass --version"),
    ("wrapped (1 GiB on a free sim GPU)", "python -c pass"),
    # What the hook's own Python costs, without the second start of the command's.
    ("gpuwait shell-hook -- true --version", "command gpuwait shell-hook -- true --version"),
]

#: Each case is run in this many turns per tree, so that machine noise hits both trees alike.
TURNS = 5


def tree_env(tree: Path, tmp: Path) -> dict[str, str]:
    """The environment of a shell hooked by the gpuwait of `tree`, with its own state."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(parents=True)
    for name, line in (
        ("gpuwait", f'PYTHONPATH={tree} exec {sys.executable} -m gpuwait "$@"'),
        ("python", f'exec {sys.executable} "$@"'),
    ):
        (bin_dir / name).write_text(f"#!/bin/sh\n{line}\n")
        (bin_dir / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "XDG_STATE_HOME": f"{tmp}/state",
        "XDG_CONFIG_HOME": f"{tmp}/config",
        "GPUWAIT_SIM": f"{tmp}/sim.toml",
        "GPUWAIT_DEFAULT_VRAM": "1G",
    }
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    # Run from there, not from this repository: `python -m gpuwait` would import the gpuwait
    # of the directory it starts in, whatever PYTHONPATH says.
    env["PWD"] = str(tmp)
    subprocess.run(
        ["gpuwait", "sim", "init", f"{tmp}/sim.toml"],
        env=env,
        cwd=tmp,
        check=True,
        capture_output=True,
    )
    return env


def cpu_of_children() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def timed(command: str, runs: int, env: dict[str, str]) -> tuple[float, float]:
    """Seconds `runs` runs of `command` take in a hooked bash: on the clock, and of CPU (less
    moved by what else the machine runs)."""
    script = (
        'eval "$(gpuwait shell-init bash --always --no-completion)"\n'
        f"for i in $(seq {runs}); do {command} >/dev/null; done\n"
    )
    started, cpu = time.perf_counter(), cpu_of_children()
    subprocess.run(["bash", "--norc", "-c", script], env=env, cwd=env["PWD"], check=True)
    return time.perf_counter() - started, cpu_of_children() - cpu


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", type=int, nargs="?", default=20)
    parser.add_argument("--against", metavar="REV", help="also time this revision (or directory)")
    args = parser.parse_args()
    runs = max(args.runs, TURNS)
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this": tree_env(REPO, Path(tmp, "this"))}
        if args.against:
            trees["other"] = tree_env(checkout(args.against, "shell"), Path(tmp, "other"))
        for env in trees.values():
            timed(CASES[3][1], 1, env)  # the bytecode, the ledger and the history made
        print(f'{runs} runs each; bash with `eval "$(gpuwait shell-init bash --always)"`')
        # By tree, case and measure (0: on the clock, 1: of CPU): milliseconds per run.
        per_run: dict[tuple[str, str, int], float] = {}
        for label, command in CASES:
            spent = {name: [0.0, 0.0] for name in trees}
            for turn in range(TURNS):
                share = runs // TURNS + (1 if turn < runs % TURNS else 0)
                for name, env in trees.items():
                    for measure, seconds in enumerate(timed(command, share, env)):
                        spent[name][measure] += seconds
            for name in trees:
                for measure in (0, 1):
                    per_run[name, label, measure] = spent[name][measure] / runs * 1000
        bare = CASES[0][0]
        for measure, unit in ((0, "ms/run"), (1, "ms of CPU/run")):
            print(f"{unit}:")
            for label, command in CASES:
                ms = per_run["this", label, measure]
                line = f"  {label:<36} {ms:7.1f}  x{ms / per_run['this', bare, measure]:.2f}"
                if args.against and label != bare:
                    other = per_run["other", label, measure]
                    added = ms - per_run["this", bare, measure]
                    added_before = other - per_run["other", bare, measure]
                    line += f"   as of {args.against}: {other:7.1f}"
                    if command.startswith("command gpuwait"):  # no Python command run
                        line += f", this / then {ms / other:5.2f}"
                    elif added_before > 0:
                        line += f", added over bare this / then {added / added_before:5.2f}"
                print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
