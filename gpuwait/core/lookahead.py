"""Lookahead re-planning: which waiters start now, chosen by laying the whole queue out in time.

The in-order policy (`policy.plan`, `queue_order = fifo`) serves waiters by priority and
submission, and keeps GPUs for the first one that does not fit. That order is fair but packs
badly: a card that could run a 40 GiB job next to a 4 GiB one runs three small ones instead,
and the big job that arrived later ends last. The lookahead order plans instead: at every
decision (an arrival, an end: the moments gpuwait re-plans anyway) it lays the queue on each
card's memory-over-time profile, running jobs ending at their expected times, and starts what
that plan starts now. The order the queue is laid out in is searched:

- urgent jobs (priority 5) and jobs whose wait budget is spent come first, in submission order;
- then waiters with a known run time, in the order that makes the best plan: the plan's end
  first, the priority-weighted waits between plans that end together, plans that keep a
  waiter past its budget worse than any that do not. The search starts from a few simple
  orders and the last plan's (`hint`), lays the best out again backwards from its end to close
  its gaps (`_justify`), and takes a bounded number of seeded swap and move steps;
- then waiters with no run time: they are planned as running for ever (so they never delay a
  job whose start is known) in submission order.

Each job is placed at the earliest time its memory fits on a card for its whole expected run,
on top of everything placed before it, so a job started now never delays one earlier in the
order, as far as the estimates go. A job whose start cannot be told (it waits on a job with no
estimate) keeps its GPUs from every job after it, as the in-order policy's head does.

An urgent job (or one whose budget is spent) that must wait keeps the room planned for it from
now until it starts: nothing is started there on the strength of an estimate that it ends first.

No starvation: a waiter's wait budget (`due`, set once by `with_wait_budgets`) is
`max_wait_factor` times its expected time from submission to end in the in-order plan, or
`max_wait`; once it has waited that long it is planned with the urgent jobs, which are served
in submission order with the GPUs kept for the first of them, so it starts as soon as the jobs
before it have.

Pure: the clock that bounds the search's time is passed in, and with the same inputs (and the
budget not reached) the same plan comes out.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

from gpuwait.core import policy
from gpuwait.core.policy import (
    NO_CONDITIONS,
    Claim,
    Conditions,
    FairShare,
    GpuRoom,
    Hold,
    Lookahead,
    Plan,
    UserLimits,
    WaitReason,
)
from gpuwait.core.record import Record
from gpuwait.core.sizes import format_duration
from gpuwait.core.snapshot import GpuSnapshot

#: Priority of urgent jobs: planned first, in submission order, never reordered.
URGENT = 5
_NEVER = math.inf
#: A running job past its expected end is planned to run on for this share of what it has run:
#: it still holds its memory now, so nothing is planned into that memory at once, and a job
#: that overran long is likely to run on a while. Planning it to end at once instead makes the
#: plan start jobs ahead of others on its memory's strength, for them to wait there. No floor
#: in seconds: how far a job overruns scales with its length, and a floor that is nothing to
#: an hour's job plans the queue behind a short one late by a third of its run (replayed on the
#: benchmark's traces, a floor of one second cost 0.6 % of the makespan).
_OVERDUE_SHARE = 0.03
#: How much a second of waiting counts against a second of the plan's end, per job and weight:
#: little, a tie-break between plans that end together. The queue's throughput is the end; the
#: waits are kept by urgent jobs going first and by the wait budgets.
_WAIT_WEIGHT = 0.02
#: How much each second past a wait budget counts against a second of the plan's end.
_LATE_WEIGHT = 10.0
#: Rounds of justification (`_justify`) tried on the best simple order.
_JUSTIFY_ROUNDS = 3
#: Plans made in one decision at most, each without the waiters a per-user limit refused in
#: the one before (the last one's admissions stand: each was checked against the limits).
_LIMIT_ROUNDS = 4


DEFAULT = Lookahead()


class Placement:
    """Where and when the plan puts one waiter. (A plain class: the search makes one per job
    per plan it tries, and a Record's general __init__ was a tenth of the search's time.)"""

    __slots__ = ("gpu_uuids", "need", "start")

    def __init__(self, start: float, gpu_uuids: tuple[str, ...], need: int) -> None:
        self.start = start
        self.gpu_uuids = gpu_uuids
        self.need = need

    def __repr__(self) -> str:
        return f"Placement(start={self.start}, gpu_uuids={self.gpu_uuids}, need={self.need})"


class Schedule(Record, frozen=True):
    """A plan laid out in time: each waiter's placement (start `inf`: not known)."""

    placements: Mapping[str, Placement]
    #: When the last planned job is expected to end (inf when one never does).
    end: float
    score: float


