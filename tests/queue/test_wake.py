"""Whom a ledger change wakes: only the waiters it concerns, never the whole queue."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.fixtures_sim import SimFileFactory
from helpers.jobs import live_job
from helpers.waiting import asleep_supervising, asleep_waiting, wait_for

from gpuwait.linux.stamp import FileStamp
from gpuwait.queue import wake
from gpuwait.queue.entries import RUNNING, WAITING, Job
from gpuwait.queue.ledger import Ledger

# A stand-in waiter: SIGCHLD blocked as gpuwait blocks it, then it reports whether one came.
WAITER = r"""
import signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
print("ready", flush=True)
got = signal.sigtimedwait({signal.SIGCHLD}, float(sys.argv[1]))
print("woken" if got is not None else "slept", flush=True)
"""


def entry(job_id: str, pid: int, order: int, state: str = WAITING, **extra: object) -> Job:
    return live_job(
        job_id, pid, command=["true"], request={"bytes": 2**30}, order=order, state=state, **extra
    )


def test_a_change_concerns_the_admitted_the_cancelled_their_dependents_and_the_head() -> None:
    before = {
        "run": (RUNNING, 10),
        "head": (WAITING, 11),
        "second": (WAITING, 12),
        "third": (WAITING, 13),
        "admitted": (WAITING, 14),
        "cancelled": (WAITING, 15),
        "dead": (WAITING, 16),
        "after-cancelled": (WAITING, 17),
    }
    after = [
        entry("head", 11, 1),
        entry("second", 12, 2),
        entry("third", 13, 3),
        entry("admitted", 14, 4, state=RUNNING),
        entry("after-cancelled", 17, 7, after_ok=["cancelled"]),
    ]
    quiet = frozenset({"dead"})
    # "run" was taken out (by another process: the one leaving is never signalled), so room was
    # freed: the first two in line plan (the second as a stand-in).
    assert wake.concerned(before, after, quiet, release=True) == {10, 11, 12, 14, 15, 17}
    # Without a release only the admitted, the removed and their dependents are woken.
    assert wake.concerned(before, after, quiet, release=False) == {10, 14, 15, 17}
    # Nothing but a sample of a running job's memory: nobody.
    same = {"head": (WAITING, 11), "run": (RUNNING, 10)}
    unchanged = [entry("head", 11, 1), entry("run", 10, 0, RUNNING)]
    assert wake.concerned(same, unchanged, quiet, release=False) == set()


def test_a_summary_lists_the_running_the_waiting_in_line_and_each_entry_by_its_owner() -> None:
    jobs = [
        entry("late", 12, 3),
        entry("run", 10, 1, state=RUNNING),
        entry("head", 11, 2),
        entry("theirs", 13, 4, uid=4242),
        entry("starts", 14, 5, uid=4242),
    ]
    content = wake.summary(jobs, 7, starting=["starts"])
    assert content["running"] == ["run", "starts"]
    assert content["waiting"] == ["head", "late", "theirs"]
    uid = os.getuid()
    assert sorted(content["owned"]) == sorted(
        [f"late@{uid}", f"run@{uid}", f"head@{uid}", "theirs@4242", "starts@4242"]
    )
    # One user's queue says nothing more than an older gpuwait's did.
    assert "owned" not in wake.summary(jobs[:3], 7)


def test_the_releasing_transaction_wakes_the_head_and_not_the_rest(tmp_path: Path) -> None:
    waiters = [
        subprocess.Popen([sys.executable, "-c", WAITER, "3"], stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    try:
        for w in waiters:
            assert w.stdout is not None and w.stdout.readline() == "ready\n"
        holder = subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
        )
        ledger = Ledger(tmp_path)
        with ledger.transaction() as data:
            data.jobs.append(entry("holder", holder.pid, 0, state=RUNNING))
            data.jobs.extend(entry(f"w{i}", w.pid, i + 1) for i, w in enumerate(waiters))
        with ledger.transaction() as data:
            data.remove("holder")  # the holder's job ended: its room is free
        holder.kill()
        holder.wait()
        said = [w.communicate(timeout=30)[0].strip() for w in waiters]
        assert said == ["woken", "woken", "slept", "slept"]
    finally:
        for w in waiters:
            w.kill()
            w.wait()


# --- the summaries of a shared ledger directory ------------------------------------------------


def _summary(release: int, waiting: list[str]) -> str:
    return json.dumps(
        {"schema": wake.SCHEMA, "release": release, "running": [], "waiting": waiting}
    )


def test_each_user_writes_a_summary_of_their_own_in_a_shared_directory(tmp_path: Path) -> None:
    wake.write_summary(tmp_path, wake.summary([], 3), os.getgid())
    written = tmp_path / f"wake.{os.getuid()}.json"
    assert stat.S_IMODE(written.stat().st_mode) == 0o640
    assert not (tmp_path / "wake.json").exists()
    (seen,) = wake.Summaries(tmp_path, shared=True).current()
    assert (seen.release, seen.source) == (3, written.name)


@pytest.mark.skipif(os.geteuid() != 0, reason="gives a file to another user: needs root")
def test_another_members_broken_or_borrowed_summary_is_passed_over(tmp_path: Path) -> None:
    other = 47251
    mine = tmp_path / f"wake.{os.getuid()}.json"
    mine.write_text(_summary(1, ["a"]))
    junk = tmp_path / f"wake.{other}.json"
    junk.write_text("y\n" * 1000)
    os.chown(junk, other, other)
    # A file named for another user but written by this one is nobody's summary.
    borrowed = tmp_path / "wake.47252.json"
    borrowed.write_text(_summary(9, []))
    summaries = wake.Summaries(tmp_path, shared=True)
    changed, _ = summaries.changed(now=0.0)
    assert [s.source if s else None for s in changed] == [mine.name]
    # A member writing junk again and again makes nobody act on it.
    for n in range(3):
        junk.write_text("y\n" * (1000 + n))
        assert summaries.changed(now=1.0 + n) == ([], None)


def test_one_users_summary_is_acted_on_at_most_every_source_gap(tmp_path: Path) -> None:
    path = tmp_path / f"wake.{os.getuid()}.json"
    path.write_text(_summary(1, ["a"]))
    summaries = wake.Summaries(tmp_path, shared=True)
    assert [s.release for s in summaries.changed(now=10.0)[0] if s] == [1]
    path.write_text(_summary(2, ["a", "b"]))  # another size: seen as changed whatever the clock
    # Changed again within the gap: held back, with the moment to look again.
    assert summaries.changed(now=10.0 + wake.SOURCE_GAP / 2) == ([], 10.0 + wake.SOURCE_GAP)
    (seen,) = summaries.changed(now=10.0 + wake.SOURCE_GAP)[0]
    assert seen is not None and seen.release == 2
    # A private ledger's one summary is the user's own: never held back.
    private = tmp_path / "private"
    private.mkdir()
    (private / "wake.json").write_text(_summary(1, []))
    own = wake.Summaries(private, shared=False)
    assert len(own.changed(now=0.0)[0]) == 1
    (private / "wake.json").write_text(_summary(2, ["b"]))
    assert len(own.changed(now=0.0)[0]) == 1


def test_a_summarys_spacing_counts_the_reading_threads_cpu_not_the_programs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A program holding room through gpuwait.reserve() reads the summaries in one thread
    while another of its threads works: the other's CPU time, 0.3 s of it here during a
    reading, is no cost of the reading, and a small summary is acted on again after
    SOURCE_GAP as in a program of one thread, not held back for ten times that 0.3 s."""
    path = tmp_path / f"wake.{os.getuid()}.json"
    path.write_text(_summary(1, ["a"]))
    summaries = wake.Summaries(tmp_path, shared=True)
    real_read = wake.read_summary
    busy_done = threading.Event()

    def busy() -> None:
        began = time.thread_time()
        while time.thread_time() - began < 0.3:
            sum(range(1000))
        busy_done.set()

    def read_beside_a_busy_thread(*args: Any) -> wake.Summary | None:
        worker = threading.Thread(target=busy)
        worker.start()
        busy_done.wait()
        worker.join()
        return real_read(*args)

    monkeypatch.setattr(wake, "read_summary", read_beside_a_busy_thread)
    assert [s.release for s in summaries.changed(now=10.0)[0] if s] == [1]
    monkeypatch.setattr(wake, "read_summary", real_read)
    path.write_text(_summary(2, ["a", "b"]))
    (seen,) = summaries.changed(now=10.0 + wake.SOURCE_GAP)[0]
    assert seen is not None and seen.release == 2


