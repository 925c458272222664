"""Messages a person gets after a slip: a misspelled GPUWAIT_* variable, subcommand or option, a
malformed value from any source, an empty answer that would mislead, and another user's
simulation. Each says what is wrong in gpuwait's words, in one line (and a hint), with the
documented exit status, and never changes what runs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.fixtures_sim import SIMJOB
from helpers.history import a_run
from helpers.users import popen_as, run_as, shared_root, user_home

from gpuwait.cli import main
from gpuwait.config import OPTIONS, known_variables, unknown_variables
from gpuwait.core.errors import EXIT_NOT_FOUND, EXIT_USAGE
from gpuwait.history.store import append_record

REPO = Path(__file__).resolve().parents[2]
GPUWAIT = [sys.executable, "-m", "gpuwait"]
#: Python's words, which gpuwait's messages never show.
PYTHON_WORDING = ("Traceback", "invalid literal", "could not convert", "True", "False")
USER = 47320


def gpuwait(*argv: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*GPUWAIT, *argv],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=cwd,
        timeout=60,
    )


# -- misspelled GPUWAIT_* variables --------------------------------------------------------------


def test_quiet_remembers_what_it_said_in_the_state_dir_it_was_given(
    sim: Path, tmp_path: Path
) -> None:
    # state_dir set elsewhere (the default one on a read-only home): the note of what was said
    # went to the default state dir, could not be written there, and every -q step said it.
    home = tmp_path / "read-only-home"
    home.write_text("")  # a file: nothing can be made under it
    env = {"XDG_STATE_HOME": str(home / "state"), "GPUWAIT_STATE_DIR": str(tmp_path / "s")}
    first = gpuwait("-q", "--vram", "1G", "--", "true", GPUWAIT_SAFTEY="0.5", **env)
    assert first.returncode == 0 and "GPUWAIT_SAFTEY" in first.stderr, first.stderr
    again = gpuwait("-q", "--vram", "1G", "--", "true", GPUWAIT_SAFTEY="0.5", **env)
    assert again.returncode == 0 and again.stderr == ""


def test_a_misspelled_variable_is_named_with_the_setting_it_likely_means(sim: Path) -> None:
    done = gpuwait("true", GPUWAIT_VRAM="6G", GPUWAIT_SAFTEY="0.5")
    assert done.returncode == 0
    assert done.stderr.splitlines() == [
        "gpuwait: warning: GPUWAIT_SAFTEY is not a gpuwait setting and is ignored "
        "(did you mean GPUWAIT_SAFETY?)",
        "gpuwait: warning: GPUWAIT_VRAM is not a gpuwait setting and is ignored "
        "(did you mean GPUWAIT_DEFAULT_VRAM?)",
    ]


def test_quiet_says_a_misspelled_variable_once_not_in_every_step(sim: Path) -> None:
    # A misspelling changes what runs (GPUWAIT_SAFTEY: the safety stays the default), so a
    # user who runs everything with -q is told, once; a script's every later -q step is not.
    said = (
        "gpuwait: warning: GPUWAIT_SAFTEY is not a gpuwait setting and is ignored "
        "(did you mean GPUWAIT_SAFETY?)\n"
    )
    done = gpuwait("-q", "--vram", "1G", "--", "true", GPUWAIT_SAFTEY="0.5")
    assert done.returncode == 0 and done.stderr == said
    again = gpuwait("-q", "--vram", "1G", "--", "true", GPUWAIT_SAFTEY="0.5")
    assert again.returncode == 0 and again.stderr == ""
    quiet_cancel = gpuwait("cancel", "-q", "--batch", "none", GPUWAIT_SAFTEY="0.5")
    assert "GPUWAIT_SAFTEY" not in quiet_cancel.stderr
    # Another misspelling is news; without -q, every run says what it ignores.
    other = gpuwait("cancel", "-q", "--batch", "none", GPUWAIT_VRMA="6G")
    assert "GPUWAIT_VRMA is not a gpuwait setting" in other.stderr
    loud = gpuwait("--vram", "1G", "--", "true", GPUWAIT_SAFTEY="0.5")
    assert loud.stderr == said


def test_a_pausable_job_on_two_gpus_is_told_it_is_never_asked_to_step_aside(sim: Path) -> None:
    # It runs as asked; but it had said it would step aside, and nobody will ever ask it to.
    done = gpuwait("--pausable", "--gpus", "2", "--vram", "1G", "--", "true")
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        "gpuwait: warning: a job on 2 GPUs is never asked to step aside: --pausable changes "
        "nothing for it (docs/pausing.md)"
    ]
    quiet = gpuwait("--pausable", "--gpus", "2", "--vram", "1G", "-q", "--", "true")
    assert quiet.returncode == 0 and quiet.stderr == ""


def test_a_size_typed_after_the_command_is_told_to_go_before_it(sim: Path) -> None:
    # `gpuwait python train.py --vram 6G` gave python the --vram, which most scripts refuse,
    # and asked for a whole GPU: only once one was free did the script's own error say so.
    done = gpuwait("python3", "-c", "pass", "--vram", "6G")
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        "gpuwait: warning: --vram 6G after the command is python3's, not gpuwait's, which asks "
        "for the size learned from earlier runs, else default_vram: put it before the command, "
        "`gpuwait --vram 6G python3 ...`, or `--` before the command where it is python3's"
    ]
    for argv in (
        ["--", "python3", "-c", "pass", "--vram", "6G"],
        ["--vram", "1G", "python3", "-c", "pass", "--vram=6G"],
    ):
        done = gpuwait(*argv)
        assert done.returncode == 0 and done.stderr == "", (argv, done.stderr)


@pytest.mark.parametrize("typed", [["--vram"], ["--vram="], ["--vram", "--epochs", "3"]])
def test_a_size_option_typed_after_the_command_without_a_size_is_told_with_one(
    sim: Path, typed: list[str]
) -> None:
    # `gpuwait python train.py --vram` was told "--vram  after the command is python3's", the
    # line to type `gpuwait --vram  python3 ...`: an option with nothing after it; and
    # `--vram --epochs 3`, `gpuwait --vram --epochs python3 ...`.
    done = gpuwait("python3", "-c", "pass", *typed)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        "gpuwait: warning: --vram SIZE after the command is python3's, not gpuwait's, which "
        "asks for the size learned from earlier runs, else default_vram: put it before the "
        "command, `gpuwait --vram SIZE python3 ...`, or `--` before the command where it is "
        "python3's"
    ]


def test_an_unknown_variable_far_from_every_setting_points_at_the_list(sim: Path) -> None:
    done = gpuwait("status", GPUWAIT_ZQX="1")
    assert done.returncode == 0
    assert done.stderr == (
        "gpuwait: warning: GPUWAIT_ZQX is not a gpuwait setting and is ignored "
        "(`gpuwait --help` lists the settings)\n"
    )


def test_gpuwait_inside_a_job_says_nothing_of_what_gpuwait_exported(sim: Path) -> None:
    # The job's environment holds every variable gpuwait exports (a pausable job's too);
    # gpuwait, its shell hook and its settings listing run inside it without a warning.
    inner = f"{sys.executable} -m gpuwait"
    script = (
        "env | grep -c '^GPUWAIT_' && "
        f"{inner} config >/dev/null && {inner} shell-hook -- true && "
        f"{inner} --vram 1G -- true"
    )
    done = gpuwait("--pausable", "--vram", "1G", "--", "sh", "-c", script)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[0]) >= 8  # JOB_ID, GPU_UUIDS, ..., RESUME_COUNT, SIM
    assert "warning" not in done.stderr


def test_every_gpuwait_variable_in_the_package_and_contrib_is_known() -> None:
    named: set[str] = set()
    for folder in ("gpuwait", "contrib"):
        for path in (REPO / folder).rglob("*"):
            if path.is_file() and path.suffix not in (".pyc",):
                text = path.read_text(errors="replace")
                named |= set(re.findall(r"(?<![A-Za-z0-9_])GPUWAIT_[A-Z][A-Z0-9_]*", text))
    named.discard("GPUWAIT_X")  # a placeholder in a comment
    assert named - known_variables() == set()


# -- misspelled subcommands and options ----------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["staus"], "did you mean `gpuwait status`?"),
        (["histroy"], "did you mean `gpuwait history`?"),
        (["--vram", "4G", "log"], "`log` is a subcommand: `gpuwait log ...` runs it"),
    ],
)
def test_a_command_not_found_that_looks_like_a_subcommand_gets_a_hint(
    sim: Path, argv: list[str], hint: str
) -> None:
    done = gpuwait(*argv)
    assert done.returncode == EXIT_NOT_FOUND
    lines = done.stderr.splitlines()
    assert lines[0] == f"gpuwait: error: {argv[-1]}: command not found"
    assert lines[1].startswith(f"gpuwait: hint: {hint}")
    assert len(lines) == 2


def test_a_program_named_like_a_misspelled_subcommand_still_runs(sim: Path, tmp_path: Path) -> None:
    program = tmp_path / "bin" / "staus"
    program.parent.mkdir()
    program.write_text("#!/bin/sh\necho ran\n")
    program.chmod(0o755)
    done = gpuwait("--vram", "1G", "staus", PATH=f"{program.parent}:{os.environ['PATH']}")
    assert (done.returncode, done.stdout, done.stderr) == (0, "ran\n", "")


@pytest.mark.parametrize(
    ("argv", "meant"),
    [
        (["--vrma", "4G", "true"], "--vram"),
        (["--vrma=4G", "true"], "--vram"),
        (["--VRAM", "4G", "true"], "--vram"),
        (["status", "--JSON"], "--json"),
        (["-V"], "--version"),
        (["--vram4G", "true"], "--vram 4G"),
        (["status", "--jsn"], "--json"),
        # A short option it does not have: the one long option that begins with its letter.
        (["status", "-w"], "--watch"),
        (["cancel", "-b", "x"], "--batch"),
        (["log", "--lins", "3"], "--lines"),
        (["history", "--kye", "x"], "--key"),
        (["cancel", "--bach", "x"], "--batch"),
        (["sim", "init", "x.toml", "--froce"], "--force"),
        (["sim", "ini", "x.toml"], "'init'"),
        (["estimate", "--kye", "x", "--", "true"], "--key"),
        (["config", "--jsn"], "--json"),
        (["completion", "bsh"], "'bash'"),
        (["shell-hook", "--explian", "--", "true"], "--explain"),
    ],
)
def test_a_misspelled_option_gets_the_nearest_one(
    sim: Path, tmp_path: Path, argv: list[str], meant: str
) -> None:
    done = gpuwait(*argv, cwd=tmp_path)
    assert done.returncode == EXIT_USAGE
    lines = done.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("gpuwait: error: ")
    assert lines[1] == f"gpuwait: hint: did you mean {meant}?"


def test_a_subcommands_unknown_option_is_matched_against_its_own_options_only(
    sim: Path, tmp_path: Path
) -> None:
    # `--name` is close to `sim job`'s `--vram`, which `sim init` does not take.
    done = gpuwait("sim", "init", "x.toml", "--name", "n", cwd=tmp_path)
    assert done.returncode == EXIT_USAGE
    assert done.stderr.splitlines() == [
        "gpuwait: error: unrecognized arguments: --name n; see 'gpuwait sim init --help'"
    ]


@pytest.mark.parametrize(
    ("argv", "word", "meant"),
    [
        (["adopt", "-vram", "2G", "4242"], "-vram", "--vram"),
        # No pid: 2G is taken for it, and -vram is still the word named.
        (["adopt", "-vram", "2G"], "-vram", "--vram"),
        (["adopt", "-name", "train", "4242"], "-name", "--name"),
        (["adopt", "--vrma", "2G", "4242"], "--vrma", "--vram"),
    ],
)
def test_an_option_mistyped_before_a_pid_is_named_not_the_value_after_it(
    sim: Path, tmp_path: Path, argv: list[str], word: str, meant: str
) -> None:
    # `gpuwait adopt -vram 2G 4242` said "argument PID: '2G' is not a whole number": the
    # option's value was taken for the pid, and the option typed wrong went unsaid.
    done = gpuwait(*argv, cwd=tmp_path)
    assert done.returncode == EXIT_USAGE
    assert done.stderr.splitlines() == [
        f"gpuwait: error: unrecognized arguments: {word}; see 'gpuwait adopt --help'",
        f"gpuwait: hint: did you mean {meant}?",
    ]


def test_a_negative_pid_is_said_to_be_too_small_not_an_unknown_option(
    sim: Path, tmp_path: Path
) -> None:
    done = gpuwait("adopt", "-1", cwd=tmp_path)
    assert done.returncode == EXIT_USAGE
    assert done.stderr.splitlines() == [
        "gpuwait: error: argument PID: -1 is too small (at least 1); see 'gpuwait adopt --help'"
    ]


def test_estimate_without_a_command_gives_the_usage_its_help_gives(sim: Path) -> None:
    # `gpuwait estimate` alone said "usage: gpuwait estimate [--] COMMAND [ARGS...]", where
    # its --help shows --key, with which no command is needed, --gpus and --json.
    done = gpuwait("estimate")
    assert done.returncode == EXIT_USAGE
    usage = gpuwait("estimate", "--help").stdout.split("\n\n", 1)[0].removeprefix("usage: ")
    assert done.stderr.splitlines() == [
        f"gpuwait: error: no command given (nor --key); usage: {usage}"
    ]


def test_a_simulated_job_suggests_the_option_too(sim: Path) -> None:
    done = gpuwait("sim", "job", "--vram", "1G", "--hodl", "1s")
    assert done.returncode == EXIT_USAGE
    assert done.stderr.splitlines() == [
        "gpuwait sim job: error: unrecognized arguments: --hodl 1s; see 'gpuwait sim job --help'",
        "gpuwait sim job: hint: did you mean --hold?",
    ]


@pytest.mark.parametrize("order", ["after", "before"])
def test_a_simulated_job_says_an_option_typed_with_one_dash(sim: Path, order: str) -> None:
    # `-hold 1s` was read as -h with 'old' after it: "argument -h/--help: ignored explicit
    # argument 'old'", where gpuwait's own options say what was meant.
    argv = ["--vram", "1G", "-hold", "1s"] if order == "after" else ["-hold", "1s", "--vram", "1G"]
    done = gpuwait("sim", "job", *argv)
    assert done.returncode == EXIT_USAGE
    assert done.stderr.splitlines() == [
        "gpuwait sim job: error: -hold is no option: a long option takes two dashes; "
        "see 'gpuwait sim job --help'",
        "gpuwait sim job: hint: did you mean --hold?",
    ]


def test_a_simulated_job_says_its_required_option_typed_with_one_dash(sim: Path) -> None:
    # `gpuwait sim job -vram 1G` said only that --vram is required, where `gpuwait -vram 1G`
    # says what was meant.
    done = gpuwait("sim", "job", "-vram", "1G", "--hold", "1s")
    assert done.returncode == EXIT_USAGE
    assert done.stderr.splitlines() == [
        "gpuwait sim job: error: -vram is no option: a long option takes two dashes; "
        "see 'gpuwait sim job --help'",
        "gpuwait sim job: hint: did you mean --vram?",
    ]


@pytest.mark.parametrize("shell", ["sh", "dash", "ksh"])
def test_a_shell_without_a_hook_is_not_taken_for_a_misspelled_one(
    sim: Path, tmp_path: Path, shell: str
) -> None:
    # `shell-init sh` was answered "did you mean 'zsh'?", `dash` "did you mean 'bash'?".
    done = gpuwait("shell-init", shell, cwd=tmp_path)
    assert done.returncode == EXIT_USAGE
    assert done.stderr.splitlines() == [
        f"gpuwait: error: argument shell: gpuwait has no hook for {shell}, only for bash, zsh "
        "and fish; see 'gpuwait shell-init --help'"
    ]


@pytest.mark.parametrize(
    "argv",
    [["shell-hook", "--explain", "python", "train.py"], ["shell-hook", "python", "train.py"]],
)
def test_shell_hook_without_its_dashes_shows_the_line_to_type(
    sim: Path, tmp_path: Path, argv: list[str]
) -> None:
    # It said "unknown option 'python'": a program's name taken for an option of its own.
    done = gpuwait(*argv, cwd=tmp_path)
    assert done.returncode == EXIT_USAGE
    options = " --explain" if "--explain" in argv else ""
    assert done.stderr.splitlines() == [
        "gpuwait: error: shell-hook: the command comes after --; "
        "usage: gpuwait shell-hook [--explain] -- COMMAND [ARGS...]",
        f"gpuwait: hint: gpuwait shell-hook{options} -- python train.py",
    ]


def test_a_misspelled_config_key_gets_the_nearest_one(
    isolated_dirs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (isolated_dirs / "config" / "gpuwait").mkdir()
    (isolated_dirs / "config" / "gpuwait" / "config.toml").write_text("safty = 0.5\n")
    assert main(["config"]) == EXIT_USAGE
    assert capsys.readouterr().err.splitlines()[1] == "gpuwait: hint: did you mean safety?"


@pytest.mark.parametrize(
    ("line", "hint"),
    [
        ("pick = best-fit", 'text takes quotes: pick = "best-fit"'),
        (
            "ledger_dir = /srv/gpuwait  # the lab's",
            'text takes quotes: ledger_dir = "/srv/gpuwait"',
        ),
        ("default_vram = 6G", 'text takes quotes: default_vram = "6G"'),
        ("safety = 0,8", None),  # as text, refused for its comma all the same
    ],
)
def test_a_config_value_without_its_quotes_is_given_them(
    isolated_dirs: Path, capsys: pytest.CaptureFixture[str], line: str, hint: str | None
) -> None:
    # TOML's 'Invalid value (at line 1, column 8); fix or remove it' alone did not say how.
    (isolated_dirs / "config" / "gpuwait").mkdir()
    (isolated_dirs / "config" / "gpuwait" / "config.toml").write_text(f"safety = 0.8\n{line}\n")
    assert main(["config"]) == EXIT_USAGE
    err = capsys.readouterr().err.splitlines()
    assert "(at line 2, column" in err[0], err
    assert err[1:] == ([] if hint is None else [f"gpuwait: hint: {hint}"])


@pytest.mark.parametrize(("key", "meant"), [("vram", "default_vram"), ("safty", "safety")])
def test_a_config_key_is_named_with_the_setting_it_likely_means_as_a_variable_is(
    isolated_dirs: Path, capsys: pytest.CaptureFixture[str], key: str, meant: str
) -> None:
    # `vram = "6G"` listed the 43 settings with no hint, where GPUWAIT_VRAM is told
    # GPUWAIT_DEFAULT_VRAM.
    (isolated_dirs / "config" / "gpuwait").mkdir()
    (isolated_dirs / "config" / "gpuwait" / "config.toml").write_text(f'{key} = "6G"\n')
    assert main(["config"]) == EXIT_USAGE
    assert capsys.readouterr().err.splitlines()[1] == f"gpuwait: hint: did you mean {meant}?"
    variable = f"GPUWAIT_{key.upper()}"
    assert [(variable, f"GPUWAIT_{meant.upper()}")] == unknown_variables([variable])


def test_a_config_file_saved_by_a_windows_editor_is_read(
    isolated_dirs: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Notepad saves UTF-8 with a byte-order mark and CRLF line ends (a config edited from WSL,
    or on a share): the mark is not shown, so 'Invalid statement (at line 1, column 1)' would
    point at nothing the user can see. The user's file, the site file and a simulation file
    are read as meant."""
    notepad = "\ufeff{}\r\n".format
    (isolated_dirs / "config" / "gpuwait").mkdir()
    (isolated_dirs / "config" / "gpuwait" / "config.toml").write_bytes(
        notepad("safety = 0.8").encode()
    )
    site = tmp_path / "site"
    (site / "gpuwait").mkdir(parents=True)
    (site / "gpuwait" / "config.toml").write_bytes(notepad("user_max_gpus = 3").encode())
    sim = tmp_path / "sim.toml"
    sim.write_bytes(notepad('[[gpu]]\r\nname = "Notepad GPU"\r\nmemory = "8GiB"').encode())
    monkeypatch.setenv("XDG_CONFIG_DIRS", str(site))
    monkeypatch.setenv("GPUWAIT_SIM", str(sim))
    assert main(["config", "--json"]) == 0, capsys.readouterr().err
    shown = json.loads(capsys.readouterr().out)["settings"]
    assert shown["safety"]["value"] == "0.8"
    assert shown["user_max_gpus"]["value"] == "3"
    assert main(["status", "--json"]) == 0, capsys.readouterr().err
    gpus = json.loads(capsys.readouterr().out)["gpus"]
    assert [g["name"] for g in gpus] == ["Notepad GPU"]