class _Card:
    """One GPU's memory over time: a step function of the bytes planned in use."""

    __slots__ = ("blocked", "cap", "index", "times", "used", "uuid")

    def __init__(self, uuid: str, index: int, cap: int) -> None:
        self.uuid = uuid
        self.index = index
        self.cap = cap
        #: used[i] bytes are in use from times[i] until times[i + 1] (the last: for ever).
        self.times: list[float] = [0.0]
        self.used: list[int] = [0]
        #: Kept for a job whose start cannot be told: nothing later in the order goes here.
        self.blocked = False

    def copy(self) -> _Card:
        card = _Card(self.uuid, self.index, self.cap)
        card.times = self.times[:]
        card.used = self.used[:]
        card.blocked = self.blocked
        return card

    def _split(self, at: float) -> int:
        """The index of the step starting at `at`, splitting the one it falls in."""
        times = self.times
        lo = bisect_left(times, at)
        if lo < len(times) and times[lo] == at:
            return lo
        times.insert(lo, at)
        self.used.insert(lo, self.used[lo - 1])
        return lo

    def add(self, start: float, length: float, need: int) -> None:
        first = self._split(start)
        last = len(self.times) if length == _NEVER else self._split(start + length)
        used = self.used
        for i in range(first, last):
            used[i] += need

    def earliest(self, need: int, length: float, after: float = 0.0) -> float:
        """The earliest time from `after` on from which `need` more bytes fit for `length`
        seconds."""
        if self.blocked:
            return _NEVER
        room = self.cap - need
        if room < 0:
            return _NEVER
        times, used = self.times, self.used
        count = len(times)
        # The step `after` falls in (times[0] is 0 and `after` is never below it).
        i = bisect_right(times, after) - 1 if after > 0.0 else 0
        while i < count:
            if used[i] > room:
                i += 1
                continue
            start = times[i] if times[i] > after else after
            end = start + length
            j = i + 1
            while j < count and times[j] < end and used[j] <= room:
                j += 1
            if j == count or times[j] >= end:
                return start
            i = j + 1
        return _NEVER

    def free_at(self, start: float) -> int:
        for i in range(len(self.times) - 1, -1, -1):
            if self.times[i] <= start:
                return self.cap - self.used[i]
        return self.cap


class _Job:
    """A waiter as the search sees it: what it needs where, for how long, how much it weighs."""

    __slots__ = (
        "area",
        "claim",
        "kept",
        "kind",
        "length",
        "needs",
        "pinned",
        "waited",
        "weight",
    )

    def __init__(
        self,
        claim: Claim,
        needs: dict[str, int],
        length: float,
        waited: float,
        kept: Mapping[str, int] = MappingProxyType({}),
    ) -> None:
        self.claim = claim
        self.needs = needs
        #: Per card, the bytes its own stricter safety keeps free beside it: it starts only
        #: where its need and these fit.
        self.kept = kept
        self.length = length
        self.weight = 2.0 ** (claim.priority - 3)
        self.waited = waited
        #: Planned with the urgent jobs (urgent, or its wait budget spent).
        self.pinned = False
        need = min(needs.values(), default=0)
        self.area = need * claim.gpus_wanted * (length if length != _NEVER else 0.0)
        #: What the plan looks at: two jobs of one kind are interchangeable.
        self.kind = (
            tuple(sorted(needs.items())),
            tuple(sorted(kept.items())),
            length,
            claim.gpus_wanted,
            claim.priority,
        )

    def asks(self, card: _Card) -> int:
        """What must be free on `card` for it to start there."""
        return self.needs[card.uuid] + self.kept.get(card.uuid, 0)


def _length(claim: Claim) -> float:
    """A waiter's expected run time, the longest of its per-GPU figures; inf when unknown."""
    figures = [s for s in claim.expected_by_gpu.values()]
    if claim.expected_seconds is not None:
        figures.append(claim.expected_seconds)
    return max(figures) if figures else _NEVER


def _static_need(claim: Claim, room: GpuRoom, conditions: Conditions) -> int | None:
    """Bytes `claim` needs on this GPU whenever it may go there; None: it never may (now)."""
    if not policy.static_ok(claim, room.gpu) or not policy.util_ok(
        claim, room.gpu.uuid, conditions
    ):
        return None
    cap = policy.room_for(claim, room).usable - room.external
    if claim.request is None:
        # A whole GPU: the card to itself, once nothing else runs there.
        return cap if policy.idle_enough(room) and cap > 0 else None
    need = claim.request.on(room.gpu.total_bytes)
    if need > cap or policy.held_outside(room):
        return None
    # A card that takes one process at a time is the job's alone, whatever it asks.
    return cap if room.gpu.one_process_only else need


