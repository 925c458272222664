"""How much VRAM a command needs, and how long it runs, learned from its earlier runs. Pure.

No I/O and no clock: the runs and `now` are passed in, so every rule here is property-tested
(tests/core/test_estimate.py).

The rules:
- Only the command's own runs count: the levels `key`, `command` and `script` (see
  gpuwait.core.cmdkey). The `program` level counts only for a program that does not run other
  code (never python, bash, torchrun, env ...: `usable_levels` is told which) and only when its
  runs agree: at least MIN_RUNS recent successes whose peaks lie within AGREE_BAND of each other.
  A command with none of these gets no estimate, so gpuwait asks for default_vram.
- Runs are looked up at the finest usable level that has at least MIN_RUNS successful runs; with
  none, the finest usable level with any.
- At the exact command (or --key), of the most recent WINDOW successful runs the QUANTILE of the
  peaks is taken, each run weighted by age (halved every HALF_LIFE; runs older than MAX_AGE are
  left out; a run dated over a day after now was recorded while the wall clock was ahead, and
  counts as the oldest). A high quantile rather than the last value or the mean: one small run must not
  starve the next, and one odd spike among many must not reserve for ever. Nor is it below the
  second-lowest peak: the newest run, weighing more than many old ones together, would
  otherwise set it alone.
- At a coarser level (the same script with other arguments, or an agreeing program) it is the
  largest recent peak there: other arguments may need more than any one run showed.
- Finer levels with fewer runs still count: the estimate never goes below the highest peak seen
  at a finer level.
- Then the margin (10 % by default) is added and the result rounded up to a tidy size.
- A command that sizes itself from its reservation (vLLM told GPUWAIT_VRAM_FRACTION) takes what
  it is given: its runs that took it count for no more than their reservation, and where all
  the runs behind the estimate are such, no margin is added. Else every run would take the
  margin more than the last, without end.
- An out-of-memory failure newer than the last success raises the estimate above what that run
  had: OOM_GROWTH times the larger of its peak and its reservation, or what its error message
  said it needed at the least (what it had plus what it tried to allocate) with the margin,
  whichever is more (usable levels only: another script's failure says nothing about this one).
- The size is per GPU, for a job on a given number of GPUs: runs on as many GPUs count alone
  where there are at least MIN_RUNS successful ones; else a run on more GPUs counts for
  what it held in all, spread over the job's (a model split across the cards it is given needs
  twice as much on each of half as many).
- Run times (ETAs, time left, backfill) come from the same usable levels.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from gpuwait.core.record import Record

MiB = 2**20
GiB = 2**30

QUANTILE = 0.95
WINDOW = 20
MIN_RUNS = 3
HALF_LIFE = 14 * 86400.0
MAX_AGE = 120 * 86400.0
#: A run dated later than this after now was recorded while the wall clock was ahead (one
#: machine's clock a little ahead of another's, sharing a history, is no such run).
FUTURE_SLACK = 86400.0
OOM_GROWTH = 1.5
MIN_ESTIMATE = 256 * MiB
#: estimate_margin's default: added on top of a learned estimate.
DEFAULT_MARGIN = 0.1
#: history_max_size's default: the size at which the history is compacted.
DEFAULT_HISTORY_MAX_BYTES = 64 * MiB
#: The program level's runs agree when their peaks differ by at most this much of the largest
#: (or 256 MiB, whichever is more).
AGREE_BAND = 0.2
#: Levels at which the estimate is a quantile; elsewhere it is the largest peak.
EXACT_LEVELS = ("key", "command")
#: A command that sizes itself from its reservation took what it was given when its peak came
#: this close to it (vLLM takes its fraction of CUDA's total, a little under NVML's).
TOOK_GIVEN = 0.95
#: A job has loaded its model once it reaches this fraction of its peak.
LOADED_FRACTION = 0.9


class RunStat(Record, frozen=True):
    """What estimates need from one run record."""

    started_at: float
    #: Peak VRAM per GPU in bytes; None when it could not be measured.
    peak_bytes: int | None
    reserved_bytes: int
    #: Exited with status 0.
    ok: bool
    oom: bool
    #: Nobody saw how it ended (its gpuwait killed, an adopted process): no exit status, no
    #: signal.
    unseen: bool = False
    #: The peak came from the device's used memory, not from per-process figures.
    approximate: bool = False
    run_seconds: float = 0.0
    wait_seconds: float = 0.0
    time_to_peak: float | None = None
    #: The GPUs it ran on (UUIDs); empty where the record does not say.
    gpu_uuids: tuple[str, ...] = ()
    #: What it held on all of them together: the sum of its peaks on each; None where the
    #: record does not say (then `peak_bytes` on each is assumed).
    held_bytes: int | None = None
    #: The command sized itself from its reservation (a server told GPUWAIT_VRAM_FRACTION): it
    #: took what it was given, so its peak says what it was given, not what it needs.
    sized_by_reservation: bool = False
    #: Ran out of memory, and its error message said it needed at least this much (what it had
    #: plus what it tried to allocate, `oom_wanted`); None where no message said.
    oom_wanted_bytes: int | None = None


class Spread(Record, frozen=True):
    """A median with the range around it (25th to 75th percentile) over `runs` values."""

    median: float
    low: float
    high: float
    runs: int


class Estimate(Record, frozen=True):
    """A learned VRAM request, or None with the reason why not."""

    bytes: int | None
    #: The level the runs came from ("command", "script", "program" or "key"); None: no history.
    level: str | None
    #: Successful runs behind the quantile.
    runs: int = 0
    quantile_bytes: int = 0
    #: The lowest and highest peak among those runs.
    low_bytes: int = 0
    high_bytes: int = 0
    #: Highest peak at a finer level, when it is above the quantile.
    finer_floor_bytes: int = 0
    #: The second-lowest peak, when it is above the quantile (one run never lowers it alone).
    second_lowest_bytes: int = 0
    #: OOM_GROWTH times what the last failed run had, when an OOM is newer than the last success.
    oom_floor_bytes: int = 0
    margin: float = 0.0
    approximate: bool = False
    #: "quantile" (the exact command's runs) or "largest" (a coarser level's largest peak).
    rule: str = "quantile"
    #: Runs on more GPUs than the job's counted for what they held in all (`for_gpus`).
    spread_over_fewer: bool = False
    #: All the runs behind it sized themselves from their reservation: no margin was added.
    sized_by_reservation: bool = False

    @property
    def raised_by_oom(self) -> bool:
        return self.oom_floor_bytes > 0 and self.bytes == self.oom_floor_bytes


def weighted_quantile(values: Sequence[float], weights: Sequence[float], q: float) -> float:
    """The smallest value whose cumulative weight reaches `q` of the total (inverted CDF)."""
    if not values or len(values) != len(weights):
        raise ValueError("need as many weights as values, and at least one")
    pairs = sorted(zip(values, weights, strict=True))
    total = sum(w for _, w in pairs)
    if total <= 0:
        return pairs[-1][0]
    target = q * total
    cumulative = 0.0
    for value, weight in pairs:
        cumulative += weight
        # A little slack so rounding in the sum never skips past the value that reaches q.
        if cumulative >= target * (1 - 1e-12):
            return value
    return pairs[-1][0]


def age_weight(age_seconds: float, half_life: float = HALF_LIFE) -> float:
    """1 for a run that just ended, halving every `half_life` seconds."""
    return float(0.5 ** (max(0.0, age_seconds) / half_life))


def tidy_size(n_bytes: float) -> int:
    """Round up to a size a person would type: 16 steps per power of two, at least 64 MiB steps.

    3.3 GiB becomes 3.375 GiB, 700 MiB becomes 704 MiB; the rounding adds at most 6.25 %.
    """
    if n_bytes <= 0:
        return 0
    step = max(64 * MiB, 2 ** (math.floor(math.log2(n_bytes)) - 4))
    return int(math.ceil(n_bytes / step) * step)


def age(run: RunStat, now: float, max_age: float = MAX_AGE) -> float:
    """How old `run` is at `now`. One dated more than FUTURE_SLACK after `now` was recorded
    while the wall clock was ahead (a wrong date, put right since): its age is unknown, and it
    counts as the oldest kept (`max_age`), or it would pass for the newest run for as long as
    the clock was ahead, and its peak would decide every estimate all that time."""
    if run.started_at > now + FUTURE_SLACK:
        return max_age
    return now - run.started_at


def recent(runs: Sequence[RunStat], now: float, max_age: float = MAX_AGE) -> list[RunStat]:
    """Runs not older than `max_age`, newest first (see `age`)."""
    kept = [r for r in runs if now - r.started_at <= max_age]
    return sorted(kept, key=lambda r: age(r, now, max_age))


def successes(runs: Sequence[RunStat]) -> list[RunStat]:
    """Runs that ended well and whose peak is known, in the given order."""
    return [r for r in runs if r.ok and not r.oom and r.peak_bytes is not None]


def runs_agree(runs: Sequence[RunStat]) -> bool:
    """Do these successful runs' peaks agree (see AGREE_BAND), with at least MIN_RUNS of them?"""
    peaks = [r.peak_bytes or 0 for r in runs]
    if len(peaks) < MIN_RUNS:
        return False
    return max(peaks) - min(peaks) <= max(256 * MiB, AGREE_BAND * max(peaks))


