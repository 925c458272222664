"""`--prefer`: preferred GPUs first where the job fits, the others only where none does."""

from __future__ import annotations

import pytest

from gpuwait.core.policy import Claim, plan
from gpuwait.core.sizes import MemoryRequest
from gpuwait.core.snapshot import GpuSnapshot

GiB = 2**30


def gpu(index: int, used_gib: float = 0.0) -> GpuSnapshot:
    return GpuSnapshot(
        index=index,
        uuid=f"GPU-{index:08d}",
        name="Test",
        total_bytes=24 * GiB,
        used_bytes=int(used_gib * GiB),
    )


def uuid(index: int) -> str:
    return f"GPU-{index:08d}"


def waiter(gib: float, prefer: tuple[int, ...] = (), **kw: object) -> Claim:
    return Claim(
        "x",
        False,
        3,
        1,
        MemoryRequest(bytes=int(gib * GiB)),
        prefer=frozenset(uuid(i) for i in prefer),
        **kw,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    "pick", ["best-fit", "most-free", "round-robin", "least-loaded", "weighted"]
)
def test_a_preferred_gpu_that_fits_is_taken_whatever_the_strategy_would_pick(pick: str) -> None:
    # Without a preference best-fit takes the fullest card (0), most-free the emptiest (3).
    cards = [gpu(0, used_gib=12), gpu(1, used_gib=6), gpu(2, used_gib=3), gpu(3)]
    assert plan(cards, [waiter(4, (1,), pick=pick)], 0.9).admitted["x"] == (uuid(1),)


def test_the_strategy_chooses_among_the_preferred_gpus() -> None:
    cards = [gpu(0), gpu(1, used_gib=10), gpu(2, used_gib=5), gpu(3, used_gib=15)]
    best = plan(cards, [waiter(4, (1, 2))], 0.9).admitted["x"]
    most = plan(cards, [waiter(4, (1, 2), pick="most-free")], 0.9).admitted["x"]
    assert (best, most) == ((uuid(1),), (uuid(2),))


def test_spills_over_to_another_gpu_when_no_preferred_one_fits() -> None:
    cards = [gpu(0), gpu(1, used_gib=20), gpu(2, used_gib=3)]
    decided = plan(cards, [waiter(8, (1,))], 0.9)
    # Started at once elsewhere, not kept waiting for the preferred card.
    assert decided.admitted["x"] == (uuid(2),)


def test_a_gang_takes_every_preferred_gpu_that_fits_then_fills_up_with_others() -> None:
    cards = [gpu(0), gpu(1), gpu(2, used_gib=20), gpu(3, used_gib=2)]
    decided = plan(cards, [waiter(8, (1, 2), gpus_wanted=2)], 0.9)
    assert decided.admitted["x"] == (uuid(1), uuid(3))


def test_no_preference_keeps_the_strategy_order() -> None:
    cards = [gpu(0, used_gib=12), gpu(1)]
    assert plan(cards, [waiter(4)], 0.9).admitted["x"] == (uuid(0),)