def _base_cards(rooms: Mapping[str, GpuRoom], running: Sequence[Claim]) -> list[_Card]:
    cards = []
    for uuid, room in rooms.items():
        card = _Card(uuid, room.gpu.index, max(0, room.usable - room.external))
        for c in running:
            if uuid not in c.gpu_uuids:
                continue
            alone = c.exclusive or room.gpu.one_process_only
            size = card.cap if alone else c.holds_on(uuid)
            left = c.expected_by_gpu.get(uuid, c.expected_seconds)
            if left is None:
                length = _NEVER
            else:
                # Positive either way: nothing is planned into memory a job still holds.
                length = max(left if left > 0 else _OVERDUE_SHARE * c.ran, 1e-6)
            card.add(0.0, length, size)
        cards.append(card)
    cards.sort(key=lambda c: c.index)
    return cards


def _place(
    job: _Job, cards: list[_Card], now_rooms: Mapping[str, GpuRoom], cursor: int
) -> Placement:
    """Where `job` goes on top of `cards`: the earliest start, then the pick strategy's choice."""
    claim = job.claim
    wanted = claim.gpus_wanted
    needs = job.needs
    eligible = [c for c in cards if c.uuid in needs]
    if len(eligible) < wanted:
        return Placement(_NEVER, (), 0)
    start, chosen = _earliest(job, eligible)
    if start == _NEVER:
        # Where it would go once the unknown ends come: the GPUs it held at the last plan (a
        # hold sticks, so the room gathered there is not handed away), else those with the
        # most room now.
        held = [c for c in eligible if c.uuid in claim.held]
        ranked = (
            held
            if len(held) == wanted == len(claim.held)
            else sorted(eligible, key=lambda c: (-c.free_at(0.0), c.index))[:wanted]
        )
        return Placement(
            _NEVER,
            tuple(c.uuid for c in sorted(ranked, key=lambda c: c.index)),
            max(needs[c.uuid] for c in ranked),
        )
    picked = _pick(job, chosen, start, now_rooms, cursor, wanted)
    if wanted == 1:
        return Placement(start, (picked[0].uuid,), needs[picked[0].uuid])
    return Placement(
        start,
        tuple(c.uuid for c in sorted(picked, key=lambda c: c.index)),
        max(needs[c.uuid] for c in picked),
    )


def _earliest(job: _Job, eligible: list[_Card]) -> tuple[float, list[_Card]]:
    """The earliest start of `job` on the `eligible` cards, and the cards it can start on then."""
    if job.claim.gpus_wanted == 1:
        starts = [(card.earliest(job.asks(card), job.length), card) for card in eligible]
        start = min(s for s, _ in starts)
        return start, [card for s, card in starts if s == start]
    return _gang_start(job, eligible)


def _gang_start(job: _Job, eligible: list[_Card]) -> tuple[float, list[_Card]]:
    """The earliest time at which `gpus_wanted` of the cards all fit the job, and those cards.

    From a time t, each card's earliest start from t is a lower bound of when it can take part:
    no gang can start before the `wanted`-th smallest of them, so t moves there until that many
    cards can start at t itself. Each move passes at least one step of some card's profile.
    """
    wanted = job.claim.gpus_wanted
    t = 0.0
    while True:
        starts = [(card.earliest(job.asks(card), job.length, t), card) for card in eligible]
        latest = sorted(s for s, _ in starts)[wanted - 1]
        if latest == _NEVER:
            return _NEVER, []
        if latest == t:
            return t, [card for s, card in starts if s == t]
        t = latest


def _pick(
    job: _Job,
    chosen: list[_Card],
    start: float,
    now_rooms: Mapping[str, GpuRoom],
    cursor: int,
    wanted: int,
) -> list[_Card]:
    """Of the cards where the job can start at `start`, those its pick strategy takes."""
    if len(chosen) <= wanted:
        return chosen
    if start == 0.0:
        # Starting now: the strategy judges the GPUs as they are (as the in-order plan does).
        by_uuid = {c.uuid: c for c in chosen}
        fits = [
            (
                now_rooms[c.uuid]._replace(
                    committed=now_rooms[c.uuid].usable - now_rooms[c.uuid].external - c.free_at(0.0)
                ),
                job.needs[c.uuid],
            )
            for c in chosen
        ]
        ordered = policy.order_for_pick(fits, job.claim, cursor, len(now_rooms))
        return [by_uuid[room.gpu.uuid] for room, _ in ordered[:wanted]]
    # Later: best fit by the room left at the start.
    return _best_fit(job, chosen, start)


