"""A stand-in CUDA MPS control daemon, as gpuwait.linux.mps finds one."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def mps_daemon(tmp_path: Path) -> Iterator[Path]:
    """A stand-in MPS control daemon: a live process whose name is the daemon's, its pid file
    and its control socket, in a pipe directory of its own."""
    pipes = tmp_path / "mps"
    pipes.mkdir()
    program = tmp_path / "nvidia-cuda-mps-control"
    program.symlink_to("/bin/sleep")
    daemon = subprocess.Popen([str(program), "300"])
    comm = Path(f"/proc/{daemon.pid}/comm")
    deadline = time.monotonic() + 10
    while comm.read_text().strip() != "nvidia-cuda-mps" and time.monotonic() < deadline:
        time.sleep(0.01)  # named by its exec, which a loaded machine may take a moment for
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(pipes / "control"))
    listener.listen()
    (pipes / "nvidia-cuda-mps-control.pid").write_text(f"{daemon.pid}\n")
    try:
        yield pipes
    finally:
        listener.close()
        daemon.kill()
        daemon.wait()
