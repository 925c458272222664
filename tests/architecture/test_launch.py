"""Keeping the launch fast, and leaving it safely.

A launch (`gpuwait --vram 1G -- CMD`) stays fast because it imports none of the standard
library's heavy modules (dataclasses, shutil, hashlib, subprocess, inspect, random), and leaves
with `os._exit` instead of tearing the interpreter down. That exit is safe only while no atexit
handler is registered, every thread left is a daemon, and the output is flushed before it: each
is checked here on real launches, over the simulation and over the NVML library.
(bench/launch_overhead.py measures the time itself.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.fixtures_nvml import FakeGpu, FakeNvml

#: random: only a waiter spaces its readings at random.
HEAVY = ("dataclasses", "shutil", "hashlib", "subprocess", "inspect", "random")

#: A launch as the console script makes it, then a look at what it left behind: run in place
#: of entry_point's os._exit, in the same process. argv[1] names the report's file.
PROBE = """
import json, sys, atexit, threading
from gpuwait import cli
code = cli.main(sys.argv[2:])
report = {
    "code": code,
    "atexit": atexit._ncallbacks(),
    "threads": [t.name for t in threading.enumerate()
                if t is not threading.main_thread() and not t.daemon],
}
with open(sys.argv[1], "w") as out:
    json.dump(report, out)
"""


def launch_report(env: dict[str, str], tmp_path: Path, args: list[str]) -> dict[str, object]:
    out = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(out), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    report: dict[str, object] = json.loads(out.read_text())
    assert report["code"] == 0, done.stderr
    return report


def imported_by_launch(
    env: dict[str, str], args: tuple[str, ...] = ("--vram", "1G", "-q", "--", "true")
) -> set[str]:
    """Every module a launch imports, as `python -X importtime` lists them."""
    done = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-c",
            "from gpuwait.cli import entry_point; entry_point()",
            *args,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    names = set()
    for line in done.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip())
    assert "gpuwait.cli" in names  # the listing is what it claims to be
    return names


@pytest.fixture
def nvml_env(fake_nvml: FakeNvml) -> dict[str, str]:
    fake_nvml.set_gpus([FakeGpu()])
    env = fake_nvml.env(dict(os.environ))
    env.pop("GPUWAIT_SIM", None)
    return env


@pytest.mark.parametrize("backend", ["sim", "nvml"])
def test_a_launch_imports_none_of_the_heavy_modules(
    backend: str, sim: Path, request: pytest.FixtureRequest
) -> None:
    env = dict(os.environ) if backend == "sim" else request.getfixturevalue("nvml_env")
    imported = imported_by_launch(env)
    assert sorted(m for m in imported if m.split(".")[0] in HEAVY) == []


def test_a_command_the_shell_hook_runs_bare_in_a_subshell_loads_no_more_of_gpuwait(
    sim: Path,
) -> None:
    """`python -m pip list | grep torch`, `v=$(python --version)`: a command the hook runs bare
    (never_wrap) in a pipeline's stage or a command substitution, where gpuwait stays its
    parent, is to start as fast as one the hook runs bare from the shell itself, which gpuwait
    becomes. It also loaded the queue's, the ledger's and the history's modules, which it never
    uses: some 5 ms more at every such launch."""

    def loaded(main: int) -> set[str]:
        # The hook's $$ and $BASHPID: the same in the shell itself, not in a subshell.
        env = dict(
            os.environ, GPUWAIT_NEVER_WRAP="true*", _GPUWAIT_SHELL_PID=f"{main}/{os.getpid()}"
        )
        imported = imported_by_launch(env, ("shell-hook", "--", "true"))
        return {m for m in imported if m.split(".")[0] == "gpuwait"}

    # The one module more: what starts the command as gpuwait's child, and watches it.
    assert sorted(loaded(main=1) - loaded(main=os.getpid()) - {"gpuwait.runner.bare"}) == []


def test_a_command_the_shell_hook_runs_bare_loads_none_of_the_queues_modules(sim: Path) -> None:
    """`python --version` typed in a hooked shell: gpuwait only decides it runs bare and becomes
    it. The queue's modules and json, which it never uses there, were loaded all the same, by
    the module that starts the command: some 2 ms more at every such line."""
    env = dict(os.environ, GPUWAIT_NEVER_WRAP="true*")
    imported = imported_by_launch(env, ("shell-hook", "--", "true"))
    assert sorted(m for m in imported if m.startswith("gpuwait.queue") or m == "json") == []


def test_a_command_the_shell_hook_runs_bare_loads_no_argument_parser(sim: Path) -> None:
    """The hook reads its own few options by hand; argparse (and the gettext it loads) served
    only to hold them, at every line typed that runs bare: some 1.2 ms."""
    env = dict(os.environ, GPUWAIT_NEVER_WRAP="true*")
    imported = imported_by_launch(env, ("shell-hook", "--", "true"))
    assert sorted(m for m in imported if m in ("argparse", "gettext")) == []


def test_status_imports_none_of_the_heavy_modules(sim: Path) -> None:
    """`gpuwait status`, typed often and run by `watch`: it measured the terminal with shutil,
    which loads bz2 and lzma, some 2 ms of each look; $COLUMNS and the tty are read directly."""
    imported = imported_by_launch(dict(os.environ), ("status",))
    assert sorted(m for m in imported if m.split(".")[0] in (*HEAVY, "bz2", "lzma")) == []


#: A launch as the console script makes it, counting the calls of compile() it makes other
#: than the import system's own (a module without its bytecode), until it ends or becomes the
#: command (a line the hook runs bare); argv[1] names the report.
COMPILE_PROBE = """
import builtins, json, os, sys
calls = []
real = builtins.compile
def counted(*args, **kwargs):
    if "importlib" not in sys._getframe(1).f_code.co_filename:
        calls.append(repr(args[0])[:60])
    return real(*args, **kwargs)
