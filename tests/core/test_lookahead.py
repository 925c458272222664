"""The lookahead order: what its plans start now, that they never over-admit, and that no job
starves however jobs arrive (property-tested on a replay of the plans in time)."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwait.core import lookahead
from gpuwait.core.lookahead import (
    Lookahead,
    expected_starts,
    lay_out,
    plan,
    plan_queue,
    with_wait_budgets,
)
from gpuwait.core.policy import NO_CONDITIONS, Claim, FairShare, gpu_rooms, need_on
from gpuwait.core.sizes import MemoryRequest
from gpuwait.core.snapshot import GpuSnapshot

GiB = 2**30
SAFETY = 0.9


def cards(count: int, total_gib: int = 48) -> list[GpuSnapshot]:
    return [GpuSnapshot(i, f"GPU-{i}", "Test GPU", total_gib * GiB, 0) for i in range(count)]


def waiter(job_id: str, gib: float, order: int, seconds: float | None, **kw: object) -> Claim:
    return Claim(
        job_id=job_id,
        running=False,
        priority=int(kw.pop("priority", 3)),  # type: ignore[call-overload]
        order=order,
        request=MemoryRequest(bytes=int(gib * GiB)),
        expected_seconds=seconds,
        **kw,  # type: ignore[arg-type]
    )


def running(job_id: str, gib: float, gpu: int, left: float | None, order: int = 0) -> Claim:
    return Claim(
        job_id=job_id,
        running=True,
        priority=3,
        order=order,
        request=MemoryRequest(bytes=int(gib * GiB)),
        gpu_uuids=(f"GPU-{gpu}",),
        reserved_bytes=int(gib * GiB),
        expected_seconds=left,
    )


def test_a_job_with_no_run_time_never_delays_one_whose_start_is_known() -> None:
    # One card: 30 GiB running for 10 more seconds; a 40 GiB job with a known run time can
    # start when it ends. A 10 GiB job fits now, but with no estimate it might run for ever.
    gpus = cards(1)
    big = waiter("big", 40, 1, 60.0)
    claims = [running("r", 30, 0, 10.0), big, waiter("unknown", 10, 2, None)]
    decided = plan(gpus, claims, SAFETY)
    assert decided.admitted == {}
    assert "cannot be estimated" not in decided.waiting["big"].describe()
    # The same small job known to end in 5 s starts now: it ends before the big one can start.
    known = [running("r", 30, 0, 10.0), big, waiter("short", 10, 2, 5.0)]
    assert set(plan(gpus, known, SAFETY).admitted) == {"short"}


def test_an_urgent_job_that_fits_starts_before_anything_else() -> None:
    gpus = cards(1)
    claims = [
        waiter("long", 40, 1, 1000.0),
        waiter("urgent", 20, 2, 10.0, priority=5),
    ]
    decided = plan(gpus, claims, SAFETY)
    assert set(decided.admitted) == {"urgent"}
    assert "planned on GPU0 in" in decided.waiting["long"].describe()


def test_an_urgent_job_that_must_wait_keeps_its_card_from_jobs_planned_to_end_first() -> None:
    # 30 GiB run on each card for 10 more seconds; an urgent 40 GiB job can start on either
    # card after that. A 5-second job fits now and would end first by its estimate, but a
    # job that overruns its estimate would delay the urgent one: it goes to the other card.
    gpus = cards(2)
    short = waiter("short", 10, 2, 5.0)
    claims = [running("r0", 30, 0, 10.0), running("r1", 30, 1, 20.0), short]
    assert plan(gpus, claims, SAFETY).admitted == {"short": ("GPU-0",)}
    urgent = waiter("urgent", 40, 1, 60.0, priority=5)
    decided = plan(gpus, [*claims, urgent], SAFETY)
    assert decided.admitted == {"short": ("GPU-1",)}
    assert "planned on GPU0 in 10.0s" in decided.waiting["urgent"].describe()


def test_a_mixed_queue_ends_sooner_than_in_order() -> None:
    """A seeded mix like bench/schedule_quality.py's: many small short jobs, some of 20-40 GiB
    and priorities 1-5, arriving over 10 s on 4 cards of 48 GiB. Replayed with exact run
    times, the lookahead plan ends sooner than the in-order one, and urgent jobs still start
    within a few seconds."""
    rng = random.Random(7)
    arrivals = []
    for _ in range(60):
        big = rng.random() < 0.3
        gib = rng.randint(20, 40) if big else rng.randint(2, 6)
        seconds = rng.uniform(6, 14) if big else rng.uniform(2, 6)
        priority = rng.choices([1, 3, 5], weights=[15, 70, 15])[0]
        arrivals.append((10 * rng.random() ** 0.7, gib, seconds, priority))
    planned = replay(arrivals, Lookahead(steps=60), gpu_count=4)
    in_order = replay(arrivals, None, gpu_count=4)
    ends = [max(s[f"j{n}"] + a[2] for n, a in enumerate(arrivals)) for s in (planned, in_order)]
    assert ends[0] < 0.97 * ends[1], ends
    urgent = [planned[f"j{n}"] - a[0] for n, a in enumerate(arrivals) if a[3] == 5]
    assert max(urgent) < 10


def mixed_queue() -> list[Claim]:
    """25 waiters of many sizes, run times and priorities."""
    return [
        waiter(f"j{i}", 4 + (i * 7) % 30, i, 10.0 + (i * 13) % 50, priority=1 + i % 4)
        for i in range(25)
    ]


def test_the_same_inputs_give_the_same_plan() -> None:
    gpus = cards(3)
    claims = mixed_queue()
    first = plan(gpus, claims, SAFETY, settings=Lookahead(steps=100, seed=3))
    again = plan(gpus, claims, SAFETY, settings=Lookahead(steps=100, seed=3))
    assert first == again


def test_a_plan_packs_tighter_than_any_simple_order_before_any_search_step() -> None:
    """Two cards of 43.2 GiB usable. Laid out in submission order, largest first or longest
    first, these six jobs end at 50 s at best; the plan, laid out again backwards from its end
    and reordered by those starts, ends at 40 s (the best any order does) with no search step."""
    gpus = cards(2)
    rooms = gpu_rooms(gpus, [], SAFETY)
    jobs = [(5, 30.0), (10, 30.0), (35, 20.0), (20, 30.0), (35, 20.0), (10, 20.0)]

    def end(order: list[int], search: bool) -> float:
        claims = [waiter(f"j{i}", jobs[i][0], n + 1, jobs[i][1]) for n, i in enumerate(order)]
        return lay_out(rooms, claims, settings=Lookahead(steps=0), search=search)[1].end

    submitted = list(range(len(jobs)))
    largest = sorted(submitted, key=lambda i: -jobs[i][0] * jobs[i][1])
    longest = sorted(submitted, key=lambda i: (-jobs[i][1], -jobs[i][0] * jobs[i][1]))
    assert min(end(order, search=False) for order in (submitted, largest, longest)) == 50.0
    assert end(submitted, search=True) == 40.0


def test_a_plan_searches_on_from_the_last_plans_order() -> None:
    """What one decision's search found, the next starts from (the ledger keeps the order):
    with no search steps of its own it plans as well as the long search did, where alone it
    plans worse; and an order naming jobs that are not there, or none of them, changes nothing
    for the worse."""
    gpus = cards(3)
    claims = mixed_queue()
    rooms = gpu_rooms(gpus, claims, SAFETY)
    searched = plan(gpus, claims, SAFETY, settings=Lookahead(steps=400))
    alone = lay_out(rooms, claims, settings=Lookahead(steps=0))[1]
    warm = lay_out(rooms, claims, settings=Lookahead(steps=0), hint=searched.order)[1]
    long = lay_out(rooms, claims, settings=Lookahead(steps=400))[1]
    assert warm.score == long.score < alone.score
    assert plan(gpus, claims, SAFETY, settings=Lookahead(steps=0), hint=searched.order) == (
        plan(gpus, claims, SAFETY, settings=Lookahead(steps=0), hint=searched.order)
    )
    for junk in (["nobody", "j3", "j3", "else"], [f"x{i}" for i in range(100)]):
        assert lay_out(rooms, claims, settings=Lookahead(steps=0), hint=junk)[1].score <= (
            alone.score
        )


def test_a_plan_stops_at_its_budget_with_the_last_plans_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A long queue takes a while to lay out once (tens of ms for a thousand waiters on 16
    cards), and the plan holds the ledger's lock: once its budget is spent it lays out no
    other order, and the one it has laid out is the last plan's, which carries the search on
    from one decision to the next."""
    gpus = cards(3)
    claims = mixed_queue()
    rooms = gpu_rooms(gpus, claims, SAFETY)
    searched = plan(gpus, claims, SAFETY, settings=Lookahead(steps=400))
    layouts = []
    schedule = lookahead._schedule

    def counted(*args: Any) -> Any:
        layouts.append(args[0])
        return schedule(*args)

    monkeypatch.setattr(lookahead, "_schedule", counted)
    ticks = itertools.count()  # every look at the clock: a second later
    order, _ = lay_out(rooms, claims, hint=searched.order, clock=lambda: float(next(ticks)))
    assert len(layouts) == 1
    assert [c.job_id for c in order] == list(searched.order)
    # In time, the same plan as with no clock at all.
    timed, timed_laid = lay_out(rooms, claims, hint=searched.order, clock=lambda: 0.0)
    untimed, untimed_laid = lay_out(rooms, claims, hint=searched.order)
    assert timed == untimed
    assert timed_laid.score == untimed_laid.score


