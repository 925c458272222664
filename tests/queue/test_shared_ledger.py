"""Several users on one server: a shared ledger, fair share, limits, and hostile entries.

These run gpuwait as two unprivileged users (numeric uids, no accounts needed), so they need
root; elsewhere they are skipped.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers.users import make_shared_ledger_dir, popen_as, run_as, shared_root, user_home

from gpuwait.gpu.sim import Allocation, ensure_state_dir, load_sim_file, write_allocation
from gpuwait.linux.proc import start_time
from gpuwait.linux.security import control_refusal
from gpuwait.queue.entries import to_document
from gpuwait.queue.ledger import Ledger

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switches to other users: needs root")

GROUP = 47200
ALICE = 47201
BOB = 47202
GiB = 2**30


@dataclass
class Server:
    """A lab server: a shared ledger dir, a simulated GPU, two users and their homes."""

    root: Path
    ledger_dir: Path
    sim: Path
    site_dir: Path
    envs: dict[int, dict[str, str]]
    procs: list[subprocess.Popen[str]] = field(default_factory=list)

    def run(self, uid: int, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return run_as(uid, uid, [GROUP], args, self.envs[uid], timeout=timeout)

    def start(self, uid: int, *args: str) -> subprocess.Popen[str]:
        # A session of its own, so that the test can end gpuwait and its command together.
        proc = popen_as(uid, uid, [GROUP], args, self.envs[uid], start_new_session=True)
        self.procs.append(proc)
        return proc

    def ledger(self) -> Ledger:
        return Ledger(self.ledger_dir)

    def jobs(self) -> list[dict[str, object]]:
        return [j.__dict__ for j in self.ledger().read().jobs]

    def wait_jobs(self, count: int, state: str | None = None, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len([j for j in self.jobs() if state is None or j["state"] == state]) >= count:
                return
            time.sleep(0.02)
        raise AssertionError(f"never saw {count} {state or ''} jobs: {self.jobs()}")

    def site_config(self, text: str) -> None:
        path = self.site_dir / "gpuwait" / "config.toml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(0o644)

    def inject(self, uid: int, raw: dict[str, object]) -> None:
        """Write the ledger as `uid` would with a plain editor: in place, no lock, no checksum."""
        subprocess.run(
            ["sh", "-c", f"cat > '{self.ledger_dir / 'ledger.json'}'"],
            input=json.dumps(raw),
            text=True,
            check=True,
            user=uid,
            group=uid,
            extra_groups=[GROUP],
        )


@pytest.fixture
def server() -> Iterator[Server]:
    root = shared_root()
    ledger_dir = make_shared_ledger_dir(root, GROUP)
    sim = root / "sim.toml"
    sim.write_text('[[gpu]]\nmemory = "24GiB"\n')
    sim.chmod(0o644)
    site_dir = root / "site"
    site_dir.mkdir(mode=0o755)
    base = {
        "PATH": "/usr/bin:/bin",
        "GPUWAIT_SIM": str(sim),
        "GPUWAIT_LEDGER_DIR": str(ledger_dir),
        "XDG_CONFIG_DIRS": str(site_dir),
    }
    envs = {uid: {**base, **user_home(root, uid, uid)} for uid in (ALICE, BOB)}
    srv = Server(root, ledger_dir, sim, site_dir, envs)
    try:
        yield srv
    finally:
        for proc in srv.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        shutil.rmtree(root, ignore_errors=True)


def test_two_users_queue_through_one_shared_ledger(server: Server) -> None:
    holder = server.start(ALICE, "--vram", "15G", "--", "sleep", "2")
    server.wait_jobs(1, "running")
    # 15 GiB of the 21.6 usable are Alice's: Bob's 15 GiB must wait for her, across users.
    waiter = server.start(BOB, "--vram", "15G", "--", "sh", "-c", "echo bob ran")
    server.wait_jobs(2)
    assert {(j["uid"], j["state"]) for j in server.jobs()} == {
        (ALICE, "running"),
        (BOB, "waiting"),
    }
    assert holder.wait(timeout=30) == 0
    out, err = waiter.communicate(timeout=30)
    assert waiter.returncode == 0, err
    assert out == "bob ran\n"
    # The ledger files are the group's, 0660, whatever each user's umask; the lock cannot be
    # replaced by a member (sticky directory).
    for name in ("ledger.json", "ledger.json.journal", "ledger.lock"):
        st = (server.ledger_dir / name).stat()
        assert (oct(st.st_mode & 0o7777), st.st_gid) == ("0o660", GROUP), name
    # Nothing private to one member is left there: no event log, no file only its writer can use.
    assert not (server.ledger_dir / "events.jsonl").exists()
    for path in server.ledger_dir.iterdir():
        st = path.stat()
        assert (oct(st.st_mode & 0o7777), st.st_gid) == ("0o660", GROUP), path.name
    # Each user's history stays in their own private state dir.
    for uid in (ALICE, BOB):
        state = Path(server.envs[uid]["XDG_STATE_HOME"]) / "gpuwait"
        assert (state / "history.jsonl").stat().st_uid == uid
        assert oct(state.stat().st_mode & 0o777) == "0o700"
    assert not list(server.ledger_dir.glob("history*"))


def hold_outside_gpuwait(server: Server, n_bytes: int) -> subprocess.Popen[bytes]:
    """A process of root's that the simulated GPU shows holding `n_bytes`, visible to every
    user as NVML's figures are."""
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    config = load_sim_file(server.sim)
    directory = ensure_state_dir(config)
    directory.chmod(0o755)
    start = start_time(proc.pid) or 0
    write_allocation(directory, Allocation(proc.pid, start, config.gpus[0].uuid, n_bytes))
    (directory / f"{proc.pid}.json").chmod(0o644)
    return proc