def usable_levels(
    levels: Sequence[tuple[str, Sequence[RunStat]]],
    now: float,
    program_runs_other_code: bool,
    max_age: float = MAX_AGE,
) -> list[tuple[str, Sequence[RunStat]]]:
    """The levels estimates may learn from (see the module docstring): the program level goes
    when the program runs other code (an interpreter, shell or launcher) or its runs disagree."""
    kept = []
    for name, runs in levels:
        if name == "program" and (
            program_runs_other_code or not runs_agree(successes(recent(runs, now, max_age)))
        ):
            continue
        kept.append((name, runs))
    return kept


def choose_level(
    levels: Sequence[tuple[str, Sequence[RunStat]]],
    now: float,
    min_runs: int = MIN_RUNS,
    max_age: float = MAX_AGE,
) -> int | None:
    """Index into `levels` (finest first) of the level to estimate from, or None."""
    counts = [len(successes(recent(runs, now, max_age))) for _, runs in levels]
    for index, count in enumerate(counts):
        if count >= min_runs:
            return index
    for index, count in enumerate(counts):
        if count > 0:
            return index
    return None


def oom_floor(
    runs: Sequence[RunStat], now: float, max_age: float = MAX_AGE, margin: float = DEFAULT_MARGIN
) -> int:
    """OOM_GROWTH times the most a failed run had, or what its message said it needed at the
    least with `margin` on top (a peak's margin), over OOMs newer than the last success."""
    floor = 0
    for run in recent(runs, now, max_age):
        if run.ok and not run.oom:
            break  # a success after the OOM shows what the command really needs
        if run.oom:
            had = max(run.peak_bytes or 0, run.reserved_bytes)
            floor = max(floor, tidy_size(had * OOM_GROWTH))
            if run.oom_wanted_bytes is not None:
                # What it asked for when it failed: the sampling may have missed how much it had
                # (a model loaded in a moment), and 1.5 times that may be far too little.
                floor = max(floor, tidy_size(run.oom_wanted_bytes * (1 + margin)))
    return floor


