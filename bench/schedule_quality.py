"""Schedule quality: how close to the best possible does gpuwait schedule a mixed trace?

The trace (seeded, `make_trace`): 120 jobs arriving within 10 s on 4 x 48 GiB cards used up to
safety 0.9 - 80 small ones (2-6 GiB), 28 of 20-40 GiB, 12 two-GPU gangs of 12-24 GiB;
priorities 1, 3 and 5. Every figure is over seeds 1-20 (`--seeds N`) unless said otherwise.

Two lower bounds, valid for any scheduler:
(a) `lower_bound`: total VRAM x time over the usable capacity, or the longest job.
(b) `bound_b`: at any time s each job still has at least its run time minus (s - arrival) to run,
    all of it after s, and at any instant a card runs only a set of distinct jobs whose requests
    fit its usable memory (a gang counts on two cards), so makespan >= s + LP(s) / cards, where
    LP(s) is the least card-time that covers that remaining work with such sets. LP(s) is a
    covering LP solved by column generation (our own simplex; a knapsack prices new sets); the
    value used is its dual's, y . remaining / max-set-weight(y), valid for any y >= 0, so (b) is
    certified whatever the solver's accuracy. s + LP(s) / cards is convex between the points
    where a job arrives or its remaining work runs out, so those points are the only ones to try.
    `--check-bound N` solves LP(s) again with scipy (HiGHS) where it is installed.

Schedules, replayed without processes (run times: estimates from "history", each job's true run
time times a seeded lognormal factor, sigma 0.1, as gpuwait's median of earlier runs gives them;
`--exact` also prints the replays with exact run times). The policies decide with the estimates;
jobs take their true run time. One draw of that error is one sample of luck (the mean of 20 seeds
moves by about ±0.005 from one to another), so gpuwait lookahead is also replayed with further
independent draws (`--draws`, 3 in all by default) and its goals are judged over all of them:
the mean of the draws' means, the worst seed of any draw.
- gpuwait fifo: gpuwait's policy, `gpuwait.core.policy.plan` (priority then submission; the head
  holds its GPUs, backfill only where it cannot delay the head);
- gpuwait lookahead: `gpuwait.core.lookahead.plan`, with each waiter's wait budget from
  `lookahead.with_wait_budgets`;
- in-order greedy: priority order, every waiting job that fits starts, best-fit, no holds;
- EASY backfill: priority order; the head is reserved its earliest start by the running jobs'
  expected ends, later jobs start only if that cannot delay it;
- largest first: greedy, VRAM x expected time first (priority ignored);
- p5 first, largest, EASY: priority-5 jobs first, then largest first, with EASY reservations;
- offline: every job known in advance (still no start before its arrival), exact run times, list
  scheduling in an order improved by a seeded local search (CP-SAT too, where `ortools` is
  installed);
- offline on the estimates: the same search with the run times estimated as the policies have
  them (every arrival still known in advance), its order then run with the true run times: what
  planning everything ahead is worth when the run times are only estimates.
After each table, where gpuwait lookahead's makespan goes: the memory it left unused, split by
what the queue held meanwhile (`Idle`).

`--real`: the same trace run by real processes on simulated GPUs (`--real-seeds`, default the one
`--seed`): every job `gpuwait --vram ... --priority P -- <simulated job>` started at its arrival,
with a history holding one earlier run of each job's command whose run time is that job's
estimate; and two baselines, a free-memory poller and one job per GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from _common import GPUWAIT, REPO, percentile, sandbox

sys.path.insert(0, str(REPO))

GIB = 2**30
GPUS = 4
CARD_GIB = 48
SAFETY = 0.9
SIMJOB = [
    sys.executable,
    "-c",
    "import sys; from gpuwait.gpu.simjob import main; sys.exit(main(sys.argv[1:]))",
]
#: Spread of the run-time estimates (lognormal sigma): gpuwait's median of earlier runs.
ESTIMATE_SIGMA = 0.1


@dataclass
class TraceJob:
    name: str
    arrival: float
    vram_gib: int
    gpus: int
    ramp: float
    hold: float
    priority: int

    @property
    def duration(self) -> float:
        return self.ramp + self.hold


@dataclass
class Outcome:
    job: TraceJob
    start: float | None = None
    end: float | None = None
    returncode: int | None = None
    oom: bool = False


@dataclass
class Result:
    policy: str
    outcomes: list[Outcome] = field(default_factory=list)

    def makespan(self) -> float:
        return max(o.end for o in self.outcomes if o.end is not None)


def make_trace(seed: int, scale: float, arrive_within: float) -> list[TraceJob]:
    rng = random.Random(seed)
    kinds = ["small"] * 80 + ["large"] * 28 + ["gang"] * 12
    rng.shuffle(kinds)
    jobs = []
    for n, kind in enumerate(kinds):
        if kind == "small":
            vram, gpus, run = rng.randint(2, 6), 1, rng.uniform(2, 6)
        elif kind == "large":
            vram, gpus, run = rng.randint(20, 40), 1, rng.uniform(6, 14)
        else:
            vram, gpus, run = rng.randint(12, 24), 2, rng.uniform(5, 10)
        priority = rng.choices([1, 3, 5], weights=[15, 70, 15])[0]
        run *= scale
        # Arrivals thin at first, then denser: the queue ramps up.
        arrival = arrive_within * rng.random() ** 0.7
        jobs.append(
            TraceJob(
                f"j{n:03d}-{kind}",
                arrival,
                vram,
                gpus,
                round(0.3 * run, 2),
                round(0.7 * run, 2),
                priority,
            )
        )
    return sorted(jobs, key=lambda j: j.arrival)


def lower_bound(trace: list[TraceJob]) -> float:
    """The issue's bound: total VRAM x time over the usable capacity, or the longest job."""
    usable = GPUS * CARD_GIB * SAFETY
    area = sum(j.vram_gib * j.gpus * j.duration for j in trace)
    return max(area / usable, max(j.duration for j in trace))


def estimates(
    trace: Sequence[TraceJob], seed: int, exact: bool = False, draw: int = 1
) -> dict[str, float]:
    """Each job's run time as gpuwait's history gives it: the true one times a seeded lognormal
    factor (sigma ESTIMATE_SIGMA), the same for a seed and `draw` every time (draw 1 is the
    tables'; each other draw is another independent one); `exact`: the true one."""
    rng = random.Random(f"estimates-{seed}" if draw == 1 else f"e{draw}-{seed}")
    noise = {j.name: math.exp(rng.gauss(0.0, ESTIMATE_SIGMA)) for j in trace}
    return {j.name: j.duration * (1.0 if exact else noise[j.name]) for j in trace}


# ---- (b): remaining work after s, packed into sets that fit a card ----------------------------

#: Jobs this small, of one size, share one row of the covering LP (a set may take several of
#: them): a relaxation, so still a lower bound; their run times are short beside LP(s), so two
#: copies of one job in a set would gain next to nothing (`--check-bound` measures what it costs).
SMALL_GIB = 8
EPS = 1e-9


def remaining_work(trace: Sequence[TraceJob], s: float) -> list[float]:
    """Card-seconds each job still needs after s at the least: run time minus what it can have
    run since its arrival, on each of its GPUs."""
    return [j.gpus * max(0.0, j.duration - max(0.0, s - j.arrival)) for j in trace]


