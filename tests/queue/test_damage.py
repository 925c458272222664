"""Damaged files, one kind of damage at a time, for every file gpuwait reads.

State files gpuwait writes itself (the ledger, its journal, the history) are recovered at the next
operation: the damaged copy is kept beside them and one warning says so. Files a person writes
(config, site config, simulation file) are never moved or rewritten: gpuwait refuses them with
one line naming the file, and they stay exactly as they were.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.crash import gpuwait_signalled_at
from helpers.fixtures_sim import SIMJOB, Run
from helpers.jobs import TRUNCATED_LEDGER, damage_ledger, live_job, replace_ledger
from helpers.processes import children, liveness_lock_held
from helpers.waiting import (
    asleep_supervising,
    asleep_waiting,
    named_entry,
    process_state,
    said,
    sleeping_in,
    wait_for,
)

from gpuwait.cli import main
from gpuwait.core.errors import StateError
from gpuwait.core.policy import Conditions, WaitReason
from gpuwait.core.snapshot import GpuSnapshot, MachineSnapshot
from gpuwait.history import store
from gpuwait.linux import proc
from gpuwait.linux.lock import exclusive
from gpuwait.queue import lifecycle
from gpuwait.queue.bookkeeping import FAILED, Finished
from gpuwait.queue.entries import RUNNING, Job, LedgerData
from gpuwait.queue.ledger import Ledger

DAMAGE = {
    "truncated": TRUNCATED_LEDGER,
    "zero-length": b"",
    "garbage": b"\x00\xff\xfe garbage \x80\x81",
    "wrong schema": b'{"schema": 1, "jobs": {"not": "a list"}}',
    "future schema": b'{"schema": 2, "jobs": [], "created_at": 1.0, "next_order": 1}',
}


@pytest.fixture
def gw(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run_gpuwait: Run) -> Run:
    sim = tmp_path / "sim.toml"
    assert main(["sim", "init", str(sim), "--gpus", "1", "--memory", "24GiB"]) == 0
    monkeypatch.setenv("GPUWAIT_SIM", str(sim))
    return run_gpuwait


def warnings_of(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("gpuwait: warning:")]


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_private_ledger_is_recovered_at_the_next_run(gw: Run, kind: str) -> None:
    state = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait"
    state.mkdir(mode=0o700)
    (state / "ledger.json").write_bytes(DAMAGE[kind])
    done = gw("--vram", "1G", "--", "echo", "ran")
    assert done.returncode == 0 and done.stdout == "ran\n", done.stderr
    warned = warnings_of(done.stderr)
    assert len(warned) == 1 and "damaged" in warned[0], done.stderr
    if kind == "future schema":
        assert "newer gpuwait" in warned[0], warned
    kept = list(state.glob("ledger.json.damaged-*"))
    assert len(kept) == 1 and kept[0].read_bytes() == DAMAGE[kind]
    json.loads((state / "ledger.json").read_text())
    # Recovered once: the next run has nothing to say.
    again = gw("--vram", "1G", "true")
    assert again.returncode == 0 and warnings_of(again.stderr) == []


def test_a_ledger_a_newer_gpuwait_keeps_for_live_jobs_is_left_alone(
    gw: Run, procs: Callable[..., subprocess.Popen[str]]
) -> None:
    # One user, two environments with two versions of gpuwait. The newer one's job runs,
    # holding its liveness lock, its entry in a ledger of a newer schema. This gpuwait started
    # that file afresh as damaged: the running job's reservation was lost with it, and the
    # next job was admitted into its room.
    state = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait"
    (state / f"alive.{os.getuid()}").mkdir(mode=0o700, parents=True)
    lock = state / f"alive.{os.getuid()}" / "0123abcd"
    holder = procs(
        [sys.executable, "-c", HOLD_LOCK, str(lock)], stdout=subprocess.PIPE, stderr=None
    )
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    newer = json.dumps({"schema": 2, "jobs": [{"id": "0123abcd", "in": "a newer form"}]})
    (state / "ledger.json").write_text(newer)
    done = gw("--vram", "1G", "--", "echo", "ran")
    assert done.returncode == 5 and done.stdout == "", done.stderr
    assert "written by a newer gpuwait (schema 2, this one reads 1)" in done.stderr
    assert "hint: install in this environment the gpuwait" in done.stderr
    assert "Traceback" not in done.stderr
    assert (state / "ledger.json").read_text() == newer
    assert not list(state.glob("ledger.json.damaged-*"))
    # Once no job of the newer gpuwait lives, the file is started afresh (as after a downgrade).
    holder.kill()
    holder.wait()
    done = gw("--vram", "1G", "--", "echo", "ran")
    assert done.returncode == 0 and done.stdout == "ran\n", done.stderr
    assert len(list(state.glob("ledger.json.damaged-*"))) == 1


def test_what_a_newer_gpuwait_added_to_the_ledger_survives_this_ones_writes(gw: Run) -> None:
    # A newer gpuwait (another environment of the same user) adds fields within the schema,
    # which older versions are to pass over. This one wrote its ledger back without them
    # whenever it changed anything: the newer one's running job lost what its gpuwait keeps
    # there (as, in this version, an entry's safety, pid namespace or boot).
    state = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait"
    state.mkdir(mode=0o700)
    entry = live_job("0123abcd", state=RUNNING, reserved_bytes=4 << 30).to_json()
    entry["from_a_newer_version"] = {"kept": [1, 2]}
    document = {
        "schema": 1,
        "created_at": 1.0,
        "next_order": 2,
        "jobs": [entry],
        "newer_table": {"a": 1},
    }
    (state / "ledger.json").write_text(json.dumps(document))
    done = gw("--vram", "1G", "--", "echo", "ran")
    assert done.returncode == 0 and done.stdout == "ran\n", done.stderr
    assert "warning" not in done.stderr
    written = json.loads((state / "ledger.json").read_text())
    (kept,) = [j for j in written["jobs"] if j["id"] == "0123abcd"]
    assert kept["from_a_newer_version"] == {"kept": [1, 2]}
    assert kept["reserved_bytes"] == 4 << 30
    assert written["newer_table"] == {"a": 1}


#: Holds an exclusive flock on argv[1] (created) until killed, as a job's gpuwait holds its own.
HOLD_LOCK = (
    "import fcntl, os, sys, time\n"
    "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)\n"
    "fcntl.flock(fd, fcntl.LOCK_EX)\n"
    "print('held', flush=True)\n"
    "time.sleep(120)\n"
)


PARTLY_DAMAGED = {
    "record of finished jobs": {"book": 5},
    "an entry": {"jobs": [{"id": "x", "pid": "not a pid"}]},
    "usage table": {"usage": {"1000": "lots"}},
}


@pytest.mark.parametrize("part", list(PARTLY_DAMAGED))
def test_a_ledger_damaged_in_part_is_repaired_and_kept_as_found(gw: Run, part: str) -> None:
    # The rest of the file is used and the damage written away; the file as it was found is
    # the evidence, kept beside it (one warning).
    state = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait"
    state.mkdir(mode=0o700)
    found: dict[str, object] = {"schema": 1, "jobs": [], "created_at": 1.0, "next_order": 1}
    found.update(PARTLY_DAMAGED[part])
    text = json.dumps(found).encode()
    (state / "ledger.json").write_bytes(text)
    done = gw("--vram", "1G", "--", "echo", "ran")
    assert done.returncode == 0 and done.stdout == "ran\n", done.stderr
    warned = warnings_of(done.stderr)
    assert len(warned) == 1 and "kept the file as found as ledger.json.damaged-" in warned[0]
    (kept,) = state.glob("ledger.json.damaged-*")
    assert kept.read_bytes() == text
    again = gw("--vram", "1G", "true")
    assert again.returncode == 0 and warnings_of(again.stderr) == []
    assert len(list(state.glob("ledger.json.damaged-*"))) == 1


def shared_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "shared"
    directory.mkdir()
    directory.chmod(0o1770)
    return directory


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_own_file_in_a_shared_ledger_damaged_is_kept_aside(tmp_path: Path, kind: str) -> None:
    ledger = Ledger(shared_dir(tmp_path))
    with ledger.transaction() as data:
        data.jobs.append(live_job("lost"))
    # Each user's own file is replaced by rename, so only an outside hand damages it.
    assert ledger.path.name == f"ledger.{os.getuid()}.json"
    ledger.path.write_bytes(DAMAGE[kind])
    again = Ledger(ledger.directory)
    with again.transaction() as data:
        assert data.jobs == []
        data.jobs.append(live_job("new"))
    assert len(again.warnings) == 1 and "damaged" in again.warnings[0]
    kept = list(ledger.directory.glob(f"ledger.{os.getuid()}.json.damaged-*"))
    assert len(kept) == 1 and kept[0].read_bytes() == DAMAGE[kind]
    assert [j.id for j in Ledger(ledger.directory).read().jobs] == ["new"]


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a file of another user's: needs root")
@pytest.mark.parametrize("kind", ["truncated", "garbage", "fifo", "symlink"])
def test_another_users_damaged_file_is_left_alone_and_not_counted(
    tmp_path: Path, kind: str
) -> None:
    directory = shared_dir(tmp_path)
    other = directory / "ledger.4242.json"
    if kind == "fifo":
        os.mkfifo(other)
    elif kind == "symlink":
        other.symlink_to("/dev/zero")
    else:
        other.write_bytes(DAMAGE[kind])
    os.lchown(other, 4242, 4242)
    ledger = Ledger(directory)
    with ledger.transaction() as data:
        data.jobs.append(live_job("mine"))
    assert [j.id for j in Ledger(directory).read().jobs] == ["mine"]
    assert len(ledger.warnings) == 1 and "of uid 4242 is not used" in ledger.warnings[0]
    # It is theirs: neither moved nor changed.
    assert os.lstat(other).st_uid == 4242
    assert not list(directory.glob("ledger.4242.json.damaged-*"))


def others_file(tmp_path: Path, content: bytes) -> tuple[Path, Path]:
    """A shared ledger directory, and in it the file of uid 4242 holding `content` (made by
    root, given to that user)."""
    directory = shared_dir(tmp_path)
    other = directory / "ledger.4242.json"
    other.write_bytes(content)
    os.lchown(other, 4242, 4242)
    return directory, other


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a file and a process of another user's")
def test_another_users_damaged_file_holds_admissions_only_lately_changed_and_while_they_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpuwait.linux import security
    from gpuwait.queue import ledger as module

    monkeypatch.setattr(security, "_RUNS_GPUWAIT", {})  # no look of another test's
    directory, _ = others_file(tmp_path, DAMAGE["truncated"])
    # Nobody of theirs runs gpuwait: the file stands for no job of theirs.
    assert Ledger(directory).read().unread == {}
    theirs = subprocess.Popen(
        ["gpuwait", "60"], executable=shutil.which("sleep"), user=4242, group=4242
    )
    try:
        wait_for(lambda: b"gpuwait" in Path(f"/proc/{theirs.pid}/cmdline").read_bytes())
        # Seen once the last look at their processes is a second old.
        wait_for(lambda: list(Ledger(directory).read().unread) == [4242], timeout=10)
        # Left so for longer (its owner's gpuwait uses another ledger, or is stopped): the
        # others are not held for it for good.
        monkeypatch.setattr(module, "UNREAD_GRACE", 0.0)
        assert Ledger(directory).read().unread == {}
    finally:
        theirs.kill()
        theirs.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a file and a directory of another user's")
def test_another_users_file_gone_between_the_listing_and_its_reading_holds_admissions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A member whose job runs (its lock held on their lock directory) removes their file in
    # the moment between another member's listing of the directory and its reading of the
    # file: the reader counted no job of theirs and held nobody, where a file of theirs found
    # gone at the listing holds everyone for 30 s. It holds them as well now.
    from gpuwait.linux import security

    monkeypatch.setattr(security, "_RUNS_GPUWAIT", {})  # none of this test's looks kept
    directory, other = others_file(
        tmp_path,
        json.dumps({"schema": 1, "jobs": [], "created_at": time.time(), "next_order": 1}).encode(),
    )
    lock_dir = directory / "alive.4242"
    lock_dir.mkdir(mode=0o700)
    os.chown(lock_dir, 4242, 4242)
    # Their job's lock on it, as its gpuwait takes it (here root's: the test's own directories
    # are closed to them).
    job = os.open(lock_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(job, fcntl.LOCK_SH)
        assert Ledger(directory).read().unread == {}  # their file is there: it is read
        read_file = Ledger._read_file

        def gone_first(self: Ledger, path: Path) -> tuple[int, bytes] | None:
            if path == other:
                path.unlink(missing_ok=True)
            return read_file(self, path)

        monkeypatch.setattr(Ledger, "_read_file", gone_first)
        assert Ledger(directory).read().unread == {4242: "it is not there"}
    finally:
        os.close(job)


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a file of another user's")
def test_another_users_damaged_file_costs_no_look_at_every_process_at_each_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A member who empties their file again and again, no gpuwait of theirs running, held
    # nobody, but made each read of the ledger by every waiter of every member go through every
    # process on the machine to find one: a waiter reads it at each summary that changes,
    # twenty times a second for each member writing theirs, and a server runs thousands.
    directory, _ = others_file(tmp_path, DAMAGE["truncated"])
    looks = []
    listdir = os.listdir

    def counted(path: Any = ".") -> list[Any]:
        if os.fspath(path) == "/proc":
            looks.append(path)
        return listdir(path)

    from gpuwait.linux import security

    monkeypatch.setattr(security, "_RUNS_GPUWAIT", {})  # no look of another test's
    monkeypatch.setattr(os, "listdir", counted)
    ledger = Ledger(directory)
    for _ in range(50):
        assert ledger.read().unread == {}
    assert len(looks) <= 2, len(looks)


def failing_open_of(monkeypatch: pytest.MonkeyPatch, path: Path, error: int) -> Callable[[], int]:
    """Opening `path` fails with `error` (out of file descriptors, the kernel's file table or
    memory, as a machine under load may be for a moment); returns how many opens failed."""
    from gpuwait.queue import ledger as module

    real = module.open_readable
    failed = [0]

    def failing(at: Path | str, owners: frozenset[int] | None) -> int | None:
        if Path(at) == path:
            failed[0] += 1
            raise OSError(error, os.strerror(error))
        return real(at, owners)

    monkeypatch.setattr(module, "open_readable", failing)
    return lambda: failed[0]


@pytest.mark.parametrize("error", [errno.EMFILE, errno.ENFILE, errno.ENOMEM])
def test_own_file_in_a_shared_ledger_that_cannot_be_opened_for_a_moment_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: int
) -> None:
    ledger = Ledger(shared_dir(tmp_path))
    with ledger.transaction() as data:
        data.jobs.append(live_job("running"))
    failed = failing_open_of(monkeypatch, ledger.path, error)
    again = Ledger(ledger.directory)
    with pytest.raises(StateError, match=os.strerror(error)), again.transaction() as data:
        data.jobs.append(live_job("admitted into its room"))
    assert failed() >= 1
    monkeypatch.undo()
    # Nothing was taken for damage: the file stays, and the job running keeps its room.
    assert not list(ledger.directory.glob("ledger.*.damaged-*"))
    assert [j.id for j in Ledger(ledger.directory).read().jobs] == ["running"]


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a file of another user's: needs root")
def test_another_users_file_that_cannot_be_opened_for_a_moment_admits_nobody(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Their jobs' room would not count: nothing is decided without it.
    directory, other = others_file(
        tmp_path, b'{"schema": 1, "jobs": [], "created_at": 1.0, "next_order": 1}'
    )
    failing_open_of(monkeypatch, other, errno.EMFILE)
    ledger = Ledger(directory)
    with pytest.raises(StateError, match="Too many open files"), ledger.transaction() as data:
        data.jobs.append(live_job("mine"))
    monkeypatch.undo()
    assert Ledger(directory).read().jobs == []


#: gpuwait, run as a process whose every open of a ledger file fails for want of file
#: descriptors while the file named by $SHORT_OF_FILES exists (a moment's shortage, another
#: program's doing).
SHORT_OF_FILES = """
import errno, os
from gpuwait.queue import ledger
real = ledger.open_readable
def short(path, owners):
    if os.path.exists(os.environ["SHORT_OF_FILES"]):
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
    return real(path, owners)