def test_a_member_with_many_summaries_is_still_acted_on_once_every_source_gap(
    tmp_path: Path,
) -> None:
    # A member writes fifty files under their own uid's names (the form a squatted summary
    # takes), rewriting them all again and again: one summary of theirs is read, and acted on
    # at most every SOURCE_GAP, as if they had one.
    uid = os.getuid()
    (tmp_path / f"wake.{uid}.json").write_text(_summary(1, ["a"]))
    extra = [tmp_path / f"wake.{uid}.{n:08x}.json" for n in range(50)]
    for n, path in enumerate(extra):
        path.write_text(_summary(100 + n, [str(n)]))
    summaries = wake.Summaries(tmp_path, shared=True)
    assert [s.release for s in summaries.changed(now=10.0)[0] if s] == [1]
    for round_ in range(3):
        for n, path in enumerate(extra):
            path.write_text(_summary(200 + round_, [str(n)] * (round_ + 2)))
        assert summaries.changed(now=10.0 + (round_ + 1) * wake.SOURCE_GAP / 4)[0] == []
    assert [s.release for s in summaries.current()] == [1]


def test_a_member_with_many_names_beside_their_own_costs_one_look_a_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A member's names beside their canonical one, listed by the directory in an order of its
    # own (here the reverse of their sort order): each that sorted before the one taken so far
    # was looked at (a stat) again, fifty looks at every read of the summaries, where the
    # first of theirs by sort order is all that is taken.
    uid = os.getuid()
    extra = [tmp_path / f"wake.{uid}.{n:08x}.json" for n in range(50)]
    for n, path in enumerate(extra):
        path.write_text(_summary(100 + n, [str(n)]))
    looks: list[str] = []

    class Entry:
        def __init__(self, entry: os.DirEntry[str]) -> None:
            self.name = entry.name
            self._entry = entry

        def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
            looks.append(self.name)
            return self._entry.stat(follow_symlinks=follow_symlinks)

    real_scandir = os.scandir

    @contextlib.contextmanager
    def scandir(path: Path) -> Iterator[list[Entry]]:
        with real_scandir(path) as listing:
            yield [Entry(e) for e in sorted(listing, key=lambda e: e.name, reverse=True)]

    monkeypatch.setattr(wake.os, "scandir", scandir)
    summaries = wake.Summaries(tmp_path, shared=True)
    for _ in range(3):
        looks.clear()
        assert [s.release for s in summaries.current()] == [100]
        assert looks == [extra[0].name]


