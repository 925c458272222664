"""Every number and path a user gives is bounded and read in gpuwait's own words (issue 14):
an absurd duration, count or size, a digit other than 0-9, a relative state or ledger dir, a
control character, a config file nested thousands deep, an unreadable state dir, a simulation
file that cannot be written. Each is answered at once with one line and its documented exit
code: never a traceback, never Python's own wording, never an escape sequence echoed raw."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.users import run_as, shared_root, user_home

#: A value nested far deeper than any parser recurses.
DEEP = "[" * 100_000 + "]" * 100_000

#: Python's words, which gpuwait's messages never show.
PYTHON_WORDING = (
    "Traceback",
    "invalid literal for int()",
    "could not convert string to float",
    "invalid int value",
    "invalid float value",
    "maximum recursion depth",
)

# (argv, environment, user config text, exit code, words in the message); "{tmp}" in argv is
# the test's own temporary directory.
Case = tuple[list[str], dict[str, str], str | None, int, str]

CASES: dict[str, Case] = {
    # -- durations: at most a year, wherever they come from --
    "env lock timeout": (
        ["--vram", "1G", "true"],
        {"GPUWAIT_LOCK_TIMEOUT": "9999999999h"},
        None,
        2,
        "'9999999999h' is too long (at most 365d)",
    ),
    "timeout": (["--timeout", "9999999999h", "--vram", "1G", "true"], {}, None, 2, "at most 365d"),
    "grace": (
        ["--pausable", "--grace", "9999999999h", "--vram", "1G", "true"],
        {},
        None,
        2,
        "--grace '9999999999h' is too long (at most 365d)",
    ),
    "status watch": (["status", "--watch", "9999999999h"], {}, None, 2, "at most 365d"),
    # Refreshing without a pause would busy a core: the least is said as the longest is.
    "status watch zero": (
        ["status", "--watch", "0"],
        {},
        None,
        2,
        "--watch '0' is too short (at least 0.1s)",
    ),
    "status watch under the least": (
        ["status", "--watch", "50ms"],
        {},
        None,
        2,
        "--watch '50ms' is too short (at least 0.1s)",
    ),
    "env poll interval": (
        ["--vram", "1G", "true"],
        {"GPUWAIT_POLL_INTERVAL": "9999999999h"},
        None,
        2,
        "at most 365d",
    ),
    "env gpu error timeout": (
        ["--vram", "1G", "true"],
        {"GPUWAIT_GPU_ERROR_TIMEOUT": "9999999999h"},
        None,
        2,
        "at most 365d",
    ),
    "config timeout as a huge number": (
        ["--vram", "1G", "true"],
        {},
        "timeout = 1e300\n",
        2,
        "at most 365d",
    ),
    "config sample interval as infinity": (
        ["--vram", "1G", "true"],
        {},
        "sample_interval = inf\n",
        2,
        "at most 365d",
    ),
    # -- counts: whole numbers in bounds --
    "too many gpus": (["--gpus", "1025", "--vram", "1G", "true"], {}, None, 2, "at most 1024"),
    "too many retries": (
        ["--retry-oom", "101", "--vram", "1G", "true"],
        {},
        None,
        2,
        "at most 100",
    ),
    "history lines": (["history", "-n", "99999999999999999999"], {}, None, 2, "at most 1000000"),
    "log lines": (["log", "-n", "1000001"], {}, None, 2, "at most 1000000"),
    "gpus word": (["--gpus", "x", "--vram", "1G", "true"], {}, None, 2, "not a whole number"),
    "sim init too many gpus": (
        ["sim", "init", "--gpus", "100000", "{tmp}/many.toml"],
        {},
        None,
        2,
        "at most 1024",
    ),
    "sim init too much memory": (
        ["sim", "init", "--memory", "2000T", "{tmp}/big.toml"],
        {},
        None,
        2,
        "'2000T' is too large (at most 1024T)",
    ),
    "size above a petabyte": (["--vram", "2000T", "true"], {}, None, 2, "at most 1024T"),
    # -- digits: 0-9 only, though Python's int() and float() read others --
    "arabic-indic size": (["--vram", "٣G", "true"], {}, None, 2, "digits 0-9"),
    "arabic-indic gpus": (["--gpus", "٢", "--vram", "1G", "true"], {}, None, 2, "digits 0-9"),
    "arabic-indic timeout": (["--timeout", "٣s", "--vram", "1G", "true"], {}, None, 2, "0-9"),
    "fullwidth safety": (["--safety", "０.５", "--vram", "1G", "true"], {}, None, 2, "fraction"),
    "fullwidth max util": (["--max-util", "５", "--vram", "1G", "true"], {}, None, 2, "max-util"),
    "max util past 100": (["--max-util", "101", "true"], {}, None, 2, "above 0 and at most 100"),
    "env arabic-indic pause max": (
        ["--vram", "1G", "true"],
        {"GPUWAIT_PAUSE_MAX": "٣"},
        None,
        2,
        "number of pauses from 0 to 1000",
    ),
    # -- gpuwait's words, not Python's --
    "env resume exit word": (
        ["--vram", "1G", "true"],
        {"GPUWAIT_RESUME_EXIT": "x"},
        None,
        2,
        "exit status from 1 to 125",
    ),
    "env margin word": (
        ["--vram", "1G", "true"],
        {"GPUWAIT_ESTIMATE_MARGIN": "x"},
        None,
        2,
        "fraction from 0 to 2",
    ),
    "env weight word": (
        ["--vram", "1G", "true"],
        {"GPUWAIT_GPU_WEIGHTS": "0=x"},
        None,
        2,
        "'x' is not a number",
    ),
    # -- config files nested too deeply for the parser --
    "config nested unknown key": (["--vram", "1G", "true"], {}, f"x = {DEEP}\n", 2, "nested"),
    "config nested known key": (["--vram", "1G", "true"], {}, f"safety = {DEEP}\n", 2, "nested"),
    # -- state and ledger dirs: absolute, or every working directory has its own --
    "env relative ledger dir": (
        ["--vram", "1G", "true"],
        {"GPUWAIT_LEDGER_DIR": "shared"},
        None,
        2,
        "expected an absolute path",
    ),
    "relative --ledger": (
        ["--ledger", "shared", "--vram", "1G", "true"],
        {},
        None,
        2,
        "--ledger 'shared' is not valid: expected an absolute path",
    ),
    "env relative state dir": (
        ["--vram", "1G", "true"],
        {"GPUWAIT_STATE_DIR": "state"},
        None,
        2,
        "expected an absolute path",
    ),
    "config relative ledger dir": (
        ["--vram", "1G", "true"],
        {},
        'ledger_dir = "x"\n',
        2,
        "expected an absolute path",
    ),
    "config number as ledger dir": (
        ["--vram", "1G", "true"],
        {},
        "ledger_dir = 5\n",
        2,
        "expected a path in quotes",
    ),
    # -- values echoed in a message: escape sequences never reach the terminal --
    "escape sequence in devices": (
        ["--devices", "0\x1b[31m", "--vram", "1G", "true"],
        {},
        None,
        2,
        "no GPU",
    ),
    "escape sequence in an unknown argument": (
        ["status", "\x1b]0;owned\x07"],
        {},
        None,
        2,
        "unrecognized arguments",
    ),
    # -- a simulation file that cannot be written: the user's path, so exit 2 --
    "sim init into a missing directory": (
        ["sim", "init", "{tmp}/missing/x.toml"],
        {},
        None,
        2,
        "/missing does not exist",
    ),
}


def answer(
    argv: list[str], env: dict[str, str], cwd: Path, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpuwait", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **env},
        cwd=cwd,
    )


def assert_one_clear_line(stderr: str) -> None:
    for words in PYTHON_WORDING:
        assert words not in stderr, stderr
    # No escape sequence or other control character reaches the terminal raw.
    assert not re.search(r"[\x00-\x09\x0b-\x1f\x7f]", stderr), repr(stderr)
    assert len(stderr.splitlines()) <= 2, stderr  # one line, and a hint line at most


@pytest.mark.parametrize("name", list(CASES))
def test_bad_value_is_answered_in_one_line(
    sim: Path, isolated_dirs: Path, tmp_path: Path, name: str
) -> None:
    argv, env, config, status, words = CASES[name]
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in argv]
    if config is not None:
        path = isolated_dirs / "config" / "gpuwait" / "config.toml"
        path.parent.mkdir(parents=True)
        path.write_text(config)
    work = tmp_path / "work"
    work.mkdir()
    started = time.monotonic()
    done = answer(argv, env, work)
    assert done.returncode == status, done.stderr
    assert words in done.stderr, done.stderr
    assert done.stderr.startswith("gpuwait: error:"), done.stderr
    assert_one_clear_line(done.stderr)
    assert time.monotonic() - started < 10
    assert list(work.iterdir()) == []  # no state dir made relative to the working directory
    assert not (tmp_path / "many.toml").exists() and not (tmp_path / "big.toml").exists()


def test_a_state_dir_under_home_is_still_taken(sim: Path, isolated_dirs: Path) -> None:
    done = answer(["config"], {"GPUWAIT_STATE_DIR": "~/elsewhere"}, isolated_dirs)
    assert done.returncode == 0, done.stderr
    assert f"state dir:   {isolated_dirs / 'elsewhere'}" in done.stdout


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--vram", "1G", "--hold", "9999999999h"], "argument --hold: '9999999999h' is too long"),
        (["--vram", "1G", "--ramp", "9999999999h"], "argument --ramp: '9999999999h' is too long"),
        (["--vram", "1G", "--exit", "256"], "argument --exit: 256 is too large (at most 255)"),
        (["--vram", "1G", "--exit", "x"], "argument --exit: 'x' is not a whole number"),
    ],
)
def test_a_simulated_job_bounds_its_durations(
    sim: Path, tmp_path: Path, argv: list[str], words: str
) -> None:
    # The simulated CUDA program answers as the programs it stands for do: argparse's usage.
    done = answer(["sim", "job", *argv], {}, tmp_path, timeout=20)
    assert done.returncode == 2, done.stderr
    assert words in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_a_damaged_allocation_record_is_ignored(sim: Path, tmp_path: Path) -> None:
    """A simulated job's allocation record nested thousands deep is damaged: ignored, as
    docs/robustness.md says, and the cards read as free."""
    records = Path(f"{sim}.d")
    records.mkdir(mode=0o700, exist_ok=True)
    (records / f"{os.getpid()}.json").write_text(DEEP)
    status = answer(["status", "--json"], {}, tmp_path)
    assert status.returncode == 0, status.stderr
    assert "Traceback" not in status.stderr
    run = answer(["--vram", "1G", "--", "true"], {}, tmp_path)
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr


def test_a_simulation_file_nested_too_deeply_is_refused(sim: Path, tmp_path: Path) -> None:
    sim.write_text(f"gpu = {DEEP}\n")
    done = answer(["status"], {}, tmp_path)
    assert done.returncode == 4, done.stderr
    assert "nested too deeply" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "maximum recursion" not in done.stderr


USER = 47310


@pytest.mark.parametrize(
    ("argv", "status", "words"),
    [
        (["estimate", "--", "python", "x.py"], 5, "history"),
        (["estimate", "--json", "--", "python", "x.py"], 5, "history"),
        (["history"], 5, "history"),
        (["log"], 5, "ledger"),
        (["status"], 5, "ledger"),
        (["--", "python3", "-c", "pass"], 5, "ledger"),
    ],
)
def test_an_unreadable_state_dir_is_a_state_error(
    sim: Path, tmp_path: Path, argv: list[str], status: int, words: str
) -> None:
    """State dir at mode 000: exit 5 and one line naming the file, like every state error
    (a launch may also warn that its history is not used)."""
    done = _in_unreadable_state_dir(sim, tmp_path, argv)
    assert done.returncode == status, done.stderr
    assert words in done.stderr and "Permission denied" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines()[-1].startswith("gpuwait: "), done.stderr


def test_a_run_with_its_ledger_elsewhere_goes_on_without_history(sim: Path, tmp_path: Path) -> None:
    """History is a help: unreadable, the run goes on (one warning), as docs/robustness.md says."""
    done = _in_unreadable_state_dir(sim, tmp_path, ["--", "python3", "-c", "pass"], ledger=True)
    assert done.returncode == 0, done.stderr
    assert "going on without what earlier runs used" in done.stderr
    assert "Traceback" not in done.stderr


def _in_unreadable_state_dir(
    sim: Path, tmp_path: Path, argv: list[str], *, ledger: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run gpuwait with its state dir at mode 000: as another user where the tests run as
    root (root reads anything), else as ourselves."""
    if os.geteuid() != 0:
        state = tmp_path / "home" / "state" / "gpuwait"
        state.mkdir(parents=True, exist_ok=True)
        extra = {}
        if ledger:
            (tmp_path / "ledger").mkdir(mode=0o700)
            extra["GPUWAIT_LEDGER_DIR"] = str(tmp_path / "ledger")
        state.chmod(0)
        try:
            return answer(argv, extra, tmp_path)
        finally:
            state.chmod(0o700)
    root = shared_root()
    env = user_home(root, USER, USER)
    env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    env["PATH"] = os.environ["PATH"]
    env["XDG_CONFIG_DIRS"] = str(root / "site")
    copy = root / "sim.toml"
    copy.write_text(sim.read_text())
    copy.chmod(0o644)
    env["GPUWAIT_SIM"] = str(copy)
    state = Path(env["XDG_STATE_HOME"]) / "gpuwait"
    state.mkdir(mode=0o700)
    os.chown(state, USER, USER)
    state.chmod(0)
    if ledger:
        mine = root / "ledger"
        mine.mkdir(mode=0o700)
        os.chown(mine, USER, USER)
        env["GPUWAIT_LEDGER_DIR"] = str(mine)
    try:
        return run_as(USER, USER, [], argv, env)
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=False)
