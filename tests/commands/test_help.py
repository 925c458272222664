"""Every --help page as a person reads it at 80 columns: each option's default said once, every
exit status listed whole, nothing wider than the terminal, and the simulation file's comments
naming only options that exist."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpuwait.commands import SUBCOMMANDS, module_name
from gpuwait.commands import run as run_command
from gpuwait.config import OPTIONS, OPTIONS_BY_NAME
from gpuwait.core import errors
from gpuwait.gpu import simjob

#: Every help page: argv after `gpuwait`.
PAGES = (
    [["--help"]]
    + [[name, "--help"] for name in SUBCOMMANDS]
    + [
        ["sim", "init", "--help"],
        ["sim", "job", "--help"],
    ]
)


def help_text(argv: list[str]) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "gpuwait", *argv],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "80"},
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    return done.stdout


def parsers() -> dict[str, argparse.ArgumentParser]:
    """Every parser gpuwait has, by the command line that shows its help."""
    found: dict[str, argparse.ArgumentParser] = {"gpuwait": run_command.build_parser()}
    for name in SUBCOMMANDS:
        parser = importlib.import_module(module_name(name)).build_parser()
        found[f"gpuwait {name}"] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, subparser in action.choices.items():
                    found[f"gpuwait {name} {sub}"] = subparser
    found["gpuwait sim job"] = simjob.build_parser()
    return found


def has_a_default(action: argparse.Action) -> bool:
    """An option whose default a user would want to know: not a flag, not help, not a list
    that starts empty."""
    return not (
        action.help == argparse.SUPPRESS
        or action.nargs == 0
        or action.default in (None, argparse.SUPPRESS, [])
        or isinstance(action.default, bool)
        or not action.option_strings
    )


def defaults(text: str) -> int:
    """How often `text` speaks of a default (not counting a name such as default_vram)."""
    return len(re.findall(r"\bdefault\b", text))


def option_blocks(text: str) -> dict[str, str]:
    """First word of each two-column row (option, setting, exit status) -> its whole text."""
    blocks: dict[str, str] = {}
    current: str | None = None
    for line in text.splitlines():
        row = re.match(r"^  (\S+)", line)
        if row:
            current = row.group(1).rstrip(",")
            blocks[current] = line
        elif current is not None and line.startswith("    ") and line.strip():
            blocks[current] += " " + line.strip()
        else:
            current = None
    return blocks


@pytest.mark.parametrize("page", list(parsers()))
def test_every_option_with_a_default_says_it_once(
    page: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    parser = parsers()[page]
    blocks = option_blocks(parser.format_help())
    for action in parser._actions:
        if not has_a_default(action):
            continue
        block = blocks[action.option_strings[0]]
        assert defaults(block) == 1, f"{page} {action.option_strings[0]}: {block}"


def test_the_options_named_in_the_issue_show_their_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    run_blocks = option_blocks(run_command.build_parser().format_help())
    assert "(default: the pick setting, best-fit)" in run_blocks["--pick"]
    assert "(default: the priority setting, 3)" in run_blocks["--priority"]
    assert "(default: the safety setting, 0.9)" in run_blocks["--safety"]
    assert "(default: the timeout setting, none)" in run_blocks["--timeout"]
    job_blocks = option_blocks(simjob.build_parser().format_help())
    assert "(default: 0s" in job_blocks["--ramp"]
    assert "(default: 1s)" in job_blocks["--hold"]
    assert "(default: 0)" in job_blocks["--exit"]
    log = importlib.import_module(module_name("log")).build_parser()
    assert "(default: 20)" in option_blocks(log.format_help())["-n"]


def section(text: str, title: str) -> str:
    start = text.index(title)
    end = text.find("\n\n", start)
    return text[start : end if end != -1 else len(text)]


def test_every_setting_says_its_default_once() -> None:
    settings = option_blocks(section(help_text(["--help"]), "settings ("))
    for option in OPTIONS:
        assert defaults(settings[option.name]) == 1, settings[option.name]
    assert "(not set)" not in help_text(["--help"])


def test_the_settings_order_names_the_site_config_file() -> None:
    # configuration.md: command line > environment > your file > the site's > default. The help
    # named one config.toml, and an administrator's file read below the user's was nowhere.
    (header,) = [
        line for line in help_text(["--help"]).splitlines() if line.startswith("settings (")
    ]
    assert (
        header == "settings (command line > GPUWAIT_<NAME> > your config.toml > site's > default):"
    )


def test_the_exit_statuses_are_all_listed() -> None:
    listed = section(help_text(["--help"]), "exit status:")
    rows = re.findall(r"^  ([0-9][0-9, ]*?)\s{2,}", listed, re.MULTILINE)
    codes = {int(code) for row in rows for code in row.split(",")}
    documented = {value for name, value in vars(errors).items() if name.startswith("EXIT_")}
    assert documented <= codes, documented - codes
    assert {130, 143} <= codes


def test_the_exit_statuses_name_the_resume_status_of_a_pausable_job() -> None:
    """A --pausable job asked to checkpoint while it waits ends with resume_exit (75), which a
    batch script requeues on: a user who looks 75 up in --help finds it there."""
    rows = option_blocks(section(help_text(["--help"]), "exit status:"))
    default = OPTIONS_BY_NAME["resume_exit"].default
    assert str(default) in rows, sorted(rows)
    assert "--pausable" in rows[str(default)] and "resume_exit" in rows[str(default)]


@pytest.mark.parametrize("argv", PAGES, ids=lambda argv: " ".join(argv))
def test_no_help_line_is_wider_than_the_terminal(argv: list[str]) -> None:
    text = help_text(argv)
    wide = [line for line in text.splitlines() if len(line) > 80]
    assert not wide, "\n".join(wide)


def test_the_simulation_file_names_only_options_that_exist(tmp_path: Path) -> None:
    path = tmp_path / "sim.toml"
    subprocess.run(
        [sys.executable, "-m", "gpuwait", "sim", "init", str(path)], check=True, timeout=60
    )
    comments = "\n".join(line for line in path.read_text().splitlines() if line.startswith("#"))
    assert "GPUWAIT_SIM" in comments
    known = {s for a in run_command.build_parser()._actions for s in a.option_strings}
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", comments))
    assert named <= known, named - known


def test_the_exit_status_2_row_names_a_command_line_refused_before_waiting() -> None:
    """`env CUDA_VISIBLE_DEVICES=0 python x.py`, `sudo -u bob ...`, `python trian.py` end with 2
    before waiting: a user who looks the status up in --help is told why, and where to read on."""
    rows = option_blocks(section(help_text(["--help"]), "exit status:"))
    assert "command line" in rows["2"], rows["2"]
    assert "docs/usage.md" in rows["2"], rows["2"]


def test_sim_help_asks_for_the_simulation_files_absolute_path() -> None:
    """`gpuwait sim init sim.toml`, then `export GPUWAIT_SIM=sim.toml` as the help said, made
    every later gpuwait end with 2: a relative GPUWAIT_SIM is refused."""
    text = " ".join(help_text(["sim", "--help"]).split())
    assert "absolute path" in text, text


@pytest.mark.parametrize("page", list(parsers()))
def test_every_value_is_named_as_a_person_types_it(page: str) -> None:
    """`gpuwait sim init`, the first command the README gives, showed `--gpus GPUS`, `--memory
    MEMORY` and `path` (and said "the following arguments are required: path"), where every
    other page and docs/usage.md write N, SIZE and FILE: each option's value has a name of its
    own, not its option's name in capitals."""
    named = [
        "/".join(action.option_strings)
        for action in parsers()[page]._actions
        if action.option_strings
        and action.nargs != 0
        and action.help != argparse.SUPPRESS
        and action.metavar is None
        and action.choices is None
    ]
    assert named == [], named


def test_sim_init_names_the_file_it_writes() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gpuwait", "sim", "init"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("gpuwait: error: the following arguments are required: FILE;"), (
        done.stderr
    )
    assert "[--gpus N] [--memory SIZE]" in " ".join(help_text(["sim", "init", "--help"]).split())
