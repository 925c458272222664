"""Every `--json` output parses in a strict JSON reader (Rust's serde_json, .NET's
System.Text.Json): text is valid Unicode and numbers are numbers, whatever the command
lines of the jobs or the files gpuwait reads back held."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO
from helpers.waiting import ledger_entries, wait_for

#: A Latin-1 file name, as old data sets and cron's C locale have them: no UTF-8.
LATIN1 = b"caf\xe9.txt"


def strict(text: str) -> Any:
    """`text` as a strict reader takes it: no NaN or Infinity, no lone surrogate (an argument
    that is no UTF-8 reaches Python as one, and `json.dumps` writes it as `\\udce9`)."""

    def refuse(constant: str) -> Any:
        raise AssertionError(f"not JSON: {constant}")

    def check(value: Any) -> None:
        if isinstance(value, str):
            value.encode("utf-8")  # a lone surrogate is no Unicode text: UnicodeEncodeError
        elif isinstance(value, float):
            assert math.isfinite(value)
        elif isinstance(value, list):
            for item in value:
                check(item)
        elif isinstance(value, dict):
            for key, item in value.items():
                check(key)
                check(item)

    document = json.loads(text, parse_constant=refuse)
    check(document)
    return document


def gpuwait_json(gpuwait_cmd: list[str], *args: str, code: int = 0) -> str:
    done = subprocess.run(
        [*gpuwait_cmd, *args], capture_output=True, text=True, timeout=60, env=os.environ
    )
    assert done.returncode == code and "Traceback" not in done.stderr, done.stderr
    return done.stdout


def test_a_job_whose_arguments_are_no_utf8_leaves_every_json_output_readable(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    command = [b"sh", b"-c", b"read line", b"sh", LATIN1]
    job = subprocess.Popen(
        [*(a.encode() for a in gpuwait_cmd), b"-q", b"--vram", b"1G", b"--", *command],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for(lambda: [j["state"] for j in ledger_entries()] == ["running"], timeout=30)
        status = strict(gpuwait_json(gpuwait_cmd, "status", "--json"))
        (shown,) = status["jobs"]
        # The undecodable byte shows as U+FFFD, as in a command read from /proc.
        assert shown["command"][-1] == "caf\ufffd.txt"
    finally:
        job.communicate(b"\n", timeout=60)
    assert job.returncode == 0, job.stderr
    (record,) = strict(gpuwait_json(gpuwait_cmd, "history", "--json"))
    assert record["command"][-1] == "caf\ufffd.txt"
    events = gpuwait_json(gpuwait_cmd, "log", "--json").splitlines()
    submit = [strict(line) for line in events if '"submit"' in line]
    assert submit and submit[0]["command"][-1] == "caf\ufffd.txt"
    estimate = subprocess.run(
        [*(a.encode() for a in gpuwait_cmd), b"estimate", b"--json", b"--", *command],
        capture_output=True,
        timeout=60,
    )
    assert estimate.returncode == 0, estimate.stderr
    learned = strict(estimate.stdout.decode())
    assert learned["runs"] == 1


def test_figures_that_are_no_numbers_in_damaged_files_never_reach_the_json(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    # Hand-edited or damaged lines: Python's json reads NaN and Infinity, no strict reader does.
    state = Path(os.environ["XDG_STATE_HOME"]) / "gpuwait"
    state.mkdir(parents=True, exist_ok=True, mode=0o700)
    run = {
        "schema": 2,
        "command": ["python", "train.py"],
        "cwd": "/",
        "started_at": 1.7e9,
        "peak_bytes": None,
        "reserved_bytes": 0,
        "exit_status": 0,
        "signal": None,
        "run_seconds": 1.0,
        "wait_seconds": 0.0,
        "gpus": [],
        "keys": {},
    }
    line = json.dumps(run)[:-1] + ', "note": NaN}\n'
    (state / "history.jsonl").write_text(line)
    (state / "events.jsonl").write_text(
        '{"schema": 1, "time": NaN, "kind": "submit", "job": "a"}\n'
        '{"schema": 1, "time": 1.7e9, "kind": "start", "job": "b", "pid": Infinity}\n'
    )
    os.chmod(state / "history.jsonl", 0o600)
    os.chmod(state / "events.jsonl", 0o600)
    (record,) = strict(gpuwait_json(gpuwait_cmd, "history", "--json"))
    assert record["command"] == ["python", "train.py"] and record["note"] is None
    events = [strict(e) for e in gpuwait_json(gpuwait_cmd, "log", "--json").splitlines()]
    # A figure that is no number is unknown: null (`gpuwait log` shows such a time as "?").
    assert events == [
        {"schema": 1, "time": None, "kind": "submit", "job": "a"},
        {"schema": 1, "time": 1.7e9, "kind": "start", "job": "b", "pid": None},
    ]


def test_config_json_gives_a_script_each_setting_as_numbers_and_lists(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    # `value` is the setting as typed (shown rounded: 67,000,000 bytes is "63.9 MiB"); a script
    # that compares sizes, times or lists needs them as data, in the units of status --json.
    env = {
        "GPUWAIT_HISTORY_MAX_SIZE": "67000000B",
        "GPUWAIT_IDLE_AFTER": "90m",
        "GPUWAIT_IGNORE_PROCESSES": "Xorg,my app",
        "GPUWAIT_DEFAULT_VRAM": "6G",
        "GPUWAIT_SAFETY": "0.85",
    }
    done = subprocess.run(
        [*gpuwait_cmd, "config", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )
    assert done.returncode == 0, done.stderr
    document = strict(done.stdout)
    assert document["schema"] == 1
    settings = document["settings"]
    assert settings["history_max_size"]["value"] == "63.9 MiB"
    parsed = {name: setting["parsed"] for name, setting in settings.items()}
    assert parsed["history_max_size"] == 67_000_000
    assert parsed["idle_after"] == 5400
    assert parsed["ignore_processes"] == ["Xorg", "my app"]
    assert parsed["default_vram"] == {"bytes": 6 * 2**30}  # as a job's `request` in status
    assert parsed["safety"] == 0.85 and parsed["priority"] == 3
    assert parsed["timeout"] is None  # none: as long as it takes
    assert parsed["prefer"] == [] and parsed["gpu_weights"] == {}
    again = strict(gpuwait_json(gpuwait_cmd, "config", "--json"))["settings"]
    assert again["default_vram"]["parsed"] == {}  # exclusive: a whole GPU, as in status


def test_idle_json_says_which_gpus_it_could_not_read(
    sim_file: Any, gpuwait_cmd: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A lost GPU is skipped: `idle: []` alone would read as "nobody idles there"; the text
    # output warns on stderr, the JSON must say it too, as status --json does.
    sim_file(gpus=2, lost=[False, True])
    idle = strict(gpuwait_json(gpuwait_cmd, "idle", "--json"))
    assert idle["idle"] == [] and idle["backend_error"] is None
    (warning,) = idle["warnings"]
    assert "GPU 1" in warning and "lost" in warning
    assert idle["warnings"] == strict(gpuwait_json(gpuwait_cmd, "status", "--json"))["warnings"]
    monkeypatch.setenv("GPUWAIT_SIM", str(tmp_path / "missing.toml"))
    unread = strict(gpuwait_json(gpuwait_cmd, "idle", "--json", code=4))
    assert "not found" in unread["backend_error"] and "sim init" in unread["backend_hint"]


def documented(page: str, start: str, end: str) -> set[str]:
    """The names in backticks (`pid`, `{"bytes": n}`) between `start` and `end` (a blank line:
    the paragraph's end)."""
    text = (REPO / "docs" / page).read_text()
    part = text[text.index(start) :]
    part = part[: part.index(end, len(start))]
    return {
        name for quoted in re.findall(r"`([^`]+)`", part) for name in re.findall(r"\w+", quoted)
    }


def event_fields() -> dict[str, set[str]]:
    """The event log's table: each kind -> the fields its row names."""
    text = (REPO / "docs" / "queue-and-status.md").read_text()
    part = text[text.index("| kind | when | fields |") :]
    fields: dict[str, set[str]] = {}
    for row in part.splitlines()[2:]:
        if not row.startswith("|"):
            break
        kinds, _, named = row.strip("|").split(" | ", 2)
        for kind in re.findall(r"`([^`]+)`", kinds):
            fields[kind] = {
                w for q in re.findall(r"`([^`]+)`", named) for w in re.findall(r"\w+", q)
            }
    return fields


def keys(value: Any, skip: frozenset[str] = frozenset()) -> set[str]:
    """Every key of every object in `value`, the values of `skip` keys left out."""
    if isinstance(value, list):
        return {k for item in value for k in keys(item, skip)}
    if not isinstance(value, dict):
        return set()
    found = set(value)
    for key, item in value.items():
        found |= set() if key in skip else keys(item, skip)
    return found


def test_every_field_of_the_json_outputs_is_documented(sim: Path, gpuwait_cmd: list[str]) -> None:
    # A script is written from the docs: a field they do not name is one nobody can rely on.
    done = subprocess.run(
        [*gpuwait_cmd, "-q", "--vram", "1G", "--batch", "b", "--", "true"], timeout=60
    )
    assert done.returncode == 0
    job = subprocess.Popen(
        [*gpuwait_cmd, "-q", "--vram", "1G", "--name", "j", "--", "sh", "-c", "read line"],
        stdin=subprocess.PIPE,
    )
    try:
        wait_for(lambda: [j["state"] for j in ledger_entries()] == ["running"], timeout=30)
        status = strict(gpuwait_json(gpuwait_cmd, "status", "--json"))
    finally:
        job.communicate(b"\n", timeout=60)
    assert status["jobs"] and status["batches"] and status["users"]
    status_doc = documented("queue-and-status.md", "### `gpuwait status --json`", "## Event log")
    assert keys(status) - status_doc == set()
    estimate = strict(gpuwait_json(gpuwait_cmd, "estimate", "--json", "--", "true"))
    assert estimate["levels"] and estimate["run_seconds"]
    estimate_doc = documented("learning.md", "`gpuwait estimate --json`", "\n\n")
    assert keys(estimate) - estimate_doc == set()
    history = strict(gpuwait_json(gpuwait_cmd, "history", "--json"))
    assert history
    history_doc = documented("learning.md", "`history.jsonl`: one JSON", "\n- `history.index/`")
    assert (
        keys(history, skip=frozenset({"keys", "peak_by_gpu", "free_at_peak_bytes"})) - (history_doc)
        == set()
    )
    events = [json.loads(line) for line in gpuwait_json(gpuwait_cmd, "log", "--json").splitlines()]
    assert {e["kind"] for e in events} >= {"submit", "admit", "start", "finish"}
    for event in events:
        fields = event_fields()[event["kind"]]
        assert set(event) - {"schema", "time", "kind"} - fields == set(), event
    idle = strict(gpuwait_json(gpuwait_cmd, "idle", "--json"))
    idle_doc = documented("shared-servers.md", "`gpuwait idle` lists them", "\n\n")
    assert keys(idle) - idle_doc - status_doc == set()
    config = strict(gpuwait_json(gpuwait_cmd, "config", "--json"))
    config_doc = documented("configuration.md", "`gpuwait config --json`", "\n\n")
    assert keys(config, skip=frozenset({"settings"})) - config_doc == {"settings"} - config_doc
    assert keys(list(config["settings"].values())) - config_doc == set()
