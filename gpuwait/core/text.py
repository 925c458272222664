"""Text from other users' files, made safe to show on a terminal; the nearest of known words."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

#: Unicode's categories of what is never shown as itself: controls, formats (bidi overrides),
#: surrogates (bytes that were no UTF-8), private and unassigned characters, and separators of
#: lines and paragraphs.
_UNPRINTABLE = ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp")


#: The longest text a ledger's entry may hold in one field (an argument of a command, say).
MAX_TEXT = 4096
#: The most items a list of text in an entry may have (a command's arguments, say).
MAX_TEXTS = 1024
#: About the most a command's arguments after the first take in its entry, as the ledger's
#: JSON writes them: a user's file holds up to 1024 entries, and a read refuses a file past
#: 16 MiB (gpuwait.queue.ledger), so a queue of jobs each handed a thousand file names
#: (100 KB of command line) would otherwise make its own ledger "damaged", over and over.
MAX_COMMAND_BYTES = 8192
#: What the cut of an argument ends with, as the ledger's JSON writes it (\u2026).
_ELLIPSIS_WRITTEN = 6


def written_size(text: str) -> int:
    """How many bytes the ledger's JSON (json.dumps, ensure_ascii) writes for `text`, its quotes
    left out: the sum of `_char_written` over its characters, ASCII counted by kind."""
    size = len(text)
    for more, kind in _ASCII_WIDER:
        size += more * len(kind.findall(text))
    if not text.isascii():
        past = _PAST_ASCII.findall(text)
        size += sum(map(_char_written, past)) - len(past)
    return size


def _char_written(char: str) -> int:
    """How many bytes the ledger's JSON writes for one character: six for one past ASCII (a
    backslash, u and four hex digits), twelve for one past the Basic Multilingual Plane (an
    emoji, written as two such), six for a control character (two for a line feed, a tab and
    the like), two for a quote or a backslash, one for anything else."""
    code = ord(char)
    if code < 0x20:
        return 2 if char in "\b\f\n\r\t" else 6
    if code < 0x7F:
        return 2 if char in '"\\' else 1
    if code == 0x7F:
        return 6
    return 12 if code > 0xFFFF else 6


def _ascii_wider() -> list[tuple[int, re.Pattern[str]]]:
    """The ASCII characters `_char_written` says take more than a byte, by how many more."""
    by_size: dict[int, str] = {}
    for code in range(0x80):
        if (size := _char_written(chr(code))) > 1:
            by_size[size] = by_size.get(size, "") + chr(code)
    return [(size - 1, re.compile(f"[{re.escape(chars)}]")) for size, chars in by_size.items()]


#: Counted by regular expressions, at C's speed: a launch measures long arguments by the
#: thousand (`xargs`).
_ASCII_WIDER = _ascii_wider()
_PAST_ASCII = re.compile("[^\x00-\x7f]")


def _cut_to_written(text: str, limit: int) -> str:
    """`text`, or its longest start that with "…" after it takes at most `limit` bytes as the
    ledger writes it. One pass over at most `limit` characters (each takes a byte or more):
    a command's every argument is cut at each launch, a thousand long ones from `xargs`."""
    if len(text) <= limit and written_size(text) <= limit:
        return text
    room = limit - _ELLIPSIS_WRITTEN
    for at, char in enumerate(text):
        room -= _char_written(char)
        if room < 0:
            return text[:at] + "…"
    return text  # not reached: a text past `limit` characters takes more than `limit` bytes


def entry_command(argv: Sequence[str], budget: int = MAX_COMMAND_BYTES) -> list[str]:
    """A command as its entry keeps it: within what a read of the entry accepts (which refuses
    the entry otherwise) and within `budget` (MAX_COMMAND_BYTES) after its first argument, so
    `xargs` handing a job thousands of file names, or an argument of a whole config file, cuts
    the command the ledger shows, not the entry. What is cut is said in one last item, "… N
    more arguments", counted in the budget too; the first argument is always kept (who runs the
    command is told by it). Each argument is cut to MAX_TEXT bytes as written (4096 characters
    of ASCII, 682 of Cyrillic), the first as the others. All is measured as the ledger's JSON
    writes it, where a character past ASCII takes six bytes. (Other versions cut elsewhere;
    `gpuwait.linux.security` reads their cuts too.)"""
    # Each argument is cut as it is reached: those past the budget, a thousand from `xargs`,
    # are counted, never measured.
    command = [_cut_to_written(a, MAX_TEXT) for a in argv[:1]]
    # The list's brackets, less the comma its last argument goes without.
    used = 1
    for at in range(1, len(argv)):
        arg = _cut_to_written(argv[at], MAX_TEXT)
        # Its quotes and the comma after it besides.
        size = written_size(arg) + 3
        if (at == MAX_TEXTS - 1 and len(argv) > MAX_TEXTS) or used + size > budget:
            # The last item takes room too: the arguments before it make way where it must.
            while True:
                more = f"… {len(argv) - at} more arguments"
                if at == 1 or used + written_size(more) + 3 <= budget:
                    break
                at -= 1
                used -= written_size(command[at]) + 3
            command[at:] = [more]
            break
        command.append(arg)
        used += size
    return command