def breakpoints(trace: Sequence[TraceJob]) -> list[float]:
    """Where a job arrives or its remaining work runs out: between two of them every remaining
    work is affine in s, LP(s) convex, so s + LP(s) / cards is largest at one of them."""
    return sorted({j.arrival for j in trace} | {j.arrival + j.duration for j in trace})


def knapsack(
    sizes: Sequence[int], values: Sequence[float], cap: int, counts: Sequence[int] | None = None
) -> tuple[float, list[int]]:
    """The most value that items of total size <= cap hold (item i at most counts[i] times,
    once by default); exact for whole sizes. Returns (value, the items, repeated as taken)."""
    best = [0.0] * (cap + 1)
    taken: list[tuple[int, bytearray]] = []
    for i, (size, value) in enumerate(zip(sizes, values, strict=True)):
        if value <= EPS or size > cap:
            continue
        copies = 1 if counts is None else min(counts[i], cap // max(size, 1))
        for _ in range(copies):
            took = bytearray(cap + 1)
            for c in range(cap, size - 1, -1):
                v = best[c - size] + value
                if v > best[c]:
                    best[c] = v
                    took[c] = 1
            taken.append((i, took))
    c = max(range(cap + 1), key=best.__getitem__)
    value, chosen = best[c], []
    for i, took in reversed(taken):
        if took[c]:
            chosen.append(i)
            c -= sizes[i]
    return value, chosen


class CoverLP:
    """min sum x_S over sets S that fit (sizes summing to <= cap, row i at most counts[i] times)
    subject to sum_S (times row i is in S) x_S >= demand_i.

    A revised simplex with an explicit inverse, starting from each row alone (a feasible basis,
    no phase 1); entering columns come from the pool of sets found so far, else from a knapsack
    over the duals (column generation). Every knapsack call also gives a certified bound: for any
    y >= 0, demand . y / (the heaviest set's weight under y) <= the optimum. The pool is kept
    between calls (a set stays a set whatever the demands), keyed by `keys` (a row's identity).
    """

    def __init__(self) -> None:
        self.pool: list[tuple[object, ...]] = []
        self.pivots = 0

    def solve(
        self,
        keys: Sequence[object],
        sizes: Sequence[int],
        counts: Sequence[int],
        demand: Sequence[float],
        cap: int,
        rel_tol: float = 1e-6,
        max_pivots: int = 4000,
    ) -> tuple[float, float, list[float]]:
        """(certified lower bound, primal value, duals y scaled so that every set weighs <= 1)."""
        m = len(keys)
        if m == 0:
            return 0.0, 0.0, []
        pos = {k: i for i, k in enumerate(keys)}
        pool: list[tuple[int, ...]] = []
        for col in self.pool:
            rows: list[int] = []
            for k in col:
                i = pos.get(k)
                if i is not None and rows.count(i) < counts[i]:
                    rows.append(i)
            if len(rows) > 1:
                pool.append(tuple(rows))
        first_new = len(pool)
        binv = [[0.0] * m for _ in range(m)]
        for i in range(m):
            binv[i][i] = 1.0
        cost = [1.0] * m  # of the basic columns: 1 a set, 0 a surplus
        x = list(demand)
        y = [1.0] * m
        best_lb, best_y, primal = 0.0, [0.0] * m, sum(demand)
        for it in range(max_pivots):
            if it % 50 == 49:  # against drift
                y = [sum(cost[i] * binv[i][k] for i in range(m)) for k in range(m)]
                x = [sum(binv[i][k] * demand[k] for k in range(m)) for i in range(m)]
            low = min(range(m), key=y.__getitem__)
            pool_rc, pool_col = -EPS, None
            for col in pool:
                rc = 1.0 - sum(y[k] for k in col)
                if rc < pool_rc:
                    pool_rc, pool_col = rc, col
            if pool_col is not None and pool_rc <= y[low]:
                reduced, col_cost, column = pool_rc, 1.0, pool_col
            else:
                weight, chosen = knapsack(sizes, y, cap, counts)
                if weight > EPS:
                    lb = sum(d * v for d, v in zip(demand, y, strict=True) if v > 0) / weight
                    if lb > best_lb:
                        best_lb, best_y = lb, [max(0.0, v) / weight for v in y]
                primal = sum(c * xi for c, xi in zip(cost, x, strict=True))
                if primal <= best_lb * (1 + rel_tol):
                    break
                if y[low] < -EPS and -y[low] > weight - 1:
                    reduced, col_cost, column = y[low], 0.0, None
                elif weight > 1 + EPS:
                    reduced, col_cost, column = 1 - weight, 1.0, tuple(chosen)
                    pool.append(column)
                else:
                    break
            if column is None:  # the surplus of row `low`
                alpha = [-binv[i][low] for i in range(m)]
            else:
                alpha = [sum(binv[i][k] for k in column) for i in range(m)]
            r, theta = -1, math.inf
            for i in range(m):
                if alpha[i] > EPS:
                    t = x[i] / alpha[i]
                    if t < theta - 1e-12:
                        r, theta = i, t
            if r < 0:
                break  # cannot happen for a covering LP with a bounded optimum
            self.pivots += 1
            ar, row_r = alpha[r], binv[r]
            step = reduced / ar
            y = [v + step * w for v, w in zip(y, row_r, strict=True)]
            new_r = [v / ar for v in row_r]
            binv[r] = new_r
            for i in range(m):
                a = alpha[i]
                if i != r and a != 0.0:
                    binv[i] = [v - a * w for v, w in zip(binv[i], new_r, strict=True)]
                    x[i] -= theta * a
            x[r] = theta
            cost[r] = col_cost
        self.pool.extend(tuple(keys[k] for k in col) for col in pool[first_new:])
        return best_lb, primal, best_y


def card_cap() -> tuple[float, int]:
    """A card's usable GiB, and its floor: sets are judged on requests rounded down to whole
    GiB against that floor, which admits every set that really fits (and maybe more: the bound
    stays a bound); exact for whole-GiB requests, as the trace's are."""
    usable = CARD_GIB * SAFETY
    return usable, math.floor(usable + 1e-9)


def _rows(
    trace: Sequence[TraceJob], demand: Sequence[float], cap: int
) -> tuple[list[object], list[int], list[int], list[float], list[object]]:
    """The LP's rows at one s: a row per job still to run, except that small one-GPU jobs of
    one size share a row. Returns keys, sizes, counts, demands, and each job's row key."""
    keys: list[object] = []
    sizes: list[int] = []
    counts: list[int] = []
    work: list[float] = []
    index: dict[object, int] = {}
    job_key: list[object] = []
    for n, (job, d) in enumerate(zip(trace, demand, strict=True)):
        size = math.floor(job.vram_gib)
        key: object = ("size", size) if size <= SMALL_GIB and job.gpus == 1 else ("job", n)
        job_key.append(key if d > EPS else None)
        if d <= EPS:
            continue
        if key in index:
            i = index[key]
            counts[i] += 1
            work[i] += d
        else:
            index[key] = len(keys)
            keys.append(key)
            sizes.append(size)
            counts.append(1)
            work.append(d)
    return keys, sizes, counts, work, job_key


@dataclass
class BoundB:
    value: float
    at: float  # the s where it is reached
    solves: int
    pivots: int
    points: list[float]
    duals: list[list[float]]  # per job, each valid for every s
    lp_at: dict[float, tuple[float, float]]  # s -> (certified, primal) where solved


def bound_b(trace: Sequence[TraceJob], solves: int = 8) -> BoundB:
    """Bound (b), certified: max over the breakpoints s of s + LP(s) / cards, each LP(s) taken
    at its best dual found (duals found at one s are valid at every s). LP(s) is solved where
    the best figure so far is reached, until that place has been solved already."""
    _, cap = card_cap()
    points = breakpoints(trace)
    lp = CoverLP()
    # Two duals that need no LP: VRAM share, and one for each job over half a card.
    duals = [
        [math.floor(j.vram_gib) / cap for j in trace],
        [1.0 if 2 * math.floor(j.vram_gib) > cap else 0.0 for j in trace],
    ]
    demand_at = [remaining_work(trace, s) for s in points]
    covered: list[list[float]] = []

    def add(y: list[float]) -> None:
        covered.append([sum(d * v for d, v in zip(dem, y, strict=True)) for dem in demand_at])

    for y in duals:
        add(y)

    def figure(k: int) -> float:
        return points[k] + max(c[k] for c in covered) / GPUS

    lp_at: dict[float, tuple[float, float]] = {}
    for _ in range(solves):
        ranked = sorted(range(len(points)), key=figure, reverse=True)
        todo = [k for k in ranked[:3] if points[k] not in lp_at]
        top = figure(ranked[0])
        todo = [k for k in todo if k == ranked[0] or figure(k) >= top - 0.01 * top]
        if not todo:
            break
        k = todo[0]
        demand = demand_at[k]
        keys, sizes, counts, work, job_key = _rows(trace, demand, cap)
        certified, primal, y = lp.solve(keys, sizes, counts, work, cap)
        lp_at[points[k]] = (certified, primal)
        by_key = dict(zip(keys, y, strict=True))
        job_y = [by_key.get(key, 0.0) if key is not None else 0.0 for key in job_key]
        duals.append(job_y)
        add(job_y)
    best = max(range(len(points)), key=figure)
    value = max(figure(best), max(j.arrival + j.duration for j in trace))
    return BoundB(value, points[best], len(lp_at), lp.pivots, points, duals, lp_at)


def exact_lp(trace: Sequence[TraceJob], s: float, pool: list[tuple[int, ...]]) -> float | None:
    """LP(s) with every job its own row, solved by column generation with scipy's HiGHS for the
    restricted master; None where scipy is not installed. `pool`: sets found before (kept)."""
    try:
        import numpy as np
        from scipy.optimize import linprog
        from scipy.sparse import csc_matrix
    except ImportError:
        return None
    _, cap = card_cap()
    demand = remaining_work(trace, s)
    rows = [i for i, d in enumerate(demand) if d > EPS]
    if not rows:
        return 0.0
    where = {r: k for k, r in enumerate(rows)}
    sizes = [math.floor(j.vram_gib) for j in trace]
    cols = [c for c in ({i for i in col if i in where} for col in pool) if c]
    cols = [tuple(sorted(c)) for c in cols] + [(r,) for r in rows]
    b = np.array([demand[r] for r in rows])
    for _ in range(5000):
        data = [(where[i], k) for k, col in enumerate(cols) for i in col]
        matrix = csc_matrix(
            ([1.0] * len(data), ([r for r, _ in data], [k for _, k in data])),
            shape=(len(rows), len(cols)),
        )
        res = linprog(np.ones(len(cols)), A_ub=-matrix, b_ub=-b, bounds=(0, None), method="highs")
        y = [0.0] * len(trace)
        for r, v in zip(rows, -res.ineqlin.marginals, strict=True):
            y[r] = float(v)
        weight, chosen = knapsack(sizes, y, cap)
        if weight <= 1 + 1e-9:
            pool.extend(cols)
            return float(res.fun)
        cols.append(tuple(sorted(chosen)))
    return float(res.fun)


def check_bound(
    trace: Sequence[TraceJob], found: BoundB, top: int = 10
) -> tuple[float, float | None]:
    """Two checks of `bound_b`'s value, each an upper bound on what it could have missed:
    LP(s) solved at every breakpoint with the same rows (the primal's value: does solving
    only where the figure is highest miss a place?), and LP(s) with every job its own row
    solved by scipy (HiGHS) at the `top` breakpoints where the figure is highest (what sharing
    a row costs); the second is None without scipy."""
    _, cap = card_cap()
    lp = CoverLP()
    everywhere = max(j.arrival + j.duration for j in trace)
    for s in found.points:
        keys, sizes, counts, work, _ = _rows(trace, remaining_work(trace, s), cap)
        _, primal, _ = lp.solve(keys, sizes, counts, work, cap)
        everywhere = max(everywhere, s + primal / GPUS)

    def figure(s: float) -> float:
        demand = remaining_work(trace, s)
        return (
            s + max(sum(d * v for d, v in zip(demand, y, strict=True)) for y in found.duals) / GPUS
        )

    pool: list[tuple[int, ...]] = []
    exact = max(j.arrival + j.duration for j in trace)
    for s in sorted(found.points, key=figure, reverse=True)[:top]:
        value = exact_lp(trace, s, pool)
        if value is None:
            return everywhere, None
        exact = max(exact, s + value / GPUS)
    return everywhere, exact


# ---- reference schedulers, replayed without processes ----------------------------------------

Key = Callable[[TraceJob], tuple[float, ...]]


def by_priority(job: TraceJob) -> tuple[float, ...]:
    return (-job.priority, job.arrival)


def list_starts(
    trace: Sequence[TraceJob],
    key: Key,
    expected: dict[str, float],
    easy: bool = False,
) -> dict[str, float]:
    """When each job starts under a list scheduler: whenever a job ends or arrives, the waiting
    jobs are looked at in `key` order and each that fits starts, best-fit (the cards left with
    the least room). `easy`: the first that does not fit (the head) is reserved its earliest
    start by the running jobs' expected ends (`expected`: run times as the scheduler knows
    them), and a later job starts only on cards it does not delay that on: cards the head does
    not get, or ending by then, or within what the head leaves spare there. Jobs take their
    true run time, and none starts before its arrival."""
    usable = CARD_GIB * SAFETY
    free = [usable] * GPUS
    pending = sorted(trace, key=lambda j: j.arrival)
    waiting: list[TraceJob] = []
    running: list[tuple[float, float, TraceJob, list[int]]] = []  # end, expected end, job, cards
    starts: dict[str, float] = {}
    now = 0.0
    while pending or waiting or running:
        while pending and pending[0].arrival <= now + 1e-9:
            waiting.append(pending.pop(0))
        head_cards: list[int] = []
        shadow = math.inf
        spare: dict[int, float] = {}
        for job in sorted(waiting, key=key):
            need = job.vram_gib
            fits = sorted((i for i in range(GPUS) if free[i] >= need - 1e-9), key=free.__getitem__)
            in_time = now + expected[job.name] <= shadow + 1e-9
            allowed = [i for i in fits if i not in head_cards or in_time or need <= spare[i] + 1e-9]
            if len(allowed) >= job.gpus:
                chosen = allowed[: job.gpus]
                for i in chosen:
                    free[i] -= need
                    if i in head_cards and not in_time:
                        spare[i] -= need
                running.append((now + job.duration, now + expected[job.name], job, chosen))
                starts[job.name] = now
                waiting.remove(job)
            elif easy and not head_cards:
                shadow, head_cards = _reservation(job, free, running, now)
                spare = {i: 0.0 for i in head_cards}
                if head_cards:
                    at = list(free)
                    for _, end, other, cards in running:
                        if max(end, now) <= shadow:
                            for i in cards:
                                at[i] += other.vram_gib
                    spare = {i: at[i] - need for i in head_cards}
        events = [end for end, _, _, _ in running]
        if pending:
            events.append(pending[0].arrival)
        if not events:
            break  # what waits can never fit (not on this trace)
        now = min(events)
        for entry in [r for r in running if r[0] <= now + 1e-9]:
            running.remove(entry)
            for i in entry[3]:
                free[i] += entry[2].vram_gib
    return starts


def _reservation(
    job: TraceJob,
    free: list[float],
    running: list[tuple[float, float, TraceJob, list[int]]],
    now: float,
) -> tuple[float, list[int]]:
    """The head's earliest start by the running jobs' expected ends, and the cards it gets."""
    room = list(free)
    for _, end, other, cards in sorted(running, key=lambda r: r[1]):
        for i in cards:
            room[i] += other.vram_gib
        fits = sorted(
            (i for i in range(GPUS) if room[i] >= job.vram_gib - 1e-9), key=room.__getitem__
        )
        if len(fits) >= job.gpus:
            return max(end, now), fits[: job.gpus]
    return math.inf, []


def greedy_starts(trace: Sequence[TraceJob], key: Key = by_priority) -> dict[str, float]:
    """The in-order greedy with exact run times (kept for callers of the older bench)."""
    return list_starts(trace, key, {j.name: j.duration for j in trace})


def offline_starts(
    trace: Sequence[TraceJob],
    seed: int,
    steps: int = 300,
    expected: dict[str, float] | None = None,
) -> dict[str, float]:
    """Every job known in advance, exact run times: list scheduling (`list_starts`, no holds) in
    an order found by a seeded local search (swap two jobs, or move one earlier or later; keep
    what is no worse), from the best of largest-first and longest-first. With `expected`, the
    search sees those run times instead, and the order it finds is then run with the true ones."""
    if expected is not None:
        planned = [_lasting(j, expected[j.name]) for j in trace]
        rank = {name: n for n, name in enumerate(_offline_order(planned, seed, steps))}
        exact = {j.name: j.duration for j in trace}
        return list_starts(trace, lambda j: (rank[j.name],), exact)
    order = _offline_order(trace, seed, steps)
    rank = {name: n for n, name in enumerate(order)}
    return list_starts(trace, lambda j: (rank[j.name],), {j.name: j.duration for j in trace})


def _lasting(job: TraceJob, run_time: float) -> TraceJob:
    """`job` with its ramp and hold scaled to take `run_time`."""
    factor = run_time / job.duration
    return TraceJob(
        job.name,
        job.arrival,
        job.vram_gib,
        job.gpus,
        job.ramp * factor,
        job.hold * factor,
        job.priority,
    )


def _offline_order(trace: Sequence[TraceJob], seed: int, steps: int) -> list[str]:
    """`offline_starts`'s search: the order whose list schedule ends first on `trace`."""
    rng = random.Random(f"offline-{seed}")
    exact = {j.name: j.duration for j in trace}

    def run(order: list[TraceJob]) -> float:
        rank = {j.name: n for n, j in enumerate(order)}
        return makespan(trace, list_starts(trace, lambda j: (rank[j.name],), exact))

    seeds = [
        sorted(trace, key=lambda j: -j.vram_gib * j.gpus * j.duration),
        sorted(trace, key=lambda j: -j.duration),
    ]
    best_span, order = min(((run(o), o) for o in seeds), key=lambda t: t[0])
    n = len(order)
    for _ in range(steps):
        trial = list(order)
        a, b = rng.randrange(n), rng.randrange(n)
        if rng.random() < 0.5:
            trial[a], trial[b] = trial[b], trial[a]
        else:
            trial.insert(b, trial.pop(a))
        span = run(trial)
        if span <= best_span + 1e-9:
            best_span, order = span, trial
    return [j.name for j in order]


def cpsat_starts(
    trace: Sequence[TraceJob], seconds: float = 10.0, hint: dict[str, float] | None = None
) -> dict[str, float] | None:
    """The best schedule CP-SAT finds in `seconds` (times in 10 ms steps, run times rounded up;
    each job on whole cards, a card's requests within its usable memory), starting from `hint`
    (the local search's starts); None without `ortools`."""
    try:
        from ortools.sat.python import cp_model
    except ImportError:
        return None
    tick = 100
    usable = int(CARD_GIB * SAFETY * 1000)
    model = cp_model.CpModel()
    horizon = int(tick * (max(j.arrival for j in trace) + sum(j.duration for j in trace)) + 1)
    ends, starts_var, demands = [], {}, [[] for _ in range(GPUS)]
    for n, job in enumerate(trace):
        d = math.ceil(job.duration * tick)
        start = model.new_int_var(math.ceil(job.arrival * tick), horizon, f"s{n}")
        starts_var[job.name] = start
        if hint is not None:
            model.add_hint(start, math.ceil(hint[job.name] * tick))
        ends.append(start + d)
        on = [model.new_bool_var(f"on{n}_{g}") for g in range(GPUS)]
        model.add(sum(on) == job.gpus)
        for g in range(GPUS):
            interval = model.new_optional_fixed_size_interval_var(start, d, on[g], f"i{n}_{g}")
            demands[g].append((interval, int(job.vram_gib * 1000)))
    for g in range(GPUS):
        model.add_cumulative([i for i, _ in demands[g]], [v for _, v in demands[g]], usable)
    span = model.new_int_var(0, horizon, "span")
    model.add_max_equality(span, ends)
    model.minimize(span)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = seconds
    solver.parameters.num_workers = 2
    if solver.solve(model) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return {name: solver.value(v) / tick for name, v in starts_var.items()}


# ---- gpuwait's own policies, replayed without processes -------------------------------------


@dataclass
class Idle:
    """Memory the replay left unused (GiB x seconds, over every card's usable memory), split by
    what the queue held meanwhile. With the memory the jobs used it adds up to the cards' usable
    memory over the makespan: where a schedule's makespan goes."""

    #: A waiting job's memory (per GPU) would have fitted there.
    fitted: float = 0.0
    #: Jobs waited, none of them small enough for what was free there.
    none_fitted: float = 0.0
    #: Nothing waited, more jobs were still to arrive.
    none_waiting: float = 0.0
    #: Nothing waited or was still to arrive: the last jobs were running.
    drained: float = 0.0

    def add(
        self,
        running: Sequence[tuple[int, tuple[str, ...]]],
        waiting: Sequence[TraceJob],
        more_to_come: bool,
        seconds: float,
    ) -> None:
        """`seconds` of the cards holding `running` (GiB reserved, the GPUs), `waiting` waiting."""
        for index in range(GPUS):
            uuid = f"GPU-{index}"
            free = CARD_GIB * SAFETY - sum(gib for gib, uuids in running if uuid in uuids)
            idle = free * seconds
            if any(job.vram_gib <= free for job in waiting):
                self.fitted += idle
            elif waiting:
                self.none_fitted += idle
            elif more_to_come:
                self.none_waiting += idle
            else:
                self.drained += idle

    @property
    def total(self) -> float:
        return self.fitted + self.none_fitted + self.none_waiting + self.drained


def replay_starts(
    trace: Sequence[TraceJob],
    expected: dict[str, float] | None = None,
    lookahead: bool = False,
    idle: Idle | None = None,
) -> dict[str, float]:
    """When each job starts under gpuwait's plan, replayed on the trace whenever a job arrives or
    ends (or a waiter's wait budget runs out): `gpuwait.core.policy.plan` (fifo), or with
    `lookahead` `gpuwait.core.lookahead.plan`, each waiter's wait budget set by
    `lookahead.with_wait_budgets` where that exists; each plan searches on from the order of
    the one before, as the ledger keeps it. `expected`: the run times the plan is told (a running
    job's: what is left of it, never below 0); None: none (no history). `idle`: gathers the
    memory left unused from time 0 to the last end."""
    from gpuwait.core import lookahead as ahead
    from gpuwait.core import policy
    from gpuwait.core.policy import Claim
    from gpuwait.core.sizes import MemoryRequest
    from gpuwait.core.snapshot import GpuSnapshot

    settings = ahead.Lookahead()
    hint: tuple[str, ...] = ()
    budgets = getattr(ahead, "with_wait_budgets", None) if lookahead else None
    cards = [GpuSnapshot(i, f"GPU-{i}", "sim", CARD_GIB * GIB, 0) for i in range(GPUS)]
    by_name = {j.name: j for j in trace}
    pending = sorted(trace, key=lambda j: j.arrival)
    claims: list[Claim] = []
    ends: dict[str, float] = {}
    starts: dict[str, float] = {}
    due: dict[str, float] = {}
    now = 0.0
    order = 0
    while pending or claims:
        while pending and pending[0].arrival <= now + 1e-9:
            job = pending.pop(0)
            order += 1
            claims.append(
                Claim(
                    job.name,
                    False,
                    job.priority,
                    order,
                    MemoryRequest(bytes=job.vram_gib * GIB),
                    job.gpus,
                    expected_seconds=None if expected is None else expected[job.name],
                )
            )
        done = {name for name, end in ends.items() if end <= now + 1e-9}
        for name in done:
            del ends[name]
        current = []
        for c in claims:
            if c.job_id in done:
                continue
            job = by_name[c.job_id]
            if expected is not None and c.running:
                left = max(0.0, starts[c.job_id] + expected[c.job_id] - now)
                c = c._replace(expected_seconds=left, ran=now - starts[c.job_id])
            if not c.running:
                c = c._replace(waited=now - job.arrival, due=due.get(c.job_id, c.due))
            current.append(c)
        if lookahead:
            if budgets is not None:
                current = list(budgets(cards, current, SAFETY, settings))
                due.update({c.job_id: c.due for c in current if c.due is not None})
            decided = ahead.plan(cards, current, SAFETY, settings=settings, hint=hint)
            if decided.admitted:
                # Written to the ledger by the admission (a plan that starts nobody is not).
                hint = decided.order
        else:
            decided = policy.plan(cards, current, SAFETY)
        kept = []
        for c in current:
            if c.job_id in decided.admitted:
                ends[c.job_id] = now + by_name[c.job_id].duration
                starts[c.job_id] = now
                c = c._replace(
                    running=True,
                    gpu_uuids=decided.admitted[c.job_id],
                    reserved_bytes=decided.reserved[c.job_id],
                )
            elif decided.hold is not None and c.job_id == decided.hold.job_id:
                c = c._replace(held=decided.hold.gpu_uuids)
            kept.append(c)
        claims = kept
        events = list(ends.values())
        if pending:
            events.append(pending[0].arrival)
        for c in claims:
            if not c.running and c.job_id in due:
                at = by_name[c.job_id].arrival + due[c.job_id]
                if at > now + 1e-6:
                    events.append(at)
        if not events:
            break  # nothing will change: what waits never fits (not on this trace)
        if idle is not None:
            idle.add(
                [(by_name[c.job_id].vram_gib, c.gpu_uuids) for c in claims if c.running],
                [by_name[c.job_id] for c in claims if not c.running],
                bool(pending),
                min(events) - now,
            )
        now = min(events)
    return starts


def makespan(trace: Sequence[TraceJob], starts: dict[str, float]) -> float:
    return max(starts[j.name] + j.duration for j in trace)


# ---- one seed's figures, and the table over seeds --------------------------------------------


@dataclass
class Row:
    """A policy's figures on one seed (waits in seconds; oom None for replays)."""

    span: float
    bound_a: float
    bound_b: float
    p5: float
    p1: float
    longest: float
    oom: int | None = None
    idle: Idle | None = None


def row_of(
    trace: Sequence[TraceJob],
    starts: dict[str, float],
    a: float,
    b: float,
    span: float | None = None,
) -> Row:
    waits = {j.name: starts[j.name] - j.arrival for j in trace}

    def p95(priority: int) -> float:
        chosen = [waits[j.name] for j in trace if j.priority == priority]
        return percentile(chosen, 95) if chosen else 0.0

    return Row(
        makespan(trace, starts) if span is None else span, a, b, p95(5), p95(1), max(waits.values())
    )


REFERENCES = (
    "gpuwait fifo (replay)",
    "gpuwait lookahead (replay)",
    "in-order greedy",
    "EASY backfill",
    "largest first",
    "p5 first, largest, EASY",
    "offline (list + local search)",
    "offline on the estimates",
    "offline (CP-SAT)",
)


def seed_rows(
    seed: int, scale: float, arrive_within: float, exact: bool, cpsat: float, draws: int = 1
) -> tuple[dict[str, Row], BoundB]:
    """Every replayed policy's figures on one seed, and bound (b); with estimated run times,
    also gpuwait lookahead's with each further draw of the estimates' error (`draw_name`)."""
    trace = make_trace(seed, scale, arrive_within)
    a = lower_bound(trace)
    found = bound_b(trace)
    b = found.value
    expected = estimates(trace, seed, exact)

    def largest(j: TraceJob) -> tuple[float, ...]:
        return (-j.vram_gib * j.gpus * expected[j.name], j.arrival)

    def urgent_largest(j: TraceJob) -> tuple[float, ...]:
        return (j.priority != 5, *largest(j))

    idle = Idle()
    runs = {
        "gpuwait fifo (replay)": replay_starts(trace, expected),
        "gpuwait lookahead (replay)": replay_starts(trace, expected, lookahead=True, idle=idle),
        "in-order greedy": list_starts(trace, by_priority, expected),
        "EASY backfill": list_starts(trace, by_priority, expected, easy=True),
        "largest first": list_starts(trace, largest, expected),
        "p5 first, largest, EASY": list_starts(trace, urgent_largest, expected, easy=True),
        "offline (list + local search)": offline_starts(trace, seed),
    }
    if not exact:
        runs["offline on the estimates"] = offline_starts(trace, seed, expected=expected)
    if cpsat > 0:
        found_cp = cpsat_starts(trace, cpsat, runs["offline (list + local search)"])
        if found_cp is not None:
            runs["offline (CP-SAT)"] = found_cp
    for draw in range(2, 1 if exact else draws + 1):
        other = estimates(trace, seed, draw=draw)
        runs[draw_name(draw)] = replay_starts(trace, other, lookahead=True)
    rows = {name: row_of(trace, starts, a, b) for name, starts in runs.items()}
    rows["gpuwait lookahead (replay)"].idle = idle
    return rows, found


def draw_name(draw: int) -> str:
    """The row of gpuwait lookahead replayed with the `draw`th draw of the estimates' error."""
    return "gpuwait lookahead (replay)" if draw == 1 else f"gpuwait lookahead, draw {draw}"


def _seed_job(
    args: tuple[int, float, float, bool, float, int],
) -> tuple[int, dict[str, Row], BoundB, float]:
    t0 = time.monotonic()
    rows, found = seed_rows(*args)
    return args[0], rows, found, time.monotonic() - t0


def all_seeds(
    seeds: Sequence[int],
    scale: float,
    arrive_within: float,
    exact: bool,
    cpsat: float,
    jobs: int,
    draws: int = 1,
) -> list[tuple[int, dict[str, Row], BoundB, float]]:
    work = [(s, scale, arrive_within, exact, cpsat, draws) for s in seeds]
    if jobs <= 1:
        return [_seed_job(w) for w in work]
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(_seed_job, work))


