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