def took_what_it_was_given(run: RunStat, margin: float) -> bool:
    """Did a command that sizes itself from its reservation take it: a peak from TOOK_GIVEN of
    it to the margin past it (SGLang's activations on top of its fraction)? One well below (a
    program that caps itself at the fraction, using less) or far past (a line that only
    mentions the variable) used what it needed, as any other command's run."""
    peak, reserved = run.peak_bytes, run.reserved_bytes
    return (
        run.sized_by_reservation
        and peak is not None
        and reserved > 0
        and TOOK_GIVEN * reserved <= peak <= reserved * (1 + max(0.0, margin))
    )


def as_needed(run: RunStat, margin: float) -> RunStat:
    """`run` as it says what its command needs: one that took what it was given needs no more
    than that (what it took past it, it would take past any reservation)."""
    if not took_what_it_was_given(run, margin):
        return run
    peak = min(run.peak_bytes or 0, run.reserved_bytes)
    given = run.reserved_bytes * max(1, len(run.gpu_uuids))
    held = None if run.held_bytes is None else min(run.held_bytes, given)
    return run._replace(peak_bytes=peak, held_bytes=held)


def on_fewer_gpus(run: RunStat, gpus: int) -> RunStat:
    """`run` as a job on `gpus` GPUs may need it: a run on more held its memory spread over
    them (a model split across the cards it is given), and on fewer each card may hold its
    share of all it held there, and never less than it held on any one card (30 GiB on one
    card and 5 on another need 35 on one, not 60). A run whose GPUs are not known (a
    compacted record) counts as it is."""
    count = len(run.gpu_uuids)
    if count <= gpus:
        return run
    peak = run.peak_bytes
    if peak is not None:
        held = peak * count if run.held_bytes is None else run.held_bytes
        peak = max(peak, -(-held // gpus))
    return run._replace(peak_bytes=peak, reserved_bytes=run.reserved_bytes * count // gpus)


def for_gpus(
    levels: Sequence[tuple[str, Sequence[RunStat]]],
    gpus: int,
    now: float,
    min_runs: int = MIN_RUNS,
    max_age: float = MAX_AGE,
) -> list[tuple[str, Sequence[RunStat]]]:
    """The runs at each level as they size a job on `gpus` GPUs: those on as many GPUs alone
    where there are at least `min_runs` successful ones of them, else all, those on more GPUs
    counted for what they held in all (`on_fewer_gpus`). Runs whose GPUs are not known count
    as runs on as many."""
    result: list[tuple[str, Sequence[RunStat]]] = []
    for name, runs in levels:
        same = [r for r in runs if len(r.gpu_uuids) in (0, gpus)]
        if len(same) < len(runs) and len(successes(recent(same, now, max_age))) < min_runs:
            same = [on_fewer_gpus(r, gpus) for r in runs]
        result.append((name, same))
    return result


def estimate(
    levels: Sequence[tuple[str, Sequence[RunStat]]],
    now: float,
    margin: float = DEFAULT_MARGIN,
    *,
    quantile: float = QUANTILE,
    window: int = WINDOW,
    min_runs: int = MIN_RUNS,
    half_life: float = HALF_LIFE,
    max_age: float = MAX_AGE,
    gpus: int = 1,
) -> Estimate:
    """The VRAM request per GPU for a command whose runs at each level (finest first) are
    given, run on `gpus` GPUs (see `for_gpus`)."""
    levels = [(name, [as_needed(r, margin) for r in runs]) for name, runs in levels]
    levels = for_gpus(levels, gpus, now, min_runs, max_age)
    chosen = choose_level(levels, now, min_runs, max_age)
    # OOMs count at the finest level that has any runs: they are about this very command.
    finest_with_runs = next((runs for _, runs in levels if recent(runs, now, max_age)), ())
    floor_oom = oom_floor(finest_with_runs, now, max_age, margin)
    if chosen is None:
        if floor_oom:
            return Estimate(
                bytes=floor_oom,
                level=next(name for name, runs in levels if recent(runs, now, max_age)),
                oom_floor_bytes=floor_oom,
                margin=margin,
            )
        return Estimate(bytes=None, level=None, margin=margin)
    name, runs = levels[chosen]
    used = successes(recent(runs, now, max_age))[:window]
    peaks = [float(r.peak_bytes or 0) for r in used]
    weights = [age_weight(age(r, now, max_age), half_life) for r in used]
    exact = name in EXACT_LEVELS
    q_bytes = int(weighted_quantile(peaks, weights, quantile) if exact else max(peaks))
    # One run never sets the size alone: the newest, weighing more than many old ones
    # together, would (one that ended at once, with only its CUDA context).
    second = int(sorted(peaks)[1]) if exact and len(peaks) > 1 else 0
    finer = [
        r.peak_bytes or 0
        for _, finer_runs in levels[:chosen]
        for r in successes(recent(finer_runs, now, max_age))[:window]
    ]
    finer_floor = max(finer, default=0)
    floor = max(second, finer_floor)
    sized = all(took_what_it_was_given(r, margin) for r in used)
    if sized:
        margin = 0.0  # what it took is what it was given: given that again, it takes as much
    learned = max(MIN_ESTIMATE, tidy_size(max(q_bytes, floor) * (1 + max(0.0, margin))))
    return Estimate(
        bytes=max(learned, floor_oom),
        level=name,
        runs=len(used),
        quantile_bytes=q_bytes,
        low_bytes=int(min(peaks)),
        high_bytes=int(max(peaks)),
        finer_floor_bytes=finer_floor if finer_floor > max(q_bytes, second) else 0,
        second_lowest_bytes=second if second > q_bytes else 0,
        oom_floor_bytes=floor_oom,
        margin=margin,
        approximate=any(r.approximate for r in used),
        rule="quantile" if exact else "largest",
        spread_over_fewer=any(len(r.gpu_uuids) > gpus for r in used),
        sized_by_reservation=sized,
    )


def _percentile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default, statistics' "inclusive")."""
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def spread(values: Sequence[float]) -> Spread | None:
    """Median and interquartile range; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return Spread(
        _percentile(ordered, 0.5),
        _percentile(ordered, 0.25),
        _percentile(ordered, 0.75),
        len(ordered),
    )


def _timing_runs(
    levels: Sequence[tuple[str, Sequence[RunStat]]],
    now: float,
    window: int,
    gpu_uuid: str | None = None,
) -> list[RunStat]:
    # Run time depends on the arguments (epochs, data), so the finest level with any run wins.
    # On one GPU: that level's runs there, so every GPU is judged by runs of the same kind.
    for _, runs in levels:
        done = [r for r in recent(runs, now) if r.ok and not r.oom]
        if done:
            if gpu_uuid is not None:
                done = [r for r in done if gpu_uuid in r.gpu_uuids]
            return done[:window]
    return []


def run_time(
    levels: Sequence[tuple[str, Sequence[RunStat]]], now: float, window: int = WINDOW
) -> Spread | None:
    """Expected run time of a successful run: median and spread, from the finest level."""
    return spread([r.run_seconds for r in _timing_runs(levels, now, window)])


def run_time_on(
    levels: Sequence[tuple[str, Sequence[RunStat]]],
    now: float,
    gpu_uuid: str,
    window: int = WINDOW,
) -> Spread | None:
    """Run time on one GPU (for adaptive-throughput): like `run_time`, from its runs there."""
    return spread([r.run_seconds for r in _timing_runs(levels, now, window, gpu_uuid)])


def wait_time(
    levels: Sequence[tuple[str, Sequence[RunStat]]], now: float, window: int = WINDOW
) -> Spread | None:
    return spread([r.wait_seconds for r in _timing_runs(levels, now, window)])


def load_time(
    levels: Sequence[tuple[str, Sequence[RunStat]]], now: float, window: int = WINDOW
) -> Spread | None:
    """How long runs took to reach LOADED_FRACTION of their peak (model load time)."""
    return spread(
        [r.time_to_peak for r in _timing_runs(levels, now, window) if r.time_to_peak is not None]
    )


def time_to_peak(
    series: Sequence[tuple[float, int]], fraction: float = LOADED_FRACTION
) -> float | None:
    """Seconds until usage first reached `fraction` of its peak; series is (elapsed, bytes)."""
    peak = max((used for _, used in series), default=0)
    if peak <= 0:
        return None
    return next(t for t, used in series if used >= fraction * peak)


def near_full(free_bytes: int | None, total_bytes: int) -> bool:
    """True when a card had (almost) no free memory left at the job's peak: the peak reached the
    card's limit. 2 % or 256 MiB, whichever is larger, allows for the allocator's granularity."""
    if free_bytes is None or total_bytes <= 0:
        return False
    return free_bytes <= max(256 * MiB, 0.02 * total_bytes)


def looks_like_oom(returncode: int, oom_message: bool, card_full: bool) -> bool:
    """A CUDA out-of-memory failure: the command failed, and it said so or the card was full."""
    return returncode != 0 and (oom_message or card_full)


#: A size as frameworks print them in out-of-memory errors: "15.00 GiB" (PyTorch), "8589934592
#: bytes" (XLA), "1,073,741,824 bytes" (CuPy).
_SIZE = r"([0-9][0-9,]{0,24}(?:\.[0-9]{1,6})?) ?(bytes|b|kib|mib|gib|tib|kb|mb|gb|tb)\b"
_UNITS = {
    **{"bytes": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40},
    **{"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12},
}
#: What the failing allocation asked for. The patterns are compiled (and kept, by re) at the
#: first message read, not as every launch and every line the shell hook runs loads this module.
_TRIED = r"(?:tried to allocate|while trying to allocate|out of memory allocating) " + _SIZE
#: What the process had when it failed: PyTorch since 2.1 (all it had, or what its allocator
#: had under a cap), before, and CuPy.
_HAD = (
    r"this process has " + _SIZE + r" memory in use",
    r"of the allocated memory " + _SIZE + r" is allocated by pytorch",
    _SIZE + r" already allocated",
    r"allocated so far: " + _SIZE,
)
#: More than any GPU has: a figure past it is no real one.
_MOST_SAID = 2**50


def oom_wanted(said: str) -> int | None:
    """What an out-of-memory error message says its program needed at the least, in bytes:
    what it had plus what it tried to allocate (as PyTorch, CuPy and XLA print them); None
    where it does not say what it tried to allocate. `said`: the message, in any case."""
    said = said.lower()
    tried = re.search(_TRIED, said)
    if tried is None:
        return None
    had = next((m for m in (re.search(p, said) for p in _HAD) if m is not None), None)
    wanted = _said_size(tried) + (0 if had is None else _said_size(had))
    return wanted if 0 < wanted <= _MOST_SAID else None


def _said_size(match: re.Match[str]) -> int:
    return int(float(match.group(1).replace(",", "")) * _UNITS[match.group(2)])
