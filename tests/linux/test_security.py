"""State paths gpuwait refuses, modes it sets whatever the umask, caps on what a ledger may hold."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import resource
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.fixtures_sim import Run
from helpers.jobs import live_job
from helpers.waiting import wait_for

from gpuwait.core.text import entry_command, printable
from gpuwait.linux import security
from gpuwait.linux.proc import command_line as proc_command
from gpuwait.linux.proc import start_time
from gpuwait.linux.security import UnsafePath, control_refusal, open_state_file
from gpuwait.queue.entries import MAX_ENTRIES_PER_UID, Job
from gpuwait.queue.ledger import MAX_FILE_BYTES, Ledger


@pytest.fixture
def gw(sim: Path, run_gpuwait: Run) -> Run:
    return run_gpuwait


def state_dir() -> Path:
    return Path(os.environ["XDG_STATE_HOME"]) / "gpuwait"


def refused(done: subprocess.CompletedProcess[str], words: str) -> None:
    assert done.returncode == 5, done.stderr
    assert words in done.stderr, done.stderr
    assert done.stderr.startswith("gpuwait: error:") and "Traceback" not in done.stderr


def test_symlinked_state_dir_is_refused(gw: Run, tmp_path: Path) -> None:
    real = tmp_path / "elsewhere"
    real.mkdir(mode=0o700)
    state_dir().symlink_to(real)
    refused(gw("--vram", "1G", "--", "echo", "ran"), "symlink")
    assert list(real.iterdir()) == []
    # on_state_error = run: the command runs, uncoordinated, after one warning.
    done = gw("--vram", "1G", "--", "echo", "ran", env={"GPUWAIT_ON_STATE_ERROR": "run"})
    assert done.returncode == 0 and done.stdout == "ran\n"
    assert done.stderr.count("warning") == 1 and "symlink" in done.stderr


@pytest.mark.parametrize("name", ["ledger.json", "ledger.lock"])
def test_symlinked_ledger_file_is_refused(gw: Run, tmp_path: Path, name: str) -> None:
    state_dir().mkdir(mode=0o700)
    target = tmp_path / "victim"
    target.write_text("precious\n")
    (state_dir() / name).symlink_to(target)
    refused(gw("--vram", "1G", "true"), "symlink")
    assert target.read_text() == "precious\n"


@pytest.mark.parametrize("name", ["ledger.json", "ledger.lock"])
@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
@pytest.mark.parametrize("command", [["--vram", "1G", "true"], ["status"], ["cancel", "x"]])
def test_a_ledger_file_that_is_a_fifo_or_a_device_is_refused_not_waited_on(
    gw: Run, name: str, kind: str, command: list[str]
) -> None:
    state_dir().mkdir(mode=0o700)
    path = state_dir() / name
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    started = time.monotonic()
    done = gw(*command)
    # One line naming the file, exit 5: no hang, no read without end.
    refused(done, str(path))
    assert len(done.stderr.splitlines()) <= 2  # the error, and its hint
    assert time.monotonic() - started < 20


@pytest.mark.parametrize("name", ["ledger.json", "ledger.lock"])
@pytest.mark.parametrize("kind", ["directory", "socket"])
def test_a_ledger_file_that_is_a_directory_or_a_socket_is_refused_by_name(
    gw: Run, name: str, kind: str
) -> None:
    # A ledger.lock made a directory (or a socket) was told as "ledger directory ... is not
    # usable: Is a directory" ("No such device or address"): the one file at fault unnamed.
    state_dir().mkdir(mode=0o700)
    path = state_dir() / name
    if kind == "directory":
        path.mkdir()
    else:
        with socket.socket(socket.AF_UNIX) as bound:
            bound.bind(str(path))
    done = gw("--vram", "1G", "true")
    refused(done, str(path))
    assert len(done.stderr.splitlines()) <= 2  # the error, and its hint


def test_symlinked_shared_ledger_dir_is_refused(gw: Run, tmp_path: Path) -> None:
    real = tmp_path / "shared"
    real.mkdir()
    real.chmod(0o1777)
    link = tmp_path / "link"
    link.symlink_to(real)
    refused(gw("--ledger", str(link), "--vram", "1G", "true"), "symlink")
    refused(gw("status", env={"GPUWAIT_LEDGER_DIR": str(link)}), "symlink")
    assert list(real.iterdir()) == []


def test_missing_ledger_dir_is_refused_not_created(gw: Run, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir"
    refused(gw("--ledger", str(missing), "--vram", "1G", "true"), "does not exist")
    assert not missing.exists()


@pytest.mark.parametrize(
    ("mode", "words"),
    [(0o777, "no sticky bit"), (0o772, "no sticky bit")],
)
def test_world_writable_dir_without_sticky_bit_is_refused(
    gw: Run, tmp_path: Path, mode: int, words: str
) -> None:
    state_dir().mkdir()
    state_dir().chmod(mode)
    refused(gw("--vram", "1G", "true"), words)


def test_group_writable_shared_dir_without_sticky_bit_is_refused(gw: Run, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o770)
    refused(gw("--ledger", str(shared), "--vram", "1G", "true"), "sticky bit")
    # With the sticky bit it is a shared ledger: each user's own file, readable by the group
    # and writable by its owner alone.
    shared.chmod(0o1770)
    assert gw("--ledger", str(shared), "--vram", "1G", "true").returncode == 0
    assert oct((shared / f"ledger.{os.getuid()}.json").stat().st_mode & 0o777) == "0o640"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a dir to another user")
def test_private_dir_of_another_user_is_refused(gw: Run) -> None:
    state_dir().mkdir(mode=0o700)
    os.chown(state_dir(), 47301, 47301)
    refused(gw("--vram", "1G", "true"), "belongs to another user")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a dir to another user")
def test_root_leaves_nothing_of_its_own_in_another_users_home(
    gw: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `sudo -E gpuwait ...` (or su keeping the environment) on an account that never ran
    # gpuwait: HOME and the runtime dir are still the user's.
    home, runtime = tmp_path / "alice", tmp_path / "alice-runtime"
    for directory in (home, runtime):
        directory.mkdir(mode=0o700)
        os.chown(directory, 47302, 47302)
    monkeypatch.delenv("XDG_STATE_HOME")
    done = gw("--vram", "1G", "true", env={"HOME": str(home), "XDG_RUNTIME_DIR": str(runtime)})
    refused(done, "belongs to uid 47302")
    # Nothing of root's there: the user's own gpuwait (and every other program that keeps
    # its state under ~/.local) goes on working.
    assert list(home.iterdir()) == [] and list(runtime.iterdir()) == []


@pytest.mark.parametrize("umask", [0o000, 0o077, 0o022, 0o277])
def test_modes_are_right_whatever_the_umask(gw: Run, umask: int) -> None:
    done = gw("--vram", "1G", "--", "true", preexec_fn=lambda: os.umask(umask))
    assert done.returncode == 0, done.stderr
    found = [state_dir(), *state_dir().rglob("*")]
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in found}
    assert {"ledger.json", "ledger.lock", "history.jsonl"} <= set(modes)
    for path in found:
        expected = "0o700" if path.is_dir() else "0o600"
        assert modes[path.name] == expected, path


def test_open_state_file_fixes_a_loosened_mode(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_text("")
    path.chmod(0o666)
    os.close(open_state_file(path, 0o600))
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    os.link(path, tmp_path / "hardlink")
    with pytest.raises(UnsafePath, match="hard links"):
        open_state_file(path, 0o600)


def test_symlinked_history_loses_the_record_not_the_run(gw: Run, tmp_path: Path) -> None:
    state_dir().mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (state_dir() / "history.jsonl").symlink_to(victim)
    done = gw("--vram", "1G", "--", "sh", "-c", "exit 7")
    assert done.returncode == 7
    assert "could not record the run" in done.stderr
    assert victim.read_text() == "precious\n"


def test_a_held_lock_makes_gpuwait_give_up_not_hang(gw: Run) -> None:
    state_dir().mkdir(mode=0o700)
    fd = os.open(state_dir() / "ledger.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        started = time.monotonic()
        done = gw("--vram", "1G", "true", env={"GPUWAIT_LOCK_TIMEOUT": "0.5s"})
        # The holder is named, so whoever is stuck knows whom to ask.
        refused(done, f"held by process {os.getpid()} (uid {os.getuid()})")
        assert time.monotonic() - started < 8
    finally:
        os.close(fd)


def test_a_lock_held_long_is_said_while_gpuwait_waits_for_it(sim: Path, tmp_path: Path) -> None:
    # A gpuwait stopped (kill -STOP) or hung in a transaction holds every other one up; they
    # waited without a word for lock_timeout (a minute by default) before saying why.
    state_dir().mkdir(mode=0o700)
    fd = os.open(state_dir() / "ledger.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    err = tmp_path / "err"
    # A holder is named once it has kept the lock for lock.SLOW_AFTER (2 s), far longer than a
    # transaction; here after 0.4 s, by the same look.
    soon = "import gpuwait.linux.lock as lock; "
    soon += "assert lock.SLOW_AFTER > 0.4; lock.SLOW_AFTER = 0.4; "
    soon += "from gpuwait.cli import entry_point; entry_point()"
    with err.open("w") as stderr:
        launch = subprocess.Popen(
            [sys.executable, "-c", soon, "--vram", "1G", "--", "echo", "ran"],
            env={**os.environ, "GPUWAIT_LOCK_TIMEOUT": "1m30s"},
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    try:
        wait_for(lambda: "waiting for the ledger lock" in err.read_text(), timeout=20)
    finally:
        os.close(fd)
        with contextlib.suppress(subprocess.TimeoutExpired):
            out, _ = launch.communicate(timeout=30)
        launch.kill()
        launch.wait()
    said = err.read_text()
    assert f"held by process {os.getpid()} (uid {os.getuid()})" in said, said
    # The setting as it is written, and as `gpuwait config` shows it.
    assert "(lock_timeout = 1m30s)" in said, said
    assert (launch.returncode, out) == (0, "ran\n"), said


def _waiting_for_lock(pid: int, path: Path) -> bool:
    """Process `pid` waits for a flock on the file now at `path` (/proc/locks: "->" lines)."""
    st = os.stat(path)
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    lines = Path("/proc/locks").read_text().splitlines()
    return any(
        line.split()[1:3] == ["->", "FLOCK"] and line.split()[5:7] == [str(pid), device]
        for line in lines
    )


def test_a_lock_file_removed_while_held_still_keeps_transactions_apart(
    gw: Run, gpuwait_cmd: list[str]
) -> None:
    # A tmp cleaner (or a user) removes ledger.lock while one transaction holds it and another
    # waits for it; the next gpuwait makes a new one and takes that.
    state_dir().mkdir(mode=0o700)
    lock = state_dir() / "ledger.lock"
    held = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX)
    waiter = subprocess.Popen([*gpuwait_cmd, "--vram", "1G", "true"], text=True)
    try:
        wait_for(lambda: _waiting_for_lock(waiter.pid, lock), timeout=30)
        lock.unlink()
        newer = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(newer, fcntl.LOCK_EX)
        os.close(held)
        # The waiter's lock is on a file that is no longer the lock: it waits for the new one,
        # and writes nothing meanwhile.
        wait_for(
            lambda: waiter.poll() is not None or _waiting_for_lock(waiter.pid, lock),
            timeout=30,
        )
        assert not (state_dir() / "ledger.json").exists(), "written while another held the lock"
        os.close(newer)
        assert waiter.wait(timeout=30) == 0
    finally:
        waiter.kill()
        waiter.wait()


def _entry(job_id: str, **changes: object) -> dict[str, object]:
    return {**vars(live_job(job_id)), **changes}


def _write_ledger(directory: Path, jobs: list[dict[str, object]]) -> None:
    directory.mkdir(mode=0o700, exist_ok=True)
    raw = {"schema": 1, "created_at": 1.0, "next_order": 1, "rr_cursor": -1, "jobs": jobs}
    (directory / "ledger.json").write_text(json.dumps(raw))


def test_one_user_cannot_fill_the_ledger(gw: Run) -> None:
    # Entries of this (live) test process stand for a user's other jobs.
    _write_ledger(state_dir(), [_entry(f"j{i}", order=i) for i in range(MAX_ENTRIES_PER_UID)])
    refused(gw("--vram", "1G", "true"), f"already have {MAX_ENTRIES_PER_UID} gpuwait jobs")


def test_entries_over_the_per_user_cap_are_dropped_running_ones_kept(tmp_path: Path) -> None:
    n = MAX_ENTRIES_PER_UID + 50
    running = _entry("running", state="running", gpu_uuids=["GPU-x"], reserved_bytes=5, order=n)
    _write_ledger(tmp_path, [_entry(f"w{i}", order=i) for i in range(n)] + [running])
    ledger = Ledger(tmp_path)
    with ledger.transaction() as data:
        assert len(data.jobs) == MAX_ENTRIES_PER_UID
        assert data.find("running") is not None
    assert len(ledger.warnings) == 1 and "more than" in ledger.warnings[0]


def test_an_oversized_ledger_is_set_aside(tmp_path: Path) -> None:
    _write_ledger(tmp_path, [_entry("a", cwd="x" * 4000)] * ((MAX_FILE_BYTES // 4000) + 10))
    ledger = Ledger(tmp_path)
    with ledger.transaction() as data:
        assert data.jobs == []
    assert "larger than 16 MiB" in ledger.warnings[0]
    assert len(list(tmp_path.glob("ledger.json.damaged-*"))) == 1


def test_a_ledger_grown_to_many_gigabytes_is_set_aside_without_being_read(gw: Run) -> None:
    # A writer gone wrong (or a file system that lost its end) leaves the ledger 64 GiB long.
    # gpuwait sets it aside as damaged, as one just past 16 MiB, having read no more of it
    # than that: read whole, it took all the memory a user's processes may have, and failed.
    assert gw("status").returncode == 0
    os.truncate(state_dir() / "ledger.json", 64 << 30)

    def little_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    done = gw("status", preexec_fn=little_memory)
    assert done.returncode == 0, done.stderr
    assert "larger than 16 MiB" in done.stderr and "Traceback" not in done.stderr
    (kept,) = state_dir().glob("ledger.json.damaged-*")
    assert kept.stat().st_size == 64 << 30
    assert (state_dir() / "ledger.json").stat().st_size < 4096


def test_reading_command_lines_again_and_again_leaves_no_file_open() -> None:
    # A waiter reads the command line of every other member's waiting gpuwait at each plan,
    # for hours: each read that left its file open would end in "too many open files".
    before = sorted(os.listdir("/proc/self/fd"))
    for _ in range(50):
        assert not security.runs_command(os.getpid(), ["python", "infer.py"])
        assert proc_command(os.getpid())
    assert sorted(os.listdir("/proc/self/fd")) == before


def test_only_the_owner_of_a_live_gpuwait_may_control_it(sim: Path, gpuwait_cmd: list[str]) -> None:
    proc = subprocess.Popen([*gpuwait_cmd, "--vram", "1G", "--", "sleep", "30"])
    try:
        job = wait_for(
            lambda: Ledger(state_dir()).read().jobs,
            timeout=20,
            interval=0.02,
            message="gpuwait never entered the ledger",
        )[0]
        assert control_refusal(job) is None
        other = os.getuid() + 1
        refusal = control_refusal(job, other)
        assert refusal is not None and "your own" in refusal
        # An entry naming a process that is not gpuwait (here: this test) is refused.
        bait = Job(**{**vars(job), "pid": os.getpid()})
        bait.start_time = start_time(os.getpid()) or 0
        refusal = control_refusal(bait)
        assert refusal is not None and "not a gpuwait process" in refusal
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    refusal = control_refusal(job)
    assert refusal is not None and "gone" in refusal


def test_printable_hides_escape_sequences() -> None:
    assert printable("ok \x1b[2J\x07 done") == "ok ?[2J? done"
    assert printable("é ü 日本") == "é ü 日本"
    assert len(printable("x" * 10_000, 40)) == 40


def test_cancel_refuses_an_entry_that_names_no_gpuwait_process(gw: Run) -> None:
    """A running entry naming some other process of the user (here: a bare `sleep`) must never
    make `gpuwait cancel` signal it: refused with exit 8, and the process lives on."""
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        with Ledger(state_dir()).transaction() as data:
            data.jobs.append(
                Job(
                    id="bait0001",
                    pid=bystander.pid,
                    start_time=start_time(bystander.pid) or 0,
                    uid=os.getuid(),
                    command=["sleep", "30"],
                    cwd="/",
                    request={"bytes": 2**30},
                    state="running",
                    name="bait",
                )
            )
        done = gw("cancel", "bait")
        assert done.returncode == 8, done.stderr
        assert "not a gpuwait process" in done.stderr and "Traceback" not in done.stderr
        # Not a precondition but the window under test: a signal sent to it would have ended
        # it within this time. A signal that never comes shows no state to wait for.
        time.sleep(0.2)
        assert bystander.poll() is None
        assert [j.id for j in Ledger(state_dir()).read().jobs] == ["bait0001"]
    finally:
        bystander.kill()
        bystander.wait(timeout=20)


def test_the_chown_that_gives_a_taken_directory_back_can_be_pasted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A home with a space in it (/home/Jane Doe): the hint's `sudo chown -R jane /home/Jane
    # Doe/.config`, pasted, would have handed /home/Jane over; the path is quoted now.
    taken = tmp_path / "Jane Doe" / ".config"
    monkeypatch.setattr(security, "taken_over", lambda path: (taken, 0))
    hint = security.taken_over_hint(taken / "gpuwait")
    assert hint is not None
    command = hint.split("`")[3]
    assert command.startswith("sudo chown -R ")
    assert shlex.split(command)[-1] == str(taken)


def test_a_program_reserving_from_python_counts_once_started_for_a_reader_that_saw_it_wait() -> (
    None
):
    """A member's program waiting in gpuwait.reserve whose command line is not the one its
    entry keeps (it set its process title, as gunicorn's and Ray's workers do) is not proven
    while it waits. Another member's waiter that read it then (a gpuwait waiting for as long
    as it takes) remembered that for good: once the program had its room, recorded as its
    own command, that waiter still counted none of it, and could be admitted into it."""
    program = subprocess.Popen(["sleep", "30"])
    try:
        start = start_time(program.pid)
        assert start is not None
        uid, pid = os.getuid(), program.pid
        titled = ["python", "train.py"]  # as its entry keeps it; the kernel shows `sleep 30`
        assert not security.proven_entry(uid, pid, start, "waiting", None, None, titled)
        assert security.proven_entry(uid, pid, start, "running", pid, start, titled)
    finally:
        program.kill()
        program.wait()


@pytest.mark.parametrize(
    "words",
    [
        ["x" * 5000, "tail"],
        [str(n) for n in range(1500)],
        ["x" * 70000, "tail"],
        [f"/data/shard-{n:05d}-" + "x" * 74 for n in range(300)],
    ],
    ids=["long", "many", "past-64-KiB", "past-8-KiB-kept"],
)
def test_a_gpuwait_runs_a_long_command_as_its_entry_keeps_it(words: list[str]) -> None:
    """An entry keeps a long argument cut, and a command of thousands of arguments counted
    (and a line past 64 KiB is read whole): the gpuwait running it still runs that entry's
    command; one running another, or a part of it, does not."""
    pause = [sys.executable, "-c", "import time; time.sleep(30)"]
    process = subprocess.Popen([*pause, "--", *words])
    try:
        wait_for(lambda: len(proc_command(process.pid) or []) > 3, timeout=10)
        assert security.runs_command(process.pid, entry_command(["--", *words]))
        assert security.runs_command(process.pid, entry_command([*pause, "--", *words]))
        other = entry_command(["-c", "import os", "--", *words])
        assert not security.runs_command(process.pid, other)
        shorter = entry_command(["--", *words[:-1]])
        assert not security.runs_command(process.pid, shorter)
        assert not security.runs_command(process.pid, ["python", "infer.py"])
    finally:
        process.kill()
        process.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a name to another user")
def test_a_name_that_vanishes_while_the_shared_directory_is_read_does_not_lose_the_users_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another member's name beside the user's, created and taken away again while gpuwait
    lists the directory, must not make it give up on the name the user already has there: it
    would start a second lock directory, and its jobs' locks would be looked for in two places."""
    uid = os.getuid()
    squat = tmp_path / f"alive.{uid}"  # another member's, made before the user's first job
    squat.symlink_to(tmp_path / "elsewhere")
    os.lchown(squat, 4242, 4242)
    own = tmp_path / f"alive.{uid}.0f"
    own.mkdir()
    before = security.own_name(tmp_path, "alive")
    assert before == own
    vanished = tmp_path / f"alive.{uid}.0a"  # sorts first; gone between listdir and lstat
    real_listdir, real_lstat = os.listdir, os.lstat
    monkeypatch.setattr(os, "listdir", lambda d: [*real_listdir(d), vanished.name])

    def lstat(path: os.PathLike[str] | str) -> os.stat_result:
        if Path(path) == vanished:
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real_lstat(path)

    monkeypatch.setattr(os, "lstat", lstat)
    assert security.own_name(tmp_path, "alive") == own


