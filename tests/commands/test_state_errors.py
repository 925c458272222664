"""A full disk and a read-only state dir: the policy decides whether the command runs, and
nothing is ever half-written.

Policy: the ledger unwritable -> exit 5 with one clear message, unless on_state_error = "run"
(the command then runs at once, uncoordinated, after one warning); the history unwritable -> the
command runs and its status stands, one warning says the record is lost.

Real file systems are used where the tests run as root (a 64 KiB tmpfs, remounted read-only);
elsewhere the same errors are injected.
"""

from __future__ import annotations

import errno
import json
import math
import os
import pwd
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO
from helpers.fixtures_sim import Run
from helpers.jobs import live_job

from gpuwait.cli import main
from gpuwait.core.errors import StateError
from gpuwait.history import store
from gpuwait.history.learn import save_record
from gpuwait.history.store import append_record
from gpuwait.linux import atomic
from gpuwait.queue.ledger import Ledger


@pytest.fixture
def gw(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, run_gpuwait: Run) -> Run:
    sim = tmp_path / "sim.toml"
    assert main(["sim", "init", str(sim), "--gpus", "1", "--memory", "24GiB"]) == 0
    monkeypatch.setenv("GPUWAIT_SIM", str(sim))
    return run_gpuwait


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs mounted for the test (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount_point = tmp_path / "tiny"
    mount_point.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(mount_point)],
        capture_output=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def fill(directory: Path) -> None:
    """Fill the file system that holds `directory` to the last byte."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        size = 4096
        while size:
            try:
                os.write(fd, b"\0" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                size //= 2
    finally:
        os.close(fd)


def no_temp_files(directory: Path) -> None:
    assert [p.name for p in directory.iterdir() if p.name.endswith(".tmp")] == []


def test_full_disk_refuses_with_exit_5_and_keeps_the_ledger(gw: Run, tiny_fs: Path) -> None:
    ledger = Ledger(tiny_fs)
    with ledger.transaction() as data:
        data.jobs.append(live_job("holder"))
    before = ledger.path.read_bytes()
    fill(tiny_fs)
    env = {"GPUWAIT_STATE_DIR": str(tiny_fs)}
    done = gw("--vram", "1G", "--", "echo", "ran", env=env)
    assert done.returncode == 5, done.stderr
    assert "No space left on device" in done.stderr and done.stdout == ""
    assert done.stderr.startswith("gpuwait: error:") and "Traceback" not in done.stderr
    assert ledger.path.read_bytes() == before
    no_temp_files(tiny_fs)
    # The policy may say: run anyway.
    done = gw("--vram", "1G", "--", "echo", "ran", env={**env, "GPUWAIT_ON_STATE_ERROR": "run"})
    assert done.returncode == 0 and done.stdout == "ran\n"
    assert len(done.stderr.splitlines()) == 1 and "on_state_error = run" in done.stderr
    assert ledger.path.read_bytes() == before


def test_full_disk_for_the_history_only_loses_the_record(
    gw: Run, tiny_fs: Path, tmp_path: Path
) -> None:
    ledger_dir = tmp_path / "ledger"
    ledger_dir.mkdir(mode=0o700)
    history = tiny_fs / "history.jsonl"
    # Records that end a few bytes short of a page: the next record can only half fit.
    record = json.dumps({"schema": 1, "job_id": "x" * 60}) + "\n"
    history.write_text(record * ((4096 - 40) // len(record)))
    before = history.read_bytes()
    fill(tiny_fs)
    env = {"GPUWAIT_STATE_DIR": str(tiny_fs), "GPUWAIT_LEDGER_DIR": str(ledger_dir)}
    done = gw("--vram", "1G", "--", "sh", "-c", "echo ran; exit 3", env=env)
    assert done.returncode == 3 and done.stdout == "ran\n"
    assert "could not record the run in the history" in done.stderr
    assert history.read_bytes() == before
    no_temp_files(tiny_fs)


def test_a_history_too_big_to_compact_on_a_full_disk_keeps_the_record_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    history = tmp_path / "history.jsonl"
    record = json.dumps({"schema": 1, "job_id": "x" * 60}) + "\n"
    history.write_text(record * (2**20 // len(record) + 1))  # past a 1 MiB limit
    # The record fits; the compacted history, written beside the old one, does not.
    monkeypatch.setattr(store, "write_atomic", _enospc)
    warnings = save_record(tmp_path, {"schema": 1, "job_id": "new"}, 2**20)
    assert history.read_text().endswith('{"job_id":"new","schema":1}\n')
    said = " ".join(warnings)
    assert "could not be compacted" in said and "No space left on device" in said, warnings
    assert "recorded" in said, warnings


def test_an_event_cut_short_by_a_full_disk_does_not_swallow_the_next(gw: Run) -> None:
    state = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait"
    state.mkdir(mode=0o700)
    # The disk filled up in the middle of an event; space was made since.
    (state / "events.jsonl").write_text('{"kind":"finish","schema":1,"time":1.0,"jo')
    assert gw("--vram", "1G", "--name", "next", "--", "true").returncode == 0
    log = gw("log", "--json")
    kinds = [json.loads(line)["kind"] for line in log.stdout.splitlines()]
    assert kinds[:2] == ["submit", "admit"], log.stdout


def test_read_only_state_dir(gw: Run, tiny_fs: Path) -> None:
    ledger = Ledger(tiny_fs)
    with ledger.transaction() as data:
        data.jobs.append(live_job("holder"))
    before = ledger.path.read_bytes()
    remount = subprocess.run(["mount", "-o", "remount,ro", str(tiny_fs)], capture_output=True)
    if remount.returncode != 0:
        pytest.skip("cannot remount read-only here")
    env = {"GPUWAIT_STATE_DIR": str(tiny_fs)}
    done = gw("--vram", "1G", "--", "echo", "ran", env=env)
    assert done.returncode == 5 and "Read-only file system" in done.stderr, done.stderr
    done = gw("--vram", "1G", "--", "echo", "ran", env={**env, "GPUWAIT_ON_STATE_ERROR": "run"})
    assert done.returncode == 0 and done.stdout == "ran\n"
    assert ledger.path.read_bytes() == before
    # A state dir that cannot even be created there.
    done = gw("--vram", "1G", "true", env={"GPUWAIT_STATE_DIR": str(tiny_fs / "new")})
    assert done.returncode == 5 and "Read-only file system" in done.stderr


#: gpuwait on a file system that takes no locks: an NFS mount whose lock daemon does not answer
#: says ENOLCK ("No locks available") to every flock(2).
NO_LOCKS = """
import errno, fcntl, sys
def flock(fd, operation):
    raise OSError(errno.ENOLCK, "No locks available")
