"""Every state file is read as one that anybody may have put there: a FIFO, a device, a link or
a file far too large in its place makes no command hang or read without end, and each refusal
is one line with its documented exit code. TERM and Ctrl-C end a gpuwait whatever it waits on.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO
from helpers.fixtures_sim import Run
from helpers.users import can_switch_users, run_as, shared_root, user_home
from helpers.waiting import asleep_waiting, ledger_entries, wait_for

COMMANDS: dict[str, tuple[str, ...]] = {
    "run": ("--vram", "1G", "--", "true"),
    "status": ("status",),
    "log": ("log",),
    "history": ("history",),
    "estimate": ("estimate", "--", "true"),
    "config": ("config",),
}

#: What each command exits with when the file is not a plain file: the documented codes
#: (docs/exit-codes.md). A command the file does not concern goes on with 0.
EXPECTED: dict[str, dict[str, int]] = {
    # The ledger and its lock: 5 for every command that uses them.
    "ledger.json": {"run": 5, "status": 5, "log": 5},
    "ledger.lock": {"run": 5},
    # A wake-up summary that is not one only costs wake-ups: it is replaced.
    "wake.json": {},
    # The event log: `log` refuses it (5); writing an event never fails a job.
    "events.jsonl": {"log": 5},
    # The history: `history` and `estimate` refuse it (5); a run goes on without it.
    "history.jsonl": {"history": 5, "estimate": 5},
    "history.lock": {},
    # The config file is refused by everything (2), the simulation file by `status` (4), and
    # a run, with on_no_gpu = "run" (the default), runs its command unwaited after a warning.
    "config.toml": dict.fromkeys(COMMANDS, 2),
    "sim.toml": {"status": 4},
}
#: The same for a plain file far too large: a damaged ledger or history is recovered (with
#: a warning, the evidence kept); a config or simulation file is refused as above.
EXPECTED_LARGE: dict[str, dict[str, int]] = {
    "ledger.json": {},
    "history.jsonl": {},
    "config.toml": EXPECTED["config.toml"],
    "sim.toml": EXPECTED["sim.toml"],
}


def state_dir() -> Path:
    return Path(os.environ["XDG_STATE_HOME"]) / "gpuwait"


def placed(name: str, sim: Path) -> Path:
    if name == "config.toml":
        path = Path(os.environ["XDG_CONFIG_HOME"]) / "gpuwait" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        return path
    return sim if name == "sim.toml" else state_dir() / name


def put(path: Path, kind: str) -> None:
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "/dev/zero":
        path.symlink_to("/dev/zero")
    else:  # a file far larger than any state file may be (sparse: it costs no disk)
        with open(path, "wb") as f:
            f.truncate(4 << 30)


def one_line(stderr: str) -> None:
    """gpuwait's own words: an error (and at most a hint) or warnings, never a traceback."""
    assert "Traceback" not in stderr, stderr
    for line in stderr.splitlines():
        assert line.startswith("gpuwait: "), stderr


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "4 GiB"])
@pytest.mark.parametrize("name", list(EXPECTED))
def test_nothing_in_place_of_a_state_file_hangs_a_command(
    sim: Path, run_gpuwait: Run, name: str, kind: str
) -> None:
    # A run first, so that every state file exists and the index is up to date.
    assert run_gpuwait("--vram", "1G", "--", "true").returncode == 0
    expected = EXPECTED_LARGE.get(name) if kind == "4 GiB" else EXPECTED[name]
    if expected is None:
        pytest.skip("a lock, a summary or a log of any size is a plain file that works")
    put(placed(name, sim), kind)
    for command, args in COMMANDS.items():
        started = time.monotonic()
        done = run_gpuwait(*args)
        took = time.monotonic() - started
        assert done.returncode == expected.get(command, 0), (command, done.stderr)
        one_line(done.stderr)
        assert took < 10, (command, took)


def test_a_refusal_says_what_is_wrong_with_which_file(sim: Path, run_gpuwait: Run) -> None:
    assert run_gpuwait("--vram", "1G", "--", "true").returncode == 0
    history = state_dir() / "history.jsonl"
    put(history, "fifo")
    done = run_gpuwait("history")
    assert done.stderr.splitlines()[0] == (
        f"gpuwait: error: history {history} cannot be read: {history} is not a plain file "
        "(a FIFO, device or socket); gpuwait refuses it"
    )
    config = placed("config.toml", sim)
    put(config, "/dev/zero")
    done = run_gpuwait("config")
    assert done.returncode == 2
    assert f"config file {config} is not a plain file" in done.stderr.splitlines()[0]


def test_a_link_in_place_of_the_history_lock_creates_nothing(
    sim: Path, run_gpuwait: Run, tmp_path: Path
) -> None:
    state_dir().mkdir(mode=0o700)
    target = tmp_path / "made-by-the-link"
    (state_dir() / "history.lock").symlink_to(target)
    done = run_gpuwait("--vram", "1G", "--", "echo", "ran")
    assert done.returncode == 0 and done.stdout == "ran\n"
    assert "history.lock is a symlink" in done.stderr
    assert not target.exists()


