"""What an entry keeps of a command line, measured as the ledger's JSON writes it."""

from __future__ import annotations

import json

import pytest

from gpuwait.core.text import MAX_TEXT, MAX_TEXTS, entry_command, written_size

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
