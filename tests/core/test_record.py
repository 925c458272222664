"""Records: what the ledger, the policy and the snapshots rely on from gpuwait.core.record."""

from __future__ import annotations

import pytest

from gpuwait.core.record import Record, field


class Entry(Record):
    name: str
    tags: list[str] = field(default_factory=list)
    size: int = 0


class Point(Record, frozen=True):
    x: int
    y: int = 0


def test_fields_take_positions_keywords_and_fresh_defaults() -> None:
    first, second = Entry("a"), Entry("b", size=3)
    first.tags.append("x")
    assert second.tags == [] and second.size == 3
    assert Entry("a", ["x"], 0) == first
    assert repr(first) == "Entry(name='a', tags=['x'], size=0)"


def test_wrong_construction_is_refused() -> None:
    with pytest.raises(TypeError, match="missing field 'name'"):
        Entry()  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="unexpected or repeated field 'colour'"):
        Entry("a", colour="red")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="at most 3"):
        Entry("a", [], 1, 2)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="follows one with"):

        class Bad(Record):
            first: int = 0
            second: int  # type: ignore[misc]


def test_mutable_records_compare_by_value_and_are_not_hashable() -> None:
    entry = Entry("a")
    entry.size = 5
    assert entry == Entry("a", size=5) and entry != Entry("a")
    with pytest.raises(TypeError):
        hash(entry)


def test_frozen_records_refuse_changes_hash_by_value_and_copy_with_changes() -> None:
    point = Point(1)
    with pytest.raises(AttributeError, match="frozen"):
        point.x = 2  # type: ignore[misc]
    assert {point, Point(1, 0)} == {point}
    moved = point._replace(y=4)
    assert (moved.x, moved.y, point.y) == (1, 4, 0)
    with pytest.raises(TypeError, match="no field 'z'"):
        point._replace(z=1)
