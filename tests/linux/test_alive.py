"""The liveness lock: held while a job's gpuwait or its command lives, seen from any process.

Real processes hold the locks; the kernel drops them when the processes die, SIGKILL included.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from helpers.waiting import wait_for

from gpuwait.linux import alive, proc

JOB = "0a1b2c3d"

# Holds JOB's lock, starts `sleep` (which inherits it) unless told not to, says so, then sleeps.
HOLDER = """
import os, sys, time
from pathlib import Path
from typing import Any
from gpuwait.linux import alive, proc
assert alive.hold(Path(sys.argv[1]), sys.argv[2])
child = os.posix_spawnp("sleep", ["sleep", "60"], dict(os.environ)) if sys.argv[3] == "1" else 0
print(child, flush=True)
time.sleep(60)
"""


@pytest.fixture
def spawned() -> Iterator[list[int]]:
    """Pids to SIGKILL at the end of the test, whatever happened."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        # The holder's child is not ours to reap: init does.
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def start_holder(
    ledger_dir: Path, spawned: list[int], command: bool, job: str = JOB
) -> tuple[subprocess.Popen[str], int]:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(ledger_dir), job, "1" if command else "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    spawned.append(holder.pid)
    assert holder.stdout is not None
    child = int(holder.stdout.readline())
    if child:
        spawned.append(child)
    return holder, child


def test_a_job_lives_while_its_gpuwait_holds_the_lock_and_not_after_it_was_killed(
    tmp_path: Path, spawned: list[int]
) -> None:
    assert alive.held(tmp_path, os.getuid(), JOB) is False  # never there
    holder, _ = start_holder(tmp_path, spawned, command=False)
    assert alive.held(tmp_path, os.getuid(), JOB) is True
    holder.kill()
    holder.wait()
    assert alive.held(tmp_path, os.getuid(), JOB) is False
    directory = tmp_path / f"alive.{os.getuid()}"
    assert oct(directory.stat().st_mode & 0o777) == "0o700"
    assert oct((directory / JOB).stat().st_mode & 0o777) == "0o600"


def test_the_command_inherits_the_lock_so_an_orphaned_command_keeps_its_job_alive(
    tmp_path: Path, spawned: list[int]
) -> None:
    holder, child = start_holder(tmp_path, spawned, command=True)
    holder.kill()
    holder.wait()
    assert alive.held(tmp_path, os.getuid(), JOB) is True
    os.kill(child, signal.SIGKILL)
    wait_for(lambda: alive.held(tmp_path, os.getuid(), JOB) is False, timeout=10)


def test_a_job_is_told_running_by_its_lock_and_not_by_another_lock_of_its_user(
    tmp_path: Path, spawned: list[int]
) -> None:
    # What other members of a shared ledger, who cannot look into the lock directory, go by:
    # the lock on the directory itself, held as long as the job's own (its command's too).
    other = tmp_path / "download.lock"
    other.touch()
    taker = subprocess.Popen(["flock", "-x", str(other), "sleep", "60"])
    spawned.append(taker.pid)
    wait_for(lambda: f" {taker.pid} " in Path("/proc/locks").read_text())
    assert alive.jobs_run(tmp_path, os.getuid()) is False
    holder, child = start_holder(tmp_path, spawned, command=True)
    assert alive.jobs_run(tmp_path, os.getuid()) is True
    holder.kill()
    holder.wait()
    assert alive.jobs_run(tmp_path, os.getuid()) is True  # its command runs on
    os.kill(child, signal.SIGKILL)
    wait_for(lambda: alive.jobs_run(tmp_path, os.getuid()) is False, timeout=10)
    assert alive.hold(tmp_path, JOB)
    assert alive.jobs_run(tmp_path, os.getuid()) is True
    alive.release(tmp_path, JOB)
    assert alive.jobs_run(tmp_path, os.getuid()) is False


