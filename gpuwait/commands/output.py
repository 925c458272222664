"""The CLI's messages on stderr: errors, warnings, and the waiting line; and the text of every
`--json` output (`json_text`). Only gpuwait.commands (and gpuwait.cli) print; the layers below
say what they have to say through a `Console`."""

from __future__ import annotations

import math
import os
import re
import sys
import time
from typing import TextIO

from gpuwait.core.errors import OutputError
from gpuwait.core.policy import WaitReason
from gpuwait.core.text import columns, printable

#: The longest message line: one that echoes a value pasted by mistake stays readable.
_MAX_LINE = 4000

#: The figures in a wait's note that move from one reading to the next, its durations
#: (`expected in 3m05s`): its words and other figures, not they, tell a new situation (GPU1
#: held in place of GPU0, 2 of 3 cards quiet enough, another job's id). A duration is one
#: figure whatever its form (`1h00m`, `59m59s`, `59.0s`, `500ms`, as format_duration writes
#: them).
_FIGURES = re.compile(r"(?<![0-9A-Za-z])[0-9]+(?:\.[0-9]+)?(?:ms|[hm][0-9]+[ms]|[hms])(?![A-Za-z])")


def situation(reason: WaitReason) -> tuple[object, ...]:
    """What a wait's `reason` says but for the figures that move with every reading (the room
    on the best card, a countdown): a new line, on a file or in a program's log, is written
    only where this changes."""
    return (
        reason.needed,
        reason.best_gpu_index,
        reason.running,
        reason.ahead,
        reason.blocked,
        reason.limit,
        # Why no room helps (every GPU too busy, only one of two answering) may change while
        # everything above stays as it was.
        _FIGURES.sub("#", reason.note or ""),
        reason.pause,
        reason.gpu_error,
        reason.ledger_error,
    )


def _line(text: str) -> str:
    """A message as one line, safe on a terminal: messages echo what users typed (options,
    GPUWAIT_* values, config values, file names), and an escape sequence or a newline in one
    must reach the terminal as '?', never as a command to it or a second line."""
    return printable(text, _MAX_LINE)


def _say(text: str, stream: TextIO | None = None) -> bool:
    """Write one of gpuwait's own messages (on stderr by default); False where it could not be
    written. Nobody may read it any more: a pipe whose reader went away (`2>&1 | head -1`),
    a terminal that hung up under a waiter left running (`& disown`, then logging out). A
    message is no part of the job: the job goes on (a reader gone from a subcommand's own
    output on stdout still ends it, as SIGPIPE would)."""
    try:
        out = stream or sys.stderr
        out.write(text)
        out.flush()
    except (OSError, ValueError):
        return False
    return True


#: Streams whose output could not be written, kept from being collected: closing one would try
#: to write what it holds once more.
_unwritable: list[TextIO] = []


def output_failed(exc: OutputError) -> None:
    """Say, in one line, that the output could not be written; stdout gives up what it holds."""
    error(f"cannot write the output: {exc.strerror}")
    _unwritable.append(sys.stdout)
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (lives as long as the process)


def error(message: str, hint: str | None = None) -> None:
    _say(f"gpuwait: error: {_line(message)}\n")
    if hint:
        _say(f"gpuwait: hint: {_line(hint)}\n")


def warn(message: str) -> None:
    _say(f"gpuwait: warning: {_line(message)}\n")


def info(message: str) -> None:
    _say(f"gpuwait: {_line(message)}\n")


#: The most of a job's name the waiting line shows.
_LABEL = 24


def json_text(document: object, indent: int | None = 2, sort_keys: bool = False) -> str:
    """`document` as JSON that every reader takes, strict ones too (Rust's serde_json, .NET's
    System.Text.Json): an argument or path that is no UTF-8 reaches Python as lone surrogates,
    which `json.dumps` would write as `\\udce9`, no Unicode text: each undecodable byte is
    written as U+FFFD, as a command read from /proc is. A figure that is no number (NaN or
    Infinity, from a damaged or hand-edited file), which `json.dumps` would write bare, is
    unknown: null. Every `--json` output goes through here."""
    import json

    return json.dumps(_readable(document), indent=indent, sort_keys=sort_keys)


def _readable(value: object) -> object:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in value)
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {_readable(k): _readable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_readable(v) for v in value]
    return value


def stream_columns(stream: TextIO) -> int:
    """The width of the terminal `stream` writes to; else $COLUMNS, else 80."""
    try:
        return os.get_terminal_size(stream.fileno()).columns or 80
    except (AttributeError, ValueError, OSError):
        pass
    try:
        columns = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        columns = 0
    return columns if columns > 0 else 80


def redraws(stream: TextIO) -> bool:
    """Whether `stream` is a terminal that takes cursor movements, as git's progress decides:
    not one with TERM unset or `dumb` (Emacs's shell and compilation buffers), which would
    show `\\033[K` as `^[[K` and pile lines rewritten after `\\r` up on one row."""
    return stream.isatty() and os.environ.get("TERM", "dumb") != "dumb"


