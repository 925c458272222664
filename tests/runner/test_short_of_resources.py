"""A machine short of threads, processes or file descriptors must not cost the user's command its
output, its exit status or its life, and must not leave its room reserved."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from helpers.fixtures_sim import SimFileFactory


def last_record() -> dict[str, Any]:
    path = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "history.jsonl"
    return dict(json.loads(path.read_text().splitlines()[-1]))


#: gpuwait in a process that can start no thread (a pids cgroup or `ulimit -u` reached, address
#: space too small for a thread's stack): Python says so as "can't start new thread".
NO_THREADS = textwrap.dedent(
    """
    import sys, threading
    def refuse(self):
        raise RuntimeError("can't start new thread")
    threading.Thread.start = refuse
    from gpuwait.cli import main
    sys.exit(main(sys.argv[1:]))
    """
)


def test_no_thread_for_watching_stderr_leaves_the_command_running_to_its_end(
    sim_file: SimFileFactory,
) -> None:
    sim_file(gpus=1)
    command = ["sh", "-c", "echo out; echo err >&2; exit 3"]
    done = subprocess.run(
        [sys.executable, "-c", NO_THREADS, "--vram", "1G", "--", *command],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
    record = last_record()
    assert record["exit_status"] == 3 and record["stderr_watched"] == "off"