def test_a_job_long_past_its_expected_end_is_not_planned_to_end_at_once() -> None:
    """A job expected to run 10 minutes has run 20: the plan does not count on its memory
    coming back within a second (it likely runs on a while), so the wait line says so."""
    gpus = cards(1)
    overdue = running("r", 30, 0, 0.0)._replace(ran=1200.0)
    big = waiter("big", 40, 1, 60.0)
    start = expected_starts(gpus, [overdue, big], SAFETY)["big"]
    assert start is not None and start >= 30.0
    # One just past its end is planned to end within a second or two.
    just = running("r", 30, 0, 0.0)._replace(ran=20.0)
    start = expected_starts(gpus, [just, big], SAFETY)["big"]
    assert start is not None and start <= 1.0


def test_a_short_job_past_its_end_is_planned_to_run_on_in_proportion_to_its_length() -> None:
    """How long an overdue job is planned to run on scales with what it has run, with no floor
    in seconds: a 3-second job just past its end is planned to end within a tenth of a second
    (a floor of a second would plan the queue behind it a second late, a third of its run),
    yet never at once, so nothing is planned into memory it still holds."""
    gpus = cards(1)
    big = waiter("big", 40, 1, 60.0)
    short = running("r", 30, 0, 0.0)._replace(ran=3.0)
    start = expected_starts(gpus, [short, big], SAFETY)["big"]
    assert start is not None and 0.0 < start <= 0.1