def _best_fit(job: _Job, cards: list[_Card], start: float) -> list[_Card]:
    """The `gpus_wanted` of `cards` with the least room left at `start` once `job` is on them."""
    ranked = sorted(cards, key=lambda c: (c.free_at(start) - job.needs[c.uuid], c.index))
    return ranked[: job.claim.gpus_wanted]


def _schedule(
    order: Sequence[_Job],
    base: list[_Card],
    now_rooms: Mapping[str, GpuRoom],
    cursor: int,
) -> Schedule:
    cards = [c.copy() for c in base]
    by_uuid = {c.uuid: c for c in cards}
    placements: dict[str, Placement] = {}
    end = 0.0
    waits = 0.0
    late = 0.0
    for job in order:
        placed = _place(job, cards, now_rooms, cursor)
        placements[job.claim.job_id] = placed
        if placed.start == _NEVER:
            for uuid in placed.gpu_uuids:
                # Kept for it (as the in-order head's hold): its start is unknown, so anything
                # placed there could delay it.
                by_uuid[uuid].blocked = True
            continue
        for uuid in placed.gpu_uuids:
            if job.pinned:
                # Held for it from now, not from its planned start: a job planned to end
                # before then runs over its estimate as often as not (start-up, loading), and
                # an urgent job's wait must not hang on other jobs' estimates.
                by_uuid[uuid].add(0.0, placed.start + job.length, job.needs[uuid])
            else:
                by_uuid[uuid].add(placed.start, job.length, job.needs[uuid])
        if job.length != _NEVER:
            end = max(end, placed.start + job.length)
            waits += job.weight * (job.waited + placed.start)
            due = job.claim.due
            if due is not None and job.waited + placed.start > due:
                # A plan that would spend a wait budget is worse than any that keeps it: the
                # job would be put first anyway once its budget is spent.
                late += job.waited + placed.start - due
    for card in base:
        if card.times and len(card.times) > 1:
            end = max(end, max(t for t in card.times if t != _NEVER))
    count = max(1, len(order))
    return Schedule(
        placements=placements,
        end=end,
        score=end + _WAIT_WEIGHT * waits / count + _LATE_WEIGHT * late,
    )


def _initial_orders(jobs: list[_Job], hint: Sequence[str]) -> list[list[_Job]]:
    """Orders to start the search from: submission, largest first, longest first, and the
    order of the last plan (`hint`: job ids; new waiters after the others, by queue order).

    The hint carries the search on from one decision to the next, where each decision alone
    can afford only a few steps. It is only a starting point: like the others it is taken only
    if its plan scores better, so a wrong or forged hint costs one plan's time, nothing more.
    """
    fifo = sorted(jobs, key=lambda j: j.claim.sort_key())
    largest = sorted(jobs, key=lambda j: (-j.area, j.claim.sort_key()))
    longest = sorted(jobs, key=lambda j: (-j.length, -j.area, j.claim.sort_key()))
    orders = [fifo, largest, longest]
    if hint:
        orders.append(_in_hint_order(fifo, hint))
    return orders


def _in_hint_order(jobs: Sequence[_Job], hint: Sequence[str]) -> list[_Job]:
    """`jobs` in the order of `hint` (job ids), those it does not name after the others in
    queue order."""
    fifo = sorted(jobs, key=lambda j: j.claim.sort_key())
    rank = {job_id: n for n, job_id in reversed(list(enumerate(hint)))}
    return sorted(fifo, key=lambda j: rank.get(j.claim.job_id, len(rank)))


def _mirrored(cards: Sequence[_Card], horizon: float) -> list[_Card]:
    """`cards` with time run backwards from `horizon` (what is in use at t is in use at
    horizon - t), cut at `horizon`."""
    out = []
    for card in cards:
        back = _Card(card.uuid, card.index, card.cap)
        times = card.times
        for k, used in enumerate(card.used):
            end = min(times[k + 1] if k + 1 < len(times) else horizon, horizon)
            if used > 0 and times[k] < end:
                back.add(horizon - end, end - times[k], used)
        out.append(back)
    return out