def test_release_takes_the_lock_and_its_file_away(tmp_path: Path) -> None:
    assert alive.hold(tmp_path, JOB)
    assert alive.held(tmp_path, os.getuid(), JOB) is True  # another open file: a conflict
    alive.release(tmp_path, JOB)
    assert not (tmp_path / f"alive.{os.getuid()}" / JOB).exists()
    assert alive.held(tmp_path, os.getuid(), JOB) is False


def test_sweep_removes_only_files_that_nobody_holds_and_no_entry_names(
    tmp_path: Path, spawned: list[int]
) -> None:
    directory = tmp_path / f"alive.{os.getuid()}"
    start_holder(tmp_path, spawned, command=False)
    for name in ("dead01", "named02"):
        (directory / name).touch()
    alive.sweep(tmp_path, {"named02"})
    assert sorted(os.listdir(directory)) == sorted([JOB, "named02"])


def test_a_directory_that_is_not_the_users_own_is_not_used(tmp_path: Path) -> None:
    # Somebody else's (here: a symlink to elsewhere) could keep a job looking alive, or take
    # its file away: no lock then, and the entry is judged by its pids as before.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / f"alive.{os.getuid()}").symlink_to(elsewhere)
    assert alive.hold(tmp_path, JOB) is False
    assert list(elsewhere.iterdir()) == []


def test_a_symlink_put_in_place_of_the_lock_directory_as_it_is_tidied_is_not_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # In a shared ledger directory, another member's symlink named for the user's lock
    # directory, made between gpuwait's look at the name and its use (here: the name is taken
    # for the user's own, as it was a moment before), points at a directory of the user's. A
    # sweep through it would take away every file in it that no entry names.
    precious = tmp_path / "thesis"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work\n")
    planted = tmp_path / f"alive.{os.getuid()}"
    planted.symlink_to(precious)
    monkeypatch.setattr(alive, "own_name", lambda *args, **kwargs: planted)
    alive.sweep(tmp_path, set())
    assert alive.unlisted(tmp_path, set(), float("inf")) == []
    assert (precious / "thesis.tex").read_text() == "years of work\n"


def test_a_name_that_is_no_job_id_names_no_file(tmp_path: Path) -> None:
    assert alive.hold(tmp_path, "../ledger") is False
    assert alive.held(tmp_path, os.getuid(), "../ledger") is None


def test_the_lock_directory_is_never_open_to_the_group_not_even_for_a_moment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A shared ledger directory (sticky, setgid: what is made in it takes the group) and a
    # umask of 002, common where each user has a group of their own. The lock directory was
    # made rwxrwsr-x, the members' group's, and only then made 0700: a member watching the
    # directory could put a file of theirs in it in that moment, there for good.
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o3770)
    born: list[int] = []
    chmod = os.chmod

    def watched(path: Any, mode: int, **kw: Any) -> None:
        if os.path.isdir(path):
            born.append(os.lstat(path).st_mode & 0o777)
        chmod(path, mode, **kw)

    monkeypatch.setattr(os, "chmod", watched)
    umask = os.umask(0o002)
    try:
        assert alive.hold(shared, JOB)
    finally:
        os.umask(umask)
        alive.release(shared, JOB)
    directory = shared / f"alive.{os.getuid()}"
    assert oct(directory.stat().st_mode & 0o777) == "0o700"
    assert [oct(mode) for mode in born if mode & 0o077] == []


