"""gpuwait's state and config dirs are the ones platformdirs gives, whatever the environment."""

from __future__ import annotations

import os
import pwd
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.fixtures_sim import SimFileFactory

from gpuwait.core.errors import StateError
from gpuwait.linux import dirs

platformdirs = pytest.importorskip("platformdirs")

CASES = [
    {},
    {"XDG_STATE_HOME": "/srv/state", "XDG_CONFIG_HOME": "/srv/config/"},
    {"XDG_STATE_HOME": "relative/state", "XDG_CONFIG_HOME": ""},
    {"XDG_CONFIG_DIRS": "/opt/site:/etc/xdg"},
    {"XDG_CONFIG_DIRS": "relative:/opt/second"},
    {"XDG_CONFIG_DIRS": ""},
    {"HOME": "/home/someone/"},
    {"HOME": "/"},
    {"HOME": "not/absolute"},
    {"HOME": None},
]


@pytest.mark.parametrize("changes", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_dirs_match_platformdirs(
    changes: dict[str, str | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("XDG_STATE_HOME", "XDG_CONFIG_HOME", "XDG_CONFIG_DIRS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in changes.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert dirs.user_state_dir() == platformdirs.user_state_dir("gpuwait")
    assert dirs.user_config_dir() == platformdirs.user_config_dir("gpuwait")
    assert dirs.site_config_dir() == platformdirs.site_config_dir("gpuwait")


def test_no_home_at_all_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("XDG_STATE_HOME", raising=False)
    monkeypatch.setenv("HOME", "relative")
    monkeypatch.setattr(pwd, "getpwuid", lambda uid: (_ for _ in ()).throw(KeyError(uid)))
    with pytest.raises(StateError, match="cannot tell your home directory"):
        dirs.user_state_dir()


def test_the_cli_keeps_its_history_in_the_state_dir(sim_file: SimFileFactory) -> None:
    sim_file(gpus=1, memory="8GiB")
    done = subprocess.run(
        [sys.executable, "-m", "gpuwait", "--vram", "1G", "-q", "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert (Path(platformdirs.user_state_dir("gpuwait")) / "history.jsonl").is_file()


@pytest.mark.parametrize("state_dir_given", [False, True], ids=["state-in-home", "state-dir-set"])
def test_a_home_that_does_not_exist_is_never_made(
    sim_file: SimFileFactory, tmp_path: Path, state_dir_given: bool
) -> None:
    # A service user's home is often one that must not exist (HOME=/nonexistent, as Debian
    # gives nobody and system users); gpuwait run as root by a unit or cron job with it made
    # that home, and ~/.local/state in it, where the next program would take it for real.
    sim_file(gpus=1, memory="8GiB")
    home = tmp_path / "nonexistent"
    env = {k: v for k, v in os.environ.items() if not k.startswith("XDG_")}
    env["HOME"] = str(home)
    if state_dir_given:
        env["GPUWAIT_STATE_DIR"] = str(tmp_path / "state")
    done = subprocess.run(
        [sys.executable, "-m", "gpuwait", "--vram", "1G", "-q", "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert not home.exists()
    if state_dir_given:
        assert done.returncode == 0, done.stderr
    else:
        assert done.returncode == 5, done.stderr
        assert f"your home directory {home} does not exist" in done.stderr, done.stderr
        assert "GPUWAIT_STATE_DIR" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
