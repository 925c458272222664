"""Sizes and durations as gpuwait says them: a figure rounded up to its unit's next step is said
in the next unit, as it would be a moment later (`1.0s`, not `1000ms`; `1.0 GiB`, not
`1024 MiB`)."""

from __future__ import annotations

import pytest

from gpuwait.core.sizes import format_duration, format_size

MiB, GiB = 2**20, 2**30


@pytest.mark.parametrize(
    ("seconds", "said"),
    [
        (0.9994, "999ms"),
        (0.9996, "1.0s"),
        (1.0, "1.0s"),
        (59.94, "59.9s"),
        (59.96, "1m00s"),
        (60.0, "1m00s"),
        (3599.9, "59m59s"),
    ],
)
def test_a_duration_is_said_in_the_unit_its_rounding_reaches(seconds: float, said: str) -> None:
    assert format_duration(seconds) == said


@pytest.mark.parametrize(
    ("n_bytes", "said"),
    [
        (1023.4 * MiB, "1023 MiB"),
        (1023.6 * MiB, "1.0 GiB"),
        (GiB, "1.0 GiB"),
        (99.94 * GiB, "99.9 GiB"),
        (99.96 * GiB, "100 GiB"),
        (1023.6, "1.0 KiB"),
        (-1023.6 * MiB, "-1.0 GiB"),
    ],
)
def test_a_size_is_said_in_the_unit_its_rounding_reaches(n_bytes: float, said: str) -> None:
    assert format_size(n_bytes) == said