def test_hostile_entries_from_another_user_change_nothing_they_should_not(
    server: Server,
) -> None:
    # Load outside gpuwait: 8 GiB held by a process of root's. Alice runs a 4 GiB job.
    external = hold_outside_gpuwait(server, 8 * GiB)
    server.procs.append(external)  # type: ignore[arg-type]
    job = server.start(ALICE, "--vram", "4G", "--", "sleep", "60")
    server.wait_jobs(1, "running")

    def probe(vram: str) -> subprocess.CompletedProcess[str]:
        return server.run(ALICE, "--vram", vram, "--timeout", "0.5s", "--", "true")

    # Room: 21.6 usable - 8 external - 4 reserved = 9.6 GiB.
    assert probe("10G").returncode == 124
    assert probe("9G").returncode == 0

    bob_sleep = subprocess.Popen(["sleep", "60"], user=BOB, group=BOB)
    try:
        alice_job = next(j for j in server.ledger().read().jobs if j.uid == ALICE)
        raw = json.loads((server.ledger_dir / "ledger.json").read_bytes()[0:].decode())
        raw.pop("crc", None)
        base = {
            **vars(alice_job),
            "pid": bob_sleep.pid,
            "start_time": start_time(bob_sleep.pid),
            "uid": BOB,
            "command": ["x"],
            "request": {"bytes": 1},
            "state": "waiting",
            "gpu_uuids": [],
            "reserved_bytes": 0,
            "pids": [],
            "child_pid": None,
            "started_at": None,
        }
        uuid = alice_job.gpu_uuids[0]
        raw["jobs"] += [
            # Claims Alice's job process as Bob's: forged, dropped.
            {**base, "id": "forged", "pid": alice_job.pid, "start_time": alice_job.start_time},
            # Claims the external 8 GiB as its own usage, reserving nothing, to make it look
            # like gpuwait's: it can only count that memory once more, never free it.
            {
                **base,
                "id": "claimer",
                "state": "running",
                "gpu_uuids": [uuid],
                "pids": [external.pid],
            },
            # Values out of every range, and a 10 MB string: each dropped.
            {**base, "id": "huge", "reserved_bytes": 2**70},
            {**base, "id": "negative", "request": {"bytes": -5}},
            {**base, "id": "pid", "pid": -1},
            {**base, "id": "long", "command": ["x" * 10_000_000]},
            {**base, "id": "types", "priority": "5"},
            # Valid, but with a terminal escape sequence in it.
            {**base, "id": "escape", "command": ["\x1b[2J\x1b]0;pwned\x07"]},
        ]
        server.inject(BOB, raw)

        # No room was made: 10 GiB still does not fit, 9 GiB still does.
        done = probe("10G")
        assert done.returncode == 124, done.stderr
        assert "dropped" in done.stderr and "invalid entries" in done.stderr
        assert "belongs to another user" in done.stderr
        assert "Traceback" not in done.stderr
        assert probe("9G").returncode == 0
        # Alice's reservation and her job are untouched.
        ids = {j.id: j for j in server.ledger().read().jobs}
        assert ids[alice_job.id].reserved_bytes == 4 * GiB and ids[alice_job.id].state == "running"
        assert set(ids) == {alice_job.id, "claimer", "escape"}
        status = server.run(ALICE, "status")
        assert status.returncode == 0
        assert "\x1b" not in status.stdout and "\x07" not in status.stdout
        assert job.poll() is None
    finally:
        bob_sleep.kill()
        bob_sleep.wait()