#: Six hundred file names in Cyrillic, as `xargs` hands them to a job.
_CYRILLIC_FILES = [f"/данные/{n:04d}.bin" for n in range(600)]


@pytest.mark.parametrize(
    ("words", "kept_before"),
    [
        # Counted at four bytes a character where the ledger writes six: cut after 221 of them.
        (["--", *_CYRILLIC_FILES], ["--", *_CYRILLIC_FILES[:221], "… 379 more arguments"]),
        # A program's name past 4096 characters, cut by characters where it is now cut by
        # what the ledger writes (the "…" writes six).
        (["x" * 5000, "tail"], ["x" * 4095 + "…", "tail"]),
        # Just under 8 KiB of arguments: kept whole, where the list's brackets now count too.
        (["--", "y" * 4094, "z" * 4092], ["--", "y" * 4094, "z" * 4092]),
    ],
    ids=["cyrillic-files", "long-program", "at-8-KiB"],
)
def test_a_waiting_entry_a_member_wrote_before_upgrading_still_runs_its_command(
    words: list[str], kept_before: list[str]
) -> None:
    """A member still on the version before commands were measured as the ledger writes them
    keeps a long command cut elsewhere: their waiting job must still be seen to run it, or
    every upgraded member's plan passes it over as though nobody would ever start it."""
    assert entry_command(words) != kept_before  # cut elsewhere now
    pause = [sys.executable, "-c", "import time; time.sleep(30)"]
    process = subprocess.Popen([*pause, *words])
    try:
        wait_for(lambda: len(proc_command(process.pid) or []) > 3, timeout=10)
        assert security.runs_command(process.pid, kept_before)
        other = [*kept_before[:-2], "other", kept_before[-1]]
        assert not security.runs_command(process.pid, other)
    finally:
        process.kill()
        process.wait()