def test_a_config_file_linked_from_elsewhere_by_its_user_is_read(
    sim: Path, run_gpuwait: Run, tmp_path: Path
) -> None:
    # Dotfiles kept in a repository and linked into place.
    kept = tmp_path / "dotfiles" / "gpuwait.toml"
    kept.parent.mkdir()
    kept.write_text('default_vram = "3G"\n')
    placed("config.toml", sim).symlink_to(kept)
    done = run_gpuwait("config")
    assert done.returncode == 0, done.stderr
    assert "3.0 GiB" in done.stdout or "3G" in done.stdout, done.stdout


@pytest.mark.skipif(not can_switch_users(), reason="runs gpuwait as another user: needs root")
@pytest.mark.parametrize(
    ("name", "command", "code"),
    [("config.toml", "config", 2), ("sim.toml", "status", 4), ("history.jsonl", "history", 5)],
)
def test_a_state_file_of_another_user_is_refused(name: str, command: str, code: int) -> None:
    uid, other = 47231, 47232
    root = shared_root()
    try:
        env = {**user_home(root, uid, uid), "PATH": "/usr/bin:/bin"}
        env["GPUWAIT_SIM"] = str(root / "sim.toml")
        (root / "sim.toml").write_text('[[gpu]]\nmemory = "24GiB"\n')
        os.chown(root / "sim.toml", uid, uid)
        path = {
            "config.toml": Path(env["XDG_CONFIG_HOME"]) / "gpuwait" / name,
            "sim.toml": root / "sim.toml",
            "history.jsonl": Path(env["XDG_STATE_HOME"]) / "gpuwait" / name,
        }[name]
        for directory in (path.parent,):
            directory.mkdir(mode=0o700, exist_ok=True)
            os.chown(directory, uid, uid)
        assert run_as(uid, uid, [], ["--vram", "1G", "--", "true"], env).returncode == 0
        # Someone else's file where the user's own should be (root put it there, say).
        path.write_text(path.read_text() if path.exists() else "")
        os.chown(path, other, other)
        path.chmod(0o644)
        done = run_as(uid, uid, [], [command], env)
        assert done.returncode == code, done.stderr
        assert f"belongs to another user (uid {other})" in done.stderr
        one_line(done.stderr)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.skipif(not can_switch_users(), reason="runs gpuwait as another user: needs root")
