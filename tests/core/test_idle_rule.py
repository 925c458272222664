"""The idle rule on snapshots and recorded evidence (core/idle: pure)."""

from __future__ import annotations

from gpuwait.core.idle import IdleRule, evidence_key, idle_holders, observe, with_unused_rooms
from gpuwait.core.snapshot import GpuSnapshot, MachineSnapshot, ProcessUsage

GIB = 2**30
RULE = IdleRule(min_bytes=GIB, max_util_pct=5, after=60)


def machine(util: int | None, *processes: ProcessUsage) -> MachineSnapshot:
    gpu = GpuSnapshot(
        index=0,
        uuid="GPU-a",
        name="sim",
        total_bytes=24 * GIB,
        used_bytes=sum(p.used_bytes or 0 for p in processes),
        processes=processes,
        utilization_pct=util,
    )
    return MachineSnapshot(backend="sim", gpus=(gpu,))


HOLDER = ProcessUsage(pid=10, used_bytes=2 * GIB)


def test_a_holder_on_a_quiet_gpu_is_idle_once_seen_so_for_idle_after() -> None:
    snapshot = machine(0, HOLDER)
    evidence = observe({}, snapshot, {10: 7}, RULE, now=1000)
    assert idle_holders(evidence, snapshot, {10: 7}, RULE, now=1059) == []
    evidence = observe(evidence, snapshot, {10: 7}, RULE, now=1060)
    [holder] = idle_holders(evidence, snapshot, {10: 7}, RULE, now=1060)
    assert (holder.pid, holder.used_bytes, holder.idle_since) == (10, 2 * GIB, 1000)


def test_a_busy_reading_an_unknown_utilization_or_a_new_process_starts_over() -> None:
    quiet = observe({}, machine(0, HOLDER), {10: 7}, RULE, now=1000)
    assert observe(quiet, machine(5, HOLDER), {10: 7}, RULE, now=1010) == {}
    assert observe(quiet, machine(None, HOLDER), {10: 7}, RULE, now=1010) == {}
    # The pid reused by another process (another start time) inherits nothing.
    reused = observe(quiet, machine(0, HOLDER), {10: 8}, RULE, now=1010)
    assert reused == {evidence_key("GPU-a", 10, 8): 1010}


def test_what_a_reading_cannot_see_keeps_the_evidence_it_had() -> None:
    seen = observe({}, machine(0, HOLDER), {10: 7}, RULE, now=1000)
    # Of other GPUs only (gpuwait in a container given some of the machine's).
    other = GpuSnapshot(0, "GPU-b", "sim", 24 * GIB, 0, utilization_pct=0)
    assert observe(seen, MachineSnapshot("sim", (other,)), {}, RULE, now=1010) == seen
    # Of this GPU without its processes (NVML's host pids, in a container): kept while quiet.
    blind = machine(0).gpus[0]._replace(per_process=False)
    assert observe(seen, MachineSnapshot("sim", (blind,)), {}, RULE, now=1010) == seen
    busy = blind._replace(utilization_pct=50)
    assert observe(seen, MachineSnapshot("sim", (busy,)), {}, RULE, now=1010) == {}


def test_small_holdings_and_ignored_names_are_never_named() -> None:
    small = machine(0, ProcessUsage(pid=11, used_bytes=GIB // 2))
    evidence = observe({}, small, {}, RULE, now=0)
    assert idle_holders(evidence, small, {}, RULE, now=1000) == []
    display = machine(0, ProcessUsage(pid=12, used_bytes=2 * GIB, name="Xorg"))
    assert observe({}, display, {}, RULE, now=0, ignore={"Xorg"}) == {}


def test_an_idle_job_is_asked_whatever_its_priority_and_before_busy_ones() -> None:
    from gpuwait.core.pausing import PauseRules, RunningJob, choose_victims

    def running(job_id: str, priority: int, idle: bool) -> RunningJob:
        return RunningJob(job_id, priority, ("GPU-a",), 10 * GIB, True, 3600.0, idle=idle)

    rules = PauseRules(min_runtime=60, max_pauses=3)
    need, room = {"GPU-a": 8 * GIB}, {"GPU-a": 0}
    # Of the waiter's priority and busy: never asked.
    assert choose_victims(need, room, 3, [running("busy", 3, False)], rules) is None
    idle_high = running("idle", 5, True)
    choice = choose_victims(need, room, 3, [running("low", 1, False), idle_high], rules)
    assert choice is not None and choice.victims == ("idle",)


def test_a_jobs_room_counts_only_where_nothing_of_the_job_shows() -> None:
    # Job 20 holds 8 GiB with nothing on the card; job 30's child (31) uses 512 MiB of its
    # 8 GiB: its own process shows, and the memory rule alone applies to it.
    child = ProcessUsage(pid=31, used_bytes=GIB // 2)
    rooms = {20: {"GPU-a": 8 * GIB}, 30: {"GPU-a": 8 * GIB}, 40: {"GPU-b": 8 * GIB}}
    snapshot, unused = with_unused_rooms(machine(0, child), rooms, {20: 20, 30: 30, 31: 30})
    assert unused == {("GPU-a", 20): 8 * GIB}
    assert [p.pid for p in snapshot.gpus[0].processes] == [31, 20]
    evidence = observe({}, snapshot, {}, RULE, now=1000, unused=unused)
    [holder] = idle_holders(evidence, snapshot, {}, RULE, now=1060, unused=unused)
    assert (holder.pid, holder.used_bytes, holder.reserved_bytes) == (20, 0, 8 * GIB)
