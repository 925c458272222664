"""Settings are typed: one attribute per setting, each shown by its own option's formatter."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import gpuwait.config as config
from gpuwait.config import OPTIONS, Settings, resolve
from gpuwait.core.errors import UsageError
from gpuwait.core.policy import UserLimits
from gpuwait.linux.stamp import FileStamp


def test_every_option_is_an_attribute_of_settings_in_the_same_order() -> None:
    names = [
        name
        for name in Settings._fields
        if name
        not in (
            "sources",
            "config_file",
            "site_file",
            "site_wait",
            "site_safety",
            "site_queue_order",
            "notes",
        )
    ]
    assert names == [option.name for option in OPTIONS]


def test_defaults_are_typed_values_and_shown_as_a_user_types_them() -> None:
    settings = resolve({}, {}, {}, Path("c.toml"))
    assert settings.safety == 0.9 and settings.priority == 3
    assert settings.default_vram is None and settings.shown("default_vram") == "exclusive"
    assert settings.timeout is None and settings.shown("timeout") == "none"
    assert settings.shown("pause_min_runtime") == "10m00s"
    assert settings.shown("history_max_size") == "64.0 MiB"
    assert settings.shown("estimate_margin") == "10%"
    assert settings.state_dir is None and settings.shown("state_dir") == "(not set)"
    assert all(source == "default" for source in settings.sources.values())


def test_a_path_setting_is_absolute_and_names_the_effective_directories(tmp_path: Path) -> None:
    settings = resolve({}, {"GPUWAIT_STATE_DIR": str(tmp_path / "s")}, {}, Path("c.toml"))
    assert settings.state_path == tmp_path / "s"
    assert settings.ledger_path == tmp_path / "s"
    assert settings.sources["state_dir"] == "environment GPUWAIT_STATE_DIR"


def test_a_share_is_written_alike_for_every_setting_that_takes_one() -> None:
    # idle_max_util read 0.5 as half a percent where estimate_margin read it as a half: a user
    # who wrote one as the other got a threshold a hundred times off, without a word.
    for name in ("idle_max_util", "estimate_margin"):
        for written in ("50%", " 50 % "):
            settings = resolve({}, {}, {name: written}, Path("c.toml"))
            assert settings.shown(name) == "50%", (name, written)
    assert (
        resolve({}, {}, {"estimate_margin": 0.5}, Path("c.toml")).shown("estimate_margin") == "50%"
    )
    # A utilization is a percent, as nvidia-smi and --max-util write it, and as configs
    # written before said it: `5` stays five percent.
    for written in (5, "5", "5%"):
        assert resolve({}, {}, {"idle_max_util": written}, Path("c.toml")).idle_max_util == 5.0
    # Between 0 and 1 too, as the release before took it (`idle_max_util = 0.5`, half a
    # percent) and as --max-util 0.5 takes it: refused, it stopped every launch of a config
    # that had worked. `gpuwait config` shows it as the percent it is.
    for written in (0.5, "0.5"):
        settings = resolve({}, {}, {"idle_max_util": written}, Path("c.toml"))
        assert settings.idle_max_util == 0.5 and settings.shown("idle_max_util") == "0.5%"
    from_env = resolve({}, {"GPUWAIT_IDLE_MAX_UTIL": "0.05"}, {}, Path("c.toml"))
    assert from_env.idle_max_util == 0.05
    # A margin past the whole without %: refused, saying how to write a percent.
    with pytest.raises(UsageError) as refused:
        resolve({}, {}, {"estimate_margin": 5}, Path("c.toml"))
    assert "write 5% for a percent" in refused.value.message, refused.value.message
    for name, too_much in (("idle_max_util", "150%"), ("estimate_margin", "250%")):
        with pytest.raises(UsageError) as refused:
            resolve({}, {}, {name: too_much}, Path("c.toml"))
        assert name in refused.value.message, refused.value.message


def test_a_zero_max_wait_or_half_life_means_none_however_it_is_written() -> None:
    # `max_wait = 0` was read as none (no cap), as configs written before used it, but
    # `max_wait = "0s"` stopped every launch with exit 2; fair_share_half_life alike.
    for written in (0, 0.0, "0", "0s", "0m", "0h00m", " 0s "):
        settings = resolve({}, {}, {"max_wait": written}, Path("c.toml"))
        assert settings.max_wait is None and settings.shown("max_wait") == "none", written
        site = resolve({}, {}, {}, Path("c.toml"), {"fair_share_half_life": written}, Path("s"))
        assert site.fair_share_half_life is None, written
        assert site.shown("fair_share_half_life") == "none", written
    from_env = resolve({}, {"GPUWAIT_MAX_WAIT": "0s"}, {}, Path("c.toml"))
    assert from_env.max_wait is None
    # What is not a duration, or is less than a millisecond, is refused as before.
    for refused in ("-1s", "0.0001s", "soon", True):
        with pytest.raises(UsageError):
            resolve({}, {}, {"max_wait": refused}, Path("c.toml"))


def test_a_timeout_of_zero_however_written_means_no_wait_and_a_boolean_is_refused() -> None:
    # `timeout = false` (meant as "no timeout") read as 0 would have every launch that does not
    # fit at once give up (exit 124): TOML's booleans are Python's ints.
    for written in ("0", "0s", "0m", 0, 0.0):
        assert resolve({}, {}, {"timeout": written}, Path("c.toml")).timeout == 0.0, written
    for written in (False, True):
        with pytest.raises(UsageError, match="timeout"):
            resolve({}, {}, {"timeout": written}, Path("c.toml"))


def test_the_shortest_interval_taken_is_the_millisecond_the_message_names() -> None:
    assert resolve({}, {}, {"sample_interval": "1ms"}, Path("c.toml")).sample_interval == 0.001
    with pytest.raises(UsageError, match="at least 1ms"):
        resolve({}, {}, {"sample_interval": "0.5ms"}, Path("c.toml"))


@pytest.mark.parametrize(
    ("name", "taken", "refused"),
    [
        ("max_wait_factor", (1, 1000, "2.5"), (0.99, 1000.5, 0)),
        ("resume_exit", (1, 125, "75"), (0, 126, 255)),
        ("pause_max", (0, 1000, "3"), (-1, 1001)),
        ("priority", (1, 5, "3"), (0, 6)),
    ],
)
def test_a_bounded_setting_takes_its_bounds_and_refuses_past_them(
    name: str, taken: tuple[object, ...], refused: tuple[object, ...]
) -> None:
    for value in taken:
        assert getattr(resolve({}, {}, {name: value}, Path("c.toml")), name) == float(value)
    for value in refused:
        with pytest.raises(UsageError, match=name):
            resolve({}, {}, {name: value}, Path("c.toml"))


@pytest.mark.parametrize(
    ("name", "taken", "refused"),
    [
        ("estimate_margin", (0, 2, "0%", "200%"), (-0.01, "201%")),
        ("idle_max_util", (0, 100, "0%", "100%", " 5 % "), (101, "101%", "-1%")),
    ],
)
def test_a_share_setting_takes_its_bounds_and_refuses_past_them(
    name: str, taken: tuple[object, ...], refused: tuple[object, ...]
) -> None:
    for value in taken:
        resolve({}, {}, {name: value}, Path("c.toml"))
    for value in refused:
        with pytest.raises(UsageError, match=name):
            resolve({}, {}, {name: value}, Path("c.toml"))


@pytest.mark.parametrize("written", ["101%", "-1%", 101, "lots"])
def test_a_utilization_refused_is_told_as_the_percent_it_is_read_as(written: object) -> None:
    # idle_max_util reads a number without % as a percent: told that it takes "a fraction from
    # 0 to 1", a user who wrote 0.05 for 5% got a threshold a hundred times too low.
    with pytest.raises(UsageError) as refused:
        resolve({}, {}, {"idle_max_util": written}, Path("c.toml"))
    assert "fraction" not in str(refused.value), refused.value
    assert "expected a percent from 0 to 100, e.g. 5%" in str(refused.value), refused.value


@pytest.mark.parametrize("written", [0, "0", "00", " 0 ", "none", ""])
def test_a_per_user_gpu_limit_of_zero_however_written_is_no_limit(written: object) -> None:
    # "00" or " 0 " in the site file was a limit of no GPU at all: every job of every user
    # refused (exit 3), where 0 means none.
    site = {"user_max_gpus": written}
    settings = resolve({}, {}, {}, Path("c.toml"), site, Path("/etc/xdg/gpuwait/config.toml"))
    assert settings.user_max_gpus is None


def test_a_site_file_rewritten_within_one_tick_reaches_the_jobs_that_wait(
    isolated_dirs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An administrator's tool lowers user_max_gpus from 4 to 2 by rename in the tick of the
    last write, on a file system with a coarse clock that gave the new file the old one's
    inode (as ext4 does): the same inode, size and times. The jobs that wait keep to 2."""
    tick = time.time_ns()

    def coarse(path: Path, **_: object) -> FileStamp | None:
        try:
            return FileStamp(12, os.stat(path).st_size, tick, tick)
        except OSError:
            return None

    monkeypatch.setattr(config, "file_stamp", coarse)
    site = isolated_dirs / "site-config" / "gpuwait" / "config.toml"
    site.parent.mkdir(parents=True)

    def write(text: str) -> None:
        temp = site.with_name(".config.toml.tmp")
        temp.write_text(text)
        os.replace(temp, site)

    write("user_max_gpus = 4\n")
    assert config.site_config_file_path() == site
    current = config.current_fair_share({}, config.load_settings({}))
    assert current().limits == UserLimits(4, None)
    write("user_max_gpus = 2\n")
    assert current().limits == UserLimits(2, None)