def test_a_member_whose_uid_is_written_with_leading_zeros_has_still_one_summary(
    tmp_path: Path,
) -> None:
    # wake.01000.json, wake.001000.json ... are names of uid 1000's as well, yet no gpuwait
    # writes them, nor reads them as theirs (`runs_a_job_of`): each was a summary of a user
    # of its own, acted on at every SOURCE_GAP, so that a member rewriting nine such files
    # was nine members' wake-ups for every waiter.
    uid = os.getuid()
    (tmp_path / f"wake.{uid}.json").write_text(_summary(1, ["a"]))
    padded = [tmp_path / f"wake.{uid:0{width}d}.json" for width in range(len(str(uid)) + 1, 11)]
    padded.append(tmp_path / f"wake.0{uid}.0123abcd.json")
    for n, path in enumerate(padded):
        path.write_text(_summary(100 + n, [str(n)]))
    summaries = wake.Summaries(tmp_path, shared=True)
    assert [s.release for s in summaries.changed(now=10.0)[0] if s] == [1]
    for n, path in enumerate(padded):
        path.write_text(_summary(200 + n, [str(n)] * 2))
    assert summaries.changed(now=10.0 + 2 * wake.SOURCE_GAP)[0] == []
    assert [s.release for s in summaries.current()] == [1]
    assert wake.runs_a_job_of(tmp_path, [uid]) == set()