def test_a_state_dir_root_made_in_a_users_home_is_named_with_the_way_back() -> None:
    # An earlier `sudo -E gpuwait` made ~/.local/state/gpuwait root's, 0700, ~/.local with it.
    uid = 47233
    root = shared_root()
    try:
        home = root / "home"
        home.mkdir(mode=0o755)
        os.chown(home, uid, uid)
        (home / ".local" / "state" / "gpuwait").mkdir(mode=0o700, parents=True)
        (home / ".local").chmod(0o700)
        env = {"HOME": str(home), "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
        env["GPUWAIT_SIM"] = str(root / "sim.toml")
        (root / "sim.toml").write_text('[[gpu]]\nmemory = "24GiB"\n')
        done = run_as(uid, uid, [], ["--vram", "1G", "--", "true"], env)
        assert done.returncode == 5, done.stderr
        assert f"{home / '.local'} belongs to root" in done.stderr, done.stderr
        assert f"chown -R {uid} {home / '.local'}" in done.stderr, done.stderr
    finally:
        shutil.rmtree(root, ignore_errors=True)


# --- signals end a gpuwait whatever it waits on ----------------------------------------------


def _blocked_on_a_lock(pid: int) -> bool:
    """Process `pid` sleeps in the kernel waiting for a file lock."""
    try:
        return "lock_inode_wait" in Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        return False


def hold(procs: Callable[..., subprocess.Popen[Any]], lock: Path, seconds: float = 120) -> None:
    """Another process takes `lock` and keeps it for `seconds` (`flock LOCK sleep SECONDS`)."""
    lock.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    lock.touch(mode=0o600)
    holder = procs(["flock", str(lock), "sleep", str(seconds)])
    wait_for(lambda: any(p.name == "sleep" for p in _children(holder.pid)))


def _children(pid: int) -> list[Path]:
    try:
        found = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    return [Path(Path(f"/proc/{child}/comm").read_text().strip()) for child in found]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_ends_a_gpuwait_that_waits_for_the_ledger_lock(
    sim: Path, gpuwait_cmd: list[str], procs: Callable[..., subprocess.Popen[Any]], signum: int
) -> None:
    hold(procs, state_dir() / "ledger.lock")
    job = procs([*gpuwait_cmd, "--vram", "1G", "--", "echo", "ran"])
    wait_for(lambda: _blocked_on_a_lock(job.pid), message="gpuwait never waited for the lock")
    started = time.monotonic()
    job.send_signal(signum)
    out, err = job.communicate(timeout=10)
    # Within a tick of the lock wait, not after lock_timeout (60 s).
    assert time.monotonic() - started < 3
    assert job.returncode in (-signum, 128 + signum), err
    assert out == "" and "Traceback" not in err


def test_a_signal_ends_a_waiter_whose_ledger_lock_is_held(
    sim: Path, gpuwait_cmd: list[str], procs: Callable[..., subprocess.Popen[Any]]
) -> None:
    # Someone takes the ledger lock and keeps it; the first job is killed outright, and the
    # waiter, seeing its entry dead, plans under the lock it cannot have.
    first, waiter = _a_waiter_behind_a_full_gpu(gpuwait_cmd, procs)
    hold(procs, state_dir() / "ledger.lock")
    os.killpg(first.pid, signal.SIGKILL)
    wait_for(lambda: _blocked_on_a_lock(waiter.pid), timeout=20)
    started = time.monotonic()
    waiter.send_signal(signal.SIGTERM)
    out, err = waiter.communicate(timeout=10)
    assert time.monotonic() - started < 3
    assert waiter.returncode == -signal.SIGTERM, err  # ended by it, as bare
    assert out == "" and "Traceback" not in err


def test_a_signal_ends_a_gpuwait_that_waits_to_record_its_run(
    sim: Path, gpuwait_cmd: list[str], procs: Callable[..., subprocess.Popen[Any]], tmp_path: Path
) -> None:
    hold(procs, state_dir() / "history.lock")
    ran = tmp_path / "ran"
    job = procs([*gpuwait_cmd, "--vram", "1G", "--", "sh", "-c", f"echo ran; touch {ran}"])
    # The command runs; then gpuwait waits to record the run in the history. TERM ends it
    # there (by the signal: its command is over, nothing is left to pass it to).
    wait_for(lambda: ran.exists() and _blocked_on_a_lock(job.pid))
    started = time.monotonic()
    job.send_signal(signal.SIGTERM)
    out, err = job.communicate(timeout=10)
    assert time.monotonic() - started < 3
    assert out == "ran\n", err
    assert job.returncode == -signal.SIGTERM, err
    assert "Traceback" not in err


def _a_waiter_behind_a_full_gpu(
    gpuwait_cmd: list[str], procs: Callable[..., subprocess.Popen[Any]]
) -> tuple[subprocess.Popen[Any], subprocess.Popen[Any]]:
    """A job that fills GPU 0, and a second job for GPU 0 asleep waiting for it."""
    first = procs([*gpuwait_cmd, "--vram", "20G", "--devices", "0", "--", "sleep", "60"])
    wait_for(lambda: any(e["state"] == "running" for e in ledger_entries()))
    waiter = procs([*gpuwait_cmd, "--vram", "20G", "--devices", "0", "--", "echo", "ran"])
    wait_for(lambda: asleep_waiting(waiter.pid))
    return first, waiter


def test_a_waiter_ended_by_a_signal_takes_its_entry_out_past_a_neighbours_lock(
    sim: Path, gpuwait_cmd: list[str], procs: Callable[..., subprocess.Popen[Any]]
) -> None:
    # scancel, systemctl stop or Ctrl-C on `make -j` ends every gpuwait at once: each takes its
    # entry out under the ledger lock, so most find it held for a moment. A signal gives up a
    # lock held for long, not one held for the length of a neighbour's transaction.
    first, waiter = _a_waiter_behind_a_full_gpu(gpuwait_cmd, procs)
    hold(procs, state_dir() / "ledger.lock", 0.3)
    waiter.send_signal(signal.SIGTERM)
    _, err = waiter.communicate(timeout=10)
    assert waiter.returncode == -signal.SIGTERM, err
    assert [e["pid"] for e in ledger_entries()] == [first.pid]


def test_a_job_ended_by_a_signal_takes_its_entry_out_past_a_neighbours_lock(
    sim: Path, gpuwait_cmd: list[str], procs: Callable[..., subprocess.Popen[Any]], tmp_path: Path
) -> None:
    ran = tmp_path / "ran"
    job = procs([*gpuwait_cmd, "--vram", "1G", "--", "sh", "-c", f"touch {ran}; exec sleep 60"])
    # Its start recorded (child_pid), not only under way: the lock held next would hold that up.
    wait_for(lambda: ran.exists() and any(e.get("child_pid") for e in ledger_entries()))
    hold(procs, state_dir() / "ledger.lock", 0.3)
    # Slurm and systemd signal every process: the command and gpuwait both get TERM, and
    # another TERM may come while gpuwait records the end.
    command = ledger_entries()[0]["child_pid"]
    for pid in (command, job.pid):
        os.kill(pid, signal.SIGTERM)
    time.sleep(0.1)
    job.send_signal(signal.SIGTERM)
    job.communicate(timeout=10)
    assert job.returncode == -signal.SIGTERM
    assert ledger_entries() == []


def test_a_damaged_files_evidence_name_cannot_be_taken_beforehand(tmp_path: Path) -> None:
    # In a shared directory another member could make a file under a name known in advance
    # (the time and a pid are), and the sticky bit would then refuse the rename, and the
    # repair with it: the name also has random letters.
    from gpuwait.linux.atomic import damaged_name

    names = {damaged_name(tmp_path / "ledger.1000.json").name for _ in range(20)}
    assert len(names) == 20
    assert all(n.startswith("ledger.1000.json.damaged-") for n in names)
