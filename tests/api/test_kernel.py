"""`%gpuwait` in a real Jupyter kernel, beside wrapped jobs: it waits its turn, is seen running
with the kernel's pid, and its room goes back when the kernel is shut down."""

from __future__ import annotations

import os
import queue
import subprocess
from pathlib import Path
from typing import Any

import pytest
from helpers.fixtures_sim import SimFileFactory, hold_card
from helpers.history import recorded_runs
from helpers.status import job_named, state_of
from helpers.waiting import wait_for

pytest.importorskip(
    "jupyter_client", reason="jupyter_client is not installed (pip install -e '.[test]')"
)
pytest.importorskip("ipykernel", reason="ipykernel is not installed (pip install -e '.[test]')")

GiB = 2**30


def outputs(client: Any, msg_id: str, timeout: float = 60) -> tuple[str, str]:
    """What the cell `msg_id` wrote to stdout and to stderr, once it has run; fails on an
    error."""
    text: dict[str, list[str]] = {"stdout": [], "stderr": []}
    while True:
        try:
            msg = client.get_iopub_msg(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"the cell did not finish within {timeout}s; so far: {text}")
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            text[content["name"]].append(content["text"])
        elif kind == "error":
            pytest.fail(f"the cell failed: {content['ename']}: {content['evalue']}")
        elif kind == "status" and content["execution_state"] == "idle":
            return "".join(text["stdout"]), "".join(text["stderr"])


@pytest.mark.slow
def test_kernel_reserves_beside_wrapped_jobs_and_releases_on_shutdown(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    from jupyter_client.manager import KernelManager

    sim_file(gpus=1, memory="24GiB")
    manager = KernelManager(kernel_name="python3")
    manager.start_kernel(env=dict(os.environ), cwd=str(tmp_path))
    jobs: list[subprocess.Popen[str]] = []
    try:
        client = manager.client()
        client.start_channels()
        client.wait_for_ready(timeout=60)
        first = hold_card(gpuwait_cmd, "16G", "2s", "--name", "first")
        jobs.append(first)
        wait_for(lambda: state_of(gpuwait_cmd, "first") == "running")
        assert outputs(client, client.execute("%load_ext gpuwait")) == ("", "")
        cell = client.execute(
            "r = %gpuwait 10G --name notebook\nimport os\n"
            "print(os.getpid(), os.environ['CUDA_VISIBLE_DEVICES'] == r.uuids[0])"
        )
        wait_for(lambda: state_of(gpuwait_cmd, "notebook") == "waiting", timeout=30)
        printed, said = outputs(client, cell)
        assert first.wait(timeout=30) == 0, first.communicate()[1]
        pid_text, visible = printed.split()
        kernel_pid = int(pid_text)
        assert visible == "True"
        # The waiting line, then what it got, in the cell's output.
        assert "waiting for 10.0 GiB" in said
        assert "gpuwait: reserved 10.0 GiB on GPU0" in said
        mine = job_named(gpuwait_cmd, "notebook")
        assert mine is not None
        assert (mine["state"], mine["pid"], mine["child_pid"]) == (
            "running",
            kernel_pid,
            kernel_pid,
        )
        # The notebook allocates through its CUDA_VISIBLE_DEVICES beside a wrapped job that
        # fits the rest: neither runs out of memory.
        beside = hold_card(gpuwait_cmd, "10G", "1s", "--name", "beside")
        jobs.append(beside)
        cell = client.execute(
            "import subprocess, sys\nprint(subprocess.run([sys.executable, '-m', 'gpuwait', "
            "'sim', 'job', '--vram', '9G', '--hold', '1s']).returncode)"
        )
        assert outputs(client, cell)[0] == "0\n"
        assert beside.wait(timeout=30) == 0, beside.communicate()[1]
        after = hold_card(gpuwait_cmd, "16G", "0.2s", "--name", "after")
        jobs.append(after)
        wait_for(lambda: state_of(gpuwait_cmd, "after") == "waiting")
        client.stop_channels()
        manager.shutdown_kernel(now=False)
        wait_for(lambda: job_named(gpuwait_cmd, "notebook") is None, timeout=30)
        assert after.wait(timeout=30) == 0, after.communicate()[1]
    finally:
        if manager.has_kernel:
            manager.shutdown_kernel(now=True)
        for job in jobs:
            if job.poll() is None:
                job.kill()
            job.communicate()
    # Shut down cleanly, the kernel released its reservation and recorded the run.
    (run,) = [r for r in recorded_runs() if r["name"] == "notebook"]
    assert run["exit_status"] == 0 and 8 * GiB <= run["peak_bytes"] <= 10 * GiB
