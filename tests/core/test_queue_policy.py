"""Property and unit tests of the queue: holds, backfill, gangs, strategies, requirements."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwait.core.policy import (
    Claim,
    Conditions,
    Requirements,
    estimate_starts,
    gpu_rooms,
    impossible_reason,
    name_matches,
    plan,
)
from gpuwait.core.sizes import MemoryRequest
from gpuwait.core.snapshot import COMPUTE_EXCLUSIVE_PROCESS, GpuSnapshot, ProcessUsage

GiB = 2**30


def card(index: int, total_gib: int = 24, **kw: object) -> GpuSnapshot:
    return GpuSnapshot(
        index=index,
        uuid=f"GPU-{index:08d}",
        name=str(kw.pop("name", "Test GPU")),
        total_bytes=total_gib * GiB,
        used_bytes=int(kw.pop("used_gib", 0) * GiB),  # type: ignore[operator]
        **kw,  # type: ignore[arg-type]
    )


def uuid(index: int) -> str:
    return f"GPU-{index:08d}"


def waiter(job_id: str, gib: float, order: int, **kw: object) -> Claim:
    return Claim(
        job_id, False, int(kw.pop("priority", 3)), order, MemoryRequest(bytes=int(gib * GiB)), **kw
    )  # type: ignore[arg-type]


def runner(job_id: str, gpus: tuple[int, ...], gib: float, expected: float | None = None) -> Claim:
    return Claim(
        job_id,
        True,
        3,
        0,
        MemoryRequest(bytes=int(gib * GiB)),
        gpus_wanted=len(gpus),
        gpu_uuids=tuple(uuid(i) for i in gpus),
        reserved_bytes=int(gib * GiB),
        expected_seconds=expected,
    )


# --- holds and backfill, by example ----------------------------------------------------------


def test_head_holds_its_gpu_against_later_small_jobs() -> None:
    cards = [card(0), card(1)]
    claims = [
        runner("r0", (0,), 12),
        runner("r1", (1,), 16),
        waiter("big", 16, order=1),
        waiter("small", 4, order=2),
    ]
    decided = plan(cards, claims, 0.9)
    assert decided.hold is not None and decided.hold.job_id == "big"
    # GPU0 is nearer to fitting the big job (9.6 GiB free against 5.6), so it is held...
    assert decided.hold.gpu_uuids == (uuid(0),)
    # ...and the small job, with no run-time estimate, goes to GPU1 instead.
    assert decided.admitted["small"] == (uuid(1),)
    assert "first in line" in (decided.waiting["big"].note or "")


def test_a_head_waiting_on_overdue_jobs_says_overdue_not_0ms() -> None:
    # The running job is past its expected run time: what is left of it reads 0.
    claims = [runner("r0", (0,), 16, expected=0.0), waiter("big", 16, order=1)]
    decided = plan([card(0)], claims, 0.9)
    note = decided.waiting["big"].note or ""
    assert note.endswith("expected overdue") and "0ms" not in note
    # With time left, the wait says when.
    claims[0] = runner("r0", (0,), 16, expected=125.0)
    assert "expected in 2m05s" in (plan([card(0)], claims, 0.9).waiting["big"].note or "")


def test_without_estimates_nothing_backfills_onto_a_held_gpu() -> None:
    cards = [card(0)]
    claims = [runner("r0", (0,), 12), waiter("big", 16, order=1), waiter("small", 4, order=2)]
    decided = plan(cards, claims, 0.9)
    assert decided.admitted == {}
    note = decided.waiting["small"].note or ""
    assert note == "GPU0 held for job big, whose start cannot be estimated"


def test_backfill_only_where_it_cannot_delay_the_heads_start() -> None:
    cards = [card(0)]
    # r0 ends in 100 s; then the head takes 16 of the 21.6 GiB usable, leaving 5.6 spare.
    base = [runner("r0", (0,), 12, expected=100), waiter("big", 16, order=1)]
    short = plan(cards, [*base, waiter("short", 6, order=2, expected_seconds=60)], 0.9)
    assert short.hold is not None and short.hold.start_in == 100
    assert short.admitted["short"] == (uuid(0),) and short.backfill["short"] == (uuid(0),)
    long = plan(cards, [*base, waiter("long", 6, order=2, expected_seconds=150)], 0.9)
    assert "long" not in long.admitted
    assert "would not end before" in (long.waiting["long"].note or "")
    # A long job that fits in the spare never stands in the head's way, but only one fits.
    spare = [waiter(f"s{n}", 4, order=2 + n, expected_seconds=150) for n in range(2)]
    decided = plan(cards, [*base, *spare], 0.9)
    assert set(decided.admitted) == {"s0"}
    # Two that fill the spare between them, to the byte, both start.
    rest = int(24 * GiB * 0.9) - 16 * GiB - 2 * GiB
    second = waiter("s1", 1, order=3, expected_seconds=150)._replace(
        request=MemoryRequest(bytes=rest)
    )
    decided = plan(
        cards, [*base, spare[0]._replace(request=MemoryRequest(bytes=2 * GiB)), second], 0.9
    )
    assert set(decided.admitted) == {"s0", "s1"}


def test_job_with_no_history_is_not_backfilled_into_the_heads_spare() -> None:
    cards = [card(0)]
    # The head's start is known (r0 ends in 100 s) and 4 GiB would fit in the 5.6 GiB it leaves
    # spare, but a job with no run-time history is never started ahead of a held head.
    base = [runner("r0", (0,), 12, expected=100), waiter("big", 16, order=1)]
    decided = plan(cards, [*base, waiter("unknown", 4, order=2)], 0.9)
    assert decided.admitted == {}
    assert "no run-time estimate" in (decided.waiting["unknown"].note or "")


def test_hold_sticks_to_its_gpus_until_others_are_sooner() -> None:
    cards = [card(0), card(1)]
    running = [runner("r0", (0,), 12), runner("r1", (1,), 10)]
    head = waiter("big", 16, order=1)
    # Unheld, GPU1 (11.6 GiB free) would be chosen; held on GPU0, the hold stays there.
    assert plan(cards, [*running, head], 0.9).hold.gpu_uuids == (uuid(1),)  # type: ignore[union-attr]
    sticky = plan(cards, [*running, head._replace(held=(uuid(0),))], 0.9)
    assert sticky.hold is not None and sticky.hold.gpu_uuids == (uuid(0),)
    # A known, sooner start elsewhere moves it.
    timed = [runner("r0", (0,), 12), runner("r1", (1,), 10, expected=30)]
    moved = plan(cards, [*timed, head._replace(held=(uuid(0),))], 0.9)
    assert moved.hold is not None and moved.hold.gpu_uuids == (uuid(1),)
    assert moved.hold.start_in == 30


def test_gang_head_holds_all_its_gpus() -> None:
    cards = [card(0), card(1), card(2)]
    claims = [
        runner("r0", (0,), 12),
        runner("r1", (1,), 12),
        runner("r2", (2,), 20),
        waiter("gang", 16, order=1, gpus_wanted=2),
        waiter("small", 2, order=2),
    ]
    decided = plan(cards, claims, 0.9)
    assert decided.hold is not None and decided.hold.gpu_uuids == (uuid(0), uuid(1))
    assert "gang" not in decided.admitted and "small" not in decided.admitted
    assert "GPU0,GPU1 held" in (decided.waiting["gang"].note or "")


def test_a_gang_hold_moves_where_the_gang_starts_sooner_than_on_its_slowest_held_card() -> None:
    # A gang of two held GPU0 (free in 10 s) and GPU1 (in 100 s): it could start on GPU0 and
    # GPU2 in 30 s, sooner than the 100 s its hold waits for, so the hold moves there.
    cards = [card(i) for i in range(4)]
    ends = (10, 100, 30, 30)
    running = [runner(f"r{i}", (i,), 12, end) for i, end in enumerate(ends)]
    gang = waiter("gang", 16, order=1, gpus_wanted=2, held=(uuid(0), uuid(1)))
    decided = plan(cards, [*running, gang], 0.9)
    assert decided.hold is not None and decided.hold.gpu_uuids == (uuid(0), uuid(2))
    assert decided.hold.start_in == 30


def test_a_whole_gpu_head_holds_the_card_whose_jobs_all_end_first() -> None:
    # GPU0's one job ends in 100 s; of GPU1's two, one ends in 10 s and the other in 200 s.
    # A whole-GPU job can start on GPU0 in 100 s and on GPU1 only in 200 s: it holds GPU0,
    # and a long job behind it goes to GPU1, where it delays nobody.
    cards = [card(0), card(1)]
    running = [runner("r0", (0,), 4, 100), runner("r1", (1,), 4, 10), runner("r2", (1,), 4, 200)]
    whole = Claim("whole", False, 3, 1, None)
    decided = plan(cards, [*running, whole, waiter("long", 2, order=2, expected_seconds=500)], 0.9)
    assert decided.hold is not None and decided.hold.gpu_uuids == (uuid(0),)
    assert decided.hold.start_in == 100
    assert decided.admitted == {"long": (uuid(1),)}


def test_a_head_holds_a_one_process_card_until_its_job_ends() -> None:
    # A card in exclusive-process compute mode runs one process at a time: a head that fits
    # there holds it for when its one job ends, in 30 s, whatever memory is free beside it.
    cards = [card(0, compute_mode=COMPUTE_EXCLUSIVE_PROCESS)]
    decided = plan(cards, [runner("r0", (0,), 4, 30), waiter("next", 4, order=1)], 0.9)
    assert decided.hold is not None and decided.hold.gpu_uuids == (uuid(0),)
    assert decided.hold.start_in == 30


def test_blocked_waiter_is_not_the_head() -> None:
    cards = [card(0)]
    claims = [
        runner("r0", (0,), 12),
        waiter("dep", 16, order=1, blocked="waiting for job x to finish"),
        waiter("small", 4, order=2),
    ]
    decided = plan(cards, claims, 0.9)
    assert decided.hold is None and "small" in decided.admitted
    assert decided.waiting["dep"].describe().startswith("waiting for job x to finish")


def test_head_that_external_load_keeps_out_holds_nothing() -> None:
    # 14 GiB used outside gpuwait: 16 GiB can never fit there until that load goes.
    cards = [card(0, used_gib=14)]
    decided = plan(cards, [waiter("big", 16, order=1), waiter("small", 4, order=2)], 0.9)
    assert decided.hold is None and "small" in decided.admitted


def test_estimated_starts_replay_the_queue() -> None:
    cards = [card(0)]
    claims = [
        runner("r0", (0,), 8, expected=10),
        waiter("a", 8, order=1, expected_seconds=20),
        waiter("b", 8, order=2, expected_seconds=5),
        waiter("c", 20, order=3, expected_seconds=5),
    ]
    # Two 8 GiB jobs fit at once: a starts beside r0, b once r0 ends; c needs the card alone,
    # once a (the later to end) is gone.
    assert estimate_starts(cards, claims, 0.9) == {"a": 0.0, "b": 10.0, "c": 20.0}
    unknown = [runner("r0", (0,), 8), waiter("a", 8, order=1)]
    assert estimate_starts(cards, unknown, 0.9) == {"a": 0.0}
    assert estimate_starts(cards, [*unknown, waiter("b", 20, order=2)], 0.9)["b"] is None


# --- strategies --------------------------------------------------------------------------------


def test_least_loaded_counts_jobs_and_foreign_processes_but_not_ignored_ones() -> None:
    cards = [
        card(0, processes=(ProcessUsage(50, GiB, "python"),), used_gib=1),
        card(1, processes=(ProcessUsage(60, GiB, "Xorg"),), used_gib=1),
        card(2),
    ]
    claims = [runner("r2", (2,), 1), waiter("x", 1, order=1, pick="least-loaded")]
    desktop = Conditions(ignore_processes=frozenset({"Xorg"}))
    assert plan(cards, claims, 0.9, conditions=desktop).admitted["x"] == (uuid(1),)
    # Without the ignore list, each card has one process: the most free room decides.
    assert plan(cards, claims, 0.9).admitted["x"] == (uuid(0),)


def test_weighted_spreads_jobs_in_proportion_to_weights() -> None:
    cards = [card(0, 80), card(1, 80)]
    weights = {uuid(0): 3.0, uuid(1): 1.0}
    claims: list[Claim] = []
    placed: list[str] = []
    for n in range(8):
        claim = waiter(f"j{n}", 1, order=n + 1, pick="weighted", weights=weights)
        gpus = plan(cards, [*claims, claim], 0.9).admitted[claim.job_id]
        placed.append(gpus[0])
        claims.append(claim._replace(running=True, gpu_uuids=gpus, reserved_bytes=GiB))
    assert placed.count(uuid(0)) == 6 and placed.count(uuid(1)) == 2


def test_adaptive_throughput_prefers_the_fastest_gpu_of_the_history() -> None:
    cards = [card(0), card(1, used_gib=10)]
    fast_on_0 = {uuid(0): 30.0, uuid(1): 90.0}
    claim = waiter("x", 4, order=1, pick="adaptive-throughput", expected_by_gpu=fast_on_0)
    assert plan(cards, [claim], 0.9).admitted["x"] == (uuid(0),)
    # No history: best-fit, the card left with the least room.
    assert plan(cards, [claim._replace(expected_by_gpu={})], 0.9).admitted["x"] == (uuid(1),)


# --- requirements and the ignore list ------------------------------------------------------------


def test_capability_requirements_filter_gpus() -> None:
    cards = [
        card(0, 24, name="NVIDIA GeForce RTX 3090", compute_capability=(8, 6)),
        card(1, 80, name="NVIDIA A100-SXM4-80GB", compute_capability=(8, 0)),
        card(2, 16, name="Tesla V100-PCIE-16GB", compute_capability=(7, 0)),
        card(3, 48, name="Mystery", compute_capability=None),
    ]

    def where(**req: object) -> tuple[str, ...] | None:
        claim = waiter("x", 1, order=1, requirements=Requirements(**req))  # type: ignore[arg-type]
        return plan(cards, [claim], 0.9).admitted.get("x")

    assert where(name_pattern="a100") == (uuid(1),)
    assert where(min_total_bytes=40 * GiB, min_compute_capability=(8, 0)) == (uuid(1),)
    assert where(min_compute_capability=(8, 6)) == (uuid(0),)
    assert where(name_pattern="*V100*") == (uuid(2),)
    assert where(name_pattern="H100") is None
    impossible = waiter("x", 1, order=1, requirements=Requirements(name_pattern="H100"))
    assert "no GPU has a name matching 'H100'" in (impossible_reason(impossible, cards, 0.9) or "")


def test_name_patterns() -> None:
    assert name_matches("A100", "NVIDIA A100-SXM4-80GB")
    assert name_matches("*a100*80gb", "NVIDIA A100-SXM4-80GB")
    assert not name_matches("A100*", "NVIDIA A100-SXM4-80GB")


def test_utilization_cap_needs_measured_readings_under_it() -> None:
    cards = [card(0), card(1)]
    capped = waiter("x", 1, order=1, requirements=Requirements(max_util_pct=50))
    busy_0 = Conditions(utilization={uuid(0): 80.0, uuid(1): 20.0})
    assert plan(cards, [capped], 0.9, conditions=busy_0).admitted["x"] == (uuid(1),)
    unmeasured = Conditions(utilization={uuid(0): 80.0})
    decided = plan(cards, [capped], 0.9, conditions=unmeasured)
    assert decided.admitted == {}
    unsupported = Conditions(utilization={uuid(0): 80.0, uuid(1): None})
    assert plan(cards, [capped], 0.9, conditions=unsupported).admitted["x"] == (uuid(1),)
    all_busy = Conditions(utilization={uuid(0): 80.0, uuid(1): 90.0})
    reason = plan(cards, [capped], 0.9, conditions=all_busy).waiting["x"]
    assert "busier than 50% utilization" in reason.describe()


def test_utilization_cap_says_it_is_still_measuring_rather_than_busy() -> None:
    cards = [card(0), card(1)]
    capped = waiter("x", 1, order=1, requirements=Requirements(max_util_pct=50))
    # GPU1 has too few readings yet: it is not known to be busy, and the reason must not say so.
    unmeasured = Conditions(utilization={uuid(0): 80.0})
    reason = plan(cards, [capped], 0.9, conditions=unmeasured).waiting["x"].describe()
    assert "busier" not in reason
    assert "measuring utilization" in reason


def test_ignored_processes_do_not_stop_an_exclusive_job() -> None:
    desktop = ProcessUsage(77, 2 * GiB, "gnome-shell")
    cards = [card(0, used_gib=2, processes=(desktop,))]
    whole = Claim("w", False, 3, 1, None)
    assert plan(cards, [whole], 0.9).admitted == {}
    ignoring = Conditions(ignore_processes=frozenset({"gnome-shell"}))
    assert plan(cards, [whole], 0.9, conditions=ignoring).admitted["w"] == (uuid(0),)
    # Its memory is still really used: the room shrinks by it either way.
    assert gpu_rooms(cards, [], 0.9, ignoring.ignore_processes)[uuid(0)].external == 2 * GiB


def test_exclusive_waiter_says_why_the_free_memory_it_sees_is_not_enough() -> None:
    # 21.6 GiB free, but 2 GiB used by another process: a whole GPU allows at most 5 %.
    other = ProcessUsage(77, 2 * GiB, "python")
    cards = [card(0, used_gib=2, processes=(other,))]
    whole = Claim("w", False, 3, 1, None)
    reason = plan(cards, [whole], 0.9).waiting["w"].describe()
    assert "5% of its memory used outside gpuwait" in reason
    # Busy with a gpuwait job instead: the same condition is what it waits for.
    busy = plan([card(0)], [runner("r0", (0,), 1), whole], 0.9).waiting["w"].describe()
    assert "no other gpuwait job" in busy


# --- properties ---------------------------------------------------------------------------------

run_times = st.integers(1, 50).map(float)


@st.composite
def queues(draw: st.DrawFn, known_times: bool) -> tuple[list[GpuSnapshot], list[Claim]]:
    """A machine with running jobs and a queue; run times all known, or all unknown."""
    n_gpus = draw(st.integers(1, 4))
    cards = [card(i, draw(st.sampled_from([16, 24, 40]))) for i in range(n_gpus)]
    claims: list[Claim] = []
    for i, gpu in enumerate(cards):
        free = gpu.total_bytes * 0.9
        for r in range(draw(st.integers(0, 3))):
            size = draw(st.integers(1, 12)) * GiB
            if size > free:
                break
            free -= size
            expected = draw(run_times) if known_times else None
            claims.append(runner(f"r{i}{r}", (i,), size / GiB, expected=expected))
    for w in range(draw(st.integers(1, 10))):
        wanted = draw(st.integers(1, min(2, n_gpus)))
        size = draw(st.integers(1, 14))
        claim = waiter(
            f"w{w}",
            size,
            order=w + 1,
            priority=draw(st.integers(1, 5)),
            gpus_wanted=wanted,
            pick=draw(st.sampled_from(["best-fit", "most-free", "least-loaded"])),
            expected_seconds=draw(run_times) if known_times else None,
        )
        if impossible_reason(claim, cards, 0.9) is None:
            claims.append(claim)
    return cards, claims


def _upto_head(claims: list[Claim], head: str) -> list[Claim]:
    key = next(c for c in claims if c.job_id == head).sort_key()
    return [c for c in claims if c.running or c.sort_key() <= key]


@settings(max_examples=300, deadline=None)
@given(queues(known_times=True))
def test_backfill_never_delays_the_heads_start(
    machine: tuple[list[GpuSnapshot], list[Claim]],
) -> None:
    """With the run times given, the head starts no later for all the jobs behind it."""
    cards, claims = machine
    first = plan(cards, claims, 0.9)
    if first.hold is None:
        return
    head = first.hold.job_id
    alone = estimate_starts(cards, _upto_head(claims, head), 0.9)[head]
    with_all = estimate_starts(cards, claims, 0.9)[head]
    assert alone is not None and first.hold.start_in is not None
    assert alone <= first.hold.start_in
    assert with_all is not None and with_all <= alone


@settings(max_examples=300, deadline=None)
@given(queues(known_times=False), st.data())
def test_head_is_admitted_once_the_jobs_on_its_gpus_have_ended(
    machine: tuple[list[GpuSnapshot], list[Claim]], data: st.DataObject
) -> None:
    """No starvation: small jobs keep arriving and ending in any order, yet the head starts as
    soon as the jobs that ran on its held GPUs when it became the head have all ended."""
    cards, claims = machine
    decided = plan(cards, claims, 0.9)
    if decided.hold is None:
        return
    head = decided.hold.job_id
    held = set(decided.hold.gpu_uuids)
    # What ran there when it became the head: running jobs, and those admitted ahead of it.
    blocking = {c.job_id for c in claims if c.running and held & set(c.gpu_uuids)}
    blocking |= {j for j, gpus in decided.admitted.items() if held & set(gpus)}
    order = max(c.order for c in claims) + 1
    # Newcomers come behind the head: same priority, later submission.
    head_priority = next(c.priority for c in claims if c.job_id == head)
    for _ in range(60):
        # Apply the plan: admitted jobs run, the hold is remembered.
        claims = [
            c._replace(
                running=True,
                gpu_uuids=decided.admitted[c.job_id],
                reserved_bytes=decided.reserved[c.job_id],
            )
            if c.job_id in decided.admitted
            else c._replace(held=decided.hold.gpu_uuids)
            if decided.hold and c.job_id == decided.hold.job_id
            else c
            for c in claims
        ]
        if head in decided.admitted:
            return
        assert blocking, "the head should have started once its GPUs were cleared"
        running = sorted(c.job_id for c in claims if c.running)
        ended = data.draw(st.sampled_from(running))
        blocking.discard(ended)
        claims = [c for c in claims if c.job_id != ended]
        for _ in range(data.draw(st.integers(0, 2))):
            small = data.draw(st.integers(1, 4))
            claims.append(waiter(f"n{order}", small, order=order, priority=head_priority))
            order += 1
        decided = plan(cards, claims, 0.9)
        if head not in decided.admitted:
            assert (
                decided.hold is not None
                and decided.hold.job_id == head
                and set(decided.hold.gpu_uuids) == held
            )
            # Nothing behind it lands on a held GPU (without estimates there is no backfill).
            for job_id, gpus in decided.admitted.items():
                assert not held & set(gpus), job_id
    raise AssertionError("no decision within 60 releases")


@settings(max_examples=300, deadline=None)
@given(queues(known_times=True))
def test_gangs_are_all_or_nothing_and_holds_cover_the_whole_gang(
    machine: tuple[list[GpuSnapshot], list[Claim]],
) -> None:
    cards, claims = machine
    decided = plan(cards, claims, 0.9)
    by_id = {c.job_id: c for c in claims}
    for job_id, gpus in decided.admitted.items():
        assert len(set(gpus)) == by_id[job_id].gpus_wanted
        assert list(gpus) == sorted(gpus, key=lambda u: int(u[4:]))
    if decided.hold is not None:
        assert len(set(decided.hold.gpu_uuids)) == by_id[decided.hold.job_id].gpus_wanted
        # Without the head (cancelled), nothing refers to it any more.
        rest = [c for c in claims if c.job_id != decided.hold.job_id]
        again = plan(cards, rest, 0.9)
        assert again.hold is None or again.hold.job_id != decided.hold.job_id


@settings(max_examples=300, deadline=None)
@given(queues(known_times=True))
def test_plans_with_holds_never_overfill(machine: tuple[list[GpuSnapshot], list[Claim]]) -> None:
    cards, claims = machine
    decided = plan(cards, claims, 0.9)
    rooms = gpu_rooms(cards, claims, 0.9)
    for gpu_id, room in rooms.items():
        added = sum(decided.reserved[j] for j, gpus in decided.admitted.items() if gpu_id in gpus)
        assert room.external + room.committed + added <= room.usable
