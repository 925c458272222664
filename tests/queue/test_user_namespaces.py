"""A rootless container (podman's default) sharing its user's state directory with the host.

Its uid 0 is, outside, the user who started it: one user, whose processes /proc shows as uid 0
in the container and as the user's uid on the host. Real user namespaces, real processes, a
simulated GPU; run as root, which may become any user and make the namespace as them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.users import ROOTLESS, clean_up, popen_as, run_as, shared_root, user_home
from helpers.waiting import process_state, wait_for

from gpuwait.linux.lock import exclusive

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switches to another user: needs root")

USER = 47230
FORGED = "belongs to another user"


class Machine:
    """One user's home and a simulated 24 GiB card; gpuwait on the host or in a container."""

    def __init__(self, root: Path) -> None:
        sim = root / "sim.toml"
        sim.write_text('[[gpu]]\nmemory = "24GiB"\n')
        os.chown(sim, USER, USER)  # the user's own, seen as root's own in the container
        self.env = {"PATH": "/usr/bin:/bin", "GPUWAIT_SIM": str(sim), **user_home(root, USER, USER)}
        self.env["XDG_CONFIG_DIRS"] = str(root / "site")
        self.ledger = Path(self.env["XDG_STATE_HOME"]) / "gpuwait" / "ledger.json"
        self.procs: list[subprocess.Popen[str]] = []

    def site_config(self, text: str) -> None:
        """A site config file (limits); the user's own (as when trying one out), so that the
        container, where the machine's root is nobody, reads it too."""
        site = Path(self.env["XDG_CONFIG_DIRS"]) / "gpuwait" / "config.toml"
        site.parent.mkdir(parents=True)
        site.write_text(text)
        os.chown(site, USER, USER)

    def start(self, args: list[str], rootless: bool = False) -> subprocess.Popen[str]:
        proc = popen_as(USER, USER, [], args, self.env, rootless, start_new_session=True)
        self.procs.append(proc)
        return proc

    def run(self, args: list[str], rootless: bool = False) -> subprocess.CompletedProcess[str]:
        return run_as(USER, USER, [], args, self.env, rootless=rootless)

    def running(self) -> list[dict[str, Any]]:
        try:
            jobs = json.loads(self.ledger.read_text())["jobs"]
        except (OSError, ValueError):
            return []
        return [j for j in jobs if j["state"] == "running" and j.get("child_pid")]


@pytest.fixture
def machine() -> Iterator[Machine]:
    root = shared_root()
    found = Machine(root)
    probe = found.run(["--version"], rootless=True)
    if probe.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"no user namespace can be made here: {probe.stderr.strip()}")
    try:
        yield found
    finally:
        clean_up(root, found.procs)


@pytest.mark.parametrize("first", ["host", "container"])
def test_a_rootless_containers_jobs_and_the_hosts_are_one_users(
    machine: Machine, first: str
) -> None:
    # Each side took the other's running job for a forged entry ("its process ... belongs to
    # another user": uid 0 there, the user's uid here) and dropped it: a 15 GiB job was
    # started beside another on a 24 GiB card.
    machine.start(["--vram", "15G", "--", "sleep", "60"], rootless=first == "container")
    wait_for(lambda: machine.running(), timeout=30)
    probe = machine.run(
        ["--vram", "15G", "--timeout", "0.5s", "--", "true"], rootless=first == "host"
    )
    assert probe.returncode == 124, probe.stderr
    assert FORGED not in probe.stderr
    assert len(machine.running()) == 1
    # Its user may cancel it from the other side.
    (job,) = machine.running()
    cancel = machine.run(["cancel", job["id"]], rootless=first == "host")
    assert cancel.returncode == 0, cancel.stderr
    wait_for(lambda: not machine.running(), timeout=30)