# -- malformed values, from every source ---------------------------------------------------------

#: A malformed value of each setting as text (environment, command line). The settings missing
#: here take any text: lists of globs, and a path.
BAD_TEXT = {
    "safety": "True",
    "pick": "True",
    "priority": "True",
    "default_vram": "True",
    "timeout": "True",
    "on_no_gpu": "True",
    "sample_interval": "abc",
    "resume_exit": "True",
    "pause_min_runtime": "abc",
    "pause_max": "True",
    "wake": "True",
    "poll_interval": "abc",
    "nvml_interval": "abc",
    "ignore_processes": "a-name-longer-than-fifteen",
    "gpu_weights": "0=abc",
    "prefer": "fast",
    "state_dir": "relative",
    "wrap_commands": "-x",
    "estimate_margin": "abc",
    "history_commands": "True",
    "history_max_size": "abc",
    "enforce": "True",
    "visible_devices": "True",
    "watch_stderr": "True",
    "ledger_dir": "relative",
    "on_state_error": "True",
    "nvml_timeout": "abc",
    "gpu_error_timeout": "abc",
    "lock_timeout": "abc",
    "idle_min_vram": "abc",
    "idle_max_util": "True",
    "idle_after": "abc",
    "idle_action": "True",
    "queue_order": "True",
    "max_wait_factor": "abc",
    "max_wait": "True",
    "plan_budget": "abc",
}
ANY_TEXT = {"wrap_only_in", "never_wrap", "sim"}
FLAGS = {
    "timeout": "--timeout",
    "pick": "--pick",
    "priority": "--priority",
    "safety": "--safety",
    "ledger_dir": "--ledger",
    "enforce": "--enforce",
    "prefer": "--prefer",
}