HEADER = (
    f"{'policy':<30} {'/(a) mean':>9} {'max':>5}  {'/(b) mean':>9} {'max':>5}"
    f"  {'p5 p95':>6} {'p1 p95':>6} {'max wait':>8}  {'OOM':>4}"
)


def table_line(name: str, rows: Sequence[Row]) -> str:
    to_a = [r.span / r.bound_a for r in rows]
    to_b = [r.span / r.bound_b for r in rows]
    ooms = [r.oom for r in rows]
    oom = "-" if any(o is None for o in ooms) else str(sum(o or 0 for o in ooms))
    return (
        f"{name:<30} {statistics.mean(to_a):9.3f} {max(to_a):5.3f}  {statistics.mean(to_b):9.3f}"
        f" {max(to_b):5.3f}  {statistics.mean(r.p5 for r in rows):5.1f}s"
        f" {statistics.mean(r.p1 for r in rows):5.1f}s {statistics.mean(r.longest for r in rows):7.1f}s"
        f"  {oom:>4}"
    )


def draws_line(draws: Sequence[Sequence[Row]]) -> str:
    """gpuwait lookahead with each independent draw of the estimates' error: its mean and worst
    seed ÷ (b) (the table's row is the first draw's)."""
    figures = [[r.span / r.bound_b for r in each] for each in draws]
    means = " ".join(f"{statistics.mean(f):.3f}" for f in figures)
    worst = " ".join(f"{max(f):.3f}" for f in figures)
    return (
        f"gpuwait lookahead (replay) with {len(draws)} independent draws of the estimates' error:"
        f" /(b) mean {means} (together {statistics.mean(statistics.mean(f) for f in figures):.3f}),"
        f" worst seed {worst}"
    )