@pytest.mark.parametrize("first", ["host", "container"])
def test_a_rootless_containers_jobs_and_the_hosts_count_against_one_users_limit(
    machine: Machine, first: str
) -> None:
    # user_max_vram = 16 GiB: a 10 GiB job on one side, and another 10 GiB job on the other
    # was started at once (uid 0 and the user's uid counted as two users, each with a limit).
    machine.site_config('user_max_vram = "16GiB"\n')
    machine.start(["--vram", "10G", "--", "sleep", "60"], rootless=first == "container")
    wait_for(lambda: machine.running(), timeout=30)
    probe = machine.run(
        ["--vram", "10G", "--timeout", "0.5s", "--", "true"], rootless=first == "host"
    )
    assert probe.returncode == 124, probe.stderr
    assert "your per-user limit of 16.0 GiB (10.0 GiB held)" in probe.stderr


@pytest.mark.parametrize("reader", ["host", "container"])
def test_status_shows_a_rootless_containers_jobs_and_the_hosts_as_one_user(
    machine: Machine, reader: str
) -> None:
    # One person's 5 GiB job on the host and another in their container: status's Users
    # table showed them as two users (root and the user), each holding 5 GiB.
    machine.start(["--vram", "5G", "--", "sleep", "60"])
    machine.start(["--vram", "5G", "--", "sleep", "60"], rootless=True)
    wait_for(lambda: len(machine.running()) == 2, timeout=30)
    done = machine.run(["status", "--json"], rootless=reader == "container")
    assert done.returncode == 0, done.stderr
    users = json.loads(done.stdout)["users"]
    held = [(u["uid"], u["running"], u["vram_held_bytes"]) for u in users]
    assert held == [(USER if reader == "host" else 0, 2, 10 * 2**30)]


def test_a_users_jobs_in_a_rootless_container_keep_their_place_behind_their_host_jobs(
    machine: Machine,
) -> None:
    # With fair share on, the user's usage was counted under their uid on the host only: their
    # job submitted later in their container, under uid 0 with no usage, went before the one
    # they had queued on the host first, as if another user's.
    machine.site_config('fair_share_half_life = "1h"\n')
    done = machine.run(["--vram", "1G", "--", "sleep", "0.2"])
    assert done.returncode == 0, done.stderr
    machine.start(["--vram", "20G", "--", "sleep", "60"])
    wait_for(lambda: machine.running(), timeout=30)

    def waiting() -> list[str]:
        jobs = json.loads(machine.ledger.read_text())["jobs"]
        return sorted(j["name"] for j in jobs if j["state"] == "waiting")

    machine.start(["--vram", "10G", "--name", "first", "--", "true"])
    wait_for(lambda: waiting() == ["first"], timeout=30)
    machine.start(["--vram", "10G", "--name", "second", "--", "true"], rootless=True)
    wait_for(lambda: waiting() == ["first", "second"], timeout=30)
    status = machine.run(["status", "--json"])
    assert status.returncode == 0, status.stderr
    queue = [j for j in json.loads(status.stdout)["jobs"] if j["position"] is not None]
    assert [j["name"] for j in sorted(queue, key=lambda j: j["position"])] == ["first", "second"]


#: A rootless container without --pid=host (podman's default): after the user namespace
#: (ROOTLESS), a pid namespace of its own, with a /proc of its own, whose first process runs
#: gpuwait while the one outside waits for it and exits as it did.
_OWN_PID_NAMESPACE = r"""
if libc.unshare(0x20000000 | 0x00020000) != 0:  # CLONE_NEWPID | CLONE_NEWNS
    raise SystemExit(f"no pid namespace: {os.strerror(ctypes.get_errno())}")
child = os.fork()
if child:
    _, status = os.waitpid(child, 0)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
if libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None) != 0:  # MS_REC | MS_PRIVATE
    raise SystemExit(f"no private mounts: {os.strerror(ctypes.get_errno())}")
if libc.mount(b"proc", b"/proc", b"proc", 2 | 4 | 8, None) != 0:
    raise SystemExit(f"no /proc of its own: {os.strerror(ctypes.get_errno())}")
"""


