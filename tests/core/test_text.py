"""What an entry keeps of a command line, measured as the ledger's JSON writes it."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwait.core.text import (
    MAX_COMMAND_BYTES,
    MAX_TEXT,
    MAX_TEXTS,
    _char_written,
    _cut_to_written,
    entry_command,
    written_size,
)

#: Arguments of every kind the ledger's JSON writes other than as themselves.
_TEXTS = [
    "plain.py",
    'say "hi"',
    "C:\\data\\x",
    "line\nfeed\ttab\rcr\bbs\fff",
    "\x00\x01\x1f\x7f",
    "данные",
    "😀 emoji",
    'mixed ф\x7f"\\\n😀',
]


@pytest.mark.parametrize("text", _TEXTS)
def test_an_argument_is_measured_exactly_as_the_ledger_writes_it(text: str) -> None:
    assert written_size(text) == len(json.dumps(text)) - 2


def test_every_character_is_measured_one_at_a_time_as_in_a_whole_text() -> None:
    # The cut walks an argument a character at a time, the budget measures whole arguments:
    # both take their figures from what the ledger's JSON writes, for every character there is.
    for start in range(0, 0x110000, 0x10000):
        chars = [chr(code) for code in range(start, start + 0x10000)]
        sizes = [_char_written(c) for c in chars]
        assert sizes == [len(json.dumps(c)) - 2 for c in chars]
        assert sum(sizes) == written_size("".join(chars)) == len(json.dumps("".join(chars))) - 2


@pytest.mark.parametrize("length", [700, 4097, 5000, 70001])
@pytest.mark.parametrize("unit", ["x", "ф", "😀", "\x01", "\n", '"', "ab\x7fф"])
def test_a_long_program_name_keeps_the_longest_start_that_fits_4_kib_as_written(
    unit: str, length: int
) -> None:
    program = (unit * length)[:length]
    if len(json.dumps(program)) - 2 <= MAX_TEXT:
        assert entry_command([program, "x.py"]) == [program, "x.py"]
        return
    kept = entry_command([program, "x.py"])
    assert kept[1:] == ["x.py"]
    start = kept[0].removesuffix("…")
    assert kept[0] == start + "…" and program.startswith(start)
    assert len(json.dumps(kept[0])) - 2 <= MAX_TEXT
    # One character more would not have fitted.
    longer = program[: len(start) + 1] + "…"
    assert len(json.dumps(longer)) - 2 > MAX_TEXT


def test_a_program_name_of_4096_ascii_characters_is_kept_whole() -> None:
    assert entry_command(["x" * MAX_TEXT, "y"]) == ["x" * MAX_TEXT, "y"]


def test_a_long_program_name_of_ascii_then_cyrillic_keeps_the_longest_start_that_fits() -> None:
    for ascii_part in range(0, MAX_TEXT, 37):
        program = "/opt/" + "x" * ascii_part + "ф" * 5000
        kept = entry_command([program])[0]
        assert len(json.dumps(kept)) - 2 <= MAX_TEXT
        longer = program[: len(kept)] + "…"
        assert len(json.dumps(longer)) - 2 > MAX_TEXT, ascii_part


def test_a_command_of_thousands_of_short_arguments_keeps_as_many_as_a_ledger_reads() -> None:
    # 1500 numbers take about 6 KiB, under what an entry keeps of arguments, but a ledger
    # reads a command of at most MAX_TEXTS items: one more made the entry unreadable.
    argv = ["python", "x.py", *(str(n) for n in range(1500))]
    kept = entry_command(argv)
    assert len(kept) == MAX_TEXTS
    assert kept[:-1] == argv[: MAX_TEXTS - 1]
    assert kept[-1] == f"… {len(argv) - MAX_TEXTS + 1} more arguments"


def _written(items: list[str]) -> int:
    """What a list of text takes in the ledger, as its JSON writes it."""
    return len(json.dumps(items, separators=(",", ":")))


@pytest.mark.parametrize("unit", ["x", "ф", "😀", "\x01", "\n", '"', "\\", 'ab\x7fф"\\'])
def test_a_long_argument_is_cut_as_the_program_name_is_not_left_out(unit: str) -> None:
    # An argument past 4 KiB as written (a prompt in Cyrillic, a config of quotes) was cut
    # by characters, then found too big for the line, and shown as '… 1 more arguments'
    # alone; one of 4096 characters was kept whole, up to 24 KiB of the entry.
    argument = (unit * 9000)[:9000]
    kept = entry_command(["python", "gen.py", "--prompt", argument])
    assert kept[:3] == ["python", "gen.py", "--prompt"]
    assert len(kept) == 4 and kept[3].endswith("…") and argument.startswith(kept[3][:-1])
    assert _written([kept[3]]) - 4 <= MAX_TEXT
    assert _written([argument[: len(kept[3])] + "…"]) - 4 > MAX_TEXT


@pytest.mark.parametrize("unit", ["x", "ф", "😀", "\x01", "\n", '"', "\\", 'ab\x7fф"\\'])
@pytest.mark.parametrize("length", [1, 7, 100, 1000, 3000, 5000])
def test_the_arguments_after_the_first_never_take_more_than_their_budget(
    unit: str, length: int
) -> None:
    # The '… N more arguments' that ends a long line was not counted: the arguments kept
    # before it could take the whole budget, and the entry more than it.
    argv = ["python", "x.py", *((unit * length)[:length] for _ in range(40))]
    kept = entry_command(argv)
    assert _written(kept[1:]) <= MAX_COMMAND_BYTES
    assert all(_written([word]) - 4 <= MAX_TEXT for word in kept)
    if kept != argv:
        assert kept[-1] == f"… {len(argv) - len(kept) + 1} more arguments"
        # Nothing more would have fitted with it.
        assert (
            len(kept) == 2
            or _written([*argv[1 : len(kept)], f"… {len(argv) - len(kept)} more arguments"])
            > MAX_COMMAND_BYTES
        )


def test_the_last_item_of_a_line_cut_at_its_budget_fits_in_it_too() -> None:
    # Two arguments taking the budget to the byte, and one more: its '… 1 more arguments'
    # came after them, 27 bytes past the budget.
    first, second = "a" * MAX_TEXT, "b" * (MAX_COMMAND_BYTES - 7 - MAX_TEXT)
    assert _written([first, second]) == MAX_COMMAND_BYTES
    kept = entry_command(["python", first, second, "c"])
    assert kept == ["python", first, "… 2 more arguments"]
    assert _written(kept[1:]) <= MAX_COMMAND_BYTES
    assert entry_command(["python", first, second]) == ["python", first, second]


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from(["x", "ф", "😀", "\x01", "\n", '"', "\\", "\x7f"])),
    limit=st.integers(min_value=6, max_value=80),
)
def test_an_argument_is_cut_at_its_longest_start_that_fits(text: str, limit: int) -> None:
    # Cut in one pass at each launch (a thousand long arguments from xargs took 146 ms a
    # launch when each was measured again and again): the same cut as the longest start whose
    # written size, with "…", is within the limit.
    cut = _cut_to_written(text, limit)
    if written_size(text) <= limit:
        assert cut == text
    else:
        starts = [text[:n] for n in range(len(text) + 1)]
        longest = max((s for s in starts if written_size(s) + 6 <= limit), key=len)
        assert cut == longest + "…"
