"""The lines `gpuwait -v` says where a job's size came from, each fitting 80 columns."""

from __future__ import annotations

import pytest

from gpuwait.core.text import columns
from gpuwait.runner.session import _phrase_lines

#: What every such line begins with: "gpuwait: job <its 8-digit id>: ".
LEAD = "gpuwait: job 0a1b2c3d: "


@pytest.mark.parametrize(
    "note",
    [
        "largest peak of 100 runs of this script (other arguments)",
        "largest peak of 100 runs of this script (other arguments), raised after an "
        "out-of-memory failure, some measured approximately",
        "estimated from 3 runs of this exact command",
    ],
)
def test_each_line_saying_where_a_size_came_from_fits_80_columns(note: str) -> None:
    # "largest peak of 100 runs of this script (other arguments)," was a phrase too long to
    # share a line and was said whole after the job's id: 81 columns, the last on a second row
    # of an 80-column terminal.
    lines = _phrase_lines(note, columns(LEAD))
    assert all(columns(LEAD + line) < 80 for line in lines), lines
    assert " ".join(lines) == note
    assert all(line.count("(") == line.count(")") for line in lines), lines


@pytest.mark.parametrize(
    ("note", "lines"),
    [
        ("", []),
        ("estimated from 3 runs of this exact command", None),
        (
            "largest peak of 9 runs of this script (other arguments), raised after an "
            "out-of-memory failure",
            [
                "largest peak of 9 runs of this script (other arguments),",
                "raised after an out-of-memory failure",
            ],
        ),
        (
            "largest peak of 12 runs of this script (other arguments); raised after an "
            "out-of-memory failure",
            [
                "largest peak of 12 runs of this script",
                "(other arguments); raised after an out-of-memory failure",
            ],
        ),
        (
            "estimated from 3 runs of this exact command; raised after a failure",
            ["estimated from 3 runs of this exact command;", "raised after a failure"],
        ),
    ],
    ids=["no note", "one line", "79 columns of words", "79 columns of phrases", "semicolon"],
)
def test_where_a_size_came_from_takes_as_few_lines_as_fit_79_columns(
    note: str, lines: list[str] | None
) -> None:
    # A size given with --vram has no line saying where it came from (not an empty "gpuwait:
    # job 0a1b2c3d: "); a note that fits is one line; a line is filled up to 79 columns,
    # words or phrases, and a new one begins after a comma or a semicolon.
    assert _phrase_lines(note, columns(LEAD)) == ([note] if lines is None else lines)