@pytest.mark.skipif(os.geteuid() != 0, reason="becomes two users: needs root")
def test_a_job_that_ended_is_told_so_beside_another_members_lock_directory() -> None:
    # A shared ledger directory where another member has run a job: their alive.<uid> is 0700,
    # which this user cannot open. A waiter held for a job of its own whose lock was let go
    # was told that job still held, four times a second until its next reading of the GPUs.
    root = Path(tempfile.mkdtemp(prefix="gpuwait-users-"))
    try:
        os.chmod(root, 0o755)
        shared = root / "ledger"
        shared.mkdir(mode=0o1777)
        shared.chmod(0o1777)
        theirs = shared / "alive.4243"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 4243, 4243)
        pid = os.fork()
        if pid == 0:  # the waiter's user
            code = 3
            try:
                os.setgroups([])
                os.setgid(4244)
                os.setuid(4244)
                assert alive.hold(shared, "0b1b")
                ended = alive.still_held(shared, {JOB})
                running = alive.still_held(shared, {"0b1b", JOB})
                # A job of the user's held by another process is found all the same.
                ready, told = os.pipe()
                holder = os.fork()
                if holder == 0:
                    alive.hold(shared, "0c1c")
                    os.write(told, b".")
                    time.sleep(60)
                    os._exit(0)
                os.read(ready, 1)
                try:
                    found = alive.unlisted(shared, set(), float("inf"))
                finally:
                    os.kill(holder, signal.SIGKILL)
                    os.waitpid(holder, 0)
                code = 0 if (ended, running, found) == (set(), {"0b1b"}, ["0c1c"]) else 1
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a file of another user's: needs root")
@pytest.mark.parametrize("kind", ["file", "symlink"])
def test_a_job_that_ended_is_told_so_beside_another_members_file_named_as_a_lock_directory(
    tmp_path: Path, spawned: list[int], kind: str
) -> None:
    # Another member of a shared ledger directory may put anything there under the name of a
    # lock directory: a waiter held for a job that has ended was told that job still held.
    other = tmp_path / "alive.4243"
    if kind == "file":
        other.touch()
    else:
        other.symlink_to(tmp_path)
    os.chown(other, 4243, 4243, follow_symlinks=False)
    assert alive.hold(tmp_path, "0b1b")
    try:
        assert alive.still_held(tmp_path, {JOB}) == set()
        assert alive.still_held(tmp_path, {"0b1b", JOB}) == {"0b1b"}
        # A job of the user's held by another process is found all the same.
        start_holder(tmp_path, spawned, command=False, job="0c1c")
        assert alive.unlisted(tmp_path, set(), float("inf")) == ["0c1c"]
    finally:
        alive.release(tmp_path, "0b1b")


@pytest.mark.parametrize("kind", ["gone", "file"])
def test_a_ledger_directory_that_cannot_be_listed_tells_no_lock_unlisted_and_every_lock_held(
    tmp_path: Path, kind: str
) -> None:
    # A waiter held for the entries a damaged ledger lost, its ledger directory gone (or a
    # file in its place): nothing can be found to wait for, and what it waits for already
    # cannot be told to have ended, so it waits on, as it would for a live job.
    ledger = tmp_path / "ledger"
    if kind == "file":
        ledger.touch()
    assert alive.unlisted(ledger, set(), float("inf")) == []
    assert alive.still_held(ledger, {JOB, "0b1b"}) == {JOB, "0b1b"}


