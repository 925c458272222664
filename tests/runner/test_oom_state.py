"""A run that died of out-of-memory is an OOM, not just a failure: real gpuwait processes on a
simulated GPU, seen through the exit summary line, `status` counters, `history` and `log`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from helpers import fixtures_sim
from helpers.fixtures_sim import SimFileFactory

from gpuwait.queue.entries import book_from_json

GPUWAIT = [sys.executable, "-m", "gpuwait"]


def gpuwait(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*GPUWAIT, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "120", **(env or {})},
    )


def run_sim_job(
    options: list[str], *job: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return fixtures_sim.run_sim_job(GPUWAIT, options, *job, env={"COLUMNS": "120", **(env or {})})


def counters() -> dict[str, Any]:
    report = json.loads(gpuwait("status", "--json").stdout)
    return dict(report["gpus"][0]["counters"])


def test_an_oom_at_its_own_limit_is_shown_as_such(sim_file: SimFileFactory) -> None:
    sim_file(gpus=1, memory="8GiB")
    done = run_sim_job(["--enforce", "limit", "--vram", "2G"], "--vram", "4G", "--hold", "0.2s")
    assert done.returncode == 1
    assert "torch.OutOfMemoryError" in done.stderr
    assert done.stderr.rstrip().endswith(
        "gpuwait: warning: the command ran out at its own 2.0 GiB limit; "
        "the next run without --vram asks for 4.5 GiB"
    ), done.stderr
    assert "0 completed, 0 failed, 1 out of memory" in gpuwait("status").stdout
    assert (counters()["failed"], counters()["oom"]) == (0, 1)
    assert "1 OOM at limit" in gpuwait("history").stdout
    assert "failed, exit 1, out of memory at its own 2.0 GiB limit" in gpuwait("log").stdout


def test_an_oom_on_a_full_card_is_shown_as_such(sim_file: SimFileFactory) -> None:
    # No message to go by (stderr not watched): the card ran full at the job's peak.
    sim_file(gpus=1, memory="24GiB")
    done = run_sim_job(
        ["--vram", "20G"],
        *("--vram", "23.9G", "--hold", "1.5s", "--exit", "1"),
        env={"GPUWAIT_WATCH_STDERR": "off"},
    )
    assert done.returncode == 1
    last = done.stderr.rstrip().splitlines()[-1]
    assert last.startswith(
        "gpuwait: warning: the command ran out of memory on a full card; "
        "the next run without --vram asks for "
    ), done.stderr
    assert "1 OOM card full" in gpuwait("history").stdout
    assert "out of memory (card full)" in gpuwait("log").stdout
    assert (counters()["failed"], counters()["oom"]) == (0, 1)


def test_a_plain_failure_is_no_oom(sim_file: SimFileFactory) -> None:
    sim_file(gpus=1, memory="8GiB")
    done = gpuwait("--vram", "1G", "--", "sh", "-c", "echo bad input >&2; exit 3")
    assert done.returncode == 3
    assert "ran out" not in done.stderr
    status = gpuwait("status").stdout
    assert "0 completed, 1 failed" in status and "out of memory" not in status
    assert (counters()["failed"], counters()["oom"]) == (1, 0)


def test_ledgers_from_before_oom_counting_still_read() -> None:
    book = book_from_json(
        {
            "finished": [{"id": "a", "outcome": "failed", "finished_at": 1.0, "exit_status": 1}],
            "gpus": {"GPU-1": {"dispatched": 2, "completed": 1, "failed": 1}},
        }
    )
    assert book.gpus["GPU-1"].oom == 0 and book.finished[0].oom is None
    assert book.finished[0].describe() == "failed with exit status 1"


def test_a_finished_oom_says_how_it_ran_out() -> None:
    book = book_from_json(
        {
            "finished": [
                {"id": "a", "outcome": "failed", "finished_at": 1.0, "oom": "card full"},
                {"id": "b", "outcome": "failed", "finished_at": 1.0, "oom": "own limit"},
            ],
            "gpus": {"GPU-1": {"dispatched": 2, "completed": 0, "failed": 0, "oom": 2}},
        }
    )
    assert book.gpus["GPU-1"].oom == 2
    assert [f.describe() for f in book.finished] == [
        "ran out of GPU memory on a full card",
        "ran out of GPU memory at its own limit",
    ]
    assert not book.finished[0].succeeded
