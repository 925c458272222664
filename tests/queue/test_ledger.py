"""The ledger under concurrent real processes, stale entries, and damage."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.fixtures_sim import Run, SimFileFactory
from helpers.jobs import live_job, replace_ledger
from helpers.waiting import process_state, wait_for

from gpuwait.core.text import entry_command
from gpuwait.linux import atomic, lock, proc
from gpuwait.queue import ledger as ledger_module
from gpuwait.queue import lifecycle
from gpuwait.queue.entries import MAX_ENTRIES_PER_UID, RUNNING, Job
from gpuwait.queue.ledger import Ledger

ADD_ENTRY = r"""
import os, sys, time
from pathlib import Path
from gpuwait.queue.entries import Job
from gpuwait.queue.ledger import Ledger
from gpuwait.linux import proc
ledger = Ledger(Path(sys.argv[1]))
n = int(sys.argv[2])
for i in range(n):
    with ledger.transaction() as data:
        job = Job(id=f"{os.getpid()}-{i}", pid=os.getpid(), start_time=proc.start_time(os.getpid()),
                  uid=os.getuid(), command=["x"], cwd="/", request={"bytes": 1}, order=data.next_order)
        data.next_order += 1
        data.jobs.append(job)
print("done", flush=True)
sys.stdin.read()  # stay alive until told, so our entries are not reaped
"""


def make_job(job_id: str, pid: int, start_time: int | None) -> Job:
    return Job(
        id=job_id,
        pid=pid,
        start_time=start_time or 0,
        uid=os.getuid(),
        command=["sleep", "1"],
        cwd="/",
        request={"bytes": 2**30},
    )


def test_sixty_processes_at_once_lose_no_entry(tmp_path: Path) -> None:
    state = tmp_path / "state"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", ADD_ENTRY, str(state), "5"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(60)
    ]
    try:
        reads = 0
        deadline = time.monotonic() + 60
        # While they write, every lock-free read sees a whole, valid file.
        while (
            any(p.poll() is None and not p.stdout.closed for p in procs)
            and time.monotonic() < deadline
        ):  # type: ignore[union-attr]
            if (state / "ledger.json").exists():
                json.loads((state / "ledger.json").read_text())
                reads += 1
            if reads > 200:
                break
        for p in procs:
            assert p.stdout is not None
            assert p.stdout.readline().strip() == "done"
        data = Ledger(state).read()
        assert len(data.jobs) == 300
        assert sorted(j.order for j in data.jobs) == list(range(1, 301))
    finally:
        for p in procs:
            p.stdin.close()  # type: ignore[union-attr]
            p.wait(timeout=30)
    # Every writer is gone now: the next change reaps all their entries.
    ledger = Ledger(state)
    assert len(lifecycle.reap(ledger)) == 300
    assert ledger.read().jobs == []
    assert oct(os.stat(state).st_mode & 0o777) == "0o700"
    assert oct(os.stat(state / "ledger.json").st_mode & 0o777) == "0o600"


def test_dead_pid_and_reused_pid_are_reaped(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    me = os.getpid()
    ledger = Ledger(tmp_path)
    with ledger.transaction() as data:
        data.jobs.append(make_job("alive", me, proc.start_time(me)))
        data.jobs.append(make_job("dead", dead.pid, 12345))
        # Our own pid, but a start time that is not ours: the pid was reused by another process.
        data.jobs.append(make_job("reused", me, (proc.start_time(me) or 0) + 1))
    assert set(lifecycle.reap(ledger)) == {"dead", "reused"}
    assert [j.id for j in ledger.read().jobs] == ["alive"]


def test_a_job_left_by_a_machine_that_went_down_holds_no_room_after_the_reboot(
    tmp_path: Path, sim_file: SimFileFactory, run_gpuwait: Run
) -> None:
    # Pids and start times (clock ticks since boot) begin again at every boot: a job left in
    # the ledger by a crash or a power cut may name a process of the new boot that got its pid
    # at the same tick, the same boot-time service started again, say: here, this process.
    sim_file(gpus=1, memory="24G")
    uuid = json.loads(run_gpuwait("status", "--json").stdout)["gpus"][0]["uuid"]
    me = os.getpid()
    ledger = Ledger(Path(os.environ["XDG_STATE_HOME"]) / "gpuwait")
    job = make_job("before", me, proc.start_time(me))
    job.state, job.gpu_uuids, job.reserved_bytes = RUNNING, [uuid], 20 * 2**30
    with ledger.transaction() as data:
        data.jobs.append(job)
    raw = json.loads(ledger.path.read_text())
    raw["jobs"][0]["boot"] = "00000000-0000-4000-8000-000000000000"  # another boot's
    replace_ledger(ledger.path, json.dumps(raw).encode())
    done = run_gpuwait("--vram", "20G", "--timeout", "1s", "--", "true")
    assert done.returncode == 0, done.stderr
    assert [j.id for j in ledger.read().jobs] == []


def test_damaged_ledger_is_kept_aside_and_recovered(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    with ledger.transaction() as data:
        data.jobs.append(make_job("a", os.getpid(), proc.start_time(os.getpid())))
    for damage in (
        b"",
        b'{"schema": 1, "jobs": [',
        b"\x00\xff garbage",
        b'{"schema": 99, "jobs": []}',
        b"[]",
    ):
        ledger.path.write_bytes(damage)
        ledger.warnings.clear()
        with ledger.transaction() as data:
            assert data.jobs == []
        assert len(ledger.warnings) == 1 and "damaged" in ledger.warnings[0]
        kept = sorted(tmp_path.glob("ledger.json.damaged-*"))
        assert kept and kept[-1].read_bytes() == damage
        for k in kept:
            k.unlink()
        json.loads(ledger.path.read_text())


def test_a_ledger_damaged_over_and_over_keeps_the_first_and_the_newest_copies(
    tmp_path: Path,
) -> None:
    # A writer gone wrong that damages the file again and again (each copy up to the 16 MiB a
    # read takes) filled the disk with copies; the first shows what went wrong first, the
    # newest what goes wrong now, and the ones between say nothing more.
    ledger = Ledger(tmp_path)
    for n in range(atomic.DAMAGED_KEPT + 6):
        time.sleep(0.01)  # set aside at times a coarse file clock tells apart
        ledger.path.write_bytes(b"garbage %d" % n)
        with ledger.transaction() as data:
            assert data.jobs == []
    kept = sorted(tmp_path.glob("ledger.json.damaged-*"))
    found = sorted(int(k.read_bytes().split()[1]) for k in kept)
    newest = list(range(6 + 1, atomic.DAMAGED_KEPT + 6))
    assert found == [0, *newest], found
    # Another file's copies, and anything else beside them, are left alone.
    other = tmp_path / "history.jsonl.damaged-20260101T000000-1-abcdef"
    other.write_bytes(b"other")
    ledger.path.write_bytes(b"garbage again")
    with ledger.transaction():
        pass
    assert other.read_bytes() == b"other"
    assert len(list(tmp_path.glob("ledger.json.damaged-*"))) == atomic.DAMAGED_KEPT


@pytest.mark.parametrize(
    "names",
    [
        [f"/data/shards/{i:06d}/part-{'x' * 80}.parquet" for i in range(1000)],
        # Rows whose fields are parted by \x01 (Hive's), which the file spells as six
        # characters each: an entry took six times the 8 KiB it was meant to, 48 MiB in all.
        ["\x01".join(["7"] * 1000) for _ in range(200)],
    ],
    ids=["file-names", "control-characters"],
)
def test_a_full_queue_of_jobs_with_long_command_lines_stays_one_readable_ledger(
    tmp_path: Path, names: list[str]
) -> None:
    # As many jobs as one user may queue, each handed a thousand file names by xargs (about
    # 100 KB of command line, 2 MB for the last): the file stays within what a read takes, so
    # nobody's entry is lost to a ledger "damaged" by its size, over and over.
    me = os.getpid()
    jobs = [make_job(f"{n:08x}", me, proc.start_time(me)) for n in range(MAX_ENTRIES_PER_UID)]
    for job in jobs:
        job.command = entry_command(["python", "prep.py", *names])
    jobs[-1].command = entry_command(["python", "prep.py", *("y" * 2000 for _ in range(1000))])
    ledger = Ledger(tmp_path)
    with ledger.transaction() as data:
        data.jobs.extend(jobs)
    assert len(Ledger(tmp_path).read().jobs) == MAX_ENTRIES_PER_UID
    assert not list(tmp_path.glob("ledger.json.damaged-*")) and not ledger.warnings
    # What the entry keeps of a long line is its start, and how much more there was.
    assert jobs[0].command[:2] == ["python", "prep.py"]
    first = jobs[0].command[2]  # whole, or its start where past 4 KiB as written
    assert first == names[0] or (first.endswith("…") and names[0].startswith(first[:-1]))
    assert jobs[0].command[-1].startswith("… ") and jobs[0].command[-1].endswith(" more arguments")


@pytest.mark.parametrize(
    "arg",
    [
        '--config={"lr": "0.001", "layers": [256, 256], "name": "a \\"quoted\\" run"}',
        "C:\\Users\\lab\\data\\shard\\part-00001.parquet",
        "-v",
        "/data/корпус/часть-00001.txt",
        "/data/🐈/part-1.txt",
    ],
    ids=["json-config", "windows-path", "short-flag", "cyrillic", "emoji"],
)
def test_an_entry_keeps_about_8_kib_of_a_commands_arguments_whatever_they_hold(arg: str) -> None:
    # Arguments full of quotes or backslashes take twice their length in the ledger's JSON,
    # and each a few bytes more besides: what an entry keeps of them is measured as written,
    # or a full queue of such jobs would pass what a read of the ledger takes.
    program = "x" * 4096  # the first word is always kept, whatever follows it
    # A long second word that fits: about 5000 bytes as written.
    second = arg * (5000 // (len(arg) if arg.isascii() else len(json.dumps(arg))))
    kept = entry_command([program, second, *[arg] * 5000])
    assert kept[0] == program and kept[-1].endswith(" more arguments")
    written = len(json.dumps(kept[1:-1], separators=(",", ":")))
    more = len(json.dumps(kept[-1])) + 1  # the last item, which says how many more, and its comma
    assert 8192 - 3 * len(json.dumps(arg)) - more < written <= 8192 - more
    # A second word that alone takes more than 4 KiB as written is cut, as the first is.
    assert entry_command([program, '"' * 5000, arg]) == [program, '"' * 2045 + "…", arg]


def test_a_full_queue_of_jobs_named_and_handed_files_in_cyrillic_stays_one_readable_ledger(
    tmp_path: Path,
) -> None:
    # JSON writes each character past ASCII as six bytes (\u0444): counted as four, a
    # queue of jobs each with a 4096-character Cyrillic program name and a thousand Cyrillic
    # file names took 35 MiB, past the 16 MiB a read takes, and every gpuwait then set the
    # user's ledger aside as damaged, their whole queue with it.
    me = os.getpid()
    program = "ф" * 4096
    names = [f"/данные/корпус/часть-{i:05d}.txt" for i in range(1000)]
    kept = entry_command([program, *names])
    assert kept[0].startswith("ффф") and len(json.dumps(kept[0])) <= 4096 + 2
    assert len(json.dumps(kept[1:-1], separators=(",", ":"))) <= 8192
    jobs = [make_job(f"{n:08x}", me, proc.start_time(me)) for n in range(MAX_ENTRIES_PER_UID)]
    for job in jobs:
        job.command = list(kept)
    ledger = Ledger(tmp_path)
    with ledger.transaction() as data:
        data.jobs.extend(jobs)
    assert len(Ledger(tmp_path).read().jobs) == MAX_ENTRIES_PER_UID
    assert not list(tmp_path.glob("ledger.json.damaged-*")) and not ledger.warnings


def test_invalid_entries_are_dropped_valid_ones_kept(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    me = os.getpid()
    with ledger.transaction() as data:
        data.jobs.append(make_job("good", me, proc.start_time(me)))
    raw = json.loads(ledger.path.read_text())
    raw["jobs"].append({"id": "bad", "pid": -5, "reserved_bytes": -1})
    raw["jobs"].append({**raw["jobs"][0], "id": "huge", "command": ["x" * 10_000_000]})
    ledger.path.write_text(json.dumps(raw))
    with ledger.transaction() as data:
        assert [j.id for j in data.jobs] == ["good"]
    # One warning however many entries were bad: a flood of junk must not flood the terminal.
    assert len(ledger.warnings) == 1 and "dropped 2 invalid entries" in ledger.warnings[0]


def test_the_last_plans_order_is_kept_and_junk_in_it_is_dropped(tmp_path: Path) -> None:
    """The lookahead plan searches on from the order the last one found: the ledger keeps it,
    and whatever a damaged or hand-edited file holds there is read as far as it is job ids."""
    ledger = Ledger(tmp_path)
    with ledger.transaction() as data:
        data.plan_order = ["b", "a"]
    with ledger.transaction() as data:
        assert data.plan_order == ["b", "a"]
    for junk, kept in (
        ([1, None, "x" * 1000, "c", {"a": 1}, "d"], ["c", "d"]),
        ("b,a", []),
        ({"b": 1}, []),
    ):
        raw = json.loads(ledger.path.read_text())
        raw["plan_order"] = junk
        ledger.path.write_text(json.dumps(raw))
        with ledger.transaction() as data:
            assert data.plan_order == kept
        assert ledger.warnings == []


def test_running_entry_round_trips(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    job = make_job("r", os.getpid(), proc.start_time(os.getpid()))
    job.state, job.gpu_uuids, job.reserved_bytes, job.pids = RUNNING, ["GPU-1"], 5, [1, 2]
    with ledger.transaction() as data:
        data.jobs.append(job)
    assert ledger.read().jobs == [job]


def test_dependencies_on_other_users_jobs_are_written_as_an_older_gpuwait_reads_them() -> None:
    # uid 1's step waits for uid 2's "x", for uid 3's "x" and for its own "y", and stepped
    # aside for uid 2's "z". An older gpuwait reads a dependency by the plain id its view
    # shows: one written as x@2 was to it one whose job had ended, so its plans started the
    # step at once (and held room for it, which its own gpuwait would not start in).
    job = live_job("s", uid=1, after=["x@2", "y"], after_ok=["x@3"], yield_to="z@2")
    raw = job.to_json()
    assert (raw["after"], raw["after_ok"], raw["yield_to"]) == (["x", "y"], ["x@3"], "z")
    assert Job.from_json(json.loads(json.dumps(raw))) == job
    # Without whose each is (an older gpuwait's entry, or that part damaged), they are read as
    # an older gpuwait kept them.
    for owners in (None, {"x": "2"}, [1]):
        older = Job.from_json({**raw, "owners": owners} if owners else {**raw, "owners": None})
        assert (older.after, older.owners_kept) == (["x", "y"], False)
    del raw["owners"]
    assert not Job.from_json(raw).owners_kept


def test_temporary_files_of_a_killed_writer_are_removed(tmp_path: Path) -> None:
    # A writer SIGKILLed between creating its temporary file and renaming it leaves the file
    # behind, for the ledger, the wake-up summary beside it and the copy of a ledger damaged in
    # part it keeps as evidence alike. Its pid may belong to
    # a live process by the next transaction (pids are reused): the file goes all the same, or
    # it would stay for as long as that process lives.
    dead = subprocess.Popen(["true"])
    dead.wait()
    with subprocess.Popen(["sleep", "60"]) as reused:
        try:
            ledger = Ledger(tmp_path / "state")
            with ledger.transaction():
                pass
            evidence = f"ledger.json.damaged-20260101T120000-{dead.pid}-a1b2c3"
            for name in ("ledger.json", "wake.json", evidence):
                for pid in (dead.pid, reused.pid):
                    (ledger.directory / f".{name}.{pid}.tmp").write_text("{")
            with ledger.transaction():
                pass
        finally:
            reused.kill()
    left = sorted(p.name for p in ledger.directory.iterdir() if p.name.endswith(".tmp"))
    assert left == []
    assert ledger.read().jobs == []


def test_an_entry_changed_to_an_equal_value_of_another_type_is_still_refused(
    tmp_path: Path,
) -> None:
    # This process validated the entry once; what it remembers must not vouch for a changed
    # entry, even one Python finds equal (1.0 == 1 == True), which the validation refuses.
    ledger = Ledger(tmp_path)
    me = os.getpid()
    with ledger.transaction() as data:
        data.jobs.append(make_job("good", me, proc.start_time(me)))
        data.jobs.append(make_job("other", me, proc.start_time(me)))
    with ledger.transaction() as data:
        assert [j.id for j in data.jobs] == ["good", "other"]
    for field, value in (("pid", float(me)), ("gpus", True), ("priority", 3.0)):
        raw = json.loads(ledger.path.read_text())
        raw["jobs"][1][field] = value
        ledger.path.write_text(json.dumps(raw))
        ledger.warnings.clear()
        with ledger.transaction() as data:
            assert [j.id for j in data.jobs] == ["good"], field
        assert "dropped 1 invalid entry" in ledger.warnings[0]
        with ledger.transaction() as data:
            data.jobs.append(make_job("other", me, proc.start_time(me)))


def test_changes_to_entries_that_are_not_written_do_not_show_in_the_next_read(
    tmp_path: Path,
) -> None:
    ledger = Ledger(tmp_path)
    me = os.getpid()
    job = make_job("r", me, proc.start_time(me))
    job.state, job.gpu_uuids, job.observed = RUNNING, ["GPU-1"], {"GPU-1": 5}
    job.requirements = {"min_compute_capability": [8, 0]}
    with ledger.transaction() as data:
        data.jobs.append(job)
    for _ in range(2):
        try:
            with ledger.transaction() as data:
                mine = data.jobs[0]
                mine.gpu_uuids.append("GPU-2")
                mine.observed["GPU-2"] = 7
                mine.command.append("--more")
                mine.requirements["min_compute_capability"][0] = 9
                raise RuntimeError("given up before writing")
        except RuntimeError:
            pass
        assert ledger.read().jobs == [job]
        with ledger.transaction() as data:
            assert data.jobs == [job]


def test_an_entry_whose_process_died_between_transactions_is_reaped(tmp_path: Path) -> None:
    # This process looks at the same entries' processes transaction after transaction: a death
    # (first a zombie, then reaped) is seen by the next one.
    child = subprocess.Popen(["sleep", "60"])
    try:
        ledger = Ledger(tmp_path)
        with ledger.transaction() as data:
            data.jobs.append(make_job("child", child.pid, proc.start_time(child.pid)))
        for _ in range(2):
            assert lifecycle.reap(ledger) == []
            assert [j.id for j in ledger.read().jobs] == ["child"]
        child.kill()
        # Until it is a zombie: killed, not yet waited for.
        wait_for(
            lambda: process_state(child.pid) == "Z",
            timeout=30,
            message=lambda: f"the killed child is {process_state(child.pid)!r}, not a zombie",
        )
        assert lifecycle.reap(ledger) == ["child"]
        assert ledger.read().jobs == []
    finally:
        child.kill()
        child.wait()


def test_ledger_file_is_canonical_json(tmp_path: Path) -> None:
    # Sorted keys, no spaces: what every earlier gpuwait wrote, so files compare byte for byte.
    ledger = Ledger(tmp_path)
    me = os.getpid()
    with ledger.transaction() as data:
        for i in range(3):
            job = make_job(f"j{i}", me, proc.start_time(me))
            job.name, job.command = 'naïve ☃ "quoted" \\ \n', ["x", "\u2028", "\x00"]
            data.jobs.append(job)
    for _ in range(3):  # encoded in one go, entry by entry, and from what this process remembers
        text = ledger.path.read_bytes()
        assert text == json.dumps(json.loads(text), separators=(",", ":"), sort_keys=True).encode()
        with ledger.transaction() as data:
            data.jobs[1].updated_at = time.time()


#: A transaction during which the terminal's Ctrl-Z arrives (SIGTSTP, sent to itself here).
SUSPENDED_MIDWAY = r"""
import os, signal, sys
from pathlib import Path
from gpuwait.linux import signals
from gpuwait.queue.ledger import Ledger
with Ledger(Path(sys.argv[1])).transaction():
    os.kill(os.getpid(), signal.SIGTSTP)
