"""Learning VRAM from history, end to end: real gpuwait processes on simulated GPUs."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.fixtures_sim import SimFileFactory
from helpers.history import a_run
from helpers.waiting import ledger_entries, wait_for

from gpuwait.core.estimate import tidy_size
from gpuwait.history.store import append_record

GiB = 2**30


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    kw.setdefault("timeout", 90)
    return subprocess.run(cmd, capture_output=True, text=True, **kw)  # type: ignore[no-any-return]


def history() -> list[dict[str, Any]]:
    path = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "history.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def sim_job(gpuwait_cmd: list[str], vram: str, *extra: str) -> list[str]:
    return [*gpuwait_cmd, "sim", "job", "--vram", vram, *extra]


def estimate_of(gpuwait_cmd: list[str], command: list[str]) -> dict[str, Any]:
    done = run([*gpuwait_cmd, "estimate", "--json", "--", *command])
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def three_runs(command: list[str], cwd: str, peak: int) -> None:
    """Three successful runs of `command` in the history, each with `peak` bytes on one GPU."""
    state = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait"
    state.mkdir(mode=0o700, parents=True, exist_ok=True)
    for i in range(3):
        append_record(state, a_run(command, cwd, time.time() - 60 + i, peak_by_gpu={"GPU-x": peak}))


def running_jobs() -> int:
    path = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "ledger.json"
    if not path.exists():
        return 0
    return sum(1 for j in json.loads(path.read_text())["jobs"] if j["state"] == "running")


def test_oom_on_a_nearly_full_card_is_recorded_and_raises_the_estimate(
    sim_file: SimFileFactory, gpuwait_cmd: list[str]
) -> None:
    # 19 GiB held outside gpuwait: 2 GiB still fit under safety 0.9, 20 GiB do not.
    sim_file(gpus=1, memory="24GiB", base_used="19GiB")
    job = sim_job(gpuwait_cmd, "20G", "--hold", "0")
    done = run([*gpuwait_cmd, "--vram", "2G", "--", *job])
    assert done.returncode == 1
    assert "CUDA out of memory" in done.stderr  # passed on unchanged
    record = history()[-1]
    assert record["oom"] is True and record["oom_evidence"] == "message"
    assert record["stderr_watched"] == "pipe" and record["request_source"] == "flag"
    learned = estimate_of(gpuwait_cmd, job)
    assert learned["estimate_bytes"] > max(2 * GiB, record["peak_bytes"] or 0)
    # The message said it tried to allocate 20 GiB, with nothing yet: that with the margin,
    # capped at what the card gives under the safety factor.
    assert learned["oom_floor_bytes"] == 22 * GiB
    assert learned["estimate_bytes"] == int(0.9 * 24 * GiB)
    assert "out-of-memory" in learned["based_on"]


def test_oom_seen_in_a_stderr_log_file(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    sim_file(gpus=1, memory="24GiB", base_used="19GiB")
    log = tmp_path / "log"
    with log.open("w") as handle:
        code = subprocess.run(
            [*gpuwait_cmd, "--vram", "2G", "--", *sim_job(gpuwait_cmd, "20G", "--hold", "0")],
            stderr=handle,
            timeout=60,
        ).returncode
    assert code == 1 and "CUDA out of memory" in log.read_text()
    record = history()[-1]
    assert record["stderr_watched"] == "file" and record["oom"] is True


def test_a_failure_with_the_card_full_at_its_peak_counts_as_oom(
    sim_file: SimFileFactory, gpuwait_cmd: list[str]
) -> None:
    # No message to go by (stderr not watched): the card ran full at the job's peak.
    sim_file(gpus=1, memory="24GiB")
    # Sampled every 0.1 s, the full card is seen in the 0.4 s the job holds its peak.
    env = {**os.environ, "GPUWAIT_WATCH_STDERR": "off", "GPUWAIT_SAMPLE_INTERVAL": "0.1s"}
    job = sim_job(gpuwait_cmd, "23.9G", "--hold", "0.4s", "--exit", "1")
    done = run([*gpuwait_cmd, "--vram", "20G", "--", *job], env=env)
    assert done.returncode == 1
    record = history()[-1]
    assert record["oom"] is True and record["oom_evidence"] == "card full"
    assert record["stderr_watched"] == "off"


def test_failure_without_oom_is_not_an_oom(
    sim_file: SimFileFactory, gpuwait_cmd: list[str]
) -> None:
    sim_file(gpus=1, memory="24GiB")
    done = run([*gpuwait_cmd, "--vram", "2G", "--", "sh", "-c", "echo bad input >&2; exit 3"])
    assert done.returncode == 3 and done.stderr == "bad input\n"
    assert history()[-1]["oom"] is False


@pytest.mark.slow
def test_three_runs_teach_the_size_and_the_fourth_runs_without_vram(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sim_file(gpus=1, memory="24GiB")
    # Sampled every 0.1 s, a run that holds its peak for 0.4 s has it read a few times over.
    monkeypatch.setenv("GPUWAIT_SAMPLE_INTERVAL", "0.1s")
    job = sim_job(gpuwait_cmd, "3G", "--ramp", "0.2s", "--hold", "0.4s")
    for _ in range(3):
        done = run([*gpuwait_cmd, "--vram", "8G", "--", *job])
        assert done.returncode == 0, done.stderr
    assert [r["peak_bytes"] for r in history()] == [3 * GiB] * 3
    # Someone else holds most of the card: a whole GPU (the default) would have to wait.
    holder = subprocess.Popen(
        [*gpuwait_cmd, "--vram", "12G", "-q", "--", *sim_job(gpuwait_cmd, "12G", "--hold", "30s")]
    )
    try:
        wait_for(lambda: running_jobs() == 1, timeout=30)
        done = run([*gpuwait_cmd, "-v", "--timeout", "20s", "--", *job])
    finally:
        holder.terminate()
        holder.wait()
    assert done.returncode == 0, done.stderr
    assert "estimated from 3 runs of this exact command" in done.stderr
    fourth = history()[3]
    assert fourth["request_source"] == "estimate" and fourth["oom"] is False
    assert fourth["peak_bytes"] == 3 * GiB
    assert 3 * GiB < fourth["reserved_bytes"] <= 3 * GiB * 1.25


@pytest.mark.slow
def test_retry_oom_queues_again_with_a_raised_estimate(
    sim_file: SimFileFactory, gpuwait_cmd: list[str]
) -> None:
    sim_file(gpus=1, memory="24GiB")
    # 18 GiB held outside gpuwait for a while: 5 GiB cannot be had until it ends.
    outside = subprocess.Popen(
        [*gpuwait_cmd, "sim", "job", "--vram", "18G", "--hold", "3s"],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"},
    )
    try:
        sim = Path(os.environ["GPUWAIT_SIM"])
        from gpuwait.gpu.sim import SimBackend

        wait_for(lambda: SimBackend(str(sim)).snapshot().gpus[0].used_bytes >= 18 * GiB)
        job = sim_job(gpuwait_cmd, "7G", "--hold", "0.2s")
        done = run([*gpuwait_cmd, "--vram", "2G", "--retry-oom", "3", "--", *job])
    finally:
        outside.kill()
        outside.wait()
    assert done.returncode == 0, done.stderr
    runs = history()
    assert runs[0]["oom"] is True and runs[-1]["oom"] is False and runs[-1]["exit_status"] == 0
    assert 2 <= len(runs) <= 4
    reserved = [r["reserved_bytes"] for r in runs]
    assert reserved == sorted(set(reserved)) and reserved[0] == 2 * GiB
    assert (
        "retrying with" in done.stderr and done.stderr.count("CUDA out of memory") == len(runs) - 1
    )


def test_without_retry_the_oom_exit_status_passes_through(
    sim_file: SimFileFactory, gpuwait_cmd: list[str]
) -> None:
    sim_file(gpus=1, memory="24GiB", base_used="19GiB")
    done = run([*gpuwait_cmd, "--vram", "2G", "--", *sim_job(gpuwait_cmd, "20G", "--hold", "0")])
    assert done.returncode == 1 and "retrying" not in done.stderr
    assert len(history()) == 1


def test_no_history_says_so_in_the_wait_line(
    sim_file: SimFileFactory, gpuwait_cmd: list[str]
) -> None:
    sim_file(gpus=1, memory="24GiB", base_used="4GiB")  # not free enough for a whole GPU
    done = run([*gpuwait_cmd, "--timeout", "0.3s", "--", "true"])
    assert done.returncode == 124
    assert "waiting for a whole GPU (no earlier runs of this command: default_vram)" in done.stderr


def test_a_damaged_history_stops_nothing(sim_file: SimFileFactory, gpuwait_cmd: list[str]) -> None:
    sim_file(gpus=1, memory="24GiB")
    for _ in range(3):
        assert run([*gpuwait_cmd, "--vram", "1G", "--", "true"]).returncode == 0
    path = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "history.jsonl"
    with path.open("ab") as handle:
        handle.write(b"{this is not json\n")
    done = run([*gpuwait_cmd, "--", "true"])
    assert done.returncode == 0
    assert done.stderr.count("damaged line") == 1
    assert history_records_ok(path) == 4
    again = run([*gpuwait_cmd, "--", "true"])
    assert again.returncode == 0 and "damaged" not in again.stderr
    shown = run([*gpuwait_cmd, "history"])
    assert shown.returncode == 0 and shown.stdout.count("true") == 5
    assert shown.stderr.count("damaged line") == 1


def history_records_ok(path: Path) -> int:
    count = 0
    for line in path.read_text().splitlines():
        try:
            json.loads(line)
            count += 1
        except ValueError:
            pass
    return count


def test_history_shows_and_exports_runs(sim_file: SimFileFactory, gpuwait_cmd: list[str]) -> None:
    sim_file(gpus=2, memory="24GiB")
    job = sim_job(gpuwait_cmd, "1G", "--hold", "0.3s")
    assert run([*gpuwait_cmd, "--vram", "2G", "--", *job]).returncode == 0
    assert run([*gpuwait_cmd, "--vram", "2G", "--", "sh", "-c", "exit 4"]).returncode == 4
    text = run([*gpuwait_cmd, "history"]).stdout
    header, first, second = text.splitlines()[:3]
    assert header.split() == ["ended", "GPU", "peak", "load", "wait", "run", "exit", "command"]
    assert "1.0 GiB" in first and "sim job --vram 1G" in first
    assert " 4 " in second and "sh -c 'exit 4'" in second
    records = json.loads(run([*gpuwait_cmd, "history", "--json", "-n", "1"]).stdout)
    assert len(records) == 1 and records[0]["exit_status"] == 4
    only = json.loads(run([*gpuwait_cmd, "history", "--json", "--", *job]).stdout)
    assert len(only) == 1 and only[0]["peak_bytes"] == GiB
    assert only[0]["time_to_peak_seconds"] is not None
    assert {"cwd", "keys", "gpus", "wait_seconds", "run_seconds", "request_source"} <= set(only[0])


def test_history_cuts_long_commands_only_at_a_terminal(
    sim_file: SimFileFactory, gpuwait_cmd: list[str]
) -> None:
    pexpect = pytest.importorskip("pexpect")
    sim_file(gpus=1, memory="24GiB")
    long_arg = "x" * 150
    assert run([*gpuwait_cmd, "--vram", "1G", "--", "echo", long_arg]).returncode == 0
    piped = run([*gpuwait_cmd, "history"]).stdout.splitlines()[1]
    assert piped.endswith(f"echo {long_arg}")
    child = pexpect.spawn(
        gpuwait_cmd[0],
        [*gpuwait_cmd[1:], "history"],
        env=dict(os.environ),
        dimensions=(24, 120),
        timeout=30,
        encoding="utf-8",
    )
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    row = str(child.before).splitlines()[1]
    assert len(row) == 120 and row.endswith("…") and "echo xxx" in row


def test_estimate_explains_itself(sim_file: SimFileFactory, gpuwait_cmd: list[str]) -> None:
    sim_file(gpus=1, memory="24GiB")
    # Long enough to be sampled: a run that ends before its first sample has no known peak.
    script = [sys.executable, "-c", "import time; time.sleep(0.5)"]
    none = run([*gpuwait_cmd, "estimate", "--", *script])
    assert none.returncode == 0 and "a whole GPU (default_vram)" in none.stdout
    for _ in range(2):
        assert run([*gpuwait_cmd, "--vram", "1G", "--key", "tiny", "--", *script]).returncode == 0
    shown = run([*gpuwait_cmd, "estimate", "--key", "tiny"])
    assert "estimate: 256 MiB per GPU, estimated from 2 runs with this --key" in shown.stdout
    assert "run time:" in shown.stdout and "load:" in shown.stdout
    assert run([*gpuwait_cmd, "estimate"]).returncode == 2


def test_estimate_says_what_a_launch_asks_for_where_the_learned_size_passes_every_card(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # Runs on a 48 GiB card taught 34 GiB; here the cards hold 24 GiB, of which a launch asks
    # for the usable 21.6 GiB: `estimate` must say that, not a size no launch asks for.
    sim_file(gpus=1, memory="24GiB")
    command = ["true", "big-model"]
    three_runs(command, str(tmp_path), 30 * GiB)
    shown = json.loads(run([*gpuwait_cmd, "estimate", "--json", *command], cwd=tmp_path).stdout)
    assert run([*gpuwait_cmd, "--", *command], cwd=tmp_path).returncode == 0
    (launched,) = [r for r in history() if r["job_id"] != "j"]
    assert shown["estimate_bytes"] == launched["reserved_bytes"] == int(24 * GiB * 0.9)
    assert (shown["learned_bytes"], shown["capped"]) == (34 * GiB, True)
    said = run([*gpuwait_cmd, "estimate", "--", *command], cwd=tmp_path).stdout
    assert "estimate: 21.6 GiB per GPU" in said and "capped at the largest card" in said


def test_a_learned_size_past_every_card_asks_for_the_room_the_driver_leaves(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # 500 MiB the driver keeps for itself is never free: capped at 21.6 GiB, the launch waited
    # for ever for room the card never has, where it asks for the 21.1 GiB it does.
    sim_file(gpus=1, memory="24GiB", driver_reserved="500MiB")
    command = ["true", "big-model"]
    three_runs(command, str(tmp_path), 30 * GiB)
    done = run([*gpuwait_cmd, "--timeout", "10s", "--", *command], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (launched,) = [r for r in history() if r["job_id"] != "j"]
    assert launched["reserved_bytes"] == int(24 * GiB * 0.9) - 500 * 2**20


def test_a_learned_size_past_the_per_user_limit_asks_for_the_limit(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], tmp_path: Path, isolated_dirs: Path
) -> None:
    # Runs taught 6 GiB; the site allows each user 4 GiB. `--vram 4G` would run, so the learned
    # size must not refuse the command (it was exit 3, "the request exceeds per-user limit").
    site = isolated_dirs / "site-config" / "gpuwait" / "config.toml"
    site.parent.mkdir(parents=True)
    site.write_text('user_max_vram = "4GiB"\n')
    sim_file(gpus=1, memory="24GiB")
    command = ["true", "mid-model"]
    three_runs(command, str(tmp_path), 6 * GiB)
    launched = run([*gpuwait_cmd, "--", *command], cwd=tmp_path)
    assert launched.returncode == 0, launched.stderr
    assert history()[-1]["reserved_bytes"] == 4 * GiB
    said = run([*gpuwait_cmd, "estimate", "--", *command], cwd=tmp_path).stdout
    assert "estimate: 4.0 GiB per GPU" in said and "capped at your per-user limit" in said


def test_an_estimate_capped_at_the_per_user_limit_says_what_the_users_jobs_hold_of_it(
    sim_file: SimFileFactory,
    gpuwait_cmd: list[str],
    tmp_path: Path,
    isolated_dirs: Path,
    procs: Callable[..., subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The limit counts a running job at what it holds: a --vram 1G job using 3 GiB holds 3 of
    # the 4 GiB, which the estimate capped at the limit said nothing of.
    site = isolated_dirs / "site-config" / "gpuwait" / "config.toml"
    site.parent.mkdir(parents=True)
    site.write_text('user_max_vram = "4GiB"\n')
    sim_file(gpus=1, memory="24GiB")
    monkeypatch.setenv("GPUWAIT_SAMPLE_INTERVAL", "0.1s")
    command = ["true", "mid-model"]
    three_runs(command, str(tmp_path), 6 * GiB)
    procs([*gpuwait_cmd, "--vram", "1G", "--", *sim_job(gpuwait_cmd, "3G", "--hold", "60s")])
    wait_for(lambda: any(e.get("grown") for e in ledger_entries()), timeout=30)
    said = run([*gpuwait_cmd, "estimate", "--", *command], cwd=tmp_path).stdout
    assert "capped at your per-user limit" in said
    assert "your running jobs hold 3.0 GiB of it now (1.0 GiB reserved)" in said


def test_approximate_peak_where_nvml_has_no_per_process_figures(
    sim_file: SimFileFactory, gpuwait_cmd: list[str]
) -> None:
    sim_file(gpus=1, memory="24GiB", base_used="1GiB", per_process=False)
    job = sim_job(gpuwait_cmd, "3G", "--ramp", "0.2s", "--hold", "0.4s")
    # Sampled every 0.1 s, the peak is read a few times over in the 0.4 s it is held.
    env = {**os.environ, "GPUWAIT_SAMPLE_INTERVAL": "0.1s"}
    done = run([*gpuwait_cmd, "--vram", "4G", "--", *job], env=env)
    assert done.returncode == 0, done.stderr
    record = history()[-1]
    assert record["peak_approximate"] is True and record["peak_bytes"] == 3 * GiB


def test_hash_mode_keeps_no_command_line(sim_file: SimFileFactory, gpuwait_cmd: list[str]) -> None:
    sim_file(gpus=1, memory="24GiB")
    env = {**os.environ, "GPUWAIT_HISTORY_COMMANDS": "hash"}
    done = run(
        [*gpuwait_cmd, "--vram", "1G", "--", "sh", "-c", "echo token=s3cr3t >/dev/null"], env=env
    )
    assert done.returncode == 0
    path = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "history.jsonl"
    assert "s3cr3t" not in path.read_text()
    shown = run([*gpuwait_cmd, "history"], env=env).stdout
    assert "sh [" in shown and "s3cr3t" not in shown
    # Nor does the event log, which lasts as long.
    events = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "events.jsonl"
    assert "s3cr3t" not in events.read_text()
    logged = run([*gpuwait_cmd, "log"], env=env).stdout
    assert "sh [" in logged and "s3cr3t" not in logged


def test_bad_options_are_one_line(sim_file: SimFileFactory, gpuwait_cmd: list[str]) -> None:
    sim_file(gpus=1, memory="24GiB")
    for argv, message in (
        (["--retry-oom", "-1", "true"], "--retry-oom"),
        (["--key", "", "true"], "--key"),
        (["history", "-n", "-2"], "-n"),
    ):
        started = time.monotonic()
        done = run([*gpuwait_cmd, *argv])
        assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr
        assert time.monotonic() - started < 10


def test_retry_oom_stops_when_the_largest_card_was_already_given(
    sim_file: SimFileFactory, gpuwait_cmd: list[str]
) -> None:
    # Too big for the only card: the first run already had all of it (default_vram exclusive),
    # so a raised estimate, capped at that card, cannot help and no retry is made.
    sim_file(gpus=1, memory="8GiB")
    done = run([*gpuwait_cmd, "--retry-oom", "3", "--", *sim_job(gpuwait_cmd, "9G", "--hold", "0")])
    assert done.returncode == 1
    assert "no larger size to retry with" in done.stderr and "retrying" not in done.stderr
    assert len(history()) == 1 and history()[0]["oom"] is True


def test_a_retry_asks_for_what_the_out_of_memory_message_said_it_needed(
    sim_file: SimFileFactory, gpuwait_cmd: list[str]
) -> None:
    # Held to its 8 GiB, the job failed at once asking for 30 GiB: 1.5 times what it had,
    # 12 GiB, was retried and failed the same way. The retry asks for what the message said.
    sim_file(gpus=1, memory="48GiB")
    job = sim_job(gpuwait_cmd, "30G", "--hold", "0")
    done = run([*gpuwait_cmd, "--enforce", "limit", "--vram", "8G", "--retry-oom", "1", "--", *job])
    assert done.returncode == 0, done.stderr
    first, retry = history()
    assert first["oom"] is True and first["oom_wanted_bytes"] == 30 * GiB
    assert retry["exit_status"] == 0 and 30 * GiB < retry["reserved_bytes"] <= 34 * GiB
    assert "retrying with 34.0 GiB" in done.stderr


@pytest.mark.parametrize(
    ("vram", "said"),
    [("3G", "retrying with 4.0 GiB"), ("4G", "no larger size to retry with")],
)
def test_retry_oom_asks_for_no_more_than_the_per_user_limit(
    sim_file: SimFileFactory,
    gpuwait_cmd: list[str],
    isolated_dirs: Path,
    vram: str,
    said: str,
) -> None:
    # The site allows each user 4 GiB. A retry raised past it could never be admitted: it
    # waited for ever ("your per-user limit of 4.0 GiB (0 B held)"). It asks for the limit
    # instead, and where the run already had that, no retry is made.
    site = isolated_dirs / "site-config" / "gpuwait" / "config.toml"
    site.parent.mkdir(parents=True)
    site.write_text('user_max_vram = "4GiB"\n')
    sim_file(gpus=1, memory="24GiB")
    job = sim_job(gpuwait_cmd, "30G", "--ramp", "0.2s")
    done = run([*gpuwait_cmd, "--vram", vram, "--retry-oom", "1", "--", *job], timeout=20)
    assert done.returncode == 1, done.stderr
    assert said in done.stderr and "per-user limit of" not in done.stderr
    assert [r["oom"] for r in history()] == [True] * (2 if vram == "3G" else 1)


def test_a_job_stopped_on_a_full_card_is_not_run_again(
    sim_file: SimFileFactory, gpuwait_cmd: list[str]
) -> None:
    # A --retry-oom job that filled its card was stopped (gpuwait cancel, a service stopped:
    # TERM to gpuwait). Its run ended by the signal on a full card, which was taken for running
    # out of memory: gpuwait queued the command again and started it anew, as though nobody
    # had stopped it, and taught its next runs to ask for more.
    sim_file(gpus=1, memory="24GiB")
    job = sim_job(gpuwait_cmd, "23.7G", "--hold", "30s")
    launch = subprocess.Popen(
        [*gpuwait_cmd, "--vram", "21G", "--retry-oom", "1", "--", *job],
        env={**os.environ, "GPUWAIT_SAMPLE_INTERVAL": "0.1s"},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Filled as gpuwait sees it: what it has published of the job's use.
        wait_for(
            lambda: any(sum(e["observed"].values()) >= 23 * GiB for e in ledger_entries()),
            interval=0.05,
            message=lambda: f"the job never filled its card: {ledger_entries()}",
        )
        launch.terminate()
        _, err = launch.communicate(timeout=30)
    finally:
        if launch.poll() is None:
            launch.kill()
            launch.communicate()
    assert launch.returncode == -15, err
    assert "retrying" not in err and "ran out" not in err, err
    (record,) = history()
    assert record["signal"] == 15 and record["oom"] is False, record


def test_other_scripts_runs_never_size_a_new_script(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # Three tiny scripts of one interpreter, then a new script that allocates 8 GiB: it must not
    # be sized by the tiny ones (that got 256 MiB and died of out-of-memory beside a big job).
    sim_file(gpus=2, memory="24GiB")
    for name in ("prep.py", "plot.py", "check.py"):
        (tmp_path / name).write_text("print('done')\n")
        done = run([*gpuwait_cmd, "--", sys.executable, name], cwd=tmp_path)
        assert done.returncode == 0, done.stderr
    big = tmp_path / "train_big.py"
    big.write_text(
        "import sys\nfrom gpuwait.gpu.simjob import main\n"
        "sys.exit(main(['--vram', '8G', '--hold', '0.5']))\n"
    )
    learned = estimate_of(gpuwait_cmd, [sys.executable, str(big)])
    assert learned["estimate_bytes"] is None, learned["based_on"]
    # It gets default_vram, which the environment sets here.
    done = run(
        [*gpuwait_cmd, "--", sys.executable, "train_big.py"],
        cwd=tmp_path,
        env={**os.environ, "GPUWAIT_DEFAULT_VRAM": "8G"},
    )
    assert done.returncode == 0, done.stderr
    record = history()[-1]
    assert record["request_source"] == "default" and record["reserved_bytes"] == 8 * GiB
    assert record["oom"] is False


@pytest.mark.parametrize(
    "switch",
    [
        lambda command: ["runuser", "-u", "svc", "--", *command],
        lambda command: ["su", "svc", "-c", shlex.join(command)],
        lambda command: ["setpriv", "--reuid=svc", "--", *command],
    ],
    ids=["runuser", "su", "setpriv"],
)
def test_runs_under_another_user_never_size_a_new_command_under_it(
    sim_file: SimFileFactory,
    gpuwait_cmd: list[str],
    tmp_path: Path,
    switch: Callable[[list[str]], list[str]],
) -> None:
    # A system unit (or a cron job of root's) that runs each job as its user: `gpuwait --
    # runuser -u svc -- python eval.py`. Three runs of a small evaluation must not size a new
    # training script run the same way (it got their 2 GiB and ran out of memory beside others),
    # no more than runs under `sudo` do.
    sim_file(gpus=1, memory="24GiB")
    three_runs(switch(["python3", "eval.py"]), str(tmp_path), 2 * GiB)
    learned = estimate_of(gpuwait_cmd, switch(["python3", "train_big.py"]))
    assert learned["estimate_bytes"] is None, learned["based_on"]


def test_a_simulated_jobs_size_is_not_pooled_with_other_sizes(
    sim_file: SimFileFactory, gpuwait_cmd: list[str]
) -> None:
    sim_file(gpus=1, memory="24GiB")
    for vram in ("1G", "20G", "6G"):
        done = run([*gpuwait_cmd, "--vram", vram, "--", *sim_job(gpuwait_cmd, vram, "--hold", "0")])
        assert done.returncode == 0, done.stderr
    # `gpuwait sim job --vram 4G` never ran: no estimate (it got 22 GiB from the others).
    learned = estimate_of(gpuwait_cmd, sim_job(gpuwait_cmd, "4G", "--hold", "0"))
    assert learned["estimate_bytes"] is None, learned["based_on"]


def test_a_job_past_its_expected_run_time_is_shown_overdue(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    sim_file(gpus=1, memory="24GiB")
    nap = tmp_path / "nap.py"
    nap.write_text("import os, time\ntime.sleep(float(os.environ['NAP']))\n")
    command = [*gpuwait_cmd, "--vram", "1G", "--name", "nap", "--", sys.executable, str(nap)]
    done = run(command, env={**os.environ, "NAP": "0.1"})
    assert done.returncode == 0, done.stderr
    long = subprocess.Popen(
        command,
        env={**os.environ, "NAP": "30"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: running_jobs() == 1, timeout=30)
        time.sleep(1.0)  # past the 0.1 s its one earlier run took
        status = run([*gpuwait_cmd, "status"])
        row = next(line for line in status.stdout.splitlines() if " nap " in line)
        assert "overdue" in row and "0ms" not in row, status.stdout
    finally:
        long.terminate()
        long.wait(timeout=30)


def test_a_file_written_over_the_index_is_kept_aside_and_the_index_made_anew(
    sim_file: SimFileFactory, gpuwait_cmd: list[str]
) -> None:
    sim_file(gpus=1)
    job = sim_job(gpuwait_cmd, "2G")
    assert run([*gpuwait_cmd, "--", *job]).returncode == 0
    state = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait"
    index = state / "history.index"
    for part in index.iterdir():
        part.unlink()
    index.rmdir()
    index.write_text("not an index\n")
    done = run([*gpuwait_cmd, "--", *job])
    assert done.returncode == 0, done.stderr
    # One warning, naming where the file went; the run recorded, and learning back.
    warnings = [line for line in done.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "was not a directory; kept it as" in warnings[0], done.stderr
    assert index.is_dir()
    (kept,) = state.glob("history.index.damaged-*")
    assert kept.read_text() == "not an index\n"
    assert len(history()) == 2
    levels = estimate_of(gpuwait_cmd, job)["levels"]
    assert next(level["runs"] for level in levels if level["level"] == "command") == 2
    again = run([*gpuwait_cmd, "--", *job])
    assert "warning" not in again.stderr, again.stderr


def _card_used(sim: Path) -> int:
    from gpuwait.gpu import open_backend

    backend = open_backend(sim, 5.0)
    try:
        return backend.snapshot().gpus[0].used_bytes
    finally:
        backend.close()


def test_an_approximate_peak_hidden_by_memory_others_freed_is_not_learned(
    sim_file: SimFileFactory, gpuwait_cmd: list[str]
) -> None:
    # Without per-process figures the peak is the card's growth since admission. A colleague's
    # 10 GiB, there at admission, is freed while the job loads its 8 GiB: the card grew by
    # 3 GiB or so, and learning that would size the next run at a third of what it needs.
    sim = sim_file(gpus=1, memory="24GiB", per_process=False)
    colleague = subprocess.Popen(
        [*gpuwait_cmd, "sim", "job", "--vram", "10G", "--hold", "0.6s"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: _card_used(sim) >= 10 * GiB, timeout=30, interval=0.05)
        job = sim_job(gpuwait_cmd, "8G", "--ramp", "1.2s", "--hold", "0.1s")
        done = run([*gpuwait_cmd, "--vram", "8G", "--", *job])
        assert done.returncode == 0, done.stderr
    finally:
        colleague.wait(timeout=30)
    record = history()[-1]
    assert record["peak_bytes"] is None or record["peak_bytes"] >= 8 * GiB, record
    assert estimate_of(gpuwait_cmd, job)["estimate_bytes"] is None


def test_an_approximate_peak_while_another_job_shares_the_card_is_not_learned(
    sim_file: SimFileFactory, gpuwait_cmd: list[str]
) -> None:
    # Without per-process figures, a job's peak cannot be told from another's growth on the
    # same card: neither run, 6 GiB and 2 GiB, may be learned from the samples taken alone.
    sim_file(gpus=1, memory="24GiB", per_process=False)
    big = sim_job(gpuwait_cmd, "6G", "--ramp", "1s", "--hold", "0.1s")
    first = subprocess.Popen(
        [*gpuwait_cmd, "--vram", "6G", "--", *big],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: running_jobs() == 1, timeout=30, interval=0.02)
        small = sim_job(gpuwait_cmd, "2G", "--hold", "1.5s")
        done = run([*gpuwait_cmd, "--vram", "2G", "--", *small])
        assert done.returncode == 0, done.stderr
    finally:
        assert first.wait(timeout=30) == 0
    peaks = {r["command"][r["command"].index("--vram") + 1]: r["peak_bytes"] for r in history()}
    assert peaks == {"6G": None, "2G": None}, peaks


def test_a_run_told_to_stop_that_exits_0_teaches_no_size(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # A script that shuts down cleanly on TERM (or Ctrl-C) exits 0 while loading: its peak,
    # 1 GiB or so of the 8 GiB it loads to, must not size its next run.
    sim_file(gpus=1, memory="24GiB")
    script = tmp_path / "train.py"
    script.write_text(
        "import signal, subprocess, sys\n"
        f"job = subprocess.Popen({sim_job(gpuwait_cmd, '8G', '--ramp', '3s', '--hold', '0')!r})\n"
        "signal.signal(signal.SIGTERM, lambda s, f: job.send_signal(signal.SIGTERM))\n"
        "job.wait()\n"
        "sys.exit(0)\n"
    )
    command = [sys.executable, str(script)]
    wrapped = subprocess.Popen(
        [*gpuwait_cmd, "--vram", "8G", "--", *command],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: running_jobs() == 1, timeout=30, interval=0.02)
    time.sleep(0.5)
    wrapped.send_signal(15)
    _, err = wrapped.communicate(timeout=30)
    assert wrapped.returncode == 0, err
    record = history()[-1]
    assert record["exit_status"] == 0 and record["stopped_by"] == 15, record
    assert record["peak_bytes"] < 8 * GiB
    assert estimate_of(gpuwait_cmd, command)["estimate_bytes"] is None
    shown = run([*gpuwait_cmd, "history", "-n", "1"])
    assert "0 (SIGTERM)" in shown.stdout, shown.stdout


def test_a_job_waiting_after_ok_on_a_retried_job_waits_for_the_retry(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # The first run of `first` runs out of memory, --retry-oom queues it again and the retry
    # succeeds: the job that needs its success runs after it, rather than giving up (exit 6)
    # on the attempt that ran out.
    sim_file(gpus=1, memory="24GiB")
    marker = tmp_path / "ran-once"
    sim = " ".join([*gpuwait_cmd, "sim", "job"])
    script = (
        f"if [ -e {marker} ]; then exec {sim} --vram 1G --hold 0.3s; fi; "
        f"touch {marker}; exec {sim} --vram 30G --ramp 0.3s"
    )
    first = subprocess.Popen(
        [
            *gpuwait_cmd,
            "--name",
            "first",
            "--retry-oom",
            "1",
            "--vram",
            "2G",
            "--",
            "sh",
            "-c",
            script,
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: running_jobs() == 1)
        then = run([*gpuwait_cmd, "--after-ok", "first", "--vram", "1G", "--", "true"])
    finally:
        _, stderr = first.communicate(timeout=30)
    assert first.returncode == 0, stderr
    assert "retrying with" in stderr and marker.exists()
    assert then.returncode == 0, then.stderr
    log = run([*gpuwait_cmd, "log", "--job", "first"]).stdout
    assert "queued again (--retry-oom)" in log and log.count("finish") == 2


UNEVEN = (
    "import os, subprocess, sys\n"
    "job = [sys.executable, '-m', 'gpuwait', 'sim', 'job', '--hold', '0.6s', '--vram']\n"
    "cards = os.environ['CUDA_VISIBLE_DEVICES'].split(',')\n"
    "both = [\n"
    "    subprocess.Popen([*job, size], env={**os.environ, 'CUDA_VISIBLE_DEVICES': card})\n"
    "    for card, size in zip(cards, ['6G', '1G'])\n"
    "]\n"
    "sys.exit(max(p.wait() for p in both))"
)


def test_a_run_on_two_cards_sizes_a_run_on_one_by_what_it_held_on_both(
    sim_file: SimFileFactory, gpuwait_cmd: list[str]
) -> None:
    # 6 GiB on one card and 1 GiB on the other: on one card the job needs 7 GiB, not twice the
    # larger of the two (12 GiB); on two it still needs 6 GiB on each.
    sim_file(gpus=2, memory="24GiB")
    command = [sys.executable, "-c", UNEVEN]
    done = run([*gpuwait_cmd, "--gpus", "2", "--vram", "8G", "--", *command])
    assert done.returncode == 0, done.stderr
    for gpus, held in (("1", 7 * GiB), ("2", 6 * GiB)):
        shown = run([*gpuwait_cmd, "estimate", "--json", "--gpus", gpus, "--", *command])
        assert json.loads(shown.stdout)["learned_bytes"] == tidy_size(held * 1.1), gpus


def test_a_learned_size_no_two_cards_hold_asks_a_job_on_two_for_what_two_hold(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # Runs taught 28 GiB per GPU; here a 24 GiB and an 80 GiB card. A job on both asks for what
    # the smaller gives (21.6 GiB), as `--vram 21G --gpus 2` would run, rather than exit 3.
    sim_file(gpus=2, memory=["24GiB", "80GiB"])
    command = ["true", "split-model"]
    three_runs(command, str(tmp_path), 28 * GiB)
    shown = run([*gpuwait_cmd, "estimate", "--json", "--gpus", "2", *command], cwd=tmp_path)
    launched = run([*gpuwait_cmd, "--gpus", "2", "--", *command], cwd=tmp_path)
    assert launched.returncode == 0, launched.stderr
    (record,) = [r for r in history() if r["job_id"] != "j"]
    assert json.loads(shown.stdout)["estimate_bytes"] == record["reserved_bytes"]
    assert record["reserved_bytes"] == int(24 * GiB * 0.9)


def test_a_command_that_takes_its_reservation_is_not_learned_ever_larger(
    sim_file: SimFileFactory, gpuwait_cmd: list[str]
) -> None:
    # A server that sizes itself from what gpuwait gives it (vLLM told
    # --gpu-memory-utilization "$GPUWAIT_VRAM_FRACTION"): it takes all of its reservation,
    # whatever it is. Learned at that plus the margin, each run would take more than the last.
    sim_file(gpus=1, memory="24GiB")
    server = [
        "sh",
        "-c",
        f'exec {" ".join(gpuwait_cmd)} sim job --vram "${{GPUWAIT_VRAM_BYTES}}B" --hold 0.3s',
    ]
    done = run([*gpuwait_cmd, "--vram", "4G", "--", *server])
    assert done.returncode == 0, done.stderr
    done = run([*gpuwait_cmd, "--", *server])
    assert done.returncode == 0, done.stderr
    assert [(r["reserved_bytes"], r["peak_bytes"]) for r in history()] == [(4 * GiB, 4 * GiB)] * 2
    assert estimate_of(gpuwait_cmd, server)["estimate_bytes"] == 4 * GiB
    said = run([*gpuwait_cmd, "estimate", "--", *server]).stdout
    assert "no margin: the command sizes itself from its reservation" in said


def test_a_caught_out_of_memory_message_does_not_size_the_next_run(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # A server that refused one huge request (its message printed, the server went on) and
    # later ran out of memory for good needed what its last message said: 8 GiB, not 302.
    sim_file(gpus=1, memory="48GiB")
    server = tmp_path / "serve.py"
    server.write_text(
        "import sys\n"
        "w = sys.stderr.write\n"
        "w('refused: CUDA out of memory. Tried to allocate 300.00 GiB. Including non-PyTorch "
        "memory, this process has 2.00 GiB memory in use.\\n')\n"
        "w('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB. Including "
        "non-PyTorch memory, this process has 7.00 GiB memory in use.\\n')\n"
        "sys.exit(1)\n"
    )
    command = [sys.executable, str(server)]
    done = run([*gpuwait_cmd, "--vram", "4G", "--", *command])
    assert done.returncode == 1
    assert history()[0]["oom"] is True and history()[0]["oom_wanted_bytes"] == 8 * GiB
    learned = estimate_of(gpuwait_cmd, command)
    assert 8 * GiB < learned["oom_floor_bytes"] <= 9 * GiB


@pytest.mark.parametrize(
    ("options", "sim"),
    [
        # Runs on the H100 taught 55 GiB; the job may only have the A100.
        (["--gpu-name", "A100"], {}),
        # The large card takes no CUDA work now (compute mode prohibited).
        ([], {"compute_mode": ["prohibited", "default"]}),
    ],
)
def test_a_learned_size_past_every_card_the_job_may_use_asks_for_the_largest_of_those(
    sim_file: SimFileFactory,
    gpuwait_cmd: list[str],
    tmp_path: Path,
    options: list[str],
    sim: dict[str, Any],
) -> None:
    # Capped at the largest card of the machine (72 GiB usable), the size was refused as one
    # that can never fit (exit 3, "ask for less"), where `--vram 36G` runs.
    names = ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB"]
    sim_file(gpus=2, memory=["80GiB", "40GiB"], name=names, **sim)
    command = ["true", "h100-model"]
    three_runs(command, str(tmp_path), 50 * GiB)
    launched = run([*gpuwait_cmd, *options, "--", *command], cwd=tmp_path)
    assert launched.returncode == 0, launched.stderr
    assert history()[-1]["reserved_bytes"] == int(40 * GiB * 0.9)
    if not options:
        # `estimate` says what that launch asked for.
        assert estimate_of(gpuwait_cmd, command)["estimate_bytes"] == int(40 * GiB * 0.9)


def test_a_command_with_an_argument_longer_than_the_ledger_keeps_learns_from_its_runs(
    sim_file: SimFileFactory, gpuwait_cmd: list[str]
) -> None:
    # A long inline script (`bash -c` with some 5,000 characters): the ledger keeps it cut
    # short, and the run was recorded under the cut line's keys, which no launch of the whole
    # line looks up. Its runs never sized it ("no earlier runs"), however often it ran.
    sim_file(gpus=1, memory="24GiB")
    job = shlex.join(sim_job(gpuwait_cmd, "3G", "--hold", "0.3s"))
    command = ["bash", "-c", f"{job} # {'x' * 5000}"]
    done = run([*gpuwait_cmd, "--vram", "8G", "--", *command])
    assert done.returncode == 0, done.stderr
    assert history()[-1]["peak_bytes"] == 3 * GiB
    learned = estimate_of(gpuwait_cmd, command)
    assert (learned["level"], learned["runs"]) == ("command", 1)
    assert learned["estimate_bytes"] == tidy_size(3 * GiB * 1.1)


def test_a_launch_with_a_key_expects_the_run_time_estimate_shows_for_the_key(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], procs: Any
) -> None:
    # Short runs of the command, long ones of it under --key long: `estimate --key long`
    # showed the key's run time, and a launch with --key long expected the command's (its
    # ETA, backfill and the cost of pausing it reckoned from runs the key set apart).
    sim_file(gpus=1, memory="24GiB")
    command, cwd = ["sleep", "30"], os.getcwd()
    state = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait"
    state.mkdir(mode=0o700, parents=True, exist_ok=True)
    for i, (key, seconds) in enumerate([(None, 10.0)] * 5 + [("long", 600.0)] * 3):
        peaks = {"GPU-x": GiB}
        run_record = a_run(
            command, cwd, time.time() - 60 + i, key=key, peak_by_gpu=peaks, run_seconds=seconds
        )
        append_record(state, run_record)
    shown = run([*gpuwait_cmd, "estimate", "--json", "--key", "long", "--", *command])
    assert shown.returncode == 0, shown.stderr
    expected = json.loads(shown.stdout)["run_seconds"]["median"]
    assert expected == 600.0, shown.stdout
    # Learned, and with --vram: each expects what estimate showed.
    for extra in ([], ["--vram", "1G"]):
        procs([*gpuwait_cmd, "--key", "long", *extra, "--", *command])
    wait_for(lambda: running_jobs() == 2, timeout=30)
    assert [j["expected_seconds"] for j in ledger_entries()] == [expected, expected]


def test_a_retry_waiting_for_room_says_in_status_where_its_raised_size_came_from(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # Run out at its --vram 8G, the command is retried with 34 GiB, which waits behind a 12 GiB
    # job: its wait line says the size was raised after the failure, and so does status.
    sim_file(gpus=1, memory="48GiB")
    holder = subprocess.Popen(
        [*gpuwait_cmd, "--vram", "12G", "--", "sleep", "60"], stderr=subprocess.DEVNULL
    )
    launch = None
    err = tmp_path / "stderr"
    try:
        wait_for(lambda: running_jobs() == 1)
        job = sim_job(gpuwait_cmd, "30G", "--hold", "0")
        argv = [*gpuwait_cmd, "--enforce", "limit", "--vram", "8G", "--retry-oom", "1", "--"]
        with err.open("w") as out:
            launch = subprocess.Popen([*argv, *job], stderr=out)
        said = "waiting for 34.0 GiB (raised after an out-of-memory failure): best GPU0 has"
        wait_for(lambda: said in err.read_text(), message=lambda: err.read_text())
        status = run([*gpuwait_cmd, "status", "--json"])
        reasons = [j["waiting_reason"] for j in json.loads(status.stdout)["jobs"]]
    finally:
        for proc in (launch, holder):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)
    assert [r for r in reasons if r is not None and r.startswith(said)], reasons