fcntl.flock = flock
from gpuwait.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_file_system_that_takes_no_locks_is_refused_in_one_line(gw: Run) -> None:
    no_locks = [sys.executable, "-c", NO_LOCKS, "--vram", "1G", "--", "echo", "ran"]
    done = subprocess.run(no_locks, capture_output=True, text=True, timeout=60)
    assert done.returncode == 5, done.stderr
    assert done.stderr.startswith("gpuwait: error: ") and "No locks available" in done.stderr
    assert "Traceback" not in done.stderr
    env = {**os.environ, "GPUWAIT_ON_STATE_ERROR": "run"}
    done = subprocess.run(no_locks, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0 and done.stdout == "ran\n", done.stderr


def _enospc(*args: object, **kw: object) -> int:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_injected_full_disk_private_ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ledger = Ledger(tmp_path)
    with ledger.transaction() as data:
        data.jobs.append(live_job("a"))
    before = ledger.path.read_bytes()
    monkeypatch.setattr(atomic.os, "fsync", _enospc)
    with pytest.raises(StateError, match="No space left"), ledger.transaction() as data:
        data.jobs.append(live_job("b"))
    assert ledger.path.read_bytes() == before
    no_temp_files(tmp_path)


def test_injected_full_disk_shared_ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1770)
    ledger = Ledger(shared)
    with ledger.transaction() as data:
        data.jobs.append(live_job("a"))
    # Each user's own file in a shared directory is replaced by rename, as a private one is.
    before = ledger.path.read_bytes()
    monkeypatch.setattr(atomic.os, "fsync", _enospc)
    with pytest.raises(StateError, match="No space left"), ledger.transaction() as data:
        data.jobs.append(live_job("b" * 100))
    assert ledger.path.read_bytes() == before
    no_temp_files(shared)


def test_injected_short_write_leaves_no_half_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    append_record(tmp_path, {"job_id": "a"})
    before = (tmp_path / "history.jsonl").read_bytes()
    real_write = os.write

    def short_write(fd: int, data: bytes) -> int:
        return real_write(fd, data[:7])  # a full disk took only 7 bytes

    monkeypatch.setattr("gpuwait.linux.atomic.os.write", short_write)
    with pytest.raises(OSError, match="No space"):
        append_record(tmp_path, {"job_id": "b"})
    assert (tmp_path / "history.jsonl").read_bytes() == before