def idle_line(rows: Sequence[Row]) -> str:
    """Where the makespan goes: the memory left unused, in seconds of every card's usable
    memory (mean over seeds), by what the queue held meanwhile."""
    usable = GPUS * CARD_GIB * SAFETY
    idles = [r.idle for r in rows if r.idle is not None]

    def mean(part: Callable[[Idle], float]) -> float:
        return statistics.mean(part(i) / usable for i in idles)

    return (
        f"memory left unused, gpuwait lookahead (replay), in seconds of all {GPUS} cards:"
        f" {mean(lambda i: i.total):.1f} of the makespan's {statistics.mean(r.span for r in rows):.1f}\n"
        f"  while a waiting job would have fitted there {mean(lambda i: i.fitted):.1f},"
        f" jobs waited and none fitted {mean(lambda i: i.none_fitted):.1f},"
        f" none waited {mean(lambda i: i.none_waiting):.1f},"
        f" none was left to start {mean(lambda i: i.drained):.1f}"
    )


def goals(draws: Sequence[Sequence[Row]], greedy: Sequence[Row]) -> list[str]:
    """The issue's goals for one policy, replayed with each draw of the estimates' error in
    `draws` (one row per seed each), each with whether it is met: the mean over the draws of
    each draw's mean, the worst seed of any draw, the waits over them all."""
    rows = [r for each in draws for r in each]
    to_b = [r.span / r.bound_b for r in rows]
    mean_b = statistics.mean(statistics.mean(r.span / r.bound_b for r in each) for each in draws)
    worst = max(to_b)
    p5 = statistics.mean(r.p5 for r in rows)
    longest = statistics.mean(r.longest for r in rows)
    greedy_longest = statistics.mean(r.longest for r in greedy)
    ooms = [r.oom for r in rows if r.oom is not None]

    def met(ok: bool) -> str:
        return "met" if ok else "NOT met"

    lines = [
        f"  mean <= 1.12 x (b) (stretch 1.10): {mean_b:.3f}, {met(mean_b <= 1.12)}"
        f" (stretch {met(mean_b <= 1.10)})",
        f"  no seed above 1.18 x (b): worst {worst:.3f}, {met(worst <= 1.18)}",
        f"  priority-5 p95 wait <= 5 s: {p5:.1f}s, {met(p5 <= 5.0)}",
        f"  max wait <= 1.1 x the in-order greedy's ({greedy_longest:.1f}s): {longest:.1f}s,"
        f" {met(longest <= 1.1 * greedy_longest)}",
    ]
    if ooms:
        lines.append(f"  0 OOM: {sum(ooms)}, {met(sum(ooms) == 0)}")
    return lines