def test_a_plan_where_nobody_can_start_gives_the_starts_of_the_last_plans_order() -> None:
    """Where nobody fits now the plan is not searched (every waiter plans at every wake-up),
    but it is laid out in the order the last plan found, not in submission order: the wait
    lines and `gpuwait status` (which shows the plan's starts) say when the queue is really
    expected to start, and say the same."""
    gpus = cards(1)
    # 40 GiB runs 10 s more; 30 GiB for 8 s and 20 GiB for 4 s do not fit beside it or each
    # other. The last plan put the short one first (the same end, less waiting).
    claims = [running("r", 40, 0, 10.0), waiter("a", 30, 1, 8.0), waiter("b", 20, 2, 4.0)]
    decided = plan(gpus, claims, SAFETY, hint=("b", "a"))
    assert decided.admitted == {}
    assert decided.starts == {"b": 10.0, "a": 14.0}
    assert decided.order == ("b", "a")
    assert decided.waiting["b"].note == "planned on GPU0 in 10.0s"
    assert decided.waiting["a"].note == "planned on GPU0 in 14.0s"
    # With no last order it is laid out in submission order, as before.
    assert plan(gpus, claims, SAFETY).starts == {"a": 10.0, "b": 18.0}


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(1, 40),  # GiB
            st.one_of(st.none(), st.floats(1, 500)),  # expected seconds
            st.integers(1, 5),  # priority
            st.booleans(),  # running
            st.integers(0, 2),  # its GPU when running
        ),
        max_size=14,
    ),
    st.integers(1, 3),
)
def test_a_plan_never_admits_beyond_the_room(
    jobs: list[tuple[float, float | None, int, bool, int]], gpu_count: int
) -> None:
    gpus = cards(gpu_count)
    rooms = gpu_rooms(gpus, [], SAFETY)
    used = dict.fromkeys((g.uuid for g in gpus), 0)
    claims = []
    for n, (gib, seconds, priority, is_running, where) in enumerate(jobs):
        uuid = f"GPU-{where % gpu_count}"
        size = int(gib * GiB)
        if is_running and used[uuid] + size <= rooms[uuid].usable:
            used[uuid] += size
            claims.append(running(f"r{n}", gib, where % gpu_count, seconds, n))
        else:
            claims.append(waiter(f"w{n}", gib, n, seconds, priority=priority))
    decided = plan(gpus, claims, SAFETY, settings=Lookahead(steps=30))
    after = gpu_rooms(gpus, claims, SAFETY)
    for job_id, uuids in decided.admitted.items():
        claim = next(c for c in claims if c.job_id == job_id)
        for uuid in uuids:
            need = need_on(claim, after[uuid])
            assert need is not None and need <= after[uuid].room
            after[uuid] = after[uuid]._replace(committed=after[uuid].committed + need)
    # The first urgent waiter is never kept waiting where it fits now.
    urgent = [c for c in claims if not c.running and c.priority == 5]
    if urgent:
        first = min(urgent, key=lambda c: c.order)
        now = gpu_rooms(gpus, claims, SAFETY).values()
        if any((n := need_on(first, room)) is not None and n <= room.room for room in now):
            assert first.job_id in decided.admitted