@pytest.mark.parametrize("moment", [1e300, -1e300, 1e18, float("nan")])
def test_a_moment_no_clock_can_show_is_shown_as_unknown(gw: Run, moment: float) -> None:
    # A history record or an event whose time no calendar holds (a damaged or edited file):
    # `history` and `log` show "?" for it and the rest as ever, never a traceback.
    assert gw("--vram", "1G", "--", "true").returncode == 0
    state = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait"
    history = state / "history.jsonl"
    record = json.loads(history.read_text().splitlines()[-1])
    history.write_text(json.dumps({**record, "started_at": moment}) + "\n")
    events = state / "events.jsonl"
    event = json.loads(events.read_text().splitlines()[-1])
    with events.open("a") as f:
        f.write(json.dumps({**event, "time": moment}) + "\n")
    for args in (["history"], ["history", "--all"], ["log"], ["log", "-n", "1"]):
        done = gw(*args)
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr
        lines = done.stdout.splitlines()
        if args[0] == "log":
            assert lines[-1].startswith("? "), done.stdout
        elif math.isfinite(moment):  # NaN: the history's reader skips the record as damaged
            assert lines[1].startswith("? "), done.stdout


@pytest.fixture
def users_machine() -> Iterator[tuple[Path, Path]]:
    """A directory every user may enter, and a simulated GPU of root's in it that all may read."""
    from helpers.users import shared_root

    root = shared_root()
    try:
        sim = root / "sim.toml"
        sim.write_text('[[gpu]]\nmemory = "24GiB"\n')
        sim.chmod(0o644)
        yield root, sim
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_an_unreadable_ledger_or_config_says_how_to_make_it_readable(
    users_machine: tuple[Path, Path],
) -> None:
    # Made unreadable (chmod 000): the hint is to give it its mode back, not to remove the
    # ledger (and the queue in it) first.
    from helpers.users import run_as, user_home

    alice = 47211
    root, sim = users_machine
    env = {"PATH": "/usr/bin:/bin", "GPUWAIT_SIM": str(sim), **user_home(root, alice, alice)}
    args = ["--vram", "1G", "--", "true"]
    assert run_as(alice, alice, [], args, env).returncode == 0
    ledger = Path(env["XDG_STATE_HOME"]) / "gpuwait" / "ledger.json"
    ledger.chmod(0)
    done = run_as(alice, alice, [], args, env)
    assert done.returncode == 5, done.stderr
    assert f"chmod u+rw {ledger}" in done.stderr and "Traceback" not in done.stderr
    ledger.chmod(0o600)
    config = Path(env["XDG_CONFIG_HOME"]) / "gpuwait" / "config.toml"
    config.parent.mkdir()
    os.chown(config.parent, alice, alice)
    config.write_text("safety = 0.8\n")
    os.chown(config, alice, alice)
    config.chmod(0)
    done = run_as(alice, alice, [], args, env)
    assert done.returncode == 2, done.stderr
    assert f"chmod u+r {config}" in done.stderr and "Traceback" not in done.stderr


def test_a_home_that_is_not_yours_is_no_config_file_and_one_taken_over_is_named(
    users_machine: tuple[Path, Path],
) -> None:
    """`docker run --user` in an image whose HOME is /root, an old `sudo -u`: HOME is a
    directory of another user that keeps this one out. With a state dir of the user's own (as
    docs say for containers), the command runs: there is no config file of theirs to read. A
    `~/.config` of root's in the user's own home (made by a program run as root with their
    HOME) is named, with the `sudo chown` that gives it back, not a `chmod` they cannot run."""
    from helpers.users import run_as, user_home

    alice = 47212
    root, sim = users_machine
    own = user_home(root, alice, alice)
    foreign = root / "foreign-home"
    (foreign / ".config" / "gpuwait").mkdir(parents=True)
    foreign.chmod(0o700)
    env = {
        "PATH": "/usr/bin:/bin",
        "GPUWAIT_SIM": str(sim),
        "PYTHONPATH": own["PYTHONPATH"],
        "HOME": str(foreign),
        "GPUWAIT_STATE_DIR": own["XDG_STATE_HOME"],
    }
    args = ["--vram", "1G", "--", "sh", "-c", "echo ran"]
    done = run_as(alice, alice, [], args, env)
    assert (done.returncode, done.stdout) == (0, "ran\n"), done.stderr
    config_dir = Path(own["HOME"]) / ".config"
    config_dir.mkdir(mode=0o700)  # root's
    done = run_as(alice, alice, [], args, {**env, "HOME": own["HOME"]})
    assert done.returncode == 2, done.stderr
    assert f"{config_dir} belongs to root" in done.stderr, done.stderr
    assert f"`sudo chown -R {alice} {config_dir}` gives it back" in done.stderr, done.stderr
    assert "chmod u+r" not in done.stderr and "Traceback" not in done.stderr
    # A ~/.config of the user's own that keeps them out (chmod 000) is theirs to open again:
    # their config file is not silently left unread.
    os.chown(config_dir, alice, alice)
    config_dir.chmod(0)
    done = run_as(alice, alice, [], args, {**env, "HOME": own["HOME"]})
    assert done.returncode == 2, done.stderr
    assert "cannot be read: Permission denied" in done.stderr, done.stderr


