"""A state directory shared over the network by several machines: each keeps its own ledger.

The end-to-end test plays two machines on one: "machine B" is a process tree in pid and host
name namespaces of its own (`unshare`, root only), so its processes are not this machine's,
as on another machine; both see the same home directory, and both read a mount table that says
it is NFS (the only thing faked: where gpuwait reads the table from).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from helpers.fixtures_sim import sim_file_text, start_sim_job
from helpers.processes import can_unshare
from helpers.waiting import wait_for

from gpuwait.cli import main
from gpuwait.config import load_settings
from gpuwait.linux import netfs, turnstile

TABLE = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw
40 27 0:50 / /home rw,relatime - nfs4 fs1:/export/home rw,vers=4.2
41 27 0:51 / /home2 rw,relatime - ext4 /dev/sdb1 rw
42 27 0:52 / /mnt/my\\040disk rw,relatime - xfs /dev/sdc1 rw
43 40 0:53 / /home/alice/scratch rw,relatime - tmpfs tmpfs rw
44 27 0:54 / /srv rw,relatime - ext4 /dev/sdd1 rw
45 27 0:55 / /srv rw,relatime - lustre 10.0.0.1@tcp:/fs rw
"""


@pytest.fixture(autouse=True)
def _fresh_answers() -> None:
    netfs._known.clear()


def nfs_table(tmp_path: Path, shared: Path, kind: str = "nfs4") -> Path:
    """A mount table, written in `tmp_path`, in which `shared` is a `kind` network mount on a
    local root."""
    path = tmp_path / "mountinfo"
    path.write_text(
        f"1 0 8:1 / / rw - ext4 /dev/sda1 rw\n2 1 0:50 / {shared} rw - {kind} fs:/h rw\n"
    )
    return path


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/home/alice/.local/state/gpuwait", "nfs4"),
        ("/home", "nfs4"),
        ("/home2/alice", "ext4"),  # /home is not a parent of /home2
        ("/home/alice/scratch/x", "tmpfs"),  # mounted inside the NFS home
        ("/mnt/my disk/state", "xfs"),  # the kernel writes a space as \040
        ("/srv/state", "lustre"),  # mounted later on the same point: hides the ext4
        ("/var/tmp", "ext4"),
    ],
)
def test_the_file_system_holding_a_path_is_the_innermost_mount(path: str, kind: str) -> None:
    assert netfs.filesystem_type(path, TABLE) == kind


def test_a_damaged_table_tells_nothing() -> None:
    assert netfs.filesystem_type("/home/a", "garbage\n\n27 1 8:1 /\n") is None