def replay(
    arrivals: list[tuple[float, float, float, int]],
    settings: Lookahead | None,
    gpu_count: int = 1,
) -> dict[str, float]:
    """Start times of jobs (arrival, GiB, seconds, priority) under the lookahead plan (None: the
    in-order plan), replayed in time with jobs taking exactly their expected run time."""
    gpus = cards(gpu_count)
    pending = sorted(
        (at, f"j{n}", gib, seconds, priority)
        for n, (at, gib, seconds, priority) in enumerate(arrivals)
    )
    arrival = {job_id: at for at, job_id, *_ in pending}
    length = {job_id: seconds for _, job_id, _, seconds, _ in pending}
    claims: dict[str, Claim] = {}
    ends: dict[str, float] = {}
    starts: dict[str, float] = {}
    order = 0
    now = 0.0
    for _ in range(10_000):
        if not pending and not claims:
            break
        now = min([*ends.values(), *(p[0] for p in pending[:1])])
        while pending and pending[0][0] <= now:
            _, job_id, gib, seconds, priority = pending.pop(0)
            order += 1
            claims[job_id] = waiter(job_id, gib, order, seconds, priority=priority)
        for job_id in [j for j, end in ends.items() if end <= now]:
            del ends[job_id], claims[job_id]
        current = [
            c._replace(expected_seconds=ends[c.job_id] - now)
            if c.running
            else c._replace(waited=now - arrival[c.job_id])
            for c in claims.values()
        ]
        if settings is None:
            decided = plan_queue(gpus, current, SAFETY, -1, NO_CONDITIONS, FairShare())
        else:
            current = with_wait_budgets(gpus, current, SAFETY, settings)
            decided = plan(gpus, current, SAFETY, settings=settings)
        for c in current:
            if c.job_id in decided.admitted:
                starts[c.job_id] = now
                ends[c.job_id] = now + length[c.job_id]
                c = c._replace(
                    running=True,
                    gpu_uuids=decided.admitted[c.job_id],
                    reserved_bytes=decided.reserved[c.job_id],
                )
            elif decided.hold is not None and c.job_id == decided.hold.job_id:
                c = c._replace(held=decided.hold.gpu_uuids)
            claims[c.job_id] = c
    return starts


