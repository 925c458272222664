"""A terminal a test can type into and look at: a tmux session of a given size.

Screens are checked as a person sees them: the commands run in a real terminal (a shell with
job control, as a user has it), and the test reads back what tmux shows, row by row, and what
has scrolled off the top. Each session runs on a tmux server of its own, killed at the end of
the test; tests skip where tmux is not installed.
"""

from __future__ import annotations

import itertools
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

_servers = itertools.count()

#: How long a screen may take to show what a test waits for.
DEADLINE = 20.0


class Terminal:
    """One tmux session running bash with job control, `width` by `height`."""

    def __init__(self, width: int, height: int, env: Mapping[str, str], cwd: Path) -> None:
        self.width = width
        self.height = height
        # A server of its own (-L): a test never sees, or kills, anyone else's sessions.
        self.socket = f"gpuwait-test-{os.getpid()}-{next(_servers)}"
        # A plain prompt, whoever runs the tests: `$ ` and nothing that differs by host.
        rc = cwd / "terminal.bashrc"
        rc.write_text("PS1='$ '\nunset PROMPT_COMMAND\n")
        environment = {**env, "HISTFILE": "/dev/null", "TERM": "xterm-256color"}
        environment.pop("TMUX", None)  # a test run from inside tmux starts a server all the same
        self._tmux(
            "-f",
            "/dev/null",
            "new-session",
            "-d",
            "-x",
            str(width),
            "-y",
            str(height),
            "-s",
            "t",
            "-c",
            str(cwd),
            f"bash --noprofile --rcfile {shlex.quote(str(rc))} -i",
            env=environment,
        )
        # The pane keeps its size even though no client is attached.
        self._tmux("set-option", "-g", "window-size", "manual")
        self._tmux("set-option", "-g", "history-limit", "5000")
        self.wait_for(lambda rows: any(r.startswith("$") for r in rows), what="the first prompt")

    def _tmux(self, *args: str, env: Mapping[str, str] | None = None) -> str:
        done = subprocess.run(
            ["tmux", "-L", self.socket, *args],
            capture_output=True,
            text=True,
            env=None if env is None else dict(env),
            timeout=10,
        )
        if done.returncode != 0:
            raise RuntimeError(f"tmux {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def type(self, line: str, enter: bool = True) -> None:
        """Type `line` at the terminal (literally), then Enter."""
        self._tmux("send-keys", "-t", "t", "-l", line)
        if enter:
            self._tmux("send-keys", "-t", "t", "Enter")

    def key(self, name: str) -> None:
        """Press a key by its tmux name: C-c, C-z, Enter."""
        self._tmux("send-keys", "-t", "t", name)

    def screen(self) -> list[str]:
        """The visible rows, as shown (a long line is as many rows as it wrapped to)."""
        rows = self._tmux("capture-pane", "-p", "-t", "t").split("\n")
        return (rows[:-1] if rows and rows[-1] == "" else rows)[: self.height]

    def everything(self, joined: bool = False) -> list[str]:
        """Every row from the top of the scrollback to the bottom of the screen; `joined`: rows
        that one line wrapped to are given back as that one line."""
        args = ["capture-pane", "-p", "-t", "t", "-S", "-", "-E", "-"]
        if joined:
            args.append("-J")
        return self._tmux(*args).rstrip("\n").split("\n")

    def alternate_screen(self) -> bool:
        """Is a full-screen program (top, watch) showing its own screen?"""
        return self._tmux("display-message", "-p", "-t", "t", "#{alternate_on}").strip() == "1"

    def wait_for(
        self, seen: Callable[[list[str]], object], timeout: float = DEADLINE, what: str = ""
    ) -> list[str]:
        """Poll the screen until `seen(rows)` holds; fail the test, showing the screen, after
        `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            rows = self.screen()
            if seen(rows):
                return rows
            if time.monotonic() > deadline:
                shown = "\n".join(rows)
                pytest.fail(f"not on the screen within {timeout:g}s: {what or seen}\n{shown}")
            time.sleep(0.05)

    def wait_idle(self, timeout: float = DEADLINE) -> list[str]:
        """Wait for the shell to wait at its prompt with nothing running in the foreground."""
        marker = f"idle-{time.monotonic_ns()}"
        self.type(f"echo {marker}")
        return self.wait_for(
            lambda rows: marker in rows and [r for r in rows if r][-1].startswith("$"),
            timeout,
            f"the prompt after {marker}",
        )

    def kill(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=10)


@pytest.fixture
def terminal(tmp_path: Path) -> Iterator[Callable[..., Terminal]]:
    """terminal(width, height, env=None) -> a Terminal in tmp_path; every one is killed (with
    what runs in it) at the end of the test. Skips where tmux is missing."""
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed: screens are checked in a tmux terminal")
    made: list[Terminal] = []

    def make(width: int, height: int, env: Mapping[str, str] | None = None) -> Terminal:
        made.append(Terminal(width, height, env if env is not None else os.environ, tmp_path))
        return made[-1]

    try:
        yield make
    finally:
        for term in made:
            term.kill()