ledger.open_readable = short
from gpuwait.cli import entry_point
entry_point()
"""


def short_of_files_waiter(
    tmp_path: Path,
    procs: Callable[..., subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
    *options: str,
) -> tuple[Path, Path, Path, subprocess.Popen[str]]:
    """(the shortage's flag, the first job's go-ahead, the waiter's stderr, the waiter): on one
    24 GiB GPU a first job holds 16 GiB until told to end; the waiter, which waits for 16 GiB
    behind it, is asleep waiting; once the flag file exists it cannot open the ledger."""
    sim = tmp_path / "sim.toml"
    assert main(["sim", "init", str(sim), "--gpus", "1", "--memory", "24GiB"]) == 0
    monkeypatch.setenv("GPUWAIT_SIM", str(sim))
    monkeypatch.setenv("GPUWAIT_NVML_INTERVAL", "0.1s")
    flag, go, err = tmp_path / "short", tmp_path / "go", tmp_path / "waiter.err"
    hold = f"while [ ! -e {shlex.quote(str(go))} ]; do sleep 0.02; done"
    procs([sys.executable, "-m", "gpuwait", "--vram", "16G", "--name", "first", "sh", "-c", hold])
    wait_for(lambda: (e := named_entry("first")) and e.get("child_pid"), timeout=20)
    waiter = procs(
        [sys.executable, "-c", SHORT_OF_FILES, "--vram", "16G", *options, "--", "true"],
        env={**os.environ, "SHORT_OF_FILES": str(flag)},
        stderr=err.open("w"),
    )
    wait_for(lambda: asleep_waiting(waiter.pid), timeout=20)
    flag.touch()
    return flag, go, err, waiter


def test_a_waiter_rides_over_a_moment_without_file_descriptors(
    tmp_path: Path, procs: Callable[..., subprocess.Popen[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    flag, go, err, waiter = short_of_files_waiter(tmp_path, procs, monkeypatch)
    # It says so on its waiting line, and waits on.
    wait_for(
        lambda: "cannot be read now" in err.read_text() or waiter.poll() is not None, timeout=20
    )
    assert waiter.poll() is None, err.read_text()
    assert "retrying" in err.read_text()
    flag.unlink()
    go.touch()
    assert waiter.wait(timeout=30) == 0, err.read_text()
    assert "Traceback" not in err.read_text()


def test_a_waiter_short_of_file_descriptors_for_longer_than_lock_timeout_gives_up(
    tmp_path: Path, procs: Callable[..., subprocess.Popen[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUWAIT_LOCK_TIMEOUT", "0.5s")
    _, _, err, waiter = short_of_files_waiter(tmp_path, procs, monkeypatch)
    assert waiter.wait(timeout=30) == 5, err.read_text()
    said = err.read_text()
    assert "cannot be read now" in said and "lock_timeout" in said, said
    assert "Traceback" not in said, said


def test_a_waiter_short_of_file_descriptors_as_its_timeout_passes_times_out(
    tmp_path: Path, procs: Callable[..., subprocess.Popen[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUWAIT_LOCK_TIMEOUT", "30s")
    _, _, err, waiter = short_of_files_waiter(tmp_path, procs, monkeypatch, "--timeout", "1s")
    # --timeout, as without the shortage: not the shortage's own bound, long after.
    assert waiter.wait(timeout=10) == 124, err.read_text()
    assert "gave up after waiting" in err.read_text()


HISTORY_DAMAGE = {
    "truncated": b'{"schema": 2, "command": ["python", "tr',
    "garbage": b"\x00\xff\xfe garbage\n",
    "wrong schema": b'["not", "a", "record"]\n',
    "future schema": b'{"schema": 9, "records": "elsewhere"}\n',
}


@pytest.mark.parametrize("kind", list(HISTORY_DAMAGE))
def test_damaged_history_costs_one_warning_and_no_record(gw: Run, kind: str) -> None:
    assert gw("--vram", "1G", "true").returncode == 0
    history = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "history.jsonl"
    with history.open("ab") as f:
        f.write(HISTORY_DAMAGE[kind])
    done = gw("--vram", "1G", "--", "echo", "ran")
    assert done.returncode == 0 and done.stdout == "ran\n", done.stderr
    warned = warnings_of(done.stderr)
    assert len(warned) == 1 and "skipped 1 damaged line" in warned[0], done.stderr
    # Reported once; the damaged bytes stay in the file as evidence, and both runs are there.
    again = gw("--vram", "1G", "true")
    assert again.returncode == 0 and warnings_of(again.stderr) == []
    assert HISTORY_DAMAGE[kind].rstrip(b"\n") in history.read_bytes()
    assert len(store.read_from(history).records) == 3


def test_zero_length_history_is_just_empty(tmp_path: Path) -> None:
    (tmp_path / "history.jsonl").write_bytes(b"")
    store.append_record(tmp_path, {"started_at": 1.0, "exit_status": 0})
    parsed = store.read_from(tmp_path / "history.jsonl")
    assert len(parsed.records) == 1 and parsed.damage.lines == 0


CONFIG_DAMAGE = {
    "truncated": (b"safety = 0.", "config file"),
    "garbage": (b"\x00\xff\xfe garbage", "not UTF-8"),
    "wrong schema": (b"[safety]\nvalue = 1\n", "not valid for safety"),
    "future schema": (b"schema = 2\n", "unknown setting 'schema'"),
}


@pytest.mark.parametrize(
    ("which", "kind"),
    [
        (which, kind)
        for which in ("user", "site")
        for kind in CONFIG_DAMAGE
        # A site file's unknown setting is warned of and skipped (the test below).
        if (which, kind) != ("site", "future schema")
    ],
)
def test_damaged_config_is_refused_and_left_alone(
    gw: Run, isolated_dirs: Path, kind: str, which: str
) -> None:
    base = isolated_dirs / ("config" if which == "user" else "site-config")
    path = base / "gpuwait" / "config.toml"
    path.parent.mkdir(parents=True)
    content, words = CONFIG_DAMAGE[kind]
    path.write_bytes(content)
    done = gw("--vram", "1G", "true")
    assert done.returncode == 2, done.stderr
    assert words in done.stderr and str(path) in done.stderr
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr
    assert path.read_bytes() == content
    assert list(path.parent.iterdir()) == [path]


def test_a_site_setting_this_gpuwait_does_not_know_is_skipped_with_a_warning(
    gw: Run, isolated_dirs: Path
) -> None:
    # An administrator sets up a newer gpuwait's setting site-wide: the users' own older copies
    # (a venv each) must still run every command, with the site's other settings in force.
    path = isolated_dirs / "site-config" / "gpuwait" / "config.toml"
    path.parent.mkdir(parents=True)
    path.write_text('safety = 0.8\ngang_topology = "nvlink"\n')
    done = gw("--vram", "1G", "--", "echo", "ran")
    assert done.returncode == 0 and done.stdout == "ran\n", done.stderr
    warned = warnings_of(done.stderr)
    assert len(warned) == 1, done.stderr
    assert "'gang_topology'" in warned[0] and str(path) in warned[0], warned
    assert json.loads(gw("config", "--json").stdout)["settings"]["safety"]["parsed"] == 0.8
    # The hook's way in, too: a wrapped command runs.
    hooked = gw("shell-hook", "--", "echo", "hooked")
    assert hooked.returncode == 0 and hooked.stdout == "hooked\n", hooked.stderr
    # A setting of the user's own file is theirs to fix: still refused there.
    own = isolated_dirs / "config" / "gpuwait" / "config.toml"
    own.parent.mkdir(parents=True)
    own.write_text('gang_topology = "nvlink"\n')
    assert gw("--vram", "1G", "true").returncode == 2


def test_zero_length_config_means_defaults(gw: Run, isolated_dirs: Path) -> None:
    path = isolated_dirs / "config" / "gpuwait" / "config.toml"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"")
    assert gw("--vram", "1G", "true").returncode == 0


SIM_DAMAGE = {
    "truncated": (b'[[gpu]]\nmemory = "24G', "not valid TOML"),
    "zero-length": (b"", "no [[gpu]] tables"),
    "garbage": (b"\x00\xff\xfe garbage", "not valid TOML"),
    "wrong schema": (b"gpu = 5\n", "array of tables"),
    "future schema": (b'[[gpu]]\nmemory = "24GiB"\nnvlink = true\n', "unknown key 'nvlink'"),
}


@pytest.mark.parametrize("kind", list(SIM_DAMAGE))
def test_damaged_simulation_file_is_refused_and_left_alone(gw: Run, kind: str) -> None:
    path = Path(os.environ["GPUWAIT_SIM"])
    content, words = SIM_DAMAGE[kind]
    path.write_bytes(content)
    # A damaged file may be one being saved: it is retried, and refused once the failure
    # has lasted gpu_error_timeout.
    env = {"GPUWAIT_ON_NO_GPU": "fail", "GPUWAIT_GPU_ERROR_TIMEOUT": "1s"}
    done = gw("--vram", "1G", "true", env=env)
    assert done.returncode == 4, done.stderr
    assert words in done.stderr and "simulation file" in done.stderr
    assert "retrying" in done.stderr and "gpu_error_timeout" in done.stderr
    assert "Traceback" not in done.stderr
    assert path.read_bytes() == content
    # `status` reports it, still shows the ledger, and exits as a run without GPUs would.
    status = gw("status")
    assert status.returncode == 4 and words in status.stderr and "Queue (0)" in status.stdout
    # Unchanged for longer than any save takes, it is a mistake to fix, not a save caught
    # halfway: refused at once (exit 4), or, with on_no_gpu = run, run unwaited with a warning.
    minute_ago = time.time() - 60
    os.utime(path, (minute_ago, minute_ago))
    started = time.monotonic()
    done = gw("--vram", "1G", "true", env={"GPUWAIT_ON_NO_GPU": "fail"})
    assert done.returncode == 4 and words in done.stderr and "retrying" not in done.stderr
    ran = gw("--vram", "1G", "--", "echo", "ran")
    assert ran.returncode == 0 and ran.stdout == "ran\n", ran.stderr
    assert "running the command without waiting" in ran.stderr and "retrying" not in ran.stderr
    assert time.monotonic() - started < 30


CHURN = r"""
import os, sys
from pathlib import Path
from gpuwait.linux import proc
from gpuwait.queue.entries import Job
from gpuwait.queue.ledger import Ledger
ledger = Ledger(Path(sys.argv[1]))
me = os.getpid()
for i in range(int(sys.argv[2])):
    with ledger.transaction() as data:
        data.remove(f"{me}-{i - 1}")
        data.jobs.append(Job(id=f"{me}-{i}", pid=me, start_time=proc.start_time(me) or 0,
                             uid=os.getuid(), command=["x" * (i % 50)], cwd="/", request={"bytes": 1}))
"""


def test_lock_free_readers_never_see_a_torn_shared_ledger(tmp_path: Path) -> None:
    import sys

    ledger = Ledger(shared_dir(tmp_path))
    with ledger.transaction() as data:
        data.jobs.append(live_job("anchor"))
    writers = [
        subprocess.Popen([sys.executable, "-c", CHURN, str(ledger.directory), "150"])
        for _ in range(4)
    ]
    try:
        reads = 0
        while any(w.poll() is None for w in writers) or reads < 50:
            assert Ledger(ledger.directory).read().find("anchor") is not None
            reads += 1
    finally:
        for w in writers:
            w.wait(timeout=60)
    assert all(w.returncode == 0 for w in writers)
    assert not list(ledger.directory.glob("*.damaged-*"))


#: A 13 GiB job, as the two tests below launch it; two never fit one 24 GiB card together.
VRAM_13G = [sys.executable, "-m", "gpuwait", "--vram", "13G"]
VRAM_4G = [sys.executable, "-m", "gpuwait", "--vram", "4G"]


def _name(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def _first_job_loading(
    procs: Callable[..., subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
    hold: str,
    report: Path,
    entry: Callable[[str], dict[str, Any] | None] = named_entry,
) -> tuple[subprocess.Popen[str], Callable[[], None]]:
    """A 13 GiB job named "first", started and loading (it allocates nothing until the test
    calls the function returned with it), its tree (the shell and its sleep) published: nothing
    new to publish until the command allocates. Loading for a set time instead, it could end
    before the test is done with it where the machine is slow. `entry`: a job's entry by name,
    from the ledger the jobs use."""
    monkeypatch.setenv("GPUWAIT_SAMPLE_INTERVAL", "0.2s")
    loads = f"sleep 600; exec {shlex.join(SIMJOB)} --vram 13G --hold {hold} --report {report}"
    first = procs([*VRAM_13G, "--name", "first", "--", "sh", "-c", loads])
    wait_for(lambda: (e := entry("first")) and len(e.get("pids", ())) >= 2, timeout=30)
    (sleep,) = [p for p in (entry("first") or {})["pids"] if _name(p) == "sleep"]

    def loaded() -> None:
        os.kill(sleep, signal.SIGKILL)

    return first, loaded


def test_a_running_jobs_entry_lost_with_its_ledger_is_put_back(
    gw: Run,
    tmp_path: Path,
    procs: Callable[..., subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # One 24 GiB card; two 13 GiB jobs never fit together. The first has started but allocated
    # nothing yet (it is loading) when its ledger is damaged and recovered without
    # its entry: nothing on the card shows it, so only the entry, put back by its gpuwait, keeps
    # the second job waiting.
    reports = [tmp_path / "first.json", tmp_path / "second.json"]
    first, loaded = _first_job_loading(procs, monkeypatch, "0.5s", reports[0])
    ledger_path = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "ledger.json"
    damage_ledger(ledger_path, lambda _: DAMAGE["truncated"])
    # The first job's gpuwait, which looks whenever the ledger changes, finds its entry gone
    # and puts it back: its transaction recovers the file (started afresh, the damaged copy
    # kept aside).
    wait_for(
        lambda: named_entry("first"),
        timeout=4,
        message="the running job's entry was never put back",
    )
    assert list(ledger_path.parent.glob("ledger.json.damaged-*"))
    second_job = [*SIMJOB, "--vram", "13G", "--hold", "0.2s", "--report", str(reports[1])]
    second = _waiting(
        procs,
        [*VRAM_13G, "--name", "second", "--", *second_job],
        "the second job ran beside the first one's reservation",
    )
    loaded()
    assert first.wait(timeout=60) == 0 and second.wait(timeout=60) == 0
    assert [json.loads(r.read_text())["oom"] for r in reports] == [False, False]


def test_a_running_jobs_entry_lost_with_its_ledger_is_put_back_once_woken(
    gw: Run,
    tmp_path: Path,
    procs: Callable[..., subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As above, the first job sampled every minute (sample_interval = 60s). The launch that
    # recovered the ledger woke its gpuwait, which put its entry back only at its next
    # sample, up to a minute later: once the recovery's 30 s were over, the second job was
    # admitted into the room the first one had not allocated yet.
    monkeypatch.setenv("GPUWAIT_SAMPLE_INTERVAL", "60s")
    reports = [tmp_path / "first.json", tmp_path / "second.json"]
    loads = f"sleep 600; exec {shlex.join(SIMJOB)} --vram 13G --hold 0.2s --report {reports[0]}"
    first = procs([*VRAM_13G, "--name", "first", "--", "sh", "-c", loads])
    wait_for(lambda: len((named_entry("first") or {}).get("pids", ())) >= 2, timeout=30)
    (sleep,) = [p for p in (named_entry("first") or {})["pids"] if _name(p) == "sleep"]
    # Past its first second, sampled densely: its next sample is a minute away.
    wait_for(lambda: asleep_supervising(first.pid), timeout=30)
    time.sleep(1.5)
    ledger_path = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "ledger.json"
    damage_ledger(ledger_path, lambda _: DAMAGE["truncated"])
    second_job = [*SIMJOB, "--vram", "13G", "--hold", "0.2s", "--report", str(reports[1])]
    second = _waiting(
        procs,
        [*VRAM_13G, "--name", "second", "--", *second_job],
        "the second job ran beside the first one's reservation",
    )
    assert list(ledger_path.parent.glob("ledger.json.damaged-*"))
    wait_for(
        lambda: named_entry("first"),
        timeout=20,
        message="the running job's entry was not put back before its next sample",
    )
    os.kill(sleep, signal.SIGKILL)
    assert first.wait(timeout=60) == 0 and second.wait(timeout=60) == 0
    assert [json.loads(r.read_text())["oom"] for r in reports] == [False, False]


def _waiters_entry_damaged(ledger: bytes) -> bytes:
    """The ledger with one figure of the waiter's entry damaged: only that entry is lost."""
    found = json.loads(ledger)
    (waiter,) = [job for job in found["jobs"] if job["name"] == "waiter"]
    waiter["reserved_bytes"] = "garbage"
    return json.dumps(found).encode()


#: A program waiting for 13 GiB through gpuwait.reserve(), with a SIGCHLD handler of its own
#: for children it may start: it waits for the room, takes it and lets it go.
_WAITING_PROGRAM_WITH_A_SIGCHLD_HANDLER = """
import signal
import gpuwait
signal.signal(signal.SIGCHLD, lambda signum, frame: None)
with gpuwait.reserve("13G", name="waiter"):
    pass
"""


@pytest.mark.parametrize(
    ("program", "damage"),
    [
        (False, lambda _: DAMAGE["truncated"]),
        (False, _waiters_entry_damaged),
        (True, lambda _: DAMAGE["truncated"]),
    ],
    ids=["whole", "in part", "a program with a SIGCHLD handler"],
)
def test_a_waiters_entry_lost_with_its_ledger_is_put_back_when_the_ledger_is_recovered(
    gw: Run,
    tmp_path: Path,
    procs: Callable[..., subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
    program: bool,
    damage: Callable[[bytes], bytes],
) -> None:
    # One 24 GiB card: a 13 GiB job runs, another waits behind it, reading the GPUs every two
    # minutes. The ledger is damaged, and started afresh (or repaired) without the waiter's
    # entry by the running job's gpuwait. A transaction wakes the waiters its ledger lists:
    # nobody told the waiter, which put its entry back only at its next reading, so a launch
    # in the grace was held for it (30 s), and once the running job had ended, nothing
    # started the waiter. A program waiting in gpuwait.reserve() with a SIGCHLD handler for
    # children of its own was passed over by the recovery's wake-up, as a program holding its
    # GPU is: its wait takes SIGCHLD in sigtimedwait, which shows it unblocked meanwhile.
    monkeypatch.setenv("GPUWAIT_NVML_INTERVAL", "120s")
    release = tmp_path / "release"
    hold = f"while [ ! -e {shlex.quote(str(release))} ]; do sleep 0.05; done"
    holder = procs([*VRAM_13G, "--name", "holder", "--", "sh", "-c", hold])
    wait_for(lambda: asleep_supervising(holder.pid), timeout=30)
    waiter = _waiting(
        procs,
        [sys.executable, "-c", _WAITING_PROGRAM_WITH_A_SIGCHLD_HANDLER]
        if program
        else [*VRAM_13G, "--name", "waiter", "--", "true"],
        "the waiter ran beside the running job",
    )
    ledger_path = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "ledger.json"
    damage_ledger(ledger_path, damage)
    wait_for(
        lambda: list(ledger_path.parent.glob("ledger.json.damaged-*")),
        timeout=10,
        message="the ledger was never recovered",
    )
    wait_for(lambda: named_entry("holder"), timeout=10, message="the entry was never put back")
    wait_for(
        # Read, not the damaged copy's (its figure "garbage") before the repair.
        lambda: isinstance((named_entry("waiter") or {}).get("reserved_bytes"), int),
        timeout=20,
        message="the waiter's entry was never put back",
    )
    release.touch()
    assert holder.wait(timeout=30) == 0
    assert waiter.wait(timeout=20) == 0, waiter.communicate()


#: A program holding 13 GiB through gpuwait.reserve() until `release` exists, its SIGCHLD
#: handler noting each one in `noted`: it starts no child, so none is its own.
_PROGRAM_WITH_A_SIGCHLD_HANDLER = """
import os, signal, sys, time
import gpuwait
noted, ready, release = sys.argv[1:]
def note(signum, frame):
    with open(noted, "a") as f:
        f.write("SIGCHLD\\n")
signal.signal(signal.SIGCHLD, note)
with gpuwait.reserve("13G", name="program"):
    open(ready, "w").close()
    while not os.path.exists(release):
        time.sleep(0.05)
"""


def test_a_program_holding_its_gpu_is_sent_no_sigchld_when_the_ledger_is_recovered(
    gw: Run, tmp_path: Path, procs: Callable[..., subprocess.Popen[str]]
) -> None:
    # A program that reserved its GPU with gpuwait.reserve() and runs, handling SIGCHLD for
    # children of its own, holds its job's liveness lock itself. Its entry lost with a damaged
    # ledger, the launch whose transaction recovered the file woke the holders of unlisted
    # locks with SIGCHLD: the program's handler ran, though no child of its had ended.
    noted, ready, release = (tmp_path / n for n in ("noted", "ready", "release"))
    files = [str(f) for f in (noted, ready, release)]
    program = procs([sys.executable, "-c", _PROGRAM_WITH_A_SIGCHLD_HANDLER, *files])
    wait_for(lambda: ready.exists() or program.poll() is not None, timeout=30)
    assert program.poll() is None, program.communicate()
    ledger_path = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "ledger.json"
    # Stopped outside a transaction of its own, so that the launch's transaction recovers the
    # file, not the program's own publishing of its usage.
    with exclusive(ledger_path.parent / "ledger.lock"):
        os.kill(program.pid, signal.SIGSTOP)
        wait_for(lambda: process_state(program.pid) == "T", timeout=10)
    try:
        replace_ledger(ledger_path, DAMAGE["truncated"])
        second = _waiting(
            procs,
            [*VRAM_13G, "--name", "second", "--", "true"],
            "the second job ran beside the program's reservation",
        )
        assert list(ledger_path.parent.glob("ledger.json.damaged-*"))
    finally:
        os.kill(program.pid, signal.SIGCONT)
    release.touch()
    assert program.wait(timeout=30) == 0, program.communicate()
    assert second.wait(timeout=60) == 0, second.communicate()
    assert not noted.exists(), noted.read_text()


#: A program holding 13 GiB through gpuwait.reserve() until `release` exists.
_PROGRAM = """
import os, sys, time
import gpuwait
ready, release = sys.argv[1:]
with gpuwait.reserve("13G", name="program"):
    open(ready, "w").close()
    while not os.path.exists(release):
        time.sleep(0.05)
"""


def test_a_programs_entry_lost_with_its_ledger_is_put_back_between_two_samples(
    gw: Run,
    tmp_path: Path,
    procs: Callable[..., subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A program holding 13 GiB of a 24 GiB card through gpuwait.reserve(), sampled every
    # minute (sample_interval = 60s), allocating nothing yet. Its entry lost with a damaged
    # ledger, it put it back only at its next sample, up to a minute later: once the
    # recovery's 30 s were over, a second 13 GiB launch was admitted into its room.
    monkeypatch.setenv("GPUWAIT_SAMPLE_INTERVAL", "60s")
    ready, release = tmp_path / "ready", tmp_path / "release"
    program = procs([sys.executable, "-c", _PROGRAM, str(ready), str(release)])
    wait_for(lambda: ready.exists() or program.poll() is not None, timeout=30)
    assert program.poll() is None, program.communicate()
    # Past its first second, sampled densely: its next sample is a minute away.
    time.sleep(1.5)
    ledger_path = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "ledger.json"
    damage_ledger(ledger_path, lambda _: DAMAGE["truncated"])
    second = _waiting(
        procs,
        [*VRAM_13G, "--name", "second", "--", "true"],
        "the second job ran beside the program's reservation",
    )
    assert list(ledger_path.parent.glob("ledger.json.damaged-*"))
    wait_for(
        lambda: named_entry("program"),
        timeout=20,
        message="the program's entry was not put back before its next sample",
    )
    assert second.poll() is None, "the second job ran beside the program's reservation"
    release.touch()
    assert program.wait(timeout=30) == 0, program.communicate()
    assert second.wait(timeout=60) == 0, second.communicate()


@pytest.mark.parametrize("ledger", ["started afresh", "new"])
def test_a_job_that_ends_in_the_grace_after_its_ledger_began_holds_no_waiter_up(
    gw: Run,
    procs: Callable[..., subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
    ledger: str,
) -> None:
    # Within the grace after the ledger began, a job whose lock is older than the ledger and
    # that lives without an entry is waited for: its entry was lost with the damage. A job
    # that has just ended holds its lock without its entry too, until its gpuwait removes the
    # file (here: it is stopped just then); the waiter its release wakes plans in that moment,
    # and must take it for the ended job it is. That job's lock is older than the ledger where
    # its entry was put back after the damage, and where it was the first job of a new ledger
    # whose lock file is dated a tick before the ledger began (the file system's clock lags, as
    # on a busy machine). The waiter reads the GPUs again only every two minutes: nothing else
    # would start it meanwhile.
    ledger_path = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "ledger.json"
    holder = procs(
        [
            *gpuwait_signalled_at("gpuwait.linux.alive", "release", "SIGSTOP"),
            *["--vram", "20G", "--name", "holder", "--", "sleep", "30"],
        ]
    )
    wait_for(lambda: asleep_supervising(holder.pid), timeout=30)
    if ledger == "new":
        began = json.loads(ledger_path.read_bytes())["created_at"]
        lock = ledger_path.parent / f"alive.{os.getuid()}" / (named_entry("holder") or {})["id"]
        os.utime(lock, (began - 0.002, began - 0.002))
    else:
        replace_ledger(ledger_path, DAMAGE["truncated"])
        wait_for(lambda: named_entry("holder"), timeout=10, message="the entry was never put back")
    monkeypatch.setenv("GPUWAIT_NVML_INTERVAL", "120s")
    waiter = _waiting(
        procs,
        [*VRAM_13G, "--name", "waiter", "--", "true"],
        "the waiter ran beside the holder's reservation",
    )
    holder.send_signal(signal.SIGTERM)
    wait_for(lambda: process_state(holder.pid) == "T", timeout=30)
    try:
        assert waiter.wait(timeout=20) == 0
    finally:
        holder.send_signal(signal.SIGCONT)
    assert holder.wait(timeout=30) == -signal.SIGTERM


def test_a_waiter_held_for_a_lost_entry_starts_once_it_is_put_back(
    gw: Run,
    procs: Callable[..., subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The ledger is started afresh without a running job's entry; a launch that would fit
    # beside it waits for the entry to come back (its reservation unknown until then), which
    # its gpuwait, stopped meanwhile, puts back once continued. Nothing woke the waiter then:
    # it started at its next reading of the GPUs (here two minutes off), or once the recovery's
    # grace (30 s) was over and it next read them.
    monkeypatch.setenv("GPUWAIT_SAMPLE_INTERVAL", "0.2s")
    holder = procs([*VRAM_4G, "--name", "holder", "--", "sleep", "60"])
    wait_for(lambda: asleep_supervising(holder.pid), timeout=30)
    ledger_path = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "ledger.json"
    # Stopped outside a transaction of its own: stopped holding the ledger's lock, it would
    # hold the launch up for that, not for its entry.
    with exclusive(ledger_path.parent / "ledger.lock"):
        holder.send_signal(signal.SIGSTOP)
        wait_for(lambda: process_state(holder.pid) == "T", timeout=10)
    try:
        replace_ledger(ledger_path, DAMAGE["truncated"])
        monkeypatch.setenv("GPUWAIT_NVML_INTERVAL", "120s")
        waiter = _waiting(
            procs,
            [*VRAM_13G, "--name", "waiter", "--", "true"],
            "the waiter ran without waiting for the lost entry",
        )
        assert named_entry("holder") is None
    finally:
        holder.send_signal(signal.SIGCONT)
    assert waiter.wait(timeout=15) == 0
    assert named_entry("holder") is not None


#: gpuwait with a recovery's grace of 8 s instead of 30 s.
_SHORT_GRACE = """
from gpuwait.queue import lifecycle
lifecycle.RECOVERY_GRACE = 8.0
from gpuwait.cli import entry_point
entry_point()
"""


def test_a_waiter_held_for_an_entry_that_never_comes_back_starts_once_the_grace_is_over(
    gw: Run,
    procs: Callable[..., subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A job of this user lives without an entry (its liveness lock held), its lock older than
    # the ledger: a launch waits the recovery's grace for the entry to come back. Nobody
    # writes anything when the grace is over: the waiter started at its next reading of the
    # GPUs (here two minutes off) instead.
    stderr = _held_beside_a_lost_job(procs, monkeypatch, _SHORT_GRACE)
    assert "1 job of yours still running or waiting has to put its entry back" in stderr


def _held_beside_a_lost_job(
    procs: Callable[..., subprocess.Popen[str]], monkeypatch: pytest.MonkeyPatch, gpuwait: str
) -> str:
    """What `gpuwait` (a script that runs gpuwait with a recovery's grace of 8 s) says of a
    launch of 13 GiB made while a job of this user lives without an entry (its liveness lock
    held, older than the ledger) and its next reading of the GPUs is two minutes off: held
    waiting first, then started with the grace over."""
    state = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait"
    with liveness_lock_held(state, "0a1b2c3d") as lock:
        wait_for(lambda: time.time() > lock.stat().st_mtime, timeout=5)
        monkeypatch.setenv("GPUWAIT_NVML_INTERVAL", "120s")
        waiter = procs([sys.executable, "-c", gpuwait, "--vram", "13G", "--", "true"])
        wait_for(lambda: asleep_waiting(waiter.pid), timeout=20)
        assert waiter.poll() is None
        # Held until the grace is over, as for an entry that never comes back.
        assert waiter.wait(timeout=20) == 0
        return waiter.communicate()[1]


#: gpuwait with a recovery's grace of 8 s, whose every look for jobs without an entry finds no
#: file descriptor left, as a process at its `ulimit -n` would.
_NO_DESCRIPTOR_TO_LOOK = """
import os, resource
from gpuwait.linux import alive
from gpuwait.queue import lifecycle
lifecycle.RECOVERY_GRACE = 8.0
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
look = alive.unlisted
def unlisted(*args):
    taken = []
    try:
        while True:
            taken.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    try:
        return look(*args)
    finally:
        for fd in taken:
            os.close(fd)
alive.unlisted = unlisted
from gpuwait.cli import entry_point
entry_point()
"""


def test_a_waiter_that_cannot_look_for_jobs_without_an_entry_is_held_not_admitted(
    gw: Run,
    procs: Callable[..., subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A job of this user lives without an entry in a ledger started afresh; the waiter's look
    # at the liveness locks failed (EMFILE) and was taken for "no job lives": it was admitted
    # at once into the room the job holds.
    stderr = _held_beside_a_lost_job(procs, monkeypatch, _NO_DESCRIPTOR_TO_LOOK)
    assert "which jobs of yours still have to put their entries back cannot be told" in stderr
    assert "Too many open files" in stderr, stderr


def _waiting(
    procs: Callable[..., subprocess.Popen[str]], argv: list[str], ran: str
) -> subprocess.Popen[str]:
    """`argv` started (`procs`), once it sleeps waiting for room; `ran`: the failure where it
    ran instead."""
    process = procs(argv)
    wait_for(lambda: asleep_waiting(process.pid) or process.poll() is not None, timeout=30)
    assert process.poll() is None, ran
    return process


@contextlib.contextmanager
def _entries_lost(
    procs: Callable[..., subprocess.Popen[str]], monkeypatch: pytest.MonkeyPatch, *names: str
) -> Iterator[tuple[Path, list[Job]]]:
    """Running jobs `names` of 4 GiB, their gpuwaits stopped outside a transaction of their own,
    whose entries a damaged ledger lost, started afresh: for the block, the ledger's path and
    the entries lost (a test puts them back as an older gpuwait does); the gpuwaits go on after
    it."""
    monkeypatch.setenv("GPUWAIT_SAMPLE_INTERVAL", "0.2s")
    holders = [procs([*VRAM_4G, "--name", name, "--", "sleep", "60"]) for name in names]
    for holder in holders:
        wait_for(lambda h=holder: asleep_supervising(h.pid), timeout=30)
    ledger_path = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "ledger.json"
    with exclusive(ledger_path.parent / "ledger.lock"):
        for holder in holders:
            holder.send_signal(signal.SIGSTOP)
            wait_for(lambda h=holder: process_state(h.pid) == "T", timeout=10)
    try:
        lost = Ledger(ledger_path.parent).read().jobs
        replace_ledger(ledger_path, DAMAGE["truncated"])
        yield ledger_path, lost
    finally:
        for holder in holders:
            holder.send_signal(signal.SIGCONT)


def test_a_waiter_held_for_a_lost_entry_starts_once_an_older_gpuwait_puts_it_back(
    gw: Run,
    procs: Callable[..., subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As above, but the running job's gpuwait is one from before the upgrade: it puts its
    # entry back as a plain change, no release in the summary, and signals nobody. The waiter,
    # which fits beside the job, waited on until the recovery's 30 s grace was over (its next
    # reading of the GPUs two minutes off).
    with _entries_lost(procs, monkeypatch, "holder") as (ledger_path, (entry,)):
        monkeypatch.setenv("GPUWAIT_NVML_INTERVAL", "120s")
        waiter = _waiting(
            procs,
            [*VRAM_13G, "--name", "waiter", "--", "true"],
            "the waiter ran without waiting for the lost entry",
        )
        # The older gpuwait's transaction: the entry appended, nothing else.
        with Ledger(ledger_path.parent).transaction() as data:
            data.jobs.append(entry)
        assert waiter.wait(timeout=15) == 0


#: gpuwait with a recovery's grace of 5 min: a waiter held for it, its next reading of the GPUs
#: two minutes off, starts only if something tells it the job it waits for is gone.
_LONG_GRACE = """
from gpuwait.queue import lifecycle
lifecycle.RECOVERY_GRACE = 300.0
from gpuwait.cli import entry_point
entry_point()
"""


@pytest.mark.parametrize("ledger", ["private", "shared"])
def test_a_waiter_held_for_a_lost_entry_starts_once_its_job_ends_without_putting_it_back(
    gw: Run,
    tmp_path: Path,
    procs: Callable[..., subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
    ledger: str,
) -> None:
    # The ledger is started afresh without a running job's entry, and the job ends before its
    # gpuwait (stopped meanwhile) has put the entry back: its gpuwait finds no entry to take
    # out, so nothing counts as a release and nobody is woken. The waiter, which would not fit
    # beside the job, waited on until its next reading of the GPUs (two minutes off) or the
    # grace's end.
    if ledger == "shared":
        directory = shared_dir(tmp_path)
        monkeypatch.setenv("GPUWAIT_LEDGER_DIR", str(directory))
        ledger_path, lock_path = directory / f"ledger.{os.getuid()}.json", directory
    else:
        ledger_path = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "ledger.json"
        lock_path = ledger_path.parent / "ledger.lock"
    holder = procs([*VRAM_13G, "--name", "holder", "--", "sleep", "60"])
    wait_for(lambda: asleep_supervising(holder.pid), timeout=30)
    # Stopped outside a transaction of its own.
    locked = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(locked, fcntl.LOCK_EX)
        holder.send_signal(signal.SIGSTOP)
        wait_for(lambda: process_state(holder.pid) == "T", timeout=10)
    finally:
        os.close(locked)
    try:
        (job,) = [p for p in children(holder.pid) if _name(p) == "sleep"]
        os.kill(job, signal.SIGKILL)
        replace_ledger(ledger_path, DAMAGE["truncated"])
        monkeypatch.setenv("GPUWAIT_NVML_INTERVAL", "120s")
        waiter = _waiting(
            procs,
            [sys.executable, "-c", _LONG_GRACE, "--vram", "13G", "--", "true"],
            "the waiter ran without waiting for the lost entry",
        )
    finally:
        holder.send_signal(signal.SIGCONT)
    assert holder.wait(timeout=30) == -signal.SIGKILL
    jobs = json.loads(ledger_path.read_bytes())["jobs"]
    assert "holder" not in [j["name"] for j in jobs], "the entry was put back"
    assert waiter.wait(timeout=20) == 0


#: gpuwait with a recovery's grace of 5 min (not over before a slow machine has launched them
#: all), that writes to the file $PLANS/PID a line "plan" for each plan it makes, and "saw" and
#: the jobs listed for each changed summary it reads.
_COUNTED = """
import os
from gpuwait.queue import lifecycle, wake
lifecycle.RECOVERY_GRACE = 300.0
notes = open(os.path.join(os.environ["PLANS"], str(os.getpid())), "a", buffering=1)
planned, changed = wake.note_planned, wake.Summaries.changed
def note_planned(state_dir):
    notes.write("plan\\n")
    planned(state_dir)
def looked(self, now):
    found, later = changed(self, now)
    for seen in found:
        if seen is not None:
            notes.write(" ".join(["saw", *sorted(seen.running.union(seen.waiting))]) + "\\n")
    return found, later
wake.note_planned = note_planned
wake.Summaries.changed = looked
from gpuwait.cli import entry_point
entry_point()
"""


def _notes(plans: Path, pid: int) -> list[str]:
    """What the gpuwait `pid` run as _COUNTED wrote: its plans and the summaries it read."""
    try:
        return (plans / str(pid)).read_text().splitlines()
    except FileNotFoundError:
        return []


def _done_with(plans: Path, pid: int, job_id: str) -> bool:
    """The gpuwait `pid` run as _COUNTED has read a summary listing `job_id`, and done what it
    does about it: it sleeps again."""
    saw = any(n.startswith("saw ") and job_id in n.split()[1:] for n in _notes(plans, pid))
    return saw and sleeping_in(pid, "sigtimedwait")


def _plans(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The folder where gpuwaits run as _COUNTED from now on write what they do."""
    plans = tmp_path / "plans"
    plans.mkdir()
    monkeypatch.setenv("PLANS", str(plans))
    return plans


def test_a_waiter_held_for_two_lost_entries_plans_once_both_are_back(
    gw: Run,
    procs: Callable[..., subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    # Two running jobs' entries are lost, and their gpuwait, older, put them back one after
    # the other: the waiter held for both planned at the first, only to be held for the second.
    # Planning only once both are back, its waiting line went on saying that two were to come
    # back until then, however long that took.
    plans = _plans(tmp_path, monkeypatch)
    with _entries_lost(procs, monkeypatch, "h0", "h1") as (ledger_path, (first, second)):
        monkeypatch.setenv("GPUWAIT_NVML_INTERVAL", "120s")
        argv = [sys.executable, "-c", _COUNTED, "--vram", "2G", "--", "true"]
        waiter = _waiting(procs, argv, "the waiter ran without waiting for the lost entries")
        said(waiter, "2 jobs of yours still running or waiting have to put their entries back")
        with Ledger(ledger_path.parent).transaction() as data:
            data.jobs.append(first)
        said(waiter, "1 job of yours still running or waiting has to put its entry back")
        wait_for(lambda: _done_with(plans, waiter.pid, first.id), timeout=30)
        assert _notes(plans, waiter.pid).count("plan") == 1
        assert waiter.poll() is None, "the waiter ran without waiting for the second entry"
        with Ledger(ledger_path.parent).transaction() as data:
            data.jobs.append(second)
        assert waiter.wait(timeout=15) == 0


def test_launches_in_the_grace_after_the_ledger_was_started_afresh_make_no_held_waiter_plan(
    gw: Run,
    procs: Callable[..., subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    # Held for a running job's lost entry, waiters look at the summaries four times a second
    # for it to come back from an older gpuwait, which signals nobody. Every job listed anew
    # made each of them plan under the ledger's lock: a launch, not only an entry put back,
    # so that the k-th launch made the k - 1 waiters before it plan, and five launches one
    # after another 15 plans where 5 (one each) tell as much.
    plans = _plans(tmp_path, monkeypatch)
    waiters: list[subprocess.Popen[str]] = []
    with _entries_lost(procs, monkeypatch, "holder") as (ledger_path, (entry,)):
        monkeypatch.setenv("GPUWAIT_NVML_INTERVAL", "120s")
        for n in range(5):
            argv = [sys.executable, "-c", _COUNTED, "--vram", "2G", "--name", f"w{n}", "--", "true"]
            waiter = _waiting(procs, argv, "the waiter ran without waiting for the lost entry")
            new = (named_entry(f"w{n}") or {})["id"]
            for held in waiters:
                wait_for(lambda p=held.pid, j=new: _done_with(plans, p, j), timeout=30)
            waiters.append(waiter)
        assert [_notes(plans, w.pid).count("plan") for w in waiters] == [1] * 5
        # The older gpuwait's transaction: the entry appended, nothing else. The one entry each
        # waiter is held for is back: it plans, or finds itself started by another's plan.
        with Ledger(ledger_path.parent).transaction() as data:
            data.jobs.append(entry)
        assert [w.wait(timeout=15) for w in waiters] == [0] * 5


def test_a_waiter_held_in_the_grace_plans_without_the_ledgers_lock(
    gw: Run,
    procs: Callable[..., subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    # Held for a lost entry, a waiter planned the whole queue at each of its readings of the
    # GPUs, found it fits, and took the ledger's lock to learn that nobody is admitted in the
    # grace. Here another process keeps the lock: the waiter's plans went on without it.
    plans = _plans(tmp_path, monkeypatch)
    with _entries_lost(procs, monkeypatch, "holder") as (ledger_path, _):
        monkeypatch.setenv("GPUWAIT_NVML_INTERVAL", "0.2s")
        waiter = _waiting(
            procs,
            [sys.executable, "-c", _COUNTED, "--vram", "2G", "--", "true"],
            "the waiter ran without waiting for the lost entry",
        )
        with exclusive(ledger_path.parent / "ledger.lock"):
            before = _notes(plans, waiter.pid).count("plan")
            wait_for(
                lambda: _notes(plans, waiter.pid).count("plan") >= before + 3,
                timeout=20,
                message=lambda: f"blocked in the lock wait: {sleeping_in(waiter.pid, 'flock')}",
            )
        assert waiter.poll() is None


def test_a_job_that_took_its_lock_just_before_the_ledger_was_started_afresh_is_waited_for(
    tmp_path: Path,
) -> None:
    # The test below, where a machine is quick: the first job began a few hundredths of a
    # second before its ledger was damaged and started afresh. Its lock still counts as a job
    # to wait for, not as one of the new ledger's.
    with liveness_lock_held(tmp_path, "0a1b2c3d") as lock:
        taken = lock.stat().st_mtime
        data = LedgerData(created_at=taken + 0.02)
        lost = lifecycle._entries_to_come_back(tmp_path, data, taken + 1, None)
        assert lost == ["0a1b2c3d"]


def test_a_job_that_took_its_lock_after_the_ledger_was_started_afresh_is_not_waited_for(
    tmp_path: Path,
) -> None:
    # A job of the new ledger that has just ended holds its lock, without its entry, until
    # its file is removed: the next launch, within the grace after the damage, is not to wait
    # for it to be put back, as it would for a job whose entry the damage lost.
    with liveness_lock_held(tmp_path, "0a1b2c3d") as lock:
        taken = lock.stat().st_mtime
        data = LedgerData(created_at=taken - 1)
        assert lifecycle._entries_to_come_back(tmp_path, data, taken + 1, None) == []


def _first_entry_damaged(ledger: bytes) -> bytes:
    """The ledger with one figure of the first job's entry damaged: only that entry is lost."""
    found = json.loads(ledger)
    (first,) = [job for job in found["jobs"] if job["name"] == "first"]
    first["reserved_bytes"] = "garbage"
    return json.dumps(found).encode()


#: Damage that loses the running job's entry, and what the next launch's waiting line says.
ENTRY_LOST = {
    "whole": (lambda _: DAMAGE["truncated"], "the ledger was started afresh after damage"),
    "in part": (_first_entry_damaged, "the ledger was repaired after damage"),
}


@pytest.mark.parametrize("damage", list(ENTRY_LOST))
def test_a_launch_right_after_the_ledger_was_recovered_waits_for_the_running_jobs_entry(
    gw: Run,
    tmp_path: Path,
    procs: Callable[..., subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
    damage: str,
) -> None:
    # As above, but the second job comes before the first job's gpuwait has looked at the
    # ledger again (here: it is stopped meanwhile): the second one's own transaction recovers
    # the file, without the first job's entry. It was admitted at once, into the 13 GiB the
    # first job had reserved and not yet allocated (where only that entry was damaged, too).
    damaged, said_why = ENTRY_LOST[damage]
    reports = [tmp_path / "first.json", tmp_path / "second.json"]
    first, loaded = _first_job_loading(procs, monkeypatch, "0.1s", reports[0])
    ledger_path = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "ledger.json"
    # Stopped outside a transaction of its own (it publishes its samples every 0.2 s): stopped
    # holding the ledger lock, it would hold the second job up for that, not for its entry.
    with exclusive(ledger_path.parent / "ledger.lock"):
        os.kill(first.pid, signal.SIGSTOP)
        wait_for(lambda: process_state(first.pid) == "T", timeout=10)
    try:
        replace_ledger(ledger_path, damaged(ledger_path.read_bytes()))
        second_job = [*SIMJOB, "--vram", "13G", "--hold", "0.1s", "--report", str(reports[1])]
        # Recovered, the second job in it, and it waits: the first job's gpuwait lives.
        second = _waiting(
            procs,
            [*VRAM_13G, "--name", "second", "--", *second_job],
            "the second job ran beside the first one's reservation",
        )
        assert (named_entry("second") or {}).get("state") == "waiting"
    finally:
        os.kill(first.pid, signal.SIGCONT)
        loaded()
    assert first.wait(timeout=60) == 0 and second.wait(timeout=60) == 0
    _, err = second.communicate()
    assert f"{said_why}; 1 job of yours still running" in err
    assert [json.loads(r.read_text())["oom"] for r in reports] == [False, False]
    said = [
        json.loads(line) for line in (ledger_path.parent / "events.jsonl").read_text().splitlines()
    ]
    first_end = next(e for e in said if e["kind"] == "finish" and e["name"] == "first")
    second_start = next(e for e in said if e["kind"] == "start" and e["name"] == "second")
    assert second_start["time"] >= first_end["time"]


def test_a_launch_right_after_own_shared_file_was_started_afresh_waits_for_the_running_jobs_entry(
    gw: Run,
    tmp_path: Path,
    procs: Callable[..., subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As above, in a shared ledger: the user's own file there, damaged, is set aside and
    # started afresh by the second job's transaction. Nobody waited for the running job's
    # entry there: the second job was admitted at once into the room the first had reserved
    # (and one started --after the first would have started beside it).
    directory = shared_dir(tmp_path)
    monkeypatch.setenv("GPUWAIT_LEDGER_DIR", str(directory))
    own = directory / f"ledger.{os.getuid()}.json"

    def entry(name: str) -> dict[str, Any] | None:
        with contextlib.suppress(OSError, ValueError):
            return next(
                (j for j in json.loads(own.read_bytes())["jobs"] if j["name"] == name), None
            )
        return None

    reports = [tmp_path / "first.json", tmp_path / "second.json"]
    first, loaded = _first_job_loading(procs, monkeypatch, "0.1s", reports[0], entry)
    # Stopped outside a transaction: the lock of a shared ledger is on its directory.
    locked = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(locked, fcntl.LOCK_EX)
        os.kill(first.pid, signal.SIGSTOP)
        wait_for(lambda: process_state(first.pid) == "T", timeout=10)
    finally:
        os.close(locked)
    try:
        replace_ledger(own, DAMAGE["truncated"])
        second_job = [*SIMJOB, "--vram", "13G", "--hold", "0.1s", "--report", str(reports[1])]
        second = procs([*VRAM_13G, "--name", "second", "--", *second_job])
        wait_for(
            lambda: (
                (
                    sleeping_in(second.pid, "sigtimedwait")
                    and (entry("second") or {}).get("state") == "waiting"
                )
                or second.poll() is not None
            ),
            timeout=30,
        )
        assert second.poll() is None, "the second job ran beside the first one's reservation"
    finally:
        os.kill(first.pid, signal.SIGCONT)
        loaded()
    assert first.wait(timeout=60) == 0 and second.wait(timeout=60) == 0
    _, err = second.communicate()
    assert "the ledger was started afresh after damage; 1 job of yours still running" in err
    assert [json.loads(r.read_text())["oom"] for r in reports] == [False, False]


@pytest.mark.parametrize("who", ["the waiter", "the later launch"])
def test_a_waiter_whose_entry_was_lost_keeps_its_place_before_a_later_launch(
    gw: Run,
    tmp_path: Path,
    procs: Callable[..., subprocess.Popen[str]],
    who: str,
) -> None:
    # One 24 GiB card: a 13 GiB job runs, another waits behind it. The ledger is damaged, and
    # a later 13 GiB launch comes. Where `who` first finds the damage is the later launch (the
    # running job's and the waiter's gpuwaits stopped meanwhile, outside a transaction), the
    # file it starts afresh numbers the later launch first: the waiter put its entry back
    # with its old place behind it, "1 ahead of you", and once the card was free the later
    # launch started first. Either way the waiter starts first.
    release = tmp_path / "release"
    started = tmp_path / "started"
    hold = f"while [ ! -e {shlex.quote(str(release))} ]; do sleep 0.05; done"
    holder = procs([*VRAM_13G, "--name", "holder", "--", "sh", "-c", hold])
    wait_for(lambda: asleep_supervising(holder.pid), timeout=30)

    def noting(name: str) -> list[str]:
        return ["sh", "-c", f"echo {name} >> {shlex.quote(str(started))}"]

    waiter = _waiting(
        procs,
        [*VRAM_13G, "--name", "waiter", "--", *noting("waiter")],
        "the waiter ran beside the running job",
    )
    ledger_path = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "ledger.json"
    stopped = [holder, waiter] if who == "the later launch" else []
    if not stopped:
        damage_ledger(ledger_path, lambda _: DAMAGE["truncated"])
    with exclusive(ledger_path.parent / "ledger.lock"):
        for process in stopped:
            process.send_signal(signal.SIGSTOP)
            wait_for(lambda p=process: process_state(p.pid) == "T", timeout=10)
    try:
        if stopped:
            replace_ledger(ledger_path, DAMAGE["truncated"])
        later = _waiting(
            procs,
            [*VRAM_13G, "--name", "later", "--", *noting("later")],
            "the later launch ran beside the running job",
        )
        if stopped:
            assert named_entry("later") and not named_entry("waiter")
    finally:
        for process in stopped:
            process.send_signal(signal.SIGCONT)
    wait_for(
        lambda: named_entry("holder") and named_entry("waiter"),
        timeout=20,
        message="the entries were never put back",
    )
    release.touch()
    assert holder.wait(timeout=30) == 0
    assert waiter.wait(timeout=30) == 0 and later.wait(timeout=30) == 0
    assert started.read_text().split() == ["waiter", "later"]


class ClockOff:
    """The time module as a module of gpuwait's sees it, its wall clock `offset` seconds off
    from the machine's."""

    def __init__(self, offset: float) -> None:
        self.offset = offset

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def time(self) -> float:
        return time.time() + self.offset


def test_another_users_damaged_file_changed_an_hour_ahead_of_the_clock_holds_nobody(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As above, the machine's clock stepped back an hour since the file last changed (NTP
    # after a wrong start): the file did not change lately, either way of the clock, and the
    # others are not held for it for the hour it takes the clock to catch up.
    from gpuwait.queue import ledger as module

    directory, _ = others_file(tmp_path, DAMAGE["truncated"])
    theirs = subprocess.Popen(
        ["gpuwait", "60"], executable=shutil.which("sleep"), user=4242, group=4242
    )
    try:
        wait_for(lambda: b"gpuwait" in Path(f"/proc/{theirs.pid}/cmdline").read_bytes())
        assert list(Ledger(directory).read().unread) == [4242]
        monkeypatch.setattr(module, "time", ClockOff(-3600))
        assert Ledger(directory).read().unread == {}
    finally:
        theirs.kill()
        theirs.wait()


def test_the_wait_for_another_users_unread_file_counts_the_jobs_running() -> None:
    # Held for a member's file that cannot be used while their gpuwait runs, the wait line
    # still says how many jobs run, as every other wait does: "(2 running, 0 ahead of you)".
    running = [live_job(name, state=RUNNING) for name in ("a", "b")]
    mine = live_job("mine", state="waiting")
    data = LedgerData(jobs=[*running, mine], unread={4242: "Expecting value"})
    reason = lifecycle.held_for_unread(data, mine)
    assert reason is not None
    assert "(2 running, 0 ahead of you)" in reason.describe(), reason.describe()
    assert "the ledger file of uid 4242" in reason.describe(), reason.describe()
    assert lifecycle.held_for_unread(LedgerData(jobs=[*running, mine]), mine) is None


@contextlib.contextmanager
def their_gpuwait_runs() -> Iterator[None]:
    """A process of uid 4242's named gpuwait runs (a sleep), seen as theirs by every reader."""
    from gpuwait.linux import security

    security._RUNS_GPUWAIT.clear()  # no look of another test's
    theirs = subprocess.Popen(
        ["gpuwait", "60"], executable=shutil.which("sleep"), user=4242, group=4242
    )
    try:
        wait_for(lambda: b"gpuwait" in Path(f"/proc/{theirs.pid}/cmdline").read_bytes())
        yield
    finally:
        theirs.kill()
        theirs.wait()
        security._RUNS_GPUWAIT.clear()


ONE_CARD = MachineSnapshot("sim", (GpuSnapshot(0, "GPU-0", "Test GPU", 24 * 2**30, 0),))


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a file and a process of another user's")
def test_a_waiter_held_for_another_users_unusable_file_is_told_when_the_hold_lapses(
    tmp_path: Path,
) -> None:
    # Held for a member's file that cannot be used while their gpuwait runs, a waiter planned
    # again only at its next reading of the GPUs once the file had been left so for the 30 s
    # after which nobody is held for it: its reason now says when that is, and the waiting
    # loop wakes then.
    from gpuwait.queue import ledger as module

    directory, other = others_file(tmp_path, DAMAGE["truncated"])
    ledger = Ledger(directory)
    with their_gpuwait_runs():
        waiter = lifecycle.submit(
            ledger, live_job("w", request={"bytes": 2**30}), [], [], tmp_path, ["x"]
        )
        _, held = lifecycle.admit(ledger, waiter, ONE_CARD, 0.99)
        assert isinstance(held, WaitReason) and "uid 4242" in (held.blocked or ""), held
        boot_now = proc.boot_clock()
        assert boot_now is not None and held.until is not None, held
        lapses_in = os.lstat(other).st_ctime + module.UNREAD_GRACE - time.time()
        assert abs(held.until - boot_now - lapses_in) < 1, (held.until - boot_now, lapses_in)


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a file and a process of another user's")
@pytest.mark.parametrize("behind", [60.0, -60.0])
def test_a_waiter_is_held_for_another_users_unusable_file_whatever_the_file_servers_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, behind: float
) -> None:
    # The ledger directory on a file server whose clock is a minute ahead of this machine's
    # (or behind it), as NFS's may be: a member's file emptied a moment ago, while their
    # gpuwait runs, was taken for one left so for a minute, and the waiter was admitted into
    # the room their jobs hold. The file's change time is now compared with this process's
    # own last write there, on the same clock: held, as where both clocks agree, until 30 s
    # after the change.
    from gpuwait.queue import ledger as module

    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - behind)
    directory, other = others_file(tmp_path, DAMAGE["truncated"])
    ledger = Ledger(directory)
    with their_gpuwait_runs():
        waiter = lifecycle.submit(
            ledger, live_job("w", request={"bytes": 2**30}), [], [], tmp_path, ["x"]
        )
        _, held = lifecycle.admit(ledger, waiter, ONE_CARD, 0.99)
        assert isinstance(held, WaitReason) and "uid 4242" in (held.blocked or ""), held
        boot_now = proc.boot_clock()
        assert boot_now is not None and held.until is not None, held
        lapses_in = os.lstat(other).st_ctime + module.UNREAD_GRACE - real()
        assert abs(held.until - boot_now - lapses_in) < 1, (held.until - boot_now, lapses_in)


@pytest.mark.parametrize(
    ("changed", "now", "ahead", "lapses"),
    [
        (1000.0, 1010.0, 0.0, 1030.0),  # both clocks agree: 20 s left
        (1000.0, 1031.0, 0.0, None),  # left so for 31 s
        (1060.0, 1010.0, 60.0, 1030.0),  # the server's clock a minute ahead: 20 s left
        (1060.0, 1041.0, 60.0, None),
        (940.0, 1010.0, -60.0, 1030.0),  # a minute behind
        (940.0, 1041.0, -60.0, None),
        (1005.0, 1000.0, 0.0, 1035.0),  # changed in the future of this clock (a few seconds)
        (1100.0, 1000.0, 0.0, None),  # or far in it
    ],
)
def test_when_a_hold_for_a_members_file_lapses_is_told_on_the_file_systems_clock(
    changed: float, now: float, ahead: float, lapses: float | None
) -> None:
    from gpuwait.queue import ledger as module

    assert module.lapse(changed, now, ahead) == lapses


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a file and a process of another user's")
def test_a_waiter_whose_dependency_failed_leaves_at_once_while_another_users_file_is_unusable(
    tmp_path: Path,
) -> None:
    # A waiter launched --after-ok a job that then failed, while a member's file cannot be
    # used and their gpuwait runs, was held for that file (30 s, or as long as it is written
    # again and again) before it was told its dependency failed. It is told at once.
    directory, _ = others_file(tmp_path, DAMAGE["truncated"])
    ledger = Ledger(directory)
    first = lifecycle.submit(ledger, live_job("first"), [], [], tmp_path, ["x"])
    waiter = lifecycle.submit(ledger, live_job("w"), [], ["first"], tmp_path, ["x"])
    with ledger.transaction() as data:
        data.remove(first.id)
        data.book.note_finished(Finished(first.id, FAILED, time.time()))
    with their_gpuwait_runs():
        assert list(ledger.read().unread) == [4242]
        _, outcome = lifecycle.admit(ledger, waiter, ONE_CARD, 0.99)
        assert isinstance(outcome, lifecycle.DependencyFailed), outcome


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a file and a process of another user's")
def test_a_waiter_whose_dependency_failed_is_not_held_for_another_users_file_between_plans(
    tmp_path: Path,
) -> None:
    # Between the plans it makes under the lock, a waiter reads the ledger without it: where
    # an --after-ok dependency failed meanwhile, that read does not say it waits for another
    # member's unusable file (up to 30 s, or for as long as the file is written so again), it
    # takes the lock at once, to leave the queue.
    from gpuwait.queue import wait

    directory, _ = others_file(tmp_path, DAMAGE["truncated"])
    ledger = Ledger(directory)
    first = lifecycle.submit(ledger, live_job("first"), [], [], tmp_path, ["x"])
    waiter = lifecycle.submit(ledger, live_job("w"), [], ["first"], tmp_path, ["x"])
    with their_gpuwait_runs():
        lifecycle.admit(ledger, waiter, ONE_CARD, 0.99)  # the GPU's health noted
        data = ledger.read()
        held = wait._reason_without_lock(data, directory, waiter, ONE_CARD, 0.99, Conditions())
        assert held.reason is not None and "uid 4242" in (held.reason.blocked or ""), held
        with ledger.transaction() as data:
            data.remove(first.id)
            data.book.note_finished(Finished(first.id, FAILED, time.time()))
        data = ledger.read()
        assert list(data.unread) == [4242]
        told = wait._reason_without_lock(data, directory, waiter, ONE_CARD, 0.99, Conditions())
        assert told.reason is None, told


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a file and a process of another user's")
def test_another_users_unusable_file_backdated_by_its_owner_still_holds_admissions(
    tmp_path: Path,
) -> None:
    # A member's file written unusable and then backdated (`touch -d '1 hour ago'`, which
    # any owner may do) changed all the same a moment ago: the others are held for it, as
    # for any file changed lately, not admitted into the room their jobs may hold.
    directory, other = others_file(tmp_path, DAMAGE["truncated"])
    an_hour_ago = time.time() - 3600
    os.utime(other, (an_hour_ago, an_hour_ago))
    with their_gpuwait_runs():
        assert list(Ledger(directory).read().unread) == [4242]


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a file and a process of another user's")
def test_the_hold_for_another_users_unusable_file_lapses_30_s_after_it_changed_however_late_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Read 10 s after it changed, a member's unusable file holds the others for the 20 s left
    # of the 30 s, not for 30 s from the reading: each reading would otherwise put the end of
    # the hold off again.
    from gpuwait.queue import ledger as module

    directory, other = others_file(tmp_path, DAMAGE["truncated"])
    with their_gpuwait_runs():
        monkeypatch.setattr(module, "time", ClockOff(10))
        lapses = Ledger(directory).read().unread_until
        assert lapses == {4242: os.lstat(other).st_ctime + module.UNREAD_GRACE}, lapses


@pytest.mark.skipif(os.geteuid() != 0, reason="makes files and processes of other users'")
def test_a_waiter_held_for_two_users_unusable_files_is_told_of_the_first_uid_and_first_end(
    tmp_path: Path,
) -> None:
    # Two members' files cannot be used while their gpuwaits run: uid 4243's left so first,
    # then uid 4242's. The waiter's reason names uid 4242, the first by uid, and ends where the
    # first of the two holds lapses, 30 s after uid 4243's file changed: the waiter plans
    # again then.
    from gpuwait.queue import ledger as module

    directory, theirs = others_file(tmp_path, DAMAGE["truncated"])
    first = directory / "ledger.4243.json"
    first.write_bytes(DAMAGE["truncated"])
    os.lchown(first, 4243, 4243)
    time.sleep(0.2)
    os.chmod(theirs, 0o644)  # uid 4242's file changed last
    assert os.lstat(theirs).st_ctime - os.lstat(first).st_ctime >= 0.1
    ledger = Ledger(directory)
    other = subprocess.Popen(
        ["gpuwait", "60"], executable=shutil.which("sleep"), user=4243, group=4243
    )
    try:
        wait_for(lambda: b"gpuwait" in Path(f"/proc/{other.pid}/cmdline").read_bytes())
        with their_gpuwait_runs():
            waiter = lifecycle.submit(
                ledger, live_job("w", request={"bytes": 2**30}), [], [], tmp_path, ["x"]
            )
            _, held = lifecycle.admit(ledger, waiter, ONE_CARD, 0.99)
            boot_now, now = proc.boot_clock(), time.time()
            assert isinstance(held, WaitReason) and held.until is not None, held
            assert "uid 4242" in (held.blocked or "") and "4243" not in (held.blocked or "")
            assert boot_now is not None
            ends = held.until - boot_now + now
            assert abs(ends - (os.lstat(first).st_ctime + module.UNREAD_GRACE)) < 0.05, ends
    finally:
        other.kill()
        other.wait()


@contextlib.contextmanager
def member_locking_their_lock_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uid: int
) -> Iterator[Path]:
    """A shared ledger directory where member `uid` holds a lock on their lock directory, as
    `flock -s alive.<uid> sleep 1d` does (no job, no GPU), taken before the block and let go
    after it; no look of another test's kept. A uid of each test's alone: a gpuwait of 4242's
    running for another test would count."""
    from gpuwait.linux import security
    from gpuwait.queue import ledger as module

    monkeypatch.setattr(security, "_RUNS_GPUWAIT", {})
    monkeypatch.setattr(module, "_HOLDS_A_LOCK", {})
    directory = shared_dir(tmp_path)
    lock_dir = directory / f"alive.{uid}"
    lock_dir.mkdir(mode=0o700)
    os.chown(lock_dir, uid, uid)
    held = subprocess.Popen(["flock", "-s", str(lock_dir), "sleep", "60"])
    try:
        wait_for(lambda: f" {held.pid} " in Path("/proc/locks").read_text())
        yield directory
    finally:
        held.kill()
        held.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a file and a directory of another user's")
@pytest.mark.parametrize(
    "theirs", [False, True], ids=["no gpuwait of theirs", "a gpuwait of theirs"]
)
def test_a_members_file_gone_holds_a_waiter_no_longer_than_the_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, theirs: bool
) -> None:
    # A member's job has ended, leaving behind a process that inherited its lock on their lock
    # directory (a `nohup` server its script started), and their ledger file is gone (root
    # removed it as they left); with or without a gpuwait of theirs running that writes no
    # ledger file (one the shell hook keeps as the parent of a command it runs bare, a waiter
    # stopped with Ctrl-Z). A waiter's hold for it lapsed 30 s after the directory's last
    # change, and every other member's write there (each launch, each job's end) pushed it
    # back: on a busy server nobody was admitted for as long as that process lived. A gpuwait
    # of theirs that writes the file again does so within moments; the hold lapses now 30 s
    # after this waiter found the file gone at the latest, whatever changes meanwhile.
    from gpuwait.linux import security
    from gpuwait.queue import ledger as module

    uid = 4272 if theirs else 4271
    with member_locking_their_lock_dir(tmp_path, monkeypatch, uid) as directory:
        gpuwait = (
            subprocess.Popen(
                ["gpuwait", "60"], executable=shutil.which("sleep"), user=uid, group=uid
            )
            if theirs
            else None
        )
        try:
            if gpuwait is not None:
                cmdline = Path(f"/proc/{gpuwait.pid}/cmdline")
                wait_for(lambda: b"gpuwait" in cmdline.read_bytes())
                assert security.runs_gpuwait(uid)
            waiter = Ledger(directory)
            first = waiter.read().unread_until
            found_gone = time.time()  # at the latest
            assert list(first) == [uid], first
            # Another member's write into the directory, two seconds on.
            time.sleep(2)
            (directory / "ledger.4243.json").write_text("{}")
            later = waiter.read().unread_until[uid]
            assert later <= found_gone + module.UNREAD_GRACE, later - found_gone
        finally:
            if gpuwait is not None:
                gpuwait.kill()
                gpuwait.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a file and a directory of another user's")
def test_a_members_file_written_unusable_again_and_again_holds_a_waiter_no_longer_than_the_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A member holds a lock on their lock directory (`flock -s alive.<uid> sleep 1d`: no job,
    # no GPU) and a loop of theirs writes junk over their ledger file every 25 s. Each write
    # moved the end of a waiter's hold to 30 s after it: nobody was admitted for as long as
    # the loop ran, at no cost to them. The hold lapses now 30 s after this waiter found the
    # file unusable at the latest, whatever they write meanwhile, as where it is gone.
    from gpuwait.queue import ledger as module

    with member_locking_their_lock_dir(tmp_path, monkeypatch, 4274) as directory:
        theirs = directory / "ledger.4274.json"
        theirs.write_bytes(DAMAGE["garbage"])
        os.chown(theirs, 4274, 4274)
        waiter = Ledger(directory)
        first = waiter.read().unread_until
        found_unusable = time.time()  # at the latest
        assert list(first) == [4274], first
        # Their next write of junk, two seconds on.
        time.sleep(2)
        theirs.write_bytes(DAMAGE["zero-length"])
        later = waiter.read().unread_until[4274]
        assert later <= found_unusable + module.UNREAD_GRACE, later - found_unusable


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a file and a directory of another user's")
def test_a_members_file_marked_started_afresh_again_and_again_holds_a_waiter_no_longer_than_the_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A member holds a lock on their lock directory (`flock -s alive.<uid> sleep 1d`: no job,
    # no GPU) and a loop of theirs writes over their ledger file every 25 s one that says it
    # was started afresh after damage just now. Each write held every waiter for 30 s more,
    # "until they have put their entries back": nobody was admitted for as long as the loop
    # ran. The hold lapses now 30 s after this waiter first found the file so, at the latest.
    from gpuwait.queue import ledger as module

    with member_locking_their_lock_dir(tmp_path, monkeypatch, 4275) as directory:
        theirs = directory / "ledger.4275.json"

        def marked_afresh() -> None:
            now = time.time()
            raw = {"schema": 1, "jobs": [], "created_at": now, "repaired_at": now, "next_order": 1}
            theirs.write_text(json.dumps(raw))
            os.chown(theirs, 4275, 4275)

        marked_afresh()
        waiter = Ledger(directory)
        first = waiter.read().recovered
        found = proc.boot_clock()  # at the latest
        assert found is not None and list(first) == [4275], first
        # Their next such write, two seconds on.
        time.sleep(2)
        marked_afresh()
        later = waiter.read().recovered.get(4275)
        assert later is None or later <= found + module.UNREAD_GRACE + 0.01, later - found


def members_who_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, first: int) -> Path:
    """A shared ledger directory where forty members, uids `first` to `first` + 39, left,
    root removing their files as docs/shared-servers.md says (their lock directories stay),
    and another wrote there just now; no look of another test's kept."""
    from gpuwait.linux import security
    from gpuwait.queue import ledger as module
    from gpuwait.queue import wake

    monkeypatch.setattr(module, "_HOLDS_A_LOCK", {})
    monkeypatch.setattr(wake, "_RUNS_A_JOB", {})
    monkeypatch.setattr(security, "_RUNS_GPUWAIT", {})
    directory = shared_dir(tmp_path)
    for uid in range(first, first + 40):
        lock_dir = directory / f"alive.{uid}"
        lock_dir.mkdir(mode=0o700)
        os.chown(lock_dir, uid, uid)
    (directory / f"ledger.{first - 1}.json").write_text("{}")  # a write there just now
    return directory


def counted(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[tuple[Any, ...]]:
    """The calls of `module`.`name` from now on, by their arguments."""
    calls: list[tuple[Any, ...]] = []
    function = getattr(module, name)

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return function(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls


def an_older_gpuwaits_job(lock_dir: Path, uid: int) -> subprocess.Popen[str]:
    """A job of `uid`'s under a gpuwait older than the lock on the lock directory: its
    liveness lock in `lock_dir`, an exclusive flock of theirs, held once this returns (opened
    through the descriptor given: the test's directories are closed to them)."""
    liveness = os.open(lock_dir / f"{uid:016x}", os.O_RDWR | os.O_CREAT)
    os.fchown(liveness, uid, uid)
    job = subprocess.Popen(
        ["flock", "-x", f"/dev/fd/{liveness}", "-c", "echo held; exec sleep 60"],
        user=uid,
        group=uid,
        extra_groups=[],
        pass_fds=(liveness,),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    os.close(liveness)
    assert job.stdout is not None and job.stdout.readline() == "held\n"
    return job


@pytest.mark.skipif(os.geteuid() != 0, reason="makes directories of other users'")
@pytest.mark.parametrize("looked_at", ["proc_locks", "_mount_device"], ids=["locks", "mounts"])
def test_the_members_whose_files_are_gone_cost_one_look_at_the_machines_locks_a_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, looked_at: str
) -> None:
    # Forty members left, root removing their files as docs/shared-servers.md says (their
    # lock directories stay). Within 30 s of any write in the directory, which on a busy
    # server is always, each read of the ledger by every waiter read the whole of
    # /proc/locks once for each of them (on a node holding 5,000 locks, half a core's second
    # for a hundred members, each second, for each waiter), and looked each one's lock
    # directory up in the mount table (/proc/self/mountinfo, 16 MB on a node of 100,000
    # mounts) to learn the device by which /proc/locks names its locks. All of them in one
    # mount, each is looked at once now.
    from gpuwait.linux import proc as linux_proc

    directory = members_who_left(tmp_path, monkeypatch, 4300)
    looks = counted(monkeypatch, linux_proc, looked_at)
    # A job of one of them holds its lock (here root's: the test's directories are closed to
    # them): they hold the others, and they alone.
    job = os.open(directory / "alive.4310", os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(job, fcntl.LOCK_SH)
        assert Ledger(directory).read().unread == {4310: "it is not there"}
    finally:
        os.close(job)
    assert len(looks) == 1, len(looks)


@pytest.mark.skipif(os.geteuid() != 0, reason="makes directories and a process of other users'")
def test_the_members_running_an_older_gpuwait_cost_one_look_at_the_machines_locks_a_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Forty members whose files are gone, each one's summary listing a job of theirs running
    # (an older gpuwait's, whose job holds no lock on their lock directory: an exclusive flock
    # of theirs on the directory's file system tells it). Within 30 s of any write in the
    # directory, each read of the ledger by every waiter read the whole of /proc/locks once
    # for each of them, and the mount table too; it reads /proc/locks twice now, whatever
    # their number.
    from gpuwait.linux import proc as linux_proc

    directory = members_who_left(tmp_path, monkeypatch, 4500)
    for uid in range(4500, 4540):
        summary = directory / f"wake.{uid}.json"
        running = {"schema": 1, "release": 1, "running": [f"{uid:016x}"], "waiting": []}
        summary.write_text(json.dumps(running))
        os.chown(summary, uid, uid)
    # One of them runs such a job: its liveness lock, an exclusive flock of theirs.
    job = an_older_gpuwaits_job(directory / "alive.4510", 4510)
    try:
        reads = counted(monkeypatch, linux_proc, "proc_locks")
        # They hold the others, and they alone.
        assert Ledger(directory).read().unread == {4510: "it is not there"}
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    assert len(reads) <= 2, len(reads)


@pytest.mark.skipif(os.geteuid() != 0, reason="makes directories and files of other users'")
def test_the_members_whose_files_are_gone_cost_one_listing_of_the_directory_a_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Forty members left, root removing their files (their lock directories stay), and
    # another member made 20,000 names in the directory. Within 30 s of any write there (on a
    # busy server, always), each read of the ledger by every waiter listed the whole
    # directory once for each of them, to find a summary of theirs beside the name another
    # member may have taken: 0.4 s of CPU a read. It lists it once for them all now.
    directory = members_who_left(tmp_path, monkeypatch, 4600)
    for n in range(20_000):
        (directory / f"x.{n}").touch()
    # One of them had a summary of theirs made beside the name another member took, and a job
    # of an older gpuwait's runs (an exclusive flock of theirs): they hold the others.
    (directory / "wake.4610.json").write_text("{}")
    beside = directory / "wake.4610.00ff.json"
    beside.write_text(json.dumps({"schema": 1, "release": 1, "running": ["a"], "waiting": []}))
    os.chown(beside, 4610, 4610)
    job = an_older_gpuwaits_job(directory / "alive.4610", 4610)
    (directory / "ledger.4599.json").write_text("{}")  # a write there just now
    try:
        listings = counted(monkeypatch, os, "listdir")
        assert Ledger(directory).read().unread == {4610: "it is not there"}
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    of_it = [args for args in listings if args and str(args[0]) == str(directory)]
    assert len(of_it) <= 1, len(of_it)


class MonotonicOn:
    """The time module as a module of gpuwait's sees it, its monotonic clock `offset` seconds
    on from the machine's."""

    def __init__(self, offset: float) -> None:
        self.offset = offset

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    def monotonic(self) -> float:
        return time.monotonic() + self.offset


@pytest.mark.skipif(os.geteuid() != 0, reason="makes directories of other users'")
def test_the_members_whose_files_are_gone_cost_nothing_once_they_hold_a_waiter_no_longer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Forty members left, root removing their files (their lock directories stay). A waiter
    # that found them gone 30 s ago is held for none of them any longer, whatever is written
    # in the directory meanwhile; yet at each of its reads within 30 s of the directory's last
    # change (on a busy server, every read) it read /proc/locks, the mount table and the
    # whole directory to learn whether a job of theirs runs, an answer it no longer uses. It
    # asks nothing of them now.
    from gpuwait.linux import proc as linux_proc
    from gpuwait.queue import ledger as module

    directory = members_who_left(tmp_path, monkeypatch, 4700)
    reads = counted(monkeypatch, linux_proc, "proc_locks")
    # A job of one of them holds its lock (here root's: the test's directories are closed to
    # them): it holds the waiter, for 30 s.
    job = os.open(directory / "alive.4710", os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(job, fcntl.LOCK_SH)
        waiter = Ledger(directory)
        assert waiter.read().unread == {4710: "it is not there"}
        monkeypatch.setattr(module, "time", MonotonicOn(module.UNREAD_GRACE + 1))
        (directory / "ledger.4699.json").write_text("{}")  # another write there
        module._HOLDS_A_LOCK.clear()  # the answer of a second ago no longer stands
        reads.clear()
        assert waiter.read().unread == {}
    finally:
        os.close(job)
    assert reads == [], len(reads)


@pytest.mark.skipif(os.geteuid() != 0, reason="makes files and a directory of another user's")
def test_a_members_summary_of_megabytes_left_as_it_is_is_parsed_once_for_their_file_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A member whose ledger file is gone and whose lock directory no job of theirs holds left
    # a summary of 4 MB, 200,000 ids of running jobs in it (under the 4 MiB a summary may
    # have): whether it lists a job of theirs running (an older gpuwait's job holds no lock on
    # that directory) was asked again each second at every read within 30 s of the
    # directory's last change (on a busy server, always), by every waiter, and the summary
    # parsed again each time, 40 ms of CPU a second each. It is parsed once while it stays
    # as it is.
    from gpuwait.linux import security
    from gpuwait.queue import ledger as module
    from gpuwait.queue import wake

    monkeypatch.setattr(security, "_RUNS_GPUWAIT", {})  # no look of another test's
    monkeypatch.setattr(module, "_HOLDS_A_LOCK", {})
    directory = shared_dir(tmp_path)
    lock_dir = directory / "alive.4450"
    lock_dir.mkdir(mode=0o700)
    os.chown(lock_dir, 4450, 4450)
    summary = directory / "wake.4450.json"
    ids = [f"{i:016x}" for i in range(200_000)]
    summary.write_text(json.dumps({"schema": 1, "release": 1, "running": ids, "waiting": []}))
    os.chown(summary, 4450, 4450)
    waiter = Ledger(directory)
    (directory / "ledger.4449.json").write_text("{}")  # a write there just now
    assert waiter.read().unread == {}
    time.sleep(2.1)  # the summary left as it is, past a coarse clock's tick
    parsed = counted(monkeypatch, wake, "read_summary")
    (directory / "ledger.4449.json").write_text("{}")  # another write there
    for _ in range(5):
        module._HOLDS_A_LOCK.clear()  # the answer of a second ago no longer stands
        assert waiter.read().unread == {}
    assert len(parsed) == 1, len(parsed)


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a file and a process of another user's")
def test_a_write_that_took_a_minute_by_the_clock_tells_nothing_of_the_file_servers_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A waiter's write of its own file took 70 s by this machine's clock (the file server not
    # answering for a minute, the process frozen or the machine suspended meanwhile, the clock
    # stepped): its change time, anywhere in those 70 s, was taken for the middle of them, the
    # server's clock for 35 s off, and a member's file emptied just now, while their gpuwait
    # runs, for one left so for 35 s: the waiter was admitted into the room their jobs hold.
    # Such a write tells nothing of the server's clock now, and the waiter is held.
    from gpuwait.queue import ledger as module

    clock = ClockOff(-70.0)  # this process's clock as the write began, against its end
    write_atomic = module.write_atomic

    def slow(*args: Any, **kwargs: Any) -> None:
        write_atomic(*args, **kwargs)
        clock.offset = 0.0

    monkeypatch.setattr(module, "time", clock)
    monkeypatch.setattr(module, "write_atomic", slow)
    monkeypatch.setattr(module, "_AHEAD", {})
    directory, _ = others_file(tmp_path, DAMAGE["truncated"])
    ledger = Ledger(directory)
    with their_gpuwait_runs():
        waiter = lifecycle.submit(
            ledger, live_job("w", request={"bytes": 2**30}), [], [], tmp_path, ["x"]
        )
        monkeypatch.setattr(module, "write_atomic", write_atomic)
        _, held = lifecycle.admit(ledger, waiter, ONE_CARD, 0.99)
        assert isinstance(held, WaitReason) and "uid 4242" in (held.blocked or ""), held
