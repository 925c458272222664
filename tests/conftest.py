"""Shared fixtures. Every test gets its own state, config and cache directories."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest_plugins = [
    "helpers.fixtures_nvml",
    "helpers.fixtures_sim",
    "helpers.processes",
    "helpers.mps",
    "helpers.tmux",
]

REPO = Path(__file__).resolve().parent.parent

# pytest-xdist runs each worker's tests in its main thread, beside the thread that reads the
# controller's commands. A signal sent to the process (`kill PID`, a timer, inotify's SIGIO)
# goes to its main thread unless that thread holds it blocked, as gpuwait does while it waits;
# it then went to the other thread, whose default action for most signals ends the worker.
# Workers start with every signal blocked, which that thread keeps, and their main thread
# takes back the controller's mask: a worker takes signals as a one-thread pytest does.
_controller_mask: set[signal.Signals] | None = None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_setupnodes(config: pytest.Config, specs: Any) -> None:
    global _controller_mask
    _controller_mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    if _controller_mask is not None:
        node.workerinput["gpuwait_sigmask"] = sorted(int(s) for s in _controller_mask)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object | None) -> None:
    # A worker that crashed is replaced by one started next: blocked alike.
    if _controller_mask is not None and error is not None:
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())


@pytest.hookimpl(optionalhook=True)
def pytest_testnodeready(node: Any) -> None:
    # Every worker (or the one replacing a crashed worker) has been started by now: the
    # controller takes Ctrl-C again.
    if _controller_mask is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, _controller_mask)


def pytest_sessionfinish(session: pytest.Session) -> None:
    # No worker replaced the last to crash (--max-worker-restart reached).
    if _controller_mask is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, _controller_mask)


def pytest_configure(config: pytest.Config) -> None:
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        return
    if "gpuwait_sigmask" in workerinput:
        signal.pthread_sigmask(signal.SIG_SETMASK, workerinput["gpuwait_sigmask"])
    # execnet gives workers a terminal's size; gpuwait's tables would take it for one.
    for name in ("COLUMNS", "LINES"):
        os.environ.pop(name, None)


@pytest.fixture(autouse=True)
def isolated_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Point every platformdirs location at a fresh temporary home, and clear GPUWAIT_* settings."""
    home = tmp_path / "home"
    for sub in ("state", "config", "cache", "data", "runtime"):
        (home / sub).mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_STATE_HOME", str(home / "state"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / "config"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / "cache"))
    monkeypatch.setenv("XDG_DATA_HOME", str(home / "data"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(home / "runtime"))
    monkeypatch.setenv("XDG_CONFIG_DIRS", str(home / "site-config"))
    for name in list(os.environ):
        # The budgets' framework settings too: a test sees what gpuwait exports, not the host's.
        if name.startswith(("GPUWAIT_", "XLA_", "PYTORCH_", "CUDA_MPS_")) or name in (
            "CUDA_VISIBLE_DEVICES",
            "CUDA_DEVICE_ORDER",
            "TF_FORCE_GPU_ALLOW_GROWTH",
        ):
            monkeypatch.delenv(name, raising=False)
    # Subprocesses run the gpuwait of this checkout.
    monkeypatch.setenv("PYTHONPATH", str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    yield home


@pytest.fixture
def gpuwait_cmd() -> list[str]:
    """argv prefix that runs this checkout's gpuwait in a fresh interpreter."""
    return [sys.executable, "-m", "gpuwait"]


@pytest.fixture
def booted_an_hour_ago(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process's boot clock as on a machine up an hour: a test that moves a job's start
    minutes back on it must not reach before the boot, as it would on a machine booted a
    moment ago (a fresh CI machine), where a negative stamp is read as none."""
    from gpuwait.linux import proc

    real = proc.boot_clock
    monkeypatch.setattr(proc, "boot_clock", lambda: real() + 3600.0)
