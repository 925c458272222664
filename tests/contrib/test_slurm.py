"""contrib/slurm on a real Slurm: a one-node cluster (contrib/slurm/try-cluster) whose two GRES
GPUs are the simulation's two cards, GRES device i being simulated GPU i (NVML index i).

The simulated cards differ in speed, so CUDA's default order (fastest first) is the reverse of
the NVML order: a step that took Slurm's index in CUDA_VISIBLE_DEVICES as a CUDA index would land
on the other allocation's card.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO
from helpers.fixtures_sim import sim_file_text
from helpers.ports import free_ports
from helpers.shellbin import env_with_bin, make_bin
from helpers.waiting import catches_signal, wait_for

SLURM = REPO / "contrib" / "slurm"
TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "scancel", "sinfo")
#: Where Debian puts the daemons, which a non-login PATH may lack.
SBIN = "/usr/sbin:/sbin"


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root: slurmd starts every job as its user"
    search = f"{os.environ.get('PATH', '')}:{SBIN}"
    missing = [tool for tool in TOOLS if shutil.which(tool, path=search) is None]
    if missing:
        return (
            f"needs Slurm and Munge ({', '.join(missing)} missing): Debian's slurmctld, slurmd, "
            "slurm-client and munge packages, which .ci/run installs"
        )
    return None


pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.skipif(_why_not() is not None, reason=_why_not() or ""),
]


class Cluster:
    def __init__(self, root: Path, bin_dir: Path) -> None:
        self.root = root
        self.bin_dir = bin_dir
        self.sim = root / "sim.toml"

    def env(self, tmp_path: Path, **extra: str) -> dict[str, str]:
        """What a user of the cluster has: Slurm's config, the simulation, gpuwait on PATH."""
        env = env_with_bin(self.bin_dir)
        env["PATH"] += f":{SBIN}"
        env.update(SLURM_CONF=str(self.root / "slurm.conf"), GPUWAIT_SIM=str(self.sim))
        env["TMPDIR"] = str(tmp_path)
        env.update(extra)
        return env

    def uuids(self) -> list[str]:
        from gpuwait.gpu.sim import SimBackend

        return [g.uuid for g in SimBackend(str(self.sim)).snapshot().gpus]


def _try_cluster(action: str, root: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SLURM / "try-cluster"), action, str(root)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _daemons_of(root: Path) -> list[str]:
    """Processes of this cluster still alive: its daemons and any job step's slurmstepd."""
    alive = []
    for proc_dir in Path("/proc").iterdir():
        if not proc_dir.name.isdigit():
            continue
        try:
            comm = (proc_dir / "comm").read_text().strip()
            cmdline = (proc_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            environ = (proc_dir / "environ").read_bytes()
        except OSError:
            continue
        ours = str(root).encode() in environ or str(root) in cmdline
        if comm in ("munged", "slurmctld", "slurmd", "slurmstepd") and ours:
            alive.append(f"{proc_dir.name} {cmdline}")
    return alive


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("slurm")
    bin_dir = make_bin(root / "bin")
    cluster = Cluster(root, bin_dir)
    # GPU 1 is the faster card: CUDA device 0 by default, NVML (and Slurm) index 1.
    cluster.sim.write_text(sim_file_text(2, "24GiB", speed=[1.0, 2.0]))
    env = env_with_bin(bin_dir)
    env["PATH"] += f":{SBIN}"
    # Ports of its own, so that another run of these tests (or a cluster of the user's) is no
    # obstacle; try-cluster's default is a fixed pair.
    env["TRY_PORT"] = str(free_ports(2))
    started = time.monotonic()
    up = _try_cluster("up", root, env)
    took = time.monotonic() - started
    try:
        assert up.returncode == 0, up.stdout + up.stderr + _logs(root)
        assert took < 15, f"the cluster took {took:.1f}s to come up"
        yield cluster
    finally:
        down = _try_cluster("down", root, env)
        assert down.returncode == 0, down.stdout + down.stderr
        assert _daemons_of(root) == [], "left running after try-cluster down"
        assert not (root / "dev").exists()


def _logs(root: Path) -> str:
    logs = sorted((root / "log").glob("*.log")) if (root / "log").is_dir() else []
    return "".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in logs)