@settings(max_examples=30, deadline=None)
@given(
    big_gib=st.floats(25, 43),
    big_seconds=st.floats(5, 60),
    small=st.lists(
        st.tuples(st.floats(0.2, 1.5), st.floats(4, 12), st.floats(5, 20)),
        min_size=30,
        max_size=80,
    ),
    factor=st.floats(1, 4),
)
def test_no_job_starves_under_a_stream_of_small_ones(
    big_gib: float,
    big_seconds: float,
    small: list[tuple[float, float, float]],
    factor: float,
) -> None:
    """Two small jobs run; a big job of priority 1 arrives; small ones of priority 4 keep
    arriving, fast enough to keep the card busy, and each plan could run them first (they
    weigh more, and the queue as planned ends no later). With its wait budget the big job
    starts within that budget plus the longest run that may be under way when it is spent."""
    arrivals = [(0.0, 8.0, 10.0, 4), (0.0, 8.0, 12.0, 4), (0.5, big_gib, big_seconds, 1)]
    at = 0.5
    for gap, gib, seconds in small:
        at += gap
        arrivals.append((at, gib, seconds, 4))
    starts = replay(arrivals, Lookahead(steps=20, max_wait_factor=factor))
    assert len(starts) == len(arrivals), "a job never started"
    # Its budget: factor x its in-order end at its first plan (start plus run time). In order
    # it starts once the two small jobs end (the later ones are priority 4, they go before it
    # too, but were not there yet): 12 s at most.
    budget = factor * (12.0 + big_seconds)
    longest = max(seconds for _, _, seconds, _ in arrivals)
    assert starts["j2"] - 0.5 <= budget + longest + 1e-6


def test_a_waiter_starts_no_fuller_than_its_own_safety_in_any_plan() -> None:
    # 20 GiB of a 48 GiB card run for 60 s more; the plan's safety is 1.0. A waiter whose own
    # safety is 0.5 (24 GiB) cannot start beside it with 10 GiB, only once it has ended; one
    # with 4 GiB can, and the in-order plan says the same.
    gpus = cards(1)
    base = running("run", 20, 0, 60.0)
    strict = waiter("strict", 10, 1, 30.0, safety=0.5)
    small = waiter("small", 4, 1, 30.0, safety=0.5)
    for order in (Lookahead(), None):
        fair = FairShare(order=order)
        decided = plan_queue(gpus, [base, strict], 1.0, -1, NO_CONDITIONS, fair)
        assert "strict" not in decided.admitted, order
        assert plan_queue(gpus, [base, small], 1.0, -1, NO_CONDITIONS, fair).admitted, order
    laid = plan(gpus, [base, strict], 1.0)
    assert laid.starts["strict"] == 60.0


def test_max_wait_caps_every_wait_budget_and_gives_one_where_strict_order_cannot_tell() -> None:
    # One card: 30 GiB runs for 100 s more; a 40 GiB job of 60 s waits behind it (in strict
    # order it ends in 160 s: a budget of 1600 s at the default factor), and behind a job with
    # no run time, a second card's waiter cannot be told a start at all.
    gpus = cards(2)
    claims = [
        running("r", 30, 0, 100.0),
        running("endless", 30, 1, None),
        waiter("next", 40, 1, 60.0, candidates=frozenset({"GPU-0"})),
        waiter("blind", 40, 2, 60.0, candidates=frozenset({"GPU-1"})),
    ]
    due = {c.job_id: c.due for c in with_wait_budgets(gpus, claims, SAFETY) if not c.running}
    assert due == {"next": 1600.0, "blind": None}
    capped = Lookahead(max_wait=300.0)
    due = {
        c.job_id: c.due for c in with_wait_budgets(gpus, claims, SAFETY, capped) if not c.running
    }
    # `max_wait` is shorter than the factor's budget, and it is a budget where none can be told.
    assert due == {"next": 300.0, "blind": 300.0}