def test_a_lock_directory_gone_as_it_is_looked_at_holds_none_of_the_users_locks(
    tmp_path: Path, spawned: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Listed, then gone before it is opened (its owner's gpuwait took it away): the locks of
    # the user's own directory are still told, the job held found and the one ended not held.
    start_holder(tmp_path, spawned, command=False)
    listdir = os.listdir

    def listed(path: Any = ".") -> list[str]:
        names = listdir(path)
        return [*names, f"alive.{os.getuid()}.dead"] if path == tmp_path else names

    monkeypatch.setattr(os, "listdir", listed)
    assert alive.unlisted(tmp_path, set(), float("inf")) == [JOB]
    assert alive.still_held(tmp_path, {JOB, "0b1b"}) == {JOB}


def test_a_file_of_the_users_own_named_as_a_lock_directory_tells_every_lock_held(
    tmp_path: Path, spawned: list[int]
) -> None:
    # The user's own, not to be looked into: the lock of an ended job in it cannot be told,
    # and counts as held; the locks of the other lock directory are found all the same.
    start_holder(tmp_path, spawned, command=False)
    (tmp_path / f"alive.{os.getuid()}.beef").touch()
    assert alive.unlisted(tmp_path, set(), float("inf")) == [JOB]
    assert alive.still_held(tmp_path, {JOB, "0b1b"}) == {JOB, "0b1b"}


def test_the_holders_of_lost_locks_are_found_without_looking_up_what_they_have_open(
    tmp_path: Path, spawned: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A recovery of a damaged ledger looks, under the ledger's lock, for the processes holding
    # the locks of lost entries. It stat(2)ed every file each of them had open: one open on a
    # mount whose server does not answer (a hung NFS mount, a FUSE daemon that never replies)
    # would have held every member's transaction with it. The files are told by what /proc
    # says of the descriptors, and nothing they name is looked up.
    holder, child = start_holder(tmp_path, spawned, command=True)
    looked_up: list[str] = []
    stat = os.stat

    def recording(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if str(path).startswith("/proc/") and "/fd/" in str(path):
            looked_up.append(str(path))
        return stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", recording)
    assert alive.holders_unlisted(tmp_path, set()) == {holder.pid}
    assert alive.opened_by(tmp_path, os.getuid(), JOB, child)
    assert not alive.opened_by(tmp_path, os.getuid(), JOB, os.getpid())
    assert looked_up == []


def test_a_process_with_a_file_of_the_same_inode_number_elsewhere_has_not_the_lock_open(
    tmp_path: Path, spawned: list[int]
) -> None:
    # A pid /proc/locks names may since be another process's: one with a file of the same
    # inode number open, on another file system, is not the lock's holder.
    holder, _ = start_holder(tmp_path, spawned, command=False)
    found = next(tmp_path.glob("alive.*")) / JOB
    mine = os.stat(found)
    assert proc.has_open(holder.pid, mine)
    elsewhere = list(mine)
    elsewhere[2] = mine.st_dev + 1  # st_dev
    assert not proc.has_open(holder.pid, os.stat_result(elsewhere))


def test_only_a_descriptor_named_as_the_lock_has_its_fdinfo_read(
    tmp_path: Path, spawned: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The check that a command holds its job's lock runs in waiters' plans, against commands
    # with a thousand files open (a server, a data loader): each descriptor whose target is
    # named otherwise than the lock is passed over on its name, with no fdinfo read.
    holder, child = start_holder(tmp_path, spawned, command=True)
    read: list[str] = []
    fd_inode = proc._fd_inode

    def recording(pid: int, fd: str) -> tuple[int, int] | None:
        read.append(f"{pid}/{fd}")
        return fd_inode(pid, fd)

    monkeypatch.setattr(proc, "_fd_inode", recording)
    assert alive.opened_by(tmp_path, os.getuid(), JOB, child)
    assert alive.holders_unlisted(tmp_path, set()) == {holder.pid}
    assert len(read) == 2, read  # the lock's descriptor in each, no other
    read.clear()
    assert not alive.opened_by(tmp_path, os.getuid(), JOB, os.getpid())
    assert read == []


def _on_another_device(text: bytes, device: int, other: int) -> bytes:
    """`text` (/proc/locks' or mountinfo's) with `device` named as `other` wherever it names
    it, in the form each uses: hexadecimal in /proc/locks, decimal in mountinfo."""
    for form in (b"%02x:%02x:", b" %d:%d "):
        text = text.replace(
            form % (os.major(device), os.minor(device)), form % (os.major(other), os.minor(other))
        )
    return text


def test_the_holder_of_a_lock_is_found_where_its_file_system_is_no_device_stat_tells(
    tmp_path: Path, spawned: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # On a btrfs subvolume (an overlay file system too) stat(2) tells another device than the
    # file system's own, by which /proc/locks names a locked file and mountinfo its mount: a
    # damaged ledger's recovery found nobody holding the locks of lost entries there, their
    # jobs taken for ended. The two files are made so here, the device 0:4095 in them.
    from gpuwait.linux import lock

    holder, _ = start_holder(tmp_path, spawned, command=False)
    device, other = os.stat(tmp_path).st_dev, os.makedev(0, 4095)
    for name, real in (("PROC_LOCKS", "/proc/locks"), ("MOUNTINFO", "/proc/self/mountinfo")):
        made = tmp_path / name
        made.write_bytes(_on_another_device(Path(real).read_bytes(), device, other))
        monkeypatch.setattr(proc, name, str(made))
    assert alive.holders_unlisted(tmp_path, set()) == {holder.pid}
    lock_file = next(tmp_path.glob("alive.*")) / JOB
    fd = os.open(lock_file, os.O_RDONLY)
    try:
        assert proc.lock_device(fd) == other
        assert lock.holders(fd) == [holder.pid]
    finally:
        os.close(fd)


def test_the_device_proc_locks_names_a_file_by_is_stats_on_a_plain_file_system(
    tmp_path: Path,
) -> None:
    # Where stat(2) tells the file system's own device (ext4, /proc), both agree.
    for path in (tmp_path, Path("/"), Path("/proc/self")):
        fd = os.open(path, os.O_PATH)
        try:
            assert proc.lock_device(fd) == os.fstat(fd).st_dev, path
        finally:
            os.close(fd)


def test_the_device_of_a_ledger_directory_is_found_cheaply_among_100000_mounts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A node's mountinfo lists 100,000 mounts (16 MB: a pod's volumes each): each look for
    # the device of a ledger directory, made at each read of a shared ledger where another
    # member's file cannot be used (or is gone), parsed all of them, 0.11 s of CPU each: 20
    # looks took 2.2 s. The mount's line alone is read now.
    real = Path("/proc/self/mountinfo").read_bytes()
    filler = b"".join(
        b"%d 2 0:%d / /var/lib/kubelet/pods/%032x/volumes/kube-api-access rw - tmpfs tmpfs rw\n"
        % (10**6 + n, n % 250, n)
        for n in range(100_000)
    )
    made = tmp_path / "mountinfo"
    made.write_bytes(filler + real)
    monkeypatch.setattr(proc, "MOUNTINFO", str(made))
    fd = os.open(tmp_path, os.O_PATH)
    try:
        began = time.process_time()
        for _ in range(20):
            assert proc.lock_device(fd) == os.fstat(fd).st_dev
        took = time.process_time() - began
    finally:
        os.close(fd)
    assert took < 0.7, took


def test_only_the_takers_of_a_flock_on_the_very_file_are_its_holders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Whether a job of another member's runs is told by the shared flock its gpuwait holds on
    # their lock directory, as /proc/locks lists it. A POSIX lock, a flock waited for ("->"),
    # and a flock on another file system (08:123 is not 08:12) or another file are none.
    from gpuwait.linux import lock

    locks = tmp_path / "locks"
    locks.write_bytes(
        b"1: FLOCK  ADVISORY  WRITE 101 08:12:5678 0 EOF\n"
        b"1: -> FLOCK  ADVISORY  WRITE 102 08:12:5678 0 EOF\n"
        b"2: FLOCK  ADVISORY  READ  103 08:12:5678 0 EOF\n"
        b"3: POSIX  ADVISORY  WRITE 104 08:12:5678 0 EOF\n"
        b"4: FLOCK  ADVISORY  WRITE 105 08:123:5678 0 EOF\n"
        b"5: FLOCK  ADVISORY  WRITE 106 08:12:56789 0 EOF\n"
    )
    monkeypatch.setattr(proc, "PROC_LOCKS", str(locks))
    file = (os.makedev(8, 0x12), 5678)
    assert lock.holders_of([file]) == {file: [101, 103]}


def test_a_process_with_another_file_of_the_locks_name_on_its_file_system_has_not_it_open(
    tmp_path: Path, spawned: list[int]
) -> None:
    # A pid /proc/locks names may since be another process's: one with a file of the lock's
    # name open on the same file system, another inode (another job's lock of the same id in
    # another ledger directory), is not the lock's holder.
    holder, _ = start_holder(tmp_path, spawned, command=False)
    mine = os.stat(next(tmp_path.glob("alive.*")) / JOB)
    assert proc.has_open(holder.pid, mine, JOB)
    another = list(mine)
    another[1] = mine.st_ino + 1  # st_ino
    assert not proc.has_open(holder.pid, os.stat_result(another), JOB)


@pytest.mark.parametrize("ahead", [60.0, -60.0], ids=["a minute ahead", "a minute behind"])
def test_the_jobs_whose_locks_were_taken_before_a_moment_are_told_on_the_file_servers_clock(
    tmp_path: Path, spawned: list[int], monkeypatch: pytest.MonkeyPatch, ahead: float
) -> None:
    # A ledger started afresh after damage waits for the entries of the jobs whose locks were
    # taken before then: the lock files' times are stamped by the file server (an NFS home's),
    # and the moment by this machine's clock. With the server's clock a minute ahead, a lock
    # taken a moment before was taken for one taken after, its job's entry not waited for, and
    # its room given away; a minute behind, one taken after for one taken before.
    start_holder(tmp_path, spawned, command=False)
    time.sleep(0.05)  # the moment comes after the lock was taken, on either clock
    now = time.time()
    start_holder(tmp_path, spawned, command=False, job="ab12cd34")  # and this one after it

    class _Clock:
        def __getattr__(self, name: str) -> Any:
            return getattr(time, name)

        def time(self) -> float:
            return time.time() - ahead

    monkeypatch.setattr(alive, "time", _Clock())
    assert alive.unlisted(tmp_path, set(), now - ahead) == [JOB]


@pytest.fixture
def whole_seconds(tmp_path: Path) -> Iterator[Path]:
    """A file system that stamps files to the whole second, as ext3 does (here ext2 of 128-byte
    inodes), and an NFS server's export of one, mounted for the test; skipped where it cannot
    be."""
    if os.geteuid() != 0 or not shutil.which("mkfs.ext2"):
        pytest.skip("mounts a file system")
    image, mount = tmp_path / "fs.img", tmp_path / "fs"
    with open(image, "wb") as f:
        f.truncate(16 << 20)
    mount.mkdir()
    made = subprocess.run(["mkfs.ext2", "-q", "-F", "-I", "128", str(image)], capture_output=True)
    if (
        made.returncode
        or subprocess.run(["mount", "-o", "loop", str(image), str(mount)]).returncode
    ):
        pytest.skip("no file system can be mounted here")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_lock_taken_before_a_moment_in_its_second_is_told_so_where_files_are_stamped_to_the_second(
    whole_seconds: Path, spawned: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A ledger started afresh after damage waits for the entries of the jobs whose locks were
    # taken before then. On a file system that stamps files to the whole second, the file
    # made to tell its clock was stamped up to a second behind the moment it was made, the
    # clock taken for as much behind this machine's, and a lock taken a moment before the
    # ledger was started afresh, in the same second, for one taken after: its job's entry
    # was not waited for, and its room was given to the next launch.
    monkeypatch.setattr(alive, "_AHEAD", {})
    start_holder(whole_seconds, spawned, command=False)
    lock = whole_seconds / f"alive.{os.getuid()}" / JOB
    time.sleep(1 - time.time() % 1)  # the start of a second: all that follows is within it
    now = time.time()
    os.utime(lock, (now - 0.001, now - 0.001))  # taken a moment before, stamped to the second
    assert alive.unlisted(whole_seconds, set(), now) == [JOB]


def test_a_lock_taken_before_a_moment_is_told_so_where_the_file_systems_clock_is_a_tick_behind(
    whole_seconds: Path, spawned: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The kernel stamps files by a coarse clock, up to a tick (10 ms at HZ=100) behind the one
    # a process reads: the file made to tell the file system's clock, made 3 ms after a second
    # began by this process's clock, was stamped with the second before, and the clock taken
    # for as much behind, past the second a whole-second stamp may lag. A lock taken a moment
    # before the ledger was started afresh, in the same second, was then taken for one taken
    # after: its job's entry was not waited for, and its room given to the next launch.
    monkeypatch.setattr(alive, "_AHEAD", {})
    start_holder(whole_seconds, spawned, command=False)
    second = float(int(time.time()))
    os.utime(whole_seconds / f"alive.{os.getuid()}" / JOB, (second, second))  # at 1 ms
    looked = iter([second + 0.003, second + 0.004])  # the look begins, and ends
    monkeypatch.setattr(
        alive, "time", SimpleNamespace(monotonic=time.monotonic, time=lambda: next(looked))
    )
    fstat = os.fstat

    def stamped(fd: int) -> Any:
        found = fstat(fd)
        if ".clock." not in os.readlink(f"/proc/self/fd/{fd}"):
            return found
        # Made when the kernel's clock read 6 ms before the second: stamped with the one before.
        return SimpleNamespace(st_mtime_ns=int(second - 1) * 1_000_000_000, st_uid=found.st_uid)

    monkeypatch.setattr(os, "fstat", stamped)
    assert alive.unlisted(whole_seconds, set(), second + 0.002) == [JOB]


class _SlowClock:
    """The time module as gpuwait.linux.alive sees it: its wall clock `offset` seconds off,
    moved on `step` seconds at each reading (a look that took that long), and its monotonic
    clock `later` seconds on."""

    def __init__(self, offset: float) -> None:
        self.offset, self.step, self.later = offset, 0.0, 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def time(self) -> float:
        self.offset += self.step
        return time.time() + self.offset

    def monotonic(self) -> float:
        return time.monotonic() + self.later


def test_a_slow_look_at_the_file_servers_clock_leaves_what_the_last_one_told(
    tmp_path: Path, spawned: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The file server's clock a minute ahead of this machine's. A look at it that took over
    # 2 s (the server not answering, the process frozen meanwhile) told nothing of it, yet was
    # kept for a minute as no difference at all: a lock taken a moment before a ledger was
    # started afresh was taken for one taken after it, its job's entry not waited for, and its
    # room given away. What the last look that told something told stands now.
    monkeypatch.setattr(alive, "_AHEAD", {})
    start_holder(tmp_path, spawned, command=False)
    time.sleep(0.05)  # the moment comes after the lock was taken, on either clock
    clock = _SlowClock(-60.0)  # this machine's clock a minute behind the file system's
    monkeypatch.setattr(alive, "time", clock)
    moment = clock.time()
    assert alive.unlisted(tmp_path, set(), moment) == [JOB]
    clock.later = 61.0  # a minute on: looked at again
    clock.step = 70.0  # the look takes 70 s by the clock
    assert alive.unlisted(tmp_path, set(), moment) == [JOB]


def test_a_look_at_the_file_servers_clock_that_took_a_second_tells_no_lock_taken_after(
    tmp_path: Path, spawned: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The look's file was stamped as its making began, and the server answered a second
    # later (a slow NFS server). Its stamp was taken for the middle of the look, half a second
    # too late, the file system's clock for half a second behind: a lock taken a moment
    # before a ledger was started afresh was taken for one taken after it, its job's entry not
    # waited for, and its room given away. The clock is told as far ahead as it may be.
    monkeypatch.setattr(alive, "_AHEAD", {})
    start_holder(tmp_path, spawned, command=False)
    time.sleep(0.05)  # the moment comes after the lock was taken, on either clock
    clock = _SlowClock(0.0)
    monkeypatch.setattr(alive, "time", clock)
    moment = clock.time()
    real_open = os.open

    def slow_open(name: Any, *args: Any, **kwargs: Any) -> int:
        fd = real_open(name, *args, **kwargs)
        if str(name).startswith(".clock."):
            clock.offset += 1.0  # made and stamped at once, answered a second later
        return fd

    monkeypatch.setattr(os, "open", slow_open)
    assert alive.unlisted(tmp_path, set(), moment) == [JOB]