@pytest.mark.parametrize(
    ("words", "entry", "runs"),
    [
        # A last argument that reads like the count an entry keeps is the command's own.
        (["echo", "… 5 more arguments"], ["echo", "… 5 more arguments"], True),
        # Another value of an option, or one cut where the argument differs before the cut.
        (["train.py", "--lr", "0.1"], ["train.py", "--lr", "0.2"], False),
        (["train.py", "--lr", "0.15"], ["train.py", "--lr", "0.2…"], False),
        # A cut argument stands for a longer one, never for one as long as what was kept.
        (["train.py"], ["train.py…"], False),
        # A count the line does not have: more arguments, or fewer, than it runs.
        (["train.py", "a"], ["train.py", "… 0 more arguments"], False),
        (["train.py", "a"], ["train.py", "… 5 more arguments"], False),
        # Nothing kept but a count stands for no command.
        (["a", "b"], ["… 2 more arguments"], False),
        # A count is said as an entry says it, "… N more arguments", or it is an argument.
        (["train.py", "a", "b"], ["train.py", "2 more arguments"], False),
        (["train.py", "a", "b"], ["train.py", "… 2"], False),
        # Another member's file may hold anything: a number is no argument, and no failure.
        (["train.py", "30"], ["train.py", 30], False),
        (["train.py", "30"], ["train.py", "30", 2], False),
    ],
)
def test_a_gpuwait_runs_only_the_command_its_entry_keeps(
    words: list[str], entry: list[object], runs: bool
) -> None:
    """A member's waiting entry counts in every plan only where its gpuwait runs that command:
    one running another line, or a part of it, would hold a place in line for a job nobody
    will ever start."""
    pause = [sys.executable, "-c", "import time; time.sleep(30)"]
    process = subprocess.Popen([*pause, "--", *words])
    try:
        wait_for(lambda: len(proc_command(process.pid) or []) > 3, timeout=10)
        assert security.runs_command(process.pid, entry) is runs
    finally:
        process.kill()
        process.wait()