def sbatch(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        ["sbatch", "--parsable", *args], env=env, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip().split(";")[0]


def job_info(env: dict[str, str], job_id: str) -> dict[str, str]:
    """`scontrol show job` as a dict; {} once Slurm has forgotten the job."""
    done = subprocess.run(
        ["scontrol", "show", "job", "--oneliner", job_id],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    if done.returncode != 0:
        return {}
    return dict(
        field.split("=", 1) for field in done.stdout.split() if "=" in field and field[0] != "="
    )


FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def wait_ended(env: dict[str, str], job_id: str, timeout: float) -> dict[str, str]:
    return wait_for(
        lambda: (info := job_info(env, job_id)) and info["JobState"] in FINISHED and info,
        timeout=timeout,
        interval=0.2,
        message=lambda: f"job {job_id} did not end: {job_info(env, job_id)}",
    )


def steps_file(path: Path, reports: Path, count: int, vram: str, hold: str) -> Path:
    reports.mkdir(parents=True, exist_ok=True)
    lines = [
        f"gpuwait sim job --vram {vram} --hold {hold} --report {reports}/{i}.json"
        for i in range(count)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def history(state_dir: Path) -> list[dict[str, Any]]:
    path = state_dir / "history.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def most_at_once(records: list[dict[str, Any]]) -> int:
    """The most runs that overlapped in time."""
    edges = []
    for r in records:
        edges += [(r["started_at"], 1), (r["started_at"] + r["run_seconds"], -1)]
    now = best = 0
    for _, step in sorted(edges, key=lambda e: (e[0], e[1])):
        now += step
        best = max(best, now)
    return best


def test_pack_steps_in_two_allocations_uses_only_the_gpu_each_was_given(
    cluster: Cluster, tmp_path: Path
) -> None:
    # Each allocation's ledger where the test can read its history afterwards (the directory the
    # script would make is removed when it ends).
    def env_of(name: str) -> dict[str, str]:
        state = str(tmp_path / f"state-{name}")
        return cluster.env(tmp_path, STEP_VRAM="6G", MAX_PARALLEL="8", GPUWAIT_STATE_DIR=state)

    env = env_of("a")
    jobs = {}
    for name in ("a", "b"):
        steps = steps_file(tmp_path / f"{name}.txt", tmp_path / name, 8, "6G", "1s")
        jobs[name] = sbatch(
            env_of(name),
            "--gres=gpu:1",
            f"--output={tmp_path}/{name}.out",
            str(SLURM / "pack-steps.sbatch"),
            str(steps),
        )
    uuids = cluster.uuids()
    given = {}
    for name, job_id in jobs.items():
        info = wait_ended(env, job_id, timeout=60)
        out = (tmp_path / f"{name}.out").read_text()
        assert info["JobState"] == "COMPLETED", out
        assert "8 step(s), 0 failed" in out
        # Slurm's index, as Slurm means it: the node's GRES device, which is NVML index.
        index = int(out.split(": GPUs ", 1)[1].split(";")[0])
        given[name] = index
        reports = [json.loads(p.read_text()) for p in (tmp_path / name).glob("*.json")]
        assert len(reports) == 8
        assert {r["gpu_uuid"] for r in reports} == {uuids[index]}, f"allocation {name}"
        assert not any(r["oom"] for r in reports)
        records = history(tmp_path / f"state-{name}")
        assert len(records) == 8
        assert not any(r["oom"] for r in records)
        # Packed by VRAM: three 6G steps side by side on a 24 GiB card (21.6 GiB at safety
        # 0.9), not one at a time, and never a fourth.
        assert 2 <= most_at_once(records) <= 3
    assert sorted(given.values()) == [0, 1], "two allocations on the same GRES device"


def test_pack_steps_in_two_allocations_given_shards_of_one_gpu_take_turns(
    cluster: Cluster, tmp_path: Path
) -> None:
    # Slurm gives shards of one GPU to several jobs at once, each with that GPU in
    # CUDA_VISIBLE_DEVICES: their steps, 8 GiB each on a 24 GiB card, must start two at a time
    # over both allocations, not two in each (they ran out of memory, each allocation with a
    # ledger of its own).
    env = cluster.env(tmp_path, STEP_VRAM="8G", MAX_PARALLEL="2")
    jobs = {}
    for name in ("a", "b"):
        lines = [
            f"gpuwait sim job --vram 8G --ramp 0.3s --hold 1s --report {tmp_path}/{name}-{i}.json"
            for i in range(2)
        ]
        steps = tmp_path / f"{name}.txt"
        steps.write_text("\n".join(lines) + "\n")
        jobs[name] = sbatch(
            env,
            "--gres=shard:1",
            f"--output={tmp_path}/{name}.out",
            str(SLURM / "pack-steps.sbatch"),
            str(steps),
        )
    outs = {}
    for name, job_id in jobs.items():
        info = wait_ended(env, job_id, timeout=60)
        outs[name] = (tmp_path / f"{name}.out").read_text()
        assert info["JobState"] == "COMPLETED", outs[name]
        assert "2 step(s), 0 failed" in outs[name]
    given = {out.split(": GPUs ", 1)[1].split(";")[0] for out in outs.values()}
    assert len(given) == 1, f"Slurm put the two allocations' shards on GPUs {given}"
    reports = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    assert len(reports) == 4 and not any(r["oom"] for r in reports)
    # One ledger, the user's own on the node, holds all four runs.
    records = history(Path(env["XDG_STATE_HOME"]) / "gpuwait")
    assert len(records) == 4 and most_at_once(records) == 2


def test_a_batch_job_given_no_gpu_is_refused(cluster: Cluster, tmp_path: Path) -> None:
    # Slurm starts a job without --gres=gpu with no CUDA_VISIBLE_DEVICES at all, so every GPU
    # of the node, each perhaps another job's, would have looked free to it.
    env = cluster.env(tmp_path)
    out = tmp_path / "out"
    script = "gpuwait --vram 1G -- echo ran; echo status=$?"
    job = sbatch(env, f"--output={out}", "--wrap", script)
    wait_ended(env, job, timeout=30)
    text = out.read_text()
    assert "status=3" in text, text
    assert "Slurm gave this job no GPU" in text
    assert "ran" not in text.splitlines()


def test_a_step_given_none_of_the_jobs_gpus_is_refused(cluster: Cluster, tmp_path: Path) -> None:
    # `srun --gres=none` in a job with a GPU starts the step with no CUDA_VISIBLE_DEVICES but
    # with the job's SLURM_JOB_GPUS: every GPU of the node, each perhaps another job's, would
    # have looked free to it.
    env = cluster.env(tmp_path)
    out = tmp_path / "out"
    script = "srun --overlap --gres=none gpuwait --vram 1G -- echo ran; echo status=$?"
    job = sbatch(env, "--gres=gpu:1", f"--output={out}", "--wrap", script)
    wait_ended(env, job, timeout=30)
    text = out.read_text()
    assert "status=3" in text, text
    assert "this Slurm job has GPUs (SLURM_JOB_GPUS=0) but this step none of them" in text
    assert "ran" not in text.splitlines()


def test_steps_spread_over_both_gpus_of_a_two_gpu_allocation(
    cluster: Cluster, tmp_path: Path
) -> None:
    env = cluster.env(tmp_path, STEP_VRAM="16G", MAX_PARALLEL="4")
    steps = steps_file(tmp_path / "steps.txt", tmp_path / "r", 4, "16G", "1s")
    job_id = sbatch(
        env,
        "--gres=gpu:2",
        f"--output={tmp_path}/out",
        str(SLURM / "pack-steps.sbatch"),
        str(steps),
    )
    info = wait_ended(env, job_id, timeout=60)
    out = (tmp_path / "out").read_text()
    assert info["JobState"] == "COMPLETED", out
    assert "GPUs 0,1;" in out
    reports = [json.loads(p.read_text()) for p in (tmp_path / "r").glob("*.json")]
    assert {r["gpu_uuid"] for r in reports} == set(cluster.uuids())
    assert not any(r["oom"] for r in reports)


def test_scancel_with_waiting_steps_leaves_no_entries(cluster: Cluster, tmp_path: Path) -> None:
    # A state dir of the user's own, which the script keeps (one it made, it removes).
    state = tmp_path / "state"
    env = cluster.env(tmp_path, STEP_VRAM="20G", MAX_PARALLEL="4", GPUWAIT_STATE_DIR=str(state))
    steps = steps_file(tmp_path / "steps.txt", tmp_path / "r", 4, "20G", "120s")
    job_id = sbatch(
        env,
        "--gres=gpu:1",
        f"--output={tmp_path}/out",
        str(SLURM / "pack-steps.sbatch"),
        str(steps),
    )

    def ledger() -> Path:
        return state / "ledger.json"

    def states() -> list[str]:
        try:
            return sorted(j["state"] for j in json.loads(ledger().read_text())["jobs"])
        except (OSError, ValueError, KeyError):
            return []

    # One step runs (20G of 24 GiB), three wait for it.
    wait_for(
        lambda: states() == ["running", "waiting", "waiting", "waiting"],
        timeout=30,
        message=lambda: f"ledger: {states()}",
    )
    pids = [j["pid"] for j in json.loads(ledger().read_text())["jobs"]]
    subprocess.run(["scancel", job_id], env=env, check=True, timeout=30)
    info = wait_ended(env, job_id, timeout=30)
    assert info["JobState"] == "CANCELLED"
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in pids), timeout=15)
    # Read as it lies on disk, not through gpuwait (which would tidy up what it finds).
    assert json.loads(ledger().read_text())["jobs"] == []


def _catching_checkpoint_signal(cluster: Cluster, job_id: str) -> bool:
    """The allocation's job (the command its gpuwait --pausable runs) has its USR1 handler in."""
    # Job IDs start at 1 on every cluster: this one's, by its configuration.
    ours = {f"SLURM_CONF={cluster.root / 'slurm.conf'}".encode(), f"SLURM_JOB_ID={job_id}".encode()}
    for proc_dir in Path("/proc").iterdir():
        if not proc_dir.name.isdigit():
            continue
        try:
            environ = set((proc_dir / "environ").read_bytes().split(b"\0"))
            stat = (proc_dir / "stat").read_text()
            ppid = stat[stat.rindex(")") + 2 :].split()[1]
            parent = Path(f"/proc/{ppid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if ours <= environ and b"--pausable" in parent:
            return catches_signal(int(proc_dir.name), signal.SIGUSR1)
    return False


def test_usr1_to_the_batch_script_checkpoints_and_the_requeued_job_resumes(
    cluster: Cluster, tmp_path: Path
) -> None:
    """What the script does with the signal its --signal=B:USR1@N asks for: the batch shell alone
    is sent USR1 (scancel --batch, as slurmctld sends it at the time limit; the next test has
    Slurm send it itself), the job checkpoints, the allocation is requeued and resumes."""
    hold = 8.0  # the signal is sent once the job catches it, well before its end
    ckpt = tmp_path / "ckpt.json"
    env = cluster.env(tmp_path, JOB_VRAM="4G")
    job_id = sbatch(
        env,
        f"--output={tmp_path}/out",
        str(SLURM / "pausable.sbatch"),
        *("gpuwait", "sim", "job", "--vram", "4G", "--hold", f"{hold}s"),
        *("--checkpoint", str(ckpt)),
    )
    wait_for(
        lambda: _catching_checkpoint_signal(cluster, job_id),
        timeout=60,
        message=lambda: f"never ran: {job_info(env, job_id)}",
    )
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], env=env, check=True, timeout=30)
    saved: list[float] = []

    def ended() -> dict[str, str] | None:
        info = job_info(env, job_id)
        try:
            state = json.loads(ckpt.read_text())
        except (OSError, ValueError):
            state = None
        if state and not state["finished"] and state["held_seconds"] not in saved:
            saved.append(state["held_seconds"])
        return info if info and info["JobState"] in FINISHED else None

    info = wait_for(ended, timeout=100, interval=0.2, message=lambda: str(job_info(env, job_id)))
    out = (tmp_path / "out").read_text()
    assert info["JobState"] == "COMPLETED", out
    assert int(info["Restarts"]) >= 1, out
    assert "time limit near: asking for a checkpoint" in out
    assert f"checkpointed; requeueing allocation {job_id}" in out
    assert f"allocation {job_id}, start 1: GPUs" in out
    state = json.loads(ckpt.read_text())
    assert state["finished"] and state["held_seconds"] == hold
    # Each checkpoint saved more progress, and the last run did only what was left.
    assert saved and saved == sorted(saved) and 0 < saved[0] < hold, saved
    hours, minutes, seconds = (int(x) for x in info["RunTime"].split(":"))
    last_run = hours * 3600 + minutes * 60 + seconds
    assert last_run <= hold - saved[-1] + 5, (last_run, saved)