class WaitLine:
    """Why a job waits, on stderr, each line naming the job (`gpuwait[train]: waiting for ...`).

    On a terminal, while this gpuwait has the terminal's foreground to itself (a shell started
    it there): one line rewritten in place, fitted to the terminal's width (a line that wrapped
    would leave a copy of its first rows at every redraw, since `\r` goes back on the last row
    only), and cleared when the wait ends. In the background (`gpuwait ... &`), or in a
    foreground group it shares (`make -j`, `xargs -P`), where other waiters, commands and the
    shell share the screen: a whole line per change of situation, fitted too, so none writes
    over another or runs into other output. Elsewhere (a file, a pipe): a whole line per
    change, in full.
    """

    def __init__(
        self, quiet: bool, job: str = "", stream: TextIO | None = None, hooked: bool = False
    ) -> None:
        self.stream = stream or sys.stderr
        self.quiet = quiet
        #: A line a shell hook runs: how it asks for less is its own (WaitReason.describe).
        self.hooked = hooked
        self.tty = redraws(self.stream)
        self.shown = False
        self.prefix = f"gpuwait[{printable(job, _LABEL)}]: " if job else "gpuwait: "
        self._last_key: tuple[object, ...] | None = None

    def update(self, reason: WaitReason) -> None:
        if self.quiet:
            return
        if not self.tty:
            # A file or a pipe (`2>&1 | tee run.log`) may still end on a terminal.
            self._once(reason, self.prefix + _line(reason.describe(hooked=self.hooked)))
            return
        # One column spare: a line that ends in the last column leaves some terminals about to
        # wrap, and the next `\r` would then go back on a fresh row.
        width = stream_columns(self.stream) - 1
        room = width - columns(self.prefix)
        said = reason.describe(max(room, 0), hooked=self.hooked)
        text = self.prefix + printable(said, max(room, 1))
        # A pane narrower than the name itself: the line is cut there too.
        text = printable(text, max(width, 1))
        if self._foreground():
            self.shown = _say("\r\033[K" + text, self.stream)
            # Sent to the background later, it says the situation again on a line of its own.
            self._last_key = None
            return
        # Put in the background while the line was shown: the shell has moved on (its job
        # notice, a prompt), and the line stays as it is.
        self.shown = False
        self._once(reason, text)

    def _once(self, reason: WaitReason, text: str) -> None:
        # Room figures move with every reading; a whole line is written only when the situation
        # changes, or once this gpuwait was stopped (Ctrl-Z) and continued: its line is then
        # behind the shell's `Stopped` and prompt (`make -j`'s waiters, after `fg`).
        from gpuwait.linux import signals  # loaded already by a waiter

        key = (situation(reason), signals.stops())
        if key != self._last_key:
            self._last_key = key
            _say(text + "\n", self.stream)

    def _foreground(self) -> bool:
        """Does this gpuwait have its terminal's foreground to itself: its process group's leader
        (as a shell starts a command), and that group in the foreground (not started with `&`)?
        A group that is its caller's (`make -j`, `xargs -P`, a script's loop of `&`) holds other
        waiters and running commands writing to the same screen."""
        try:
            group = os.getpgrp()
            return os.tcgetpgrp(self.stream.fileno()) == group and group == os.getpid()
        except (AttributeError, ValueError, OSError):
            # Not our controlling terminal (`setsid gpuwait ... &`): whose screen it is cannot be
            # told, and the shell that started it may be showing its prompt, and what the user
            # types, on the row a redraw would wipe.
            return False

    def clear(self) -> None:
        if self.shown and self.tty and self._foreground():
            _say("\r\033[K", self.stream)
        self.shown = False


class Console:
    """A run's messages (gpuwait.runner.session.Reporter) on this terminal: with --quiet only
    errors are said."""

    def __init__(self, quiet: bool, hooked: str | None = None) -> None:
        self.quiet = quiet
        self._line: WaitLine | None = None
        #: The program a shell hook runs through gpuwait (`python`), said once where it waits:
        #: typed bare, it would not have.
        self._hooked = hooked
        self._from_hook = hooked is not None

    def warn(self, message: str) -> None:
        if not self.quiet:
            warn(message)

    def info(self, message: str) -> None:
        if not self.quiet:
            info(message)

    def error(self, message: str) -> None:
        error(message)

    def waiting(self, reason: WaitReason, job: str) -> None:
        if self._line is None:
            if self._hooked is not None:
                program = printable(self._hooked, 40)
                # How much, and why that much (learned, or default_vram): a whole line, where
                # the wait line below is fitted to the terminal and drops the why first.
                why = f"{reason.source}; " if reason.source else ""
                self.info(
                    f"{program} waits for {reason.needed} ({why}shell hook: "
                    f"`command {program}` skips it)"
                )
                self._hooked = None
            self._line = WaitLine(self.quiet, job, hooked=self._from_hook)
        self._line.update(reason)

    def waited(self) -> None:
        # Each wait has its own line: after a pause the first reason is said again.
        if self._line is not None:
            self._line.clear()
            self._line = None


def local_time(seconds: object, form: str) -> str:
    """A moment (seconds since the epoch) as local time in `form`; "?" for what a damaged file
    may hold instead (not a number, NaN, a year past what the C library can show)."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        return "?"
    try:
        return time.strftime(form, time.localtime(seconds))
    except (OverflowError, OSError, ValueError):
        return "?"
