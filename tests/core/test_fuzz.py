"""Every parser, fed anything: it answers with a value or its documented error, nothing else.

Documented errors: ValueError for sizes, durations, device lists, ledger entries and ledger files;
UsageError for settings and config files; BackendUnavailable for simulation files. Whole state
files (ledger, history) never raise at all: damage becomes a warning and a recovery.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.history import a_run
from helpers.jobs import live_job
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gpuwait.cli import main
from gpuwait.config import OPTIONS, load_config_file, resolve
from gpuwait.core.devices import parse_devices_option, parse_inherited_visible
from gpuwait.core.errors import BackendUnavailable, UsageError
from gpuwait.core.sizes import MAX_SIZE, parse_duration, parse_request, parse_size
from gpuwait.core.snapshot import GpuSnapshot
from gpuwait.gpu.sim import load_sim_file
from gpuwait.history import index, store
from gpuwait.history.learn import learn
from gpuwait.queue.conditions import claim_of
from gpuwait.queue.entries import Job
from gpuwait.queue.ledger import Ledger, _check_crc

FILES = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)

size_like = st.one_of(
    st.text(max_size=30),
    st.from_regex(r"\s*-?[0-9.]{0,30}\s*[kKmMgGtTpP%]?[iI]?[bB]?\s*", fullmatch=True),
)
duration_like = st.one_of(
    st.text(max_size=30),
    st.from_regex(r"\s*([0-9.]{0,25}\s*(ms|s|m|h|d|x)?\s*){0,4}", fullmatch=True),
)


@given(size_like)
def test_parse_size(text: str) -> None:
    try:
        value = parse_size(text)
    except ValueError:
        return
    assert isinstance(value, int) and 0 <= value < 2**63
    # Only zero may come without a unit: `6` is never silently 6 bytes.
    assert value == 0 or any(c in "KMGTBkmgtb" for c in text)


@given(size_like)
def test_parse_request(text: str) -> None:
    try:
        request = parse_request(text)
    except ValueError:
        return
    assert request.on(80 * 2**30) > 0


@given(duration_like)
def test_parse_duration(text: str) -> None:
    try:
        seconds = parse_duration(text)
    except ValueError:
        return
    assert math.isfinite(seconds) and seconds >= 0


GPUS = (
    GpuSnapshot(0, "GPU-aaaa-1111", "A", 2**30, 0),
    GpuSnapshot(1, "GPU-bbbb-2222", "B", 2**30, 0),
)


@given(st.text(max_size=40))
def test_device_lists(text: str) -> None:
    try:
        chosen = parse_devices_option(text, GPUS)
    except ValueError:
        pass
    else:
        assert chosen and set(chosen) <= {g.uuid for g in GPUS}
    assert set(parse_inherited_visible(text, GPUS)) <= {g.uuid for g in GPUS}
    mig = ((2, "GPU-cccc-3333"),)
    assert set(parse_inherited_visible(text, GPUS, mig)) <= {g.uuid for g in GPUS}


setting_values = st.one_of(
    st.text(max_size=20), st.integers(), st.floats(), st.booleans(), st.lists(st.integers())
)


@given(st.sampled_from(OPTIONS), setting_values, st.sampled_from(["cli", "env", "file", "site"]))
def test_every_setting_from_every_place(option: Any, value: Any, where: str) -> None:
    cli = {option.name: value} if where == "cli" else {}
    env = {option.env_var: str(value)} if where == "env" else {}
    user = {option.name: value} if where == "file" else {}
    site = {option.name: value} if where == "site" else {}
    try:
        settings_ = resolve(cli, env, user, Path("c.toml"), site, Path("s.toml"))
    except UsageError as exc:
        assert exc.message and "\n" not in exc.message
        return
    assert settings_.sources[option.name] != ""
    assert isinstance(settings_.shown(option.name), str)


@FILES
@given(st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
# A number of more digits than int() converts: tomllib raised Python's ValueError for it.
@example(b"priority = " + b"1" * 5000)
def test_config_files(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "config.toml"
    path.write_bytes(content)
    for site in (False, True):
        try:
            data = load_config_file(path, site=site)
        except UsageError as exc:
            assert str(path) in exc.message
            continue
        assert isinstance(data, dict)


def _valid_entry() -> dict[str, Any]:
    return dict(vars(live_job("x", command=["c"])))


FIELDS = sorted(_valid_entry())


@given(st.sampled_from(FIELDS), json_values)
def test_ledger_entry_with_one_field_replaced(field: str, value: Any) -> None:
    entry = {**_valid_entry(), field: value}
    try:
        job = Job.from_json(entry)
    except ValueError:
        return
    assert isinstance(job.pid, int) and job.state in ("waiting", "running")
    claim_of(job, GPUS)


@given(json_values)
def test_ledger_entry_anything(value: Any) -> None:
    with contextlib.suppress(ValueError):
        Job.from_json(value)


def _ledger_bytes(draw_jobs: Any) -> bytes:
    raw = {"schema": 1, "created_at": 1.0, "next_order": 1, "rr_cursor": -1, "jobs": draw_jobs}
    return json.dumps(raw).encode()


ledger_files = st.one_of(
    st.binary(max_size=400),
    st.lists(json_values, max_size=4).map(_ledger_bytes),
    st.lists(st.sampled_from(FIELDS).flatmap(lambda f: json_values.map(lambda v: {f: v})))
    .map(lambda changes: [{**_valid_entry(), **c, "id": str(i)} for i, c in enumerate(changes)])
    .map(_ledger_bytes),
    json_values.map(lambda v: json.dumps(v).encode()),
)


@given(ledger_files)
def test_ledger_decode(content: bytes) -> None:
    try:
        _check_crc(content)
        Ledger(Path("/nonexistent"))._decode(content, repair=True)
    except ValueError:
        pass


@FILES
@pytest.mark.parametrize("shared", [False, True])
@given(content=ledger_files)
def test_ledger_transaction_never_raises(tmp_path: Path, shared: bool, content: bytes) -> None:
    directory = tmp_path / ("shared" if shared else "private")
    directory.mkdir(mode=0o1770 if shared else 0o700, exist_ok=True)
    directory.chmod(0o1770 if shared else 0o700)
    (directory / "ledger.json").write_bytes(content)
    ledger = Ledger(directory)
    with ledger.transaction() as data:
        for job in data.jobs:
            claim_of(job, GPUS)
    assert len(ledger.warnings) <= 3


@FILES
@given(st.binary(max_size=400))
def test_history_never_raises(tmp_path: Path, content: bytes) -> None:
    store.parse_lines(content)
    (tmp_path / "history.jsonl").write_bytes(content)
    store.append_record(tmp_path, {"started_at": 1.0, "exit_status": 0, "job_id": "z"})
    records = store.read_from(tmp_path / "history.jsonl").records
    assert records[-1][1]["job_id"] == "z"


sim_tables = st.dictionaries(
    st.sampled_from(["name", "memory", "uuid", "speed", "base_used", "lost", "utilization", "x"]),
    st.one_of(
        st.text(max_size=10),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=False),
        st.booleans(),
    ),
    max_size=5,
)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, float) and not math.isfinite(v):
        return "inf"
    return repr(v)


def _sim_text(tables: list[dict[str, Any]]) -> bytes:
    parts = [
        "[[gpu]]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in t.items()) for t in tables
    ]
    return "\n".join(parts).encode()


@FILES
@given(st.binary(max_size=300) | st.lists(sim_tables, max_size=3).map(_sim_text))
@example(b"[[gpu]]\nmemory = " + b"1" * 5000)
def test_simulation_files(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "sim.toml"
    path.write_bytes(content)
    try:
        config = load_sim_file(path)
    except BackendUnavailable as exc:
        assert "simulation file" in exc.message
        return
    assert all(g.total_bytes > 0 for g in config.gpus)


def _history_with_an_index(state: Path) -> list[str]:
    """A history of three runs of one command, and its index built: that command. The GPUs are
    simulated ones (the user's config.toml in the same home says so): what NVML says where there
    is none may differ between two estimates, a test before this one in the same process having
    left it otherwise."""
    argv = ["python", "train.py"]
    config = state.parent.parent / "config" / "gpuwait"
    config.mkdir(parents=True, exist_ok=True)
    (config / "sim.toml").write_text('[[gpu]]\nmemory = "24GiB"\n')
    (config / "config.toml").write_text(f"sim = {json.dumps(str(config / 'sim.toml'))}\n")
    shutil.rmtree(state, ignore_errors=True)
    state.mkdir(mode=0o700, parents=True)
    for n in range(3):
        run = a_run(argv, os.getcwd(), time.time() - 60 + n, peak_by_gpu={"GPU-0": (n + 2) << 30})
        store.append_record(state, run)
    learn(state, argv, os.getcwd())
    return argv


def _estimate_shown(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    assert main(["estimate", "--", *argv]) == 0
    shown = capsys.readouterr().out
    assert "nan" not in shown and "inf" not in shown
    return shown


#: The history index's cases: each runs `gpuwait estimate` twice.
INDEX = settings(FILES, max_examples=20)


@INDEX
@given(field=st.sampled_from(["schema", "dev", "ino", "offset"]), value=st.integers() | json_values)
@example(field="offset", value=-1)
def test_history_index_meta_damaged_anyhow_is_rebuilt(
    isolated_dirs: Path, capsys: pytest.CaptureFixture[str], field: str, value: Any
) -> None:
    # The index is a cache: whatever its meta says, the estimate is the history's, and the
    # next run is recorded.
    state = isolated_dirs / "state" / "gpuwait"
    argv = _history_with_an_index(state)
    expected = _estimate_shown(argv, capsys)
    meta = state / index.DIRNAME / index.META
    meta.write_text(json.dumps({**json.loads(meta.read_text()), field: value}))
    assert _estimate_shown(argv, capsys) == expected
    store.append_record(state, a_run(argv, os.getcwd(), time.time()))
    assert learn(state, argv, os.getcwd()).levels[0].total_runs == 4


@INDEX
@given(column=st.integers(min_value=1, max_value=9), value=st.floats() | json_values)
@example(column=5, value=math.nan)
def test_history_index_run_damaged_anyhow_is_rebuilt_or_read_as_a_real_figure(
    isolated_dirs: Path, capsys: pytest.CaptureFixture[str], column: int, value: Any
) -> None:
    # A run's figure in the index that is none (NaN, a string, -1e305 seconds) makes it taken
    # for damaged and rebuilt: `estimate` never shows a traceback, nan or a negative time.
    state = isolated_dirs / "state" / "gpuwait"
    argv = _history_with_an_index(state)
    for bucket in (state / index.DIRNAME).glob("b*.json"):
        keys = json.loads(bucket.read_text())
        for entry in keys.values():
            entry["runs"][-1][column] = value
        bucket.write_text(json.dumps(keys))
    _estimate_shown(argv, capsys)
    learned = learn(state, argv, os.getcwd())
    assert learned.estimate.bytes is None or 0 < learned.estimate.bytes <= MAX_SIZE
    for spread in (learned.run_time, learned.wait_time):
        assert spread is None or all(
            math.isfinite(x) and x >= 0 for x in (spread.low, spread.median, spread.high)
        )
