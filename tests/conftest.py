"""Shared fixtures. Every test gets its own state, config and cache directories."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest_plugins = [
    "helpers.fixtures_nvml",
    "helpers.fixtures_sim",
    "helpers.processes",
    "helpers.mps",
    "helpers.tmux",
]

REPO = Path(__file__).resolve().parent.parent


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
