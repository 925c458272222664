"""`gpuwait adopt PID`: a process started without gpuwait gets a place in the queue, with real
processes on simulated GPUs: counted as a job (once), shown by `status`, its end recorded."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import users
from helpers.fixtures_sim import SIMJOB, Run, SimFileFactory, start_sim_job, wrapped_sim_job
from helpers.processes import suspended_gpuwait
from helpers.waiting import ledger_entries, wait_for

from gpuwait.core.errors import EXIT_IMPOSSIBLE, EXIT_NOT_PERMITTED, EXIT_USAGE
from gpuwait.queue.entries import Job
from gpuwait.queue.ledger import Ledger

GiB = 2**30


def used_on_gpu0(sim: Path) -> bool:
    from gpuwait.gpu.sim import SimBackend

    return SimBackend(sim).snapshot().gpus[0].used_bytes > 0


def bare_job(sim: Path, *args: str) -> subprocess.Popen[str]:
    """`gpuwait sim job ARGS` started without gpuwait, once it has allocated on GPU 0."""
    job = start_sim_job(*args)
    wait_for(lambda: used_on_gpu0(sim), message="the bare job never allocated")
    return job


def adopted(run_gpuwait: Run, pid: int, *args: str) -> subprocess.CompletedProcess[str]:
    """`gpuwait adopt PID ARGS`, which succeeds."""
    done = run_gpuwait("adopt", str(pid), *args)
    assert done.returncode == 0, done.stderr
    return done


def status_json(run_gpuwait: Run) -> dict[str, object]:
    done = run_gpuwait("status", "--json")
    assert done.returncode == 0, done.stderr
    report: dict[str, object] = json.loads(done.stdout)
    return report


def test_adopted_process_is_a_running_job_until_it_ends_then_in_history(
    sim_file: SimFileFactory, run_gpuwait: Run
) -> None:
    sim = sim_file(gpus=1)
    job = bare_job(sim, "--vram", "6G", "--hold", "60s")
    allocated = time.monotonic()
    try:
        done = adopted(run_gpuwait, job.pid, "--name", "notebook")
        (entry,) = ledger_entries()
        assert done.stderr.startswith(f"gpuwait: adopted process {job.pid} as job {entry['id']}")
        assert "6.0 GiB reserved on GPU 0" in done.stderr
        assert (entry["pid"], entry["child_pid"], entry["state"]) == (job.pid, job.pid, "running")
        assert entry["reserved_bytes"] == 6 * 2**30

        shown = run_gpuwait("status")
        running = shown.stdout.split("Running (1)")[1].split("Queue")[0]
        assert entry["id"] in running and "notebook" in running and "6.0G" in running
        # Its use is the job's, not also an outside process's.
        (gpu,) = status_json(run_gpuwait)["gpus"]  # type: ignore[misc]
        assert gpu["external_bytes"] == 0, gpu
    finally:
        # Ended here, once it has run past the second its record is checked for.
        time.sleep(max(0.0, 1.2 - (time.monotonic() - allocated)))
        job.terminate()
        job.wait(timeout=30)
    assert job.returncode == -signal.SIGTERM  # ended by the test, not by running out of memory
    # The next look at the queue takes the ended process out and records its run.
    assert status_json(run_gpuwait)["jobs"] == []
    assert ledger_entries() == []
    history = run_gpuwait("history", "--json")
    assert history.returncode == 0, history.stderr
    (record,) = json.loads(history.stdout)
    assert record["job_id"] == entry["id"] and record["name"] == "notebook"
    assert record["peak_bytes"] == 6 * 2**30 and record["exit_status"] is None
    assert record["run_seconds"] > 1
    log = run_gpuwait("log").stdout
    # Said in words, as every other event is (not as the event's raw JSON).
    assert f"adopt     {entry['id']} (notebook) pid {job.pid} on GPU0, 6.0 GiB reserved" in log
    assert "reap" in log and "{" not in log


def test_waiting_job_is_not_admitted_onto_the_room_an_adopted_process_reserves(
    sim_file: SimFileFactory, run_gpuwait: Run, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    sim = sim_file(gpus=1)
    # It grows to 14G; adopted early with its full size, while it still uses little.
    grower = bare_job(sim, "--vram", "14G", "--ramp", "4s", "--hold", "0s")
    try:
        done = run_gpuwait("adopt", str(grower.pid), "--vram", "14G")
        assert done.returncode == 0, done.stderr
        report = tmp_path / "waiter.json"
        waiter = subprocess.Popen(
            wrapped_sim_job(
                gpuwait_cmd, ["--vram", "12G"], "--vram", "12G", "--report", str(report)
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        wait_for(lambda: any(e["state"] == "waiting" for e in ledger_entries()))
        time.sleep(1)
        # 14G reserved + 12G asked > 24G: it waits, though the card was mostly free then.
        assert [e["state"] for e in ledger_entries()] == ["running", "waiting"]
        assert grower.wait(timeout=30) == 0  # the grower never ran out of memory
        _, err = waiter.communicate(timeout=60)
        assert waiter.returncode == 0, err
        assert "out of memory" not in err.lower()
    finally:
        if grower.poll() is None:
            grower.kill()


def test_adopted_use_counts_once(
    sim_file: SimFileFactory, run_gpuwait: Run, gpuwait_cmd: list[str]
) -> None:
    sim = sim_file(gpus=1)
    job = bare_job(sim, "--vram", "10G", "--hold", "20s")
    try:
        assert run_gpuwait("adopt", str(job.pid)).returncode == 0
        # 10G adopted + 10G asked fit in 24G (safety 0.9) only if the adopted 10G count once.
        done = subprocess.run(
            wrapped_sim_job(gpuwait_cmd, ["--vram", "10G", "--timeout", "10s"], "--vram", "10G"),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
    finally:
        job.kill()
        job.wait()


def test_an_adopted_reservation_stays_within_the_sites_per_user_limit(
    sim_file: SimFileFactory, run_gpuwait: Run, gpuwait_cmd: list[str], isolated_dirs: Path
) -> None:
    sim = sim_file(gpus=1)
    site = isolated_dirs / "site-config" / "gpuwait" / "config.toml"
    site.parent.mkdir(parents=True)
    site.write_text('user_max_vram = "10GiB"\n')
    first = subprocess.Popen([*gpuwait_cmd, "-q", "--vram", "6G", "--", "sleep", "30"])
    notebook = bare_job(sim, "--vram", "2G", "--hold", "30s")
    try:
        wait_for(lambda: [e["state"] for e in ledger_entries()] == ["running"])
        # 6 GiB held and 8 GiB more reserved for a process that uses 2 GiB: over the 10 GiB a
        # user may hold, which `gpuwait --vram 8G` would wait for. Adopting cannot wait.
        over = run_gpuwait("adopt", str(notebook.pid), "--vram", "8G")
        assert over.returncode == EXIT_IMPOSSIBLE
        assert over.stderr.splitlines() == [
            f"gpuwait: error: process {notebook.pid} with 8.0 GiB reserved would go over your "
            "per-user limit of 10.0 GiB (6.0 GiB held)",
            "gpuwait: hint: reserve less (--vram), or adopt it without --vram: what it uses "
            "counts whatever the limit; the limit is the site's",
        ]
        assert len(ledger_entries()) == 1
        # What it uses is counted as it is, limit or not: adopting it only says whose it is.
        done = run_gpuwait("adopt", str(notebook.pid))
        assert done.returncode == 0, done.stderr
        assert len(ledger_entries()) == 2
    finally:
        for process in (first, notebook):
            process.kill()
            process.wait()


ON_TWO_CARDS = (
    "import os, subprocess, sys\n"
    "from gpuwait.gpu.sim import SimBackend\n"
    "job = [sys.executable, '-m', 'gpuwait', 'sim', 'job', '--hold', '20s', '--vram']\n"
    "cards = [g.uuid for g in SimBackend(os.environ['GPUWAIT_SIM']).snapshot().gpus]\n"
    "both = [\n"
    "    subprocess.Popen([*job, size], env={**os.environ, 'CUDA_VISIBLE_DEVICES': card})\n"
    "    for card, size in zip(cards, ['6G', '1G'])\n"
    "]\n"
    "sys.exit(max(p.wait() for p in both))"
)


def test_a_process_on_two_cards_is_adopted_with_what_it_uses_on_each(
    sim_file: SimFileFactory, run_gpuwait: Run, procs: Callable[..., Any]
) -> None:
    # 6 GiB on GPU 0 and 1 GiB on GPU 1: reserving 6 GiB on each kept 5 GiB of GPU 1 from
    # everyone for nothing.
    from gpuwait.gpu.sim import SimBackend

    sim = sim_file(gpus=2)
    notebook = procs([sys.executable, "-c", ON_TWO_CARDS])
    wait_for(lambda: all(g.used_bytes > 0 for g in SimBackend(sim).snapshot().gpus))
    done = run_gpuwait("adopt", str(notebook.pid))
    assert done.returncode == 0, done.stderr
    assert "6.0 GiB on GPU0, 1.0 GiB on GPU1 reserved" in done.stderr
    gpus = status_json(run_gpuwait)["gpus"]
    assert [g["reserved_bytes"] for g in gpus] == [6 * GiB, 1 * GiB]  # type: ignore[attr-defined]


def test_a_share_of_each_card_is_reserved_as_the_main_command_reserves_it(
    sim_file: SimFileFactory, run_gpuwait: Run, procs: Callable[..., Any]
) -> None:
    # `gpuwait adopt PID --vram 50%` was refused: "'50%' is not a size", though `gpuwait
    # --vram 50%` takes a share of each card, and adopt knows the cards the process is on.
    from gpuwait.gpu.sim import SimBackend

    sim = sim_file(gpus=2, memory=["24GiB", "16GiB"])
    notebook = procs([sys.executable, "-c", ON_TWO_CARDS])
    wait_for(lambda: all(g.used_bytes > 0 for g in SimBackend(sim).snapshot().gpus))
    done = run_gpuwait("adopt", str(notebook.pid), "--vram", "50%")
    assert done.returncode == 0, done.stderr
    assert "12.0 GiB on GPU0, 8.0 GiB on GPU1 reserved" in done.stderr
    gpus = status_json(run_gpuwait)["gpus"]
    assert [g["reserved_bytes"] for g in gpus] == [12 * GiB, 8 * GiB]  # type: ignore[attr-defined]
    again = run_gpuwait("adopt", str(notebook.pid), "--vram", "150%")
    assert again.returncode == EXIT_USAGE
    assert "at most 100%" in again.stderr


def test_a_process_whose_memory_the_driver_cannot_tell_is_adopted_with_vram(
    sim_file: SimFileFactory, run_gpuwait: Run
) -> None:
    # Where the driver lists a process without its memory (Windows' WDDM under WSL2, some
    # containers: NVML's "not available"), `adopt --vram 6G` was refused as a process that
    # "uses no GPU memory", though the driver named the card it runs on.
    sim = sim_file(gpus=2, per_process=False)
    job = bare_job(sim, "--vram", "6G", "--hold", "20s")
    try:
        done = run_gpuwait("adopt", str(job.pid))
        assert done.returncode == EXIT_USAGE
        assert done.stderr.splitlines() == [
            f"gpuwait: error: the driver does not tell how much GPU memory process {job.pid} "
            "uses (on GPU 0)",
            "gpuwait: hint: give its reservation: gpuwait adopt PID --vram SIZE",
        ]
        done = adopted(run_gpuwait, job.pid, "--vram", "6G")
        assert "6.0 GiB reserved on GPU 0" in done.stderr
        (entry,) = ledger_entries()
        assert (entry["gpu_uuids"], entry["reserved_bytes"]) == (
            [status_json(run_gpuwait)["gpus"][0]["uuid"]],  # type: ignore[index]
            6 * GiB,
        )
    finally:
        job.kill()
        job.wait()


def test_refuses_a_pid_that_does_not_exist(run_gpuwait: Run, sim_file: SimFileFactory) -> None:
    sim_file(gpus=1)
    done = run_gpuwait("adopt", "4194303")
    assert done.returncode == EXIT_USAGE
    assert done.stderr.splitlines()[0] == "gpuwait: error: no process 4194303"


def test_refuses_a_process_already_a_job(
    sim_file: SimFileFactory, run_gpuwait: Run, gpuwait_cmd: list[str]
) -> None:
    sim_file(gpus=1)
    wrapped = subprocess.Popen(
        wrapped_sim_job(gpuwait_cmd, ["--vram", "4G"], "--vram", "4G", "--hold", "20s"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        entry = wait_for(lambda: next((e for e in ledger_entries() if e.get("child_pid")), None))
        for pid in (entry["child_pid"], entry["pid"]):
            done = run_gpuwait("adopt", str(pid))
            assert done.returncode == EXIT_USAGE
            assert done.stderr.startswith(
                f"gpuwait: error: process {pid} already belongs to gpuwait job {entry['id']}"
            )
        assert len(ledger_entries()) == 1
    finally:
        wrapped.terminate()
        wrapped.communicate(timeout=30)


def test_refuses_a_process_a_jobs_command_started(
    sim_file: SimFileFactory, run_gpuwait: Run, gpuwait_cmd: list[str]
) -> None:
    # A program the job's command started (a worker of its, here below a shell) holds memory
    # the job's reservation already counts: adopted, it would be reserved a second time.
    sim = sim_file(gpus=1)
    worker = shlex.join([*gpuwait_cmd, "sim", "job", "--vram", "2G", "--hold", "20s"])
    wrapped = subprocess.Popen(
        [*gpuwait_cmd, "-q", "--vram", "4G", "--", "sh", "-c", f"{worker} & wait"]
    )
    try:
        from gpuwait.gpu.sim import SimBackend

        (pid,) = wait_for(
            lambda: [p.pid for g in SimBackend(sim).snapshot().gpus for p in g.processes],
            message="the worker never allocated",
        )
        # The job's gpuwait lists its command's processes as it next looks at them, not at once.
        (entry,) = wait_for(
            lambda: [e for e in ledger_entries() if pid in e.get("pids", [])],
            message="the job's gpuwait never listed its worker",
        )
        done = run_gpuwait("adopt", str(pid))
        assert done.returncode == EXIT_USAGE, done.stderr
        assert done.stderr.startswith(
            f"gpuwait: error: process {pid} already belongs to gpuwait job {entry['id']}"
        ), done.stderr
        assert len(ledger_entries()) == 1
    finally:
        wrapped.terminate()
        wrapped.wait(timeout=30)


def test_a_shell_is_adopted_without_the_jobs_below_it_and_never_the_adopts_own(
    sim_file: SimFileFactory, run_gpuwait: Run, gpuwait_cmd: list[str]
) -> None:
    # A shell running a gpuwait job (4 GiB) and a program of its own (2 GiB) was adopted with
    # 6 GiB reserved, the job's memory a second time; `gpuwait adopt $$` (or 1) made one's
    # login shell (or init) a job for as long as it lived, which `gpuwait cancel` refused.
    sim = sim_file(gpus=1)
    job = shlex.join(
        wrapped_sim_job(gpuwait_cmd, ["-q", "--vram", "4G"], "--vram", "4G", "--hold", "20s")
    )
    own = shlex.join([*SIMJOB, "--vram", "2G", "--hold", "20s"])
    shell = subprocess.Popen(["sh", "-c", f"{own} & {job}; wait"], start_new_session=True)
    try:
        from gpuwait.gpu.sim import SimBackend

        wait_for(
            lambda: SimBackend(sim).snapshot().gpus[0].used_bytes == 6 * GiB,
            timeout=30,
            message="the two programs never allocated",
        )
        (entry,) = ledger_entries()
        done = adopted(run_gpuwait, shell.pid)
        assert "2.0 GiB reserved on GPU 0" in done.stderr, done.stderr
        shell_entry = next(e for e in ledger_entries() if e["id"] != entry["id"])
        assert shell_entry["reserved_bytes"] == 2 * GiB
        assert entry["child_pid"] not in shell_entry["pids"]
        # The shell the adopt is typed in.
        line = f"{shlex.join([*gpuwait_cmd, 'adopt'])} $$"
        done = subprocess.run(
            ["sh", "-c", f"{line}; exit $?"], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == EXIT_USAGE, done.stderr
        assert "runs this gpuwait below it" in done.stderr, done.stderr
        assert len(ledger_entries()) == 2
    finally:
        os.killpg(shell.pid, signal.SIGTERM)
        shell.wait(timeout=30)
        wait_for(lambda: ledger_entries() == [], timeout=30, message="the jobs never ended")


def test_refuses_a_process_an_adopted_one_started_after_its_adoption(
    sim_file: SimFileFactory, run_gpuwait: Run, tmp_path: Path
) -> None:
    # A shell adopted with its program (3 GiB) starts a second one (2 GiB) afterwards: the
    # adopted entry's pids are those of the adoption, and the second program, running under
    # the adopted job, was adopted as a job of its own, where the adopt page says a process
    # that runs under a gpuwait job is refused.
    from gpuwait.gpu.sim import SimBackend
    from gpuwait.linux import proc

    sim = sim_file(gpus=1)
    go = tmp_path / "go"
    first = shlex.join([*SIMJOB, "--vram", "3G", "--hold", "30s"])
    second = shlex.join([*SIMJOB, "--vram", "2G", "--hold", "30s"])
    script = f"{first} & while [ ! -e {go} ]; do sleep 0.05; done; {second} & wait"
    shell = subprocess.Popen(["sh", "-c", script], start_new_session=True)
    try:
        wait_for(lambda: SimBackend(sim).snapshot().gpus[0].used_bytes == 3 * GiB, timeout=30)
        adopted(run_gpuwait, shell.pid)
        (entry,) = ledger_entries()
        go.touch()
        wait_for(lambda: SimBackend(sim).snapshot().gpus[0].used_bytes == 5 * GiB, timeout=30)
        (later,) = set(proc.process_tree([shell.pid])) - set(entry["pids"])
        done = run_gpuwait("adopt", str(later))
        assert done.returncode == EXIT_USAGE, done.stderr
        assert done.stderr.startswith(
            f"gpuwait: error: process {later} already belongs to gpuwait job {entry['id']}"
        ), done.stderr
        assert len(ledger_entries()) == 1
    finally:
        os.killpg(shell.pid, signal.SIGTERM)
        shell.wait(timeout=30)
        run_gpuwait("status")
        wait_for(lambda: ledger_entries() == [], timeout=30, message="the shell never left")


#: A notebook's kernel that uses 3 GiB of GPU 0 itself and then adopts itself as a notebook
#: does, `!gpuwait adopt {os.getpid()}`: through a shell, below it.
KERNEL = """
import os, subprocess, sys
from gpuwait.gpu.sim import Allocation, ensure_state_dir, load_sim_file, write_allocation
from gpuwait.linux import proc
config = load_sim_file(os.environ["GPUWAIT_SIM"])
me = os.getpid()
allocation = Allocation(me, proc.start_time(me), config.gpus[0].uuid, 3 << 30)
write_allocation(ensure_state_dir(config), allocation)
done = subprocess.run(["sh", "-c", f"{sys.argv[1]} {me}"], capture_output=True, text=True)
sys.stderr.write(done.stderr)
sys.exit(done.returncode)
"""


def test_a_kernel_that_uses_the_gpu_itself_adopts_itself(
    sim_file: SimFileFactory, run_gpuwait: Run, gpuwait_cmd: list[str]
) -> None:
    # A notebook kernel, the first process the adopt page names, adopting itself from a cell
    # (`!gpuwait adopt {os.getpid()}`) was refused with exit 2, 'runs this gpuwait below it (a
    # shell, a session or init)', and the hint to adopt the process that uses the GPU
    # itself, which it was. It is adopted with the 3 GiB it uses, as before.
    sim_file(gpus=1)
    adopt = shlex.join([*gpuwait_cmd, "adopt", "--name", "notebook"])
    done = subprocess.run(
        [sys.executable, "-c", KERNEL, adopt], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "3.0 GiB reserved on GPU 0" in done.stderr, done.stderr
    run_gpuwait("status")
    wait_for(lambda: ledger_entries() == [], timeout=30, message="the kernel never left")


#: A process that uses GIB GiB of GPU 0 and then runs COMMAND (with the pid to adopt, the
#: first of the chain, after it): `python -c CHAIN GIB ADOPT_PID COMMAND...`.
CHAIN = """
import os, subprocess, sys
from gpuwait.gpu.sim import Allocation, ensure_state_dir, load_sim_file, write_allocation
from gpuwait.linux import proc
config = load_sim_file(os.environ["GPUWAIT_SIM"])
me = os.getpid()
allocation = Allocation(me, proc.start_time(me), config.gpus[0].uuid, int(sys.argv[1]) << 30)
write_allocation(ensure_state_dir(config), allocation)
first = sys.argv[2] or str(me)
done = subprocess.run([*sys.argv[3:], first], capture_output=True, text=True)
sys.stderr.write(done.stderr)
sys.exit(done.returncode)
"""


def test_a_process_adopted_from_below_a_child_of_its_on_the_gpu_reserves_that_childs_memory(
    sim_file: SimFileFactory, run_gpuwait: Run, gpuwait_cmd: list[str]
) -> None:
    # A program using 3 GiB whose worker, using 5 GiB, adopts it (`gpuwait adopt` of its
    # parent, through a shell): the worker, between the program and the adopt, was left out
    # with the shell and the gpuwait, and the program was adopted with 3 GiB reserved where
    # it and its children use 8 GiB (what the adopt page says it reserves).
    sim_file(gpus=1)
    adopt = shlex.join([*gpuwait_cmd, "adopt"])
    worker = [sys.executable, "-c", CHAIN, "5", "", "sh", "-c", f'{adopt} "$0"']
    done = subprocess.run(
        [sys.executable, "-c", CHAIN, "3", "", *worker], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "8.0 GiB reserved on GPU 0" in done.stderr, done.stderr
    run_gpuwait("status")
    wait_for(lambda: ledger_entries() == [], timeout=30, message="the program never left")


def test_refuses_a_job_that_has_not_allocated_yet_as_a_job(
    sim_file: SimFileFactory, run_gpuwait: Run, gpuwait_cmd: list[str]
) -> None:
    # A job's command still loading (no GPU memory yet) was refused for that, "adopt it once
    # it has allocated memory", which would then have been refused again: it is a job already.
    sim_file(gpus=1)
    wrapped = subprocess.Popen([*gpuwait_cmd, "-q", "--vram", "4G", "--", "sleep", "20"])
    try:
        entry = wait_for(lambda: next((e for e in ledger_entries() if e.get("child_pid")), None))
        done = run_gpuwait("adopt", str(entry["child_pid"]))
        assert done.returncode == EXIT_USAGE
        assert done.stderr.startswith(
            f"gpuwait: error: process {entry['child_pid']} already belongs to gpuwait job "
            f"{entry['id']}"
        ), done.stderr
    finally:
        wrapped.terminate()
        wrapped.wait(timeout=30)


def test_refuses_a_process_without_gpu_memory(sim_file: SimFileFactory, run_gpuwait: Run) -> None:
    sim_file(gpus=1)
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        done = run_gpuwait("adopt", str(sleeper.pid), "--vram", "2G")
        assert done.returncode == EXIT_USAGE
        assert "uses no GPU memory that gpuwait can see" in done.stderr
        assert ledger_entries() == []
    finally:
        sleeper.kill()
        sleeper.wait()


def test_refuses_a_reservation_of_nothing(sim_file: SimFileFactory, run_gpuwait: Run) -> None:
    sim = sim_file(gpus=1)
    job = bare_job(sim, "--vram", "2G", "--hold", "30s")
    try:
        done = run_gpuwait("adopt", str(job.pid), "--vram", "0G")
        assert done.returncode == EXIT_USAGE
        assert done.stderr.splitlines() == ["gpuwait: error: --vram: reserve more than 0 bytes"]
        assert ledger_entries() == []
    finally:
        job.terminate()
        job.wait(timeout=30)


@pytest.mark.skipif(not users.can_switch_users(), reason="needs root to act as another user")
def test_root_refuses_another_users_process_in_a_shared_ledger_directory(
    sim_file: SimFileFactory, run_gpuwait: Run, tmp_path: Path
) -> None:
    # Each user's entries live in a file only they write: one root wrote for them in its own
    # would stand for nobody's job in any member's plan.
    sim_file(gpus=1)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    sleeper = subprocess.Popen(["sleep", "30"], user=4242, group=4242)
    try:
        done = run_gpuwait("adopt", str(sleeper.pid), env={"GPUWAIT_LEDGER_DIR": str(shared)})
        assert done.returncode == EXIT_NOT_PERMITTED, done.stderr
        assert done.stderr.splitlines()[0] == (
            f"gpuwait: error: process {sleeper.pid} belongs to uid 4242: in a shared ledger "
            "directory only its owner can adopt it"
        )
        assert list(shared.iterdir()) == []
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.skipif(not users.can_switch_users(), reason="needs root to act as another user")
def test_refuses_another_users_process(tmp_path: Path) -> None:
    root = users.shared_root()
    env = users.user_home(root, 4242, 4242)
    sleeper = subprocess.Popen(["sleep", "30"])  # root's
    try:
        done = users.run_as(4242, 4242, [], ["adopt", str(sleeper.pid)], env)
        assert done.returncode == EXIT_NOT_PERMITTED, done.stderr
        assert done.stderr.splitlines()[0] == (
            f"gpuwait: error: process {sleeper.pid} belongs to uid 0: only your own can be adopted"
        )
    finally:
        sleeper.kill()
        sleeper.wait()


def test_other_members_of_a_shared_ledger_count_an_adopted_process() -> None:
    from gpuwait.linux import proc
    from gpuwait.linux.security import proven_entry

    sleeper = subprocess.Popen(["sleep", "30"])  # no gpuwait: its own entry's gpuwait
    try:
        start = proc.start_time(sleeper.pid)
        assert start is not None
        uid, pid = os.getuid(), sleeper.pid
        assert proven_entry(uid, pid, start, "running", pid, start)
        # A waiting entry, or one whose command is another process, still needs a gpuwait.
        assert not proven_entry(uid, pid, start, "waiting", pid, start)
        assert not proven_entry(uid, pid, start, "running", 1, 1)
    finally:
        sleeper.kill()
        sleeper.wait()


def recorded_run_seconds(
    sim_file: SimFileFactory, run_gpuwait: Run, moved: Callable[[Job], None], reaper: Run
) -> tuple[float, float]:
    """An adopted process ended after `moved` changed its entry (as a clock stepped would
    have), and found ended by `reaper`: its history record's run time, and how long it really
    ran at most."""
    sim = sim_file(gpus=1)
    job = bare_job(sim, "--vram", "2G", "--hold", "30s")
    try:
        adopted(run_gpuwait, job.pid)
        began = time.monotonic()
        with Ledger(Path(os.environ["XDG_STATE_HOME"]) / "gpuwait").transaction() as data:
            (entry,) = data.jobs
            moved(entry)
    finally:
        job.terminate()
        job.wait(timeout=30)
    done = reaper("status", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["jobs"] == []  # taken out, its run recorded
    (record,) = json.loads(run_gpuwait("history", "--json").stdout)
    return record["run_seconds"], time.monotonic() - began + 1


def test_an_adopted_process_is_recorded_with_its_run_time_whatever_the_wall_clock_did(
    sim_file: SimFileFactory, run_gpuwait: Run
) -> None:
    # NTP stepped the wall clock an hour forward while the adopted process ran (as if, by the
    # wall clock, it had been adopted an hour earlier): its history said it ran for an hour.
    def stepped(entry: Job) -> None:
        assert entry.started_at is not None
        entry.submitted_at -= 3600
        entry.started_at -= 3600

    ran, at_most = recorded_run_seconds(sim_file, run_gpuwait, stepped, run_gpuwait)
    assert ran <= at_most


def test_an_adopted_process_is_recorded_without_the_time_the_machine_slept(
    sim_file: SimFileFactory, run_gpuwait: Run, tmp_path: Path
) -> None:
    # Adopted, then the laptop was closed for two hours: the process slept with the machine,
    # as a wrapped command does, whose run time leaves the suspend out. The adopted one's
    # history said it ran for two hours, and taught its command's next run that much.
    woke = tmp_path / "woke"
    woke.touch()

    def woken(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*suspended_gpuwait(woke), *args], capture_output=True, text=True, timeout=60
        )

    ran, at_most = recorded_run_seconds(sim_file, run_gpuwait, lambda entry: None, woken)
    assert ran <= at_most


@pytest.mark.parametrize("script", ["kernel.py", "gpuwait_demo.py"])
def test_cancel_of_an_adopted_process_says_to_stop_it_by_hand(
    sim_file: SimFileFactory, run_gpuwait: Run, tmp_path: Path, script: str
) -> None:
    # A notebook kernel adopted, then `gpuwait cancel` of it: refused as "not a gpuwait
    # process; refusing to signal it", which read as a forged entry, with no word of what to do.
    # A program of the user's whose name has "gpuwait" in it (gpuwait_demo.py) got the TERM.
    sim = sim_file(gpus=1)
    kernel = tmp_path / script  # a program of the user's
    kernel.write_text(
        "import sys\nfrom gpuwait.gpu import simjob\nsys.exit(simjob.main(sys.argv[1:]))\n"
    )
    job = subprocess.Popen(
        [sys.executable, str(kernel), "--vram", "2G", "--hold", "30s"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: used_on_gpu0(sim), message="the kernel never allocated")
        adopted(run_gpuwait, job.pid, "--name", "nb")
        done = run_gpuwait("cancel", "nb")
        assert done.returncode == EXIT_NOT_PERMITTED, done.stderr
        assert "adopted" in done.stderr and f"kill {job.pid}" in done.stderr, done.stderr
        assert "refusing to signal" not in done.stderr and len(done.stderr.splitlines()) == 1
        assert job.poll() is None, "gpuwait signalled a process it did not start"
        # The event log said "refused, not theirs" of the user's own job.
        logged = run_gpuwait("log", "-n", "1").stdout
        assert "(running) by uid" in logged and "refused: it is process" in logged, logged
        assert "not theirs" not in logged
    finally:
        job.kill()
        job.wait()


def test_a_name_adopt_cannot_give_is_refused_before_anything_else(
    sim_file: SimFileFactory, run_gpuwait: Run
) -> None:
    # `gpuwait adopt --name '' PID` on a process adopted already said "already belongs", the
    # name unchecked; on one not adopted it gave a job a name `gpuwait --name` refuses.
    sim = sim_file(gpus=1)
    job = bare_job(sim, "--vram", "2G", "--hold", "60s")
    try:
        for name in ("", "a b"):
            done = run_gpuwait("adopt", "--name", name, str(job.pid))
            assert done.returncode == EXIT_USAGE, done.stderr
            assert done.stderr.startswith(
                f"gpuwait: error: --name {name!r}: use up to 100 letters"
            ), done.stderr
        assert ledger_entries() == []
        adopted(run_gpuwait, job.pid)
        again = run_gpuwait("adopt", "--name", "", str(job.pid))
        assert again.returncode == EXIT_USAGE, again.stderr
        assert "--name ''" in again.stderr and "already belongs" not in again.stderr
    finally:
        job.terminate()
        job.wait(timeout=10)