# ---- real processes on simulated GPUs ---------------------------------------------------------


def seed_history(
    env: dict[str, str], trace: Sequence[TraceJob], expected: dict[str, float]
) -> None:
    """One earlier run of each job's exact command, taking its estimate, written with gpuwait's
    own history code, so that gpuwait learns its run time as it would from real history."""
    from gpuwait.core.estimate import DEFAULT_HISTORY_MAX_BYTES
    from gpuwait.history import learn, record

    state = Path(env["XDG_STATE_HOME"]) / "gpuwait"
    state.mkdir(parents=True, exist_ok=True)
    cwd = os.getcwd()
    then = time.time() - 3600
    for n, job in enumerate(trace):
        run = record.build(
            job_id=f"history-{n}",
            name=None,
            batch=None,
            command=job_command(job),
            cwd=cwd,
            key=None,
            history_commands="full",
            request={"bytes": job.vram_gib * GIB},
            request_source="flag",
            reserved_bytes=job.vram_gib * GIB,
            gpus=(),
            measured=record.Measured(
                peak_by_gpu={},
                peak_approximate=False,
                time_to_peak=None,
                samples=3,
                free_at_peak_bytes={},
                run_seconds=expected[job.name],
                returncode=0,
                oom=False,
                oom_evidence=None,
                stderr_watched="off",
            ),
            wait_seconds=0.0,
            started_at=then + n,
        )
        learn.save_record(state, run, DEFAULT_HISTORY_MAX_BYTES)


