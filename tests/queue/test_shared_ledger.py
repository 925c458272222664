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
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from helpers.history import a_run
from helpers.jobs import live_job
from helpers.users import (
    AS_USER,
    clean_up,
    hidepid_prefix,
    make_shared_ledger_dir,
    popen_as,
    program_as,
    run_as,
    shared_root,
    user_argv,
    user_home,
)
from helpers.waiting import catches_signal, process_state, said, sleeping_in, wait_for

from gpuwait.gpu.sim import Allocation, ensure_state_dir, load_sim_file, write_allocation
from gpuwait.history.learn import save_record
from gpuwait.linux.proc import command_line as proc_command
from gpuwait.linux.proc import owner_uid, start_time
from gpuwait.linux.security import control_refusal
from gpuwait.queue.bookkeeping import FINISHED_KEPT, OK, Finished
from gpuwait.queue.entries import Job
from gpuwait.queue.ledger import Ledger
from gpuwait.queue.wake import Summaries

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

    def run(
        self, uid: int, *args: str, timeout: float = 60, prefix: Sequence[str] = ()
    ) -> subprocess.CompletedProcess[str]:
        return run_as(uid, uid, [GROUP], args, self.envs[uid], timeout=timeout, prefix=prefix)

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

    def wait_pausable(self, uid: int, priority: int, min_runtime: float = 0.5) -> None:
        """Wait until `uid`'s running job of `priority` may be asked to step aside: older than
        `min_runtime` by its `started_at` (what waiters judge it by), its command catching the
        checkpoint signal, so that a request is acted on at once."""

        def pausable() -> bool:
            for job in self.jobs():
                if (job["uid"], job["priority"], job["state"]) != (uid, priority, "running"):
                    continue
                child, started = job.get("child_pid"), job.get("started_at")
                if not isinstance(child, int) or not isinstance(started, (int, float)):
                    return False
                return catches_signal(child, signal.SIGUSR1) and time.time() - started > min_runtime
            return False

        wait_for(
            pausable, timeout=60, interval=0.05, message=lambda: f"never pausable: {self.jobs()}"
        )

    def site_config(self, text: str) -> None:
        """Write the site config file whole, as at once (by rename): a gpuwait reading it in
        the moment a write in place has emptied it would find no setting there (no limit)."""
        path = self.site_dir / "gpuwait" / "config.toml"
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(f"{path.name}.tmp-test")
        temp.write_text(text)
        temp.chmod(0o644)
        os.replace(temp, path)

    def root_env(self) -> dict[str, str]:
        """Root's environment on the server, with a state dir of its own."""
        return {
            **self.envs[ALICE],
            "HOME": str(self.root),
            "XDG_STATE_HOME": str(self.root / "root-state"),
        }

    def run_root(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        """`gpuwait ARGS` as the administrator (root, with a state dir of its own), with the
        environment variables `env` besides."""
        return subprocess.run(
            ["python3", "-m", "gpuwait", *args],
            env={**self.root_env(), "COLUMNS": "120", **env},
            capture_output=True,
            text=True,
            timeout=60,
        )

    def own_file(self, uid: int) -> Path:
        return self.ledger_dir / f"ledger.{uid}.json"

    def write_as(self, uid: int, path: Path, raw: object) -> subprocess.CompletedProcess[str]:
        """Write `path` as `uid` would with a plain editor: no lock, no checks."""
        return self.shell(uid, f"cat > '{path}'", json.dumps(raw))

    def shell(self, uid: int, script: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        """Run the shell `script` as `uid`, a member of the group, with `stdin` as its input."""
        return subprocess.run(
            ["sh", "-c", script],
            input=stdin,
            text=True,
            capture_output=True,
            user=uid,
            group=uid,
            extra_groups=[GROUP],
        )

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the ledger's lock (the directory), so no gpuwait writes meanwhile."""
        fd = os.open(self.ledger_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def edit_own(self, uid: int, change: Callable[[dict[str, Any]], None]) -> None:
        """`uid` edits their own file by hand (under the lock, so their gpuwait cannot undo it
        halfway)."""
        with self.locked():
            path = self.own_file(uid)
            raw = json.loads(path.read_text()) if path.exists() else empty_document()
            change(raw)
            done = self.write_as(uid, path, raw)
            assert done.returncode == 0, done.stderr


def empty_document() -> dict[str, Any]:
    return {"schema": 1, "jobs": [], "created_at": time.time(), "next_order": 1}


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
        clean_up(root, srv.procs)


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
    # Each user's entries are in a file of their own: readable by the group, writable by its
    # owner alone, whatever each user's umask. There is no lock file a member could take away.
    for uid in (ALICE, BOB):
        st = server.own_file(uid).stat()
        assert (st.st_uid, oct(st.st_mode & 0o7777), st.st_gid) == (uid, "0o640", GROUP)
    assert not (server.ledger_dir / "ledger.lock").exists()
    # Nothing private to one member is left there: no event log.
    assert not (server.ledger_dir / "events.jsonl").exists()
    for path in server.ledger_dir.iterdir():
        st = path.stat()
        if path.name.startswith("alive."):
            # A member's jobs' liveness locks: a directory only its owner can open.
            assert (path.name, oct(st.st_mode & 0o777)) == (f"alive.{st.st_uid}", "0o700")
            continue
        assert st.st_gid == GROUP and st.st_mode & 0o040, path.name
    # Each user's history stays in their own private state dir.
    for uid in (ALICE, BOB):
        state = Path(server.envs[uid]["XDG_STATE_HOME"]) / "gpuwait"
        assert (state / "history.jsonl").stat().st_uid == uid
        assert oct(state.stat().st_mode & 0o777) == "0o700"
    assert not list(server.ledger_dir.glob("history*"))


def hold_outside_gpuwait(
    server: Server, n_bytes: int, user: int | None = None
) -> subprocess.Popen[bytes]:
    """A process of root's (or of `user`'s) that the simulated GPU (the first) shows holding
    `n_bytes`, visible to every user as NVML's figures are."""
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True, user=user, group=user)
    config = load_sim_file(server.sim)
    directory = ensure_state_dir(config)
    directory.chmod(0o755)
    start = start_time(proc.pid) or 0
    write_allocation(directory, Allocation(proc.pid, start, config.gpus[0].uuid, n_bytes))
    (directory / f"{proc.pid}.json").chmod(0o644)
    return proc


def pid1_entry(base: dict[str, Any], uuid: str, reserved: int) -> dict[str, Any]:
    """An entry of uid 0 naming pid 1 (which never exits), holding `reserved` on `uuid`."""
    return {
        **base,
        "id": "pid1",
        "uid": 0,
        "pid": 1,
        "start_time": start_time(1),
        "state": "running",
        "gpu_uuids": [uuid],
        "reserved_bytes": reserved,
    }


def test_the_log_of_a_shared_ledger_says_there_is_none(server: Server) -> None:
    # It printed nothing and exited 0, said of --job that no such job was, and -f waited for
    # ever for events nobody writes there.
    for args in (["log"], ["log", "--job", "x"], ["log", "-f"]):
        done = server.run(ALICE, *args, timeout=10)
        assert done.returncode == 5, (args, done.stderr)
        assert done.stderr.count("\n") == 1 and "keeps no event log" in done.stderr


def test_what_a_member_writes_in_their_own_file_counts_only_as_theirs(server: Server) -> None:
    # Load outside gpuwait: 8 GiB held by a process of root's. Alice runs a 4 GiB job.
    external = hold_outside_gpuwait(server, 8 * GiB)
    server.procs.append(external)  # type: ignore[arg-type]
    job = server.start(ALICE, "--vram", "4G", "--name", "mine", "--", "sleep", "60")
    server.wait_jobs(1, "running")

    def probe(vram: str) -> subprocess.CompletedProcess[str]:
        return server.run(ALICE, "--vram", vram, "--timeout", "0.5s", "--", "true")

    # Room: 21.6 usable - 8 external - 4 reserved = 9.6 GiB.
    assert probe("10G").returncode == 124
    assert probe("9G").returncode == 0

    alice_job = next(j for j in server.ledger().read().jobs if j.uid == ALICE)
    uuid = alice_job.gpu_uuids[0]
    bob_sleep = subprocess.Popen(["sleep", "60"], user=BOB, group=BOB)
    try:
        alice_entry = alice_job.to_json()
        base = {**alice_entry, "state": "waiting", "gpu_uuids": [], "reserved_bytes": 0}

        def forge(raw: dict[str, Any]) -> None:
            raw["jobs"] = [
                # Alice's job, as if its entry were Bob's to write: same id, uid, pid.
                {**alice_entry, "reserved_bytes": 0, "observed": {}, "pids": []},
                # Stands in for Alice under another id, naming her live gpuwait.
                {**base, "id": "impostor", "priority": 5},
                # uid 0 and pid 1, reserving the whole card.
                pid1_entry(base, uuid, 20 * GiB),
                # Claims the external 8 GiB as its own usage, naming Bob's own `sleep`.
                {
                    **base,
                    "id": "claimer",
                    "uid": BOB,
                    "pid": bob_sleep.pid,
                    "start_time": start_time(bob_sleep.pid),
                    "state": "running",
                    "gpu_uuids": [uuid],
                    "pids": [external.pid],
                },
                # Enough entries under Alice's uid to reach the per-user cap.
                *({**base, "id": f"fill{n}"} for n in range(1024)),
            ]
            # Asks, in Bob's file, to cancel Alice's job and to pause it.
            target = {
                "uid": ALICE,
                "job": alice_job.id,
                "pid": alice_job.pid,
                "start_time": alice_job.start_time,
                "at": time.time(),
            }
            raw["requests"] = [
                {**target, "kind": "cancel"},
                {**target, "kind": "pause", "by_job": "impostor"},
            ]

        server.edit_own(BOB, forge)
        # And Alice's file is hers: Bob can neither write it nor replace or remove it.
        before = server.own_file(ALICE).read_bytes()
        assert server.write_as(BOB, server.own_file(ALICE), {"jobs": []}).returncode != 0
        for argv in (
            ["rm", "-f", str(server.own_file(ALICE))],
            ["mv", str(server.own_file(BOB)), str(server.own_file(ALICE))],
        ):
            moved = subprocess.run(
                argv, user=BOB, group=BOB, extra_groups=[GROUP], capture_output=True
            )
            assert moved.returncode != 0
        assert server.own_file(ALICE).read_bytes() == before

        # Nothing Bob wrote counts: no room was made or taken, no job of Alice's is shown but
        # hers, her cap is her own, and her job runs on, neither cancelled nor paused.
        done = probe("10G")
        assert done.returncode == 124, done.stderr
        assert "Traceback" not in done.stderr
        assert probe("9G").returncode == 0
        view = server.ledger().read()
        assert [(j.id, j.uid, j.reserved_bytes) for j in view.jobs] == [
            (alice_job.id, ALICE, 4 * GiB)
        ]
        assert view.jobs[0].pause_requested_at is None
        status = json.loads(server.run(ALICE, "status", "--json").stdout)
        assert [(j["id"], j["uid"]) for j in status["jobs"]] == [(alice_job.id, ALICE)]
        assert job.poll() is None
        # Alice's cancel by name reaches her own job only.
        cancel = server.run(ALICE, "cancel", "mine")
        assert cancel.returncode == 0, cancel.stderr
        assert job.wait(timeout=20) != 0
        assert bob_sleep.poll() is None
    finally:
        bob_sleep.kill()
        bob_sleep.wait()


def test_a_members_file_written_by_a_newer_gpuwait_still_counts(server: Server) -> None:
    # Bob's gpuwait is a newer one, which writes a newer ledger schema. Alice's reads his file
    # as far as it can: his running job's room stays his (it was not counted at all, and a
    # 12 GiB job of hers was started into it).
    server.start(BOB, "--vram", "10G", "--name", "bobs", "--", "sleep", "60")
    server.wait_jobs(1, "running")
    # Bob's gpuwait here is this version: stopped, it cannot write his file in this schema
    # again (stopped outside a transaction of its own).
    (bobs,) = server.ledger().read().jobs
    with server.locked():
        os.kill(bobs.pid, signal.SIGSTOP)
        wait_for(lambda: process_state(bobs.pid) == "T", timeout=10)
    server.edit_own(BOB, lambda raw: raw.update(schema=2, newer_field={"any": "thing"}))

    def probe(vram: str) -> subprocess.CompletedProcess[str]:
        return server.run(ALICE, "--vram", vram, "--timeout", "0.5s", "--", "true")

    # Room: 21.6 usable - 10 reserved = 11.6 GiB.
    done = probe("12G")
    assert done.returncode == 124, done.stderr
    assert probe("11G").returncode == 0
    # Nobody wrote Bob's file meanwhile: what Alice's gpuwait read was the newer one.
    assert json.loads(server.own_file(BOB).read_text())["schema"] == 2


@pytest.mark.parametrize("hidepid", ["noaccess", "invisible"])
def test_a_members_job_counts_where_proc_hides_it_from_the_others(
    server: Server, hidepid: str
) -> None:
    # A hardened server mounts /proc with hidepid: Bob may not read Alice's processes. His
    # gpuwait took her running job for a forged entry: her 15 GiB were given to a job of his
    # (two 15 GiB jobs on a 24 GiB card), and his `status` showed the card empty.
    hidden = hidepid_prefix(hidepid)
    alice = server.start(ALICE, "--vram", "15G", "--name", "alices", "--", "sleep", "60")
    server.wait_jobs(1, "running")

    def probe(vram: str) -> subprocess.CompletedProcess[str]:
        return server.run(BOB, "--vram", vram, "--timeout", "0.5s", "--", "true", prefix=hidden)

    # Room: 21.6 usable - 15 of Alice's = 6.6 GiB.
    done = probe("7G")
    assert done.returncode == 124, done.stderr
    assert probe("6G").returncode == 0
    status = server.run(BOB, "status", "--json", prefix=hidden)
    assert [j["name"] for j in json.loads(status.stdout)["jobs"]] == ["alices"]
    # Her gpuwait killed, her command runs on and keeps its room (an orphan).
    alice.kill()
    alice.wait(timeout=10)
    done = probe("7G")
    assert done.returncode == 124, done.stderr


def test_a_members_own_entry_says_what_it_likes_only_about_them(server: Server) -> None:
    # Whatever Bob writes into the entry of his own running job counts as his, once, and what
    # it shows other users is made harmless.
    bob = server.start(BOB, "--vram", "1G", "--", "sleep", "60")
    server.wait_jobs(1, "running")

    def rewrite(raw: dict[str, Any]) -> None:
        entry = raw["jobs"][0]
        entry.update(uid=ALICE, reserved_bytes=8 * GiB, command=["\x1b[2J\x1b]0;pwned\x07"])
        # Copies of it, under other ids, name the same gpuwait process: not counted again.
        raw["jobs"] += [{**entry, "id": f"copy{n}"} for n in range(3)]

    server.edit_own(BOB, rewrite)
    view = server.ledger().read()
    assert [(j.uid, j.reserved_bytes) for j in view.jobs] == [(BOB, 8 * GiB)]
    status = server.run(ALICE, "status")
    assert status.returncode == 0
    assert "\x1b" not in status.stdout and "\x07" not in status.stdout
    # 21.6 usable - 8 of Bob's: 13 GiB still fit for Alice.
    assert server.run(ALICE, "--vram", "13G", "--timeout", "2s", "--", "true").returncode == 0
    bob.send_signal(signal.SIGTERM)
    bob.wait(timeout=20)


def test_a_counter_forged_in_a_members_own_file_breaks_nobody_elses(server: Server) -> None:
    # Bob sets his file's order counter to the most a reader accepts. Alice's next submission
    # must not take it past that: her file would be set aside by her own gpuwait and skipped
    # by everyone else's, her running job counted by nobody, and a job of hers OOM.
    def forge(raw: dict[str, Any]) -> None:
        raw["next_order"] = 2**62

    server.edit_own(BOB, forge)
    job = server.start(ALICE, "--vram", "13G", "--", "sleep", "60")
    server.wait_jobs(1, "running")
    # Her 13 GiB count for her and for Bob: another 13 GiB does not fit on 21.6 usable.
    for uid in (ALICE, BOB):
        done = server.run(uid, "--vram", "13G", "--timeout", "0.5s", "--", "true")
        assert done.returncode == 124, done.stderr
        assert "not used" not in done.stderr and "damaged" not in done.stderr
    assert not list(server.ledger_dir.glob("*.damaged-*"))
    assert [j.uid for j in server.ledger().read().jobs] == [ALICE]
    assert job.poll() is None


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
    # Said with what was asked, and what would help: not the cards, the request.
    assert "the request (2 GPUs, 2.0 GiB in all) exceeds" in never.stderr
    assert "fewer GPUs (--gpus)" in never.stderr and "raise safety" not in never.stderr
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


def test_a_waiter_held_back_by_its_users_limit_keeps_no_card_from_another_user(
    server: Server,
) -> None:
    server.sim.write_text('[[gpu]]\nmemory = "24GiB"\n' * 2)
    server.site_config("user_max_gpus = 1\n")
    server.start(ALICE, "--vram", "20G", "--", "sleep", "30")
    server.wait_jobs(1, "running")
    # Alice's next job, urgent to her, is first in line but over her limit while the first runs.
    server.start(ALICE, "--priority", "4", "--vram", "20G", "--", "sleep", "30")
    server.wait_jobs(2)
    # The other card is idle: Bob's job starts there rather than wait for Alice's first to end.
    bob = server.run(BOB, "--vram", "20G", "--timeout", "10s", "--", "true")
    assert bob.returncode == 0, bob.stderr
    status = json.loads(server.run(BOB, "status", "--json").stdout)
    (waiting,) = [j for j in status["jobs"] if j["state"] == "waiting"]
    assert "per-user limit of 1 GPUs" in waiting["waiting_reason"]


def test_a_users_laxer_safety_does_not_fill_the_card_under_anothers_job(server: Server) -> None:
    # Bob runs 10 GiB on the 24 GiB card with the default safety (0.9: 21.6 GiB may be
    # reserved). Alice has set safety 1.0 for herself.
    server.start(BOB, "--vram", "10G", "--", "sleep", "30")
    server.wait_jobs(1, "running")
    alice = {**server.envs[ALICE], "GPUWAIT_SAFETY": "1.0"}

    def alice_runs(vram: str) -> subprocess.CompletedProcess[str]:
        return run_as(ALICE, ALICE, [GROUP], ["--vram", vram, "--timeout", "1s", "true"], alice)

    # 13 GiB beside Bob's job would leave his margin to no one: she waits while it runs...
    over = alice_runs("13G")
    assert over.returncode == 124, over.stderr
    # ...while what stays within Bob's safety starts at once.
    assert alice_runs("11G").returncode == 0


def test_a_users_own_short_max_wait_does_not_put_their_jobs_first(server: Server) -> None:
    server.site_config('fair_share_half_life = "none"\n')  # first come, first served
    holder = server.start(BOB, "--vram", "20G", "--", "sleep", "30")
    server.wait_jobs(1, "running")
    server.start(BOB, "--name", "bobs-next", "--vram", "20G", "--", "sleep", "30")
    server.wait_jobs(2)
    # Alice, who came later, has set max_wait = 0.5s for herself.
    argv = ["--name", "alices", "--vram", "20G", "--", "sleep", "30"]
    env = {**server.envs[ALICE], "GPUWAIT_MAX_WAIT": "0.5s"}
    server.procs.append(popen_as(ALICE, ALICE, [GROUP], argv, env, start_new_session=True))
    server.wait_jobs(3)
    time.sleep(1.0)  # past her own max_wait
    os.killpg(holder.pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    while not (
        started := [j["name"] for j in server.jobs() if j["state"] == "running" and j["name"]]
    ):
        assert time.monotonic() < deadline, server.jobs()
        time.sleep(0.02)
    # Bob's job, first in line, starts: her setting shortens nobody's wait but for her own plan.
    assert started == ["bobs-next"]


def ran_before(server: Server, uid: int, **seconds: float) -> None:
    """Three earlier runs of each of `uid`'s `--key KEY` jobs in their history, each as long
    as `seconds` says."""
    state = Path(server.envs[uid]["XDG_STATE_HOME"])
    os.chown(state, 0, 0)  # written by root here, then given to the user
    for key, length in seconds.items():
        for n in range(3):
            run = a_run(["sleep", "30"], "/", time.time() - 600 + n, job_id=f"{key}{n}", key=key)
            save_record(state / "gpuwait", {**run, "run_seconds": length}, 64 * 2**20)
    subprocess.run(["chown", "-R", f"{uid}:{uid}", str(state)], check=True)


def short_after_long(
    server: Server,
    alice: Callable[[list[str]], subprocess.Popen[str]],
    bob: Callable[[list[str]], subprocess.Popen[str]] | None = None,
) -> list[tuple[object, object]]:
    """Bob's long job, then Alice's short one (started by `alice` from its gpuwait arguments;
    his by `bob`, else as any job of his), waiting for one card that fits one of them at a time;
    the card freed: who runs on it once one of them has started (each user's gpuwait starts only
    their own jobs)."""
    ran_before(server, BOB, long=300.0)
    ran_before(server, ALICE, short=5.0)
    holder = server.start(BOB, "--vram", "20G", "--", "sleep", "30")
    server.wait_jobs(1, "running")
    long = ["--key", "long", "--name", "long", "--vram", "20G", "--", "sleep", "30"]
    if bob is None:
        server.start(BOB, *long)
    else:
        server.procs.append(bob(long))
    server.wait_jobs(2)
    server.procs.append(
        alice(["--key", "short", "--name", "short", "--vram", "20G", "--", "sleep", "30"])
    )
    server.wait_jobs(3)
    os.killpg(holder.pid, signal.SIGTERM)
    holder.communicate(timeout=10)
    wait_for(
        lambda: any(j["state"] == "running" and j["name"] for j in server.jobs()),
        timeout=40,  # a disagreement is told after 15 s (wait.DISAGREE_AFTER), or as patched
        message=lambda: f"a job started on the idle card: {server.jobs()}",
    )
    return [(j["uid"], j["name"]) for j in server.jobs() if j["state"] == "running"]


def test_a_users_own_queue_order_does_not_leave_a_shared_card_idle(server: Server) -> None:
    # The site keeps the default order (lookahead), which starts Alice's short job before
    # Bob's long one; Alice has set queue_order = fifo for herself, which starts his first.
    # Under two orders each user's gpuwait waited for the other's job (Bob's for 100 minutes,
    # his wait budget). (A plan budget no busy machine runs out of: every plan is searched to
    # its end.)
    server.site_config('fair_share_half_life = "none"\nplan_budget = "30s"\n')
    env = {**server.envs[ALICE], "GPUWAIT_QUEUE_ORDER": "fifo"}

    def alice(argv: list[str]) -> subprocess.Popen[str]:
        return popen_as(ALICE, ALICE, [GROUP], argv, env, start_new_session=True)

    # The one the site's order starts.
    assert short_after_long(server, alice) == [(ALICE, "short")]
    os.killpg(server.procs[-1].pid, signal.SIGTERM)
    _, err = server.procs[-1].communicate(timeout=10)
    assert (
        "gpuwait: warning: queue_order = fifo of yours is not used in the shared ledger "
        f"{server.ledger_dir}: everyone's queue there is in the site's order, lookahead\n"
    ) in err


#: Alice's gpuwait on a machine so busy that every plan's search is cut at once: its clock
#: passes a second each time the search looks at it, past any plan budget.
BUSY_MACHINE = """
import itertools
import gpuwait.core.lookahead, gpuwait.queue.conditions
searched = gpuwait.core.lookahead.plan_queue
def cut_short(gpus, claims, safety, cursor, conditions, fair, clock=None, hint=()):
    seconds = itertools.count()
    clock = lambda: float(next(seconds))
    return searched(gpus, claims, safety, cursor, conditions, fair, clock, hint)
gpuwait.queue.conditions.plan_queue = cut_short
"""

#: Put into a member's gpuwait: plans that disagree are told so after 2 s instead of 15 s. The
#: same rule, sooner: nothing but a disagreement starts Bob's long job below, however long it
#: lasts, and every second of it is the card left idle.
TOLD_SOON = """
import gpuwait.queue.wait
assert gpuwait.queue.wait.DISAGREE_AFTER > 2.0
gpuwait.queue.wait.DISAGREE_AFTER = 2.0
"""


def test_two_members_whose_plans_disagree_do_not_leave_a_shared_card_idle(
    server: Server,
) -> None:
    # Each member's gpuwait starts only that member's jobs, so all must come to one plan. A
    # busy machine can cut one member's search short: Alice's plan (cut at once) starts Bob's
    # long job, which he submitted first; Bob's, searched to its end, starts Alice's short one.
    # Each waited for the other's job, and the free card went to nobody until a wait budget
    # ran out, hours later.
    server.site_config('fair_share_half_life = "none"\n')

    def member(uid: int, code: str) -> Callable[[list[str]], subprocess.Popen[str]]:
        def start(argv: list[str]) -> subprocess.Popen[str]:
            patched = user_argv(uid, uid, [GROUP], argv)
            patched[2] = patched[2].replace(
                "gpuwait.cli.entry_point()", code + "gpuwait.cli.entry_point()"
            )
            return subprocess.Popen(
                patched,
                env=server.envs[uid],
                text=True,
                cwd="/",
                start_new_session=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )

        return start

    # Once the two plans have disagreed for a while (wait.DISAGREE_AFTER), both plan in strict
    # order (no search: the same for everyone), and the job submitted first starts.
    alice = member(ALICE, BUSY_MACHINE + TOLD_SOON)
    assert short_after_long(server, alice, member(BOB, TOLD_SOON)) == [(BOB, "long")]


def test_a_users_stricter_safety_keeps_the_card_no_emptier_than_the_sites(
    server: Server,
) -> None:
    # Bob holds 1 GiB of the 24 GiB card with safety 0.05 set for himself: believed as it is,
    # his job would keep the whole card from everyone while it ran, for 1 GiB of his limits
    # and fair share. Another user's safety counts down to the site's (the default 0.9).
    bob = {**server.envs[BOB], "GPUWAIT_SAFETY": "0.05"}
    server.procs.append(
        popen_as(
            BOB, BOB, [GROUP], ["--vram", "1G", "--", "sleep", "30"], bob, start_new_session=True
        )
    )
    server.wait_jobs(1, "running")
    done = server.run(ALICE, "--vram", "10G", "--timeout", "2s", "true")
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("fair_share", [True, False])
def test_fair_share_puts_the_lighter_user_first(server: Server, fair_share: bool) -> None:
    if not fair_share:
        server.site_config('fair_share_half_life = "none"\n')
    # Alice has used the GPU heavily of late; Bob not at all.
    # (Written into her own file, where only she and root may write it.)
    alice_file = empty_document()
    alice_file["usage"] = {str(ALICE): [1e15, time.time()]}
    assert server.write_as(ALICE, server.own_file(ALICE), alice_file).returncode == 0
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


def test_an_admission_written_by_another_member_starts_nothing(server: Server) -> None:
    # 20 GiB of the 21.6 usable are held outside gpuwait: a 10 GiB job does not fit.
    external = hold_outside_gpuwait(server, 20 * GiB)
    server.procs.append(external)  # type: ignore[arg-type]
    waiter = server.start(ALICE, "--vram", "10G", "--", "sh", "-c", "echo started; sleep 30")
    server.wait_jobs(1, "waiting")
    uuid = load_sim_file(server.sim).gpus[0].uuid
    # Bob writes Alice's waiting entry, marked as admitted onto the full GPU, into his own file:
    # it is his entry (naming her process, so not even that), never her admission.
    jobs = [j.to_json() for j in server.ledger().read().jobs]
    for entry in jobs:
        entry.update(state="running", gpu_uuids=[uuid], reserved_bytes=10 * GiB)
    server.edit_own(BOB, lambda mine: mine.update(jobs=jobs))
    time.sleep(2)
    assert [(j["uid"], j["state"]) for j in server.jobs()] == [(ALICE, "waiting")]
    assert waiter.poll() is None
    waiter.send_signal(signal.SIGTERM)
    out, err = waiter.communicate(timeout=10)
    assert "started" not in out, err


HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""


def bob_holds_the_lock(server: Server) -> subprocess.Popen[str]:
    """Bob takes the ledger's lock and keeps it (a minute); returns once he holds it."""
    holder = subprocess.Popen(
        ["python3", "-c", HOLD_LOCK, str(server.ledger_dir)],
        user=BOB,
        group=BOB,
        extra_groups=[GROUP],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    server.procs.append(holder)
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    return holder


def test_a_member_holding_the_lock_keeps_no_launch_past_its_timeout(server: Server) -> None:
    # Bob keeps the lock. Alice's launch with --timeout 0.5s waited for it as long as
    # lock_timeout (a minute) and then failed with exit 5, where her script expects 124 soon.
    holder = bob_holds_the_lock(server)
    started = time.monotonic()
    done = server.run(ALICE, "--vram", "1G", "--timeout", "0.5s", "--", "true", timeout=30)
    assert done.returncode == 124, done.stderr
    assert time.monotonic() - started < 10
    assert f"held by process {holder.pid} (uid {BOB})" in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr


def test_a_member_taking_the_lock_keeps_no_waiter_past_its_timeout(server: Server) -> None:
    # Alice's job fills the card; her second one waits behind it with --timeout 0.5s, and the
    # lock is taken meanwhile (here by the test, as a member would): the waiter gives up at its
    # timeout (exit 124), not a minute later when lock_timeout has passed.
    server.start(ALICE, "--vram", "20G", "--", "sleep", "60")
    server.wait_jobs(1, "running")
    waiter = server.start(ALICE, "--vram", "20G", "--timeout", "0.5s", "--", "true")
    server.wait_jobs(2)
    with server.locked():
        _, err = waiter.communicate(timeout=30)
    assert waiter.returncode == 124, err
    assert "gave up after waiting" in err and "warning" not in err, err


def test_a_member_cannot_lock_the_others_out(server: Server) -> None:
    assert server.run(BOB, "--vram", "1G", "--", "true").returncode == 0
    # The lock is the directory itself, which is root's: no member can change its mode.
    chmod = subprocess.run(
        ["chmod", "000", str(server.ledger_dir)], user=BOB, group=BOB, capture_output=True
    )
    assert chmod.returncode != 0
    # A member who holds it is named when others give up, uid and pid.
    holder = bob_holds_the_lock(server)
    done = run_as(
        ALICE,
        ALICE,
        [GROUP],
        ["--vram", "1G", "--", "true"],
        {**server.envs[ALICE], "GPUWAIT_LOCK_TIMEOUT": "1s"},
    )
    assert done.returncode == 5
    assert f"held by process {holder.pid} (uid {BOB})" in done.stderr, done.stderr
    holder.kill()
    holder.wait()
    assert server.run(ALICE, "--vram", "1G", "--", "true").returncode == 0


def as_bob(
    server: Server, argv: list[str], stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `argv` as Bob, a member of the group, in the ledger directory."""
    return subprocess.run(
        argv,
        input=stdin,
        cwd=server.ledger_dir,
        user=BOB,
        group=BOB,
        extra_groups=[GROUP],
        capture_output=True,
        text=True,
    )


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "mode 000"])
def test_what_a_member_does_to_every_file_of_theirs_hangs_or_stops_nobody(
    server: Server, kind: str
) -> None:
    # Bob uses the directory first: every file gpuwait made there so far is his.
    assert server.run(BOB, "--vram", "1G", "--", "true").returncode == 0
    swap = {
        "fifo": 'mkfifo "$f.new" && mv -f "$f.new" "$f"',
        "/dev/zero": 'ln -s /dev/zero "$f.new" && mv -f "$f.new" "$f"',
        "mode 000": 'chmod 000 "$f"',
    }[kind]
    with server.locked():
        script = f"for f in $(find . -maxdepth 1 -type f -user {BOB}); do {swap}; done"
        done = as_bob(server, ["sh", "-c", script])
    assert done.returncode == 0, done.stderr
    started = time.monotonic()
    alice = server.run(ALICE, "--vram", "1G", "--", "echo", "ran", timeout=30)
    assert alice.returncode == 0 and alice.stdout == "ran\n", alice.stderr
    assert "Traceback" not in alice.stderr
    status = server.run(ALICE, "status", timeout=30)
    assert status.returncode == 0, status.stderr
    assert time.monotonic() - started < 20


RENAMES = """
import os
open("scratch", "w").close()
for _ in range(60000):
    os.rename("scratch", "scratch.2")
    os.rename("scratch.2", "scratch")
os.unlink("scratch")
"""


def cpu_seconds(pid: int) -> float:
    """The CPU time process `pid` has used, user and system."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_members_loop_of_renames_keeps_no_waiter_busy(server: Server) -> None:
    # Bob's script renames a scratch file of his in the shared directory in a loop. Alice's
    # waiter, watching the directory for summaries, was woken by each rename and read every
    # event one by one: it used 0.92 s of CPU in the loop's 2.9 s, as would every waiter of
    # every member. Woken no more often than a summary is acted on, its events searched for
    # the names of summaries alone, it uses 0.05 s in 1.3 s.
    outside = hold_outside_gpuwait(server, 20 * GiB)
    try:
        waiter = server.start(ALICE, "--vram", "10G", "--", "echo", "ran")
        wait_for(lambda: sleeping_in(waiter.pid, "sigtimedwait"), timeout=30)
        before = cpu_seconds(waiter.pid)
        started = time.monotonic()
        done = as_bob(server, ["python3", "-c", RENAMES])
        assert done.returncode == 0, done.stderr
        # CPU time against the loop's time on the clock: the wake-ups a waiter takes are
        # bounded by the clock, whatever else keeps the machine busy.
        lasted = time.monotonic() - started
        used = cpu_seconds(waiter.pid) - before
        assert used < 0.15 * lasted, (used, lasted)
    finally:
        outside.kill()
        outside.wait()
    # It still starts once the room is free.
    out, err = waiter.communicate(timeout=60)
    assert (waiter.returncode, out) == (0, "ran\n"), err


EMPTIES = """
import os, sys, time
while True:
    try:
        os.truncate(sys.argv[1], 0)
    except OSError:
        pass
    time.sleep(0.002)
"""


def bobs_loop(server: Server, program: str, *args: str) -> subprocess.Popen[str]:
    """A Python `program` of Bob's (with `args`), running until the test kills it."""
    loop = subprocess.Popen(
        ["python3", "-c", program, *args],
        user=BOB,
        group=BOB,
        extra_groups=[GROUP],
        start_new_session=True,
        text=True,
    )
    server.procs.append(loop)
    return loop


@contextlib.contextmanager
def bobs_file_emptied(server: Server) -> Iterator[None]:
    """Bob's ledger file emptied again and again by a loop of his while the block runs (from
    its first emptying on)."""
    loop = bobs_loop(server, EMPTIES, str(server.own_file(BOB)))

    def emptied() -> bool:
        try:
            return server.own_file(BOB).stat().st_size == 0
        except FileNotFoundError:
            return False  # moved aside by his gpuwait, found damaged: written again next

    try:
        wait_for(emptied)
        yield
    finally:
        loop.kill()
        loop.wait()


def alice_is_held_for_bobs_file(server: Server, launches: int) -> None:
    """Each of Alice's `launches` of 15 GiB waits (none runs), one at least saying it is for
    Bob's file: read between a write of his and the loop's next truncation, his file shows
    his job, and Alice waits for its room then too."""
    said_why = []
    for _ in range(launches):
        done = server.run(ALICE, "--vram", "15G", "--timeout", "0", "--", "echo", "ran")
        assert (done.returncode, done.stdout) == (124, ""), done.stderr
        said_why.append(f"the ledger file of uid {BOB}, whose gpuwait or job runs" in done.stderr)
    assert any(said_why), done.stderr


def bobs_room_is_alices_once_it_ends(server: Server, bob: subprocess.Popen[str]) -> None:
    os.killpg(bob.pid, signal.SIGTERM)
    bob.communicate(timeout=30)
    done = server.run(ALICE, "--vram", "15G", "--", "echo", "ran")
    assert (done.returncode, done.stdout) == (0, "ran\n"), done.stderr


def test_a_member_emptying_their_file_while_their_job_runs_admits_nobody_into_its_room(
    server: Server,
) -> None:
    # Bob's job holds 15 GiB of the card's 21.6 usable, and a loop of his empties his ledger
    # file again and again. Alice's launches read it as damaged, counted no job of his, and
    # each of 5 was started into the room his job holds. While a gpuwait of his runs, a file
    # of his that cannot be used admits nobody, and says so.
    bob = server.start(BOB, "--vram", "15G", "--", "sleep", "60")
    server.wait_jobs(1, "running")
    with bobs_file_emptied(server):
        alice_is_held_for_bobs_file(server, 5)
    # Once Bob's job has ended, its room is Alice's.
    bobs_room_is_alices_once_it_ends(server, bob)


def stopped_outside_a_transaction(server: Server, pid: int) -> None:
    """Stop the gpuwait `pid` (SIGSTOP) where it holds no lock on the ledger directory."""
    from gpuwait.linux.lock import holders_of

    st = server.ledger_dir.stat()
    while True:
        wait_for(lambda: sleeping_in(pid, "sigtimedwait"), timeout=30)
        os.kill(pid, signal.SIGSTOP)
        if pid not in holders_of([(st.st_dev, st.st_ino)]).get((st.st_dev, st.st_ino), []):
            return
        os.kill(pid, signal.SIGCONT)


@pytest.mark.parametrize("damage", [":>", "rm -f"], ids=["emptied", "removed"])
def test_a_members_file_started_afresh_admits_nobody_until_their_jobs_entries_are_back(
    server: Server, damage: str
) -> None:
    # Bob's job holds 15 GiB of the card's 21.6 usable; his file is emptied (or removed), and
    # a launch of his starts it afresh, without the job's entry, which the job's gpuwait puts
    # back once woken (stopped here, as a loaded machine may keep it a while). Bob's own
    # launch waits for it; Alice's was started into the room his job holds, the file readable
    # again and counting no job of his. While a gpuwait of his runs, nobody is admitted for
    # 30 s from the file's recovery, as no waiter of his is until his jobs' entries are back.
    bob = server.start(BOB, "--vram", "15G", "--", "sleep", "60")
    server.wait_jobs(1, "running")
    stopped_outside_a_transaction(server, bob.pid)
    try:
        assert server.shell(BOB, f"{damage} '{server.own_file(BOB)}'").returncode == 0
        later = server.start(BOB, "--vram", "1G", "--", "true")
        said(later, "the ledger was started afresh after damage")
        assert server.ledger().read().unread == {}
        alice_held_for_bobs_file_started_afresh(server)
    finally:
        os.kill(bob.pid, signal.SIGCONT)
    os.killpg(bob.pid, signal.SIGTERM)
    bob.communicate(timeout=30)
    later.communicate(timeout=60)


def alice_held_for_bobs_file_started_afresh(server: Server) -> None:
    """Alice's launch of 15 GiB, beside Bob's job of 15 GiB whose entry his file started afresh
    lost, gives up at its 3 s --timeout without running, saying why."""
    done = server.run(ALICE, "--vram", "15G", "--timeout", "3", "--", "echo", "ran")
    assert (done.returncode, done.stdout) == (124, ""), done.stderr
    assert f"the ledger file of uid {BOB}, whose gpuwait or job runs, was started afresh" in (
        " ".join(done.stderr.split())
    ), done.stderr


def written(path: Path) -> bool:
    """Is there something in the file at `path`? Not while it is gone: one found damaged is
    moved aside before it is written afresh."""
    try:
        return path.stat().st_size > 0
    except FileNotFoundError:
        return False


def test_a_members_file_started_afresh_admits_nobody_whatever_the_file_servers_clock(
    server: Server,
) -> None:
    # As above, the ledger directory on a file server whose clock is a minute ahead of this
    # machine's, as NFS's may be: it stamped the lock Bob's job took a moment ago a minute
    # ahead of the clock of his launch that started his file afresh, which took the lock for
    # one taken since, of a job of the new file's, and marked nothing: Alice's launch was
    # started into the room his job holds. Under the ledger's lock every lock a job of his
    # holds was taken before: nobody is admitted until his job's entry is back.
    bob = server.start(BOB, "--vram", "15G", "--", "sleep", "60")
    server.wait_jobs(1, "running")
    (job,) = server.jobs()
    stopped_outside_a_transaction(server, bob.pid)
    try:
        lock = server.ledger_dir / f"alive.{BOB}" / str(job["id"])
        ahead = lock.stat().st_mtime + 60
        os.utime(lock, (ahead, ahead))
        assert server.shell(BOB, f":> '{server.own_file(BOB)}'").returncode == 0
        later = server.start(BOB, "--vram", "1G", "--", "true")
        wait_for(lambda: written(server.own_file(BOB)))
        alice_held_for_bobs_file_started_afresh(server)
    finally:
        os.kill(bob.pid, signal.SIGCONT)
    os.killpg(bob.pid, signal.SIGTERM)
    bob.communicate(timeout=30)
    later.communicate(timeout=60)


def test_a_members_file_started_afresh_holds_nobody_once_their_jobs_entries_are_back(
    server: Server,
) -> None:
    # Bob's job holds 15 GiB of the card's 21.6 usable; his file is emptied and a launch of
    # his starts it afresh while the job's gpuwait is stopped, and Alice's 5 GiB launch waits
    # for his entries. Once the job's gpuwait runs on, it puts its entry back, and Bob's
    # launch, which waited for that, runs: the room his job holds is known again. Alice's
    # launch, which fits beside it, was held all the same for the rest of the 30 s (here
    # past its 20 s --timeout, exit 124), though its wait line said "until they have put
    # their entries back".
    bob = server.start(BOB, "--vram", "15G", "--", "sleep", "60")
    server.wait_jobs(1, "running")
    stopped_outside_a_transaction(server, bob.pid)
    try:
        assert server.shell(BOB, f":> '{server.own_file(BOB)}'").returncode == 0
        later = server.start(BOB, "--vram", "1G", "--", "true")
        said(later, "the ledger was started afresh after damage")
        alice = server.start(ALICE, "--vram", "5G", "--timeout", "20", "--", "echo", "ran")
        said(alice, f"the ledger file of uid {BOB}, whose gpuwait or job runs, was started afresh")
    finally:
        os.kill(bob.pid, signal.SIGCONT)
    assert later.wait(timeout=60) == 0
    out, err = alice.communicate(timeout=60)
    assert (alice.returncode, out) == (0, "ran\n"), err
    os.killpg(bob.pid, signal.SIGTERM)
    bob.communicate(timeout=30)
    later.communicate(timeout=30)


def test_a_members_file_started_afresh_with_no_job_of_theirs_alive_holds_nobody(
    server: Server,
) -> None:
    # Bob's file emptied while no job of his runs or waits: his next launch starts it afresh
    # with no entry still to come back, and Alice's launch beside his job is not held for it.
    bob = server.start(BOB, "--vram", "1G", "--", "sleep", "60")
    server.wait_jobs(1, "running")
    os.killpg(bob.pid, signal.SIGTERM)
    bob.communicate(timeout=30)
    assert server.shell(BOB, f":> '{server.own_file(BOB)}'").returncode == 0
    bob = server.start(BOB, "--vram", "1G", "--", "sleep", "60")
    server.wait_jobs(1, "running")
    done = server.run(ALICE, "--vram", "15G", "--timeout", "3", "--", "echo", "ran")
    assert (done.returncode, done.stdout) == (0, "ran\n"), done.stderr
    os.killpg(bob.pid, signal.SIGTERM)
    bob.communicate(timeout=30)


def test_status_says_why_nobody_is_admitted_while_a_members_file_cannot_be_used(
    server: Server,
) -> None:
    # Bob's job holds 15 GiB, and a loop of his empties his ledger file again and again:
    # Alice's launch waits, as its wait line says, for his file. `gpuwait status` showed the
    # card free, no job running, and Alice's job as starting now (ETA ~0ms), no word of why.
    bob = server.start(BOB, "--vram", "15G", "--", "sleep", "60")
    server.wait_jobs(1, "running")
    held = f"the ledger file of uid {BOB}, whose gpuwait or job runs, cannot be used"
    with bobs_file_emptied(server):
        alice = server.start(ALICE, "--vram", "15G", "--name", "alice", "--", "echo", "ran")
        said(alice, held)
        shown = server.run(ALICE, "status")
        assert shown.returncode == 0, shown.stderr
        assert held in " ".join(shown.stdout.split()), shown.stdout
        assert "~0ms" not in shown.stdout, shown.stdout
    os.killpg(bob.pid, signal.SIGTERM)
    bob.communicate(timeout=30)
    out, err = alice.communicate(timeout=60)
    assert (alice.returncode, out) == (0, "ran\n"), err


def test_status_with_nobody_waiting_says_a_members_file_cannot_be_used(server: Server) -> None:
    # Bob's job holds 15 GiB, his gpuwait is stopped (Ctrl-Z) and his file is junk: a launch
    # of Alice's would be held for it. With nothing of hers waiting, `gpuwait status` showed
    # the card free, no job running, and no word of his file (where it had nothing to tidy).
    assert server.run(ALICE, "--vram", "1G", "--", "true").returncode == 0
    bob = server.start(BOB, "--vram", "15G", "--", "sleep", "60")
    server.wait_jobs(1, "running")
    os.kill(bob.pid, signal.SIGSTOP)
    try:
        assert server.shell(BOB, f"echo junk > '{server.own_file(BOB)}'").returncode == 0
        shown = server.run(ALICE, "status")
        assert shown.returncode == 0, shown.stderr
        held = f"the ledger file of uid {BOB}, whose gpuwait or job runs, cannot be used"
        assert held in " ".join((shown.stdout + shown.stderr).split()), shown
    finally:
        os.kill(bob.pid, signal.SIGCONT)
    os.killpg(bob.pid, signal.SIGTERM)
    bob.communicate(timeout=30)


def test_a_member_emptying_their_file_while_their_program_holds_room_admits_nobody_into_it(
    server: Server,
) -> None:
    # Bob's Python program holds 15 GiB of the card's 21.6 usable through gpuwait.reserve(),
    # and a loop of his empties his ledger file again and again. No process of his names
    # gpuwait on its command line, so his file was taken for one nobody of his uses: Alice's
    # launches counted no job of his and were started into the room his program holds. His
    # program holds its job's liveness lock, as a gpuwait of his would: nobody is admitted.
    python = (
        'import gpuwait\nr = gpuwait.reserve("15G")\nprint("held", flush=True)\nsignal.pause()\n'
    )
    bob = bobs_program_in_the_queue(server, python)
    assert bob.stdout is not None
    assert bob.stdout.readline() == "held\n"
    with bobs_file_emptied(server):
        alice_is_held_for_bobs_file(server, 3)
    # Once Bob's program has ended, its room is Alice's.
    bobs_room_is_alices_once_it_ends(server, bob)


FORGE = """
import json, os, sys
payload = sys.stdin.read()
for name in sorted(os.listdir(".")):
    try:
        fd = os.open(name, os.O_WRONLY | os.O_TRUNC | os.O_NONBLOCK)
    except OSError:
        continue
    os.write(fd, payload.encode())
    os.close(fd)
    print(name)
"""


def test_no_file_a_member_can_write_lets_them_act_on_anothers_jobs(server: Server) -> None:
    # Alice runs a --pausable job on the one card; a second one waits behind it.
    assert server.run(BOB, "--vram", "1G", "--", "true").returncode == 0
    runs = server.start(ALICE, "--pausable", "--vram", "12G", "--", "sleep", "60")
    server.wait_jobs(1, "running")
    waits = server.start(ALICE, "--vram", "12G", "--name", "second", "--", "echo", "ran")
    server.wait_jobs(2)
    view = {j.state: j for j in server.ledger().read().jobs}
    running, waiting = view["running"].to_json(), view["waiting"].to_json()
    uuid = running["gpu_uuids"][0]
    now = time.time()
    # Bob writes, into every file of the directory he can write to, a ledger in which: Alice's
    # waiter is gone and cancelled; her running job is asked to step aside; an impostor under
    # her uid names her live gpuwait; 1024 entries of hers fill her cap; uid 0 and pid 1 hold
    # the card.
    base = {**waiting, "state": "waiting"}
    forged = {
        "schema": 1,
        "created_at": now,
        "next_order": 2000,
        "jobs": [
            {**running, "pause_requested_at": now, "pause_requested_by": "impostor"},
            {
                **base,
                "id": "impostor",
                "priority": 5,
                "pid": running["pid"],
                "start_time": running["start_time"],
            },
            pid1_entry(base, uuid, 22 * GiB),
            *(
                {
                    **base,
                    "id": f"fill{n}",
                    "pid": running["pid"],
                    "start_time": running["start_time"],
                }
                for n in range(1024)
            ),
        ],
        "book": {"finished": [{"id": waiting["id"], "outcome": "cancelled", "finished_at": now}]},
        "requests": [
            {
                "kind": kind,
                "uid": ALICE,
                "job": job["id"],
                "pid": job["pid"],
                "start_time": job["start_time"],
                "at": now,
                "by_job": "impostor",
            }
            for kind, job in (("cancel", waiting), ("pause", running))
        ],
    }
    with server.locked():
        wrote = as_bob(server, ["python3", "-c", FORGE], json.dumps(forged))
    assert wrote.returncode == 0, wrote.stderr
    assert wrote.stdout  # Bob could write something: his own file at least
    time.sleep(2)  # a sample interval or two: time for anything to act on it
    # Alice's waiter still waits, her running job was not asked to step aside.
    assert waits.poll() is None and runs.poll() is None
    alice = {j.id: j for j in server.ledger().read().jobs if j.uid == ALICE}
    assert sorted(alice) == sorted([running["id"], waiting["id"]])
    assert alice[running["id"]].pause_requested_at is None
    assert alice[running["id"]].pause_signalled_at is None
    # Her cap is hers: another job of hers may queue (and, with the card taken, times out).
    probe = server.run(ALICE, "--vram", "1G", "--timeout", "0.5s", "--", "true")
    assert probe.returncode == 124 and "already have" not in probe.stderr, probe.stderr
    # Nothing she does to "impostor" reaches her own job.
    cancel = server.run(ALICE, "cancel", "impostor")
    assert cancel.returncode != 0 and runs.poll() is None
    for proc in (runs, waits):
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)


def test_root_cancels_a_members_waiting_job_through_its_own_gpuwait(server: Server) -> None:
    holder = server.start(ALICE, "--vram", "20G", "--", "sleep", "30")
    server.wait_jobs(1, "running")
    waiter = server.start(ALICE, "--vram", "20G", "--name", "second", "--", "echo", "ran")
    server.wait_jobs(2)
    # Bob may not.
    bob = server.run(BOB, "cancel", "second")
    assert bob.returncode == 8, bob.stderr
    assert waiter.poll() is None
    # Root may: the request is written in root's own file, and Alice's gpuwait carries it out.
    root_env = server.root_env()
    root = subprocess.run(
        ["python3", "-m", "gpuwait", "cancel", "second"],
        env=root_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert root.returncode == 0, root.stderr
    out, err = waiter.communicate(timeout=20)
    assert waiter.returncode == 7, err
    assert "ran" not in out and "cancelled while waiting by uid 0" in err
    assert [j["state"] for j in server.jobs()] == ["running"]
    # Nothing of the request is left once done.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        root_file = json.loads(server.own_file(0).read_text())
        if not root_file.get("requests"):
            break
        server.run(ALICE, "status")
        subprocess.run(["python3", "-m", "gpuwait", "status"], env=root_env, capture_output=True)
        time.sleep(0.2)
    assert not json.loads(server.own_file(0).read_text()).get("requests")
    holder.kill()


def test_a_members_running_job_root_cancels_counts_as_cancelled_in_their_batch(
    server: Server,
) -> None:
    # Root's cancel sends the TERM: Alice's gpuwait, ending as its command did, counted the
    # job failed in her batch, as though her code had crashed.
    running = server.start(ALICE, "--vram", "4G", "--batch", "sweep", "--", "sleep", "30")
    server.wait_jobs(1, "running")
    root = server.run_root("cancel", "--batch", "sweep")
    assert root.returncode == 0, root.stderr
    assert running.wait(timeout=20) == -signal.SIGTERM
    status = server.run(ALICE, "status", "--json")
    (batch,) = json.loads(status.stdout)["batches"]
    assert (batch["failed"], batch["cancelled"]) == (0, 1)


def test_an_urgent_waiter_of_another_member_makes_a_pausable_job_step_aside(
    server: Server,
) -> None:
    # Simulated jobs of every member record what they allocate beside the simulation file.
    ensure_state_dir(load_sim_file(server.sim)).chmod(0o1777)
    checkpoint = Path(server.envs[ALICE]["HOME"]) / "progress.json"
    # Alice's own queue order is not the site's: she is told so once, not at each resume.
    env = {
        **server.envs[ALICE],
        "GPUWAIT_PAUSE_MIN_RUNTIME": "0.5s",
        "GPUWAIT_QUEUE_ORDER": "fifo",
    }
    wrapper = ["--priority", "1", "--pausable", "--vram", "16G", "--"]
    sim_job = ["python3", "-m", "gpuwait", "sim", "job", "--vram", "16G", "--hold", "4s"]
    argv = [*wrapper, *sim_job, "--checkpoint", str(checkpoint)]
    low = popen_as(ALICE, ALICE, [GROUP], argv, env, start_new_session=True)
    server.procs.append(low)
    server.wait_pausable(ALICE, 1)
    # (The waiter judges whether a job has run long enough to be asked.)
    server.envs[BOB]["GPUWAIT_PAUSE_MIN_RUNTIME"] = "0.5s"
    urgent = server.start(BOB, "--priority", "5", "--vram", "16G", "--", "sh", "-c", "sleep 1")
    assert urgent.wait(timeout=60) == 0, urgent.stderr.read() if urgent.stderr else ""
    _, err = low.communicate(timeout=60)
    assert low.returncode == 0, err
    assert json.loads(checkpoint.read_text())["resumes"] == 1
    assert err.count("queue_order = fifo of yours is not used") == 1, err


def test_a_job_that_stepped_aside_for_another_members_job_waits_no_more_once_it_started(
    server: Server,
) -> None:
    """Alice's job steps aside for Bob's, which starts, then steps aside in turn for Bob's
    urgent one. Once room for Alice's job comes free, it resumes there: it waited until Bob's
    job had started, not for it to start a second time (Bob's gpuwait, which knew, may not
    write Alice's entry; it kept waiting for the urgent job to end, its room idle)."""
    ensure_state_dir(load_sim_file(server.sim)).chmod(0o1777)
    for uid in (ALICE, BOB):
        server.envs[uid]["GPUWAIT_PAUSE_MIN_RUNTIME"] = "0.5s"
    home = {uid: Path(server.envs[uid]["HOME"]) for uid in (ALICE, BOB)}

    def pausable(uid: int, priority: str, vram: str) -> subprocess.Popen[str]:
        job = ["python3", "-m", "gpuwait", "sim", "job", "--vram", vram, "--hold", "60s"]
        checkpoint = str(home[uid] / f"progress-{priority}.json")
        wrapper = ["--priority", priority, "--pausable", "--vram", vram, "--"]
        return server.start(uid, *wrapper, *job, "--checkpoint", checkpoint)

    def until_gone(uid: int, name: str) -> list[str]:
        return ["sh", "-c", f"while [ ! -e {home[uid] / name} ]; do sleep 0.1; done"]

    def state(uid: int, priority: int) -> object:
        jobs = [j for j in server.jobs() if j["uid"] == uid and j["priority"] == priority]
        return jobs[0]["state"] if jobs else None

    # 21.6 GiB of the card are usable: Alice's 6 GiB beside Bob's other 8 GiB.
    pausable(ALICE, "1", "6G")
    server.start(BOB, "--priority", "2", "--vram", "8G", "--", *until_gone(BOB, "other-done"))
    server.wait_jobs(2, "running")
    server.wait_pausable(ALICE, 1)
    # Bob's 12 GiB fit once Alice's job has stepped aside; it starts.
    pausable(BOB, "3", "12G")
    wait_for(lambda: state(BOB, 3) == "running", timeout=60, message=lambda: server.jobs())
    assert state(ALICE, 1) == "waiting"
    server.wait_pausable(BOB, 3)
    # Bob's urgent job makes his own step aside, and runs until told.
    server.start(BOB, "--priority", "5", "--vram", "12G", "--", *until_gone(BOB, "urgent-done"))
    wait_for(lambda: state(BOB, 5) == "running", timeout=60, message=lambda: server.jobs())
    assert state(BOB, 3) == "waiting"
    # Bob's other job ends: 9.6 GiB free, room for Alice's 6 GiB but not for Bob's 12.
    server.shell(BOB, f"touch {home[BOB] / 'other-done'}")
    wait_for(
        lambda: state(ALICE, 1) == "running",
        timeout=30,
        message=lambda: f"Alice's job never resumed: {server.jobs()}",
    )
    assert state(BOB, 3) == "waiting"


def test_a_waiter_that_saw_another_members_job_start_does_not_wait_for_it_to_start_again(
    server: Server,
) -> None:
    """Alice's waiter stepped aside for Bob's job, which has started since. Once Bob's job steps
    aside in turn for his urgent one, Alice's job waits for room, not for Bob's job to start a
    second time. Bob's gpuwait may not write Alice's entry, and nothing else of hers changes
    meanwhile: a look of hers at the queue that has seen Bob's job run must do it."""
    ensure_state_dir(load_sim_file(server.sim)).chmod(0o1777)
    server.envs[BOB]["GPUWAIT_PAUSE_MIN_RUNTIME"] = "0.5s"
    home = Path(server.envs[BOB]["HOME"])
    job = ["python3", "-m", "gpuwait", "sim", "job", "--vram", "12G", "--hold", "60s"]
    checkpoint = ["--checkpoint", str(home / "progress.json")]
    server.start(BOB, "--priority", "1", "--pausable", "--vram", "12G", "--", *job, *checkpoint)
    server.wait_jobs(1, "running")
    bobs = server.jobs()[0]["id"]
    # 21.6 GiB of the card are usable: Alice's 10 GiB do not fit beside Bob's 12, nor do the
    # 20 GiB of another job of Bob's, ahead of hers, holding the card whatever comes, that
    # asks nobody to step aside who ran less than an hour: nothing of Alice's changes from
    # here on. (Her job, of Bob's job's priority, asks nobody either.)
    server.envs[BOB]["GPUWAIT_PAUSE_MIN_RUNTIME"] = "1h"
    ahead = server.start(BOB, "--priority", "4", "--vram", "20G", "--", "echo", "started")
    server.wait_jobs(2)
    wait_for(lambda: sleeping_in(ahead.pid, "sigtimedwait"))  # planned, and watching
    waiter = server.start(ALICE, "--priority", "1", "--vram", "10G", "--", "echo", "started")
    server.wait_jobs(3)
    wait_for(lambda: sleeping_in(waiter.pid, "sigtimedwait"))

    def stepped_aside(raw: dict[str, Any]) -> None:
        for entry in raw["jobs"]:
            # As Alice's gpuwait writes a job of Bob's: its plain id, and whose it is.
            entry.update(yield_to=bobs, owners={bobs: BOB})

    server.edit_own(ALICE, stepped_aside)

    def alices_reason() -> object:
        status = json.loads(server.run(ALICE, "status", "--json").stdout)
        return next(j for j in status["jobs"] if j["uid"] == ALICE)["waiting_reason"]

    assert "stepped aside" not in str(alices_reason())
    server.envs[BOB]["GPUWAIT_PAUSE_MIN_RUNTIME"] = "0.5s"
    server.wait_pausable(BOB, 1)
    done = home / "urgent-done"
    until = ["sh", "-c", f"while [ ! -e {done} ]; do sleep 0.1; done"]
    server.start(BOB, "--priority", "5", "--vram", "10G", "--", *until)

    def bobs_states() -> dict[object, object]:
        return {j["priority"]: j["state"] for j in server.jobs() if j["uid"] == BOB}

    wait_for(
        lambda: bobs_states() == {1: "waiting", 4: "waiting", 5: "running"},
        timeout=60,
        message=bobs_states,
    )
    reason = str(alices_reason())
    assert "stepped aside" not in reason and "best GPU0 has 11.6 GiB" in reason, reason
    server.shell(BOB, f"touch {done}")


def test_a_file_of_the_single_file_kind_in_a_shared_directory_is_not_believed(
    server: Server,
) -> None:
    # Bob is first, and has a job running when Alice first runs gpuwait there.
    bob = server.start(BOB, "--vram", "1G", "--", "sleep", "30")
    server.wait_jobs(1, "running")
    bob_job = server.ledger().read().jobs[0]
    # The file every member wrote in earlier versions (or one Bob plants as a newcomer's
    # welcome): an entry under Alice's uid naming Bob's live gpuwait, reserving most of the
    # card, and a fair-share usage of Alice's that would put her last for weeks.
    legacy = empty_document()
    legacy["usage"] = {str(ALICE): [5e14, time.time() + 1e9], str(BOB): [1.0, time.time()]}
    legacy["jobs"] = [
        {**bob_job.to_json(), "id": "planted", "uid": ALICE, "reserved_bytes": 20 * GiB}
    ]
    assert server.write_as(BOB, server.ledger_dir / "ledger.json", legacy).returncode == 0
    done = server.run(ALICE, "--vram", "10G", "--timeout", "5s", "--", "true")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    # Nothing of it is taken: Alice's usage is her own runs' alone.
    mine = json.loads(server.own_file(ALICE).read_text())
    assert mine["usage"][str(ALICE)][0] < 1e12
    assert [j.id for j in server.ledger().read().jobs] == [bob_job.id]
    bob.send_signal(signal.SIGTERM)
    bob.wait(timeout=20)


def test_a_members_job_lost_while_root_looks_is_still_met_for_after(server: Server) -> None:
    # Bob's job `prep` dies with its gpuwait (kill -9 of its session), and root looks at the
    # queue before Bob runs gpuwait again: Bob's next gpuwait still learns that it was lost.
    prep = server.start(BOB, "--name", "prep", "--vram", "1G", "--", "sleep", "30")
    server.wait_jobs(1, "running")
    os.killpg(prep.pid, signal.SIGKILL)
    prep.communicate()
    assert server.run_root("status").returncode == 0
    after = server.run(BOB, "-q", "--after", "prep", "--vram", "1G", "--", "true")
    assert after.returncode == 0, after.stderr
    after_ok = server.run(BOB, "-q", "--after-ok", "prep", "--vram", "1G", "--", "true")
    assert after_ok.returncode == 6, after_ok.stderr
    assert "lost" in after_ok.stderr


def test_root_tidies_what_nobody_counts_out_of_a_members_file(server: Server) -> None:
    bob = server.start(BOB, "--vram", "1G", "--", "sleep", "30")
    server.wait_jobs(1, "running")
    live = server.ledger().read().jobs[0].to_json()
    gone = subprocess.Popen(["true"], user=BOB, group=BOB)
    gone.wait()
    uuid = live["gpu_uuids"][0]

    def add(raw: dict[str, Any]) -> None:
        dead = {**live, "id": "dead", "pid": gone.pid, "child_pid": None}
        raw["jobs"] += [pid1_entry(live, uuid, 20 * GiB), dead]

    # Bob's own gpuwait would reap the dead entry at its next usage sample: it is stopped
    # (between two of its transactions, the lock held meanwhile) while root looks.
    with server.locked():
        os.kill(bob.pid, signal.SIGSTOP)
    server.edit_own(BOB, add)
    assert len(json.loads(server.own_file(BOB).read_text())["jobs"]) == 3
    root_env = server.root_env()
    done = subprocess.run(
        ["python3", "-m", "gpuwait", "status"], env=root_env, capture_output=True, timeout=60
    )
    os.kill(bob.pid, signal.SIGCONT)
    assert done.returncode == 0, done.stderr
    tidied = json.loads(server.own_file(BOB).read_text())
    # The entry of a process that is gone is Bob's to reap (and record as lost), not root's.
    assert [j["id"] for j in tidied["jobs"]] == [live["id"], "dead"]
    st = server.own_file(BOB).stat()
    assert (st.st_uid, st.st_gid, oct(st.st_mode & 0o777)) == (BOB, GROUP, "0o640")
    assert server.run(BOB, "status").returncode == 0
    reaped = json.loads(server.own_file(BOB).read_text())
    assert [j["id"] for j in reaped["jobs"]] == [live["id"]]
    bob.send_signal(signal.SIGTERM)
    assert bob.wait(timeout=20) != 0


def test_root_leaves_a_members_file_of_a_newer_gpuwait_as_it_is(server: Server) -> None:
    # Bob's gpuwait is newer than root's: root's tidying read his file as far as this version
    # can and wrote it back in this version's schema, without every entry it could not read
    # (his newer gpuwait's jobs, running ones too) nor what else the newer schema holds.
    gone = subprocess.Popen(["true"], user=BOB, group=BOB)
    gone.wait()
    dead = {"id": "dead", "pid": gone.pid, "start_time": 1, "uid": BOB, "state": "running"}
    newer = {**empty_document(), "schema": 2, "jobs": [dead, {"id": "0123abcd", "in": "v2"}]}
    with server.locked():
        assert server.write_as(BOB, server.own_file(BOB), newer).returncode == 0
    before = server.own_file(BOB).read_bytes()
    done = subprocess.run(
        ["python3", "-m", "gpuwait", "--vram", "1G", "--", "true"],
        env=server.root_env(),
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert server.own_file(BOB).read_bytes() == before


def test_a_shared_directory_of_a_group_one_is_not_in_says_so() -> None:
    # World-writable and sticky, but its group is root's: files there go to that group, which
    # a member of the public cannot give them. The hint says what to do about it, not to free
    # disk space.
    root = shared_root()
    try:
        ledger_dir = make_shared_ledger_dir(root, 0, mode=0o1777)
        sim = root / "sim.toml"
        sim.write_text('[[gpu]]\nmemory = "24GiB"\n')
        sim.chmod(0o644)
        env = {
            "PATH": "/usr/bin:/bin",
            "GPUWAIT_SIM": str(sim),
            "GPUWAIT_LEDGER_DIR": str(ledger_dir),
            **user_home(root, ALICE, ALICE),
        }
        done = run_as(ALICE, ALICE, [], ["--vram", "1G", "--", "true"], env)
        assert done.returncode == 5, done.stderr
        assert "is for group root, which you are not in" in done.stderr
        assert "disk space" not in done.stderr and "Traceback" not in done.stderr
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_what_other_users_finished_over_the_months_costs_no_reader_of_the_queue(
    server: Server,
) -> None:
    """A lab server after months: forty members, each file holding its owner's last hundred
    finished jobs and batches. Nobody's plan reads those (a member's `--after`, batches and
    counters are their own), yet every look at the queue (a launch looks several times) went
    through all four thousand: 28 ms a look instead of 7."""
    pid = os.fork()
    if pid == 0:  # Alice's gpuwait recording her jobs' ends, as she runs them
        try:
            os.setgroups([GROUP])
            os.setgid(ALICE)
            os.setuid(ALICE)
            with server.ledger().transaction() as data:
                for n in range(FINISHED_KEPT):
                    ended = Finished(f"{n:08x}", OK, time.time() - 3600 + n, batch=f"b{n}")
                    data.book.note_finished(ended, ["GPU-0"])
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    months = json.loads(server.own_file(ALICE).read_text())
    assert len(months["book"]["finished"]) == FINISHED_KEPT
    fresh = {**months, "book": {}}
    (server.root / "light").mkdir(mode=0o755)
    light = make_shared_ledger_dir(server.root / "light", GROUP).parent
    for uid in range(ALICE + 10, ALICE + 50):
        for directory, raw in ((server.ledger_dir, months), (light / "ledger", fresh)):
            path = directory / f"ledger.{uid}.json"
            path.write_text(json.dumps(raw))
            os.chown(path, uid, GROUP)
            path.chmod(0o640)

    def look(directory: Path) -> float:
        started = time.thread_time()
        Ledger(directory).read()
        return time.thread_time() - started

    # The CPU time each look takes, the least of nine, taken in turn: on a busy machine the
    # time that passes is the other processes' too, and a look of 25 ms is far likelier to be
    # taken off the CPU than one of 2 ms. Leaving the book unread makes it about 6 times the light
    # one's; read whole, about 22.
    months_looks, light_looks = [], []
    for _ in range(9):
        months_looks.append(look(server.ledger_dir))
        light_looks.append(look(light / "ledger"))
    assert min(months_looks) < 12 * min(light_looks), (min(months_looks), min(light_looks))


def test_a_failing_reading_as_a_waiter_checks_an_admission_found_is_retried(
    server: Server,
) -> None:
    # 20 GiB of the 21.6 usable are held outside gpuwait: Alice's 10 GiB job waits.
    external = hold_outside_gpuwait(server, 20 * GiB)
    server.procs.append(external)  # type: ignore[arg-type]
    waiter = server.start(ALICE, "--vram", "10G", "--", "sh", "-c", "echo started; sleep 30")
    server.wait_jobs(1, "waiting")
    wait_for(lambda: sleeping_in(waiter.pid, "sigtimedwait"))  # planned, and watching
    uuid = load_sim_file(server.sim).gpus[0].uuid
    good = server.sim.read_text()
    server.sim.write_text("[[gpu]\nmemory = ")  # caught half-saved: readings fail for now
    # An admission turns up in her file (an edit here; another waiter's plan alike), and her
    # summary names the job running: her waiter checks it against a reading, which fails.
    server.edit_own(
        ALICE,
        lambda mine: [
            j.update(state="running", gpu_uuids=[uuid], reserved_bytes=10 * GiB)
            for j in mine["jobs"]
        ],
    )
    (job_id,) = [j["id"] for j in server.jobs()]
    summary = {"schema": 1, "release": 99, "running": [job_id], "waiting": []}
    edited = server.ledger_dir / "summary.edit"
    assert server.write_as(ALICE, edited, summary).returncode == 0
    # Put in place as gpuwait puts its summaries, by rename (what the waiters watch for).
    moved = ["mv", str(edited), str(server.ledger_dir / f"wake.{ALICE}.json")]
    subprocess.run(moved, check=True, user=ALICE, group=ALICE, extra_groups=[GROUP])
    time.sleep(1.0)
    assert waiter.poll() is None, "a failed reading must not end the wait"
    # Readings back, the admission is checked, found to have no room, and undone.
    server.sim.write_text(good)
    server.wait_jobs(1, "waiting")
    assert waiter.poll() is None
    waiter.send_signal(signal.SIGTERM)
    out, err = waiter.communicate(timeout=10)
    assert "started" not in out, err
    assert "GPU readings failing, retrying" in err, err


def test_a_waiters_own_stricter_safety_counts_in_another_users_plan(server: Server) -> None:
    # Alice (safety 1.0) runs 10 GiB of the 24 GiB card. Bob waits for 6 GiB at safety 0.5:
    # the card may hold 12 GiB for him, so he starts only once her job (no estimate) has ended.
    # Alice's plans said he started at once: her status showed him due now.
    alice = {**server.envs[ALICE], "GPUWAIT_SAFETY": "1.0"}
    server.procs.append(
        popen_as(
            ALICE,
            ALICE,
            [GROUP],
            ["--vram", "10G", "--", "sleep", "30"],
            alice,
            start_new_session=True,
        )
    )
    server.wait_jobs(1, "running")
    server.start(BOB, "--safety", "0.5", "--vram", "6G", "--", "true")
    server.wait_jobs(2)

    def bobs_eta(uid: int, env: dict[str, str]) -> object:
        shown = run_as(uid, uid, [GROUP], ["status", "--json"], env)
        assert shown.returncode == 0, shown.stderr
        (waiting,) = [j for j in json.loads(shown.stdout)["jobs"] if j["uid"] == BOB]
        return waiting["eta_seconds"]

    assert bobs_eta(ALICE, alice) is None
    assert bobs_eta(BOB, server.envs[BOB]) is None


def test_a_site_config_its_members_cannot_read_says_what_the_administrator_does(
    server: Server,
) -> None:
    # The set-up of docs/shared-servers.md, as root with umask 077 (a hardened server's):
    # `mkdir -p` makes the site config's directory root's alone; the file is then chmod 644.
    server.site_config("user_max_gpus = 1\n")
    site = server.site_dir / "gpuwait"
    config = site / "config.toml"
    site.chmod(0o700)
    done = server.run(ALICE, "--vram", "1G", "--", "true")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    # Neither what she can do about it (the file is root's) nor a file of her own instead
    # (the site's file is read whatever GPUWAIT_CONFIG names): what the administrator runs.
    assert "chmod u+r" not in done.stderr and "GPUWAIT_CONFIG" not in done.stderr
    assert f"an administrator runs: chmod o+rx {site}" in done.stderr
    # The file itself unreadable: the same, naming the file.
    site.chmod(0o755)
    config.chmod(0o600)
    done = server.run(ALICE, "--vram", "1G", "--", "true")
    assert done.returncode == 2, done.stderr
    assert f"an administrator runs: chmod o+r {config}" in done.stderr
    # Made readable as said, her job runs in the shared ledger.
    config.chmod(0o644)
    done = server.run(ALICE, "--vram", "1G", "--", "true")
    assert done.returncode == 0, done.stderr
    assert server.own_file(ALICE).exists()


def start_logged(server: Server, uid: int, *args: str) -> tuple[subprocess.Popen[str], Path]:
    """`server.start`, its stderr in a file the test can read while it runs."""
    log = server.root / f"stderr-{len(server.procs)}"
    with log.open("w") as out:
        proc = popen_as(
            uid, uid, [GROUP], args, server.envs[uid], start_new_session=True, stderr=out
        )
    server.procs.append(proc)
    return proc, log


def test_a_limit_the_administrator_adds_holds_jobs_that_already_wait(server: Server) -> None:
    # Both run until the test ends them: on a slow machine, jobs that ended by themselves
    # could leave the room before the limit was there.
    first = server.start(ALICE, "--vram", "8G", "--", "sleep", "600")
    server.wait_jobs(1, "running")
    bob = server.start(BOB, "--vram", "12G", "--", "sleep", "600")
    server.wait_jobs(2, "running")
    # 20 of the card's 21.6 usable GiB are held: Alice's second job waits, with no limit yet.
    second, log = start_logged(server, ALICE, "--vram", "8G", "--", "echo", "second ran")
    server.wait_jobs(3)
    # The administrator caps what one user holds; then Bob's job ends and leaves room.
    server.site_config('user_max_vram = "12GiB"\n')
    os.killpg(bob.pid, signal.SIGTERM)
    bob.wait(timeout=20)
    # Her second job would take her to 16 GiB: it waits for her first, under the new limit.
    wait_for(
        lambda: "per-user limit" in log.read_text() or second.poll() is not None,
        timeout=20,
        message=lambda: log.read_text(),
    )
    assert second.poll() is None, log.read_text()
    assert [j["state"] for j in server.jobs() if j["uid"] == ALICE] == ["running", "waiting"]
    # The limit lowered below what it asks alone: it can never run, and says so (exit 3).
    server.site_config('user_max_vram = "4GiB"\n')
    assert second.wait(timeout=20) == 3, log.read_text()
    assert "per-user limit" in log.read_text() and "Traceback" not in log.read_text()
    assert "second ran" not in (second.stdout.read() if second.stdout else "")
    # What already runs is not touched: her first job (over the limit now) runs on.
    assert first.poll() is None
    assert [j["state"] for j in server.jobs()] == ["running"]
    first.kill()


def test_root_sees_whose_jobs_hold_the_card_and_whose_wait(server: Server) -> None:
    server.start(ALICE, "--vram", "15G", "--name", "train", "--", "sleep", "30")
    server.wait_jobs(1, "running")
    server.start(BOB, "--vram", "15G", "--name", "eval", "--", "sleep", "30")
    server.wait_jobs(2)
    # Bob asks why his job does not start: it waits for the job that holds GPU0, and the
    # administrator's `gpuwait status` says whose that is, beside each job.
    done = server.run_root("status")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    running = lines.index("Running (1)")
    assert "USER" in lines[running + 1].split()
    assert {"train", str(ALICE)} <= set(lines[running + 2].split()), done.stdout
    queue = lines.index("Queue (1)")
    assert "USER" in lines[queue + 1].split()
    assert {"eval", str(BOB)} <= set(lines[queue + 2].split()), done.stdout


def test_a_name_two_users_give_their_jobs_cancels_only_ones_own(server: Server) -> None:
    server.start(ALICE, "--vram", "20G", "--", "sleep", "30")
    server.wait_jobs(1, "running")
    alices = server.start(ALICE, "--vram", "20G", "--name", "train", "--", "true")
    bobs = server.start(BOB, "--vram", "20G", "--name", "train", "--", "true")
    server.wait_jobs(3)
    # Root, asked to cancel "train", cannot tell which student's is meant: nothing is
    # cancelled, and it is told to name the job by its id.
    root = server.run_root("cancel", "train")
    assert root.returncode == 2, root.stderr
    assert "jobs of 2 users are named train" in root.stderr and "by its id" in root.stderr
    assert alices.poll() is None and bobs.poll() is None
    # Alice cancels her "train": hers goes, and she is not told off about Bob's.
    done = server.run(ALICE, "cancel", "train")
    assert done.returncode == 0, done.stderr
    assert "cannot be cancelled" not in done.stderr, done.stderr
    assert alices.wait(timeout=20) == 7
    assert bobs.poll() is None
    assert [(j["uid"], j["name"]) for j in server.jobs() if j["state"] == "waiting"] == [
        (BOB, "train")
    ]
    # Now one user's name: root cancels it by name, as before.
    root = server.run_root("cancel", "train")
    assert root.returncode == 0, root.stderr
    assert bobs.wait(timeout=20) == 7


def test_a_member_who_left_long_ago_is_no_row_of_the_users_for_ever(server: Server) -> None:
    # Bob ran his last job two months ago and left (his account removed): his file, with what
    # he used, stays in the shared directory, and nobody's gpuwait writes it again.
    long_ago = time.time() - 60 * 86400

    def left(raw: dict[str, Any]) -> None:
        raw["usage"] = {str(BOB): [5e14, long_ago]}

    server.edit_own(BOB, left)
    server.start(ALICE, "--vram", "1G", "--", "sleep", "30")
    server.wait_jobs(1, "running")
    report = json.loads(server.run_root("status", "--json").stdout)
    assert [u["uid"] for u in report["users"]] == [ALICE]
    assert str(BOB) not in server.run_root("status").stdout
    # One who used the cards yesterday is still shown, jobs or none.
    server.edit_own(BOB, lambda raw: raw.update(usage={str(BOB): [5e14, time.time() - 86400]}))
    report = json.loads(server.run_root("status", "--json").stdout)
    assert [u["uid"] for u in report["users"]] == [ALICE, BOB]


def test_a_name_two_users_give_their_jobs_orders_only_ones_own(server: Server) -> None:
    # Alice's "prep" ran and succeeded; Bob happens to run a job he too calls "prep".
    assert server.run(ALICE, "--vram", "1G", "--name", "prep", "--", "true").returncode == 0
    server.start(BOB, "--vram", "1G", "--name", "prep", "--", "sleep", "60")
    server.wait_jobs(1, "running")
    # Her next step, after her own prep, starts at once: it neither waits for Bob's job nor
    # fails (exit 6) once his ends.
    fit = server.run(ALICE, "--vram", "1G", "--after-ok", "prep", "--", "echo", "fit", timeout=10)
    assert (fit.returncode, fit.stdout) == (0, "fit\n"), fit.stderr
    # With her own "prep" still running, "--after prep" waits for hers, not for his.
    server.start(ALICE, "--vram", "1G", "--name", "prep", "--", "sleep", "0.5")
    server.wait_jobs(2, "running")
    after = server.run(ALICE, "--vram", "1G", "--after", "prep", "--", "echo", "next", timeout=10)
    assert (after.returncode, after.stdout) == (0, "next\n"), after.stderr


def test_after_ok_on_another_users_job_is_refused_at_once(server: Server) -> None:
    # Only Bob's gpuwait learns how his job ends: Alice's job, told to start once it succeeded,
    # waited for it and then gave up as if it had failed (exit 6), whatever it did.
    server.start(BOB, "--vram", "1G", "--name", "prep", "--", "sleep", "60")
    server.wait_jobs(1, "running")
    done = server.run(ALICE, "--vram", "1G", "--after-ok", "prep", "--", "true", timeout=10)
    assert done.returncode == 2, done.stderr
    assert f"is uid {BOB}'s" in done.stderr and "--after waits for it" in done.stderr
    assert [j["uid"] for j in server.jobs()] == [BOB]


@pytest.mark.parametrize("long_ago", [False, True])
def test_a_member_who_gives_an_entry_the_id_of_ones_ended_job_holds_up_no_chain(
    server: Server, long_ago: bool
) -> None:
    # Alice's `prep` ran and succeeded. Bob, who reads her file, writes an entry under its id
    # into his own, naming his live gpuwait: her next step waited on it as if her prep still
    # ran (`--after`), or was refused as if she had named a job of his (`--after-ok`); so it
    # was for a prep so long ago that only her history knows it (her book keeps the last
    # hundred), with --after-ok.
    assert server.run(ALICE, "-q", "--vram", "1G", "--name", "prep", "--", "true").returncode == 0
    book = json.loads(server.own_file(ALICE).read_text())["book"]
    prep = next(f["id"] for f in book["finished"] if f["name"] == "prep")
    if long_ago:
        server.edit_own(ALICE, lambda raw: raw["book"].update(finished=[]))
    server.start(BOB, "--vram", "1G", "--", "sleep", "60")
    server.wait_jobs(1, "running")
    bobs = server.ledger().read().jobs[0].to_json()
    forged = {**bobs, "id": prep, "name": "prep", "state": "waiting", "gpu_uuids": []}
    server.edit_own(BOB, lambda raw: raw.update(jobs=[forged, *raw["jobs"]]))
    for option in ("--after-ok", "--after"):
        done = server.run(
            ALICE, "--vram", "1G", "--timeout", "3s", option, prep, "--", "echo", "next"
        )
        assert (done.returncode, done.stdout) == (0, "next\n"), (option, done.stderr)


def older_gpuwait_waiting(server: Server, uid: int, *args: str) -> subprocess.Popen[str]:
    """A gpuwait of `uid`'s from before an upgrade, waiting to run ARGS' command (after
    `--`): its command line, and nothing that plans or starts anything."""
    older = subprocess.Popen(
        ["sh", "-c", "sleep 60; exit", "gpuwait", *args],
        user=uid,
        group=uid,
        extra_groups=[GROUP],
        start_new_session=True,
        text=True,
    )
    server.procs.append(older)
    return older


def alices_prep_runs(server: Server) -> str:
    """Alice's job `prep` runs (a minute); its id."""
    server.start(ALICE, "--vram", "1G", "--name", "prep", "--", "sleep", "60")
    server.wait_jobs(1, "running")
    return str(server.jobs()[0]["id"])


def test_a_step_an_older_gpuwait_queued_on_anothers_job_still_waits_for_it(
    server: Server,
) -> None:
    # Bob's step waits for Alice's prep ('--after ID'), queued by the gpuwait he had before
    # he upgraded, which kept her job's id as his view showed it: plain. The first job his
    # new gpuwait ran marked that step as started at once, beside her prep, still running.
    prep = alices_prep_runs(server)
    step = ["sh", "-c", "echo step"]
    older = older_gpuwait_waiting(server, BOB, "--after", prep, "--vram", "1G", "--", *step)
    queued = live_job(
        "step", older.pid, uid=BOB, command=step, after=[prep], request={"bytes": GiB}
    ).to_json()
    del queued["owners"]  # which that gpuwait knew nothing of
    server.edit_own(BOB, lambda raw: raw["jobs"].append(queued))
    done = server.run(BOB, "--vram", "1G", "--", "echo", "ran")
    assert (done.returncode, done.stdout) == (0, "ran\n"), done.stderr
    shown = server.run(BOB, "status")
    assert f"waiting for job {prep} (prep) to finish" in shown.stdout, shown.stdout
    assert {(j["id"], j["state"]) for j in server.jobs()} == {
        (prep, "running"),
        ("step", "waiting"),
    }


def test_a_step_on_anothers_job_is_written_so_that_an_older_gpuwait_waits_for_it(
    server: Server,
) -> None:
    # Bob, upgraded, queues a step after Alice's prep, still running. Alice (or Bob's own
    # launches from before he upgraded) plan with an older gpuwait, which reads the step's
    # dependency by the plain id its view shows: written as ID@UID, it was one whose job had
    # ended to them, and their jobs that fitted beside her prep waited behind the step, which
    # could not start, for as long as her prep ran.
    prep = alices_prep_runs(server)
    server.start(BOB, "--after", prep, "--vram", "1G", "--", "echo", "step")
    server.wait_jobs(2)
    (written,) = json.loads(server.own_file(BOB).read_text())["jobs"]
    assert written["after"] == [prep]
    # ... and as this version keeps it: that job of hers, whoever takes its id.
    (bobs,) = [j for j in server.jobs() if j["uid"] == BOB]
    assert bobs["after"] == [f"{prep}@{ALICE}"]


@pytest.mark.parametrize("orphaned", [False, True], ids=["running", "said-orphaned"])
def test_a_member_cannot_name_anothers_process_as_the_holder_of_their_unused_room(
    server: Server, orphaned: bool
) -> None:
    # The card does no work. Bob's running entry names, as its command, a process of Alice's
    # that holds nothing there: `gpuwait idle` blamed Alice for Bob's 20 GiB left unused. So
    # too where the entry said its gpuwait was gone (an orphan's command, and what runs below
    # it, are its job's), though that gpuwait lives.
    server.sim.write_text('[[gpu]]\nmemory = "24GiB"\nutilization = 0\n')
    alices = subprocess.Popen(["sleep", "60"], user=ALICE, group=ALICE)
    try:
        server.start(BOB, "--vram", "1G", "--", "sleep", "60")
        server.wait_jobs(1, "running")
        bobs = server.ledger().read().jobs[0].to_json()
        forged = {
            **bobs,
            "id": "blame",
            "child_pid": alices.pid,
            "child_start_time": start_time(alices.pid),
            "pids": [alices.pid],
            "reserved_bytes": 20 * GiB,
            "orphaned_at": time.time() if orphaned else None,
        }
        server.edit_own(BOB, lambda raw: raw.update(jobs=[forged, *raw["jobs"]]))
        shown = server.run_root("idle", "--json", GPUWAIT_IDLE_AFTER="1h")
        assert shown.returncode == 0, shown.stderr
        report = json.loads(shown.stdout)
        named = [(h["pid"], h["uid"]) for h in report["idle"] + report["watching"]]
        assert (alices.pid, ALICE) not in named, report
    finally:
        alices.kill()
        alices.wait()


def bob_claims(server: Server, pid: int, *options: str, as_command: bool = False) -> None:
    """Bob runs a job (with `options`) and lists process `pid` among its processes in his
    own file, his gpuwait stopped between two of its transactions first: its next sample
    would write the processes it finds over the list. `as_command`: names it as the job's
    command too, and says the job's gpuwait is gone (an orphan's command is its job's)."""
    bob = server.start(BOB, *options, "--vram", "1G", "--", "sleep", "60")
    server.wait_jobs(1, "running")
    with server.locked():
        os.kill(bob.pid, signal.SIGSTOP)

    def claim(raw: dict[str, Any]) -> None:
        raw["jobs"][0]["pids"] = [*raw["jobs"][0]["pids"], pid]
        if as_command:
            raw["jobs"][0].update(
                child_pid=pid, child_start_time=start_time(pid), orphaned_at=time.time()
            )

    server.edit_own(BOB, claim)


@pytest.mark.parametrize("as_command", [False, True], ids=["a-process", "an-orphans-command"])
def test_a_member_cannot_claim_anothers_process_off_a_card_that_takes_one_at_a_time(
    server: Server, as_command: bool
) -> None:
    # GPU 0 takes one process at a time, and a program of Alice's, run without gpuwait, has
    # it. Bob's job on GPU 1 claims that program among its processes in his own file: a job
    # was then started on GPU 0 as if nothing held it, where it could not run. So too where
    # his entry named it as its command and said its gpuwait was gone, though it lives.
    exclusive = '[[gpu]]\nmemory = "24GiB"\ncompute_mode = "exclusive-process"\n'
    server.sim.write_text(exclusive + '[[gpu]]\nmemory = "24GiB"\n')
    alices = hold_outside_gpuwait(server, 2 * GiB, ALICE)
    try:
        bob_claims(server, alices.pid, "--devices", "1", as_command=as_command)
        done = server.run(
            ALICE, "--devices", "0", "--vram", "1G", "--timeout", "1s", "--", "echo", "started"
        )
        assert done.returncode == 124 and "started" not in done.stdout, done.stderr
    finally:
        alices.kill()
        alices.wait()


def test_a_member_claiming_anothers_process_keeps_them_from_adopting_it_no_more(
    server: Server,
) -> None:
    # A program of Alice's, run without gpuwait, holds 2 GiB; Bob lists it among his job's
    # processes in his own file. Her `gpuwait adopt` of it was refused: "process ... already
    # belongs to gpuwait job" (Bob's).
    alices = hold_outside_gpuwait(server, 2 * GiB, ALICE)
    try:
        bob_claims(server, alices.pid)
        adopted = server.run(ALICE, "adopt", str(alices.pid))
        assert adopted.returncode == 0, adopted.stderr
        assert sorted(j["uid"] for j in server.jobs()) == [ALICE, BOB]
    finally:
        alices.kill()
        alices.wait()


def bobs_program_in_the_queue(
    server: Server, python: str, extra: Sequence[str | bytes] = ()
) -> subprocess.Popen[str]:
    """Bob's Python program running `python` (which waits in gpuwait.reserve), given the
    arguments `extra`, once its entry is in his file."""
    argv = [*program_as(BOB, BOB, [GROUP], server.root, python), *extra]
    bob = subprocess.Popen(
        argv,
        env=server.envs[BOB],
        cwd="/",
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    server.procs.append(bob)
    wait_for(
        lambda: (
            server.own_file(BOB).exists() and json.loads(server.own_file(BOB).read_text())["jobs"]
        ),
        timeout=20,
    )
    return bob


@pytest.mark.parametrize(
    "extra",
    [
        (),
        ("x" * 5000,),
        (b"caf\xe9.csv",),
        tuple(
            f"/datasets/laion-2b-en/webdataset/train/part-{i // 100:03}/laion2b-en-{i:06}.tar"
            for i in range(1000)
        ),
    ],
    ids=["plain", "a-long-argument", "a-file-name-in-latin-1", "over-64-KiB-of-arguments"],
)
def test_a_members_program_waiting_for_room_from_python_is_in_everyones_queue(
    server: Server, extra: tuple[str | bytes, ...]
) -> None:
    # Bob's notebook waits in `gpuwait.reserve("10G")` behind Alice's 20 GiB job. Its entry
    # names his Python program, no gpuwait: Alice's plans and `status` (and root's) did not see
    # it at all, so her jobs submitted after it went first, and root's `status` even took it
    # out of Bob's file. So too where his program was given an argument over 4 KiB (`python -c
    # "$(cat job.py)"`, a config inline), which its entry keeps cut: that never equalled the
    # command line the kernel shows; nor where an argument was no UTF-8 (a file name in
    # Latin-1), which Python and the kernel's command line, read as text, spelt apart; nor
    # where its arguments came to more than 64 KiB (xargs handing it 900 shards), of which
    # the kernel's command line was read no further.
    server.start(ALICE, "--vram", "20G", "--", "sleep", "60")
    server.wait_jobs(1, "running")
    python = "r = gpuwait.reserve('10G'); print('got', flush=True); signal.pause()"
    bobs_program_in_the_queue(server, python, extra)
    shown = json.loads(server.run(ALICE, "status", "--json").stdout)
    assert [(j["uid"], j["state"]) for j in shown["jobs"]] == [
        (ALICE, "running"),
        (BOB, "waiting"),
    ], shown["jobs"]
    assert server.run_root("status").returncode == 0
    assert len(json.loads(server.own_file(BOB).read_text())["jobs"]) == 1


def test_roots_status_leaves_a_members_program_that_set_its_own_title_waiting(
    server: Server,
) -> None:
    # Bob's server waits in `gpuwait.reserve("10G")` behind Alice's 20 GiB job, under a
    # process title of its own (as gunicorn's workers set): its command line is not the one
    # its entry keeps, so the others do not see it waiting. Root's `gpuwait status` took its
    # entry out of Bob's file, as one naming nobody of his, and Bob's program gave up,
    # cancelled, though it was his own and still waiting.
    alice = server.start(ALICE, "--vram", "20G", "--", "sleep", "60")
    server.wait_jobs(1, "running")
    python = (
        "sys.orig_argv = ['gunicorn: worker [serve:app]']\n"
        "try:\n"
        "    r = gpuwait.reserve('10G')\n"
        "except BaseException as e:\n"
        "    print('gave up', type(e).__name__, e, flush=True)\n"
        "    raise SystemExit(1)\n"
        "print('got', flush=True)\n"
        "signal.pause()"
    )
    bob = bobs_program_in_the_queue(server, python)
    assert server.run_root("status").returncode == 0
    assert len(json.loads(server.own_file(BOB).read_text())["jobs"]) == 1
    # Still waiting for its room, not cancelled: it gets it once Alice's job ends.
    os.killpg(alice.pid, signal.SIGTERM)
    assert bob.stdout is not None
    assert bob.stdout.readline() == "got\n", bob.communicate()


def test_a_members_program_admitted_from_python_keeps_its_room_before_it_is_started(
    server: Server,
) -> None:
    # Bob's program, waiting in `gpuwait.reserve("12G")`, has been admitted: its entry runs
    # with 12 GiB on the card, and names it as its gpuwait, not yet as its command (that is
    # the next transaction's, `started`). Nobody else counted that room: Alice's 12 GiB job
    # was started beside it, on a 24 GiB card, and one of the two ran out of memory.
    argv = program_as(BOB, BOB, [GROUP], server.root, "signal.pause()")
    bob = subprocess.Popen(argv, env=server.envs[BOB], cwd="/", start_new_session=True)
    server.procs.append(bob)  # type: ignore[arg-type]
    # Bob's once it has switched to him (it starts as root, to read this checkout).
    wait_for(lambda: owner_uid(bob.pid) == BOB and proc_command(bob.pid) == argv)
    now = time.time()
    admitted = Job(
        id="notebook",
        pid=bob.pid,
        start_time=start_time(bob.pid) or 0,
        uid=BOB,
        command=argv,
        cwd="/",
        request={"bytes": 12 * GiB},
        state="running",
        gpu_uuids=[load_sim_file(server.sim).gpus[0].uuid],
        reserved_bytes=12 * GiB,
        submitted_at=now,
        started_at=now,
        updated_at=now,
    )
    server.edit_own(BOB, lambda raw: raw.update(jobs=[admitted.to_json()]))
    done = server.run(ALICE, "--vram", "12G", "--timeout", "1s", "--", "echo", "started")
    assert done.returncode == 124 and "started" not in done.stdout, done.stderr


def test_a_job_whose_command_is_a_setuid_program_is_named_for_its_unused_room(
    server: Server,
) -> None:
    # Alice's job runs its command through sudo (here: a set-user-ID copy of sleep), which
    # runs as root below her gpuwait and holds nothing on a quiet card: `gpuwait idle` named
    # nobody for her 20 GiB left unused, as if the command were someone else's process.
    server.sim.write_text('[[gpu]]\nmemory = "24GiB"\nutilization = 0\n')
    setuid_sleep = server.root / "sudo-sleep"
    shutil.copy("/bin/sleep", setuid_sleep)
    setuid_sleep.chmod(0o4755)
    server.start(ALICE, "--vram", "20G", "--", str(setuid_sleep), "60")
    job = wait_for(
        lambda: next((j for j in server.ledger().read().jobs if j.child_pid), None),
        message="the job's command to start",
    )
    command = job.child_pid
    wait_for(lambda: owner_uid(command) == 0, message="the command to run as root")
    shown = server.run(ALICE, "idle", "--json", prefix=["env", "GPUWAIT_IDLE_AFTER=1h"])
    assert shown.returncode == 0, shown.stderr
    report = json.loads(shown.stdout)
    named = [(h["pid"], h["job"]) for h in report["idle"] + report["watching"]]
    assert (command, job.id) in named, report


@pytest.mark.parametrize(
    "command",
    [["python", "infer.py"], [], {"0": "python"}, ["python", 5], "python infer.py"],
    ids=["another-command", "no-command", "a-mapping", "a-number-in-it", "a-string"],
)
def test_a_members_waiting_entry_naming_a_gpuwait_that_runs_no_such_job_holds_up_nobody(
    server: Server, command: object
) -> None:
    # Bob's file has a waiting entry asking 20 GiB, first in the queue, that names his
    # `gpuwait status --watch` as its gpuwait: nothing will ever start it. Alice's 6 GiB job
    # waited behind it on a card where only Bob's 1 GiB ran, for as long as it was there.
    # So too where he wrote it no command, or one that is no list of words: it neither holds
    # her up nor stops her gpuwait as it reads his file.
    server.start(BOB, "--vram", "1G", "--", "sleep", "60")
    server.wait_jobs(1, "running")
    watch = server.start(BOB, "status", "--watch")
    wait_for(lambda: "status" in (proc_command(watch.pid) or []), timeout=20)
    bobs = server.ledger().read().jobs[0].to_json()
    never = {
        **bobs,
        "id": "never",
        "pid": watch.pid,
        "start_time": start_time(watch.pid),
        "state": "waiting",
        "command": command,
        "request": {"bytes": 20 * GiB},
        "gpu_uuids": [],
        "reserved_bytes": 0,
        "pids": [],
        "child_pid": None,
        "child_start_time": None,
        "started_at": None,
        "started_boot": None,
        "submitted_at": bobs["submitted_at"] - 60,
    }
    server.edit_own(BOB, lambda raw: raw.update(jobs=[never, *raw["jobs"]]))
    done = server.run(ALICE, "--vram", "6G", "--timeout", "3s", "--", "echo", "started")
    assert (done.returncode, done.stdout) == (0, "started\n"), done.stderr
    shown = json.loads(server.run(ALICE, "status", "--json").stdout)
    assert "never" not in [j["id"] for j in shown["jobs"]]


#: A third member, whose uid is below the others'.
CAROL = 47199


def carol_takes_the_id(server: Server, job_id: str) -> None:
    """Carol runs a job, and gives its entry in her own file the id `job_id`, her gpuwait
    stopped first (its next transaction would not find its job)."""
    server.envs[CAROL] = {**server.envs[ALICE], **user_home(server.root, CAROL, CAROL)}
    carol = server.start(CAROL, "--vram", "1G", "--", "sleep", "60")
    wait_for(lambda: any(j["uid"] == CAROL for j in server.jobs()), timeout=20)
    server.wait_jobs(2, "running")
    with server.locked():
        os.kill(carol.pid, signal.SIGSTOP)
    server.edit_own(CAROL, lambda raw: raw["jobs"][0].update(id=job_id))


def test_a_member_who_gives_an_entry_the_id_of_anothers_job_takes_no_chain_on_it(
    server: Server,
) -> None:
    # Alice's next step waits for Bob's job (`--after ID`). Carol, whose uid is lower, gives
    # an entry of hers that id: hers was then shown with the plain id, Bob's as ID@UID, and
    # Alice's step waited for Carol's job, long after Bob's had ended.
    bob = server.start(BOB, "--vram", "1G", "--", "sleep", "60")
    server.wait_jobs(1, "running")
    bobs = server.jobs()[0]["id"]
    assert isinstance(bobs, str)
    alice = server.start(ALICE, "--vram", "1G", "--after", bobs, "--", "echo", "next")
    server.wait_jobs(2)
    carol_takes_the_id(server, bobs)
    # Named now, the id is of two users' jobs: which one is meant, Alice is asked.
    done = server.run(ALICE, "--vram", "1G", "--timeout", "1s", "--after", bobs, "--", "true")
    assert done.returncode == 2 and f"{bobs}@{BOB}" in done.stderr, done.stderr
    assert f"{bobs}@{CAROL}" in done.stderr and "Traceback" not in done.stderr
    os.killpg(bob.pid, signal.SIGTERM)
    out, err = alice.communicate(timeout=20)
    assert (alice.returncode, out) == (0, "next\n"), err


@pytest.mark.parametrize("whose", [BOB, ALICE], ids=["his-own", "hers"])
def test_a_members_step_after_a_running_job_keeps_nobody_waiting(
    server: Server, whose: int
) -> None:
    # Bob's step waits for a running job (`--after`), his own or Alice's; her 10 GiB job fits
    # beside it. Her gpuwait read his step's dependency as hers would be kept, found it met,
    # and waited behind a step that could not start.
    server.site_config('fair_share_half_life = "none"\n')  # first come, first served
    first = server.start(whose, "--vram", "10G", "--name", "prep", "--", "sleep", "60")
    server.wait_jobs(1, "running")
    server.start(BOB, "--vram", "10G", "--after", "prep", "--", "sleep", "60")
    server.wait_jobs(2)
    done = server.run(ALICE, "--vram", "10G", "--timeout", "3s", "--", "echo", "started")
    assert (done.returncode, done.stdout) == (0, "started\n"), done.stderr
    assert first.poll() is None
    shown = json.loads(server.run(ALICE, "status", "--json").stdout)
    assert [j["state"] for j in shown["jobs"]] == ["running", "waiting"], shown


def test_a_members_entry_naming_a_gpuwait_of_a_long_repeating_command_line_hangs_nobody(
    server: Server,
) -> None:
    # Bob's gpuwait runs a command of 40 000 words alike, and his file has a waiting entry,
    # first in it, that names that gpuwait with another command beginning with that word.
    # Each read of the ledger compared the entry's command with the line from each of those
    # words on, 40 000 times 40 000 of them: Alice's `gpuwait status` (and every plan of her
    # waiting jobs) took minutes, for as long as the entry was there.
    words = ["zz"] * 40_000
    server.start(BOB, "--vram", "1G", "--", "sh", "-c", "sleep 60", *words)
    server.wait_jobs(1, "running")
    bobs = server.ledger().read().jobs[0].to_json()
    never = {**bobs, "id": "never", "state": "waiting", "command": ["zz", "never"]}
    never.update(gpu_uuids=[], reserved_bytes=0, pids=[], child_pid=None, started_at=None)
    server.edit_own(BOB, lambda raw: raw.update(jobs=[never, *raw["jobs"]]))
    started = time.monotonic()
    shown = server.run(ALICE, "status", "--json", timeout=20)
    assert shown.returncode == 0, shown.stderr
    assert time.monotonic() - started < 10
    assert "never" not in [j["id"] for j in json.loads(shown.stdout)["jobs"]]


def test_a_members_waiting_job_with_a_long_command_line_is_in_everyones_queue(
    server: Server,
) -> None:
    # Bob's job waits behind Alice's 20 GiB job, handed 300 file names of 90 characters
    # (27 KB of command line): his entry keeps its arguments up to about 8 KiB, the rest
    # counted in one last item. Alice's gpuwait looked for that cut command as many words
    # from the end of his gpuwait's command line as the entry has items, not as many as it
    # stands for: it never found it, and left his job out of her queue, her jobs first.
    server.start(ALICE, "--vram", "20G", "--", "sleep", "60")
    server.wait_jobs(1, "running")
    shards = [f"/data/shard-{n:05d}-" + "x" * 74 for n in range(300)]
    server.start(BOB, "--vram", "10G", "--", "sleep", "60", *shards)
    wait_for(lambda: server.own_file(BOB).exists(), timeout=20)
    wait_for(lambda: json.loads(server.own_file(BOB).read_text())["jobs"], timeout=20)
    bobs = json.loads(server.own_file(BOB).read_text())["jobs"]
    assert bobs[0]["command"][-1] == f"… {302 - len(bobs[0]['command']) + 1} more arguments"
    shown = json.loads(server.run(ALICE, "status", "--json").stdout)
    assert [(j["uid"], j["state"]) for j in shown["jobs"]] == [
        (ALICE, "running"),
        (BOB, "waiting"),
    ], shown["jobs"]


def test_a_long_command_line_an_older_gpuwait_keeps_whole_is_in_everyones_queue(
    server: Server,
) -> None:
    # Bob has not upgraded: his gpuwait waits behind Alice's 20 GiB job with 300 file names
    # of 90 characters, and keeps them all in its entry, as gpuwait did before an entry kept
    # about 8 KiB of arguments. Alice's upgraded gpuwait cut his gpuwait's command line as it
    # now cuts one, which never equalled his entry's: his job was in nobody's queue but his.
    server.start(ALICE, "--vram", "20G", "--", "sleep", "60")
    server.wait_jobs(1, "running")
    command = ["sleep", "60", *(f"/data/shard-{n:05d}-" + "x" * 74 for n in range(300))]
    older = older_gpuwait_waiting(server, BOB, "--vram", "10G", "--", *command)
    wait_for(lambda: len(proc_command(older.pid) or []) > len(command), timeout=20)
    queued = live_job("older", older.pid, uid=BOB, command=command, request={"bytes": 10 * GiB})
    written = queued.to_json()
    del written["owners"]  # which that gpuwait knew nothing of
    server.edit_own(BOB, lambda raw: raw["jobs"].append(written))
    shown = json.loads(server.run(ALICE, "status", "--json").stdout)
    assert [(j["uid"], j["state"]) for j in shown["jobs"]] == [
        (ALICE, "running"),
        (BOB, "waiting"),
    ], shown["jobs"]


def test_a_members_job_another_members_plan_starts_starts_at_once_whatever_their_interval(
    server: Server,
) -> None:
    # Two cards. Bob reads the GPUs once a minute (nvml_interval); his job waits for room on
    # GPU0, where a process outside gpuwait holds 20 GiB; Alice's urgent job waits for her
    # own on GPU1. The outside process ends: Alice's plan started Bob's job, but with nothing
    # of hers to write it told him nothing, and his job started at his next reading, up to a
    # minute later, while from 30 s on her plans passed it over: a job of hers coming then
    # would have taken the room before it.
    server.sim.write_text('[[gpu]]\nmemory = "24GiB"\n[[gpu]]\nmemory = "24GiB"\n')
    external = hold_outside_gpuwait(server, 20 * GiB)
    server.procs.append(external)  # type: ignore[arg-type]
    server.start(ALICE, "--devices", "1", "--vram", "20G", "--", "sleep", "600")
    server.wait_jobs(1, "running")
    slow = {**server.envs[BOB], "GPUWAIT_NVML_INTERVAL": "60s"}
    argv = ["--vram", "12G", "--", "echo", "bob ran"]
    bob = popen_as(BOB, BOB, [GROUP], argv, slow, start_new_session=True)
    server.procs.append(bob)
    server.wait_jobs(1, "waiting")
    server.start(ALICE, "--devices", "1", "--priority", "5", "--vram", "20G", "--", "true")
    server.wait_jobs(2, "waiting")
    # Bob's gpuwait has read the GPUs and sleeps until its next reading, a minute away.
    wait_for(lambda: sleeping_in(bob.pid, "sigtimedwait"))
    external.kill()
    external.wait()
    out, err = bob.communicate(timeout=15)
    assert (bob.returncode, out) == (0, "bob ran\n"), err


@pytest.mark.parametrize("victim", [ALICE, 0])
def test_a_member_cannot_make_another_members_gpuwait_delete_files_through_their_alive_dir(
    server: Server, victim: int
) -> None:
    # Bob plants a symlink named for Alice's (or root's) liveness-lock directory before its
    # owner's first job there, pointing at a directory of theirs. Their gpuwait, tidying up
    # the locks of its ended jobs, deleted every file in it (root's: any directory at all).
    precious = server.root / f"precious-{victim}"
    precious.mkdir(mode=0o700)
    (precious / "thesis.tex").write_text("years of work\n")
    os.chown(precious, victim, victim)
    os.chown(precious / "thesis.tex", victim, victim)
    planted = server.shell(BOB, f"ln -s '{precious}' '{server.ledger_dir}/alive.{victim}'")
    assert planted.returncode == 0, planted.stderr
    if victim == ALICE:
        done = server.run(ALICE, "--vram", "1G", "--", "true")
    else:
        done = server.run_root("--vram", "1G", "--", "true")
    assert done.returncode == 0, done.stderr
    assert (precious / "thesis.tex").read_text() == "years of work\n"


@pytest.mark.parametrize("freed", [False, True], ids=["kept", "freed"])
def test_a_liveness_lock_directory_another_member_made_first_still_keeps_a_members_jobs_counted(
    server: Server, freed: bool
) -> None:
    # Bob makes a directory named for Alice's liveness locks before her first job. Her jobs
    # then held no lock, and once her own file was damaged and started afresh, her next job
    # was admitted at once into the room her running job had reserved. Freed: Bob removes his
    # once her job runs; her gpuwait went back to the freed name, found no lock of the running
    # job there, and admitted the next job just the same.
    squatted = server.ledger_dir / f"alive.{ALICE}"
    made = server.shell(BOB, f"mkdir -m 755 '{squatted}'")
    assert made.returncode == 0, made.stderr
    first = server.start(ALICE, "--vram", "15G", "--", "sleep", "600")
    server.wait_jobs(1, "running")
    with server.locked():  # stopped outside a transaction
        os.kill(first.pid, signal.SIGSTOP)
        wait_for(lambda: process_state(first.pid) == "T", timeout=10)
    if freed:
        removed = server.shell(BOB, f"rmdir '{squatted}'")
        assert removed.returncode == 0, removed.stderr
    damaged = server.shell(ALICE, f"cat > '{server.own_file(ALICE)}'", '{"schema": 1, "jobs": [')
    assert damaged.returncode == 0, damaged.stderr
    second = server.start(ALICE, "--vram", "15G", "--", "true")

    def waits() -> bool:
        entries = [j for j in server.jobs() if j["uid"] == ALICE and j["state"] == "waiting"]
        return bool(entries) and sleeping_in(second.pid, "sigtimedwait")

    wait_for(lambda: waits() or second.poll() is not None, timeout=30)
    assert second.poll() is None, "the second job ran in the room of the first"
    os.killpg(first.pid, signal.SIGKILL)
    _, err = second.communicate(timeout=60)
    assert second.returncode == 0, err
    assert "the ledger was started afresh after damage; 1 job of yours still running" in err
    assert freed or list(squatted.iterdir()) == []  # nothing of Alice's in Bob's directory


def test_a_members_entry_naming_someone_elses_process_counts_at_no_later_look_either(
    server: Server,
) -> None:
    # Bob's file has a running entry reserving 20 GiB that names a process of root's, no
    # gpuwait and not his. Alice's 6 GiB job waits behind her own 18 GiB job and starts once
    # that ends: Bob's entry counted for nothing at its first look, nor at any later one.
    holder = server.start(ALICE, "--vram", "18G", "--", "sleep", "60")
    server.wait_jobs(1, "running")
    roots = subprocess.Popen(["sleep", "60"], start_new_session=True)
    server.procs.append(roots)  # type: ignore[arg-type]
    alices = server.ledger().read().jobs[0].to_json()
    began = start_time(roots.pid)
    forged = {**alices, "id": "forged", "uid": BOB, "pid": roots.pid, "start_time": began}
    forged.update(child_pid=roots.pid, child_start_time=began, pids=[roots.pid])
    forged.update(reserved_bytes=20 * GiB, name=None)
    server.edit_own(BOB, lambda raw: raw.update(jobs=[forged]))
    waiter = server.start(ALICE, "--vram", "6G", "--timeout", "10s", "--", "echo", "started")
    server.wait_jobs(2)
    os.killpg(holder.pid, signal.SIGTERM)
    out, err = waiter.communicate(timeout=30)
    assert (waiter.returncode, out) == (0, "started\n"), err


@pytest.mark.parametrize(
    ("state", "command"),
    [("waiting", None), ("waiting", BOB), ("running", "gone"), ("running", 0)],
    ids=["waiting", "waiting-naming-his-process", "running-command-gone", "running-roots"],
)
def test_a_members_entry_whose_gpuwait_is_gone_holds_up_nobody(
    server: Server, state: str, command: int | str | None
) -> None:
    # Bob's file has an entry asking 20 GiB, first in the queue, whose gpuwait is gone
    # (killed with -9, say, before it could take the entry out): waiting, nothing will start
    # it, whatever process of his it names as its command; running, its command gone too (or
    # the one it names is root's), it holds nothing. Alice's 6 GiB job starts at once.
    server.start(ALICE, "--vram", "1G", "--", "sleep", "60")
    server.wait_jobs(1, "running")
    alices = server.ledger().read().jobs[0].to_json()
    gone = subprocess.Popen(["sleep", "60"], user=BOB, group=BOB)
    gone_start = start_time(gone.pid)
    gone.kill()
    gone.wait()
    entry = {**alices, "id": "gone", "uid": BOB, "pid": gone.pid, "start_time": gone_start}
    entry.update(state=state, name=None, request={"bytes": 20 * GiB})
    entry.update(submitted_at=alices["submitted_at"] - 60, reserved_bytes=0, pids=[])
    entry.update(child_pid=None, child_start_time=None)
    if state == "running":
        entry.update(reserved_bytes=20 * GiB)
    if command == "gone":
        entry.update(child_pid=gone.pid, child_start_time=gone_start, pids=[gone.pid])
    elif isinstance(command, int):
        named = subprocess.Popen(["sleep", "60"], start_new_session=True, user=command)
        server.procs.append(named)  # type: ignore[arg-type]
        began = start_time(named.pid)
        entry.update(child_pid=named.pid, child_start_time=began, pids=[named.pid])
    server.edit_own(BOB, lambda raw: raw.update(jobs=[entry]))
    done = server.run(ALICE, "--vram", "6G", "--timeout", "3s", "--", "echo", "started")
    assert (done.returncode, done.stdout) == (0, "started\n"), done.stderr


#: Before gpuwait runs as the user: every summary's metadata looks the same (a coarse file
#: system clock, the inode reused), and inotify is out of reach (its instances used up), so
#: that only the writer's signal tells the waiter a summary was written.
_SIGNAL_ALONE = """
from gpuwait.linux import inotify
from gpuwait.linux.stamp import FileStamp
from gpuwait.queue import wake
real = wake.file_stamp
def same_stamp(*args, **kwargs):
    return None if real(*args, **kwargs) is None else FileStamp(1, 100, 10**18, 10**18)
wake.file_stamp = same_stamp
watch = inotify.LedgerWatch.__init__
inotify.LedgerWatch.__init__ = lambda self, directory: watch(self, None)
"""


def test_a_waiter_signalled_by_its_users_release_reads_their_summary(server: Server) -> None:
    # In a shared ledger a waiter woken by its own user's release (the writer's signal) was
    # told that wake.json was written, a name nobody writes there: where its summary looked as
    # it was (three written within one tick of a coarse clock) and inotify gave no word, it
    # slept through the room freed until its next reading of the GPUs (here two minutes).
    holder = server.start(ALICE, "--vram", "15G", "--", "sleep", "60")
    server.wait_jobs(1, "running")
    code = AS_USER.replace("gpuwait.cli.entry_point()", _SIGNAL_ALONE + "gpuwait.cli.entry_point()")
    args = ["--vram", "15G", "--", "true"]
    argv = [sys.executable, "-c", code, str(ALICE), str(ALICE), str(GROUP), "gpuwait", *args]
    env = {**server.envs[ALICE], "GPUWAIT_NVML_INTERVAL": "120s"}
    waiter = subprocess.Popen(argv, env=env, text=True, cwd="/", start_new_session=True)
    server.procs.append(waiter)
    server.wait_jobs(2)
    wait_for(lambda: sleeping_in(waiter.pid, "sigtimedwait"), timeout=30)
    holder.send_signal(signal.SIGTERM)
    assert waiter.wait(timeout=20) == 0


def test_a_name_found_another_users_is_its_uids_once_they_make_their_file_there(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A name under a uid not its owner's is looked at again only once the directory has
    # changed: Bob's file, made where Alice had made one under his name, is his at the next
    # look, whoever looked at hers before.
    import gpuwait.linux.stamp

    monkeypatch.setattr(gpuwait.linux.stamp, "RACY_SECONDS", 0)
    squatted = server.ledger_dir / f"ledger.{BOB}.json"
    summary = server.ledger_dir / f"wake.{BOB}.json"
    for path in (squatted, summary):
        path.write_text("{}")
        os.chown(path, ALICE, GROUP)
    time.sleep(0.05)  # past the tick of the file system's clock in which they were made
    ledger = server.ledger()
    ledger.read()
    summaries = Summaries(server.ledger_dir, shared=True)
    for _ in range(2):  # the names found Alice's again, or kept as hers
        assert BOB not in ledger._user_files()
        assert summary.name not in summaries._current_tokens()
    for path in (squatted, summary):
        path.unlink()
        path.write_text("{}")
        os.chown(path, BOB, GROUP)
    assert ledger._user_files().get(BOB) == squatted.name
    assert summary.name in summaries._current_tokens()


def test_a_members_file_under_their_uid_in_leading_zeros_is_not_taken_for_their_ledger(
    server: Server,
) -> None:
    # Alice took Bob's name, so his gpuwait writes his ledger beside it. A file of his named by
    # his uid in leading zeros, which no gpuwait writes, sorts before that one: it was taken
    # for his ledger, by his gpuwait and everyone's, and the entries of his jobs in the one
    # beside were read by nobody. His summaries and his lock directory were never looked for
    # under such a name.
    squatted = server.ledger_dir / f"ledger.{BOB}.json"
    beside = server.ledger_dir / f"ledger.{BOB}.0123abcd.json"
    padded = server.ledger_dir / f"ledger.0{BOB}.json"
    for path, owner in ((squatted, ALICE), (beside, BOB), (padded, BOB)):
        path.write_text("{}")
        os.chown(path, owner, GROUP)
    assert server.ledger()._user_files().get(BOB) == beside.name
    padded.rename(server.ledger_dir / f"ledger.{BOB}.00.json")  # a name of his, beside
    assert server.ledger()._user_files().get(BOB) == f"ledger.{BOB}.00.json"


def test_where_a_members_waiting_job_says_its_size_came_from_takes_a_few_lines_of_status(
    server: Server,
) -> None:
    # Bob writes into his waiting entry that its size came from a text of 4,002 characters: every
    # user's status said it in 15 lines under his job, the room on the best card cut off.
    alice = server.start(ALICE, "--vram", "20G", "--", "sleep", "60")
    server.wait_jobs(1, "running")
    bob = server.start(BOB, "--vram", "10G", "--", "true")
    server.wait_jobs(1, "waiting")

    def rewrite(raw: dict[str, Any]) -> None:
        raw["jobs"][0]["size_source"] = "estimated from 3 runs, " * 174

    server.edit_own(BOB, rewrite)
    status = server.run(ALICE, "status")
    assert status.returncode == 0, status.stderr
    queue = status.stdout.split("Queue (1)\n")[1].split("\n\n")[0].splitlines()
    wait = " ".join(line.strip() for line in queue[2:])
    assert len(queue[2:]) <= 3 and "best GPU0 has 1.6 GiB" in wait, status.stdout
    for proc in (alice, bob):
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)


def test_a_members_own_file_under_their_uids_name_is_theirs_beside_one_of_another_name(
    server: Server,
) -> None:
    # Bob's gpuwait made a file of another name while his own name was taken (ledger.<uid>.
    # <hex>.json, listed before ledger.<uid>.json); once his own name is a file of his, that
    # file is his ledger, the one every member reads, and the other is passed over.
    for name in (f"ledger.{BOB}.00ff.json", f"ledger.{BOB}.json"):
        path = server.ledger_dir / name
        path.write_text("{}")
        os.chown(path, BOB, GROUP)
    assert server.ledger()._user_files().get(BOB) == f"ledger.{BOB}.json"


REMOVES = """
import os, sys, time
while True:
    for name in sys.argv[1:]:
        try:
            os.unlink(name)
        except OSError:
            pass
    time.sleep(0.002)
"""


@contextlib.contextmanager
def bobs_file_removed(server: Server, *also: Path) -> Iterator[None]:
    """Bob's ledger file (and `also`) removed again and again by a loop of his while the block
    runs (from its first removal on); his gpuwait writes it back."""
    loop = bobs_loop(server, REMOVES, str(server.own_file(BOB)), *map(str, also))
    try:
        wait_for(lambda: not server.own_file(BOB).exists())
        yield
    finally:
        loop.kill()
        loop.wait()


def test_a_member_removing_their_file_while_their_job_runs_admits_nobody_into_its_room(
    server: Server,
) -> None:
    # Bob's job holds 15 GiB of the card's 21.6 usable, and a loop of his removes his ledger
    # file again and again (his gpuwait writes it back). Alice's launches found no file of his,
    # counted no job of his, and each of 3 was started into the room his job holds, as where
    # he empties it (above). While a job of his holds its lock, a file of his gone admits
    # nobody, and says so.
    bob = server.start(BOB, "--vram", "15G", "--", "sleep", "60")
    server.wait_jobs(1, "running")
    with bobs_file_removed(server):
        alice_is_held_for_bobs_file(server, 3)
    bobs_room_is_alices_once_it_ends(server, bob)


def test_a_member_removing_their_file_and_summary_while_their_job_runs_admits_nobody(
    server: Server,
) -> None:
    # As above, and Bob's loop removes his wake-up summary too, as root's removal of a member
    # who left does: Alice's launches found no file of his, took him for one who left, and
    # each was started into the room his job holds.
    bob = server.start(BOB, "--vram", "15G", "--", "sleep", "60")
    server.wait_jobs(1, "running")
    with bobs_file_removed(server, server.ledger_dir / f"wake.{BOB}.json"):
        alice_is_held_for_bobs_file(server, 3)
    bobs_room_is_alices_once_it_ends(server, bob)


def test_a_member_whose_lock_directory_name_another_took_is_a_member_all_the_same(
    server: Server,
) -> None:
    # Carol made a directory alive.<Bob's uid> before Bob's first job, whose gpuwait then
    # keeps his locks in one of his own beside it (alive.<uid>.<random>). With his job of
    # 15 GiB running and a loop of his removing his ledger file, Alice's launches took him
    # for nobody's member, and each was started into the room his job holds.
    squatted = server.ledger_dir / f"alive.{BOB}"
    squatted.mkdir()
    os.chown(squatted, CAROL, CAROL)
    bob = server.start(BOB, "--vram", "15G", "--", "sleep", "60")
    server.wait_jobs(1, "running")
    assert list(server.ledger_dir.glob(f"alive.{BOB}.*"))
    with bobs_file_removed(server):
        alice_is_held_for_bobs_file(server, 3)
    bobs_room_is_alices_once_it_ends(server, bob)


def bob_holds_a_flock_of_no_job(server: Server) -> None:
    """A process under Bob's uid holds an exclusive flock on a file of his on the ledger
    directory's file system, as a program's download lock does: it tells nothing of a job."""
    held = server.root / "bob.lock"
    held.touch()
    os.chown(held, BOB, BOB)
    lock = subprocess.Popen(
        ["flock", "-x", str(held), "sleep", "60"], user=BOB, group=BOB, start_new_session=True
    )
    server.procs.append(lock)
    wait_for(lambda: f" {lock.pid} " in Path("/proc/locks").read_text())


def test_a_member_whose_two_files_were_removed_holds_nobody_with_a_lock_of_theirs(
    server: Server,
) -> None:
    # Bob has left: his job ended, and root removed his ledger file and summary as
    # docs/shared-servers.md says (his lock directory stays). A process under his uid holds an
    # exclusive flock on the directory's file system, as a program's download lock does: no
    # job of his is anywhere, and Alice's launch runs at once.
    assert server.run(BOB, "--vram", "15G", "--", "true").returncode == 0
    assert (server.ledger_dir / f"alive.{BOB}").is_dir()
    server.own_file(BOB).unlink()
    (server.ledger_dir / f"wake.{BOB}.json").unlink()
    bob_holds_a_flock_of_no_job(server)
    done = server.run(ALICE, "--vram", "15G", "--timeout", "0", "--", "echo", "ran")
    assert (done.returncode, done.stdout) == (0, "ran\n"), done.stderr


#: Members of the tests below alone: a gpuwait of theirs is one of these tests' own, wherever
#: other tests run beside them (a gpuwait of Bob's running for another test would count).
DOWNLOADERS = {"emptied": 47203, "removed": 47204}


@pytest.mark.parametrize("left", list(DOWNLOADERS))
def test_a_members_lock_of_another_program_holds_nobody_for_their_file(
    server: Server, left: str
) -> None:
    # A member's job has ended; a download of theirs holds an exclusive flock on a file of the
    # ledger directory's file system (`flock -x`, as Python's filelock does), and their ledger
    # file is emptied or gone. No job of theirs is anywhere: Alice's launch waited 30 s (it
    # ended, with --timeout 0, at once, saying their gpuwait runs), and now runs at once.
    member = DOWNLOADERS[left]
    server.envs[member] = {**server.envs[ALICE], **user_home(server.root, member, member)}
    assert server.run(member, "--vram", "15G", "--", "true").returncode == 0
    held = server.root / f"download-{member}.lock"
    held.touch()
    os.chown(held, member, member)
    lock = subprocess.Popen(
        ["flock", "-x", str(held), "sleep", "60"], user=member, group=member, start_new_session=True
    )
    server.procs.append(lock)
    wait_for(lambda: f" {lock.pid} " in Path("/proc/locks").read_text())
    own_file = server.own_file(member)
    if left == "emptied":
        loop = subprocess.Popen(
            ["python3", "-c", EMPTIES, str(own_file)],
            user=member,
            group=member,
            extra_groups=[GROUP],
            start_new_session=True,
        )
        server.procs.append(loop)
        wait_for(lambda: own_file.stat().st_size == 0)
    else:
        own_file.unlink()
    done = server.run(ALICE, "--vram", "15G", "--timeout", "0", "--", "echo", "ran")
    assert (done.returncode, done.stdout) == (0, "ran\n"), done.stderr
    assert "whose gpuwait or job runs" not in done.stderr


#: A loop of Bob's writing over his ledger file (argv[1]) one whose schema is in the file argv[2]:
#: written whole (by rename), so that a reader never finds it half-written.
WRITES_SCHEMA = """
import os, sys, time
with open(sys.argv[2]) as f:
    body = '{"schema": %s, "jobs": []}' % f.read()
while True:
    try:
        with open(sys.argv[1] + ".part", "w") as f:
            f.write(body)
        os.replace(sys.argv[1] + ".part", sys.argv[1])
    except OSError:
        pass
    time.sleep(0.002)
"""


@pytest.mark.parametrize(
    ("schema", "his_words", "said"),
    [
        # 2,000 lines of text of his: said in its warning, its wait line and its last words,
        # four lines of 4,000 characters each, his words in each.
        (
            json.dumps("\x1b[2J\x1b[31mcancelled by root: run sudo gpuwait-fix\u202e\n" * 2000),
            "cancelled by root",
            "cannot be used (schema str)",
        ),
        # A number of 4,000 digits: said whole, four lines of 4,000 characters and more, 50
        # rows each at 80 columns. A schema of more than 9 digits is said by its type alone.
        ("-" + "9" * 4000, "9999", "cannot be used (schema int)"),
    ],
    ids=["text", "number of 4000 digits"],
)
def test_a_members_file_of_a_long_schema_puts_none_of_it_in_anothers_lines(
    server: Server, schema: str, his_words: str, said: str
) -> None:
    # Bob's job runs, and a loop of his writes over his ledger file one whose schema is long.
    # Alice's launch, held while his file cannot be used, said the schema whole in its
    # warning, its wait line and its last words. It is said by its type alone.
    written = server.root / "schema"
    written.write_text(schema)
    written.chmod(0o644)
    bob = server.start(BOB, "--vram", "1G", "--", "sleep", "60")
    server.wait_jobs(1, "running")
    loop = bobs_loop(server, WRITES_SCHEMA, str(server.own_file(BOB)), str(written))
    try:
        wait_for(lambda: his_words in server.own_file(BOB).read_text()[:200])
        done = server.run(ALICE, "--vram", "1G", "--timeout", "0", "--", "echo", "ran")
    finally:
        loop.kill()
        loop.wait()
    assert done.returncode == 124, done.stderr[:300]
    assert his_words not in done.stderr, done.stderr[:300]
    assert said in done.stderr, done.stderr[:300]
    assert max(len(line) for line in done.stderr.splitlines()) < 400, done.stderr[:300]
    os.killpg(bob.pid, signal.SIGTERM)
    bob.communicate(timeout=30)


BIG_SUMMARY = """
import json, os, time
ids = [f"{n:08x}" for n in range(300000)]
end = time.monotonic() + 3
while time.monotonic() < end:
    body = json.dumps({"schema": 1, "release": 1, "running": ids, "waiting": []})
    with open("big.tmp", "w") as f:
        f.write(body)
    os.rename("big.tmp", f"wake.{os.getuid()}.json")
os.unlink(f"wake.{os.getuid()}.json")
"""


def test_a_members_summary_of_megabytes_written_in_a_loop_keeps_no_waiter_busy(
    server: Server,
) -> None:
    # Bob's loop writes his wake-up summary again and again, 300,000 ids of running jobs in it
    # (3.6 MB, under the 4 MiB a summary may have). Alice's waiter read each change, at most
    # every 50 ms, and once more at each plan it made: it used 0.9 to 1.8 s of CPU in the
    # loop's 3.1 s, as would every waiter of every member. A summary is now read again no
    # sooner than ten times the CPU time its last reading took, and a plan made meanwhile takes
    # it as it was read: 0.5 s.
    assert server.run(BOB, "--vram", "1G", "--", "true").returncode == 0
    outside = hold_outside_gpuwait(server, 20 * GiB)
    try:
        waiter = server.start(ALICE, "--vram", "10G", "--", "echo", "ran")
        wait_for(lambda: sleeping_in(waiter.pid, "sigtimedwait"), timeout=30)
        before = cpu_seconds(waiter.pid)
        started = time.monotonic()
        done = as_bob(server, ["python3", "-c", BIG_SUMMARY])
        assert done.returncode == 0, done.stderr
        # CPU time against the loop's time on the clock, as for a loop of renames (above).
        lasted = time.monotonic() - started
        used = cpu_seconds(waiter.pid) - before
        assert used < 0.3 * lasted, (used, lasted)
    finally:
        outside.kill()
        outside.wait()
    # The room freed, the waiter starts.
    assert waiter.poll() is None
    out, err = waiter.communicate(timeout=60)
    assert (waiter.returncode, out) == (0, "ran\n"), err


#: The last gpuwait whose jobs hold no lock on their user's lock directory: a member may run it
#: still (a venv's older copy) beside a newer one.
OLDER = "1f6b7c3"


def older_gpuwait(server: Server) -> str:
    """A tree of gpuwait at OLDER that every member may import, for PYTHONPATH; the test is
    skipped where the repository's history does not hold it (a shallow clone)."""
    repo = Path(__file__).resolve().parents[2]
    tree = server.root / "older"
    tree.mkdir(mode=0o755)
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    archive = subprocess.run(
        ["git", "-C", str(repo), "archive", OLDER, "gpuwait"], capture_output=True, timeout=60
    )
    if archive.returncode != 0:
        pytest.skip(f"gpuwait {OLDER} is not in this repository's history")
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True, timeout=60)
    subprocess.run(["chmod", "-R", "a+rX", str(tree)], check=True, timeout=60)
    return str(tree)


def test_an_older_members_job_holds_its_room_while_their_file_is_gone(server: Server) -> None:
    # Bob runs gpuwait 1f6b7c3 (a venv's older copy), whose jobs take no lock on his lock
    # directory; his job holds 15 GiB of the card's 21.6 usable and a loop of his removes his
    # ledger file. Alice's launches (this gpuwait) found no lock of his job's, counted none,
    # and each was started into the room his job holds. The summary his gpuwait wrote last
    # lists his job running: nobody is admitted until it ends.
    server.envs[BOB]["PYTHONPATH"] = older_gpuwait(server)
    bob = server.start(BOB, "--vram", "15G", "--", "sleep", "60")
    server.wait_jobs(1, "running")
    with bobs_file_removed(server):
        alice_is_held_for_bobs_file(server, 3)
    bobs_room_is_alices_once_it_ends(server, bob)


def test_an_older_members_program_holds_its_room_while_their_file_cannot_be_used(
    server: Server,
) -> None:
    # Bob's Python program, importing gpuwait 1f6b7c3, holds 15 GiB through gpuwait.reserve(),
    # and a loop of his empties his ledger file. Its command line names no gpuwait and it
    # holds no lock on his lock directory: Alice's launches were started into its room, where
    # Alice's gpuwait 1f6b7c3 waited (it counted any exclusive flock of his). Nobody is now.
    server.envs[BOB]["PYTHONPATH"] = older_gpuwait(server)
    python = (
        'import gpuwait\nr = gpuwait.reserve("15G")\nprint("held", flush=True)\nsignal.pause()\n'
    )
    bob = bobs_program_in_the_queue(server, python)
    assert bob.stdout is not None
    assert bob.stdout.readline() == "held\n"
    with bobs_file_emptied(server):
        alice_is_held_for_bobs_file(server, 3)
    bobs_room_is_alices_once_it_ends(server, bob)


def test_a_members_summary_of_anothers_running_job_holds_nobody_for_their_file(
    server: Server,
) -> None:
    # Bob's last job ended while Alice's ran: the summary his gpuwait wrote then lists her job
    # running, the queue's only entry. With his ledger file removed and no job of his, nothing
    # of his runs, whatever exclusive flock of his is held (a download's): Alice's next launch
    # runs at once. His summary listed her job by its id alone, read as a job of his running
    # (as an older gpuwait's summary of a queue of his own entries is), and, with his flock,
    # she was held for his file. It says whose each job is now.
    alice = server.start(ALICE, "--vram", "1G", "--", "sleep", "60")
    server.wait_jobs(1, "running")
    assert server.run(BOB, "--vram", "1G", "--", "true").returncode == 0
    summary = json.loads((server.ledger_dir / f"wake.{BOB}.json").read_text())
    assert summary["running"] and summary.get("owned") == [f"{summary['running'][0]}@{ALICE}"]
    server.own_file(BOB).unlink()
    bob_holds_a_flock_of_no_job(server)
    done = server.run(ALICE, "--vram", "1G", "--timeout", "0", "--", "echo", "ran")
    assert (done.returncode, done.stdout) == (0, "ran\n"), done.stderr
    os.killpg(alice.pid, signal.SIGTERM)
    alice.communicate(timeout=30)


#: AS_USER, telling on stderr each listing of the ledger directory ("@list") and where each of
#: gpuwait's reads and transactions of the ledger begins and ends ("@begin", "@end").
COUNTING = AS_USER.replace(
    "gpuwait.cli.entry_point()",
    r"""
import contextlib
from gpuwait.queue.ledger import Ledger
where = os.environ["GPUWAIT_LEDGER_DIR"]
real_scandir, real_listdir, real_read, real_transaction = os.scandir, os.listdir, Ledger.read, Ledger.transaction
def told(listing):
    def listed(path="."):
        if not isinstance(path, int) and os.path.abspath(path) == where:
            os.write(2, b"@list\n")
        return listing(path)
    return listed
os.scandir, os.listdir = told(real_scandir), told(real_listdir)
def read(self):
    os.write(2, b"@begin\n")
    try:
        return real_read(self)
    finally:
        os.write(2, b"@end\n")
@contextlib.contextmanager
def transaction(self, *args, **kwargs):
    os.write(2, b"@begin\n")
    try:
        with real_transaction(self, *args, **kwargs) as data:
            yield data
    finally:
        os.write(2, b"@end\n")
Ledger.read, Ledger.transaction = read, transaction
gpuwait.cli.entry_point()
""",
)


def listings(server: Server, uid: int, *args: str) -> tuple[list[int], int]:
    """`gpuwait ARGS` as `uid`: the listings of the ledger directory in each of its reads and
    transactions, and those outside them."""
    done = subprocess.run(
        [sys.executable, "-c", COUNTING, str(uid), str(uid), str(GROUP), "gpuwait", *args],
        env=server.envs[uid],
        text=True,
        cwd="/",
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    inside: list[int] = []
    outside = 0
    depth = 0
    for line in done.stderr.splitlines():
        if line == "@begin":
            if depth == 0:
                inside.append(0)
            depth += 1
        elif line == "@end":
            depth -= 1
        elif line == "@list":
            if depth:
                inside[-1] += 1
            else:
                outside += 1
    return inside, outside


def test_names_a_member_makes_in_the_shared_directory_are_listed_once_a_transaction(
    server: Server,
) -> None:
    # Bob makes thousands of names of his own in the shared directory: ledger files, summaries
    # and lock directories beside his canonical names, and names of no kind. Alice's launch
    # listed the directory 24 times among 30,000 of each (each listing meeting every name): in
    # each transaction once for the users' files and once for the temporary files, and again for
    # his lock directories and his summary, and for the lock directories of hers. Each read and
    # transaction now lists it once, his names making no listing more.
    launch = ("-q", "--vram", "1G", "--", "true")
    quiet_inside, _ = listings(server, ALICE, *launch)
    assert quiet_inside and max(quiet_inside) <= 1, quiet_inside
    for n in range(2000):
        random = f"{n:016x}"
        for name in (f"ledger.{BOB}.{random}.json", f"wake.{BOB}.{random}.json", f"junk.{random}"):
            path = server.ledger_dir / name
            path.write_text("")
            os.chown(path, BOB, GROUP)
        lock_dir = server.ledger_dir / f"alive.{BOB}.{random}"
        lock_dir.mkdir(mode=0o700)
        os.chown(lock_dir, BOB, GROUP)
    inside, outside = listings(server, ALICE, *launch)
    assert inside and max(inside) <= 1, inside
    # Outside them: the waiter's first looks at the summaries (two), and the job's supervisor's
    # fingerprint of the ledger, once.
    assert outside <= 3, outside
    status_inside, status_outside = listings(server, ALICE, "status")
    assert (status_inside, status_outside) == ([1], 0)