@pytest.mark.skipif(os.geteuid() != 0, reason="gives a file to another user: needs root")
def test_a_summary_squatted_by_another_member_is_written_beside_it(tmp_path: Path) -> None:
    squat = tmp_path / f"wake.{os.getuid()}.json"
    squat.write_text(_summary(77, []))
    os.chown(squat, 47253, 47253)
    wake.write_summary(tmp_path, wake.summary([], 5), os.getgid())
    (mine,) = [p for p in tmp_path.glob(f"wake.{os.getuid()}.*.json") if p != squat]
    assert mine.stat().st_uid == os.getuid()
    # Found again by its owner, not made anew.
    wake.write_summary(tmp_path, wake.summary([], 6), os.getgid())
    assert sorted(tmp_path.glob("wake.*.json")) == sorted([squat, mine])
    # Readers take the owner's and pass over the squatter's.
    assert [s.release for s in wake.Summaries(tmp_path, shared=True).current()] == [6]


def test_a_stamp_dated_ahead_of_the_clock_says_nobody_planned(tmp_path: Path) -> None:
    wake.note_planned(tmp_path)
    assert wake.planned_since(tmp_path, time.time_ns() - 10**9)
    ahead = time.time() + 3600
    os.utime(tmp_path / wake.STAMP, (ahead, ahead))
    assert not wake.planned_since(tmp_path, time.time_ns() - 10**9)


#: A member who owns plan.stamp swaps it for a FIFO, again and again, while another member's
#: waiter notes its plans there (each waiter does, between two looks for room).
_FIFO_SWAPPER = """
import os, sys
stamp = sys.argv[1]
while True:
    try:
        os.unlink(stamp)
    except FileNotFoundError:
        pass
    try:
        os.mkfifo(stamp)
    except FileExistsError:
        pass  # the waiter made its stamp in between
"""

_NOTER = """
import stat, sys, time
from pathlib import Path
from gpuwait.linux.stamp import FileStamp
from gpuwait.queue import wake
directory = Path(sys.argv[1])
while not (directory / wake.STAMP).is_fifo():  # the swapper is at work
    time.sleep(0.001)
end = time.monotonic() + 1
while time.monotonic() < end:
    wake.note_planned(directory)
print("done")
"""