@pytest.mark.parametrize("first", ["container", "host"])
def test_a_rootless_container_without_the_hosts_pids_and_the_host_keep_each_others_room(
    machine: Machine, first: str
) -> None:
    # A job's liveness lock is alive.0/<job id> to the container (its uid 0), a directory the
    # host shows as the user's, and alive.<uid>/ to the host, which the container shows as its
    # root's: each side's gpuwait, looking for the other's lock in a directory of that very
    # uid's own, found none, reaped the other side's running 15 GiB job as lost and started
    # another 15 GiB job beside it on the 24 GiB card (exit 0 for 124).
    script = ROOTLESS.replace("sys.argv = [", _OWN_PID_NAMESPACE + "sys.argv = [", 1)
    argv = [sys.executable, "-c", script, str(USER), str(USER), "", "gpuwait"]
    kw: dict[str, Any] = {"env": machine.env, "text": True, "cwd": "/"}
    probe = subprocess.run([*argv, "--version"], capture_output=True, **kw)
    if probe.returncode != 0:
        pytest.skip(f"no pid namespace can be made here: {probe.stderr.strip()}")
    job = ["--vram", "15G", "--", "sleep", "60"]
    if first == "container":
        started = subprocess.Popen(
            [*argv, *job],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            **kw,
            start_new_session=True,
        )
        machine.procs.append(started)
    else:
        machine.start(job)
    wait_for(lambda: machine.running(), timeout=30)
    (running,) = machine.running()
    late = ["--vram", "15G", "--timeout", "0.5s", "--", "true"]
    if first == "container":
        probe = machine.run(late)
    else:
        probe = subprocess.run([*argv, *late], capture_output=True, timeout=60, **kw)
    assert probe.returncode == 124, probe.stderr
    assert [j["id"] for j in machine.running()] == [running["id"]]


@pytest.mark.parametrize("first", ["container", "host"])
def test_a_launch_after_damage_waits_for_the_running_job_of_the_other_side(
    machine: Machine, first: str
) -> None:
    # The ledger is damaged and started afresh while a job runs in the user's container, its
    # gpuwait not looking meanwhile (here: stopped): the next launch on the host waited only
    # for the jobs whose locks are in alive.<uid>/, the host's, not for the container's, in
    # alive.0/, and was admitted at once into the 15 GiB the container's job held (exit 0);
    # and so was a launch in the container beside a job of the host's.
    running = machine.start(["--vram", "15G", "--", "sleep", "60"], rootless=first == "container")
    wait_for(lambda: machine.running(), timeout=30)
    # Stopped outside a transaction of its own: stopped holding the ledger's lock, it would
    # hold the launch up for that, not for its entry.
    with exclusive(machine.ledger.parent / "ledger.lock"):
        os.kill(running.pid, signal.SIGSTOP)
        wait_for(lambda: process_state(running.pid) == "T", timeout=10)
    try:
        machine.ledger.write_bytes(b'{"schema": 1, "jobs": [')
        probe = machine.run(
            ["--vram", "15G", "--timeout", "1s", "--", "true"], rootless=first == "host"
        )
    finally:
        os.kill(running.pid, signal.SIGCONT)
    assert probe.returncode == 124, probe.stderr
    assert "1 job of yours still running or waiting has to put its entry back" in probe.stderr


def test_the_host_cancels_a_reservation_its_user_holds_from_python_in_a_rootless_container(
    machine: Machine,
) -> None:
    # The program holds 10 GiB through gpuwait.reserve in the user's container: its user on
    # the host was refused its cancel (exit 8, 'not a gpuwait process'), since the proof that
    # the program is the job's own, its liveness lock open in it, was looked for in a lock
    # directory of uid 0's own, where the host shows the container's alive.0/ as the user's.
    script = Path(machine.env["HOME"]) / "train.py"
    python = "r = gpuwait.reserve('10G'); print('got', flush=True); signal.pause()"
    script.write_text(ROOTLESS.replace("gpuwait.cli.entry_point()", python))
    script.chmod(0o644)
    program = subprocess.Popen(
        [sys.executable, str(script), str(USER), str(USER), ""],
        env=machine.env,
        cwd="/",
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    machine.procs.append(program)
    assert program.stdout is not None
    assert program.stdout.readline() == "got\n"
    (job,) = json.loads(machine.ledger.read_text())["jobs"]
    cancel = machine.run(["cancel", job["id"]])
    assert cancel.returncode == 0, cancel.stderr
    assert program.wait(timeout=30) != 0
