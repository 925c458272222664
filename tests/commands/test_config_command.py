"""`gpuwait config` shows the values gpuwait acts on, and where each came from."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path


def _files(home: Path, site: str, own: str) -> Path:
    """A site config file and a config file of the user's own; the shared ledger dir."""
    shared = home / "shared-ledger"
    shared.mkdir()
    shared.chmod(0o1777)
    site_file = home / "site-config" / "gpuwait" / "config.toml"
    site_file.parent.mkdir(parents=True)
    site_file.write_text(f'ledger_dir = "{shared}"\n{site}')
    own_file = home / "config" / "gpuwait" / "config.toml"
    own_file.parent.mkdir(parents=True)
    own_file.write_text(own)
    return shared


def _settings(gpuwait_cmd: list[str]) -> dict[str, dict[str, object]]:
    done = subprocess.run([*gpuwait_cmd, "config", "--json"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    settings: dict[str, dict[str, object]] = json.loads(done.stdout)["settings"]
    return settings


def test_config_shows_the_queue_order_a_shared_ledger_is_planned_in(
    isolated_dirs: Path, gpuwait_cmd: list[str]
) -> None:
    """A user's own queue_order and shorter wait budgets are not used in a shared ledger:
    `gpuwait config` shows the site's, in force there, and says the user's are not used."""
    own_file = isolated_dirs / "config" / "gpuwait" / "config.toml"
    shared = _files(
        isolated_dirs,
        site='max_wait = "1h"\nmax_wait_factor = 4.0\n',
        own='queue_order = "fifo"\nmax_wait = "10m"\nmax_wait_factor = 2.0\n',
    )
    settings = _settings(gpuwait_cmd)
    order = settings["queue_order"]
    assert order["value"] == "lookahead", "config showed an order the shared queue is not in"
    assert order["parsed"] == "lookahead"
    assert str(shared) in str(order["source"])
    assert f"yours, fifo from config file {own_file}, is not used" in str(order["source"])
    # In the site's order, with the site's budgets: the user's own were for another order.
    assert (settings["max_wait"]["value"], settings["max_wait_factor"]["parsed"]) == ("1h00m", 4.0)

    own_file.write_text('max_wait = "10m"\nmax_wait_factor = 2.0\nsafety = 0.8\n')
    settings = _settings(gpuwait_cmd)
    assert settings["queue_order"]["source"] == "default"
    wait = settings["max_wait"]
    assert (wait["value"], wait["parsed"]) == ("1h00m", 3600.0)
    assert f"yours, 10m00s from config file {own_file}, is not used" in str(wait["source"])
    assert settings["max_wait_factor"]["parsed"] == 4.0
    assert settings["safety"]["source"] == f"config file {own_file}"  # each user's own

    text = subprocess.run([*gpuwait_cmd, "config"], capture_output=True, text=True).stdout
    line = next(row for row in text.splitlines() if row.startswith("max_wait "))
    assert "1h00m" in line and "10m00s" in line and str(shared) in line


def test_config_shows_a_users_own_order_where_the_ledger_is_private(
    isolated_dirs: Path, gpuwait_cmd: list[str]
) -> None:
    own_file = isolated_dirs / "config" / "gpuwait" / "config.toml"
    shared = _files(isolated_dirs, site='queue_order = "lookahead"\n', own='queue_order = "fifo"\n')
    shared.chmod(0o700)
    order = _settings(gpuwait_cmd)["queue_order"]
    assert (order["value"], order["source"]) == ("fifo", f"config file {own_file}")


def test_config_with_a_shared_ledger_dir_not_there_yet_shows_the_settings(
    isolated_dirs: Path, gpuwait_cmd: list[str]
) -> None:
    shared = _files(isolated_dirs, site="", own='queue_order = "fifo"\n')
    shared.rmdir()
    assert os.path.lexists(shared) is False
    assert _settings(gpuwait_cmd)["queue_order"]["value"] == "fifo"


def test_a_site_queue_order_that_is_not_valid_is_refused_over_a_users_own(
    isolated_dirs: Path, gpuwait_cmd: list[str]
) -> None:
    """In a shared ledger the site's queue_order and wait budgets are used over a user's own:
    one the site file spells wrong stops the user's commands as it stops everyone else's, not
    shown as a valid order of the site's while the user's own keeps it out of sight."""
    _files(
        isolated_dirs,
        site='queue_order = "fair-share"\n',
        own='queue_order = "fifo"\nmax_wait = "10m"\n',
    )
    for args in (["config"], ["--", "true"]):
        done = subprocess.run([*gpuwait_cmd, *args], capture_output=True, text=True)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert "'fair-share' is not valid for queue_order" in done.stderr
        assert "site config file" in done.stderr and "Traceback" not in done.stderr
