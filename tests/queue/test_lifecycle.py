"""The lifecycle, the one home of every change of a job's state: each change is in the ledger
before its event is logged, a change that fails logs nothing, the caller's job is never changed
in place, and reading the queue (`gpuwait status`) changes nothing and takes no lock."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
from helpers.jobs import live_job
from helpers.waiting import process_state, wait_for

from gpuwait.core.errors import StateError, UsageError
from gpuwait.core.lookahead import Lookahead
from gpuwait.core.pausing import DEFAULT_CHECKPOINT_SIGNAL, DEFAULT_GRACE_SECONDS
from gpuwait.core.policy import FairShare
from gpuwait.core.snapshot import GpuSnapshot, MachineSnapshot
from gpuwait.linux import netfs, proc
from gpuwait.queue import conditions, entries, events, lifecycle
from gpuwait.queue.bookkeeping import FAILED, LOST, OK, Finished
from gpuwait.queue.entries import RUNNING, WAITING, Job, LedgerData, UserUsage
from gpuwait.queue.ledger import Ledger
from gpuwait.queue.lifecycle import Admitted
from gpuwait.queue.report import View, report_from

GiB = 2**30
MACHINE = MachineSnapshot("sim", (GpuSnapshot(0, "GPU-0", "Test GPU", 24 * GiB, 0),))
TWO_CARDS = MachineSnapshot(
    "sim", tuple(GpuSnapshot(i, f"GPU-{i}", "Test GPU", 24 * GiB, 0) for i in range(2))
)


def running_pausable(
    job_id: str, priority: int, started_at: float, gpu: str = "GPU-0", **fields: Any
) -> Job:
    """A --pausable job of this process, running with 16 GiB on `gpu` since `started_at`."""
    return live_job(
        job_id,
        state=RUNNING,
        priority=priority,
        pausable=True,
        started_at=started_at,
        gpu_uuids=[gpu],
        reserved_bytes=16 * GiB,
        request={"bytes": 16 * GiB},
        **fields,
    )


def stepped_aside_for(urgent: str, job_id: str) -> Job:
    """A --pausable job of priority 1 of this process that stepped aside once for `urgent`, a job
    of priority 5, and waits to resume with 16 GiB."""
    return live_job(
        job_id,
        state=WAITING,
        priority=1,
        boost=5,
        yield_to=urgent,
        pauses=1,
        pausable=True,
        request={"bytes": 16 * GiB},
    )


@pytest.fixture
def logged(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    """Each event as it is logged, with the ledger's entries as the file held them then."""
    seen: list[tuple[str, dict[str, Any]]] = []
    emit = events.emit

    def spy(state_dir: Path, kind: Any, **fields: Any) -> None:
        on_disk = json.loads((state_dir / "ledger.json").read_text())
        seen.append((kind, {j["id"]: j["state"] for j in on_disk["jobs"]}))
        emit(state_dir, kind, **fields)

    monkeypatch.setattr(events, "emit", spy)
    return seen


def test_each_event_is_logged_once_its_change_is_in_the_ledger(
    tmp_path: Path, logged: list[tuple[str, dict[str, Any]]]
) -> None:
    ledger = Ledger(tmp_path)
    job = lifecycle.submit(ledger, live_job("j1"), [], [], tmp_path, ["x"])
    job, outcome = lifecycle.admit(ledger, job, MACHINE, 0.9)
    assert isinstance(outcome, Admitted)
    job = lifecycle.started(ledger, job, os.getpid())
    lifecycle.finish(ledger, job, "ok", exit_status=0, run_seconds=1.0)
    assert logged == [
        ("submit", {"j1": WAITING}),
        ("admit", {"j1": RUNNING}),
        ("start", {"j1": RUNNING}),
        ("finish", {}),
    ]
    assert [e["kind"] for e in events.read_events(tmp_path)] == [k for k, _ in logged]