def _justify(
    pinned: Sequence[_Job], middle: Sequence[_Job], laid: Schedule, base: Sequence[_Card]
) -> list[_Job]:
    """`middle` reordered by laying `laid` out again backwards (justification).

    A plan laid out in order leaves gaps: a job early in the order takes the first room it
    finds, and a larger one after it is pushed past the end. Laid out backwards from the plan's
    end instead, the last to end first and each as late as it fits, the jobs pack against the
    end; ordered by those starts, the forward plan is often shorter. (The caller keeps it only
    if it scores better.)
    """
    placements = laid.placements

    def end(job: _Job) -> float:
        return placements[job.claim.job_id].start + job.length

    horizon = max(
        [end(j) for j in (*pinned, *middle) if end(j) != _NEVER]
        + [card.times[-1] for card in base],
        default=0.0,
    )
    back = _mirrored(base, horizon)
    by_uuid = {c.uuid: c for c in back}
    for job in pinned:
        placed = placements[job.claim.job_id]
        for uuid in placed.gpu_uuids:
            if placed.start == _NEVER:
                by_uuid[uuid].blocked = True
            else:
                # Held from now to its end, as `_schedule` holds it.
                until = min(end(job), horizon)
                by_uuid[uuid].add(horizon - until, until, job.needs[uuid])
    latest: dict[str, float] = {}
    for job in sorted(middle, key=lambda j: -end(j)):
        if end(job) == _NEVER:
            continue
        at, cards = _earliest(job, [c for c in back if c.uuid in job.needs])
        if at == _NEVER:
            continue
        for card in _best_fit(job, cards, at):
            card.add(at, job.length, job.needs[card.uuid])
        latest[job.claim.job_id] = horizon - at - job.length
    return sorted(middle, key=lambda j: latest.get(j.claim.job_id, _NEVER))


def lay_out(
    rooms: Mapping[str, GpuRoom],
    claims: Sequence[Claim],
    cursor: int = -1,
    conditions: Conditions = NO_CONDITIONS,
    settings: Lookahead = DEFAULT,
    clock: Callable[[], float] | None = None,
    search: bool = True,
    hint: Sequence[str] = (),
) -> tuple[list[Claim], Schedule]:
    """The order the waiters are planned in, and the plan it makes, on the GPUs' `rooms` now.

    `clock` (seconds, monotonic) bounds the search by `settings.budget_ms`; without it only the
    number of steps does. `hint`: the order of the last plan (job ids), searched on from.
    Without `search`, the waiters with known run times are laid out in the order of `hint`
    (submission order without one), with no search.
    Waiters that differ in nothing the plan looks at are never reordered among themselves (no
    order of them is better than another).
    """
    running = [c for c in claims if c.running]
    base = _base_cards(rooms, running)
    pinned, known, unknown = _waiting_jobs(rooms, claims, conditions)

    def evaluate(middle: Sequence[_Job]) -> Schedule:
        return _schedule([*pinned, *middle, *unknown], base, rooms, cursor)

    deadline = None if clock is None else clock() + settings.budget_ms / 1000

    def in_time() -> bool:
        return deadline is None or clock is None or clock() <= deadline

    if len(known) > 1 and search and len({j.kind for j in known}) > 1:
        best, best_order = _best_start(known, hint, evaluate, in_time)
        for _ in range(_JUSTIFY_ROUNDS):
            if not in_time():
                break
            candidate = _justify(pinned, best_order, best, base)
            tried = evaluate(candidate)
            if tried.score >= best.score:
                break
            best, best_order = tried, candidate
        best, best_order = _search(best, best_order, evaluate, settings, in_time)
    else:
        # Not searched (nobody can start now): laid out as the last plan ordered the queue, so
        # the starts it tells (the wait lines, `gpuwait status`) are those the search left off at.
        best_order = list(known) if search or not hint else _in_hint_order(known, hint)
        best = evaluate(best_order)
    order = [j.claim for j in (*pinned, *best_order, *unknown)]
    return order, best


def _best_start(
    known: list[_Job],
    hint: Sequence[str],
    evaluate: Callable[[Sequence[_Job]], Schedule],
    in_time: Callable[[], bool],
) -> tuple[Schedule, list[_Job]]:
    """The best of the orders the search starts from (`_initial_orders`), as many of them as
    the budget lets it lay out: the last plan's first, since it carries the search on from one
    decision to the next (a long queue may have time for no other). Between orders whose plans
    score alike, the one `_initial_orders` lists first, so that a plan in time is the same
    whatever order they were laid out in."""
    candidates = list(enumerate(_initial_orders(known, hint)))
    if hint:
        candidates.insert(0, candidates.pop())
    tried: list[tuple[float, int, Schedule, list[_Job]]] = []
    for rank, candidate in candidates:
        if tried and not in_time():
            break
        laid = evaluate(candidate)
        tried.append((laid.score, rank, laid, candidate))
    _, _, best, best_order = min(tried, key=lambda t: (t[0], t[1]))
    return best, best_order