def test_the_plan_starts_a_job_on_the_gpus_it_may_use_and_a_whole_gpu_job_on_an_idle_card() -> None:
    # GPU0 runs a 10 GiB job; GPU1 is idle. Best fit would put a 4 GiB job on GPU0, but it may
    # use GPU1 alone (--devices 1): it starts there now, not planned where it may not go.
    gpus = cards(2)
    busy = running("r", 10, 0, 60.0)
    pinned = waiter("pinned", 4, 1, 30.0, candidates=frozenset({"GPU-1"}))
    assert plan(gpus, [busy, pinned], SAFETY).admitted == {"pinned": ("GPU-1",)}
    # 8 GiB used outside gpuwait on GPU0 (a desktop, another user's process): a whole-GPU job
    # takes idle GPU1 at once, whatever room GPU0 seems to have.
    shared = [gpus[0]._replace(used_bytes=8 * GiB), gpus[1]]
    whole = Claim("whole", False, 3, 1, None, expected_seconds=30.0)
    assert plan(shared, [whole], SAFETY).admitted == {"whole": ("GPU-1",)}


def test_a_share_of_the_card_equal_to_the_safety_factor_starts() -> None:
    # `--vram 90%` at safety 0.9 asks exactly what the card offers: it fits, as in strict order.
    share = Claim("share", False, 3, 1, MemoryRequest(fraction=SAFETY), expected_seconds=30.0)
    assert plan(cards(1), [share], SAFETY).admitted == {"share": ("GPU-0",)}


def test_a_gang_starts_on_as_many_free_cards_at_once_or_is_planned_for_when_they_are() -> None:
    # Three cards, GPU0 busy for 10 s more: a gang of two 20 GiB jobs starts now on GPU1 and
    # GPU2. With GPU2 busy too, for 30 s, it waits: planned for when GPU0 frees, in 10 s.
    gang = waiter("gang", 20, 1, 60.0, gpus_wanted=2)
    busy = running("r0", 30, 0, 10.0)
    assert plan(cards(3), [busy, gang], SAFETY).admitted == {"gang": ("GPU-1", "GPU-2")}
    decided = plan(cards(3), [busy, running("r2", 30, 2, 30.0), gang], SAFETY)
    assert decided.admitted == {} and decided.starts["gang"] == 10.0


def test_a_waiter_kept_off_a_held_gpu_by_its_own_gpus_is_told_its_own_wait() -> None:
    # Two Slurm allocations of one user on one node (an array's tasks), one GPU each, one ledger:
    # both cards are full of a job with no run-time estimate, and each allocation has a waiter
    # that may use its own GPU alone. The second waits for GPU1, kept for it, not for GPU0 or
    # for the first waiter, which it could never use or follow.
    gpus = cards(2)
    full = Claim(
        job_id="r",
        running=True,
        priority=3,
        order=0,
        request=MemoryRequest(bytes=40 * GiB),
        gpus_wanted=2,
        gpu_uuids=("GPU-0", "GPU-1"),
        reserved_bytes=40 * GiB,
    )
    first = waiter("first", 10, 1, None, candidates=frozenset({"GPU-0"}))
    second = waiter("second", 10, 2, None, candidates=frozenset({"GPU-1"}))
    decided = plan(gpus, [full, first, second], SAFETY)
    assert decided.admitted == {}
    assert decided.waiting["second"].note == (
        "GPU1 held for it until a job with no run-time estimate ends"
    )
    # In order (queue_order = fifo), nothing is held for it, and nothing else is said either.
    in_order = plan_queue(gpus, [full, first, second], SAFETY, -1, NO_CONDITIONS, FairShare())
    assert in_order.waiting["second"].note is None