def test_every_setting_has_a_malformed_text_or_takes_any() -> None:
    user_settings = {o.name for o in OPTIONS if not o.site_only}
    assert set(BAD_TEXT) | ANY_TEXT == user_settings
    assert not set(BAD_TEXT) & ANY_TEXT


def assert_one_line_in_gpuwaits_words(code: int, err: str, setting: str) -> None:
    assert code == EXIT_USAGE, err
    lines = err.splitlines()
    assert lines[0].startswith("gpuwait: error: ") and setting in lines[0], err
    assert all(line.startswith("gpuwait: hint: ") for line in lines[1:]) and len(lines) <= 2
    words = lines[0].replace("'True'", "").replace(setting.upper(), "")
    assert not [w for w in PYTHON_WORDING if w in words], err


@pytest.mark.parametrize("name", [o.name for o in OPTIONS])
def test_a_toml_boolean_is_refused_for_every_setting(
    name: str, isolated_dirs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # `safety = true` is no number, though Python's True is the int 1; a site-only setting is
    # the administrator's, in the site file.
    site = next(o.site_only for o in OPTIONS if o.name == name)
    folder = isolated_dirs / ("site-config" if site else "config") / "gpuwait"
    folder.mkdir(parents=True)
    (folder / "config.toml").write_text(f"{name} = true\n")
    code = main(["config"])
    err = capsys.readouterr().err
    assert_one_line_in_gpuwaits_words(code, err, name)
    assert ": true is not valid for" in err


@pytest.mark.parametrize("name", sorted(BAD_TEXT))
def test_a_malformed_environment_variable_is_refused_in_gpuwaits_words(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GPUWAIT_" + name.upper(), BAD_TEXT[name])
    code = main(["config"])
    err = capsys.readouterr().err
    assert_one_line_in_gpuwaits_words(code, err, name)
    assert err.count(repr(BAD_TEXT[name])) == 1, err


@pytest.mark.parametrize("name", sorted(FLAGS))
def test_a_malformed_option_is_refused_in_gpuwaits_words(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main([FLAGS[name], BAD_TEXT[name], "true"])
    err = capsys.readouterr().err
    # Named by the option typed (--ledger), which names the setting (ledger_dir) already.
    assert_one_line_in_gpuwaits_words(code, err, FLAGS[name])
    assert err.count(repr(BAD_TEXT[name])) == 1, err


def test_a_refused_value_is_said_once_from_every_source(
    isolated_dirs: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # `--timeout 1h30` was told "--timeout: '1h30' is not valid for timeout: '1h30' gives 30
    # no unit; write 1h30m": the value twice, and so from the environment and the config file.
    said = "'1h30' gives 30 no unit; write 1h30m"
    assert main(["--timeout", "1h30", "true"]) == EXIT_USAGE
    assert capsys.readouterr().err == f"gpuwait: error: --timeout {said}\n"
    monkeypatch.setenv("GPUWAIT_TIMEOUT", "1h30")
    assert main(["config"]) == EXIT_USAGE
    assert capsys.readouterr().err == (
        f"gpuwait: error: environment GPUWAIT_TIMEOUT: timeout {said}\n"
    )
    monkeypatch.delenv("GPUWAIT_TIMEOUT")
    config = isolated_dirs / "config" / "gpuwait" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text('timeout = "1h30"\n')
    assert main(["config"]) == EXIT_USAGE
    assert capsys.readouterr().err == f"gpuwait: error: config file {config}: timeout {said}\n"
    # A TOML number too: the value as the file writes it, once.
    config.write_text("max_wait = 1e30\n")
    assert main(["config"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("1e+30") == 1 and err.startswith(
        f"gpuwait: error: config file {config}: max_wait "
    ), err


def test_a_refused_setting_is_named_once_on_the_command_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # `--safety 1x` was told "--safety: '1x' is not valid for safety: ...", the setting named
    # twice; a variable or a config file needs the setting's name, the option says it already.
    said = "is not valid: expected a fraction above 0 and at most 1, e.g. 0.9"
    assert main(["--safety", "1x", "true"]) == EXIT_USAGE
    assert capsys.readouterr().err == f"gpuwait: error: --safety '1x' {said}\n"
    # --ledger's setting is ledger_dir, a name the command line does not use.
    assert main(["--ledger", "shared", "true"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("gpuwait: error: --ledger 'shared' is not valid: expected"), err
    monkeypatch.setenv("GPUWAIT_SAFETY", "1x")
    assert main(["config"]) == EXIT_USAGE
    assert capsys.readouterr().err == (
        "gpuwait: error: environment GPUWAIT_SAFETY: '1x' is not valid for safety: "
        "expected a fraction above 0 and at most 1, e.g. 0.9\n"
    )


# -- empty answers -------------------------------------------------------------------------------


def test_history_minus_n_0_shows_no_rows_and_no_false_news(sim: Path) -> None:
    assert gpuwait("--vram", "1G", "true").returncode == 0
    done = gpuwait("history", "-n", "0")
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    assert "true" in gpuwait("history").stdout


def test_history_rows_and_their_times_are_in_one_order(
    sim: Path, isolated_dirs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Rows come in the order runs ended; a 60 s run started at 20:34:50 ends after a 1 s run
    # started at 20:35:05. The column showed start times, 20:35, 20:34, 20:36: out of order.
    at = time.mktime((2026, 11, 30, 20, 34, 50, 0, 0, -1))
    state = isolated_dirs / "state" / "gpuwait"
    state.mkdir(parents=True, exist_ok=True)
    for started, seconds in ((at + 15, 1.0), (at, 60.0), (at + 70, 1.0)):
        append_record(state, a_run(["python3", "t.py"], "/tmp", started, run_seconds=seconds))
    assert main(["history"]) == 0
    header, *rows = capsys.readouterr().out.splitlines()[:4]
    assert header.split()[0] == "ended", header
    shown = [row[:16] for row in rows]
    assert shown == ["2026-11-30 20:35", "2026-11-30 20:35", "2026-11-30 20:36"], rows


def test_history_of_a_command_run_elsewhere_says_where_it_ran(sim: Path, tmp_path: Path) -> None:
    ran, other = tmp_path / "project", tmp_path / "elsewhere"
    ran.mkdir()
    other.mkdir()
    (ran / "t.py").write_text("pass\n")
    assert gpuwait("--vram", "1G", "python3", "t.py", cwd=ran).returncode == 0
    done = gpuwait("history", "--", "python3", "t.py", cwd=other)
    assert done.returncode == 0
    assert "no runs recorded yet" not in done.stdout
    assert f"no runs of python {other}/t.py are recorded" in done.stdout
    assert f"`python3 t.py` ran from {ran}" in done.stdout
    done = gpuwait("history", "--", "python3", "u.py", cwd=other)
    assert "`gpuwait history` shows the 1 run of other commands" in done.stdout


def test_history_of_a_program_run_with_a_new_date_each_day_shows_its_runs(
    sim: Path, tmp_path: Path
) -> None:
    """A tool that is its own script (no interpreter), run from cron with the day's date: its
    history is that of the program, as `history -- python x.py` is that of the script."""
    tool = tmp_path / "render"
    tool.write_text("#!/bin/sh\nexit 0\n")
    tool.chmod(0o755)
    for day in ("2026-03-01", "2026-03-02"):
        assert (
            gpuwait("--vram", "1G", "--", "./render", "--date", day, cwd=tmp_path).returncode == 0
        )
    assert gpuwait("--vram", "1G", "--", "true").returncode == 0
    for asked in (["./render"], ["./render", "--date", "2026-03-03"], [str(tool)]):
        done = gpuwait("history", "--", *asked, cwd=tmp_path)
        assert done.returncode == 0 and "no runs" not in done.stdout, (asked, done.stdout)
        rows = [line for line in done.stdout.splitlines() if "render --date" in line]
        assert len(rows) == 2 and "true" not in done.stdout, (asked, done.stdout)
    # A program that runs other code (make, an interpreter) still shows that line's runs only.
    done = gpuwait("history", "--", "make", "train", cwd=tmp_path)
    assert "no runs of make train" in done.stdout


def test_history_of_nothing_echoes_what_was_asked_for_safely(sim: Path) -> None:
    # A key or a command pasted with an escape sequence in it (clearing the screen here) was
    # echoed raw in "no runs with --key ... are recorded", as no error message echoes it.
    assert gpuwait("--vram", "1G", "true").returncode == 0
    done = gpuwait("history", "--key", "\033[2Jtrain")
    assert done.returncode == 0
    assert done.stdout.startswith("no runs with --key ?[2Jtrain are recorded;"), done.stdout
    done = gpuwait("history", "--", "python3", "\033[2J.py")
    assert "\033" not in done.stdout and "no runs of " in done.stdout, done.stdout


def test_log_of_a_job_by_name_shows_how_it_ended(sim: Path) -> None:
    """Some events name the job by id alone (a dependency that failed, a reaped job): asked for
    by its name, the log still shows them."""
    assert gpuwait("--vram", "1G", "--name", "broken", "false").returncode == 1
    done = gpuwait("--vram", "1G", "--name", "report", "--after-ok", "broken", "true")
    assert done.returncode == 6
    lines = [
        json.loads(line) for line in gpuwait("log", "--json", "--job", "report").stdout.splitlines()
    ]
    assert [e["kind"] for e in lines] == ["submit", "leave"]
    assert lines[1]["outcome"] == "dependency-failed"
    text = gpuwait("log", "-n", "1", "--job", "report").stdout
    assert "leave" in text and "dependency-failed" in text


def test_log_of_an_unknown_job_answers_as_cancel_does(sim: Path) -> None:
    assert gpuwait("--vram", "1G", "--name", "known", "true").returncode == 0
    assert gpuwait("log", "--job", "known").stdout
    log = gpuwait("log", "--job", "nosuch")
    cancel = gpuwait("cancel", "nosuch")
    assert log.returncode == cancel.returncode == EXIT_USAGE
    assert log.stdout == ""
    assert log.stderr == (
        "gpuwait: error: no job matches nosuch in the event log; see `gpuwait log`\n"
    )
    assert "matches nosuch" in cancel.stderr


def test_a_job_name_that_matches_nothing_is_said_as_it_would_be_typed(sim: Path) -> None:
    # `gpuwait cancel ''` said "no waiting or running job matches ; see ...", and `gpuwait log
    # --job` of a name with a line break said it over two lines, the second alone.
    for asked in (["cancel", ""], ["log", "--job", ""]):
        assert "matches ''" in gpuwait(*asked).stderr
    broken = gpuwait("log", "--job", "a\nb")
    assert broken.returncode == EXIT_USAGE
    assert broken.stderr.count("\n") == 1 and "matches 'a?b' in the event log" in broken.stderr


def test_cancel_of_a_job_that_has_ended_says_how_it_ended(sim: Path) -> None:
    # `gpuwait cancel train` after train had ended said only "no waiting or running job
    # matches train", as for a name never given: the user could not tell a typo from a job
    # that was over.
    assert gpuwait("--vram", "1G", "--name", "train", "false").returncode == 1
    done = gpuwait("cancel", "train")
    assert done.returncode == EXIT_USAGE
    assert done.stderr.startswith("gpuwait: error: job "), done.stderr
    assert "(train) has already ended: it failed with exit status 1; nothing to cancel" in (
        done.stderr
    )
    job_id = done.stderr.split("job ", 1)[1].split(" ", 1)[0]
    by_id = gpuwait("cancel", job_id)
    assert by_id.stderr == done.stderr
    assert "no waiting or running job matches nosuch" in gpuwait("cancel", "nosuch").stderr
    # One killed by a signal read "it killed by signal 15".
    assert gpuwait("--vram", "1G", "--name", "shot", "sh", "-c", "kill $$").returncode == -15
    assert "(shot) has already ended: it was killed by signal 15; nothing" in (
        gpuwait("cancel", "shot").stderr
    )


def test_log_of_nothing_says_so_as_history_does(sim: Path) -> None:
    # A new user's `gpuwait log` printed nothing at all, where `gpuwait history` said "no runs
    # recorded yet": an empty screen reads as a log that is broken.
    assert gpuwait("history").stdout == "no runs recorded yet\n"
    log = gpuwait("log")
    assert (log.returncode, log.stdout) == (0, "no events recorded yet\n")
    assert gpuwait("log", "--json").stdout == ""
    assert gpuwait("--vram", "1G", "true").returncode == 0
    assert "no events" not in gpuwait("log").stdout
    # Asked for none of them (as `tail -n 0`), it shows none, and does not say there are none.
    assert (gpuwait("log", "-n", "0").returncode, gpuwait("log", "-n", "0").stdout) == (0, "")


# -- a terminal that cannot show every character -----------------------------------------------


@pytest.mark.parametrize("encoding", ["latin-1", "ascii"])
def test_reports_reach_a_terminal_that_cannot_show_every_character(
    sim: Path, encoding: str
) -> None:
    """Under a Latin-1 or ASCII locale (emulated by PYTHONIOENCODING), what gpuwait's reports
    show that the terminal cannot (the en dash of a time range, a command's own letters) is
    shown as '?', not ended with a traceback half-way through the report."""
    for _ in range(2):
        assert gpuwait("--vram", "1G", "--", "sh", "-c", ": résumé").returncode == 0
    for report in (
        ["history"],
        ["log"],
        ["estimate", "--", "sh", "-c", ": résumé"],
        ["status"],
    ):
        done = subprocess.run(
            [*GPUWAIT, *report],
            capture_output=True,
            encoding=encoding,
            env={**os.environ, "PYTHONIOENCODING": encoding},
            timeout=60,
        )
        assert done.returncode == 0, (report, done.stderr)
        assert "Traceback" not in done.stderr, report
        if report[0] != "status":
            assert "sh -c" in done.stdout, (report, done.stdout)
        if report[0] == "history":
            assert "middle half" in done.stdout, done.stdout


@pytest.mark.parametrize(
    "report",
    [["--version"], ["--help"], ["status", "--json"], ["history"], ["config"]],
    ids=" ".join,
)
def test_output_that_cannot_be_written_is_said_in_one_line(sim: Path, report: list[str]) -> None:
    """`gpuwait status --json > file` on a full disk (here /dev/full): one line says the output
    was not written, and the status says it failed, so a script does not go on with an empty
    file (no traceback, and no exit 0 with nothing written)."""
    assert gpuwait("--vram", "1G", "true").returncode == 0
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [*GPUWAIT, *report], stdout=full, stderr=subprocess.PIPE, text=True, timeout=60
        )
    assert (done.returncode, done.stderr) == (
        EXIT_USAGE,
        "gpuwait: error: cannot write the output: No space left on device\n",
    )


@pytest.mark.parametrize("report", [["--version"], ["--help"], ["status"]], ids=" ".join)
def test_output_to_a_closed_stdout_is_said_in_one_line(sim: Path, report: list[str]) -> None:
    """`gpuwait status >&-` (a cron line or a script that closed its stdout): the report went
    nowhere, and the status says so, as `ls >&-` does, rather than 0 with nothing written."""
    done = subprocess.run(
        ["sh", "-c", 'exec "$@" >&-', "sh", *GPUWAIT, *report],
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stderr) == (
        EXIT_USAGE,
        "gpuwait: error: cannot write the output: Bad file descriptor\n",
    )


# -- another user's simulation -------------------------------------------------------------------

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching users needs root")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[Path, dict[str, str], dict[str, str]]]:
    """A simulation file of root's in a directory every user can reach, and the environments
    of root and of another user pointed at it."""
    root = shared_root()
    sim = root / "sim.toml"
    subprocess.run([*GPUWAIT, "sim", "init", str(sim)], check=True, capture_output=True)
    user_env = {
        **user_home(root, USER, USER),
        "PYTHONPATH": os.environ["PYTHONPATH"],
        "PATH": "/usr/bin:/bin",
        "GPUWAIT_SIM": str(sim),
    }
    yield sim, {**os.environ, "GPUWAIT_SIM": str(sim)}, user_env
    subprocess.run(["rm", "-rf", str(root)], check=False)


def used(env: dict[str, str], as_user: bool) -> tuple[int, list[str], str]:
    """GPU 0's used bytes as `status --json` reports them, its warnings, and its stderr."""
    argv = ["status", "--json"]
    done = (
        run_as(USER, USER, [], argv, env)
        if as_user
        else subprocess.run([*GPUWAIT, *argv], env=env, capture_output=True, text=True)
    )
    report = json.loads(done.stdout)
    return report["gpus"][0]["used_bytes"], report["warnings"], done.stderr


@needs_root
def test_another_users_private_simulation_is_said_not_crashed_on(
    server: tuple[Path, dict[str, str], dict[str, str]],
) -> None:
    sim, root_env, user_env = server
    holder = subprocess.Popen([*SIMJOB, "--vram", "5G", "--hold", "30s"], env=root_env)
    try:
        deadline = time.monotonic() + 30
        while not list(Path(f"{sim}.d").glob("*.json")) and time.monotonic() < deadline:
            time.sleep(0.05)
        # status: the simulated jobs' memory cannot be seen, and it says so.
        bytes_used, warnings, _ = used(user_env, as_user=True)
        assert bytes_used == 0
        assert any("simulated jobs' memory" in w and "--shared" in w for w in warnings)
        done = run_as(USER, USER, [], ["status"], user_env)
        assert "gpuwait: warning: the simulated jobs' memory in" in done.stderr
        # sim job: one line and how to share, no traceback.
        done = run_as(USER, USER, [], ["sim", "job", "--vram", "1G", "--hold", "0s"], user_env)
        assert done.returncode == 2
        lines = done.stderr.splitlines()
        assert len(lines) == 2 and "Traceback" not in done.stderr
        assert lines[0].startswith(f"gpuwait sim job: the simulated jobs' directory {sim}.d")
        assert "gpuwait sim init FILE --shared" in lines[1]
    finally:
        holder.kill()
        holder.wait()


@needs_root
def test_a_shared_simulation_is_used_and_seen_by_every_user(
    server: tuple[Path, dict[str, str], dict[str, str]],
) -> None:
    sim, root_env, user_env = server
    done = subprocess.run(
        [*GPUWAIT, "sim", "init", str(sim), "--force", "--shared"],
        env=root_env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    argv = ["--vram", "5G", "--", "python3", "-m", "gpuwait", "sim", "job", "--vram", "5G"]
    job = popen_as(USER, USER, [], [*argv, "--hold", "30s"], user_env)
    try:
        deadline = time.monotonic() + 30
        while used(root_env, as_user=False)[0] < 5 << 30 and time.monotonic() < deadline:
            time.sleep(0.1)
        bytes_used, warnings, _ = used(root_env, as_user=False)
        assert bytes_used == 5 << 30 and warnings == []
        bytes_used, warnings, _ = used(user_env, as_user=True)
        assert bytes_used == 5 << 30 and warnings == []
    finally:
        job.terminate()
        job.communicate(timeout=30)
    # A short job of the user's runs to the end and leaves nothing behind.
    short = run_as(USER, USER, [], [*argv, "--hold", "0s"], user_env)
    assert short.returncode == 0, short.stderr
    assert not list(Path(f"{sim}.d").glob("*.json"))


def test_only_root_can_share_a_simulation(tmp_path: Path) -> None:
    argv = ["sim", "init", str(tmp_path / "sim.toml"), "--shared"]
    if os.geteuid() == 0:
        root = shared_root()
        try:
            env = {**user_home(root, USER, USER), "PYTHONPATH": os.environ["PYTHONPATH"]}
            argv[2] = str(root / "sim.toml")
            done = run_as(USER, USER, [], argv, env)
        finally:
            subprocess.run(["rm", "-rf", str(root)], check=False)
    else:
        done = gpuwait(*argv)
    assert done.returncode == EXIT_USAGE
    assert done.stderr.splitlines()[0] == (
        "gpuwait: error: only root can write a shared simulation: other users' gpuwait trusts "
        "no file of yours"
    )


def test_the_export_line_of_sim_init_can_be_pasted_for_a_path_with_spaces(tmp_path: Path) -> None:
    # "now: export GPUWAIT_SIM=/home/a/my sims/it's.toml", pasted, set GPUWAIT_SIM to
    # /home/a/my and failed on the rest; the path is quoted as the shell needs it now.
    path = tmp_path / "my sims" / "it's.toml"
    path.parent.mkdir()
    done = gpuwait("sim", "init", str(path), "--gpus", "1", "--memory", "8GiB")
    assert done.returncode == 0, done.stderr
    line = done.stderr.splitlines()[-1]
    assert line.startswith("gpuwait: now: export GPUWAIT_SIM=")
    pasted = line.removeprefix("gpuwait: now: ") + '; printf %s "$GPUWAIT_SIM"'
    shell = subprocess.run(["sh", "-c", pasted], capture_output=True, text=True, timeout=30)
    assert (shell.returncode, shell.stdout) == (0, str(path)), shell.stderr


def test_sim_init_asks_for_the_export_only_where_it_is_not_made(tmp_path: Path) -> None:
    # The README sets GPUWAIT_SIM first and writes the file there: the line asking for the
    # export it had just made read as a step still to do.
    path = tmp_path / "sim.toml"
    done = gpuwait("sim", "init", str(path), GPUWAIT_SIM=str(path))
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [f"gpuwait: wrote 2 simulated GPU(s) of 24.0 GiB to {path}"]
    other = gpuwait("sim", "init", "--force", str(path), GPUWAIT_SIM=str(tmp_path / "other.toml"))
    assert other.stderr.splitlines()[-1] == f"gpuwait: now: export GPUWAIT_SIM={path}"


def test_a_missing_simulation_file_is_answered_with_the_line_that_makes_it(tmp_path: Path) -> None:
    # The hint said `gpuwait sim init PATH ...`, leaving the path to be typed again.
    path = tmp_path / "my sims" / "gpuwait-sim.toml"
    path.parent.mkdir()
    done = gpuwait(
        "--vram", "1G", "true", GPUWAIT_SIM=str(path), GPUWAIT_ON_NO_GPU="fail", cwd=tmp_path
    )
    assert done.returncode == 4, done.stderr
    assert done.stderr.splitlines() == [
        f"gpuwait: error: simulation file {path}: not found",
        f"gpuwait: hint: create it with `gpuwait sim init '{path}' --gpus 2 --memory 24GiB`",
    ]


def test_the_configuration_pages_misspelled_variable_is_named_with_a_setting() -> None:
    # The page's example, GPUWAIT_VRMA, was said to be named with the setting it likely means,
    # and was named with none.
    page = (REPO / "docs" / "configuration.md").read_text()
    example = re.search(r"variable that is no setting \(`(GPUWAIT_\w+)=", page)
    assert example is not None
    [(name, meant)] = unknown_variables([example.group(1)])
    assert meant is not None, f"{name} is named with no setting"