def _waiting_jobs(
    rooms: Mapping[str, GpuRoom], claims: Sequence[Claim], conditions: Conditions
) -> tuple[list[_Job], list[_Job], list[_Job]]:
    """The waiters free to start (no dependency left), as the plan lays them out: those planned
    with the urgent jobs (in submission order), then those with a run time, then those with
    none (each in queue order)."""
    pinned: list[_Job] = []
    known: list[_Job] = []
    unknown: list[_Job] = []
    for claim in sorted((c for c in claims if not c.running), key=Claim.sort_key):
        if claim.blocked is not None:
            continue
        needs = {
            uuid: need
            for uuid, room in rooms.items()
            if (need := _static_need(claim, room, conditions)) is not None
        }
        kept = {
            uuid: room.usable - seen.usable
            for uuid in needs
            if (seen := policy.room_for(claim, room := rooms[uuid])) is not room
        }
        job = _Job(claim, needs, _length(claim), claim.waited, kept)
        if claim.priority >= URGENT or (claim.due is not None and claim.waited >= claim.due):
            job.pinned = True
            pinned.append(job)
        elif job.length == _NEVER:
            unknown.append(job)
        else:
            known.append(job)
    pinned.sort(key=lambda j: j.claim.order)
    return pinned, known, unknown


def _strict_starts(
    gpus: Sequence[GpuSnapshot],
    claims: Sequence[Claim],
    safety: float,
    conditions: Conditions,
) -> dict[str, float | None]:
    """Seconds from now until each waiter would start in strict order (None: not known): the
    queue laid out in the order it is served in (priority, then fair share, then submission;
    the urgent jobs first), each waiter at the earliest time it fits on top of those before
    it, and one with no run time in its place, as running for ever. Unlike the plan, it puts
    no waiter last for want of a run time: a user whose job has no history yet must not have
    a budget measured behind every job of a heavier user that has one."""
    rooms = policy.gpu_rooms(gpus, claims, safety, conditions.ignore_processes)
    base = _base_cards(rooms, [c for c in claims if c.running])
    pinned, known, unknown = _waiting_jobs(rooms, claims, conditions)
    rest = sorted((*known, *unknown), key=lambda j: j.claim.sort_key())
    laid = _schedule([*pinned, *rest], base, rooms, -1)
    return _starts(claims, laid)


class _Steps:
    """A seeded stream of numbers (splitmix64): the same seed, the same search, on any
    machine; the core draws on no outside randomness."""

    __slots__ = ("state",)

    def __init__(self, seed: int) -> None:
        self.state = seed & _MASK

    def below(self, bound: int) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        return (z ^ (z >> 31)) % bound


_MASK = 2**64 - 1


def _search(
    best: Schedule,
    order: list[_Job],
    evaluate: Callable[[Sequence[_Job]], Schedule],
    settings: Lookahead,
    in_time: Callable[[], bool],
) -> tuple[Schedule, list[_Job]]:
    """Hill-climbing over swaps and moves of one job, seeded, within the step budget and while
    `in_time()` (what is left of the plan's time budget)."""
    rng = _Steps(settings.seed)
    size = len(order)
    for _ in range(settings.steps):
        if not in_time():
            break
        i, j = rng.below(size), rng.below(size)
        if i == j:
            continue
        candidate = order[:]
        if rng.below(2):
            candidate[i], candidate[j] = candidate[j], candidate[i]
        else:
            candidate.insert(j, candidate.pop(i))
        tried = evaluate(candidate)
        if tried.score < best.score:
            best, order = tried, candidate
    return best, order