def whole_number(text: str) -> int | None:
    """The number `text` writes in the digits 0-9 alone (no sign, no space); None for any other
    text. str.isdigit() also takes digits that int() refuses (a superscript two) or reads as
    another script's (an Arabic-Indic three), so text from a file, a variable or another user is
    read here. One of more digits than int() converts (4300, or as few as 640 where
    PYTHONINTMAXSTRDIGITS says so), which would raise, is larger than any count, index, pid or
    uid read with it: 10**600 stands for it."""
    if not (text.isascii() and text.isdigit()):
        return None
    return int(text) if len(text.lstrip("0")) <= 600 else 10**600


def printable(text: str, limit: int = 200) -> str:
    """`text` safe to print on another user's terminal: control characters (escape sequences)
    and line and paragraph separators (U+2028, U+2029: the end of a line to str.splitlines)
    shown as '?', and at most `limit` columns of it (a Chinese character or an emoji takes
    two)."""
    import unicodedata  # only `status` prints foreign text; a launch does not pay for it

    # Read no further than `limit` columns can show, with up to three combining accents
    # (no column of their own) on each letter.
    cleaned = "".join(
        "?" if unicodedata.category(c) in _UNPRINTABLE else c for c in text[: 4 * (limit + 1)]
    )
    if columns(cleaned) <= limit:
        return cleaned
    return cut(cleaned, limit - 1) + "…"


def one_line(text: str) -> bool:
    """Whether `text` is shown as it is by `printable`: no control character, line end or the
    like in it."""
    import unicodedata

    return all(unicodedata.category(c) not in _UNPRINTABLE for c in text)


def columns(text: str) -> int:
    """How many columns of a terminal `text` takes: two for each wide character (Chinese,
    Japanese and Korean ones, fullwidth forms, most emoji), none for a combining mark (an
    accent written as one of its own after its letter), one for any other."""
    return len(text) if text.isascii() else sum(map(_columns_of, text))


def cut(text: str, width: int) -> str:
    """The longest start of `text` that takes at most `width` columns."""
    if text.isascii():
        return text[: max(0, width)]
    taken = 0
    for end, c in enumerate(text):
        taken += _columns_of(c)
        if taken > width:
            return text[:end]
    return text


def _columns_of(c: str) -> int:
    import unicodedata  # only text that is not ASCII needs it

    if unicodedata.combining(c):
        return 0
    return 2 if unicodedata.east_asian_width(c) in ("W", "F") else 1


def nearest(word: str, choices: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The choice `word` most likely misspells (`staus` for `status`), or None when none is
    close. Only asked once something was not recognised: a launch does not pay for difflib."""
    import difflib

    found = difflib.get_close_matches(word, list(choices), n=1, cutoff=cutoff)
    return found[0] if found else None


def nearest_option(word: str, options: Iterable[str]) -> str | None:
    """The option `word` (`--vrma`) most likely misspells, or None: told by their names alone,
    since the two dashes every long option has would make `--wait` close to `--quiet`."""
    named = {option.lstrip("-"): option for option in options}
    found = nearest(word.lstrip("-"), named)
    return None if found is None else named[found]


def command_line(argv: Sequence[object], limit: int = 4000) -> str:
    """A command as one line, quoted as a shell would need it typed (`python3 -c 'import time;
    time.sleep(3)'`), and safe to print: every command gpuwait shows goes through here, so a
    command looks the same in `status`, `log`, `history` and `estimate`."""
    import re
    import shlex  # only the commands that show commands pay for it

    words = [str(a) for a in argv]
    if len(words) == 2 and re.fullmatch(r"\[[0-9a-f]{12}\]", words[1]):
        # Kept without its line (history_commands = hash): the program and the line's hash.
        return printable(f"{shlex.join(words[:1])} {words[1]}", limit)
    return printable(shlex.join(words), limit)


def shell_word(text: object) -> str:
    """`text` (a path) as a shell needs it in a command to paste: quoted where it holds a space,
    a quote or anything else the shell would read otherwise."""
    import shlex  # only a message that gives a command pays for it

    return shlex.quote(str(text))