def learned_run_time(env: dict[str, str], job: TraceJob) -> str:
    """What `gpuwait estimate` says of the job's command (its run-time line)."""
    out = subprocess.run(
        [*GPUWAIT, "estimate", "--json", "--", *job_command(job)],
        env=env,
        capture_output=True,
        text=True,
    )
    try:
        found = json.loads(out.stdout)
    except ValueError:
        return f"unreadable ({out.stderr.strip()[:200]})"
    for key in ("run_time", "run_seconds", "runtime"):
        if key in found:
            return f"{key} {found[key]}"
    return json.dumps(found)[:300]


def queue_orders() -> list[str]:
    """The queue orders to run: `fifo` and `lookahead` where `gpuwait config` lists a
    queue_order setting, else only the default."""
    env = sandbox(gpus=1, memory="1GiB")
    listing = subprocess.run([*GPUWAIT, "config"], env=env, capture_output=True, text=True).stdout
    return ["fifo", "lookahead"] if "queue_order" in listing else ["default"]


def job_command(job: TraceJob) -> list[str]:
    """The simulated job; a gang runs one simulated process per GPU it was given."""
    args = ["--vram", f"{job.vram_gib}G", "--ramp", f"{job.ramp}s", "--hold", f"{job.hold}s"]
    if job.gpus == 1:
        return [*SIMJOB, *args]
    one = " ".join(f"'{a}'" for a in [*SIMJOB, *args])
    script = (
        'pids=""; for d in $(echo "$CUDA_VISIBLE_DEVICES" | tr , " "); do '
        f'CUDA_VISIBLE_DEVICES=$d {one} & pids="$pids $!"; done; '
        "fail=0; for p in $pids; do wait $p || fail=1; done; exit $fail"
    )
    return ["sh", "-c", script]