print("continued", signals.stops(), flush=True)
"""


def test_ctrl_z_during_a_change_stops_the_process_only_once_the_lock_is_free(
    tmp_path: Path,
) -> None:
    """Ctrl-Z landing while a job's gpuwait changes the ledger (a waiter's plan, a running job's
    sample): it stops as soon as the change is made, not holding the lock, for which every
    other gpuwait would wait (then give up, exit 5, after lock_timeout)."""
    # A process group of its own whose parent is in another group of the session, as a job
    # control shell starts a job: the kernel ignores Ctrl-Z in an orphaned group (CI's may be).
    child = subprocess.Popen(
        [sys.executable, "-c", SUSPENDED_MIDWAY, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        process_group=0,
    )
    try:
        wait_for(lambda: process_state(child.pid) == "T", timeout=30)
        with Ledger(tmp_path, lock_timeout=1.0).transaction():
            pass
    finally:
        child.send_signal(signal.SIGCONT)
        out, _ = child.communicate(timeout=30)
    # Known stopped: a waiter says its line again once continued (`make -j`'s, after `fg`).
    assert out == "continued 1\n"


def test_a_lock_passed_from_hand_to_hand_is_not_called_hung(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sweep of a hundred launches keeps the lock busy for seconds, each transaction holding
    it a moment: every launch said the holder "may be hung or stopped". Only a holder that
    keeps the lock throughout is named; here the lock is held as long, passed between
    processes (as /proc/locks would show them one after another)."""
    monkeypatch.setattr(lock, "SLOW_AFTER", 0.3)
    told: list[str] = []
    ledger = Ledger(tmp_path, on_slow_lock=told.append)
    with ledger.transaction():
        pass  # the lock file exists
    turns = iter(range(100000, 200000))
    monkeypatch.setattr(ledger_module, "holders", lambda fd: [next(turns)])
    _transaction_while_held(ledger)
    assert told == []

    # The same holder all along is named.
    same = os.getpid()
    monkeypatch.setattr(ledger_module, "holders", lambda fd: [same])
    _transaction_while_held(ledger)
    assert len(told) == 1 and f"held by process {same}" in told[0], told