def report(code):
    with open(sys.argv[1], "w") as out:
        json.dump({"code": code, "compiled": calls}, out)
def becomes(*args):
    report(0)
    os._exit(0)
builtins.compile = counted
os.execvp = becomes
from gpuwait import cli
report(cli.main(sys.argv[2:]))
"""


@pytest.mark.parametrize(
    ("backend", "args"),
    [("nvml", ("--vram", "1G", "-q", "--", "true")), ("sim", ("shell-hook", "--", "true"))],
)
def test_a_launch_and_a_line_the_hook_runs_bare_compile_no_source_text(
    backend: str, args: tuple[str, ...], sim: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The first compile() of a process sets up Python's whole syntax tree module, some 0.9 ms;
    typing compiles every type named by a string (a NamedTuple's fields under `from __future__
    import annotations`, a TypeVar's bound), and a launch had three such, for nothing. (The
    simulation's TOML, or a config file, is read by tomllib, which compiles its own.)"""
    env = dict(os.environ, GPUWAIT_NEVER_WRAP="true*")
    if backend == "nvml":
        env = {**request.getfixturevalue("nvml_env"), "GPUWAIT_NEVER_WRAP": "true*"}
    out = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-c", COMPILE_PROBE, str(out), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["code"] == 0, done.stderr
    assert report["compiled"] == []


@pytest.mark.parametrize("backend", ["sim", "nvml"])
def test_what_leaving_with_os_exit_relies_on(
    backend: str, sim: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    env = dict(os.environ) if backend == "sim" else request.getfixturevalue("nvml_env")
    report = launch_report(env, tmp_path, ["--vram", "1G", "-q", "--", "true"])
    assert report["atexit"] == 0, "an atexit handler would never run after os._exit"
    assert report["threads"] == [], "a thread that is not a daemon would be cut off mid-work"


def test_output_is_complete_when_gpuwait_leaves_through_os_exit(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    # stdout to a pipe is block-buffered: without the flush before os._exit the end would be lost.
    done = subprocess.run(
        [*gpuwait_cmd, "config"], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.rstrip().splitlines()[-1].startswith("ledger dir:")
    verbose = subprocess.run(
        [*gpuwait_cmd, "--vram", "1G", "-v", "--", "true"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert verbose.returncode == 0 and "starts on GPU" in verbose.stderr