def gpu_uuids(env: dict[str, str]) -> list[str]:
    from gpuwait.gpu.sim import SimBackend

    return [g.uuid for g in SimBackend(env["GPUWAIT_SIM"]).snapshot().gpus]


def free_bytes(env: dict[str, str]) -> dict[str, int]:
    from gpuwait.gpu.sim import SimBackend

    return {g.uuid: g.free_bytes for g in SimBackend(env["GPUWAIT_SIM"]).snapshot().gpus}


class Runner:
    """Starts trace jobs at their arrival (or when a baseline decides) and reaps them."""

    def __init__(self, policy: str, trace: list[TraceJob], env: dict[str, str]) -> None:
        self.result = Result(policy, [Outcome(j) for j in trace])
        self.env = env
        self.logs = Path(env["XDG_STATE_HOME"]).parent / "logs"
        self.logs.mkdir()
        self.running: dict[subprocess.Popen[bytes], Outcome] = {}
        self.t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def start(self, outcome: Outcome, argv: list[str], env: dict[str, str]) -> None:
        log = open(self.logs / outcome.job.name, "wb")  # noqa: SIM115 - closed by the child's end
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=log)
        log.close()
        self.running[proc] = outcome

    def reap(self) -> list[Outcome]:
        ended = []
        for proc, outcome in list(self.running.items()):
            code = proc.poll()
            if code is None:
                continue
            del self.running[proc]
            outcome.end, outcome.returncode = self.now(), code
            outcome.oom = "out of memory" in (self.logs / outcome.job.name).read_text(
                errors="replace"
            )
            ended.append(outcome)
        return ended


def run_gpuwait(
    trace: list[TraceJob], expected: dict[str, float], order: str = "default"
) -> tuple[Result, str]:
    """The trace under gpuwait, its history seeded (see seed_history); with `order` other than
    default, GPUWAIT_QUEUE_ORDER set to it. Returns the result and what `gpuwait estimate`
    learned for the first job."""
    env = sandbox(gpus=GPUS, memory=f"{CARD_GIB}GiB")
    if order != "default":
        env["GPUWAIT_QUEUE_ORDER"] = order
    seed_history(env, trace, expected)
    learned = learned_run_time(env, trace[0])
    runner = Runner(f"gpuwait {order}", trace, env)
    pending = list(runner.result.outcomes)
    while pending or runner.running:
        while pending and pending[0].job.arrival <= runner.now():
            outcome = pending.pop(0)
            job = outcome.job
            argv = [
                *GPUWAIT,
                "--vram",
                f"{job.vram_gib}G",
                "--gpus",
                str(job.gpus),
                "--priority",
                str(job.priority),
                "--name",
                job.name,
                "--batch",
                "trace",
                "-q",
                "--",
                *job_command(job),
            ]
            runner.start(outcome, argv, env)
        runner.reap()
        time.sleep(0.02)
    # Start times from gpuwait's own event log: when each job was admitted.
    events = Path(env["XDG_STATE_HOME"]) / "gpuwait" / "events.jsonl"
    started = {}
    for line in events.read_text().splitlines():
        event = json.loads(line)
        if event["kind"] == "admit":
            started[event["name"]] = event["time"]
    wall0 = time.time() - runner.now()
    for outcome in runner.result.outcomes:
        if outcome.job.name in started:
            outcome.start = started[outcome.job.name] - wall0
    return runner.result, learned


