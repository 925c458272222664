"""`idle_action = pause`: a user's own idle --pausable job steps aside for a waiter of the same
priority, on a simulated card that does no work; on a busy card nothing happens."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers.fixtures_sim import SimFileFactory, hold_card
from helpers.waiting import catches_signal, ledger_entries, wait_for


def pausable_job(gpuwait_cmd: list[str], checkpoint: Path) -> subprocess.Popen[str]:
    """A --pausable job of the default priority holding 16 GiB of the card for 4s of work: asked
    to step aside, it is about 1 s into it."""
    return subprocess.Popen(
        [
            *gpuwait_cmd,
            "--pausable",
            "--vram",
            "16G",
            "--",
            *gpuwait_cmd,
            "sim",
            "job",
            "--vram",
            "16G",
            "--hold",
            "4s",
            "--checkpoint",
            str(checkpoint),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )


def events() -> list[str]:
    path = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait" / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["kind"] for line in path.read_text().splitlines()]


def wait_until_catching() -> None:
    def ready() -> bool:
        running = [j for j in ledger_entries() if j["state"] == "running"]
        return bool(
            len(running) == 1
            and running[0].get("child_pid")
            and catches_signal(running[0]["child_pid"], signal.SIGUSR1)
        )

    wait_for(ready, timeout=60, interval=0.05, message=lambda: f"never ran: {ledger_entries()}")


@pytest.mark.parametrize("utilization", [0, 90])
def test_an_idle_own_pausable_job_steps_aside_for_a_waiter_only_on_a_quiet_card(
    utilization: int,
    sim_file: SimFileFactory,
    gpuwait_cmd: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sim_file(gpus=1, memory="24GiB", utilization=utilization)
    monkeypatch.setenv("GPUWAIT_IDLE_ACTION", "pause")
    monkeypatch.setenv("GPUWAIT_IDLE_AFTER", "500ms")
    monkeypatch.setenv("GPUWAIT_PAUSE_MIN_RUNTIME", "100ms")
    checkpoint = tmp_path / "progress.json"
    idle = pausable_job(gpuwait_cmd, checkpoint)
    waiter = None
    try:
        wait_until_catching()
        # Same priority: without idleness nobody would be asked.
        waiter = hold_card(gpuwait_cmd, "16G", "1s")
        if utilization:
            # A busy card: the job works, and the waiter waits for it to end. Three times the
            # 0.5 s it would take to be seen idle, and still inside the job's 4s of work.
            time.sleep(1.5)
            assert waiter.poll() is None
            assert "pause-request" not in events()
            assert idle.wait(timeout=60) == 0
            assert waiter.wait(timeout=60) == 0
            assert json.loads(checkpoint.read_text())["resumes"] == 0
            return
        assert waiter.wait(timeout=60) == 0
        # It did not wait for the idle job's 4s of work to end: seen idle for 0.5 s by the
        # waiter's own readings, asked, stepped aside with its work part done.
        progress = json.loads(checkpoint.read_text())
        assert not progress["finished"] and progress["held_seconds"] < 4, progress
        assert "pause-request" in events() and "paused" in events()
        # The idle job was queued again and finishes its work afterwards.
        assert idle.wait(timeout=60) == 0
        assert json.loads(checkpoint.read_text()) == {
            "held_seconds": 4.0,
            "finished": True,
            "resumes": 1,
        }
    finally:
        for p in (idle, waiter):
            if p is not None and p.poll() is None:
                p.terminate()
                p.communicate(timeout=30)
