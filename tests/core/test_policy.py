"""Property tests of the pure scheduling policy."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwait.core.policy import (
    Claim,
    Conditions,
    FairShare,
    Requirements,
    admission_fits,
    estimate_starts,
    gpu_rooms,
    impossible_reason,
    plan,
    unlisted_of_strangers,
    wait_reason,
)
from gpuwait.core.sizes import MemoryRequest
from gpuwait.core.snapshot import (
    COMPUTE_EXCLUSIVE_PROCESS,
    COMPUTE_PROHIBITED,
    GpuSnapshot,
    ProcessUsage,
)

GiB = 2**30


def gpu(
    index: int, total_gib: float, used_gib: float = 0.0, procs: tuple[ProcessUsage, ...] = ()
) -> GpuSnapshot:
    return GpuSnapshot(
        index=index,
        uuid=f"GPU-{index:08d}",
        name="Test",
        total_bytes=int(total_gib * GiB),
        used_bytes=int(used_gib * GiB),
        processes=procs,
    )


def waiting(job_id: str, gib: float, order: int, priority: int = 3, **kw: object) -> Claim:
    return Claim(job_id, False, priority, order, MemoryRequest(bytes=int(gib * GiB)), **kw)  # type: ignore[arg-type]


def running(job_id: str, uuid: str, reserved_gib: float, observed_gib: float = 0.0) -> Claim:
    return Claim(
        job_id,
        True,
        3,
        0,
        MemoryRequest(bytes=int(reserved_gib * GiB)),
        gpu_uuids=(uuid,),
        reserved_bytes=int(reserved_gib * GiB),
        observed={uuid: int(observed_gib * GiB)},
    )


def test_reservation_holds_room_before_the_job_allocates() -> None:
    # A job admitted a moment ago has not allocated yet: NVML shows the card empty, but its
    # reservation must still keep the next job out. This is the race free-memory pollers lose.
    cards = [gpu(0, 24)]
    claims = [running("a", "GPU-00000000", 16), waiting("b", 16, order=2)]
    assert "b" not in plan(cards, claims, 0.9).admitted


def test_job_grown_past_its_reservation_counts_at_real_size() -> None:
    cards = [gpu(0, 24, used_gib=12, procs=(ProcessUsage(10, 12 * GiB),))]
    claims = [running("a", "GPU-00000000", 4, observed_gib=12), waiting("b", 10, order=2)]
    room = gpu_rooms(cards, claims, 0.9)["GPU-00000000"]
    assert room.external == 0
    assert room.committed == 12 * GiB
    assert "b" not in plan(cards, claims, 0.9).admitted
    assert "c" in plan(cards, [*claims[:1], waiting("c", 9, order=3)], 0.9).admitted


def test_a_jobs_memory_listed_without_a_figure_is_counted_once() -> None:
    # NVML lists the job's process with no figure (N/A): its 10 GiB is its reservation's, not
    # someone else's besides it; what it uses past its reservation counts as taken all the same.
    def card(used_gib: float, *procs: ProcessUsage) -> list[GpuSnapshot]:
        return [gpu(0, 24, used_gib=used_gib, procs=procs)]

    a = running("a", "GPU-00000000", 10)._replace(
        pids=frozenset({10}), unlisted_at_start={"GPU-00000000": 0}
    )
    mine = ProcessUsage(10, None)
    assert gpu_rooms(card(10, mine), [a], 0.9)["GPU-00000000"].external == 0
    assert gpu_rooms(card(13, mine), [a], 0.9)["GPU-00000000"].external == 3 * GiB
    assert "b" in plan(card(10, mine), [a, waiting("b", 8, order=2)], 0.9).admitted
    # Someone else's process is listed without a figure too: whose the memory is cannot be
    # told, and all of it stays taken.
    stranger = ProcessUsage(20, None)
    assert gpu_rooms(card(14, mine, stranger), [a], 0.9)["GPU-00000000"].external == 14 * GiB
    # A process of someone else's with a figure is theirs; the rest is the job's.
    known = ProcessUsage(20, 4 * GiB)
    assert gpu_rooms(card(14, mine, known), [a], 0.9)["GPU-00000000"].external == 4 * GiB


def test_memory_unlisted_before_a_job_without_a_figure_stays_someone_elses() -> None:
    # 8 GiB in use that the driver lists no process for (a Windows program under WSL) when
    # job A (10 GiB, listed with no figure) was admitted: A has taken 1 GiB so far, and the
    # stranger's 8 GiB stay taken; A's growth is A's, up to its reservation.
    def card(used_gib: float) -> list[GpuSnapshot]:
        return [gpu(0, 24, used_gib=used_gib, procs=(ProcessUsage(10, None),))]

    a = running("a", "GPU-00000000", 10)._replace(
        pids=frozenset({10}), unlisted_at_start={"GPU-00000000": 8 * GiB}
    )
    assert gpu_rooms(card(9), [a], 0.9)["GPU-00000000"].external == 8 * GiB
    assert "b" not in plan(card(9), [a, waiting("b", 8, order=2)], 0.9).admitted
    assert gpu_rooms(card(18), [a], 0.9)["GPU-00000000"].external == 8 * GiB
    assert gpu_rooms(card(20), [a], 0.9)["GPU-00000000"].external == 10 * GiB
    # Admitted by a version that did not write down what was unlisted: all of it is taken.
    older = a._replace(unlisted_at_start={})
    assert gpu_rooms(card(10), [older], 0.9)["GPU-00000000"].external == 10 * GiB


def test_a_job_listed_partly_without_a_figure_is_counted_at_all_it_uses() -> None:
    # Job A reserved 10 GiB; one of its processes is listed at 6 GiB, another with no figure
    # holds 8 more: A uses 14 GiB, 4 past its reservation, and all 14 stay taken.
    cards = [gpu(0, 24, used_gib=14, procs=(ProcessUsage(10, 6 * GiB), ProcessUsage(11, None)))]
    a = running("a", "GPU-00000000", 10, observed_gib=6)._replace(
        pids=frozenset({10, 11}), unlisted_at_start={"GPU-00000000": 0}
    )
    room = gpu_rooms(cards, [a], 0.9)["GPU-00000000"]
    assert room.committed + room.external == 14 * GiB
    assert "b" not in plan(cards, [a, waiting("b", 8, order=2)], 0.9).admitted


def test_memory_of_a_job_not_running_is_a_strangers_to_a_job_admitted_now() -> None:
    # Job P is paused on GPU0 and its process, listed with no figure, still holds 6 GiB: a job
    # admitted now finds those 6 GiB there, never its own, so they stay taken as it ramps up.
    cards = [gpu(0, 24, used_gib=6, procs=(ProcessUsage(10, None),))]
    paused = running("p", "GPU-00000000", 10)._replace(
        running=False, pids=frozenset({10}), unlisted_at_start={"GPU-00000000": 0}
    )
    assert unlisted_of_strangers(cards[0], [paused]) == 6 * GiB


def test_memory_unlisted_since_the_first_of_two_jobs_without_figures_stays_taken() -> None:
    # A (10 GiB) was admitted onto an empty card; then a program the driver lists no process
    # for took 4 GiB; then B (10 GiB) was admitted, finding those 4 GiB. A and B, both listed
    # with no figure, have taken 5 and 3 GiB so far. The stranger's 4 GiB are no job's: once
    # A and B reach their reservations the card holds 24 GiB, and C (1.5 GiB) has no room.
    cards = [gpu(0, 24, used_gib=12, procs=(ProcessUsage(10, None), ProcessUsage(11, None)))]
    a = running("a", "GPU-00000000", 10)._replace(
        pids=frozenset({10}), unlisted_at_start={"GPU-00000000": 0}
    )
    b = running("b", "GPU-00000000", 10)._replace(
        pids=frozenset({11}), unlisted_at_start={"GPU-00000000": 4 * GiB}
    )
    assert gpu_rooms(cards, [a, b], 0.9)["GPU-00000000"].external == 4 * GiB
    assert "c" not in plan(cards, [a, b, waiting("c", 1.5, order=3)], 0.9).admitted


def test_external_processes_reduce_room() -> None:
    cards = [gpu(0, 24, used_gib=15)]
    assert "b" not in plan(cards, [waiting("b", 8, order=1)], 0.9).admitted
    assert "c" in plan(cards, [waiting("c", 6, order=1)], 0.9).admitted


def test_later_waiter_does_not_jump_an_earlier_one_on_the_same_gpu() -> None:
    cards = [gpu(0, 24)]
    claims = [waiting("late", 12, order=5), waiting("early", 12, order=1)]
    decided = plan(cards, claims, 0.9)
    assert set(decided.admitted) == {"early"}
    assert "late" in decided.waiting


def test_priority_goes_before_submission_order() -> None:
    cards = [gpu(0, 24)]
    claims = [waiting("normal", 12, order=1), waiting("urgent", 12, order=9, priority=5)]
    assert set(plan(cards, claims, 0.9).admitted) == {"urgent"}


def test_pick_strategies() -> None:
    cards = [gpu(0, 24, used_gib=10), gpu(1, 24, used_gib=2)]
    claim = waiting("x", 4, order=1)
    assert plan(cards, [claim], 0.9).admitted["x"] == ("GPU-00000000",)
    most_free = Claim("x", False, 3, 1, MemoryRequest(bytes=4 * GiB), pick="most-free")
    assert plan(cards, [most_free], 0.9).admitted["x"] == ("GPU-00000001",)
    rr = Claim("x", False, 3, 1, MemoryRequest(bytes=4 * GiB), pick="round-robin")
    assert plan(cards, [rr], 0.9, cursor=0).admitted["x"] == ("GPU-00000001",)
    assert plan(cards, [rr], 0.9, cursor=1).admitted["x"] == ("GPU-00000000",)


def test_gang_is_all_or_nothing_and_listed_in_pci_order() -> None:
    cards = [gpu(0, 24), gpu(1, 24, used_gib=20), gpu(2, 24)]
    gang = waiting("g", 8, order=1, gpus_wanted=2)
    assert plan(cards, [gang], 0.9).admitted["g"] == ("GPU-00000000", "GPU-00000002")
    three = waiting("g3", 8, order=1, gpus_wanted=3)
    assert "g3" not in plan(cards, [three], 0.9).admitted


def test_impossible_requests_are_named() -> None:
    cards = [gpu(0, 24), gpu(1, 12)]
    assert impossible_reason(waiting("x", 22, order=1), cards, 0.9) is not None
    assert impossible_reason(waiting("x", 21, order=1), cards, 0.9) is None
    only_small = waiting("x", 20, order=1, candidates=frozenset({"GPU-00000001"}))
    assert "GPU1" in (impossible_reason(only_small, cards, 0.9) or "")
    assert impossible_reason(waiting("x", 1, order=1, gpus_wanted=3), cards, 0.9) is not None


def test_a_gang_that_fits_on_too_few_cards_is_told_so_not_that_its_size_never_fits() -> None:
    # 20 GiB fits the 24 GiB card (21.6 GiB at 0.9), not the 16 GiB one: two of them never fit
    # at once, and the reason must not say that the largest card cannot hold 20 GiB.
    cards = [gpu(0, 24), gpu(1, 16)]
    why = impossible_reason(waiting("g", 20, order=1, gpus_wanted=2), cards, 0.9) or ""
    assert why.startswith("2 GPUs wanted with 20.0 GiB each, but only 1 can ever hold that")
    assert "GPU0 (24.0 GiB)" in why and "GPU1" not in why


def test_a_waiting_gang_is_told_the_gpu_that_keeps_it_waiting() -> None:
    # 15 GiB in use on GPU0: a gang of two 16 GiB waits for GPU0, not for GPU1 (21.6 GiB free,
    # which the line used to name as its "best", more than the 16 GiB it waits for).
    cards = [gpu(0, 24), gpu(1, 24)]
    gang = waiting("g", 16, order=2, gpus_wanted=2)
    rooms = gpu_rooms(cards, [running("r", "GPU-00000000", 15), gang], 0.9)
    text = wait_reason(gang, rooms, 1, 0, Conditions()).describe()
    assert text.startswith("waiting for 2 GPUs with 16.0 GiB each: 2nd best GPU0 has 6.6 GiB")
    # Busy cards: the one under the --max-util cap is not enough for two.
    capped = gang._replace(requirements=Requirements(max_util_pct=50))
    busy = Conditions(utilization={"GPU-00000000": 90.0, "GPU-00000001": None})
    text = wait_reason(capped, gpu_rooms(cards, [capped], 0.9), 0, 0, busy).describe()
    assert "only 1 of 2 candidates under 50% utilization, 2 wanted" in text


def test_a_waiting_gang_whose_gpu_was_lost_is_told_so_not_a_room_figure() -> None:
    # One of the two cards lost (left out of the reading): it waited "for 2 GPUs with 10.0 GiB
    # each: best GPU0 has 21.6 GiB", as if room were missing.
    gang = waiting("g", 10, order=1, gpus_wanted=2)
    text = wait_reason(gang, gpu_rooms([gpu(0, 24)], [gang], 0.9), 0, 0, Conditions()).describe()
    assert "only 1 of the GPUs it may use answers now, 2 wanted" in text


def test_a_fraction_equal_to_the_safety_factor_fits_an_idle_card() -> None:
    # 90 % of 24 GiB is 23192823398.4 bytes: the request and the room under safety 0.9 are
    # rounded alike, so `--vram 90%` is neither refused as "can never fit" nor left waiting.
    cards = [gpu(0, 24)]
    claim = Claim("x", False, 3, 1, MemoryRequest(fraction=0.9))
    assert impossible_reason(claim, cards, 0.9) is None
    assert plan(cards, [claim], 0.9).admitted["x"] == ("GPU-00000000",)


def test_a_request_past_the_room_the_driver_leaves_can_never_fit() -> None:
    # What the driver keeps for itself (NVML's "reserved", 500 MiB here) is never free: on an
    # idle 80 GiB card `--vram 90%` waited for ever, "best GPU0 has 71.5 GiB", nothing running,
    # where the plan never admits it; it can never fit, and is told so at once.
    card = gpu(0, 80)._replace(used_bytes=500 * 2**20, driver_bytes=500 * 2**20)
    share = Claim("x", False, 3, 1, MemoryRequest(fraction=0.9))
    assert plan([card], [share], 0.9).admitted == {}
    why = impossible_reason(share, [card], 0.9) or ""
    assert why.startswith("90% of a GPU can never fit"), why
    assert "offers at most 71.5 GiB at safety 0.9" in why
    assert "the driver keeps 500 MiB" in why
    # What the room holds still fits, at once.
    assert impossible_reason(waiting("y", 71.5, order=1), [card], 0.9) is None
    assert "y" in plan([card], [waiting("y", 71.5, order=1)], 0.9).admitted


def test_exclusive_takes_a_whole_idle_gpu_only() -> None:
    cards = [gpu(0, 24, used_gib=8), gpu(1, 24)]
    whole = Claim("w", False, 3, 1, None)
    decided = plan(cards, [whole], 0.9)
    assert decided.admitted["w"] == ("GPU-00000001",)
    after = [
        Claim(
            "w", True, 3, 1, None, gpu_uuids=("GPU-00000001",), reserved_bytes=decided.reserved["w"]
        )
    ]
    assert "s" not in plan([cards[1]], [*after, waiting("s", 1, order=2)], 0.9).admitted


def test_a_whole_gpu_job_is_not_started_beside_one_the_same_plan_starts() -> None:
    # Strict order, one idle card: a 4 GiB job first in line starts; the whole-GPU job
    # behind it waits, rather than both starting on the card at once.
    cards = [gpu(0, 24)]
    decided = plan(cards, [waiting("small", 4, order=1), Claim("w", False, 3, 2, None)], 0.9)
    assert decided.admitted == {"small": ("GPU-00000000",)}


def test_a_whole_gpu_may_have_up_to_five_percent_used_by_others() -> None:
    # 1 GiB of a 20 GiB card used outside gpuwait is 5 %, as docs/queue-and-status.md allows
    # an --exclusive job; a byte more is not.
    at_most = gpu(0, 20, used_gib=1)
    assert plan([at_most], [Claim("w", False, 3, 1, None)], 0.9).admitted == {"w": (at_most.uuid,)}
    over = at_most._replace(used_bytes=GiB + 1)
    assert plan([over], [Claim("w", False, 3, 1, None)], 0.9).admitted == {}


def test_a_whole_gpu_is_idle_with_only_the_drivers_own_memory_used() -> None:
    # A 4 GiB card on a recent driver: 300 MiB the driver keeps for itself is 7 % of it, more
    # than the 5 % of outside use a whole GPU allows; no process holds it, so the card is idle.
    card = gpu(0, 4)._replace(used_bytes=300 * 2**20, driver_bytes=300 * 2**20)
    assert plan([card], [Claim("w", False, 3, 1, None)], 0.9).admitted == {"w": ("GPU-00000000",)}
    # The same memory held by a process outside gpuwait keeps the card from a whole-GPU job.
    busy = gpu(0, 4)._replace(used_bytes=300 * 2**20)
    assert plan([busy], [Claim("w", False, 3, 1, None)], 0.9).admitted == {}


# --- properties ---------------------------------------------------------------------------

gib_amounts = st.floats(min_value=0.1, max_value=30, allow_nan=False)


@st.composite
def machines(draw: st.DrawFn) -> tuple[list[GpuSnapshot], list[Claim], float]:
    n_gpus = draw(st.integers(1, 4))
    cards = []
    claims: list[Claim] = []
    for i in range(n_gpus):
        total = draw(st.sampled_from([8, 12, 24, 40, 80]))
        external = draw(st.floats(0, total * 0.5))
        procs: list[ProcessUsage] = []
        used = external
        for r in range(draw(st.integers(0, 3))):
            reserved = draw(st.floats(0.1, total * 0.3))
            observed = draw(st.floats(0, total * 0.3))
            pid = 1000 + i * 10 + r
            procs.append(ProcessUsage(pid, int(observed * GiB)))
            used += observed
            claims.append(
                Claim(
                    f"r{i}{r}",
                    True,
                    3,
                    0,
                    MemoryRequest(bytes=int(reserved * GiB)),
                    gpu_uuids=(f"GPU-{i:08d}",),
                    reserved_bytes=int(reserved * GiB),
                    observed={f"GPU-{i:08d}": int(observed * GiB)},
                )
            )
        cards.append(gpu(i, total, used_gib=min(used, total), procs=tuple(procs)))
    for w in range(draw(st.integers(0, 12))):
        claims.append(
            Claim(
                f"w{w}",
                False,
                draw(st.integers(1, 5)),
                w + 1,
                MemoryRequest(bytes=int(draw(gib_amounts) * GiB)),
                gpus_wanted=draw(st.integers(1, 2)),
                pick=draw(st.sampled_from(["best-fit", "most-free", "round-robin"])),
            )
        )
    safety = draw(st.floats(0.5, 1.0))
    return cards, claims, safety


@settings(max_examples=300, deadline=None)
@given(machines())
def test_never_admits_past_usable(machine: tuple[list[GpuSnapshot], list[Claim], float]) -> None:
    cards, claims, safety = machine
    decided = plan(cards, claims, safety)
    rooms = gpu_rooms(cards, claims, safety)
    for uuid, room in rooms.items():
        added = sum(
            decided.reserved[job_id] for job_id, uuids in decided.admitted.items() if uuid in uuids
        )
        if added:
            assert room.external + room.committed + added <= room.usable


@settings(max_examples=300, deadline=None)
@given(machines())
def test_admitted_jobs_get_exactly_what_they_asked(
    machine: tuple[list[GpuSnapshot], list[Claim], float],
) -> None:
    cards, claims, safety = machine
    decided = plan(cards, claims, safety)
    by_id = {c.job_id: c for c in claims}
    for job_id, uuids in decided.admitted.items():
        assert len(uuids) == len(set(uuids)) == by_id[job_id].gpus_wanted
        assert list(uuids) == sorted(uuids)  # PCI order (UUIDs here sort like indices)


@settings(max_examples=300, deadline=None)
@given(machines())
def test_queue_order_respected(machine: tuple[list[GpuSnapshot], list[Claim], float]) -> None:
    """A waiter admitted while an earlier one waits must not fit where the earlier one would."""
    cards, claims, safety = machine
    decided = plan(cards, claims, safety)
    order = sorted((c for c in claims if not c.running), key=Claim.sort_key)
    for position, claim in enumerate(order):
        if claim.job_id in decided.admitted:
            continue
        # Removing every later waiter must not let this one in: they did not take its room.
        earlier = [c for c in claims if c.running or Claim.sort_key(c) <= Claim.sort_key(claim)]
        assert claim.job_id not in plan(cards, earlier, safety).admitted, position


@settings(max_examples=200, deadline=None)
@given(machines())
def test_plans_are_deterministic(machine: tuple[list[GpuSnapshot], list[Claim], float]) -> None:
    cards, claims, safety = machine
    first = plan(cards, claims, safety)
    second = plan(list(reversed(cards)), list(reversed(claims)), safety)
    assert first.admitted == second.admitted


@settings(max_examples=300, deadline=None)
@given(machines())
def test_an_admission_a_plan_made_passes_the_check_of_a_found_one(
    machine: tuple[list[GpuSnapshot], list[Claim], float],
) -> None:
    # A waiter admitted by another waiter's plan (in a shared ledger) checks the admission
    # against the same readings: it must never refuse one that a plan made.
    cards, claims, safety = machine
    decided = plan(cards, claims, safety)
    after = [
        c._replace(running=True, gpu_uuids=decided.admitted[c.job_id], reserved_bytes=r)
        if (r := decided.reserved.get(c.job_id)) is not None
        else c
        for c in claims
    ]
    for claim in claims:
        if claim.job_id in decided.admitted:
            others = [c for c in after if c.job_id != claim.job_id]
            uuids = decided.admitted[claim.job_id]
            reserved = decided.reserved[claim.job_id]
            assert admission_fits(claim, uuids, reserved, others, cards, safety)


def test_an_admission_written_into_the_ledger_onto_a_full_gpu_fails_the_check() -> None:
    cards = [gpu(0, 24, used_gib=20), gpu(1, 24)]
    asked = waiting("a", 10, order=1)
    assert not admission_fits(asked, ("GPU-00000000",), 10 * GiB, [], cards, 0.9)
    # Room enough, but a reservation smaller than the request would let others in beside it.
    assert not admission_fits(asked, ("GPU-00000001",), 1 * GiB, [], cards, 0.9)
    assert not admission_fits(asked, ("GPU-00000001", "GPU-00000000"), 10 * GiB, [], cards, 0.9)
    assert not admission_fits(asked, ("GPU-gone",), 10 * GiB, [], cards, 0.9)
    assert admission_fits(asked, ("GPU-00000001",), 10 * GiB, [], cards, 0.9)


def test_a_found_admission_into_exactly_the_room_left_passes_the_check() -> None:
    # 10 GiB run on a 24 GiB card (21.6 GiB usable at safety 0.9): another member's plan
    # admitted a job of exactly the 11.6 GiB left. Its own gpuwait starts it, not undoes it.
    cards = [gpu(0, 24)]
    left = int(24 * GiB * 0.9) - 10 * GiB
    asked = Claim("a", False, 3, 1, MemoryRequest(bytes=left))
    beside = [running("r", "GPU-00000000", 10)]
    assert admission_fits(asked, ("GPU-00000000",), left, beside, cards, 0.9)


def test_a_share_of_each_card_is_reserved_on_each_in_strict_order() -> None:
    # `--gpus 2 --vram 50%` on an 8 GiB and a 24 GiB card, queue_order = fifo: 12 GiB is
    # reserved on the large card and 4 GiB on the small one, so nobody is admitted into the
    # large card's other 8 GiB that the job is entitled to.
    cards = [gpu(0, 8), gpu(1, 24)]
    gang = Claim("g", False, 3, 1, MemoryRequest(fraction=0.5), gpus_wanted=2)
    decided = plan(cards, [gang], 0.9)
    assert decided.admitted == {"g": ("GPU-00000000", "GPU-00000001")}
    assert decided.reserved == {"g": 12 * GiB}
    assert decided.reserved_by_gpu == {"g": {"GPU-00000000": 4 * GiB}}


def test_a_gang_written_onto_one_gpu_twice_fails_the_check_of_a_found_admission() -> None:
    # A two-GPU gang given the same card twice would run on one card, beside a second copy of
    # its own reservation that nobody counts: it waits on, as for any edit the GPUs refuse.
    cards = [gpu(0, 24), gpu(1, 24)]
    gang = waiting("g", 10, order=1, gpus_wanted=2)
    twice = ("GPU-00000001", "GPU-00000001")
    assert not admission_fits(gang, twice, 10 * GiB, [], cards, 0.9)
    assert admission_fits(gang, ("GPU-00000000", "GPU-00000001"), 10 * GiB, [], cards, 0.9)


def test_a_found_admission_fuller_than_the_jobs_own_safety_fails_the_check() -> None:
    # 10 GiB run on a 24 GiB card. Under the planner's safety of 0.9 another 10 GiB fits
    # there, but the waiter's own safety is 0.5 (12 GiB): written in by a member who plans
    # with the laxer one, its admission is refused, as its own plan would never make it.
    cards = [gpu(0, 24)]
    beside = [running("r", "GPU-00000000", 10)]
    careful = waiting("c", 10, order=1, safety=0.5)
    assert not admission_fits(careful, ("GPU-00000000",), 10 * GiB, beside, cards, 0.9)
    assert admission_fits(
        careful._replace(safety=None), ("GPU-00000000",), 10 * GiB, beside, cards, 0.9
    )


# -- compute modes ----------------------------------------------------------------------------


def exclusive_process(card: GpuSnapshot) -> GpuSnapshot:
    return card._replace(compute_mode=COMPUTE_EXCLUSIVE_PROCESS)


def test_an_exclusive_process_card_takes_one_job_whatever_its_size() -> None:
    # Two 4 GiB jobs fit a 24 GiB card in memory, but in EXCLUSIVE_PROCESS mode CUDA fails
    # the second process with "all CUDA-capable devices are busy or unavailable".
    cards = [exclusive_process(gpu(0, 24)), gpu(1, 24)]
    claims = [waiting("a", 4, order=1), waiting("b", 4, order=2), waiting("c", 4, order=3)]
    decided = plan(cards, claims, 0.9)
    on_first = [j for j, uuids in decided.admitted.items() if "GPU-00000000" in uuids]
    assert len(on_first) == 1 and set(decided.admitted) == {"a", "b", "c"}
    # Once one runs there, nobody joins it; the estimate of the next start waits for its end.
    running_there = running("r", "GPU-00000000", 2)._replace(expected_seconds=30.0)
    alone = [exclusive_process(gpu(0, 24))]
    decided = plan(alone, [running_there, waiting("d", 2, order=4)], 0.9)
    assert decided.admitted == {}
    assert "GPU0 runs one process at a time" in decided.waiting["d"].describe()
    starts = estimate_starts(
        alone, [running_there, waiting("d", 2, order=4, expected_seconds=5.0)], 0.9
    )
    assert starts["d"] == 30.0


def test_an_exclusive_process_card_held_by_an_outside_process_takes_no_job() -> None:
    card = exclusive_process(gpu(0, 24, used_gib=0.5, procs=(ProcessUsage(777, GiB // 2),)))
    assert plan([card], [waiting("a", 2, order=1)], 0.9).admitted == {}
    # Even one the ignore list leaves out of the load: it holds the card's one context.
    named = card._replace(processes=(ProcessUsage(777, GiB // 2, name="Xorg"),))
    ignoring = Conditions(ignore_processes=frozenset({"Xorg"}))
    assert plan([named], [waiting("a", 2, order=1)], 0.9, conditions=ignoring).admitted == {}
    # Behind an MPS server, the card's one process, its clients share the card as usual.
    mps = card._replace(processes=(ProcessUsage(777, GiB // 2, name="nvidia-cuda-mps"),))
    both = [waiting("a", 2, order=1), waiting("b", 2, order=2)]
    assert set(plan([mps], both, 0.9).admitted) == {"a", "b"}


def test_the_lookahead_gives_an_exclusive_process_card_to_one_job_at_a_time() -> None:
    from gpuwait.core.lookahead import Lookahead, plan_queue

    cards = [exclusive_process(gpu(0, 24))]
    claims = [waiting(j, 2, order=n, expected_seconds=10.0) for n, j in enumerate("abc")]
    decided = plan_queue(cards, claims, 0.9, -1, Conditions(), FairShare(order=Lookahead()))
    assert len(decided.admitted) == 1
    started = [c._replace(running=True, gpu_uuids=("GPU-00000000",), reserved_bytes=2 * GiB)
               for c in claims[:1]]  # fmt: skip
    again = plan_queue(cards, [*started, *claims[1:]], 0.9, -1, Conditions(),
                       FairShare(order=Lookahead()))  # fmt: skip
    assert again.admitted == {}


def test_a_prohibited_card_is_never_chosen_and_alone_can_never_serve() -> None:
    closed = gpu(0, 24)._replace(compute_mode=COMPUTE_PROHIBITED)
    cards = [closed, gpu(1, 24, used_gib=10)]
    decided = plan(cards, [waiting("a", 8, order=1), waiting("b", 8, order=2)], 0.9)
    assert decided.admitted == {"a": ("GPU-00000001",)}  # b waits rather than go to GPU0
    assert impossible_reason(waiting("x", 2, order=1), cards, 0.9) is None
    only = waiting("x", 2, order=1, candidates=frozenset({"GPU-00000000"}))
    said = impossible_reason(only, cards, 0.9) or ""
    assert said == "no candidate GPU takes CUDA work: GPU0's compute mode is prohibited"
    gang = impossible_reason(waiting("x", 2, order=1, gpus_wanted=2), cards, 0.9) or ""
    assert gang.endswith("only 1 can be used; GPU0's compute mode is prohibited"), gang
    # A waiter whose card was switched to prohibited while it waited is told so.
    reason = wait_reason(only, gpu_rooms(cards, [only], 0.9), 0, 0, Conditions())
    assert "GPU0's compute mode is prohibited" in reason.describe()


def test_an_exclusive_process_card_whose_processes_cannot_be_listed_is_judged_by_memory() -> None:
    # The driver would not list the card's processes (NOT_SUPPORTED on a vGPU, NO_PERMISSION):
    # 10 GiB used outside gpuwait means a process with a context there, and the card takes one.
    unlisted = exclusive_process(gpu(0, 24, used_gib=10))
    assert plan([unlisted], [waiting("a", 2, order=1)], 0.9).admitted == {}
    idle = exclusive_process(gpu(0, 24, used_gib=0.3))  # the driver's own, nobody's context
    assert plan([idle], [waiting("a", 2, order=1)], 0.9).admitted == {"a": ("GPU-00000000",)}
