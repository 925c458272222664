"""Sizes as users type them: a share of a card is written as a size's number is."""

from __future__ import annotations

import pytest

from gpuwait.core.sizes import MemoryRequest, parse_request

GiB = 2**30


@pytest.mark.parametrize(
    ("typed", "wanted"),
    [
        (".5G", MemoryRequest(bytes=GiB // 2)),
        (".5%", MemoryRequest(fraction=0.005)),
        (" .5 % ", MemoryRequest(fraction=0.005)),
        ("50%", MemoryRequest(fraction=0.5)),
    ],
)
def test_a_number_without_a_leading_zero_is_taken_in_a_share_as_in_a_size(
    typed: str, wanted: MemoryRequest
) -> None:
    assert parse_request(typed) == wanted


def test_a_negative_share_without_a_leading_zero_is_told_negative() -> None:
    with pytest.raises(ValueError, match="is negative; give a share above zero"):
        parse_request("-.5%")


def test_seconds_after_minutes_are_read_as_a_clock_reads_them() -> None:
    from gpuwait.core.sizes import parse_duration

    assert parse_duration("2m30") == parse_duration("2m 30") == 150.0
    assert parse_duration("1h2m30") == 3750.0