@pytest.mark.parametrize("name", ["state_dir", "ledger_dir", "sim"])
def test_a_path_setting_written_with_spaces_around_it_names_the_path_within(
    tmp_path: Path, name: str
) -> None:
    # `state_dir = " /srv/gpuwait "` (spaces pasted in with the path) is /srv/gpuwait: not
    # refused for a relative path, nor a directory of another name, whose jobs would not see
    # those of every gpuwait run with it written plainly.
    settings = resolve({}, {}, {name: f" {tmp_path / 'gw'} "}, Path("c.toml"))
    assert getattr(settings, name) == tmp_path / "gw"


@pytest.mark.parametrize("name", ["state_dir", "ledger_dir", "sim"])
def test_a_path_setting_written_as_no_string_is_refused(name: str) -> None:
    # `state_dir = 5` in a config file is refused, saying a path is written in quotes: not
    # taken for no setting at all, the jobs of this user then in a ledger of their own.
    with pytest.raises(UsageError, match=f"{name}.*expected a path in quotes"):
        resolve({}, {}, {name: 5}, Path("c.toml"))


@pytest.mark.parametrize(
    ("name", "value"),
    [("sim", "0\n0"), ("sim", "~no\nsuchuser/sim.toml"), ("state_dir", "~no\nsuchuser/s")],
)
def test_a_path_setting_of_two_lines_is_refused_in_one(name: str, value: str) -> None:
    # `gpuwait --sim $'0\n0'`: the message's example path was made of the name given, and
    # printed its line break, the rest of the message on a line of its own.
    with pytest.raises(UsageError) as refused:
        resolve({name: value}, {}, {}, Path("c.toml"))
    assert "\n" not in refused.value.message, refused.value.message
