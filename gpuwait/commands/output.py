"""The CLI's messages on stderr: errors, warnings, and the waiting line. Only gpuwait.commands
(and gpuwait.cli) print; the layers below say what they have to say through a `Console`."""

from __future__ import annotations

import sys
from typing import TextIO

from gpuwait.core.policy import WaitReason
from gpuwait.core.text import printable

#: The longest message line: one that echoes a value pasted by mistake stays readable.
_MAX_LINE = 4000


def _line(text: str) -> str:
    """A message as one line, safe on a terminal: messages echo what users typed (options,
    GPUWAIT_* values, config values, file names), and an escape sequence or a newline in one
    must reach the terminal as '?', never as a command to it or a second line."""
    return printable(text, _MAX_LINE)


def error(message: str, hint: str | None = None) -> None:
    print(f"gpuwait: error: {_line(message)}", file=sys.stderr)
    if hint:
        print(f"gpuwait: hint: {_line(hint)}", file=sys.stderr)


def warn(message: str) -> None:
    print(f"gpuwait: warning: {_line(message)}", file=sys.stderr)


def info(message: str) -> None:
    print(f"gpuwait: {_line(message)}", file=sys.stderr)


class WaitLine:
    """On a terminal, one stderr line rewritten in place; elsewhere a line per change of reason."""

    def __init__(self, quiet: bool, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.tty = self.stream.isatty()
        self.shown = False
        self._last_key: tuple[object, ...] | None = None

    def update(self, reason: WaitReason) -> None:
        if self.quiet:
            return
        text = f"gpuwait: {reason.describe()}"
        if self.tty:
            self.stream.write("\r\033[K" + text)
            self.stream.flush()
            self.shown = True
            return
        # Room figures move with every reading; log only when the situation changes.
        key = (
            reason.needed,
            reason.best_gpu_index,
            reason.running,
            reason.ahead,
            reason.pause,
            reason.gpu_error,
        )
        if key != self._last_key:
            self._last_key = key
            self.stream.write(text + "\n")
            self.stream.flush()

    def clear(self) -> None:
        if self.shown and self.tty:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.shown = False


class Console:
    """A run's messages (gpuwait.runner.session.Reporter) on this terminal: with --quiet only
    errors are said."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self._line: WaitLine | None = None

    def warn(self, message: str) -> None:
        if not self.quiet:
            warn(message)

    def info(self, message: str) -> None:
        if not self.quiet:
            info(message)

    def error(self, message: str) -> None:
        error(message)

    def waiting(self, reason: WaitReason) -> None:
        if self._line is None:
            self._line = WaitLine(self.quiet)
        self._line.update(reason)

    def waited(self) -> None:
        # Each wait has its own line: after a pause the first reason is said again.
        if self._line is not None:
            self._line.clear()
            self._line = None
