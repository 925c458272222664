"""The pure estimation math: quantile, margin, aging, level fallback, OOM, timings."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuwait.core.estimate import (
    MAX_AGE,
    MIN_ESTIMATE,
    MiB,
    RunStat,
    Spread,
    estimate,
    looks_like_oom,
    near_full,
    oom_wanted,
    run_time,
    spread,
    tidy_size,
    time_to_peak,
    usable_levels,
    weighted_quantile,
)
from gpuwait.core.policy import Claim, gpu_rooms
from gpuwait.core.sizes import MemoryRequest
from gpuwait.core.snapshot import GpuSnapshot, ProcessUsage

GiB = 2**30
NOW = 1_700_000_000.0
DAY = 86400.0


def run(
    gib: float,
    age_days: float = 0.0,
    *,
    ok: bool = True,
    oom: bool = False,
    reserved_gib: float = 0.0,
    seconds: float = 60.0,
) -> RunStat:
    return RunStat(
        started_at=NOW - age_days * DAY,
        peak_bytes=int(gib * GiB),
        reserved_bytes=int(reserved_gib * GiB),
        ok=ok,
        oom=oom,
        run_seconds=seconds,
    )


def sized(peak: int, reserved: int, started_at: float = NOW - 1) -> RunStat:
    """A successful run of a command line that names GPUWAIT_VRAM_FRACTION."""
    return RunStat(
        started_at=started_at,
        peak_bytes=peak,
        reserved_bytes=reserved,
        ok=True,
        oom=False,
        sized_by_reservation=True,
    )


def one_level(*runs: RunStat) -> list[tuple[str, list[RunStat]]]:
    # Each run a minute apart, newest last, as the history holds them.
    return [("command", list(runs))]


def test_three_runs_give_the_highest_peak_plus_margin_rounded_up() -> None:
    est = estimate(one_level(run(3.0, 0.3), run(2.9, 0.2), run(3.0, 0.1)), NOW)
    assert est.level == "command" and est.runs == 3
    assert est.quantile_bytes == 3 * GiB
    assert est.bytes == tidy_size(3 * GiB * 1.1)
    assert 3.3 * GiB <= est.bytes <= 3.5 * GiB


def test_not_the_last_value_and_not_the_mean() -> None:
    runs = [run(8, 0.4), run(8, 0.3), run(8, 0.2), run(2, 0.1)]
    est = estimate(one_level(*runs), NOW)
    assert est.bytes is not None and est.bytes >= 8 * GiB * 1.1


def test_one_spike_among_many_runs_does_not_set_the_size() -> None:
    runs = [run(4, i / 100) for i in range(1, 20)] + [run(20, 0.5)]
    est = estimate(one_level(*runs), NOW)
    assert est.bytes == tidy_size(4 * GiB * 1.1)
    assert est.high_bytes == 20 * GiB


def test_margin_is_a_setting() -> None:
    runs = one_level(run(10, 0.2), run(10, 0.1), run(10, 0))
    assert estimate(runs, NOW, margin=0.0).bytes == 10 * GiB
    assert estimate(runs, NOW, margin=0.5).bytes == 15 * GiB


def test_old_runs_weigh_less_and_age_out() -> None:
    old = [run(8, 60 + i / 10) for i in range(10)]
    new = [run(4, i / 10) for i in range(10)]
    # Ten 60-day-old runs weigh 1/16 each: under 5 % of the total, they no longer decide.
    assert estimate(one_level(*old, *new), NOW).bytes == tidy_size(4 * GiB * 1.1)
    # Only old runs: still used while younger than MAX_AGE ...
    assert estimate(one_level(*old), NOW).bytes == tidy_size(8 * GiB * 1.1)
    # ... and forgotten after.
    ancient = [run(8, MAX_AGE / DAY + 1 + i) for i in range(5)]
    assert estimate(one_level(*ancient), NOW).bytes is None


def test_one_small_run_after_old_ones_does_not_set_the_size_alone() -> None:
    # Ten runs of 9 GiB, 110 days old, then one that ended at once (its data missing, exit 0)
    # with only its CUDA context: weighing 20 times more than all of them, it alone would
    # size the next run at 384 MiB, which then takes 9 GiB from its neighbours.
    old = [run(9, 110 + i / 10) for i in range(10)]
    odd = run(0.3, 0.01)
    est = estimate(one_level(*old, odd), NOW)
    assert est.bytes == tidy_size(9 * GiB * 1.1)
    assert (est.quantile_bytes, est.second_lowest_bytes) == (int(0.3 * GiB), 9 * GiB)
    # A second such run says the command needs that little now.
    again = run(0.3, 0.0)
    assert estimate(one_level(*old, odd, again), NOW).bytes == tidy_size(int(0.3 * GiB) * 1.1)


def on_gpus(stat: RunStat, count: int) -> RunStat:
    return stat._replace(gpu_uuids=tuple(f"GPU-{i}" for i in range(count)))


def test_runs_on_more_gpus_size_a_job_on_fewer_for_what_they_held_in_all() -> None:
    # A model spread over the cards it is given (device_map="auto"): 9 GiB on each of 2, so
    # 18 GiB on 1. Sized by the 2-GPU runs, a 1-GPU run reserved 9.9 GiB and took 18.
    spread = [on_gpus(run(9, i / 10), 2) for i in range(3)]
    assert estimate(one_level(*spread), NOW, gpus=2).bytes == tidy_size(9 * GiB * 1.1)
    assert estimate(one_level(*spread), NOW, gpus=1).bytes == tidy_size(18 * GiB * 1.1)
    # Runs on as many GPUs as the job, once there are enough, size it alone: a job that holds
    # as much on each card however many it has is not sized 2x for ever, and the 2-GPU runs
    # go on sizing 2-GPU runs after a 1-GPU one.
    single = [on_gpus(run(9, 0.01 + i / 10), 1) for i in range(3)]
    assert estimate(one_level(*spread, *single), NOW, gpus=1).bytes == tidy_size(9 * GiB * 1.1)
    once = on_gpus(run(18, 0.0), 1)
    assert estimate(one_level(*spread, once), NOW, gpus=2).bytes == tidy_size(9 * GiB * 1.1)
    # An out-of-memory failure on 2 GPUs raises the floor for 1 by as much.
    failed = on_gpus(run(9, 0.0, ok=False, oom=True, reserved_gib=9), 2)
    assert estimate(one_level(failed), NOW, gpus=1).bytes == tidy_size(18 * GiB * 1.5)


def test_uneven_runs_on_more_gpus_size_a_job_on_fewer_by_what_they_held_on_all() -> None:
    # 30 GiB on one card, 5 on the other: 35 GiB on one card, not twice the larger (60), and
    # on two of four such cards never less than the 30 one card held.
    uneven = [on_gpus(run(30, i / 10), 2)._replace(held_bytes=35 * GiB) for i in range(3)]
    assert estimate(one_level(*uneven), NOW, gpus=1).bytes == tidy_size(35 * GiB * 1.1)
    four = [on_gpus(run(30, i / 10), 4)._replace(held_bytes=45 * GiB) for i in range(3)]
    assert estimate(one_level(*four), NOW, gpus=2).bytes == tidy_size(30 * GiB * 1.1)


def test_runs_recorded_while_the_clock_was_ahead_do_not_hide_the_latest_ones() -> None:
    # A date set a year ahead for a day, put right since: those runs look newer than any other
    # for a year, and would fill the window of the newest runs all that time.
    ahead = [run(4, -365 + i / 100) for i in range(20)]
    latest = [run(10, i / 100) for i in range(5)]
    assert estimate(one_level(*ahead, *latest), NOW).bytes == tidy_size(10 * GiB * 1.1)


def test_falls_back_to_the_script_then_the_program() -> None:
    script_runs = [run(6, i) for i in range(1, 5)]
    program_runs = [run(1, i) for i in range(1, 9)]
    levels = [("command", [run(5, 0.5)]), ("script", script_runs), ("program", program_runs)]
    est = estimate(levels, NOW)
    assert est.level == "script" and est.runs == 4
    est = estimate([("command", []), ("script", []), ("program", program_runs)], NOW)
    assert est.level == "program" and est.runs == 8


def test_three_runs_of_the_command_size_it_whatever_its_script_did_with_other_arguments() -> None:
    # Three runs of this very command took 2 GiB; the script with other arguments took up
    # to 9 GiB. Three are enough: the command is sized from its own runs, not asked for 10 GiB.
    script_runs = [run(9, 0.5), *(run(2, i) for i in range(1, 5))]
    levels = [("command", [run(2, i) for i in range(1, 4)]), ("script", script_runs)]
    est = estimate(levels, NOW)
    assert est.level == "command" and est.runs == 3
    assert est.bytes == tidy_size(2 * GiB * 1.1)


def test_finer_runs_keep_the_estimate_above_their_peak() -> None:
    # Twenty newer runs of the script with other arguments push the large one out of its window.
    small = [run(2, i / 100) for i in range(20)]
    levels = [("command", [run(20, 0.5)]), ("script", [run(20, 0.5), *small])]
    est = estimate(levels, NOW)
    assert est.level == "script"
    assert est.finer_floor_bytes == 20 * GiB
    assert est.bytes is not None and est.bytes >= 22 * GiB


def test_the_largest_of_the_finer_runs_is_the_floor() -> None:
    # Two runs of this very command, of 3 and 20 GiB (too few to size it alone), and many of
    # its script with other arguments at 2 GiB: the request is kept above the 20 GiB run.
    levels = [("command", [run(20, 0.5), run(3, 0.4)]), ("script", [run(2, i) for i in range(5)])]
    est = estimate(levels, NOW)
    assert est.level == "script" and est.bytes == tidy_size(20 * GiB * 1.1)


def test_few_runs_of_the_command_are_used_when_nothing_coarser_has_enough() -> None:
    levels = [("command", [run(5, 1)]), ("script", [run(5, 1)]), ("program", [run(1, 1)] * 2)]
    est = estimate(levels, NOW)
    assert est.level == "command" and est.runs == 1


def test_the_program_alone_needs_enough_runs_that_agree() -> None:
    few = [("command", []), ("script", []), ("program", [run(1, 1), run(1, 2)])]
    assert estimate(usable_levels(few, NOW, False), NOW).bytes is None
    agreeing = [("command", []), ("program", [run(4, 0.1), run(4.2, 0.2), run(3.9, 0.3)])]
    est = estimate(usable_levels(agreeing, NOW, False), NOW)
    # Largest peak, not a quantile: this command itself never ran.
    assert est.level == "program" and est.rule == "largest"
    assert est.bytes == tidy_size(4.2 * GiB * 1.1)
    disagreeing = [("command", []), ("program", [run(1, 0.1), run(8, 0.2), run(3, 0.3)])]
    assert estimate(usable_levels(disagreeing, NOW, False), NOW).bytes is None


def test_a_programs_runs_agree_within_256_mib_or_a_fifth_of_the_largest_whichever_is_more() -> None:
    # Peaks of 0.3, 0.45 and 0.35 GiB: 150 MiB apart, a third of the largest but within 256 MiB,
    # agree; 2 and 2.45 GiB (450 MiB apart, under a fifth of the largest) do too; 2 and 2.6 GiB
    # do not.
    small = [("command", []), ("program", [run(0.3, 0.1), run(0.45, 0.2), run(0.35, 0.3)])]
    assert estimate(usable_levels(small, NOW, False), NOW).level == "program"
    close = [("command", []), ("program", [run(2, 0.1), run(2.45, 0.2), run(2.2, 0.3)])]
    assert estimate(usable_levels(close, NOW, False), NOW).level == "program"
    apart = [("command", []), ("program", [run(2, 0.1), run(2.6, 0.2), run(2.2, 0.3)])]
    assert estimate(usable_levels(apart, NOW, False), NOW).bytes is None


def test_an_interpreters_runs_never_size_another_script() -> None:
    # The story: three tiny scripts taught "python needs 256 MiB"; a new 8 GiB script then got
    # 256 MiB and died of out-of-memory beside a 20 GiB job.
    tiny = [run(0, 0.1), run(0, 0.2), run(0, 0.3)]
    levels = [("command", []), ("script", []), ("program", tiny)]
    usable = usable_levels(levels, NOW, program_runs_other_code=True)
    assert estimate(usable, NOW).bytes is None
    assert run_time(usable, NOW) is None
    # Nor does another script's out-of-memory failure raise this one's request.
    failed = [run(5.6, 0.05, ok=False, oom=True, reserved_gib=5.6)]
    usable = usable_levels([("command", []), ("program", failed)], NOW, True)
    assert estimate(usable, NOW).bytes is None


def test_the_same_script_with_other_arguments_gets_its_largest_peak() -> None:
    script = [run(2, 0.1), run(9, 0.2), run(2, 0.3), run(2, 0.4), run(2, 0.5)]
    est = estimate([("command", []), ("script", script)], NOW, 0.1)
    assert est.rule == "largest" and est.bytes == tidy_size(9 * GiB * 1.1)
    # The exact command keeps the quantile rule: one odd spike among many does not rule it.
    exact = [run(2, i / 100) for i in range(1, 20)] + [run(9, 0.5)]
    est = estimate([("command", exact)], NOW, 0.1)
    assert est.rule == "quantile" and est.bytes is not None and est.bytes < 9 * GiB


def test_no_history_no_estimate() -> None:
    est = estimate([("command", []), ("program", [])], NOW)
    assert est.bytes is None and est.level is None


def test_failed_runs_and_unknown_peaks_do_not_count() -> None:
    unknown = RunStat(started_at=NOW, peak_bytes=None, reserved_bytes=0, ok=True, oom=False)
    levels = one_level(run(30, 0.3, ok=False), unknown, run(3, 0.2), run(3, 0.1), run(3, 0))
    est = estimate(levels, NOW)
    assert est.runs == 3 and est.high_bytes == 3 * GiB


def test_oom_raises_the_next_estimate_above_the_failed_run() -> None:
    runs = [run(4, 0.3), run(4, 0.2), run(4, 0.1), run(7, 0.01, ok=False, oom=True, reserved_gib=5)]
    est = estimate(one_level(*runs), NOW)
    assert est.bytes is not None and est.bytes > 7 * GiB
    assert est.raised_by_oom and est.oom_floor_bytes == tidy_size(7 * GiB * 1.5)


def test_an_oom_message_that_says_what_it_needed_raises_the_estimate_to_it() -> None:
    # Sampled at 2 GiB of its 8 GiB reservation, it failed asking for 30 GiB more: 1.5 times
    # what it had (12 GiB) would fail again; it asks for what it said, with the margin.
    failed = run(2, 0.01, ok=False, oom=True, reserved_gib=8)
    failed = RunStat(**{**failed.__dict__, "oom_wanted_bytes": 30 * GiB})
    est = estimate(one_level(failed), NOW)
    assert est.raised_by_oom and est.bytes == tidy_size(30 * GiB * 1.1)
    # Where it said less than 1.5 times what it had, that stands.
    small = RunStat(**{**failed.__dict__, "oom_wanted_bytes": 9 * GiB})
    assert estimate(one_level(small), NOW).bytes == tidy_size(8 * GiB * 1.5)


@pytest.mark.parametrize(
    ("said", "gib"),
    [
        (
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 15.00 GiB. GPU 0 has a "
            "total capacity of 24.00 GiB of which 8.00 GiB is free. Process 12 has 1024.00 MiB "
            "memory in use. Including non-PyTorch memory, this process has 15.00 GiB memory in "
            "use. Of the allocated memory 14.50 GiB is allocated by PyTorch",
            30,
        ),
        (
            "RuntimeError: CUDA out of memory. Tried to allocate 512.00 MiB (GPU 0; 15.78 GiB "
            "total capacity; 14.50 GiB already allocated; 15.69 MiB free; 14.80 GiB reserved)",
            15,
        ),
        (
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB. Of the "
            "allocated memory 2.00 GiB is allocated by PyTorch, and this process is limited to "
            "6.00 GiB (set_per_process_memory_fraction)",
            6,
        ),
        ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8589934592 bytes.", 8),
        (
            "cupy.cuda.memory.OutOfMemoryError: Out of memory allocating 1,073,741,824 bytes "
            "(allocated so far: 2,147,483,648 bytes).",
            3,
        ),
    ],
)
def test_what_an_oom_message_says_its_program_needed(said: str, gib: float) -> None:
    assert oom_wanted(said) == gib * GiB


@pytest.mark.parametrize(
    "said",
    [
        "RuntimeError: CUDA error: out of memory",
        "OOM when allocating tensor with shape[4096,4096]",
        "CUDA out of memory. Tried to allocate 99999999999999999999 GiB.",
        "CUDA out of memory. Tried to allocate 0 bytes.",
    ],
)
def test_an_oom_message_that_says_no_real_size_says_nothing(said: str) -> None:
    assert oom_wanted(said) is None


def test_oom_without_any_success_still_gives_a_raised_estimate() -> None:
    est = estimate(one_level(run(0, 0.01, ok=False, oom=True, reserved_gib=2)), NOW)
    assert est.bytes == 3 * GiB and est.runs == 0


def test_a_failure_of_another_kind_after_the_oom_keeps_the_raise() -> None:
    # Out of memory at 7 GiB, then a run that failed at once for another reason (a typo, a
    # missing file) with 1 GiB: that run says nothing of what the command needs, and the next
    # one is still given more than the run that ran out of memory had.
    runs = [
        run(4, 0.3),
        run(4, 0.2),
        run(4, 0.1),
        run(7, 0.02, ok=False, oom=True, reserved_gib=5),
        run(1, 0.01, ok=False),
    ]
    est = estimate(one_level(*runs), NOW)
    assert est.raised_by_oom and est.bytes == tidy_size(7 * GiB * 1.5)
    # One whose peak was never read is raised from its reservation.
    unread = run(0, 0.01, ok=False, oom=True, reserved_gib=2)._replace(peak_bytes=None)
    assert estimate(one_level(unread), NOW).oom_floor_bytes == 3 * GiB


def test_a_success_after_the_oom_ends_the_raise() -> None:
    runs = [run(7, 0.3, ok=False, oom=True, reserved_gib=5), run(9, 0.2), run(9, 0.1), run(9, 0)]
    est = estimate(one_level(*runs), NOW)
    assert est.oom_floor_bytes == 0 and est.bytes == tidy_size(9 * GiB * 1.1)


def test_small_jobs_get_a_minimum() -> None:
    assert estimate(one_level(run(0, 0.1), run(0, 0)), NOW).bytes == MIN_ESTIMATE


peaks = st.lists(st.integers(min_value=1, max_value=80 * GiB), min_size=1, max_size=19)


@given(peaks, st.floats(min_value=0, max_value=1))
def test_fewer_than_twenty_equal_runs_are_all_covered(values: list[int], margin: float) -> None:
    runs = [RunStat(NOW - i, v, 0, True, False) for i, v in enumerate(values)]
    est = estimate(one_level(*runs), NOW, margin)
    assert est.bytes is not None
    assert est.bytes >= max(values) * (1 + margin)
    # ... without being wildly above: the margin, then at most one rounding step.
    assert est.bytes <= max(MIN_ESTIMATE, max(values) * (1 + margin) * 1.0625 + 64 * MiB)


@given(
    st.lists(st.integers(min_value=0, max_value=10**12), min_size=1, max_size=50),
    st.floats(min_value=0.01, max_value=1),
)
def test_weighted_quantile_with_equal_weights(values: list[int], q: float) -> None:
    result = weighted_quantile(values, [1.0] * len(values), q)
    assert result in values
    assert sum(1 for v in values if v <= result) >= q * len(values) - 1e-9
    assert weighted_quantile(values, [1.0] * len(values), 1.0) == max(values)


@given(st.integers(min_value=1, max_value=2**45))
def test_tidy_size_rounds_up_by_at_most_one_step(n: int) -> None:
    tidy = tidy_size(n)
    assert n <= tidy <= max(n * 1.0625, n + 64 * MiB)
    assert tidy_size(tidy) == tidy
    assert tidy % (64 * MiB) == 0


def test_run_time_is_a_median_with_its_spread_from_the_finest_level() -> None:
    levels = [
        ("command", [run(1, 0.3, seconds=100), run(1, 0.2, seconds=120), run(1, 0.1, seconds=110)]),
        ("program", [run(1, 0.05, seconds=5)] * 10),
    ]
    times = run_time(levels, NOW)
    assert times is not None and times.median == 110 and times.runs == 3
    assert 100 <= times.low <= times.median <= times.high <= 120
    assert run_time([("command", [])], NOW) is None
    assert spread([]) is None
    assert spread([4.0]) == Spread(4.0, 4.0, 4.0, 1)


@given(st.lists(st.floats(min_value=0, max_value=1e6), min_size=1, max_size=40))
def test_spread_matches_the_statistics_module(values: list[float]) -> None:
    import statistics

    result = spread(values)
    assert result is not None and result.runs == len(values)
    assert math.isclose(result.median, statistics.median(values), rel_tol=1e-9, abs_tol=1e-9)
    if len(values) > 1:
        low, _, high = statistics.quantiles(values, n=4, method="inclusive")
        assert math.isclose(result.low, low, rel_tol=1e-9, abs_tol=1e-9)
        assert math.isclose(result.high, high, rel_tol=1e-9, abs_tol=1e-9)


def test_time_to_peak_is_when_ninety_percent_was_reached() -> None:
    series = [(0.0, 0), (0.5, 100), (1.0, 950), (2.0, 1000), (3.0, 400)]
    assert time_to_peak(series) == 1.0
    assert time_to_peak([(0.0, 0)]) is None


def test_oom_needs_a_failure_and_evidence() -> None:
    assert looks_like_oom(1, oom_message=True, card_full=False)
    assert looks_like_oom(-6, oom_message=False, card_full=True)
    assert not looks_like_oom(0, oom_message=True, card_full=True)
    assert not looks_like_oom(1, oom_message=False, card_full=False)
    assert near_full(100 * MiB, 24 * GiB) and not near_full(2 * GiB, 24 * GiB)
    assert not near_full(None, 24 * GiB)


@given(
    reserved=st.integers(min_value=1, max_value=40 * GiB),
    observed=st.integers(min_value=0, max_value=40 * GiB),
)
def test_a_reservation_is_never_released_before_the_job_grows_past_it(
    reserved: int, observed: int
) -> None:
    # A job still loading its model uses less than it reserved; the policy keeps counting the
    # whole reservation (max(reserved, observed)), so load time needs no timer of its own.
    gpu = GpuSnapshot(0, "GPU-0", "t", 48 * GiB, observed, (ProcessUsage(7, observed),))
    claim = Claim(
        "a",
        True,
        3,
        0,
        MemoryRequest(bytes=reserved),
        gpu_uuids=("GPU-0",),
        reserved_bytes=reserved,
        observed={"GPU-0": observed},
    )
    room = gpu_rooms([gpu], [claim], 1.0)["GPU-0"]
    assert room.committed == max(reserved, observed)
    assert room.room == 48 * GiB - max(reserved, observed)


def test_a_command_that_takes_what_it_is_given_is_learned_at_that_and_no_more() -> None:
    # vLLM told --gpu-memory-utilization "$GPUWAIT_VRAM_FRACTION" takes the fraction of its
    # 80 GiB card (rounded down), SGLang a little more (activations on top): run after run
    # without --vram, each given what the last taught, the size stays where it was set.
    total = 80 * GiB
    for overshoot in (0, GiB // 2):
        reserved, runs = 20 * GiB, []
        for i in range(6):
            fraction = math.floor(reserved / total * 10_000) / 10_000
            took = int(fraction * total) + overshoot
            runs.append(sized(took, reserved, NOW - 6 + i))
            learned = estimate(one_level(*runs), NOW + 1).bytes
            assert learned == 20 * GiB
            assert estimate(one_level(*runs), NOW + 1).sized_by_reservation
            reserved = learned


def test_a_command_that_used_nearly_all_it_reserved_keeps_the_margin() -> None:
    # `--vram 10G -- python train.py` (a command that does not name GPUWAIT_VRAM_FRACTION)
    # peaked at 9.8 GiB, three times: it needs room to vary, and is given the margin on top.
    near = [run(9.8, i / 10, reserved_gib=10) for i in range(1, 4)]
    est = estimate(one_level(*near), NOW)
    assert est.bytes == tidy_size(9.8 * GiB * 1.1) and not est.sized_by_reservation


def test_a_command_that_sizes_itself_among_others_keeps_the_margin() -> None:
    given = sized(10 * GiB, 10 * GiB)
    est = estimate(one_level(run(10, 0.1), given), NOW)
    assert est.bytes == tidy_size(10 * GiB * 1.1)


def test_a_command_that_sizes_itself_with_no_known_reservation_counts_as_any() -> None:
    adopted = sized(10 * GiB, 0)
    assert estimate(one_level(adopted), NOW).bytes == tidy_size(10 * GiB * 1.1)


def test_a_command_naming_the_fraction_that_uses_far_more_is_learned_at_what_it_used() -> None:
    # `sh -c 'echo $GPUWAIT_VRAM_FRACTION; python train.py'` names the variable, but train.py
    # took 9 GiB of its 4: learned at its 4, it would overrun its neighbours at every run; it
    # is learned as any other command.
    logged = sized(9 * GiB, 4 * GiB)
    assert estimate(one_level(logged), NOW).bytes == tidy_size(9 * GiB * 1.1)


def test_a_command_that_caps_itself_at_the_fraction_keeps_the_margin() -> None:
    # `python train.py --cap "$GPUWAIT_VRAM_FRACTION"` (set_per_process_memory_fraction) used
    # 8 of its 9 GiB: it used what it needed, and its next run needs room to vary, as any.
    capped = sized(8 * GiB, 9 * GiB)
    est = estimate(one_level(capped), NOW)
    assert est.bytes == tidy_size(8 * GiB * 1.1) and not est.sized_by_reservation
