"""What the bash hook of `gpuwait shell-init` adds to starting a wrapped command.

    python bench/shell_hook_overhead.py [RUNS]

Runs `python -c pass` through the hook in bash against simulated GPUs (a temporary sim file
and state dir), bare, disabled, sent bare by a never_wrap rule, and wrapped, and prints the
milliseconds per run and the ratio to the bare run measured in the same process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CASES = [
    ("bare (command python)", "command python -c pass"),
    ("GPUWAIT_DISABLE=1", "GPUWAIT_DISABLE=1 python -c pass"),
    ("sent bare by never_wrap", "python -c pass --version"),
    ("wrapped (1 GiB on a free sim GPU)", "python -c pass"),
]


def main() -> int:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    with tempfile.TemporaryDirectory() as tmp:
        bin_dir = Path(tmp, "bin")
        bin_dir.mkdir()
        for name, line in (
            ("gpuwait", f'PYTHONPATH={REPO} exec {sys.executable} -m gpuwait "$@"'),
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
        subprocess.run(
            ["gpuwait", "sim", "init", f"{tmp}/sim.toml"], env=env, check=True, capture_output=True
        )
        print(f'{runs} runs each; bash with `eval "$(gpuwait shell-init bash --always)"`')
        baseline = None
        for label, command in CASES:
            script = (
                'eval "$(gpuwait shell-init bash --always --no-completion)"\n'
                f"for i in $(seq {runs}); do {command} >/dev/null; done\n"
            )
            started = time.perf_counter()
            subprocess.run(["bash", "--norc", "-c", script], env=env, check=True)
            per_run = (time.perf_counter() - started) / runs * 1000
            baseline = baseline or per_run
            print(f"  {label:<36} {per_run:7.1f} ms/run  x{per_run / baseline:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