def test_a_user_controls_only_their_own_jobs(server: Server) -> None:
    alice = server.start(ALICE, "--vram", "1G", "--", "sleep", "30")
    server.wait_jobs(1, "running")
    job = server.ledger().read().jobs[0]
    assert control_refusal(job, ALICE) is None
    assert control_refusal(job, 0) is None  # root may
    refusal = control_refusal(job, BOB)
    assert refusal is not None and "only control your own" in refusal
    # The OS agrees: Bob cannot signal Alice's gpuwait.
    kill = subprocess.run(["kill", "-TERM", str(job.pid)], user=BOB, capture_output=True)
    assert kill.returncode != 0 and alice.poll() is None

    # A forged entry that names one of Bob's own processes (say his shell) under his uid must
    # not make Bob's own cancel kill that process: it is not a gpuwait process.
    bob_shell = subprocess.Popen(["sleep", "30"], user=BOB, group=BOB)
    try:
        forged = type(job)(**{**job.__dict__, "id": "bait", "uid": BOB, "pid": bob_shell.pid})
        forged.start_time = start_time(bob_shell.pid) or 0
        refusal = control_refusal(forged, BOB)
        assert refusal is not None and "not a gpuwait process" in refusal
        # And an entry under Alice's uid that names Bob's process is forged outright.
        forged.uid = ALICE
        refusal = control_refusal(forged, ALICE)
        assert refusal is not None and "forged" in refusal
    finally:
        bob_shell.kill()
        bob_shell.wait()
    alice.send_signal(signal.SIGTERM)
    alice.wait(timeout=10)


def test_per_user_gpu_limit_from_the_site_config(server: Server) -> None:
    server.sim.write_text('[[gpu]]\nmemory = "24GiB"\n' * 3)
    server.site_config("user_max_gpus = 1\n")
    first = server.start(ALICE, "--vram", "1G", "--", "sleep", "30")
    server.wait_jobs(1, "running")
    # A second GPU for Alice is over her limit, though two GPUs are idle...
    over = server.run(ALICE, "--vram", "1G", "--timeout", "1s", "--", "true")
    assert over.returncode == 124
    assert "per-user limit of 1 GPUs" in over.stderr
    # ...while Bob is not held back by Alice's use.
    assert server.run(BOB, "--vram", "1G", "--", "true").returncode == 0
    # Asking for more than the limit at once can never be granted.
    never = server.run(BOB, "--vram", "1G", "--gpus", "2", "--", "true")
    assert never.returncode == 3 and "per-user limit" in never.stderr
    # A user cannot lift the limit for themselves.
    env_try = run_as(
        ALICE,
        ALICE,
        [GROUP],
        ["--vram", "1G", "true"],
        {**server.envs[ALICE], "GPUWAIT_USER_MAX_GPUS": "8"},
    )
    assert env_try.returncode == 2 and "administrator" in env_try.stderr
    status = server.run(BOB, "status", "--json")
    users = {u["uid"]: u for u in json.loads(status.stdout)["users"]}
    assert users[ALICE]["running"] == 1 and users[ALICE]["gpus_held"] == 1
    first.kill()


