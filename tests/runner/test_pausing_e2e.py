"""Cooperative pausing end to end, on a simulated card: real gpuwait processes and jobs."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO
from helpers.fixtures_sim import hold_card
from helpers.pausing import start_pausable
from helpers.processes import children
from helpers.shellbin import with_program
from helpers.waiting import catches_signal, ledger_entries, process_state, wait_for

from gpuwait.gpu.sim import SimBackend
from gpuwait.history.record import run_stat
from gpuwait.queue import lifecycle
from gpuwait.queue.entries import Job
from gpuwait.queue.ledger import Ledger
from gpuwait.runner.paused import PauseResponder

#: A command that catches the checkpoint signal and lets it change nothing.
CATCHER = "import signal, time; signal.signal(signal.SIGUSR1, lambda s, f: None); time.sleep(30)"
IGNORER = textwrap.dedent(
    """
    import signal, sys, time
    signal.signal(signal.SIGUSR1, lambda s, f: None)  # listens, but never steps aside
    time.sleep(float(sys.argv[1]))
    """
)


#: pause_min_runtime under `one_card`: a job younger than this is never asked to step aside.
MIN_RUNTIME = 1.0
#: The checkpoint signal: the default, USR1, throughout.
SIGNAL = signal.SIGUSR1


@pytest.fixture
def one_card(sim_file: object, monkeypatch: pytest.MonkeyPatch) -> None:
    sim_file(gpus=1, memory="24GiB")  # type: ignore[operator]
    monkeypatch.setenv("GPUWAIT_PAUSE_MIN_RUNTIME", f"{MIN_RUNTIME:g}s")


@pytest.fixture
def quick_card(sim_file: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """One card, as `one_card`, where a job may be asked to step aside once it has run 0.3 s."""
    sim_file(gpus=1, memory="24GiB")  # type: ignore[operator]
    monkeypatch.setenv("GPUWAIT_PAUSE_MIN_RUNTIME", "300ms")
    monkeypatch.setattr(sys.modules[__name__], "MIN_RUNTIME", 0.3)


def events() -> list[dict[str, object]]:
    path = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_until_running(count: int, timeout: float = 60) -> None:
    wait_for(
        lambda: sum(e["kind"] == "start" for e in events()) >= count,
        timeout=timeout,
        interval=0.05,
        message=lambda: f"{count} jobs never started: {events()}",
    )


def wait_until_pausable(catching: bool = True) -> None:
    """Wait until the one running job may be asked to step aside: it has run longer than the
    minimum run time, by its `started_at` in the ledger (what waiters judge it by), and (with
    `catching`) its command catches the checkpoint signal, so the request is acted on at once.

    The run time is the duration under test: only this much real time makes the job old enough.
    """

    def pausable() -> bool:
        running = [j for j in ledger_entries() if j["state"] == "running"]
        if len(running) != 1 or running[0].get("started_at") is None:
            return False
        job = running[0]
        if catching and not (job.get("child_pid") and catches_signal(job["child_pid"], SIGNAL)):
            return False
        return time.time() - job["started_at"] > MIN_RUNTIME

    wait_for(
        pausable,
        timeout=60,
        interval=0.05,
        message=lambda: f"the running job never became one to pause: {ledger_entries()}",
    )


def long_job(
    gpuwait_cmd: list[str],
    checkpoint: Path,
    hold: str = "6s",
    exit_status: int = 0,
    env: dict[str, str] | None = None,
    resumed_vram: str = "16G",
) -> subprocess.Popen[str]:
    """A low-priority --pausable simulated job holding 16 GiB (`resumed_vram` once resumed),
    saving its progress to `checkpoint` (`env`: variables set for it alone)."""
    # The VRAM its run takes, by its resume count: 0 is the first run.
    vram = f'$([ "$GPUWAIT_RESUME_COUNT" = 0 ] && echo 16G || echo {resumed_vram})'
    return start_pausable(
        gpuwait_cmd,
        *("sh", "-c", f'exec "$@" --vram "{vram}"', "sh", *gpuwait_cmd, "sim", "job"),
        *("--hold", hold, "--exit", str(exit_status), "--checkpoint", str(checkpoint)),
        env={**os.environ, **(env or {})},
    )


def urgent_job(gpuwait_cmd: list[str], vram: str = "16G") -> subprocess.Popen[str]:
    return hold_card(gpuwait_cmd, vram, "1s", "--priority", "5")


def urgent_runs_and_nobody_steps_aside(gpuwait_cmd: list[str], low: subprocess.Popen[str]) -> None:
    """An urgent job arrives while `low` runs; it waits for `low`, which is never asked to
    step aside and ends well."""
    urgent = urgent_job(gpuwait_cmd)
    assert urgent.wait(timeout=60) == 0
    assert low.wait(timeout=60) == 0
    assert "pause-request" not in [e["kind"] for e in events()]


def test_urgent_job_makes_a_long_one_step_aside_and_it_resumes(
    quick_card: None, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    checkpoint = tmp_path / "progress.json"
    # Resumed, what is left of its work takes less memory than its first run did.
    low = long_job(gpuwait_cmd, checkpoint, hold="4s", exit_status=3, resumed_vram="4G")
    try:
        wait_until_running(1)
        wait_until_pausable()
        arrived = time.monotonic()
        urgent = urgent_job(gpuwait_cmd)
        assert urgent.wait(timeout=60) == 0, urgent.stderr.read() if urgent.stderr else ""
        # It started within the grace period plus a second: it ran 1 s of work.
        assert time.monotonic() - arrived < 1.0 + 1.0 + 3.0
        # The long job resumes, finishes its remaining work, and ends with its own status.
        assert low.wait(timeout=60) == 3
        progress = json.loads(checkpoint.read_text())
        assert progress == {"held_seconds": 4.0, "finished": True, "resumes": 1}
        kinds = [e["kind"] for e in events()]
        assert kinds.count("pause-signal") == 1 and kinds.count("paused") == 1
        history = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "history.jsonl"
        assert not any("out of memory" in line for line in history.read_text().splitlines())
        # The pause and the time lost to it are in the history and the event log.
        records = [json.loads(line) for line in history.read_text().splitlines()]
        paused_run = next(r for r in records if r["exit_status"] == 3)
        assert paused_run["pauses"] == 1 and paused_run["paused_seconds"] > 0.5
        # Its peak is that of all its runs: the next run of the command needs 16 GiB.
        assert paused_run["peak_bytes"] == 16 * 2**30, paused_run
        finish = next(e for e in events() if e["kind"] == "finish" and e.get("exit_status") == 3)
        assert finish["pauses"] == 1 and finish["paused_seconds"] > 0.5
        shown = subprocess.run(
            [*gpuwait_cmd, "history"], capture_output=True, text=True, check=True
        ).stdout
        assert "paused 1×" in shown, shown
        log = subprocess.run([*gpuwait_cmd, "log"], capture_output=True, text=True).stdout
        assert "stepped aside" in log and "paused 1×" in log, log
    finally:
        for p in (low,):
            p.kill()
            p.wait()


def test_a_job_that_grew_past_its_reservation_is_asked_for_the_room_it_keeps(
    quick_card: None, gpuwait_cmd: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A --vram 2G job that took 18 GiB and let it go keeps the 18 GiB while it runs: an
    urgent 12 GiB waiter asks it to step aside for them, not for its 2 GiB alone."""
    monkeypatch.setenv("GPUWAIT_SAMPLE_INTERVAL", "0.1s")
    sim = shlex.join([*gpuwait_cmd, "sim", "job"])
    phases = (
        f'[ "$GPUWAIT_RESUME_COUNT" = 0 ] && {sim} --vram 18G --hold 1s; '
        f"exec {sim} --vram 1G --hold 4s --checkpoint {shlex.quote(str(tmp_path / 'c.json'))}"
    )
    low = start_pausable(gpuwait_cmd, "sh", "-c", phases, vram="2G")
    try:
        wait_for(
            lambda: any(j.get("grown") for j in ledger_entries()),
            timeout=60,
            message=lambda: f"the job never grew: {ledger_entries()}",
        )
        wait_until_pausable()
        urgent = urgent_job(gpuwait_cmd, "12G")
        assert urgent.wait(timeout=60) == 0, urgent.stderr.read() if urgent.stderr else ""
        assert low.wait(timeout=60) == 0
        assert [e["kind"] for e in events()].count("paused") == 1, events()
    finally:
        low.kill()
        low.communicate()