def _transaction_while_held(ledger: Ledger) -> None:
    """A transaction of `ledger`, begun while another process holds its lock for 1.5 s more."""
    # The 1.5 s count from the moment this process goes for the lock, not from the holder's
    # start; three looks take 0.45 s of them, and on a loaded machine the time from "go" to
    # the transaction's first try can take most of a second.
    code = (
        "import fcntl, os, sys, time\n"
        "fd = os.open(sys.argv[1], os.O_RDWR)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('held', flush=True)\n"
        "sys.stdin.readline()\n"
        "time.sleep(1.5)\n"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(ledger.lock_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        assert holder.stdin is not None
        holder.stdin.write("go\n")
        holder.stdin.flush()
        with ledger.transaction():
            pass
    finally:
        holder.kill()
        holder.wait()


def test_the_damaged_copy_a_warning_names_is_never_the_one_pruned(tmp_path: Path) -> None:
    # Copies are ordered by when each was set aside (their change time); a clock stepped back
    # makes the copy just set aside look older than the others, and the warning named a file
    # the pruning had just removed.
    path = tmp_path / "ledger.json"
    made = []
    for n in range(atomic.DAMAGED_KEPT + 4):
        time.sleep(0.01)  # made at times a coarse file clock tells apart
        copy = atomic.damaged_name(path)
        copy.write_bytes(b"copy %d" % n)
        made.append(copy)
    kept = made[1]  # set aside just now, but dated before all but the first
    atomic.prune_damaged(path, kept)
    left = sorted(tmp_path.glob("ledger.json.damaged-*"))
    assert kept.exists()
    assert made[0].exists() and made[-1].exists()
    assert len(left) == atomic.DAMAGED_KEPT