def run_baseline(trace: list[TraceJob], policy: str, poll: float) -> Result:
    """A free-memory poller (`poller`) or one job per GPU (`one-per-gpu`), polling every
    `poll` seconds, in priority order."""
    env = sandbox(gpus=GPUS, memory=f"{CARD_GIB}GiB")
    runner = Runner(policy, trace, env)
    uuids = gpu_uuids(env)
    busy: dict[str, int] = dict.fromkeys(uuids, 0)  # jobs this baseline runs on each GPU
    where: dict[int, list[str]] = {}
    waiting: list[Outcome] = []
    pending = list(runner.result.outcomes)
    next_poll = 0.0
    while pending or waiting or runner.running:
        while pending and pending[0].job.arrival <= runner.now():
            waiting.append(pending.pop(0))
        for outcome in runner.reap():
            for uuid in where.pop(id(outcome)):
                busy[uuid] -= 1
        if runner.now() >= next_poll and waiting:
            next_poll = runner.now() + poll
            free = free_bytes(env)
            for outcome in sorted(waiting, key=lambda o: (-o.job.priority, o.job.arrival)):
                job = outcome.job
                if policy == "poller":
                    fits = [u for u in uuids if free[u] >= job.vram_gib * GIB]
                else:
                    fits = [u for u in uuids if busy[u] == 0]
                if len(fits) < job.gpus:
                    continue
                chosen = fits[: job.gpus]
                for uuid in chosen:
                    free[uuid] -= job.vram_gib * GIB
                    busy[uuid] += 1
                where[id(outcome)] = chosen
                waiting.remove(outcome)
                outcome.start = runner.now()
                child_env = {
                    **env,
                    "CUDA_VISIBLE_DEVICES": ",".join(chosen),
                    "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                }
                runner.start(outcome, job_command(job), child_env)
        time.sleep(0.02)
    return runner.result


def real_row(result: Result, a: float, b: float) -> Row:
    """A real run's figures; a job that never started counts as waiting until the end."""
    span = result.makespan()
    starts = {o.job.name: o.start if o.start is not None else span for o in result.outcomes}
    trace = [o.job for o in result.outcomes]
    row = row_of(trace, starts, a, b)
    ends = [o.end for o in result.outcomes if o.end is not None]
    return Row(max(ends), a, b, row.p5, row.p1, row.longest, sum(o.oom for o in result.outcomes))


def replays(args: argparse.Namespace, seeds: list[int], t0: float) -> None:
    """The replayed part: bounds, the table, the goals (and --check-bound)."""
    print(
        f"trace: 120 jobs (80 small, 28 of 20-40 GiB, 12 2-GPU gangs) arriving within"
        f" {args.arrive_within:g}s, on {GPUS} x {CARD_GIB} GiB at safety {SAFETY}; seeds"
        f" {seeds[0]}-{seeds[-1]}; run times: true x lognormal(sigma {ESTIMATE_SIGMA}) estimates",
        flush=True,
    )
    modes = [False, True] if args.exact else [False]
    results = {}
    for exact in modes:
        results[exact] = all_seeds(
            seeds, args.scale, args.arrive_within, exact, args.cpsat, args.jobs, args.draws
        )
    first = results[False]
    ratio = [f.value / rows["in-order greedy"].bound_a for _, rows, f, _ in first]
    print(
        f"bound (b) / bound (a): mean {statistics.mean(ratio):.3f}, max {max(ratio):.3f},"
        f" above 1.10 on {sum(r > 1.10 for r in ratio)} of {len(ratio)} seeds;"
        f" LPs solved per seed {statistics.mean(f.solves for _, _, f, _ in first):.1f}"
    )
    try:
        import ortools  # noqa: F401

        cp = f"CP-SAT: {args.cpsat:g}s per seed" if args.cpsat > 0 else "CP-SAT: off"
    except ImportError:
        cp = "CP-SAT: not installed"
    for exact in modes:
        each = results[exact]
        print()
        print(
            f"replayed without processes, run times {'exact' if exact else 'estimated'}"
            f" ({cp}); waits: mean over seeds of each seed's p95 / longest"
        )
        print(HEADER)
        for name in REFERENCES:
            rows = [r[name] for _, r, _, _ in each if name in r]
            if rows:
                print(table_line(name, rows))
        look = [r["gpuwait lookahead (replay)"] for _, r, _, _ in each]
        greedy = [r["in-order greedy"] for _, r, _, _ in each]
        draws = (
            [[r[draw_name(d)] for _, r, _, _ in each] for d in range(1, args.draws + 1)]
            if not exact
            else [look]
        )
        if len(draws) > 1:
            print(draws_line(draws))
        print(
            "goals, gpuwait lookahead (replay)"
            + (f", over the {len(draws)} draws:" if len(draws) > 1 else ":")
        )
        print("\n".join(goals(draws, greedy)))
        print(idle_line(look))
    print(
        f"(replays: {time.monotonic() - t0:.1f}s wall; per seed"
        f" {statistics.mean(t for *_, t in first):.1f}s in {args.jobs} processes)",
        flush=True,
    )
    if args.check_bound:
        every, exact = [], []
        for seed, _, found, _ in first:
            trace = make_trace(seed, args.scale, args.arrive_within)
            at_all, at_top = check_bound(trace, found, args.check_bound)
            every.append((at_all - found.value) / at_all)
            if at_top is not None:
                exact.append((at_top - found.value) / at_top)
        print(
            f"check of (b): LP(s) solved at every breakpoint: (b) below it by at most"
            f" {100 * max(every):.4f}%"
        )
        if exact:
            print(
                f"check of (b): every job its own row, scipy (HiGHS), the {args.check_bound}"
                f" best points: (b) below it by mean {100 * statistics.mean(exact):.4f}%,"
                f" at most {100 * max(exact):.4f}%"
            )
        else:
            print("check of (b) with scipy: scipy is not installed")


def main(argv: Sequence[str] | None = None) -> None:
    global CARD_GIB
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=20, metavar="N", help="replay seeds 1..N")
    parser.add_argument("--scale", type=float, default=0.6, help="multiply every run time")
    parser.add_argument("--arrive-within", type=float, default=10.0, help="seconds")
    parser.add_argument("--card-gib", type=int, default=CARD_GIB, help="memory of each GPU")
    parser.add_argument("--exact", action="store_true", help="also replay with exact run times")
    parser.add_argument(
        "--cpsat", type=float, default=10.0, metavar="S", help="CP-SAT's seconds per seed (0: off)"
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes")
    parser.add_argument(
        "--draws",
        type=int,
        default=3,
        metavar="N",
        help="replay gpuwait lookahead with N independent draws of the estimates' error; the"
        " goals are judged over them all (one draw is one sample of luck)",
    )
    parser.add_argument(
        "--check-bound",
        type=int,
        default=0,
        metavar="N",
        help="check (b): LP(s) at every breakpoint, and with scipy at the N best of each seed",
    )
    parser.add_argument("--real", action="store_true", help="also run real processes (minutes)")
    parser.add_argument("--seed", type=int, default=4, help="the seed of --real's default")
    parser.add_argument("--real-seeds", default=None, help="comma-separated (default: --seed)")
    parser.add_argument("--poll", type=float, default=0.5, help="baselines' polling interval")
    parser.add_argument(
        "--policies", default="gpuwait,poller,one-per-gpu", help="--real: comma-separated subset"
    )
    args = parser.parse_args(argv)
    CARD_GIB = args.card_gib
    seeds = list(range(1, args.seeds + 1))
    t0 = time.monotonic()
    if seeds:
        replays(args, seeds, t0)
    if not args.real:
        return
    real_seeds = [int(s) for s in (args.real_seeds or str(args.seed)).split(",")]
    policies = [p for p in args.policies.split(",") if p]
    rows_by: dict[str, list[Row]] = {}
    for seed in real_seeds:
        trace = make_trace(seed, args.scale, args.arrive_within)
        a, b = lower_bound(trace), bound_b(trace).value
        expected = estimates(trace, seed)
        for policy in policies:
            if policy == "gpuwait":
                for order in queue_orders():
                    result, learned = run_gpuwait(trace, expected, order)
                    print(f"seed {seed}, gpuwait {order}: history gives {trace[0].name}: {learned}")
                    rows_by.setdefault(result.policy, []).append(real_row(result, a, b))
            else:
                result = run_baseline(trace, policy, args.poll)
                rows_by.setdefault(policy, []).append(real_row(result, a, b))
    print()
    print(f"real processes on simulated GPUs, seeds {','.join(map(str, real_seeds))}")
    print(HEADER)
    for name, rows in rows_by.items():
        print(table_line(name, rows))
    print("(a baseline's makespan counts jobs that died of OOM early)")


if __name__ == "__main__":
    main()