def test_slurm_sends_the_time_limit_signal_to_the_batch_script(
    cluster: Cluster, tmp_path: Path
) -> None:
    """--signal=B:USR1@N as the script's header has it reaches the script's trap before the limit,
    from Slurm itself; the previous test follows the checkpoint through the requeue and resume."""
    # Longer than the signal may take: due 5 s after the start, sent within 30 s more. The test
    # ends at the requeue, so the length costs nothing.
    hold = 60.0
    ckpt = tmp_path / "ckpt.json"
    env = cluster.env(tmp_path, JOB_VRAM="4G")
    # The signal is due 5 s after the start (1 minute's limit, USR1 55 s before it), when the
    # script's gpuwait catches it; slurmctld sends it at its next check of time limits, up to
    # 30 s later.
    job_id = sbatch(
        env,
        "--time=1",
        "--signal=B:USR1@55",
        f"--output={tmp_path}/out",
        str(SLURM / "pausable.sbatch"),
        *("gpuwait", "sim", "job", "--vram", "4G", "--hold", f"{hold}s"),
        *("--checkpoint", str(ckpt)),
    )

    def requeued() -> bool:
        out = tmp_path / "out"
        return out.exists() and f"checkpointed; requeueing allocation {job_id}" in out.read_text()

    try:
        wait_for(requeued, timeout=90, interval=0.2, message=lambda: str(job_info(env, job_id)))
    finally:
        # What follows the requeue is the previous test's; the allocation goes now.
        subprocess.run(["scancel", job_id], env=env, capture_output=True, timeout=30)
    out = (tmp_path / "out").read_text()
    assert "time limit near: asking for a checkpoint" in out
    state = json.loads(ckpt.read_text())
    assert not state["finished"] and 0 < state["held_seconds"] < hold, state
    assert wait_ended(env, job_id, timeout=30)["JobState"] == "CANCELLED"