def plan(
    gpus: Sequence[GpuSnapshot],
    claims: Sequence[Claim],
    safety: float,
    cursor: int = -1,
    conditions: Conditions = NO_CONDITIONS,
    limits: UserLimits | None = None,
    settings: Lookahead = DEFAULT,
    clock: Callable[[], float] | None = None,
    hint: Sequence[str] = (),
) -> Plan:
    """What starts now under the lookahead order: the waiters its plan starts at once.

    Each is checked against the GPUs' room as it stands (and its user's limits), in the plan's
    order, exactly as the in-order policy admits: the plan chooses, it never over-admits.
    `hint`: the last plan's `order`, searched on from.
    """
    claims = policy.within_vram_limit(claims, gpus, safety, limits)
    rooms = policy.gpu_rooms(gpus, claims, safety, conditions.ignore_processes)
    held_by_user = policy.user_holdings(claims) if limits is not None else {}
    running_total = sum(c.running for c in claims)
    # Waiters a per-user limit keeps from starting now are left out of the layout: planned
    # there, they would take room at once that they cannot use, and the other users' waiters
    # behind them would wait for it (a limit holds up nobody but its own user).
    left_out = policy.over_limit(claims, rooms, conditions, limits, held_by_user)
    for _ in range(_LIMIT_ROUNDS):
        planned = [c for c in claims if c.job_id not in left_out]
        now_rooms = dict(rooms)
        # The search only matters where someone can start now; most wake-ups find nobody
        # can, and every waiter plans at every wake-up.
        search = any(_fits_now(c, now_rooms, conditions) for c in planned if not c.running)
        order, laid = lay_out(now_rooms, planned, cursor, conditions, settings, clock, search, hint)
        holdings = dict(held_by_user)
        admitted: dict[str, tuple[str, ...]] = {}
        reserved: dict[str, int] = {}
        reserved_by_gpu: dict[str, dict[str, int]] = {}
        refused: dict[str, str] = {}
        next_cursor = cursor
        for claim in order:
            placed = laid.placements.get(claim.job_id)
            if placed is None or placed.start != 0.0:
                continue
            fits = [
                (room, need)
                for u in placed.gpu_uuids
                if (
                    need := policy.need_on(
                        claim, room := policy.room_for(claim, now_rooms[u]), conditions
                    )
                )
                is not None
                and need <= room.room
            ]
            if len(fits) != claim.gpus_wanted:
                continue
            refusal = policy.take(claim, fits, now_rooms, limits, holdings)
            if refusal is not None:
                refused[claim.job_id] = refusal
                continue
            admitted[claim.job_id] = placed.gpu_uuids
            reserved[claim.job_id] = max(n for _, n in fits)
            less = policy.less_on(fits)
            if less:
                reserved_by_gpu[claim.job_id] = less
            if claim.pick == "round-robin":
                next_cursor = now_rooms[placed.gpu_uuids[-1]].gpu.index
        if not refused:
            break
        # Planned again without them: the room they were given goes to whoever can use it.
        left_out.update(refused)
    cursor = next_cursor
    reasons: dict[str, WaitReason] = {}
    position = {c.job_id: n for n, c in enumerate(order)}
    waiting = sorted(
        (c for c in claims if not c.running),
        key=lambda c: position.get(c.job_id, len(order) + c.order),
    )
    hold = _hold(order, laid)
    for ahead, claim in enumerate(waiting):
        if claim.job_id in admitted:
            continue
        placed = laid.placements.get(claim.job_id)
        if claim.job_id in left_out or claim.job_id in refused:
            reason = policy.wait_reason(claim, now_rooms, running_total, ahead, conditions)
            limit = left_out.get(claim.job_id) or refused[claim.job_id]
            reasons[claim.job_id] = reason._replace(limit=limit)
            continue
        reasons[claim.job_id] = policy.wait_reason(
            claim,
            now_rooms,
            running_total,
            ahead,
            conditions,
            _planned_note(claim, placed, hold, now_rooms),
        )
    return Plan(
        admitted=admitted,
        reserved=reserved,
        waiting=reasons,
        next_cursor=cursor,
        hold=hold,
        order=tuple(c.job_id for c in order) if search else tuple(hint),
        starts=_starts(claims, laid),
        reserved_by_gpu=reserved_by_gpu,
    )


def _hold(order: Sequence[Claim], laid: Schedule) -> Hold | None:
    """The first waiter whose start cannot be told keeps its GPUs from everyone after it."""
    for claim in order:
        placed = laid.placements.get(claim.job_id)
        if placed is not None and placed.start == _NEVER and placed.gpu_uuids:
            return Hold(
                job_id=claim.job_id,
                gpu_uuids=placed.gpu_uuids,
                start_in=None,
                spare=dict.fromkeys(placed.gpu_uuids, 0),
            )
    return None


def _fits_now(claim: Claim, rooms: Mapping[str, GpuRoom], conditions: Conditions) -> bool:
    if claim.blocked is not None:
        return False
    fitting = 0
    for room in (policy.room_for(claim, r) for r in rooms.values()):
        need = policy.need_on(claim, room, conditions)
        if need is not None and need <= room.room:
            fitting += 1
    return fitting >= claim.gpus_wanted