@pytest.mark.parametrize("whole", ["urgent", "long"])
def test_a_whole_gpu_is_no_reason_to_ask_nobody_to_step_aside(
    quick_card: None, gpuwait_cmd: list[str], tmp_path: Path, whole: str
) -> None:
    # No --vram and no earlier runs: a whole GPU. Where the urgent job needed one, or the long
    # job had one, nobody was asked, and the urgent job waited for the long one to end (a
    # training run's hours), pausable as that was.
    sized: dict[str, list[str]] = {"urgent": [], "long": []}
    sized["long" if whole == "urgent" else "urgent"] = ["--vram", "16G"]
    job = [*gpuwait_cmd, "sim", "job", "--vram", "16G"]
    checkpoint = ["--checkpoint", str(tmp_path / "progress.json")]
    options = ["-q", "--priority", "1", "--pausable", *sized["long"]]
    low = subprocess.Popen(
        [*gpuwait_cmd, *options, "--", *job, "--hold", "30s", *checkpoint],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until_running(1)
        wait_until_pausable()
        options = ["-q", "--priority", "5", "--timeout", "10s", *sized["urgent"]]
        urgent = subprocess.Popen(
            [*gpuwait_cmd, *options, "--", *job, "--hold", "0s"],
            stderr=subprocess.PIPE,
            text=True,
        )
        _, err = urgent.communicate(timeout=60)
        assert urgent.returncode == 0, err
        kinds = [e["kind"] for e in events()]
        assert "pause-request" in kinds and "paused" in kinds, kinds
    finally:
        low.kill()
        low.wait()


def test_the_runs_before_stepping_aside_count_in_fair_share_usage(
    quick_card: None, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # Only a job's last run was charged to its user's usage: a long job that stepped aside
    # near its end counted as if it had run for the moments after it resumed, and its user's
    # jobs went ahead of others' that had used less.
    low = long_job(gpuwait_cmd, tmp_path / "progress.json", hold="1s")
    try:
        wait_until_running(1)
        wait_until_pausable()
        urgent = hold_card(gpuwait_cmd, "16G", "0.1s", "--priority", "5")
        assert urgent.wait(timeout=60) == 0
        assert low.wait(timeout=60) == 0
    finally:
        low.kill()
        low.wait()
    ran = [e for e in events() if e["kind"] in ("paused", "finish")]
    assert [e["kind"] for e in ran] == ["paused", "finish", "finish"], ran
    seconds = sum(float(e.get("ran_seconds") or e["run_seconds"]) for e in ran)  # type: ignore[arg-type]
    shown = subprocess.run(
        [*gpuwait_cmd, "status", "--json"], capture_output=True, text=True, check=True
    ).stdout
    (user,) = json.loads(shown)["users"]
    # Each run held 16 GiB; a day's half-life takes nothing noticeable off in seconds.
    assert user["usage_vram_seconds"] >= 0.99 * 16 * 2**30 * seconds, (user, ran)


#: Asked to checkpoint, it says so in a file; stopped (TERM), it saves and exits with the
#: resume status, as a training loop that checkpoints on TERM does. Resumed, it ends at once.
SAVES_ON_TERM = textwrap.dedent(
    """
    import os, pathlib, signal, sys, time
    if os.environ["GPUWAIT_RESUME_COUNT"] != "0":
        sys.exit(0)
    signal.signal(signal.SIGUSR1, lambda s, f: pathlib.Path(sys.argv[1]).touch())
    signal.signal(signal.SIGTERM, lambda s, f: sys.exit(int(os.environ["GPUWAIT_RESUME_EXIT"])))
    time.sleep(30)
    """
)


def test_a_job_cancelled_while_it_steps_aside_is_not_resumed(
    sim_file: object, gpuwait_cmd: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `gpuwait cancel` reached the job while it was saving its checkpoint for an urgent job;
    # it exited with the resume status, and gpuwait queued it again and ran it once more after
    # the urgent job had started, as though nobody had cancelled it.
    sim_file(gpus=1, memory="24GiB")  # type: ignore[operator]
    monkeypatch.setenv("GPUWAIT_PAUSE_MIN_RUNTIME", "100ms")
    asked = tmp_path / "asked"
    low = start_pausable(gpuwait_cmd, sys.executable, "-c", SAVES_ON_TERM, str(asked))
    urgent = None
    try:
        wait_until_running(1)
        (entry,) = ledger_entries()
        wait_for(lambda: catches_signal(entry["child_pid"], signal.SIGTERM), timeout=30)
        urgent = hold_card(gpuwait_cmd, "16G", "0.1s", "--priority", "5")
        wait_for(asked.exists, timeout=30, message="the job was never asked to step aside")
        subprocess.run([*gpuwait_cmd, "cancel", entry["id"]], check=True, timeout=30)
        assert low.wait(timeout=30) == 75, low.stderr.read() if low.stderr else ""
        assert urgent.wait(timeout=30) == 0
    finally:
        for p in (low, urgent):
            if p is not None and p.poll() is None:
                p.kill()
            if p is not None:
                p.communicate(timeout=30)
    assert [e["kind"] for e in events()].count("start") == 2  # its one run, and the urgent job's


def steps_aside_then_runs_out(gpuwait_cmd: list[str], tmp_path: Path, *options: str) -> int:
    """A --pausable job of 8 GiB (`options` added) that an urgent job of 20 GiB asks to step
    aside; resumed, it runs out of memory once (a retry goes on from its checkpoint and holds
    what is left of its 1 s). Its exit status.

    Its first run holds until it is asked: one of 1 s ended, on a loaded machine, before the
    urgent job's gpuwait had started, and nobody was asked to step aside.

    It runs out ramping over 1 s, sampled densely in its first second: its retry asks for
    1.5 times the peak seen, more than the card has. Ramped over 0.1 s in two steps, the
    sampling of a loaded machine missed the first one at times, and the retry asked for
    1.5 times its 8 GiB, which fitted."""
    sim = " ".join([*gpuwait_cmd, "sim", "job"])
    checkpoint, ran_out = tmp_path / "progress.json", tmp_path / "ran-out"
    script = (
        f'if [ "$GPUWAIT_RESUME_COUNT" = 0 ]; then '
        f"exec {sim} --vram 8G --hold 60s --checkpoint {checkpoint}; fi; "
        f"if [ -e {ran_out} ]; then exec {sim} --vram 8G --hold 1s --checkpoint {checkpoint}; fi; "
        f"touch {ran_out}; exec {sim} --vram 30G --ramp 1s"
    )
    low = start_pausable(
        gpuwait_cmd, "sh", "-c", script, vram="8G", options=("--retry-oom", "1", *options)
    )
    try:
        wait_until_running(1)
        wait_until_pausable()
        assert hold_card(gpuwait_cmd, "20G", "0.1s", "--priority", "5").wait(timeout=60) == 0
        low.wait(timeout=30)
    finally:
        low.kill()
        _, stderr = low.communicate(timeout=30)
    assert ran_out.exists(), stderr
    return low.returncode


def test_a_retry_after_running_out_of_memory_counts_the_runs_before_stepping_aside(
    quick_card: None, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # Resumed after stepping aside, the job ran out of memory; its retry went on from the
    # checkpoint (GPUWAIT_RESUME_COUNT stays 1), yet its record, the one that succeeded and
    # that estimates learn from, counted only the retry's run: the work done before stepping
    # aside was lost from the learned run time, and the pause from the record.
    assert steps_aside_then_runs_out(gpuwait_cmd, tmp_path) == 0
    (paused,) = [e for e in events() if e["kind"] == "paused"]
    history = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "history.jsonl"
    last = json.loads(history.read_text().splitlines()[-1])
    assert last["exit_status"] == 0 and last["pauses"] == 1, last
    assert last["paused_runs_seconds"] == pytest.approx(paused["ran_seconds"], abs=0.01), last
    assert last["paused_seconds"] > 0, last


def test_a_retry_of_a_job_that_stepped_aside_waits_at_most_its_timeout(
    quick_card: None, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # Each --retry-oom attempt waits at most --timeout; a job that had stepped aside before
    # it ran out of memory waited for its retry without end. The retry asks for the whole
    # card, which 1 GiB held outside gpuwait keeps from it.
    outside = subprocess.Popen(
        [*gpuwait_cmd, "sim", "job", "--vram", "1G", "--hold", "60s"],
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"},
    )
    try:
        # Held before the job starts: on a loaded machine the holder's own start takes seconds,
        # and a retry planned before it held anything would find the whole card free.
        backend = SimBackend(os.environ["GPUWAIT_SIM"])
        wait_for(lambda: backend.snapshot().gpus[0].used_bytes >= 2**30, timeout=60)
        # 3 s: long enough that a loaded machine never ends its first wait, for a free card.
        assert steps_aside_then_runs_out(gpuwait_cmd, tmp_path, "--timeout", "3s") == 124
    finally:
        outside.kill()
        outside.wait()


def stopped_while_waiting_to_resume(gpuwait_cmd: list[str], tmp_path: Path, how: str) -> str:
    """A --pausable job of 16 GiB that steps aside for an urgent one and, while it waits to
    resume, is stopped: by `gpuwait cancel` ("cancel") or TERM to its gpuwait ("TERM"). Its id."""
    low = long_job(gpuwait_cmd, tmp_path / "progress.json", hold="5s")
    urgent = None
    try:
        wait_until_running(1)
        wait_until_pausable()
        (entry,) = ledger_entries()
        urgent = hold_card(gpuwait_cmd, "16G", "5s", "--priority", "5")
        wait_until_running(2)
        if how == "cancel":
            subprocess.run([*gpuwait_cmd, "cancel", entry["id"]], check=True, timeout=30)
            assert low.wait(timeout=30) != 0
        else:
            low.terminate()
            assert low.wait(timeout=30) == -signal.SIGTERM
    finally:
        for p in (low, urgent):
            if p is not None:
                p.terminate()
                p.communicate(timeout=30)
    return str(entry["id"])


def test_a_job_stopped_while_waiting_to_resume_says_how_often_it_stepped_aside(
    quick_card: None, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # Its `leave` event, the last word on the job, said nothing of its pauses: as far as the
    # log told, a job that never ran had left the queue.
    stopped_while_waiting_to_resume(gpuwait_cmd, tmp_path, "TERM")
    (left,) = [e for e in events() if e["kind"] == "leave"]
    assert left["outcome"] == "interrupted" and left["pauses"] == 1, left
    assert float(left["paused_seconds"]) > 0, left  # type: ignore[arg-type]


@pytest.mark.parametrize("how", ["cancel", "TERM"])
def test_a_job_stopped_while_waiting_to_resume_leaves_its_runs_in_the_history(
    quick_card: None, gpuwait_cmd: list[str], tmp_path: Path, how: str
) -> None:
    # Cancelled (or stopped) while it waited to resume, a job that had run and stepped aside
    # left no record: `gpuwait history` knew nothing of its run, nor of the 16 GiB it took.
    job = stopped_while_waiting_to_resume(gpuwait_cmd, tmp_path, how)
    history = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "history.jsonl"
    records = [json.loads(line) for line in history.read_text().splitlines()]
    (ran,) = [r for r in records if r["job_id"] == job]
    assert ran["pauses"] == 1 and ran["paused_seconds"] > 0, ran
    assert ran["peak_bytes"] == 16 * 2**30 and ran["run_seconds"] >= MIN_RUNTIME, ran
    # What it had reserved for that run, not the nothing it held while waiting to resume.
    assert ran["reserved_bytes"] == 16 * 2**30, ran
    # Cut short, it teaches no run time as a finished run would.
    stat = run_stat(ran)
    assert stat is not None and not stat.ok


def test_young_jobs_are_not_paused(
    sim_file: object, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    sim_file(gpus=1, memory="24GiB")  # type: ignore[operator]
    low = long_job(gpuwait_cmd, tmp_path / "p.json", hold="3s")  # default minimum: 10 minutes
    try:
        wait_until_running(1)
        urgent_runs_and_nobody_steps_aside(gpuwait_cmd, low)
        assert json.loads((tmp_path / "p.json").read_text())["resumes"] == 0
    finally:
        low.kill()
        low.wait()


def _ignoring_job(gpuwait_cmd: list[str], seconds: str, *extra: str) -> subprocess.Popen[str]:
    """A --pausable job that catches the checkpoint signal but never steps aside."""
    return start_pausable(
        gpuwait_cmd, sys.executable, "-c", IGNORER, seconds, options=("--grace", "0.5s", *extra)
    )


@pytest.mark.parametrize(
    ("extra", "seconds", "status"),
    [((), "4", 0), (("--grace-kill",), "30", -15)],
    ids=["not-forced", "grace-kill"],
)
def test_a_job_that_ignores_the_request(
    quick_card: None, gpuwait_cmd: list[str], extra: tuple[str, ...], seconds: str, status: int
) -> None:
    """Nothing is forced on it unless --grace-kill: then TERM once the grace has passed."""
    low = _ignoring_job(gpuwait_cmd, seconds, *extra)
    try:
        wait_until_running(1)
        wait_until_pausable()
        urgent = urgent_job(gpuwait_cmd)
        if not extra:
            # `status` names who asked the running job to step aside.
            wait_for(
                lambda: any(e["kind"] == "pause-signal" for e in events()),
                timeout=30,
                message="the job was never signalled",
            )
            shown = subprocess.run(
                [*gpuwait_cmd, "status"], capture_output=True, text=True, timeout=30
            ).stdout
            waiter = next(j for j in ledger_entries() if j["state"] == "waiting")
            assert f"asked to checkpoint and step aside by job {waiter['id']}" in shown, shown
            assert f"(uid {os.getuid()}), signalled" in shown, shown
        assert low.wait(timeout=60) == status
        assert urgent.wait(timeout=60) == 0
        kinds = [e["kind"] for e in events()]
        assert "pause-signal" in kinds
        assert ("pause-grace-kill" in kinds) == bool(extra)
        if not extra:  # the waiter is told why it still waits once the grace has passed
            said = urgent.stderr.read() if urgent.stderr else ""
            assert "has not stepped aside within its grace" in said, said
            assert "--grace-kill" in said, said
    finally:
        low.kill()
        low.wait()


def test_two_urgent_waiters_pause_one_victim_once(
    one_card: None, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    checkpoint = tmp_path / "progress.json"
    low = long_job(gpuwait_cmd, checkpoint, hold="5s")
    try:
        wait_until_running(1)
        wait_until_pausable()
        urgent = [urgent_job(gpuwait_cmd, "10G") for _ in range(2)]
        assert [u.wait(timeout=60) for u in urgent] == [0, 0]
        assert low.wait(timeout=60) == 0
        kinds = [e["kind"] for e in events()]
        assert kinds.count("pause-signal") == 1
        assert json.loads(checkpoint.read_text())["resumes"] == 1
    finally:
        low.kill()
        low.wait()


def test_a_waiter_past_pause_grace_max_says_it_no_longer_waits_for_a_job_deaf_to_the_signal(
    quick_card: None, gpuwait_cmd: list[str], isolated_dirs: Path
) -> None:
    """An urgent waiter asks a --pausable job whose command never catches the checkpoint
    signal: past the site's pause_grace_max (1 s here) the waiter may ask others, and its wait
    line says so, not that it still waits for the job to catch the signal."""
    site = isolated_dirs / "site-config" / "gpuwait" / "config.toml"
    site.parent.mkdir(parents=True)
    site.write_text('pause_grace_max = "1s"\n')
    low = start_pausable(gpuwait_cmd, "sleep", "60", start_new_session=True)
    try:
        wait_until_running(1)
        wait_until_pausable(catching=False)
        urgent = hold_card(gpuwait_cmd, "16G", "1s", "--priority", "5", "--timeout", "4s")
        _, said = urgent.communicate(timeout=60)
    finally:
        os.killpg(low.pid, signal.SIGKILL)
        low.wait()
    assert urgent.returncode == 124, said
    told = [line for line in said.splitlines() if "step aside" in line or "catch" in line]
    assert told, said
    assert "does not catch USR1" in told[-1] and "past 1.0s (pause_grace_max" in told[-1], said


def test_pause_max_is_honoured(
    quick_card: None, gpuwait_cmd: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUWAIT_PAUSE_MAX", "0")
    low = long_job(gpuwait_cmd, tmp_path / "p.json", hold="3s")
    try:
        wait_until_running(1)
        wait_until_pausable()
        urgent_runs_and_nobody_steps_aside(gpuwait_cmd, low)
    finally:
        low.kill()
        low.wait()


CONTRIB = REPO / "contrib" / "checkpoint"


def _pause_once(
    gpuwait_cmd: list[str], job: list[str], ready: Callable[[], object]
) -> subprocess.Popen[str]:
    low = start_pausable(gpuwait_cmd, *job)
    try:
        wait_for(
            lambda: ready() or low.poll() is not None,
            timeout=120,
            interval=0.05,
            message="the job never got ready",
        )
        assert ready(), "the job ended before it got ready"
        # `ready` says that the command listens for the checkpoint signal (whichever of its
        # processes that is): only its run time is left to wait for.
        wait_until_pausable(catching=False)
        assert urgent_job(gpuwait_cmd).wait(timeout=120) == 0
    except BaseException:
        low.kill()
        low.wait()
        raise
    return low


def test_shell_job_resumes_where_it_stopped(
    quick_card: None, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    work = tmp_path / "work"
    log = work / "log"
    low = _pause_once(gpuwait_cmd, ["bash", str(CONTRIB / "job.sh"), str(work), "30"], log.exists)
    try:
        assert low.wait(timeout=120) == 0
        lines = log.read_text().splitlines()
        assert [int(line.split()[1]) for line in lines] == list(range(30))  # none lost or repeated
        assert "(run 0)" in lines[0] and "(run 1)" in lines[-1]
        # Its run time, as estimates learn it, is that of both runs, not of the last one only:
        # a fresh run of the command does the whole work.
        (ran_first,) = [e["ran_seconds"] for e in events() if e["kind"] == "paused"]
        history = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "history.jsonl"
        records = [json.loads(line) for line in history.read_text().splitlines()]
        (done,) = [r for r in records if r.get("pauses")]
        learned = run_stat(done)
        assert learned is not None and learned.ok
        assert learned.run_seconds == pytest.approx(ran_first + done["run_seconds"], abs=0.01)
    finally:
        low.kill()
        low.wait()


# The PyTorch loop (contrib/checkpoint/train_pytorch.py) paused and resumed at the same step:
# tests/contrib/test_contrib.py runs contrib/checkpoint/README.md's try, which shows exactly that.


def test_lightning_example_resumes(one_card: None, gpuwait_cmd: list[str], tmp_path: Path) -> None:
    probe = subprocess.run([sys.executable, "-c", "import lightning"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(
            "PyTorch Lightning is not installed (pip install lightning to run this example)"
        )
    ckpt_dir = tmp_path / "ckpts"
    log = tmp_path / "train.log"
    job = [
        sys.executable,
        str(CONTRIB / "train_lightning.py"),
        "--ckpt-dir",
        str(ckpt_dir),
        "--epochs",
        "40",
        "--log",
        str(log),
    ]
    low = _pause_once(gpuwait_cmd, job, lambda: log.exists() and "starts" in log.read_text())
    try:
        assert low.wait(timeout=600) == 0
        lines = log.read_text().splitlines()
        paused_at = int(lines[1].split()[-1])
        finished_at = 40 * 4096 // 64  # epochs x batches per epoch
        assert lines[0] == "run 0 starts at step 0"
        assert lines[1].startswith("run 0 paused at step") and 0 < paused_at < finished_at
        assert lines[2] == f"run 1 starts at step {paused_at}"  # restored, not started afresh
        assert lines[3] == f"run 1 finished at step {finished_at}"
        assert (ckpt_dir / "last.ckpt").exists()
    finally:
        low.kill()
        low.wait()


def test_a_checkpoint_signal_sent_early_waits_for_the_jobs_handler(
    one_card: None, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    """The checkpoint signal sent to gpuwait (as Slurm's --signal=B:USR1@N does) before the job
    has installed its handler reaches the job once it has, instead of killing it."""
    said = tmp_path / "said"
    script = (
        f"sleep 1.5; trap 'echo checkpointed > {said}; exit 0' USR1; while :; do sleep 0.1; done"
    )
    job = start_pausable(gpuwait_cmd, "bash", "-c", script, vram="1G", priority=None)
    try:
        wait_until_running(1)
        wait_for(lambda: any(j.get("child_pid") for j in ledger_entries()), timeout=30)
        job.send_signal(signal.SIGUSR1)
        assert job.wait(timeout=30) == 0, job.stderr.read() if job.stderr else ""
        assert said.read_text().strip() == "checkpointed"
    finally:
        job.kill()
        job.wait()


def test_a_checkpoint_signal_while_still_waiting_ends_with_the_resume_status(
    one_card: None, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    """Slurm's warning before the time limit (--signal=B:USR1@N, passed on by the batch script)
    can come while the job still waits for room: it leaves the queue and exits with the resume
    status, so that the script requeues it, instead of dying of USR1 and ending the job."""
    holder = hold_card(gpuwait_cmd, "20G", "30s")
    wait_for(lambda: [j["state"] for j in ledger_entries()] == ["running"], timeout=30)
    ran = tmp_path / "ran"
    job = start_pausable(gpuwait_cmd, "touch", str(ran), vram="8G", priority=None)
    try:
        wait_for(
            lambda: [j["state"] for j in ledger_entries()] == ["running", "waiting"], timeout=30
        )
        job.send_signal(SIGNAL)
        stderr = job.communicate(timeout=30)[1]
        assert job.returncode == 75, stderr
        assert "asked to checkpoint while still waiting" in stderr
        assert "Traceback" not in stderr
        assert not ran.exists()
        assert [j["state"] for j in ledger_entries()] == ["running"]
    finally:
        # TERM, which gpuwait passes on to its command: killed, it would leave the holder's
        # simulated job running on for its 30 s, an orphan of the test.
        for proc in (job, holder):
            proc.terminate()
        for proc in (job, holder):
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()


def test_a_checkpoint_signal_reaches_a_process_whose_name_is_not_text(
    one_card: None, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    """A process's name is its first 15 bytes (a script run by its own name, a name set with
    setproctitle), which may end in the middle of a character: `run_学習スクリプト.py`. Such a
    job still gets the checkpoint signal sent to gpuwait (Slurm's --signal=B:USR1@N before the
    time limit), instead of being left to be killed without a checkpoint."""
    said, ready = tmp_path / "said", tmp_path / "ready"
    script = textwrap.dedent(
        f"""
        import signal, sys, time
        def checkpoint(signum, frame):
            open({str(said)!r}, "w").write("checkpointed")
            sys.exit(0)
        signal.signal(signal.SIGUSR1, checkpoint)
        with open("/proc/self/comm", "wb") as comm:
            comm.write("run_学習スクリプト".encode()[:15])
        open({str(ready)!r}, "w").close()
        time.sleep(5)
        sys.exit(3)
        """
    )
    job = start_pausable(gpuwait_cmd, sys.executable, "-c", script, vram="1G", priority=None)
    try:
        wait_for(ready.exists, timeout=30, interval=0.02)
        job.send_signal(SIGNAL)
        assert job.wait(timeout=30) == 0, job.stderr.read() if job.stderr else ""
        assert said.read_text() == "checkpointed"
    finally:
        job.kill()
        job.wait()


@pytest.mark.parametrize(
    "own", [{"GPUWAIT_PAUSE_MIN_RUNTIME": "10m"}, {"GPUWAIT_PAUSE_MAX": "0"}], ids=str
)
def test_a_jobs_own_protection_holds_whatever_its_asker_allows(
    quick_card: None, gpuwait_cmd: list[str], tmp_path: Path, own: dict[str, str]
) -> None:
    # The long job's owner allows no pause this soon (or none at all); the urgent waiter's
    # settings (0.3 s, as many as it likes) would: the owner's rule is the one that holds.
    low = long_job(gpuwait_cmd, tmp_path / "p.json", hold="3s", env=own)
    try:
        wait_until_running(1)
        wait_until_pausable()
        urgent_runs_and_nobody_steps_aside(gpuwait_cmd, low)
        assert json.loads((tmp_path / "p.json").read_text())["resumes"] == 0
    finally:
        low.kill()
        low.wait()


def test_a_job_that_ends_when_asked_to_step_aside_teaches_no_size(
    one_card: None, gpuwait_cmd: list[str]
) -> None:
    # It saves and exits 0 on the checkpoint signal, instead of with the resume status: a run
    # cut short, whose peak and run time must not size the command's next run.
    quitter = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGUSR1, lambda s, f: sys.exit(0))\n"
        "time.sleep(30)\n"
    )
    command = [sys.executable, "-c", quitter]
    low = start_pausable(gpuwait_cmd, *command)
    try:
        wait_until_running(1)
        wait_until_pausable()
        urgent = urgent_job(gpuwait_cmd)
        assert low.wait(timeout=60) == 0
        assert urgent.wait(timeout=60) == 0
    finally:
        low.kill()
        low.wait()
    history = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "history.jsonl"
    records = [json.loads(line) for line in history.read_text().splitlines()]
    mine = next(r for r in records if r["command"] == command)
    assert mine["exit_status"] == 0 and mine["stopped_by"] == SIGNAL, mine
    learned = subprocess.run(
        [*gpuwait_cmd, "estimate", "--json", "--", *command],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert json.loads(learned.stdout)["estimate_bytes"] is None, learned.stdout


def asked_to_step_aside(
    state: Path, asker: int | None = None, **fields: Any
) -> tuple[Ledger, Job, Job]:
    """A running --pausable job (`fields` added) that an urgent waiter (whose gpuwait is the
    process `asker`, this one by default) asked to step aside, in the ledger in `state`: (the
    ledger, the job, the urgent job)."""
    from helpers.jobs import live_job

    from gpuwait.core.pausing import PauseRules
    from gpuwait.core.snapshot import GpuSnapshot, MachineSnapshot
    from gpuwait.queue.entries import RUNNING, WAITING
    from gpuwait.queue.pausing import ask_for_room

    gib = 2**30
    card = MachineSnapshot("sim", (GpuSnapshot(0, "GPU-0", "Test GPU", 24 * gib, 0),))
    ledger = Ledger(state)
    victim = live_job(
        "long",
        state=RUNNING,
        priority=1,
        pausable=True,
        started_at=time.time() - 60,
        gpu_uuids=["GPU-0"],
        reserved_bytes=16 * gib,
        request={"bytes": 16 * gib},
        **fields,
    )
    urgent = live_job("urgent", asker, state=WAITING, priority=5, request={"bytes": 16 * gib})
    with ledger.transaction() as data:
        data.jobs[:] = [victim, urgent]
    assert ask_for_room(ledger, urgent, card, 0.9, PauseRules(min_runtime=1.0)) == ("long",)
    return ledger, victim, urgent


def test_a_request_withdrawn_before_the_command_catches_the_signal_pauses_nothing(
    tmp_path: Path, procs: Callable[..., subprocess.Popen[str]]
) -> None:
    """An urgent job asks a --pausable job whose command does not catch the signal yet (still
    loading, say); before it does, the urgent job leaves (Ctrl-C, or it started elsewhere). Once
    the command catches the signal, it is not sent: nobody is waiting for its room, and stepping
    aside would cost it its reload for nothing."""
    ledger, victim, urgent = asked_to_step_aside(tmp_path / "state")
    loading = procs([sys.executable, "-c", "import time; time.sleep(30)"])
    responder = PauseResponder(ledger, victim)
    responder.check(loading.pid)  # asked, but its command does not catch the signal yet
    assert responder.signalled_at is None
    lifecycle.finish(ledger, urgent, "interrupted")  # the urgent job leaves
    ready = procs([sys.executable, "-c", CATCHER])
    wait_for(lambda: catches_signal(ready.pid, SIGNAL), timeout=30)
    responder.check(ready.pid)  # now its command catches it
    assert responder.signalled_at is None, "signalled for a request nobody makes any more"


def test_a_request_withdrawn_within_the_grace_kills_nothing(
    tmp_path: Path, procs: Callable[..., subprocess.Popen[str]]
) -> None:
    """A --grace-kill job was signalled, and before its grace is over the urgent job that asked
    leaves (Ctrl-C, or it started elsewhere): the job is not sent TERM when its grace ends, since
    nobody waits for its room any more. It runs on."""
    ledger, victim, urgent = asked_to_step_aside(
        tmp_path / "state", grace_kill=True, grace_seconds=30.0
    )
    command = procs([sys.executable, "-c", CATCHER])
    wait_for(lambda: catches_signal(command.pid, SIGNAL), timeout=30)
    responder = PauseResponder(ledger, victim)
    responder.check(command.pid)  # its checkpoint signal: the grace begins
    assert responder.signalled_at is not None
    lifecycle.finish(ledger, urgent, "interrupted")  # the urgent job leaves
    responder.signalled_at -= 31  # its grace is over
    responder.check(command.pid)
    assert not responder.killed and command.poll() is None, "TERM for a request nobody makes"


@pytest.mark.parametrize("when", ["signal", "TERM"])
def test_a_request_whose_asker_was_stopped_since_it_was_looked_up_is_not_carried_out(
    tmp_path: Path, procs: Callable[..., subprocess.Popen[str]], when: str
) -> None:
    """The urgent job's gpuwait is stopped (Ctrl-Z) after the --pausable job's gpuwait looked its
    request up, and nothing is written in the ledger since: stopping a process writes nothing.
    Passed over while stopped, the urgent job would start nothing in the room: once the command
    catches its signal it is not sent it, and a --grace-kill job past its grace is not TERMed."""
    from gpuwait.runner.paused import LOOK_AGAIN_EVERY

    asker = procs(["sleep", "60"])
    ledger, victim, _urgent = asked_to_step_aside(
        tmp_path / "state", asker.pid, grace_kill=True, grace_seconds=30.0
    )
    responder = PauseResponder(ledger, victim)
    command = procs([sys.executable, "-c", CATCHER])
    try:
        if when == "signal":
            loading = procs([sys.executable, "-c", "import time; time.sleep(30)"])
            responder.check(loading.pid)  # asked, but its command does not catch it yet
        else:
            wait_for(lambda: catches_signal(command.pid, SIGNAL), timeout=30)
            responder.check(command.pid)  # its checkpoint signal: the grace begins
            assert responder.signalled_at is not None
            responder.check(command.pid)  # the signal written down, looked up again
            responder.signalled_at -= 31  # its grace is over
        signalled = responder.signalled_at
        asker.send_signal(signal.SIGSTOP)
        wait_for(lambda: process_state(asker.pid) == "T", timeout=30)
        wait_for(lambda: catches_signal(command.pid, SIGNAL), timeout=30)
        assert responder.looked_at is not None
        responder.looked_at -= LOOK_AGAIN_EVERY  # its last look is that long ago
        responder.check(command.pid)
        assert responder.signalled_at == signalled, "signalled for a stopped waiter"
        assert not responder.killed and command.poll() is None, "TERM for a stopped waiter"
    finally:
        asker.send_signal(signal.SIGCONT)


def test_a_change_of_the_ledger_reads_no_other_process_while_nobody_asks(
    tmp_path: Path, procs: Callable[..., subprocess.Popen[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A running --pausable job looks its entry up on every change of the ledger. With a sweep
    # of its user's queued beside it, each look also read every entry's process (alive? a
    # gpuwait?) for a signal nobody asked for: 30 ms a change with 1000 entries, 46 ms for
    # the read itself (bench/pause_look.py). They are read only for a signal to send.
    from helpers.jobs import live_job

    from gpuwait.linux import security
    from gpuwait.queue.entries import RUNNING, WAITING

    read: list[int] = []
    looks = security.looks_like_gpuwait
    monkeypatch.setattr(security, "looks_like_gpuwait", lambda pid: read.append(pid) or looks(pid))
    ledger = Ledger(tmp_path / "state")
    sweep = [procs(["sleep", "30"]) for _ in range(3)]
    job = live_job("long", state=RUNNING, pausable=True, gpu_uuids=["GPU-0"], child_pid=1)
    with ledger.transaction() as data:
        data.jobs[:] = [job] + [
            live_job(f"w{i}", p.pid, state=WAITING, order=i + 2) for i, p in enumerate(sweep)
        ]
    command = procs([sys.executable, "-c", CATCHER])
    wait_for(lambda: catches_signal(command.pid, SIGNAL), timeout=30)
    responder = PauseResponder(ledger, job)
    for i in range(3):
        with ledger.transaction() as data:
            data.jobs[1 + i].updated_at = time.time()
        responder.check(command.pid)
    assert read == [] and responder.signalled_at is None
    # Its command's tree, for a checkpoint signal sent to gpuwait (Slurm's), still leaves out
    # the other jobs' gpuwait processes: each is read then.
    assert responder.tree(command.pid) == {command.pid}
    assert sorted(read) == sorted(p.pid for p in sweep)


def test_a_job_that_cannot_start_again_after_stepping_aside_says_how_often_it_did(
    quick_card: None, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # Its script removed while it waited to resume, the job could not start again (exit 127):
    # its `finish` event, the last word on the job, said nothing of its pauses, as though it
    # had never stepped aside.
    script = tmp_path / "train.sh"
    checkpoint = tmp_path / "progress.json"
    job = [*gpuwait_cmd, "sim", "job", "--vram", "16G", "--hold", "6s"]
    script.write_text(f"#!/bin/sh\nexec {shlex.join(job)} --checkpoint {checkpoint}\n")
    script.chmod(0o755)
    low = start_pausable(gpuwait_cmd, str(script))
    urgent = None
    try:
        wait_until_running(1)
        wait_until_pausable()
        urgent = urgent_job(gpuwait_cmd)
        wait_for(
            lambda: any(e["kind"] == "paused" for e in events()),
            timeout=30,
            interval=0.05,
            message=lambda: f"the job never stepped aside: {events()}",
        )
        script.unlink()
        _, err = low.communicate(timeout=30)
    finally:
        for p in (low, urgent):
            if p is not None and p.poll() is None:
                p.kill()
                p.communicate(timeout=30)
    assert low.returncode == 127, err
    (paused,) = [e for e in events() if e["kind"] == "paused"]
    (ended,) = [e for e in events() if e["kind"] == "finish" and e["job"] == paused["job"]]
    assert ended["exit_status"] == 127 and ended["pauses"] == 1, ended
    assert float(ended["paused_seconds"]) > 0, ended  # type: ignore[arg-type]
    # The run it did before stepping aside is in the history.
    history = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "history.jsonl"
    records = [json.loads(line) for line in history.read_text().splitlines()]
    (ran,) = [r for r in records if r["job_id"] == paused["job"]]
    assert ran["pauses"] == 1 and ran["peak_bytes"] == 16 * 2**30, ran
    assert ran["reserved_bytes"] == 16 * 2**30, ran


#: A --pausable command that writes a line in the file argv[1] for each checkpoint signal it gets
#: and, once the file argv[2] exists, steps aside (exit 75); started again (resumed), it ends at
#: once.
SLOW_TO_STEP_ASIDE = textwrap.dedent(
    """
    import os, signal, sys, time
    if os.environ["GPUWAIT_RESUME_COUNT"] != "0":
        sys.exit(0)
    got = 0
    def asked(signum, frame):
        global got
        got += 1
        with open(sys.argv[1], "a") as f:
            f.write("asked\\n")
    signal.signal(signal.SIGUSR1, asked)
    while not (got and os.path.exists(sys.argv[2])):
        time.sleep(0.05)
    sys.exit(75)
    """
)


@pytest.mark.parametrize("to_group", [False, True], ids=["to-gpuwait", "to-its-group"])
def test_a_checkpoint_signal_while_stepping_aside_ends_with_the_resume_status(
    quick_card: None, gpuwait_cmd: list[str], tmp_path: Path, to_group: bool
) -> None:
    """Slurm's warning before the time limit (--signal=B:USR1@N, passed on by the batch script)
    comes while the job checkpoints for an urgent waiter: gpuwait ends with the resume status,
    so that the script requeues the allocation, rather than queue the job to run again in an
    allocation about to end (it waited, started again, and ended 0 with its work cut short)."""
    signals, go = tmp_path / "signals", tmp_path / "go"
    low = start_pausable(
        gpuwait_cmd,
        *(sys.executable, "-c", SLOW_TO_STEP_ASIDE, str(signals), str(go)),
        start_new_session=True,  # ended with its command, whatever happens
    )
    urgent = None
    try:
        wait_until_running(1)
        wait_until_pausable()
        urgent = urgent_job(gpuwait_cmd)
        # The urgent job's request reached the command: it is saving its checkpoint.
        wait_for(lambda: signals.exists(), timeout=60, interval=0.05)
        # The time limit is near (`kill -USR1 -PGID`: the command gets it straight away too).
        (os.killpg if to_group else os.kill)(low.pid, SIGNAL)
        wait_for(lambda: signals.read_text().count("\n") >= 2, timeout=30, interval=0.05)
        go.touch()
        _, err = low.communicate(timeout=60)
        assert low.returncode == 75, err
        assert "Traceback" not in err
        kinds = [e["kind"] for e in events()]
        assert kinds.count("start") <= 2, kinds  # its own and the urgent job's
        assert urgent.wait(timeout=60) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(low.pid, signal.SIGKILL)
        low.communicate(timeout=30)
        if urgent is not None:
            urgent.terminate()  # passed on to its command: nothing is left running
            urgent.communicate(timeout=30)


def test_a_job_is_not_killed_for_a_waiter_stopped_with_ctrl_z(
    quick_card: None, gpuwait_cmd: list[str]
) -> None:
    """A --grace-kill job asked to step aside by an urgent waiter whose gpuwait is then stopped
    (Ctrl-Z): passed over while stopped, that waiter would start nothing in its room, so the job
    is not TERMed when its grace ends (it was, and its work was lost). Continued, the waiter
    wants the room again, and the job gets its TERM."""
    # A grace long enough for the waiter to be stopped within it (the test stops it as soon as
    # the job is signalled, a few tens of ms later).
    low = _ignoring_job(gpuwait_cmd, "60", "--grace", "2s", "--grace-kill")
    urgent = None
    try:
        wait_until_running(1)
        wait_until_pausable()
        urgent = urgent_job(gpuwait_cmd)
        wait_for(
            lambda: any(e["kind"] == "pause-signal" for e in events()),
            timeout=30,
            interval=0.05,
            message="the job was never signalled",
        )
        urgent.send_signal(signal.SIGSTOP)
        # Its grace, and 1 s more: the job's gpuwait looks at its request four times a second,
        # so it has looked four times past the grace, where a TERM would have been sent.
        time.sleep(2 + 1)
        assert low.poll() is None, low.stderr.read() if low.stderr else ""
        assert "pause-grace-kill" not in [e["kind"] for e in events()]
        urgent.send_signal(signal.SIGCONT)
        assert low.wait(timeout=60) == -signal.SIGTERM
        assert urgent.wait(timeout=60) == 0
    finally:
        for p in (low, urgent):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.terminate()  # passed on to its command: nothing is left running
            if p is not None:
                p.communicate(timeout=30)


@contextlib.contextmanager
def _asked_to_step_aside(
    gpuwait_cmd: list[str], command: list[str], holder: str
) -> Iterator[subprocess.Popen[str]]:
    """Run `command` as a --pausable 16G job inside which a 1 GiB job (or reservation) starts;
    once that entry's process `holder` (its "pid" or its "child_pid") catches the checkpoint
    signal and the job may be asked, an urgent job needing its room starts and is yielded.
    Every process is ended after."""
    outer = start_pausable(gpuwait_cmd, *command, start_new_session=True)
    urgent = None
    try:
        wait_until_running(2)
        inside = next(j for j in ledger_entries() if j["request"].get("bytes") == 2**30)
        wait_for(lambda: catches_signal(inside[holder], SIGNAL), timeout=30)
        time.sleep(MIN_RUNTIME + 0.5)  # the job may be asked now
        urgent = urgent_job(gpuwait_cmd)
        yield urgent
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(outer.pid, signal.SIGKILL)
        outer.communicate(timeout=30)
        if urgent is not None:
            # Passed on to its command: nothing is left running.
            with contextlib.suppress(ProcessLookupError):
                urgent.terminate()
            urgent.communicate(timeout=30)


def test_a_job_inside_a_pausable_one_is_not_sent_its_checkpoint_signal(
    quick_card: None, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    """A pausable pipeline runs a step as a job of its own, not --pausable, whose program
    catches USR1 for a purpose of its own (a stack dump, say). Asked to step aside, the
    pipeline's gpuwait signals the processes of its command that catch the signal, but not
    those of the step: the outer job's checkpoint signal is not the step's to take (it was)."""
    log = tmp_path / "step-got-usr1"
    step = textwrap.dedent(
        f"""
        import signal, time
        signal.signal(signal.SIGUSR1, lambda s, f: open({str(log)!r}, "a").write("USR1\\n"))
        time.sleep(60)
        """
    )
    inner = shlex.join([*gpuwait_cmd, "--vram", "1G", "--", sys.executable, "-c", step])
    with _asked_to_step_aside(gpuwait_cmd, ["sh", "-c", inner], "child_pid"):
        wait_for(
            lambda: any(e["kind"] == "pause-request" for e in events()),
            timeout=30,
            interval=0.05,
            message=lambda: f"the pipeline was never asked: {events()}",
        )
        # Its gpuwait looks for processes to signal four times a second: four looks.
        time.sleep(1.0)
        assert not log.exists(), log.read_text()
        assert "pause-signal" not in [e["kind"] for e in events()]


def test_a_pausable_program_that_reserves_room_itself_still_gets_its_signal(
    quick_card: None, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    """A --pausable job's program that holds room of its own through gpuwait.reserve() (a
    pipeline's stage, say) is named by that reservation's entry as its gpuwait: it is still
    the job's command, and is sent the checkpoint signal when the job is asked to step aside
    (it was passed over as a job run inside the command, and the urgent job waited)."""
    log = tmp_path / "got-usr1"
    program = textwrap.dedent(
        f"""
        import signal, sys, time
        import gpuwait
        held = gpuwait.reserve("1G")
        def step_aside(signum, frame):
            open({str(log)!r}, "a").write("USR1\\n")
            sys.exit(0)
        signal.signal(signal.SIGUSR1, step_aside)
        time.sleep(60)
        """
    )
    with _asked_to_step_aside(gpuwait_cmd, [sys.executable, "-c", program], "pid") as urgent:
        wait_for(
            log.exists,
            timeout=30,
            message=lambda: f"the program was never signalled: {events()}",
        )
        assert urgent.wait(timeout=60) == 0


def test_another_members_entry_naming_the_command_does_not_keep_it_from_its_signal(
    tmp_path: Path, procs: Callable[..., subprocess.Popen[str]]
) -> None:
    """In a shared ledger another member writes an entry naming a process of a --pausable
    job's (its command, a gpuwait-named script) as that entry's gpuwait. Asked to step aside,
    the job's command still gets its checkpoint signal: it was passed over as a job run inside
    the command, and the urgent job waited on for a job that was never signalled."""
    from helpers.jobs import live_job

    from gpuwait.queue.entries import RUNNING

    ledger, victim, _urgent = asked_to_step_aside(tmp_path / "state")
    script = tmp_path / "gpuwait-stage.py"
    script.write_text(CATCHER)
    command = procs([sys.executable, str(script)])
    wait_for(lambda: catches_signal(command.pid, SIGNAL), timeout=30)
    forged = live_job("forged", pid=command.pid, state=RUNNING, uid=os.getuid() + 1)
    with ledger.transaction() as data:
        data.jobs.append(forged)
    responder = PauseResponder(ledger, victim)
    responder.check(command.pid)
    assert responder.signalled_at is not None, "never signalled: another member's entry named it"


@pytest.mark.parametrize(
    ("script_name", "fields"),
    [
        # A program of its own holding room through gpuwait.reserve(): its entry names it as
        # its gpuwait and its command.
        ("gpuwait-stage.py", {"child_pid": "pid"}),
        # An entry left by a gpuwait that is gone, its pid now the command's.
        ("gpuwait-stage.py", {"start_time": 1}),
        # An entry naming the command, which runs no gpuwait.
        ("stage.py", {}),
        # An entry written in another pid namespace (a container), whose pid is the command's
        # here only by chance.
        ("gpuwait-stage.py", {"pidns": 1}),
    ],
)
def test_an_entry_naming_the_command_that_runs_no_job_inside_it_keeps_no_signal_from_it(
    tmp_path: Path,
    procs: Callable[..., subprocess.Popen[str]],
    script_name: str,
    fields: dict[str, Any],
) -> None:
    """Asked to step aside, a --pausable job signals its command, as long as no job of its own
    runs inside it: an entry of this user's naming the command as its gpuwait keeps it from
    its signal only where that is a live gpuwait of this namespace running another job."""
    from helpers.jobs import live_job

    from gpuwait.queue.entries import RUNNING

    ledger, victim, _urgent = asked_to_step_aside(tmp_path / "state")
    script = tmp_path / script_name
    script.write_text(CATCHER)
    command = procs([sys.executable, str(script)])
    wait_for(lambda: catches_signal(command.pid, SIGNAL), timeout=30)
    named = {k: command.pid if v == "pid" else v for k, v in fields.items()}
    entry = live_job("other", pid=command.pid, state=RUNNING, **named)
    with ledger.transaction() as data:
        data.jobs.append(entry)
    responder = PauseResponder(ledger, victim)
    responder.check(command.pid)
    assert responder.signalled_at is not None, f"never signalled: {entry}"


def test_a_job_past_its_grace_is_sent_one_term_however_often_it_is_looked_at(
    tmp_path: Path, procs: Callable[..., subprocess.Popen[str]]
) -> None:
    """A --grace-kill job that has not stepped aside when its grace ends gets one TERM; a
    command that takes a while to save its work on TERM is not TERMed again on every check of
    its gpuwait meanwhile."""
    ledger, victim, _urgent = asked_to_step_aside(
        tmp_path / "state", grace_kill=True, grace_seconds=0.0
    )
    log = tmp_path / "terms"
    saver = textwrap.dedent(
        f"""
        import signal, time
        signal.signal(signal.SIGUSR1, lambda s, f: None)
        signal.signal(signal.SIGTERM, lambda s, f: open({str(log)!r}, "a").write("TERM\\n"))
        time.sleep(30)
        """
    )
    command = procs([sys.executable, "-c", saver])
    wait_for(lambda: catches_signal(command.pid, signal.SIGTERM), timeout=30)
    responder = PauseResponder(ledger, victim)
    responder.check(command.pid)
    assert responder.signalled_at is not None
    wait_for(lambda: responder.check(command.pid) or log.exists(), timeout=30, interval=0.05)
    for _ in range(5):
        with ledger.transaction() as data:
            data.jobs[0].updated_at = time.time()  # the ledger changes meanwhile
        responder.check(command.pid)
    time.sleep(0.5)  # a second TERM, if one was sent, is written by now
    command.kill()  # it would take its TERMs as a reason to save its work, never to end
    assert log.read_text() == "TERM\n"


#: A --pausable command that passes its checkpoint signal on to its process group (its
#: workers, started beside it), as launchers do, and steps aside; started again, it ends at
#: once.
PASSES_IT_ON = textwrap.dedent(
    """
    import os, signal, sys, time
    if os.environ["GPUWAIT_RESUME_COUNT"] != "0":
        sys.exit(0)
    got = 0
    def asked(signum, frame):
        global got
        got += 1
        if got == 1:
            os.killpg(0, signal.SIGUSR1)  # for the workers
    signal.signal(signal.SIGUSR1, asked)
    while got < 2:
        time.sleep(0.05)
    sys.exit(75)
    """
)


def test_a_checkpoint_signal_the_command_passes_on_to_its_group_is_no_time_limit(
    quick_card: None, gpuwait_cmd: list[str]
) -> None:
    """A command asked to step aside for an urgent waiter that passes the signal on to its
    process group, gpuwait's too, is queued again and resumed once there is room: the signal
    is its own, not one sent to gpuwait before a time limit (it ended with 75, and never ran
    again)."""
    low = start_pausable(
        gpuwait_cmd,
        *(sys.executable, "-c", PASSES_IT_ON),
        start_new_session=True,  # its group is its own, not the tests'
    )
    urgent = None
    try:
        wait_until_running(1)
        wait_until_pausable()
        urgent = urgent_job(gpuwait_cmd)
        assert urgent.wait(timeout=60) == 0
        _, err = low.communicate(timeout=60)
        assert low.returncode == 0, err
        assert [e["kind"] for e in events()].count("start") == 3  # its two runs, and the urgent
    finally:
        if low.poll() is None:
            low.terminate()
        low.communicate(timeout=30)
        if urgent is not None and urgent.poll() is None:
            urgent.terminate()
            urgent.communicate(timeout=30)


#: As PASSES_IT_ON, but the process that passes the signal on to the group is a short-lived
#: one of the command's (`sh -c 'kill -USR1 0'`), gone by the time gpuwait looks at who sent
#: it: here gpuwait is stopped meanwhile, as a loaded machine may keep it from running.
PASSES_IT_ON_AND_IS_GONE = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    from pathlib import Path
    if os.environ["GPUWAIT_RESUME_COUNT"] != "0":
        sys.exit(0)
    here = Path(sys.argv[1])
    got = 0
    def asked(signum, frame):
        global got
        got += 1
    signal.signal(signal.SIGUSR1, asked)
    while not got:
        time.sleep(0.05)
    (here / "asked").touch()
    while not (here / "stopped").exists():
        time.sleep(0.05)
    subprocess.run(["sh", "-c", "kill -USR1 0"])
    (here / "sent").touch()
    while not (here / "go").exists():
        time.sleep(0.05)
    sys.exit(75)
    """
)


def test_a_checkpoint_signal_passed_on_by_a_process_of_the_command_gone_since_is_no_time_limit(
    quick_card: None, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    """A command asked to step aside whose short-lived helper passes the signal on to the
    group, gpuwait's too, and has ended before gpuwait looks at who sent it: the job is queued
    again and resumed (it ended with 75, and never ran again)."""
    low = start_pausable(
        gpuwait_cmd,
        *(sys.executable, "-c", PASSES_IT_ON_AND_IS_GONE, str(tmp_path)),
        start_new_session=True,  # its group is its own, not the tests'
    )
    urgent = None
    try:
        wait_until_running(1)
        wait_until_pausable()
        urgent = urgent_job(gpuwait_cmd)
        wait_for(lambda: (tmp_path / "asked").exists(), timeout=60, interval=0.05)
        os.kill(low.pid, signal.SIGSTOP)
        (tmp_path / "stopped").touch()
        wait_for(lambda: (tmp_path / "sent").exists(), timeout=60, interval=0.05)
        os.kill(low.pid, signal.SIGCONT)
        wait_for(lambda: process_state(low.pid) != "T", timeout=60, interval=0.05)
        time.sleep(1.0)  # gpuwait reads the signal: without the time, the test shows nothing
        (tmp_path / "go").touch()
        assert urgent.wait(timeout=60) == 0
        _, err = low.communicate(timeout=60)
        assert low.returncode == 0, err
        assert [e["kind"] for e in events()].count("start") == 3  # its two runs, and the urgent
    finally:
        if low.poll() is None:
            os.kill(low.pid, signal.SIGCONT)
            low.terminate()
        low.communicate(timeout=30)
        if urgent is not None and urgent.poll() is None:
            urgent.terminate()
            urgent.communicate(timeout=30)


#: A stand-in for `apptainer exec --cleanenv IMAGE CMD...` (and --containall without its PID
#: namespace): of gpuwait's variables, the command gets those given as APPTAINERENV_ ones,
#: prefix taken off, and none other; and Apptainer's starter catches every signal, passes it on
#: to the command (internal/app/starter/master_linux.go: signal.Notify, MonitorContainer), and
#: ends as the command did.
CLEANENV_STARTER = """#!/usr/bin/env python3
import os, signal, subprocess, sys
JOBS = ("GPUWAIT_JOB_", "GPUWAIT_GPU_", "GPUWAIT_VRAM_", "GPUWAIT_PAUSABLE", "GPUWAIT_RESUME_",
        "GPUWAIT_CHECKPOINT_SIGNAL", "CUDA_", "APPTAINERENV_", "SINGULARITYENV_")
env = {k: v for k, v in os.environ.items() if not k.startswith(JOBS)}
env.update({k[13:]: v for k, v in os.environ.items() if k.startswith("APPTAINERENV_")})
child = subprocess.Popen(sys.argv[4:], env=env)
for signum in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
    signal.signal(signum, lambda s, f: child.send_signal(s))
status = child.wait()
if status < 0:
    signal.signal(-status, signal.SIG_DFL)
    os.kill(os.getpid(), -status)
sys.exit(status)
"""


def test_a_pausable_job_in_a_container_that_cleans_its_environment_steps_aside(
    quick_card: None, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # `gpuwait --pausable -- apptainer exec --nv --cleanenv img.sif python train.py`: the
    # program saw no GPUWAIT_PAUSABLE, so gpuwait.checkpoint took it for no pausable job and
    # caught nothing, while Apptainer's starter, which catches every signal, took the
    # checkpoint signal and passed it on: asked to step aside, the job died of it (SIGUSR1).
    env = with_program(tmp_path / "bin", "apptainer", CLEANENV_STARTER)
    checkpoint = tmp_path / "progress.json"
    job = [*gpuwait_cmd, "sim", "job", "--vram", "16G", "--hold", "3s", "--checkpoint", checkpoint]
    container = ["apptainer", "exec", "--cleanenv", "img.sif", *map(str, job)]
    low = start_pausable(gpuwait_cmd, *container, env=env)
    try:
        wait_until_running(1)
        wait_until_pausable()
        # The starter catches the signal from its first moment and passes it on; the program
        # inside takes a while longer to load and catch it (minutes for a real model, whence
        # pause_min_runtime), and asked before that it would die of it.
        starter = next(j["child_pid"] for j in ledger_entries() if j["state"] == "running")
        wait_for(
            lambda: any(catches_signal(pid, SIGNAL) for pid in children(starter)),
            timeout=60,
            interval=0.05,
            message="the program in the container never caught the checkpoint signal",
        )
        urgent = urgent_job(gpuwait_cmd)
        assert urgent.wait(timeout=60) == 0
        assert low.wait(timeout=60) == 0, low.stderr.read() if low.stderr else ""
        assert json.loads(checkpoint.read_text())["resumes"] == 1
    finally:
        low.kill()
        low.wait()


def test_a_waiter_says_the_job_that_could_step_aside_is_stopped(
    one_card: None, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    """The only pausable job on the card is stopped with Ctrl-Z: an urgent waiter asks nobody,
    and its wait line said only "held for it until a job with no run-time estimate ends",
    nothing of the job that would step aside for it once continued."""
    stopped = start_pausable(
        gpuwait_cmd,
        *(*gpuwait_cmd, "sim", "job", "--vram", "16G", "--hold", "30s"),
        *("--checkpoint", str(tmp_path / "stopped.json")),
        start_new_session=True,
    )
    urgent = None
    try:
        wait_until_running(1)
        wait_until_pausable()
        (entry,) = ledger_entries()
        os.killpg(stopped.pid, signal.SIGSTOP)  # as Ctrl-Z: its gpuwait and its command stop
        wait_for(lambda: process_state(stopped.pid) == "T", timeout=30)
        urgent = hold_card(gpuwait_cmd, "12G", "1s", "--priority", "5", "--timeout", "3s")
        _, said = urgent.communicate(timeout=60)
        assert urgent.returncode == 124, said
        assert (
            f"job {entry['id']}, which may step aside for it, is stopped (Ctrl-Z, SIGSTOP): "
            "not asked until continued"
        ) in said, said
    finally:
        for p in (stopped, urgent):
            if p is not None and p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGCONT)
                    os.killpg(p.pid, signal.SIGKILL)
            if p is not None:
                p.communicate(timeout=30)


def test_a_job_stopped_with_ctrl_z_is_passed_over_for_one_that_can_step_aside(
    one_card: None, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    """Two pausable jobs share the card; the younger one, the first to ask, is stopped with
    Ctrl-Z (its gpuwait and its command). Stopped, it cannot step aside until continued, so an
    urgent waiter asks the older one instead and starts at once, rather than wait out the
    stopped one's grace (120 s) for nothing."""
    older = start_pausable(
        gpuwait_cmd,
        *(*gpuwait_cmd, "sim", "job", "--vram", "8G", "--hold", "30s"),
        *("--checkpoint", str(tmp_path / "older.json")),
        vram="8G",
        start_new_session=True,
    )
    younger = None
    urgent = None
    try:
        wait_until_running(1)
        younger = start_pausable(
            gpuwait_cmd,
            *(*gpuwait_cmd, "sim", "job", "--vram", "8G", "--hold", "30s"),
            *("--checkpoint", str(tmp_path / "younger.json")),
            vram="8G",
            start_new_session=True,
        )
        wait_until_running(2)
        entry = next(j for j in ledger_entries() if j["pid"] == younger.pid)
        wait_for(
            lambda: all(
                j.get("child_pid") and catches_signal(j["child_pid"], SIGNAL)
                for j in ledger_entries()
            ),
            timeout=30,
            message="the jobs never caught the checkpoint signal",
        )
        os.killpg(younger.pid, signal.SIGSTOP)  # as Ctrl-Z: its gpuwait and its command stop
        wait_for(lambda: process_state(younger.pid) == "T", timeout=30)
        time.sleep(MIN_RUNTIME + 0.5)  # both may be asked now
        urgent = hold_card(gpuwait_cmd, "12G", "1s", "--priority", "5", "--timeout", "20s")
        _, said = urgent.communicate(timeout=60)
        assert urgent.returncode == 0, said
        asked = [v for e in events() if e["kind"] == "pause-request" for v in e["victims"]]
        assert entry["id"] not in asked, events()
    finally:
        for p in (older, younger, urgent):
            if p is not None and p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGCONT)
                    os.killpg(p.pid, signal.SIGKILL)
            if p is not None:
                p.communicate(timeout=30)