def test_the_ledger_goes_to_a_directory_per_machine_only_on_a_network_file_system(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared, local = tmp_path / "nfs" / "state", tmp_path / "disk" / "state"
    monkeypatch.setattr(netfs, "MOUNTINFO", str(nfs_table(tmp_path, tmp_path / "nfs", "nfs")))
    monkeypatch.setattr(os, "uname", lambda: SimpleNamespace(nodename="gpu07.lab"))
    assert netfs.ledger_home(shared) == shared / "machines" / "gpu07.lab"
    assert netfs.ledger_home(local) == local


def test_a_table_that_cannot_be_read_leaves_the_ledger_in_the_state_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(netfs, "MOUNTINFO", str(tmp_path / "missing"))
    assert netfs.ledger_home(tmp_path / "state") == tmp_path / "state"


@pytest.mark.parametrize(
    ("nodename", "name"),
    [("gpu-b", "gpu-b"), ("a/../b", "a_.._b"), ("..", "localhost"), ("", "localhost")],
)
def test_the_machine_name_is_a_plain_file_name(
    nodename: str, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "uname", lambda: SimpleNamespace(nodename=nodename))
    assert netfs.machine_name() == name


def test_settings_and_turnstile_use_the_machines_directory_on_a_shared_home(
    tmp_path: Path,
    isolated_dirs: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(netfs, "MOUNTINFO", str(nfs_table(tmp_path, isolated_dirs)))
    monkeypatch.setattr(os, "uname", lambda: SimpleNamespace(nodename="gpu-a"))
    state = isolated_dirs / "state" / "gpuwait"
    settings = load_settings({})
    assert settings.ledger_path == state / "machines" / "gpu-a"
    # An explicit ledger_dir is used as it is (an administrator's shared one, say).
    assert load_settings({"ledger_dir": str(tmp_path)}).ledger_path == tmp_path
    # Without a runtime dir, the turns are taken on this machine's own.
    assert turnstile.directories({}, str(state)) == [state / "machines" / "gpu-a"]
    # `gpuwait config` says where the ledger is, and why there.
    assert main(["config"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"ledger dir:  {state}/machines/gpu-a"
        " (this machine's own: the state dir is on nfs4, shared by machines)"
    )


# --- two machines, one home ---------------------------------------------------------------------

WRAPPER = (
    "import sys, gpuwait.linux.netfs as n; n.MOUNTINFO = sys.argv.pop(1); "
    "from gpuwait.cli import entry_point; entry_point()"
)

#: Machine B: its own host name, then one job that holds its card's memory as it ramps up; once
#: the test says so, a second one as large, which must wait for the first (`--timeout`). The
#: second gives up (1 s) two to three seconds into the first's 4 s ramp, well before its end.
MACHINE_B = textwrap.dedent(
    """\
    import json, os, socket, subprocess, sys, time
    gpuwait, here = json.loads(sys.argv[1]), sys.argv[2]
    socket.sethostname("gpu-b")
    os.environ["GPUWAIT_SIM"] = os.path.join(here, "sim-b.toml")
    sim_job = [sys.executable, "-m", "gpuwait", "sim", "job"]
    first = subprocess.Popen(
        [*gpuwait, "--vram", "14G", "--name", "first", "--",
         *sim_job, "--vram", "14G", "--ramp", "4", "--hold", "2"],
        stdout=subprocess.DEVNULL, stderr=open(os.path.join(here, "first.err"), "w"))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        shown = subprocess.run([*gpuwait, "status", "--json"], capture_output=True, text=True)
        if any(j["name"] == "first" and j["state"] == "running"
               for j in json.loads(shown.stdout or '{"jobs": []}')["jobs"]):
            break
        time.sleep(0.1)
    open(os.path.join(here, "ready"), "w").close()
    while not os.path.exists(os.path.join(here, "go")) and time.monotonic() < deadline:
        time.sleep(0.05)
    second = subprocess.run(
        [*gpuwait, "--vram", "14G", "--timeout", "1", "--",
         *sim_job, "--vram", "14G", "--ramp", "0", "--hold", "0"],
        capture_output=True, text=True)
    first_status = first.wait()
    log = subprocess.run([*gpuwait, "log", "--json", "-n", "100"], capture_output=True, text=True)
    with open(os.path.join(here, "outcome.json"), "w") as out:
        json.dump({"second": second.returncode, "second_err": second.stderr,
                   "first": first_status, "first_err": open(os.path.join(here, "first.err")).read(),
                   "events": [json.loads(line)["kind"] for line in log.stdout.splitlines()]}, out)
    """
)


@pytest.mark.skipif(not can_unshare(), reason="needs root and unshare(1) for namespaces")
def test_a_machine_sharing_the_home_never_takes_away_another_machines_reservation(
    tmp_path: Path, isolated_dirs: Path, procs: Any
) -> None:
    """Machine B runs a job whose memory is still ramping up; machine A (this one) runs a
    `gpuwait status` meanwhile. A must not take B's entry (whose process it cannot see) for a
    dead one's: until B's gpuwait put it back, B's next job would start on the memory the
    first is still growing into. So it waits, and B's log shows no job lost."""
    table = nfs_table(tmp_path, isolated_dirs)
    for machine in ("a", "b"):
        (tmp_path / f"sim-{machine}.toml").write_text(sim_file_text(1, "24GiB"))
    gpuwait = [sys.executable, "-c", WRAPPER, str(table)]
    b = procs(
        [
            "unshare",
            "--uts",
            "--pid",
            "--fork",
            "--mount-proc",
            sys.executable,
            "-c",
            MACHINE_B,
            json.dumps(gpuwait),
            str(tmp_path),
        ]
    )
    deadline = time.monotonic() + 60
    while not (tmp_path / "ready").exists():
        assert b.poll() is None, b.communicate()
        assert time.monotonic() < deadline, "machine B's first job never ran"
        time.sleep(0.05)
    # Machine A looks at its queue: a transaction, which takes out the entries of dead processes.
    a = subprocess.run(
        [*gpuwait, "status"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "GPUWAIT_SIM": str(tmp_path / "sim-a.toml")},
    )
    assert a.returncode == 0, a.stderr
    assert "first" not in a.stdout  # B's job is not A's to show
    (tmp_path / "go").touch()
    b.communicate(timeout=60)
    outcome = json.loads((tmp_path / "outcome.json").read_text())
    assert outcome["second"] == 124, outcome  # waited for the first, gave up at --timeout
    assert outcome["first"] == 0, outcome  # and the first never ran out of memory
    # B's log tells its jobs' story, and nothing of a job lost while it ran.
    assert outcome["events"] == ["submit", "admit", "start", "submit", "leave", "finish"], outcome
    machines = isolated_dirs / "state" / "gpuwait" / "machines"
    assert sorted(p.name for p in machines.iterdir()) == sorted(["gpu-b", os.uname().nodename])


def test_the_machines_directories_are_private(
    tmp_path: Path, isolated_dirs: Path, sim: Path
) -> None:
    shutil.rmtree(isolated_dirs / "state")
    launch = subprocess.run(
        [
            sys.executable,
            "-c",
            WRAPPER,
            str(nfs_table(tmp_path, isolated_dirs)),
            "--vram",
            "1G",
            "--",
            "true",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert launch.returncode == 0, launch.stderr
    state = isolated_dirs / "state" / "gpuwait"
    mine = state / "machines" / netfs.machine_name()
    for directory in (state, state / "machines", mine):
        assert directory.stat().st_mode & 0o777 == 0o700, directory
    assert (mine / "ledger.json").exists()
    assert not (state / "ledger.json").exists()


#: gpuwait as machine `argv[1]` whose home is the NFS mount of the table `argv[2]` says.
AS_MACHINE = (
    "import os, sys, types, gpuwait.linux.netfs as n; name = sys.argv.pop(1); "
    "os.uname = lambda: types.SimpleNamespace(nodename=name); n.MOUNTINFO = sys.argv.pop(1); "
    "from gpuwait.cli import entry_point; entry_point()"
)


def test_a_machine_sharing_the_home_does_not_reset_another_machines_idle_holders(
    tmp_path: Path, isolated_dirs: Path, sim_file: Any, sim_jobs: list[Any]
) -> None:
    """Machine A watches a process forgotten on its quiet GPU; machine B, sharing the home,
    reads its own GPUs meanwhile (its `status`, `idle` or a waiter's reading). B's reading
    must not wipe what A has seen: A names the process once idle_after has passed."""
    table = str(nfs_table(tmp_path, isolated_dirs))
    sim_a = sim_file(gpus=1, utilization=0, file=tmp_path / "sim-a.toml")
    sim_b = sim_file(gpus=1, utilization=0, file=tmp_path / "sim-b.toml")
    forgotten = start_sim_job("--vram", "3G", "--hold", "60s", env={"GPUWAIT_SIM": str(sim_a)})
    sim_jobs.append(forgotten)

    def idle(machine: str, sim: Path) -> dict[str, Any]:
        done = subprocess.run(
            [sys.executable, "-c", AS_MACHINE, machine, table, "idle", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "GPUWAIT_SIM": str(sim), "GPUWAIT_IDLE_AFTER": "1s"},
        )
        assert done.returncode == 0, done.stderr
        found: dict[str, Any] = json.loads(done.stdout)
        return found

    wait_for(lambda: [h["pid"] for h in idle("gpu-a", sim_a)["watching"]] == [forgotten.pid])
    seen = time.monotonic()
    on_b = idle("gpu-b", sim_b)
    assert (on_b["idle"], on_b["watching"]) == ([], [])
    time.sleep(max(0.0, 1.1 - (time.monotonic() - seen)))
    assert [h["pid"] for h in idle("gpu-a", sim_a)["idle"]] == [forgotten.pid]