@pytest.mark.parametrize("fair_share", [True, False])
def test_fair_share_puts_the_lighter_user_first(server: Server, fair_share: bool) -> None:
    if not fair_share:
        server.site_config('fair_share_half_life = "none"\n')
    # Alice has used the GPU heavily of late; Bob not at all.
    with server.ledger().transaction() as data:
        from gpuwait.queue.fairness import charge

        charge(data, ALICE, 1e15, time.time(), None)
    holder = server.start(ALICE, "--vram", "20G", "--", "sleep", "1.5")
    server.wait_jobs(1, "running")
    alice_next = server.start(ALICE, "--vram", "20G", "--", "sh", "-c", "sleep 0.5")
    server.wait_jobs(2)
    bob_next = server.start(BOB, "--vram", "20G", "--", "sh", "-c", "sleep 0.5")
    server.wait_jobs(3)
    for proc in (holder, alice_next, bob_next):
        assert proc.wait(timeout=60) == 0

    def started(uid: int) -> float:
        history = Path(server.envs[uid]["XDG_STATE_HOME"]) / "gpuwait" / "history.jsonl"
        return float(json.loads(history.read_text().splitlines()[-1])["started_at"])

    # Alice submitted first; with fair share Bob, who has used less, goes first.
    assert (started(BOB) < started(ALICE)) is fair_share


def test_an_admission_forged_by_another_user_is_not_trusted(server: Server) -> None:
    # 20 GiB of the 21.6 usable are held outside gpuwait: a 10 GiB job does not fit.
    external = hold_outside_gpuwait(server, 20 * GiB)
    server.procs.append(external)  # type: ignore[arg-type]
    waiter = server.start(ALICE, "--vram", "10G", "--", "sh", "-c", "echo started; sleep 30")
    server.wait_jobs(1, "waiting")
    uuid = load_sim_file(server.sim).gpus[0].uuid
    # Bob rewrites Alice's waiting entry as if a plan had admitted it onto the full GPU (the
    # test holds the lock meanwhile, only so that Alice's own writes cannot undo the edit).
    lock = os.open(server.ledger_dir / "ledger.lock", os.O_RDWR)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        raw = to_document(server.ledger().read())
        for entry in raw["jobs"]:
            entry.update(state="running", gpu_uuids=[uuid], reserved_bytes=10 * GiB)
        server.inject(BOB, raw)
    finally:
        os.close(lock)
    # Alice's gpuwait does not start its command on a GPU that NVML shows has no room for it:
    # it puts its entry back in the queue, and waits on.
    deadline = time.monotonic() + 20
    while server.jobs()[0]["state"] == "running" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [(j["state"], j["gpu_uuids"]) for j in server.jobs()] == [("waiting", [])]
    assert waiter.poll() is None
    waiter.send_signal(signal.SIGTERM)
    out, err = waiter.communicate(timeout=10)
    assert "started" not in out, err
    assert "ignored an admission" in err, err


def test_a_copy_of_a_job_id_under_another_uid_does_not_stand_in_for_the_job(
    server: Server,
) -> None:
    alice = server.start(ALICE, "--vram", "4G", "--name", "mine", "--", "sleep", "60")
    server.wait_jobs(1, "running")
    bob_sleep = subprocess.Popen(["sleep", "60"], user=BOB, group=BOB)
    try:
        lock = os.open(server.ledger_dir / "ledger.lock", os.O_RDWR)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            raw = to_document(server.ledger().read())
            # Bob's entry under Alice's job id, first in order, reserving nothing.
            copy = {
                **raw["jobs"][0],
                "uid": BOB,
                "pid": bob_sleep.pid,
                "start_time": start_time(bob_sleep.pid),
                "order": 0,
                "reserved_bytes": 0,
                "pids": [],
                "child_pid": None,
            }
            raw["jobs"].insert(0, copy)
            server.inject(BOB, raw)
        finally:
            os.close(lock)
        # Alice's gpuwait puts its own entry back (it checks once per sample interval): her
        # reservation stands again and the copy is gone.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            entries = [(j["uid"], j["reserved_bytes"]) for j in server.jobs()]
            if entries == [(ALICE, 4 * GiB)]:
                break
            time.sleep(0.05)
        assert entries == [(ALICE, 4 * GiB)]
        # And she can still cancel her own job by its name.
        cancel = server.run(ALICE, "cancel", "mine")
        assert cancel.returncode == 0, cancel.stderr
        assert alice.wait(timeout=20) != 0
    finally:
        bob_sleep.kill()
        bob_sleep.wait()