def plan_queue(
    gpus: Sequence[GpuSnapshot],
    claims: Sequence[Claim],
    safety: float,
    cursor: int,
    conditions: Conditions,
    fair: FairShare,
    clock: Callable[[], float] | None = None,
    hint: Sequence[str] = (),
) -> Plan:
    """The plan in the queue's order: in order (`fair.order` None) or lookahead (searched on
    from `hint`, the last plan's `order`)."""
    if fair.order is None:
        return policy.plan(gpus, claims, safety, cursor, conditions, fair.limits)
    return plan(gpus, claims, safety, cursor, conditions, fair.limits, fair.order, clock, hint)


def _planned_note(
    claim: Claim, placed: Placement | None, hold: Hold | None, rooms: Mapping[str, GpuRoom]
) -> str | None:
    """Where and when the plan starts the waiter, as its wait line says it."""
    if placed is None or not placed.gpu_uuids:
        return None
    where = ",".join(f"GPU{rooms[u].gpu.index}" for u in placed.gpu_uuids if u in rooms)
    if placed.start == _NEVER:
        # Another waiter's hold, where it keeps this one off the GPUs it would take; one on
        # other GPUs (all this waiter may not use, in another Slurm allocation) holds it up not.
        if (
            hold is not None
            and hold.job_id != claim.job_id
            and not set(hold.gpu_uuids).isdisjoint(placed.gpu_uuids)
        ):
            held = ",".join(f"GPU{rooms[u].gpu.index}" for u in hold.gpu_uuids if u in rooms)
            return f"{held} held for job {hold.job_id}, whose start cannot be estimated"
        return f"{where} held for it until a job with no run-time estimate ends"
    if placed.start <= 0:
        return f"planned on {where} now"
    return f"planned on {where} in {format_duration(placed.start)}"


def expected_starts(
    gpus: Sequence[GpuSnapshot],
    claims: Sequence[Claim],
    safety: float,
    cursor: int = -1,
    conditions: Conditions = NO_CONDITIONS,
    settings: Lookahead = DEFAULT,
    search: bool = True,
) -> dict[str, float | None]:
    """Seconds from now until each waiter is planned to start (None: not known). Without
    `search`, the waiters are laid out in submission order (see `lay_out`)."""
    rooms = policy.gpu_rooms(gpus, claims, safety, conditions.ignore_processes)
    _, laid = lay_out(rooms, claims, cursor, conditions, settings, search=search)
    return _starts(claims, laid)


def _starts(claims: Sequence[Claim], laid: Schedule) -> dict[str, float | None]:
    """Seconds from now until each waiter starts in the plan `laid` (None: not known)."""
    starts: dict[str, float | None] = {c.job_id: None for c in claims if not c.running}
    for job_id, placed in laid.placements.items():
        starts[job_id] = None if placed.start == _NEVER else placed.start
    return starts


def with_wait_budgets(
    gpus: Sequence[GpuSnapshot],
    claims: Sequence[Claim],
    safety: float,
    settings: Lookahead = DEFAULT,
    conditions: Conditions = NO_CONDITIONS,
) -> list[Claim]:
    """`claims` with a wait budget (`due`) given to each waiter that has none yet.

    The budget is `max_wait_factor` times the time strict order (`_strict_starts`: the queue
    laid out in the order it is served in, urgent jobs first) takes from its submission to its
    end:
    what it has waited, plus its expected start from now, plus its expected run time where
    that is known; capped by `max_wait`. A waiter whose strict-order start cannot be told yet gets
    `max_wait` (when set), or none until it can be told.

    Why its end and not its start: a job that strict order would start at once has a start
    of 0, and a budget of a few times 0 would pin every such job at once; a budget in
    proportion to its whole turnaround leaves the plan room to fit it in.
    """
    if all(c.running or c.due is not None for c in claims):
        return list(claims)
    # The in-order plan: the queue laid out in time in submission order, with no search (one
    # pass, where simulating the in-order policy's decisions took up to a tenth of a second).
    starts = _strict_starts(gpus, claims, safety, conditions)
    out = []
    for c in claims:
        if not c.running and c.due is None:
            start = starts.get(c.job_id)
            due: float | None = settings.max_wait
            if start is not None:
                own = _length(c)
                end = c.waited + start + (0.0 if own == _NEVER else own)
                budget = settings.max_wait_factor * end
                due = budget if due is None else min(due, budget)
            c = c._replace(due=due)
        out.append(c)
    return out