def test_a_change_that_fails_logs_nothing(
    tmp_path: Path, logged: list[tuple[str, dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = Ledger(tmp_path)
    monkeypatch.setattr(lifecycle, "MAX_ENTRIES_PER_UID", 1)
    lifecycle.submit(ledger, live_job("first"), [], [], tmp_path, ["x"])
    with pytest.raises(StateError, match="the most one user may"):
        lifecycle.submit(ledger, live_job("second"), [], [], tmp_path, ["x"])
    assert [kind for kind, _ in logged] == ["submit"]
    assert [j.id for j in ledger.read().jobs] == ["first"]


def test_the_callers_job_is_never_changed_in_place(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    mine = live_job("j1")
    submitted = lifecycle.submit(ledger, mine, [], [], tmp_path, ["x"])
    assert (mine.order, submitted.order) == (0, 1)
    admitted, outcome = lifecycle.admit(ledger, submitted, MACHINE, 0.9)
    assert isinstance(outcome, Admitted) and outcome.job == admitted
    assert submitted.state == WAITING and submitted.gpu_uuids == []
    assert admitted.state == RUNNING and admitted.gpu_uuids == ["GPU-0"]
    paused = lifecycle.step_aside(ledger, admitted, 1.0)
    assert (admitted.state, admitted.pauses) == (RUNNING, 0)
    assert (paused.state, paused.pauses) == (WAITING, 1)


def test_an_admission_keeps_the_lookahead_plans_order_for_the_next_plan(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    fair = FairShare(order=Lookahead())
    submitted = [
        lifecycle.submit(
            ledger,
            live_job(name, request={"bytes": gib * GiB}, expected_seconds=seconds),
            [],
            [],
            tmp_path,
            ["x"],
        )
        for name, gib, seconds in (("a", 12, 30.0), ("b", 16, 10.0), ("c", 4, 20.0), ("d", 20, 5.0))
    ]
    lifecycle.admit(ledger, submitted[0], MACHINE, 0.9, fair=fair)
    data = ledger.read()
    waiting = {j.id for j in data.jobs if j.state == WAITING}
    assert waiting and len(waiting) < 4
    assert sorted(data.plan_order) == sorted(waiting)
    # In-order plans keep none.
    lifecycle.admit(ledger, submitted[1], MACHINE, 0.9)
    assert ledger.read().plan_order == []


def test_a_reaped_entry_is_said_after_it_left_the_file(
    tmp_path: Path, logged: list[tuple[str, dict[str, Any]]]
) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    ledger = Ledger(tmp_path)
    with ledger.transaction() as data:
        data.jobs.append(live_job("gone", pid=gone.pid, start_time=1))
    assert lifecycle.reap(ledger) == ["gone"]
    assert logged == [("reap", {})]


def test_an_entry_without_pause_settings_gets_the_protocols_defaults() -> None:
    raw = live_job("j1").to_json()
    for key in ("checkpoint_signal", "grace_seconds", "grace_kill"):
        del raw[key]
    job = Job.from_json(raw)
    assert (job.checkpoint_signal, job.grace_seconds) == (
        DEFAULT_CHECKPOINT_SIGNAL,
        DEFAULT_GRACE_SECONDS,
    )
    del raw["owners"]  # written beside the dependencies: no field of a Job
    assert job.grace_seconds == Job(**{**raw, "id": "j2"}).grace_seconds == 120.0


def test_status_reads_the_queue_without_the_lock_and_changes_nothing(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    # A first run records the GPUs' health; from then on a reading has nothing to change.
    assert subprocess.run([*gpuwait_cmd, "--vram", "1G", "--", "true"], timeout=60).returncode == 0
    state = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait"
    before = (state / "ledger.json").stat()
    # A hung gpuwait (here: this test) holds the ledger lock.
    fd = os.open(state / "ledger.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        started = time.monotonic()
        shown = subprocess.run(
            [*gpuwait_cmd, "status"],
            env={**os.environ, "GPUWAIT_LOCK_TIMEOUT": "2s"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        took = time.monotonic() - started
    finally:
        os.close(fd)
    assert shown.returncode == 0, shown.stderr
    assert "Queue (0)" in shown.stdout and took < 2
    after = (state / "ledger.json").stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_status_shows_the_queue_untidied_while_a_stopped_process_holds_the_lock(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    # An entry whose gpuwait is gone asks to be reaped, which takes the lock; a process that
    # holds it for good (stopped, hung, hostile) must not keep status from answering.
    assert subprocess.run([*gpuwait_cmd, "--vram", "1G", "--", "true"], timeout=60).returncode == 0
    state = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait"
    gone = subprocess.Popen(["true"])
    gone.wait()
    ledger = Ledger(state)
    with ledger.transaction() as data:
        data.jobs.append(live_job("gone1", gone.pid, start_time=1))
    fd = os.open(state / "ledger.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        started = time.monotonic()
        shown = subprocess.run([*gpuwait_cmd, "status"], capture_output=True, text=True, timeout=60)
        took = time.monotonic() - started
    finally:
        os.close(fd)
    assert shown.returncode == 0, shown.stderr
    assert took < 10, took
    assert "showing the ledger as read, not tidied" in shown.stderr + shown.stdout
    # Once the lock is free again, the next reading tidies as ever.
    again = subprocess.run([*gpuwait_cmd, "status"], capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "not tidied" not in again.stderr + again.stdout
    assert [j.id for j in Ledger(state).read().jobs] == []


@pytest.mark.parametrize(
    ("ran", "pauses", "asked"),
    [(5.0, 0, False), (700.0, 0, True), (700.0, 2, False)],
    ids=["younger than its minimum", "old enough", "at its pause_max"],
)
def test_a_pause_request_counts_only_where_the_victims_own_rules_allow(
    ran: float, pauses: int, asked: bool
) -> None:
    # However the asker's gpuwait was set (or its file written by hand), the job it asks is
    # marked as asked only once its own owner's rules allow: 10 minutes, at most 2 pauses.
    from gpuwait.queue.entries import PAUSE, LedgerData, Request, mark_pause_requests

    now = time.time()
    victim = live_job(
        "low",
        state=RUNNING,
        priority=1,
        pausable=True,
        started_at=now - ran,
        pauses=pauses,
        pause_min_runtime=600.0,
        pause_max=2,
    )
    asker = live_job("urgent", state=WAITING, priority=5)
    request = Request.to(victim, PAUSE, now, by_uid=asker.uid, by_job=asker.id)
    data = LedgerData(jobs=[victim, asker], requests=[request])
    mark_pause_requests(data, now)
    assert (victim.pause_requested_by == "urgent") is asked


def test_a_job_that_stepped_aside_asks_nobody_of_higher_priority_to_step_aside(
    tmp_path: Path,
) -> None:
    # A priority-1 job that stepped aside for a priority-5 one queues at priority 5 (so that
    # urgent jobs cannot starve it), but that boost is no licence to pause a priority-3 job:
    # only jobs below its own priority step aside for it, by its asking or by its file's word.
    from gpuwait.core.pausing import PauseRules
    from gpuwait.queue.entries import PAUSE, LedgerData, Request, mark_pause_requests
    from gpuwait.queue.pausing import ask_for_room

    now = time.time()
    middle = running_pausable("middle", 3, now - 700)
    resumed = live_job(
        "resumed", state=WAITING, priority=1, boost=5, pauses=1, request={"bytes": 16 * GiB}
    )
    ledger = Ledger(tmp_path)
    with ledger.transaction() as data:
        data.jobs[:] = [middle, resumed]
    asked = ask_for_room(ledger, resumed, MACHINE, 0.9, PauseRules(min_runtime=1.0))
    assert asked == ()
    # Nor does a request in its file (another user's, say) mark the job as asked.
    request = Request.to(middle, PAUSE, now, by_uid=resumed.uid + 1, by_job=resumed.id)
    other = live_job("resumed", state=WAITING, priority=1, boost=5, uid=resumed.uid + 1)
    data = LedgerData(jobs=[middle, other], requests=[request])
    mark_pause_requests(data, now)
    assert middle.pause_requested_by is None
    # The same waiter at priority 5 of its own would ask.
    urgent = resumed._replace(priority=5, boost=0)
    with ledger.transaction() as data:
        data.jobs[:] = [middle, urgent]
    assert ask_for_room(ledger, urgent, MACHINE, 0.9, PauseRules(min_runtime=1.0)) == ("middle",)


def test_a_waiter_over_its_users_limit_asks_nobody_to_step_aside(tmp_path: Path) -> None:
    # One GPU per user. The user's urgent job waits while their training run holds GPU1; a
    # pausable job of priority 1 runs on GPU0. Were it to step aside, the urgent job still
    # could not start until the training run had ended: the paused job would lose its run and
    # GPU0 would stand idle, for nothing.
    from gpuwait.core.pausing import PauseRules
    from gpuwait.core.policy import UserLimits
    from gpuwait.queue.pausing import ask_for_room

    now = time.time()
    low = running_pausable("low", 1, now - 700, "GPU-0")
    training = live_job(
        "training", state=RUNNING, started_at=now, gpu_uuids=["GPU-1"], reserved_bytes=16 * GiB
    )
    urgent = live_job("urgent", state=WAITING, priority=5, request={"bytes": 16 * GiB})
    ledger = Ledger(tmp_path)
    with ledger.transaction() as data:
        data.jobs[:] = [low, training, urgent]
    rules = PauseRules(min_runtime=1.0)
    one_gpu = UserLimits(max_gpus=1)
    assert ask_for_room(ledger, urgent, TWO_CARDS, 0.9, rules, limits=one_gpu) == ()
    # Without the limit it is asked; so it is where the training run could step aside too.
    assert ask_for_room(ledger, urgent, TWO_CARDS, 0.9, rules) == ("low",)
    fresh = Ledger(tmp_path / "fresh")
    with fresh.transaction() as data:
        data.jobs[:] = [low, training._replace(pausable=True, priority=1), urgent]
    assert ask_for_room(fresh, urgent, TWO_CARDS, 0.9, rules, limits=one_gpu) != ()


def test_a_waiter_whose_victim_ignores_the_request_past_its_grace_asks_another(
    tmp_path: Path,
) -> None:
    # A --pausable job that does not step aside within its grace is left alone; its asker then
    # asks the jobs that would, instead of waiting for that one to end (hours, maybe).
    from gpuwait.core.pausing import PauseRules
    from gpuwait.queue.pausing import ask_for_room

    now = time.time()

    def running(job_id: str, gpu: str, ran: float) -> Job:
        return running_pausable(job_id, 1, now - ran, gpu, grace_seconds=1.0)

    deaf, willing = running("deaf", "GPU-1", 100), running("willing", "GPU-0", 200)
    urgent = live_job("urgent", state=WAITING, priority=5, request={"bytes": 16 * GiB})
    ledger = Ledger(tmp_path)
    with ledger.transaction() as data:
        data.jobs[:] = [deaf, willing, urgent]
    rules = PauseRules(min_runtime=1.0)
    # The least work lost: the younger job is asked first, and nobody else while it may obey.
    assert ask_for_room(ledger, urgent, TWO_CARDS, 0.9, rules) == ("deaf",)
    lifecycle.pause_signalled(ledger, "deaf", now, [os.getpid()])
    assert ask_for_room(ledger, urgent, TWO_CARDS, 0.9, rules) == ()
    # Its grace has passed and it still runs: the other one is asked.
    lifecycle.pause_signalled(ledger, "deaf", now - 5, [os.getpid()])
    assert ask_for_room(ledger, urgent, TWO_CARDS, 0.9, rules) == ("willing",)


@pytest.mark.parametrize("grace_kill", [False, True], ids=["left-alone", "ignores-term"])
def test_a_waiter_asks_another_job_once_its_grace_max_has_passed(
    tmp_path: Path, grace_kill: bool
) -> None:
    # A colleague's --pausable job gave itself --grace 365d (or ignores the TERM that
    # --grace-kill sends it): the urgent waiter that asked it waited for it alone, a year, while
    # another job would have stepped aside.
    from gpuwait.core.pausing import PauseRules
    from gpuwait.queue.pausing import ask_for_room, pause_progress

    now = time.time()
    year = 365 * 86400.0
    deaf = running_pausable(
        "deaf", 1, now - 100, "GPU-1", grace_seconds=year, grace_kill=grace_kill
    )
    willing = running_pausable("willing", 1, now - 200, "GPU-0")
    urgent = live_job("urgent", state=WAITING, priority=5, request={"bytes": 16 * GiB})
    ledger = Ledger(tmp_path)
    with ledger.transaction() as data:
        data.jobs[:] = [deaf, willing, urgent]
    rules = PauseRules(min_runtime=1.0, grace_max=30.0)
    assert ask_for_room(ledger, urgent, TWO_CARDS, 0.9, rules) == ("deaf",)
    lifecycle.pause_signalled(ledger, "deaf", now - 20, [os.getpid()])
    assert ask_for_room(ledger, urgent, TWO_CARDS, 0.9, rules) == ()
    # Signalled 40 s ago, past the waiter's 30 s: the other job is asked.
    lifecycle.pause_signalled(ledger, "deaf", now - 40, [os.getpid()])
    said = pause_progress(ledger.read(), "urgent", time.time(), grace_max=30.0)
    # Its TERM, with --grace-kill, still comes at its own grace.
    told = "it gets TERM at its own grace" if grace_kill else "left alone (pause_grace_max"
    assert said is not None and told in said, said
    assert ask_for_room(ledger, urgent, TWO_CARDS, 0.9, rules) == ("willing",)


def test_a_waiter_past_its_grace_max_says_a_grace_kill_job_still_gets_term_at_its_grace(
    tmp_path: Path,
) -> None:
    # A job started with --grace 15m --grace-kill, asked 11 minutes ago: its waiter asks others
    # past pause_grace_max, but the job is not left alone, its TERM comes at 15 minutes.
    from gpuwait.queue.entries import LedgerData
    from gpuwait.queue.pausing import pause_progress

    now = time.time()
    slow = running_pausable(
        "slow",
        1,
        now - 3600,
        grace_seconds=900.0,
        grace_kill=True,
        pause_requested_at=now - 661,
        pause_requested_by="urgent",
        pause_signalled_at=now - 660,
    )
    urgent = live_job("urgent", state=WAITING, priority=5, request={"bytes": 16 * GiB})
    data = LedgerData(jobs=[slow, urgent])
    said = pause_progress(data, "urgent", now, grace_max=600.0)
    assert said is not None and "left alone" not in said, said
    assert "it gets TERM at its own grace (15m00s)" in said, said
    # Past its own grace too, it ignores the TERM: left alone.
    said = pause_progress(data, "urgent", now + 300, grace_max=600.0)
    assert said is not None and "left alone (pause_grace_max" in said, said


def test_a_waiter_held_back_by_its_dependencies_asks_nobody_to_step_aside(
    tmp_path: Path,
) -> None:
    # An urgent job that waits for an --after job could not start in the room freed: the job
    # that stepped aside would wait for it (hours, maybe) with its GPU idle.
    from gpuwait.core.pausing import PauseRules
    from gpuwait.queue.pausing import ask_for_room

    now = time.time()
    long = running_pausable("long", 1, now - 700)
    first = live_job(
        "first",
        state=RUNNING,
        started_at=now - 5,
        gpu_uuids=["GPU-0"],
        reserved_bytes=1 * GiB,
        request={"bytes": GiB},
    )
    after = live_job(
        "urgent", state=WAITING, priority=5, after=["first"], request={"bytes": 16 * GiB}
    )
    ledger = Ledger(tmp_path)
    with ledger.transaction() as data:
        data.jobs[:] = [long, first, after]
    assert ask_for_room(ledger, after, MACHINE, 0.9, PauseRules(min_runtime=1.0)) == ()
    # Once nothing but room holds it back, it asks.
    free = after._replace(after=[])
    with ledger.transaction() as data:
        data.jobs[:] = [long, first, free]
    assert ask_for_room(ledger, free, MACHINE, 0.9, PauseRules(min_runtime=1.0)) == ("long",)


def test_a_job_that_stepped_aside_does_not_wait_for_a_stopped_job_it_made_room_for(
    tmp_path: Path, procs: Any
) -> None:
    # A --pausable job stepped aside for an urgent waiter, whose gpuwait was then stopped
    # (Ctrl-Z) before it started: passed over until continued, the urgent job starts nothing,
    # and the job that stepped aside resumes on the card it freed instead of waiting with it idle.
    import signal

    stopped = procs(["sleep", "60"])
    os.kill(stopped.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: process_state(stopped.pid) == "T", timeout=10)
        urgent = live_job(
            "urgent", pid=stopped.pid, state=WAITING, priority=5, request={"bytes": 16 * GiB}
        )
        resumed = stepped_aside_for("urgent", "resumed")
        ledger = Ledger(tmp_path)
        with ledger.transaction() as data:
            data.jobs[:] = [urgent, resumed]
        _, attempt = lifecycle.admit(ledger, resumed, MACHINE, 0.9)
        assert isinstance(attempt, Admitted), attempt
    finally:
        os.kill(stopped.pid, signal.SIGKILL)


def test_two_jobs_that_stepped_aside_for_each_other_do_not_wait_for_each_other(
    tmp_path: Path,
) -> None:
    # `first` stepped aside for `urgent`, which started, then sat idle; `first`, waiting to
    # resume, asked it to step aside (idle_action = pause asks one's own idle jobs whatever
    # their priority), and it did. Each then waited for the other to start, both for ever.
    from gpuwait.core.pausing import PauseRules
    from gpuwait.queue.pausing import ask_for_room

    ledger = Ledger(tmp_path)
    first = stepped_aside_for("urgent", "first")
    urgent = running_pausable("urgent", 5, time.time() - 60)
    with ledger.transaction() as data:
        data.jobs[:] = [first, urgent]
    rules = PauseRules(min_runtime=1.0)
    assert ask_for_room(ledger, first, MACHINE, 0.9, rules, frozenset({"urgent"})) == ("urgent",)
    lifecycle.step_aside(ledger, urgent, 60.0)
    # The job that asked last goes first: `urgent` started after `first` stepped aside for it.
    first, attempt = lifecycle.admit(ledger, first, MACHINE, 0.9)
    assert isinstance(attempt, Admitted), attempt
    # Resumed, what it stepped aside for is behind it: a retry after running out of memory
    # queues it again without waiting for `urgent` to start once more.
    assert first.yield_to is None
    waiting = ledger.read().find("urgent")
    assert waiting is not None and waiting.yield_to == "first" and waiting.state == WAITING


def test_a_resumed_job_is_asked_to_step_aside_again_as_a_job_of_its_own_priority(
    tmp_path: Path,
) -> None:
    # A priority-1 job stepped aside for an urgent (p5) job and queued at p5 to resume. Once it
    # ran again, it kept that p5 for good: no waiter of priority 2-5 could ask it to step aside
    # any more, and a p4 job waited behind a p1 job until it ended.
    from gpuwait.core.pausing import PauseRules
    from gpuwait.queue.pausing import ask_for_room

    ledger = Ledger(tmp_path)
    resumed = stepped_aside_for("gone", "resumed")
    with ledger.transaction() as data:
        data.jobs[:] = [resumed]
    resumed, attempt = lifecycle.admit(ledger, resumed, MACHINE, 0.9)
    assert isinstance(attempt, Admitted) and resumed.effective_priority == 1, resumed
    with ledger.transaction() as data:
        data.jobs[0].started_at, data.jobs[0].started_boot = time.time() - 60, None
        data.jobs.append(live_job("p4", state=WAITING, priority=4, request={"bytes": 16 * GiB}))
    waiter = ledger.read().find("p4")
    assert waiter is not None
    rules = PauseRules(min_runtime=1.0)
    assert ask_for_room(ledger, waiter, MACHINE, 0.9, rules) == ("resumed",)


def test_a_job_after_a_whole_sweep_keeps_its_entry(tmp_path: Path) -> None:
    """`--after sweep` names every job of the batch, those that already ended too: after a
    sweep of a thousand, more than the 1024 an entry may list, so every later read refused the
    new entry and dropped it (its gpuwait waited on, in no queue). Jobs that ended are met
    dependencies, left out from the start."""
    ledger = Ledger(tmp_path)
    with ledger.transaction() as data:
        data.jobs.extend(live_job(f"w{i:04d}", batch="sweep", order=i) for i in range(1020))
        for i in range(10):
            data.book.note_finished(Finished(f"f{i}", OK, time.time(), batch="sweep"))
    lifecycle.submit(ledger, live_job("report"), ["sweep"], [], tmp_path, ["x"])
    report = ledger.read().find("report")
    assert report is not None and len(report.after) == 1020
    assert not ledger.take_warnings()


def test_a_job_after_more_unfinished_jobs_than_an_entry_holds_is_refused(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    with ledger.transaction() as data:
        data.jobs.extend(live_job(f"w{i:04d}", batch="sweep", order=i) for i in range(1020))
        for i in range(10):  # failed: each one still fails an --after-ok
            data.book.note_finished(Finished(f"f{i}", FAILED, time.time(), batch="sweep"))
    with pytest.raises(UsageError, match="names 1030 jobs that have not ended, more than the 1024"):
        lifecycle.submit(ledger, live_job("report"), [], ["sweep"], tmp_path, ["x"])
    assert ledger.read().find("report") is None


def _expected_left(ledger: Ledger, job_id: str) -> float | None:
    """What `gpuwait status --json` says is left of the job's expected run time."""
    report = report_from(MACHINE, ledger.read(), time.time(), View(0.9), boot_now=proc.boot_clock())
    (shown,) = [j for j in report["jobs"] if j["id"] == job_id]
    left = shown["expected_remaining_seconds"]
    return None if left is None else float(left)


def test_a_resumed_job_is_expected_to_end_after_what_its_earlier_runs_left(tmp_path: Path) -> None:
    """A --pausable job of 10 minutes that checkpointed after 500 s resumes with 100 s of work
    left, and 20 s to load its checkpoint: not with its whole 10 minutes ahead of it, as status
    showed, and as waiters behind it and those deciding whether to ask it to step aside again
    counted."""
    ledger = Ledger(tmp_path)
    long = live_job(
        "long",
        pausable=True,
        request={"bytes": 16 * GiB},
        expected_seconds=600.0,
        load_seconds=20.0,
    )
    job = lifecycle.submit(ledger, long, [], [], tmp_path, ["x"])
    job, outcome = lifecycle.admit(ledger, job, MACHINE, 0.9)
    assert isinstance(outcome, Admitted)
    job = lifecycle.started(ledger, job, os.getpid())
    assert _expected_left(ledger, "long") == pytest.approx(600, abs=5)
    job = lifecycle.step_aside(ledger, job, 500.0)
    job, outcome = lifecycle.admit(ledger, job, MACHINE, 0.9)
    assert isinstance(outcome, Admitted)
    lifecycle.started(ledger, job, os.getpid())
    assert _expected_left(ledger, "long") == pytest.approx(120, abs=5)


def _thawed_after_500s(ledger: Ledger, tmp_path: Path) -> Job:
    """A --freezable job of 10 minutes, frozen after 500 s and thawed: running again."""
    long = live_job("long", freezable=True, request={"bytes": 16 * GiB}, expected_seconds=600.0)
    job = lifecycle.submit(ledger, long, [], [], tmp_path, ["x"])
    job, outcome = lifecycle.admit(ledger, job, MACHINE, 0.9)
    assert isinstance(outcome, Admitted)
    job = lifecycle.started(ledger, job, os.getpid())
    # Frozen after 500 s: its memory comes back as it was, with nothing to load again.
    with ledger.transaction() as data:
        entry = data.find("long")
        assert entry is not None and entry.started_boot is not None
        entry.started_at = time.time() - 500
        entry.started_boot -= 500
    job = lifecycle.freeze(ledger, job, [os.getpid()], time.time())
    job, outcome = lifecycle.admit(ledger, job, MACHINE, 0.9)
    assert isinstance(outcome, Admitted)
    return lifecycle.thaw(ledger, job, time.time())


@pytest.mark.usefixtures("booted_an_hour_ago")
def test_a_thawed_job_is_expected_to_end_after_what_it_ran_before_it_was_frozen(
    tmp_path: Path,
) -> None:
    ledger = Ledger(tmp_path)
    _thawed_after_500s(ledger, tmp_path)
    assert _expected_left(ledger, "long") == pytest.approx(100, abs=5)


@pytest.mark.usefixtures("booted_an_hour_ago")
def test_a_retry_of_a_thawed_job_is_expected_to_run_its_whole_run_time(tmp_path: Path) -> None:
    # Thawed, the job ran out of memory, and its retry started its command anew: a frozen job
    # keeps no checkpoint of its own. Status showed the retry with 100 s left of its 10 minutes,
    # overdue soon after, and waiters behind it counted on its end that early.
    ledger = Ledger(tmp_path)
    job = _thawed_after_500s(ledger, tmp_path)
    job = lifecycle.retry(ledger, job, {"bytes": 20 * GiB})
    job, outcome = lifecycle.admit(ledger, job, MACHINE, 0.9)
    assert isinstance(outcome, Admitted)
    lifecycle.started(ledger, job, os.getpid())
    assert _expected_left(ledger, "long") == pytest.approx(600, abs=5)


def test_a_job_cancelled_as_its_run_ran_out_of_memory_is_not_queued_again(
    tmp_path: Path,
) -> None:
    # A --retry-oom job cancelled while it ran, its run ending out of memory before the TERM
    # ended it: its retry took it for a run that ran out and queued it again, and the job the
    # user had cancelled ran once more, on room another job was waiting for.
    ledger = Ledger(tmp_path)
    job = lifecycle.submit(ledger, live_job("oom"), [], [], tmp_path, ["x"])
    job, outcome = lifecycle.admit(ledger, job, MACHINE, 0.9)
    assert isinstance(outcome, Admitted)
    job = lifecycle.started(ledger, job, os.getpid())
    with ledger.transaction() as data:
        entry = data.find("oom")
        assert entry is not None
        entry.cancelled_by = os.getuid()
    assert lifecycle.retry(ledger, job, {"bytes": 20 * GiB}) is None
    entry = ledger.read().find("oom")
    assert entry is not None
    assert (entry.state, entry.request) == (RUNNING, job.request)
    assert [e["kind"] for e in events.read_events(tmp_path)] == ["submit", "admit", "start"]


@pytest.mark.parametrize("ended", ["command", "gpuwait"])
def test_a_process_under_a_pid_a_job_had_is_not_refused_adoption(
    tmp_path: Path, ended: str
) -> None:
    # A job's command ended and its pid was taken by an unrelated shell since, while the job's
    # gpuwait lives on (finishing); or its gpuwait was killed, its command left running, and
    # the gpuwait's pid was taken: a program that shell runs was refused adoption, 'already
    # belongs to gpuwait job ID'.
    ledger = Ledger(tmp_path)
    env = {**os.environ, "GPUWAIT_JOB_ID": "ended"}
    other = subprocess.Popen(["sleep", "60"], start_new_session=True, env=env)
    shell = subprocess.Popen(["sh", "-c", "sleep 60; :"], start_new_session=True)
    try:
        wait_for(lambda: proc.process_tree([shell.pid]) != {shell.pid}, timeout=30)
        (program,) = set(proc.process_tree([shell.pid])) - {shell.pid}
        began = proc.start_time(shell.pid)
        assert began is not None
        # The process the entry names had the shell's pid and ended a second before the shell
        # began; the entry's other process lives.
        if ended == "command":
            job = live_job("ended", other.pid, child_pid=shell.pid, child_start_time=began - 100)
        else:
            job = live_job(
                "ended",
                shell.pid,
                start_time=began - 100,
                orphaned_at=time.time(),
                child_pid=other.pid,
                child_start_time=proc.start_time(other.pid),
            )
        with ledger.transaction() as data:
            data.jobs.append(job._replace(state=RUNNING, gpu_uuids=["GPU-0"]))
        adopted = lifecycle.adopt(ledger, live_job("adopted", pid=program, state=RUNNING))
        assert adopted.pid == program
        assert [j.id for j in ledger.read().jobs] == ["ended", "adopted"]
    finally:
        for started in (shell, other):
            os.killpg(started.pid, 9)
            started.wait(timeout=30)


def test_a_resumed_run_over_its_reservation_is_said_so_again(tmp_path: Path) -> None:
    # A --pausable job's run went over its reservation, then it stepped aside. Waiting, status
    # went on showing it over its reservation, and when its resumed run went over by a little
    # less, nothing said so: the first run's figures stood for the new run.
    ledger = Ledger(tmp_path)
    job = lifecycle.submit(
        ledger, live_job("p", pausable=True, request={"bytes": 16 * GiB}), [], [], tmp_path, ["x"]
    )
    for used in (22 * GiB, 21 * GiB):
        job, outcome = lifecycle.admit(ledger, job, MACHINE, 0.9)
        assert isinstance(outcome, Admitted)
        job = lifecycle.started(ledger, job, os.getpid())
        job = lifecycle.publish_usage(ledger, job, {"GPU-0": used}, [os.getpid()])
        job = lifecycle.step_aside(ledger, job, 60.0)
        (shown,) = report_from(MACHINE, ledger.read(), time.time(), View(0.9))["jobs"]
        assert (shown["state"], shown["overuse"], shown["held_by"]) == (WAITING, None, [])
    said = [
        e["used_bytes"] for e in events.read_events(tmp_path) if e["kind"] == "over-reservation"
    ]
    assert said == [22 * GiB, 21 * GiB]


def test_an_admission_undone_by_its_own_check_keeps_the_place_a_step_aside_gave(
    tmp_path: Path,
) -> None:
    # A p1 job stepped aside for an urgent job (p5) that still waits, so it waits at p5 behind
    # it. Admitted in a shared ledger where its own check of fresh readings found no room, it
    # waited on at p1, behind every p2-p4 job submitted since, and no longer behind the urgent.
    ledger = Ledger(tmp_path)
    urgent = live_job("urgent", state=WAITING, priority=5, request={"bytes": 16 * GiB})
    asked = stepped_aside_for("urgent", "resumed")
    with ledger.transaction() as data:
        data.jobs[:] = [urgent, stepped_aside_for("urgent", "resumed")]
        # Admitted as a plan admits it (what it stepped aside for is behind it).
        entry = data.jobs[1]
        entry.state, entry.gpu_uuids, entry.reserved_bytes = RUNNING, ["GPU-0"], 16 * GiB
        entry.boost, entry.yield_to, entry.started_at = 0, None, time.time()
    assert lifecycle.confirm_admission(ledger, "resumed", asked, MACHINE, lambda *_: False) is None
    undone = ledger.read().find("resumed")
    assert undone is not None and undone.state == WAITING and not undone.gpu_uuids
    assert (undone.effective_priority, undone.yield_to) == (5, "urgent")
    assert undone.started_at is None and undone.reserved_bytes == 0


def test_a_job_left_running_by_a_machine_that_went_down_is_charged_until_the_boot(
    tmp_path: Path,
) -> None:
    """Its processes ended by the time the machine booted again: what it held until then is
    its user's usage, not the hours the machine stood and ran since."""
    if proc.boot_id() is None:
        pytest.skip("no boot id to tell an earlier boot by")
    now = time.time()
    booted = now - proc.boot_clock()
    ledger = Ledger(tmp_path, fair_half_life=None)
    with ledger.transaction() as data:
        data.jobs.append(
            live_job(
                "crashed",
                state=RUNNING,
                boot="an earlier boot",
                started_at=booted - 3600,  # an hour before the machine went down
                gpu_uuids=["GPU-0"],
                reserved_bytes=GiB,
            )
        )
    assert lifecycle.reap(ledger) == ["crashed"]
    usage = ledger.read().usage[os.getuid()].vram_seconds
    assert usage == pytest.approx(GiB * 3600, rel=0.01)


def test_word_of_how_a_run_ended_is_read_once_and_damaged_word_kept_as_evidence(
    tmp_path: Path,
) -> None:
    """A gpuwait that could not take its entry out leaves word of how its run ended for the
    gpuwait that reaps the entry (`leave_word`): read back as written, once; a word that is
    damaged (cut short, or from another schema) is not believed, and kept beside for a look."""
    ledger = Ledger(tmp_path / "ledger")
    job = live_job("a1b2", history_dir=str(tmp_path / "state"))
    assert lifecycle.leave_word(ledger, job, OK, exit_status=0, run_seconds=2.5)
    read: list[tuple[Path, bool]] = []
    assert lifecycle._word_left(job, read) == (OK, {"exit_status": 0, "run_seconds": 2.5})
    lifecycle._take_words(read)
    assert lifecycle._word_left(job, []) is None
    words = tmp_path / "state" / "ended"
    for damaged in (b'{"schema": 1, "outcome": "o', b'{"schema": 99, "outcome": "ok"}'):
        (words / "a1b2.json").write_bytes(damaged)
        read = []
        assert lifecycle._word_left(job, read) is None
        lifecycle._take_words(read)
    kept = sorted(p.read_bytes() for p in words.iterdir())
    assert kept == sorted([b'{"schema": 1, "outcome": "o', b'{"schema": 99, "outcome": "ok"}'])


@pytest.mark.parametrize(
    "how",
    [
        {"exit_status": 2**70},
        {"charge_usage": [1e9, 0]},
        {"charge_usage": [float("inf"), -1.0]},
    ],
)
def test_a_word_saying_what_no_run_ends_with_is_not_believed(
    tmp_path: Path, how: dict[str, Any]
) -> None:
    """A word of how a run ended with a figure no run ends with (an exit status past any, a
    cause of a book's size, a half-life of zero): taken as said, it made the next transaction
    fail with a traceback, or went into the book, which the next read then dropped whole
    with every job's outcome (so every `--after-ok` waiting on one failed)."""
    ledger = Ledger(tmp_path / "ledger", fair_half_life=3600.0)
    gone = subprocess.Popen(["true"])
    gone.wait()
    state = tmp_path / "state"
    job = live_job("a1b2", pid=gone.pid, start_time=1, history_dir=str(state))
    with ledger.transaction() as data:
        data.jobs.append(job)
        data.book.note_finished(Finished("prep", OK, time.time()))
        data.usage[os.getuid()] = UserUsage(1e9, time.time())
    words = state / "ended"
    words.mkdir(parents=True)
    (words / "a1b2.json").write_text(
        json.dumps({"schema": 1, "outcome": FAILED, **how}), encoding="utf-8"
    )
    lifecycle.reap(ledger)
    data = ledger.read()
    assert data.jobs == []
    assert data.book.outcome("prep") is not None
    assert data.book.outcome("a1b2") is not None
    usage = data.usage[os.getuid()].vram_seconds
    assert 0 <= usage <= 1e9


def test_a_word_left_for_an_entry_taken_out_since_is_tidied_by_the_next_job_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A program whose thread took its entry out once the ledger's lock was free, and that
    ended before the thread removed the word it had left (`leave_word`), left the word in
    ended/ for good: nothing read or removed it. The next job to end in that ledger takes it
    away (one left in a container of this machine, of a host name of its own, too); a word
    for an entry still there, or one left for another ledger, stays."""
    state = tmp_path / "state"
    ledger = Ledger(tmp_path / "ledger")
    stray, waiting, ending, contained = (
        live_job(job_id, history_dir=str(state))
        for job_id in ("0000aaaa", "0000bbbb", "0000dddd", "0000eeee")
    )
    with ledger.transaction() as data:
        data.jobs[:] = [waiting, ending]
    assert lifecycle.leave_word(ledger, stray, OK, exit_status=0)
    with monkeypatch.context() as in_a_container:
        in_a_container.setattr(netfs, "machine_name", lambda: "0123abcd4567")
        assert lifecycle.leave_word(ledger, contained, OK, exit_status=0)
    assert lifecycle.leave_word(ledger, waiting, OK, exit_status=0)
    elsewhere = live_job("0000cccc", history_dir=str(state))
    assert lifecycle.leave_word(Ledger(tmp_path / "other"), elsewhere, OK, exit_status=0)
    lifecycle.finish(ledger, ending, OK, exit_status=0)
    left = sorted(p.name for p in (state / "ended").iterdir())
    assert left == ["0000bbbb.json", "0000cccc.json"]


def test_a_word_left_before_words_named_their_machine_is_tidied_once_old_enough(
    tmp_path: Path,
) -> None:
    """A word left by a gpuwait of before words named their machine (no host name, no boot
    id) and that no entry stands for stayed in ended/ for good: no job's end took it away,
    since it could not be told from another machine's. Once older than any word a gpuwait
    still waits to read (a month), the next job to end in its ledger takes it away; a recent
    one stays (another machine's gpuwait may yet read it), and so does one of another ledger."""
    state = tmp_path / "state"
    words = state / "ended"
    words.mkdir(parents=True)
    ledger = Ledger(tmp_path / "ledger")
    old = time.time() - 40 * 24 * 3600
    for job_id, where, when in (
        ("0000aaaa", ledger.directory, old),
        ("0000bbbb", ledger.directory, time.time()),
        ("0000cccc", tmp_path / "other", old),
    ):
        path = words / f"{job_id}.json"
        path.write_text(
            json.dumps({"schema": 1, "outcome": "ok", "ledger": str(where), "exit_status": 0})
        )
        os.utime(path, (when, when))
    ending = live_job("0000dddd", history_dir=str(state))
    with ledger.transaction() as data:
        data.jobs[:] = [ending]
    lifecycle.finish(ledger, ending, OK, exit_status=0)
    assert sorted(p.name for p in words.iterdir()) == ["0000bbbb.json", "0000cccc.json"]


def gone_running_job(job_id: str, state_dir: Path) -> Job:
    """A running job's entry whose gpuwait and command are gone, its state dir `state_dir`."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    return live_job(
        job_id,
        pid=gone.pid,
        start_time=1,
        state=RUNNING,
        gpu_uuids=["GPU-0"],
        reserved_bytes=GiB,
        started_at=time.time() - 60,
        history_dir=str(state_dir),
    )


@pytest.mark.parametrize(
    "word",
    [
        b'{"schema": 1, "outcome": "ok", "exit_status": "0"}',
        b'{"schema": 1, "outcome": "ok", "exit_status": true}',
        b'{"schema": 1, "outcome": "ok", "charge_usage": [60.0, null, 1]}',
        b'{"schema": 1, "outcome": "ok", "charge_usage": ["60", null]}',
        b'{"schema": 1, "outcome": "ok", "charge_usage": [60.0, "1h"]}',
        b'{"schema": 1, "outcome": "ok", "paused": [true, 3.0]}',
        b'{"schema": 1, "outcome": "failed", "signal": 9.0}',
        b'{"schema": 1, "outcome": "failed", "signal": 0}',
        b'{"schema": 1, "outcome": "failed", "oom": 137}',
        b'{"schema": 1, "outcome": "failed", "oom": ""}',
    ],
)
def test_a_word_of_a_runs_end_with_a_field_of_the_wrong_kind_is_not_believed(
    tmp_path: Path, word: bytes
) -> None:
    """A word of how a run ended that holds what no gpuwait writes (damaged, or edited) is
    not believed: the entry is reaped as lost, the word kept beside as evidence, and nobody's
    gpuwait fails on it."""
    ledger = Ledger(tmp_path / "ledger", fair_half_life=None)
    ran = gone_running_job("a1b2", tmp_path / "state")
    with ledger.transaction() as data:
        data.jobs[:] = [ran]
    (tmp_path / "state" / "ended").mkdir(parents=True)
    (tmp_path / "state" / "ended" / "a1b2.json").write_bytes(word)
    lifecycle.reap(ledger)
    data = ledger.read()
    done = data.book.outcome("a1b2")
    assert not data.jobs and done is not None and done.outcome == LOST
    kept = [p.read_bytes() for p in (tmp_path / "state" / "ended").iterdir()]
    assert kept == [word]


@pytest.mark.parametrize(
    "how",
    [
        {"signal": 1, "run_seconds": 0.0, "oom": "CUDA out of memory"},
        {"exit_status": 1, "run_seconds": 75.5},
    ],
    ids=["hung-up", "exit-1"],
)
def test_a_failed_run_that_left_word_of_its_end_is_recorded_as_it_ended(
    tmp_path: Path, how: dict[str, object]
) -> None:
    """A run killed by SIGHUP (its terminal closed) at once, with an out-of-memory error, or
    one that exited 1, while another process kept the ledger's lock, its gpuwait leaving word
    of how it ended: the entry is reaped as failed, not as lost."""
    ledger = Ledger(tmp_path / "ledger", fair_half_life=None)
    ran = gone_running_job("a1b2", tmp_path / "state")
    with ledger.transaction() as data:
        data.jobs[:] = [ran]
    assert lifecycle.leave_word(ledger, ran, FAILED, **how)
    lifecycle.reap(ledger)
    data = ledger.read()
    done = data.book.outcome("a1b2")
    assert not data.jobs and done is not None and done.outcome == FAILED
    assert not (tmp_path / "state" / "ended" / "a1b2.json").exists()


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_word_that_is_no_plain_file_is_not_believed_and_stops_no_transaction(
    tmp_path: Path, kind: str
) -> None:
    """Where a gone job's word of its end is a symlink (to a word of another job's) or a FIFO,
    it is not followed nor waited on: the entry is reaped as lost, and the user's gpuwaits go
    on, where a failure there would fail every transaction for as long as the entry stayed."""
    ledger = Ledger(tmp_path / "ledger", fair_half_life=None)
    ran = gone_running_job("a1b2", tmp_path / "state")
    with ledger.transaction() as data:
        data.jobs[:] = [ran]
    words = tmp_path / "state" / "ended"
    words.mkdir(parents=True)
    (words / "c3d4.json").write_text('{"schema": 1, "outcome": "ok", "exit_status": 0}')
    if kind == "symlink":
        (words / "a1b2.json").symlink_to("c3d4.json")
    else:
        os.mkfifo(words / "a1b2.json")
    lifecycle.reap(ledger)
    data = ledger.read()
    done = data.book.outcome("a1b2")
    assert not data.jobs and done is not None and done.outcome == LOST


def test_a_word_left_on_another_machine_sharing_the_state_dir_is_not_tidied_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Machines that mount one home directory share its state dir, and with it ended/, while a
    `ledger_dir` of one path on each (/var/lib/gpuwait, the lab set-up) is each machine's own.
    A run that ended on gpu02 while that ledger's lock was kept left word of how it ended, for
    gpu02's next gpuwait: a job that ended on this machine took it away, as a word no entry of
    its ledger stood for, and the run was then reaped on gpu02 as lost (a step waiting on it
    with --after-ok gave up, exit 6)."""
    state, shared_path = tmp_path / "state", tmp_path / "ledger"
    theirs = Ledger(shared_path)
    ran = gone_running_job("0000aaaa", state)
    with theirs.transaction() as data:
        data.jobs[:] = [ran, live_job("0000cccc", after_ok=["0000aaaa"])]
    with monkeypatch.context() as on_gpu02:
        on_gpu02.setattr(netfs, "machine_name", lambda: "gpu02")
        on_gpu02.setattr(proc, "boot_id", lambda: "gpu02's boot")
        assert lifecycle.leave_word(theirs, ran, OK, exit_status=0, run_seconds=60.0)
    # This machine's ledger, at the same path here.
    shared_path.rename(tmp_path / "on-gpu02")
    here = Ledger(shared_path)
    ending = live_job("0000bbbb", history_dir=str(state))
    with here.transaction() as data:
        data.jobs[:] = [ending]
    lifecycle.finish(here, ending, OK, exit_status=0)
    # Back on gpu02, whose next gpuwait reaps the entry as the run ended.
    shutil.rmtree(shared_path)
    (tmp_path / "on-gpu02").rename(shared_path)
    monkeypatch.setattr(netfs, "machine_name", lambda: "gpu02")
    lifecycle.reap(Ledger(shared_path))
    data = Ledger(shared_path).read()
    done = data.book.outcome("0000aaaa")
    assert done is not None and done.outcome == OK
    assert conditions.dependency_blocker(data.jobs[0], data) is None


def test_a_run_that_left_word_of_its_end_counts_for_its_waiters_and_its_users_usage(
    tmp_path: Path,
) -> None:
    """A run ended while another process kept the ledger's lock, its gpuwait leaving word of
    how it ended: the gpuwait that reaps its entry takes it as it ended, so a job already
    waiting for it with --after-ok may start, and what it held counts in its user's usage."""
    ledger = Ledger(tmp_path / "ledger", fair_half_life=None)
    ran = gone_running_job("a1b2", tmp_path / "state")
    with ledger.transaction() as data:
        data.jobs[:] = [ran, live_job("c3d4", after_ok=["a1b2"])]
    usage = [60.0 * GiB, None]
    assert lifecycle.leave_word(
        ledger, ran, OK, exit_status=0, run_seconds=60.0, charge_usage=usage
    )
    lifecycle.reap(ledger)
    data = ledger.read()
    assert [j.id for j in data.jobs] == ["c3d4"]
    assert conditions.dependency_blocker(data.jobs[0], data) is None
    assert data.usage[os.getuid()].vram_seconds == pytest.approx(60 * GiB, rel=0.01)


def test_a_job_ends_whatever_lies_in_ended_beside_the_words(tmp_path: Path) -> None:
    """The next job to end in a ledger takes away the words no entry stands for: it read
    every file in ended/, a FIFO there too, which hung that job's end (its gpuwait, for ever)
    and every later one's. Such a file is read as the words are where an entry is reaped:
    never waited on, never followed through a symlink, and it is no word to take away."""
    import threading

    state = tmp_path / "state"
    ledger = Ledger(tmp_path / "ledger")
    ending = live_job("0000dddd", history_dir=str(state))
    with ledger.transaction() as data:
        data.jobs[:] = [ending]
    (state / "ended").mkdir(parents=True)
    fifo = state / "ended" / "0000eeee.json"
    os.mkfifo(fifo)
    done = threading.Thread(target=lifecycle.finish, args=(ledger, ending, OK), daemon=True)
    done.start()
    done.join(5)
    hung = done.is_alive()
    if hung:  # let the thread go: a writer opens the FIFO it waits on
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        done.join(5)
    assert not hung, "the job's end hung on a FIFO in ended/"
    assert ledger.read().jobs == []


def test_a_damaged_word_read_as_a_job_ends_is_kept_as_evidence(tmp_path: Path) -> None:
    """A job's end reaps the entries whose gpuwait is gone, reading the words they left: one
    not believed (a figure no run ends with) is to be kept beside as evidence once the reaping
    is written. The same job's end took away every word no entry stood for any more, the
    reaped entry's too, before the reaping was written: the evidence was deleted."""
    ledger = Ledger(tmp_path / "ledger")
    gone = subprocess.Popen(["true"])
    gone.wait()
    state = tmp_path / "state"
    dead = live_job("a1b2", pid=gone.pid, start_time=1, history_dir=str(state))
    ending = live_job("0000dddd", history_dir=str(state))
    with ledger.transaction() as data:
        data.jobs[:] = [dead, ending]
    assert lifecycle.leave_word(ledger, dead, OK, exit_status=2**40)
    lifecycle.finish(ledger, ending, OK, exit_status=0)
    assert ledger.read().jobs == []
    kept = [p.name for p in (state / "ended").iterdir()]
    assert len(kept) == 1 and kept[0].startswith("a1b2.json.damaged-"), kept


def _launcher(ledger: Ledger, tmp_path: Path, wall: Iterable[float]) -> Callable[[str, int], Job]:
    """Launches of so many GiB into `ledger`, each stamped with the next time of `wall` (the
    wall clock's)."""
    stamps = iter(wall)

    def launch(name: str, gib: int) -> Job:
        job = live_job(name, request={"bytes": gib * GiB}, submitted_at=next(stamps))
        return lifecycle.submit(ledger, job, [], [], tmp_path, ["x"])

    return launch


def _waiting_in_order(ledger: Ledger) -> list[str]:
    """The ids of the jobs waiting in `ledger`, first in line first."""
    waiting = (j for j in ledger.read().jobs if j.state == WAITING)
    return [j.id for j in sorted(waiting, key=lambda j: (-j.priority, j.order))]


def _holder_and_waiter_lost(
    ledger: Ledger, launch: Callable[[str, int], Job], tmp_path: Path
) -> tuple[Job, Job]:
    """On one 24 GiB card a 20 GiB job runs and a 13 GiB one waits behind it; then the ledger
    is lost (started afresh at the next transaction). The two jobs, as their gpuwaits know them."""
    running, outcome = lifecycle.admit(ledger, launch("holder", 20), MACHINE, 0.99)
    assert isinstance(outcome, Admitted)
    waiting, _ = lifecycle.admit(ledger, launch("waiter", 13), MACHINE, 0.99)
    assert waiting.state == WAITING
    ledger.path.unlink()
    return running, waiting


def test_launches_made_after_a_waiters_entry_was_lost_keep_their_own_order_behind_it(
    tmp_path: Path,
) -> None:
    """A 20 GiB job runs and a 13 GiB one waits behind it on one 24 GiB card; the ledger is
    started afresh and three 13 GiB launches follow, numbered from 1 in the new file. Once the
    running job and the waiter have put their entries back, the waiter is first in line and the
    three launches behind it in the order they were made."""
    ledger = Ledger(tmp_path)
    launch = _launcher(ledger, tmp_path, (1000.0 + n for n in range(1, 10)))
    running, waiting = _holder_and_waiter_lost(ledger, launch, tmp_path)
    later = [launch(name, 13) for name in ("first", "second", "third")]
    lifecycle.publish_usage(ledger, running, {"GPU-0": 20 * GiB}, [os.getpid()])
    for job in later:
        assert lifecycle.admit(ledger, job, MACHINE, 0.99)[0].state == WAITING
    lifecycle.admit(ledger, waiting, MACHINE, 0.99)
    assert _waiting_in_order(ledger) == ["waiter", "first", "second", "third"]


def test_a_waiters_entry_put_back_keeps_its_place_where_the_clock_was_set_back_since(
    tmp_path: Path,
) -> None:
    """As above, the wall clock set back an hour after the waiter's launch (an NTP step, a
    virtual machine resumed): the launches made after it are stamped earlier than it, and are
    behind it all the same."""
    ledger = Ledger(tmp_path)
    wall = [5000.0, 5001.0, 1401.0, 1402.0]
    launch = _launcher(ledger, tmp_path, wall)

    running, waiting = _holder_and_waiter_lost(ledger, launch, tmp_path)
    later = [launch(name, 13) for name in ("first", "second")]
    lifecycle.publish_usage(ledger, running, {"GPU-0": 20 * GiB}, [os.getpid()])
    lifecycle.admit(ledger, waiting, MACHINE, 0.99)
    assert _waiting_in_order(ledger) == ["waiter", "first", "second"]
    assert [j.submitted_at for j in later] == [1401.0, 1402.0]


def test_a_launch_put_back_with_the_place_it_was_first_given_goes_behind_a_waiter_before_it(
    tmp_path: Path,
) -> None:
    """The ledger damaged twice: the later launch, moved behind the waiter once the waiter put
    its entry back, put its own back after the second damage with the place its gpuwait had
    known it by (the first of the file started afresh the first time), ahead of the waiter."""
    ledger = Ledger(tmp_path)
    wall = [1001.0, 1002.0, 1003.0]
    launch = _launcher(ledger, tmp_path, wall)

    running, waiting = _holder_and_waiter_lost(ledger, launch, tmp_path)
    later = launch("later", 13)
    lifecycle.publish_usage(ledger, running, {"GPU-0": 20 * GiB}, [os.getpid()])
    lifecycle.admit(ledger, waiting, MACHINE, 0.99)
    (tmp_path / "ledger.json").unlink()
    lifecycle.publish_usage(ledger, running, {"GPU-0": 20 * GiB}, [os.getpid()])
    lifecycle.admit(ledger, waiting, MACHINE, 0.99)
    lifecycle.admit(ledger, later, MACHINE, 0.99)
    assert _waiting_in_order(ledger) == ["waiter", "later"]


def test_launches_after_a_waiter_keep_their_own_order_where_the_clock_was_set_back_between(
    tmp_path: Path,
) -> None:
    """The wall clock set back an hour between two launches made after the waiter's entry was
    lost: the second is stamped before the first, and stays behind it all the same."""
    ledger = Ledger(tmp_path)
    wall = [5000.0, 5001.0, 5002.0, 1402.0]
    launch = _launcher(ledger, tmp_path, wall)

    running, waiting = _holder_and_waiter_lost(ledger, launch, tmp_path)
    for name in ("first", "second"):
        launch(name, 13)
    lifecycle.publish_usage(ledger, running, {"GPU-0": 20 * GiB}, [os.getpid()])
    lifecycle.admit(ledger, waiting, MACHINE, 0.99)
    assert _waiting_in_order(ledger) == ["waiter", "first", "second"]


def test_a_waiters_entry_put_back_keeps_its_place_before_launches_of_an_older_gpuwait(
    tmp_path: Path,
) -> None:
    """The launches made after the waiter's entry was lost were made by an older gpuwait, which
    stamps no boot clock: which came first is told on the wall clock, and they go behind it."""
    ledger = Ledger(tmp_path)
    wall = [1001.0, 1002.0, 1003.0, 1004.0]
    launch = _launcher(ledger, tmp_path, wall)

    running, waiting = _holder_and_waiter_lost(ledger, launch, tmp_path)
    for name in ("first", "second"):
        launch(name, 13)
    with ledger.transaction() as data:
        for job in data.jobs:
            job.submitted_boot = None
    lifecycle.publish_usage(ledger, running, {"GPU-0": 20 * GiB}, [os.getpid()])
    lifecycle.admit(ledger, waiting, MACHINE, 0.99)
    assert _waiting_in_order(ledger) == ["waiter", "first", "second"]


def test_two_launches_put_back_with_the_places_they_were_first_given_keep_their_order(
    tmp_path: Path,
) -> None:
    """The ledger damaged twice, with two launches made after the first damage: each puts its
    entry back with the place its gpuwait first knew it by, the second launch before the first,
    and both go behind the waiter in the order they were made."""
    ledger = Ledger(tmp_path)
    wall = [1001.0, 1002.0, 1003.0, 1004.0]
    launch = _launcher(ledger, tmp_path, wall)

    running, waiting = _holder_and_waiter_lost(ledger, launch, tmp_path)
    first, second = launch("first", 13), launch("second", 13)
    lifecycle.publish_usage(ledger, running, {"GPU-0": 20 * GiB}, [os.getpid()])
    lifecycle.admit(ledger, waiting, MACHINE, 0.99)
    (tmp_path / "ledger.json").unlink()
    lifecycle.publish_usage(ledger, running, {"GPU-0": 20 * GiB}, [os.getpid()])
    lifecycle.admit(ledger, waiting, MACHINE, 0.99)
    lifecycle.admit(ledger, second, MACHINE, 0.99)
    lifecycle.admit(ledger, first, MACHINE, 0.99)
    assert _waiting_in_order(ledger) == ["waiter", "first", "second"]


def test_a_waiters_entry_put_back_goes_before_a_launch_given_the_same_place(
    tmp_path: Path,
) -> None:
    """The running job's entry put back first, with its place, 1, the file started afresh gives
    the next launch 2, the waiter's own place: the waiter, launched first, is ahead of it."""
    ledger = Ledger(tmp_path)
    wall = [1001.0, 1002.0, 1003.0]
    launch = _launcher(ledger, tmp_path, wall)

    running, waiting = _holder_and_waiter_lost(ledger, launch, tmp_path)
    lifecycle.publish_usage(ledger, running, {"GPU-0": 20 * GiB}, [os.getpid()])
    later = launch("later", 13)
    assert later.order == waiting.order
    lifecycle.admit(ledger, waiting, MACHINE, 0.99)
    waits = {j.id: j for j in ledger.read().jobs if j.state == WAITING}
    assert waits["waiter"].order < waits["later"].order


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a file and a process of another user's")
def test_a_launch_put_back_behind_a_waiter_keeps_its_place_before_another_members_later_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shared ledger directory, this user's file damaged twice, as above: once the later
    launch was moved behind the waiter, another member (uid 4242) launched a 13 GiB job of
    theirs, given the directory's next place. The launch put back a second time goes behind
    the waiter, and ahead of that job, launched after it."""
    from gpuwait.linux import security

    monkeypatch.setattr(security, "_RUNS_GPUWAIT", {})
    directory = tmp_path / "shared"
    directory.mkdir()
    directory.chmod(0o1770)
    ledger = Ledger(directory)
    launch = _launcher(ledger, directory, [1001.0, 1002.0, 1003.0])
    running, waiting = _holder_and_waiter_lost(ledger, launch, directory)
    later = launch("later", 13)
    lifecycle.publish_usage(ledger, running, {"GPU-0": 20 * GiB}, [os.getpid()])
    lifecycle.admit(ledger, waiting, MACHINE, 0.99)
    assert _waiting_in_order(ledger) == ["waiter", "later"]

    theirs = subprocess.Popen(
        ["gpuwait", "60"], executable=shutil.which("sleep"), user=4242, group=4242
    )
    try:
        wait_for(lambda: b"gpuwait" in Path(f"/proc/{theirs.pid}/cmdline").read_bytes())
        place = ledger.read().next_order
        their_job = live_job(
            "theirs",
            pid=theirs.pid,
            uid=4242,
            command=["60"],
            request={"bytes": 13 * GiB},
            order=place,
            submitted_at=1004.0,
            submitted_boot=proc.boot_clock(),
        )
        file = LedgerData(jobs=[their_job], next_order=place + 1, me=4242)
        (directory / "ledger.4242.json").write_bytes(entries.encode(entries.to_document(file)))
        os.lchown(directory / "ledger.4242.json", 4242, 4242)
        assert _waiting_in_order(ledger) == ["waiter", "later", "theirs"]

        ledger.path.unlink()
        lifecycle.publish_usage(ledger, running, {"GPU-0": 20 * GiB}, [os.getpid()])
        lifecycle.admit(ledger, waiting, MACHINE, 0.99)
        lifecycle.admit(ledger, later, MACHINE, 0.99)
        assert _waiting_in_order(ledger) == ["waiter", "later", "theirs"]
    finally:
        theirs.kill()
        theirs.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a file and a process of another user's")
def test_a_waiters_entry_put_back_goes_before_another_members_job_launched_while_it_was_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shared ledger directory: a 20 GiB job runs and a 13 GiB one waits behind it (place 2)
    on one 24 GiB card when this user's file is lost. Another member (uid 4242) launches a
    13 GiB job meanwhile, given place 1, the directory's next with this file gone. The waiter,
    launched first, puts its entry back ahead of theirs: at place 0, the one place before 1
    that every reader takes."""
    from gpuwait.linux import security

    monkeypatch.setattr(security, "_RUNS_GPUWAIT", {})
    directory = tmp_path / "shared"
    directory.mkdir()
    directory.chmod(0o1770)
    ledger = Ledger(directory)
    launch = _launcher(ledger, directory, [1001.0, 1002.0])
    running, waiting = _holder_and_waiter_lost(ledger, launch, directory)
    assert waiting.order == 2

    theirs = subprocess.Popen(
        ["gpuwait", "60"], executable=shutil.which("sleep"), user=4242, group=4242
    )
    try:
        wait_for(lambda: b"gpuwait" in Path(f"/proc/{theirs.pid}/cmdline").read_bytes())
        their_job = live_job(
            "theirs",
            pid=theirs.pid,
            uid=4242,
            command=["60"],
            request={"bytes": 13 * GiB},
            order=1,
            submitted_at=1003.0,
            submitted_boot=proc.boot_clock(),
        )
        file = LedgerData(jobs=[their_job], next_order=2, me=4242)
        (directory / "ledger.4242.json").write_bytes(entries.encode(entries.to_document(file)))
        os.lchown(directory / "ledger.4242.json", 4242, 4242)

        lifecycle.publish_usage(ledger, running, {"GPU-0": 20 * GiB}, [os.getpid()])
        lifecycle.admit(ledger, waiting, MACHINE, 0.99)
        assert _waiting_in_order(ledger) == ["waiter", "theirs"]
        assert {j.id: j.order for j in ledger.read().jobs}["waiter"] == 0
    finally:
        theirs.kill()
        theirs.wait()


@pytest.mark.parametrize(
    ("hooked", "asks"),
    [(False, "--vram SIZE asks for less"), (True, "GPUWAIT_DEFAULT_VRAM=SIZE asks for less")],
)
def test_status_says_a_waiters_reason_as_its_own_wait_line_does(hooked: bool, asks: str) -> None:
    """`gpuwait status` says where a waiter's size came from, and how to ask for less: with
    --vram, or for a line a shell hook runs (which has no gpuwait option to give) with
    GPUWAIT_DEFAULT_VRAM, as the waiter's own line says."""
    running = live_job("run", state=RUNNING, request={"bytes": 20 * GiB}, gpu_uuids=["GPU-0"])
    whole = live_job("whole", request={}, order=2, size_source="default_vram", from_hook=hooked)
    learnt = live_job(
        "learnt", request={"bytes": 13 * GiB}, order=3, size_source="largest peak of 3 runs"
    )
    data = LedgerData(jobs=[running, whole, learnt])
    said = {
        j["id"]: j["waiting_reason"]
        for j in report_from(MACHINE, data, time.time(), View(0.9))["jobs"]
    }
    assert asks in said["whole"], said["whole"]
    assert said["learnt"].startswith("waiting for 13.0 GiB (largest peak of 3 runs)"), said


def test_status_says_a_waiter_is_held_for_another_users_unusable_file_with_no_eta() -> None:
    """Where another member's file cannot be used while their gpuwait runs, nobody is admitted
    whatever the plan would start: `gpuwait status` says a waiter waits for that file, as the
    waiter's own line does, and gives it no expected start, which the plan could not keep."""
    waiter = live_job("w", request={"bytes": GiB}, order=1)
    data = LedgerData(jobs=[waiter], unread={4242: "Expecting value"})
    (shown,) = report_from(MACHINE, data, time.time(), View(0.9))["jobs"]
    assert "the ledger file of uid 4242" in shown["waiting_reason"], shown["waiting_reason"]
    assert shown["eta_seconds"] is None, shown["eta_seconds"]


def test_four_hundred_waiters_put_back_in_reverse_launch_order_keep_their_order_quickly() -> None:
    """400 waiters lost with a damaged ledger, with places running against their launches (as
    files started afresh more than once can leave them), put their entries back one after
    another, the last launched first: each put back moves every one launched after it behind it. They end in the order they were launched, and the whole
    takes well under half a second of CPU under the ledger's lock (3.4 s when every entry
    moved looked through every waiting one)."""
    count, boot = 400, proc.boot_clock()
    assert boot is not None
    jobs = [
        live_job(f"w{n}", order=count - n, submitted_at=1000.0 + n, submitted_boot=boot - 500 + n)
        for n in range(count)
    ]
    data = LedgerData(jobs=[])
    start = time.process_time()
    for job in reversed(jobs):
        lifecycle._entry(data, job)
    spent = time.process_time() - start
    in_line = [j.id for j in sorted(data.jobs, key=lambda j: j.order)]
    assert in_line == [j.id for j in jobs]
    assert spent < 0.5, f"{spent:.2f} s of CPU"


def test_an_entry_put_back_releases_the_waiters_held_for_it(tmp_path: Path) -> None:
    """A waiter held after a damaged ledger for the entries it lost plans again once they are
    listed again: the running job's entry put back counts as a release, which wakes the
    waiters that watch the queue's summaries, as a job's end does."""
    ledger = Ledger(tmp_path)
    launch = _launcher(ledger, tmp_path, (1000.0 + n for n in range(1, 10)))
    running, _ = _holder_and_waiter_lost(ledger, launch, tmp_path)
    before = ledger.read().release_seq
    lifecycle.publish_usage(ledger, running, {"GPU-0": 20 * GiB}, [os.getpid()])
    assert ledger.read().release_seq > before