def test_a_fifo_swapped_in_at_the_stamp_never_hangs_a_waiter(tmp_path: Path) -> None:
    # A waiter that found no stamp and made one opened whatever was there by then: a FIFO put
    # in its place in that moment hung it for ever (TERM and Ctrl-C too wait for its loop),
    # an admitted job's command never started and its room stayed held.
    swapper = subprocess.Popen([sys.executable, "-c", _FIFO_SWAPPER, str(tmp_path / wake.STAMP)])
    try:
        noter = subprocess.run(
            [sys.executable, "-c", _NOTER, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=5,
        )
    finally:
        swapper.kill()
        swapper.wait()
    assert noter.returncode == 0 and noter.stdout == "done\n", noter.stderr


def test_a_step_after_another_members_job_looks_closer_only_once_that_job_left_the_queue() -> None:
    # A dependency on another member's job is kept as ID@UID; a summary lists it by the id its
    # writer's view shows, the plain one unless another member's job has that id too. Read
    # against the kept form alone, every summary that changed looked like the job had ended,
    # and the step read the GPUs and planned at every change of anybody's queue.
    seen = wake.Summary(release=1, running=frozenset({"a1b2", "c3d4@1002"}), waiting=("e5f6",))
    assert not seen.lacks_any(["a1b2@1001"])
    assert not seen.lacks_any(["c3d4@1002", "e5f6"])
    assert not seen.lacks_any([])
    assert seen.lacks_any(["0a0b@1001"])
    assert seen.lacks_any(["a1b2@1001", "0a0b"])
    assert seen.lacks_any(["e5f6", "0a0b"])
    assert seen.lacks_any(["0a0b"])


def test_a_step_after_another_members_job_looks_closer_once_it_left_though_a_third_has_its_id(
    tmp_path: Path,
) -> None:
    # Alice (1001) has a step --after Bob's job a1b2, kept as a1b2@1002. Carol (1000) has a
    # job of that id too. Once Bob's has left the queue (his gpuwait killed, say), a summary
    # written by any other member shows Carol's with the plain id a1b2, and the step took that
    # for Bob's: it was woken by no summary, and started only at its next reading of the GPUs,
    # up to nvml_interval later.
    def summary_of(*jobs: Job) -> wake.Summary:
        content = wake.summary(jobs, 1)
        path = tmp_path / "wake.1003.json"
        path.write_text(json.dumps(content))
        seen = wake.read_summary(path)
        assert seen is not None
        return seen

    carols = entry("a1b2", os.getpid(), 1, RUNNING, uid=1000)
    bobs = entry("a1b2@1002", os.getpid(), 2, RUNNING, uid=1002)
    alices_own = entry("e5f6", os.getpid(), 3, uid=1001)
    assert not summary_of(carols, bobs, alices_own).lacks_any(["a1b2@1002", "e5f6"])
    assert summary_of(carols, alices_own).lacks_any(["a1b2@1002"])
    # Bob's alone, shown by its plain id: still there.
    assert not summary_of(entry("a1b2", os.getpid(), 2, RUNNING, uid=1002)).lacks_any(["a1b2@1002"])
    bobs_plain = entry("a1b2", os.getpid(), 2, RUNNING, uid=1002)
    assert not summary_of(bobs_plain, alices_own).lacks_any(["a1b2@1002"])
    # A summary of an older gpuwait lists no owners: the ids its writer's view shows are all
    # there is to go by, as before.
    older = wake.Summary(release=1, running=frozenset({"a1b2"}), waiting=())
    assert not older.lacks_any(["a1b2@1002"])


def test_names_a_member_makes_for_nobody_never_hide_another_members_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A member makes names of the summaries' form for uids that are nobody's (thousands: past
    # MAX_SUMMARIES), files of their own that stand for no user. They were counted as
    # summaries looked at, and a real member's listed after them was never read: their
    # waiters, and the jobs of others that their plans start, were woken by no summary.
    monkeypatch.setattr(wake, "MAX_SUMMARIES", 16)  # the same with 4096, at 256 times the files
    for n in range(1000):
        (tmp_path / f"wake.{4_000_000 + n}.json").write_text(_summary(9, []))
    wake.write_summary(tmp_path, wake.summary([], 3), os.getgid())
    assert [s.release for s in wake.Summaries(tmp_path, shared=True).current()] == [3]


@pytest.mark.skipif(os.geteuid() != 0, reason="writes another member's summary: needs root")
@pytest.mark.parametrize("theirs_running", [False, True], ids=["theirs-ended", "theirs-runs"])
def test_a_waiter_another_members_summary_shows_by_its_owner_is_not_taken_for_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, theirs_running: bool
) -> None:
    # Where another member's job has the same id (running, or ended and in their book), that
    # member's summary shows this user's waiter as ID@UID. Looked for by its plain id alone it
    # seemed gone (cancelled), or admitted where theirs runs, and the waiter read the ledger to
    # learn it, and planned, at each change of that summary.
    from gpuwait.gpu.sim import SimBackend
    from gpuwait.linux import proc
    from gpuwait.queue import lifecycle, wait
    from gpuwait.queue.wait import WaitPolicy, wait_for_admission

    sim = tmp_path / "sim.toml"
    sim.write_text('[[gpu]]\nmemory = "24GiB"\nbase_used = "20GiB"\n')
    ledger_dir = tmp_path / "ledger"
    ledger_dir.mkdir()
    ledger_dir.chmod(0o1777)
    ledger = Ledger(ledger_dir)
    mine = live_job("a1b2", command=["true"], request={"bytes": 10 * 2**30}, order=1)
    with ledger.transaction() as data:
        data.jobs.append(mine)
    theirs = {
        "schema": wake.SCHEMA,
        "release": 1,
        "running": ["a1b2"] if theirs_running else [],
        "waiting": [f"a1b2@{mine.uid}"],
        "owned": [*(["a1b2@1002"] if theirs_running else []), f"a1b2@{mine.uid}"],
    }
    path = ledger_dir / "wake.1002.json"
    path.write_text(json.dumps(theirs))
    os.chown(path, 1002, 1002)
    reads: list[str] = []
    real = lifecycle.cancellation

    def cancellation(data: object, job_id: str) -> object:
        reads.append(job_id)
        return real(data, job_id)  # type: ignore[arg-type]

    monkeypatch.setattr(lifecycle, "cancellation", cancellation)
    looked = wait._admitted_by_another

    def admitted_by_another(*args: object) -> object:
        reads.append("admitted?")
        return looked(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(wait, "_admitted_by_another", admitted_by_another)
    policy = WaitPolicy(safety=0.9, poll_interval=0.05, nvml_interval=60.0)
    _, outcome = wait_for_admission(
        ledger,
        SimBackend(str(sim)),
        mine,
        policy,
        deadline=proc.boot_clock(),
        on_reason=lambda _: None,
    )
    assert type(outcome).__name__ == "TimedOut"
    # Only the look a waiter takes at its deadline, whether a plan admitted it at the last
    # moment: nothing for the summary that shows it waiting.
    assert reads == ["admitted?"]


def test_a_summary_shows_a_job_by_the_id_its_writers_view_gives_it() -> None:
    seen = wake.Summary(
        release=1,
        running=frozenset({"a1b2"}),
        waiting=("a1b2@1001", "c3d4"),
        owned=frozenset({"a1b2@1002", "a1b2@1001", "c3d4@1001"}),
    )
    assert seen.shows("a1b2", 1001) == "a1b2@1001"
    assert seen.shows("a1b2", 1002) == "a1b2"
    assert seen.shows("c3d4", 1001) == "c3d4"
    assert seen.shows("e5f6", 1001) is None
    # The plain id is another member's job, and this user's is listed nowhere: gone.
    assert seen.shows("c3d4", 1003) is None
    # An older gpuwait's summary lists no owners: the plain id is all there is to go by.
    older = wake.Summary(release=1, running=frozenset(), waiting=("a1b2",))
    assert older.shows("a1b2", 1001) == "a1b2"


# --- a change the summary's metadata does not show -------------------------------------------

#: gpuwait on a file system whose metadata shows no change between two summaries: its clock
#: ticks coarsely (every change in one tick has the same times), the inode of a replaced file
#: is reused at once (ext4), and the summaries have one size. Every summary looks the same.
_COARSE_CLOCK = """
from gpuwait.linux.stamp import FileStamp
from gpuwait.linux.stamp import FileStamp
from gpuwait.queue import wake
real = wake.file_stamp
def same_stamp(*args, **kwargs):
    return None if real(*args, **kwargs) is None else FileStamp(1, 100, 10**18, 10**18)
wake.file_stamp = same_stamp
from gpuwait.cli import entry_point
entry_point()
"""


def test_a_waiter_woken_by_a_release_its_summary_seems_not_to_show_starts(
    sim_file: SimFileFactory,
    gpuwait_cmd: list[str],
    procs: Callable[..., subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Three summaries written within one tick, the first and the last of one size, the inode
    # reused: the waiter the writer signalled took the summary for the one it had read, and
    # did not plan until its next reading of the GPUs (here two minutes off; a second by
    # default, much longer with a large nvml_interval). Signalled, it reads the summary.
    sim_file(gpus=1)
    holder = procs([*gpuwait_cmd, "--vram", "20G", "--name", "holder", "--", "sleep", "30"])
    wait_for(lambda: asleep_supervising(holder.pid), timeout=30)
    monkeypatch.setenv("GPUWAIT_NVML_INTERVAL", "120s")
    waiter = procs([sys.executable, "-c", _COARSE_CLOCK, "--vram", "10G", "--", "true"])
    wait_for(lambda: asleep_waiting(waiter.pid) or waiter.poll() is not None, timeout=30)
    assert waiter.poll() is None, "the waiter ran beside the holder's reservation"
    holder.send_signal(signal.SIGTERM)
    assert waiter.wait(timeout=20) == 0


def test_a_summary_told_written_is_read_and_acted_on_only_if_it_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / wake.FILENAME
    path.write_text(_summary(1, ["a", "b"]))
    monkeypatch.setattr(wake, "file_stamp", lambda *_, **__: FileStamp(1, 100, 7, 7))
    summaries = wake.Summaries(tmp_path, shared=False)
    assert [s.release for s in summaries.changed(now=0.0)[0] if s] == [1]
    path.write_text(_summary(2, ["b", "a"]))
    # By its metadata, nothing changed: a poll (no wake-up) passes it over.
    assert summaries.changed(now=1.0) == ([], None)
    summaries.written([wake.FILENAME])
    assert [(s.release, s.waiting) for s in summaries.changed(now=2.0)[0] if s] == [(2, ("b", "a"))]
    # Told again where nothing changed: nothing to act on.
    summaries.written(None)
    assert summaries.changed(now=3.0) == ([], None)


def test_inotify_tells_the_names_of_the_files_written(tmp_path: Path) -> None:
    from gpuwait.linux.inotify import LedgerWatch

    watch = LedgerWatch(tmp_path)
    try:
        assert watch.active
        for name in ("wake.1000.json", "wake.1001.json"):
            (tmp_path / "temp").write_text("{}")
            os.replace(tmp_path / "temp", tmp_path / name)
        assert watch.drain() == {"wake.1000.json", "wake.1001.json"}
        assert watch.drain() == set()
        # Looking for summaries alone: another file's events, however many, name none.
        for name in ("scratch", "xwake.1000.json", "wake.1000.json.old", "wake.1000.json"):
            (tmp_path / "temp").write_text("{}")
            os.replace(tmp_path / "temp", tmp_path / name)
        assert watch.drain(wake.EVENT_NAMES) == {"wake.1000.json"}
    finally:
        watch.close()


def test_a_watch_whose_events_overflowed_says_so_when_looking_for_summaries(
    tmp_path: Path,
) -> None:
    # A member's loop renaming a scratch file of theirs fills the kernel's queue of events
    # (16384 by default) before a summary is written: the summary's event is lost. Looking
    # for summaries alone, the watch must say that events were lost, so that the waiter reads
    # every summary, not that no summary was written, which would leave it asleep.
    from gpuwait.linux.inotify import LedgerWatch

    limit = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    watch = LedgerWatch(tmp_path)
    try:
        assert watch.active
        (tmp_path / "a").write_text("{}")
        for _ in range(limit // 2 + 1):  # two events a rename
            os.replace(tmp_path / "a", tmp_path / "b")
            os.replace(tmp_path / "b", tmp_path / "a")
        (tmp_path / "temp").write_text("{}")
        os.replace(tmp_path / "temp", tmp_path / "wake.1000.json")
        assert watch.drain(wake.EVENT_NAMES) is None
    finally:
        watch.close()


def test_of_a_members_summaries_under_other_names_the_first_by_name_is_read(
    tmp_path: Path,
) -> None:
    # A member whose own summary name is taken writes beside it under names of their own: of
    # several, the first by name is theirs, as of ledger files, whichever the directory lists
    # first. Made in either order, the one read is the same.
    uid = os.getuid()
    for made in (range(5), reversed(range(5))):
        directory = tmp_path / ("up" if isinstance(made, range) else "down")
        directory.mkdir()
        for n in made:
            (directory / f"wake.{uid}.{n:08x}.json").write_text(_summary(100 + n, [str(n)]))
        summaries = wake.Summaries(directory, shared=True)
        assert [s.release for s in summaries.changed(now=10.0)[0] if s] == [100], directory.name