def test_a_config_file_named_in_a_directory_shut_to_the_user_is_refused_not_skipped(
    users_machine: tuple[Path, Path],
) -> None:
    # GPUWAIT_CONFIG naming a file behind a directory that keeps the user out ended every
    # command in a traceback (PermissionError) from the check that it exists; read as the
    # usual file would be, in a home not theirs, it would be skipped without a word instead.
    from helpers.users import run_as, user_home

    alice = 47213
    root, sim = users_machine
    shut = root / "shut"
    shut.mkdir(mode=0o700)  # root's
    (shut / "config.toml").write_text("safety = 0.8\n")
    env = {"PATH": "/usr/bin:/bin", "GPUWAIT_SIM": str(sim), **user_home(root, alice, alice)}
    env["GPUWAIT_CONFIG"] = str(shut / "config.toml")
    done = run_as(alice, alice, [], ["--vram", "1G", "--", "sh", "-c", "echo ran"], env)
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert "cannot be looked up: Permission denied" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_a_user_with_no_home_at_all_runs_with_the_state_dir_it_names(
    users_machine: tuple[Path, Path],
) -> None:
    """A uid with no entry in the password file and no HOME (`env -i` in a container run as an
    arbitrary uid, as OpenShift does): it has no config file, and with GPUWAIT_STATE_DIR the
    command runs; without one, it is told what to set."""
    from helpers.users import run_as

    nobody_known = 47213
    root, sim = users_machine
    state = root / "state"
    state.mkdir(mode=0o700)
    os.chown(state, nobody_known, nobody_known)
    env = {"PATH": "/usr/bin:/bin", "GPUWAIT_SIM": str(sim), "PYTHONPATH": str(REPO)}
    args = ["--vram", "1G", "--", "sh", "-c", "echo ran"]
    done = run_as(nobody_known, nobody_known, [], args, {**env, "GPUWAIT_STATE_DIR": str(state)})
    assert (done.returncode, done.stdout) == (0, "ran\n"), done.stderr
    done = run_as(
        nobody_known, nobody_known, [], ["config"], {**env, "GPUWAIT_STATE_DIR": str(state)}
    )
    assert done.returncode == 0, done.stderr
    assert "config file: (none: no home directory)" in done.stdout, done.stdout
    done = run_as(nobody_known, nobody_known, [], args, env)
    assert (done.returncode, done.stdout) == (5, ""), done.stderr
    assert "cannot tell your home directory" in done.stderr
    assert "GPUWAIT_STATE_DIR" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("command", [["history"], ["estimate", "--", "python", "x.py"], ["log"]])
def test_a_history_or_event_log_gpuwait_refuses_says_what_to_do(
    gw: Run, tmp_path: Path, command: list[str]
) -> None:
    # `gpuwait history` of a history that is a directory (or a link, another user's file), or
    # in a state dir that is a file, said only that it could not be read: no word of what to
    # do, where the ledger's own error says how to get it back.
    state = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait"
    state.mkdir(mode=0o700)
    name = "events.jsonl" if command == ["log"] else "history.jsonl"
    (state / name).mkdir()
    done = gw(*command)
    assert done.returncode == 5, done.stderr
    (error, hint) = done.stderr.splitlines()
    assert error.startswith("gpuwait: error: ") and str(state / name) in error
    assert hint == f"gpuwait: hint: move it out of the way: mv {state / name} {state / name}.old"

    if os.geteuid() == 0:  # a history of the user's that `sudo gpuwait` made root's
        (state / name).rmdir()
        (state / name).write_text("")
        os.chown(state / name, 4321, 4321)
        (error, hint) = gw(*command).stderr.splitlines()
        user = pwd.getpwuid(os.getuid()).pw_name
        assert hint == f"gpuwait: hint: make it yours again: sudo chown {user} {state / name}"

    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")
    done = gw(*command, env={"GPUWAIT_STATE_DIR": str(not_a_dir)})
    assert done.returncode == 5, done.stderr
    assert done.stderr.splitlines()[-1].startswith("gpuwait: hint: set GPUWAIT_STATE_DIR"), (
        done.stderr
    )
