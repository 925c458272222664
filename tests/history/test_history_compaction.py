"""Compaction at the size limit: what `gpuwait estimate` shows is the same before and after."""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.history import a_run
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gpuwait.cli import main
from gpuwait.core.estimate import MIN_RUNS, recent
from gpuwait.core.snapshot import GpuSnapshot
from gpuwait.history import record, store
from gpuwait.history.learn import learn

GiB = 2**30
DAY = 86400.0
CWD = "/home/me/proj"
START = 1_700_000_000.0
H100 = GpuSnapshot(
    index=0,
    uuid="GPU-8f3c2a1e-7d4b-4c1a-9e2f-0b6d5a4c3e21",
    name="NVIDIA H100 80GB HBM3",
    total_bytes=80 * GiB,
    used_bytes=0,
)
Probe = tuple[tuple[str, ...], str | None]


def run_record(
    rng: random.Random, argv: list[str], at: float, key: str | None = None
) -> dict[str, Any]:
    """A record as gpuwait writes it: successes, OOMs, failures, signal deaths, approximate and
    unknown peaks, runs without a load time."""
    outcome = rng.random()
    oom = outcome < 0.05
    returncode = 1 if outcome < 0.1 else (-9 if outcome < 0.13 else 0)
    peak = int(rng.uniform(1, 40) * GiB)
    measured = rng.random() > 0.02
    job_id = f"{rng.getrandbits(48):012x}"
    reserved = peak if rng.random() < 0.5 else 0
    approximate = rng.random() < 0.1
    to_peak = rng.uniform(1, 90) if rng.random() > 0.2 else None
    samples = rng.randrange(5, 500)
    wait, ran = rng.uniform(0, 600), rng.uniform(5, 7200)
    return a_run(
        argv,
        CWD,
        at,
        job_id=job_id,
        key=key,
        request={"bytes": peak},
        reserved_bytes=reserved,
        gpus=[H100],
        peak_by_gpu={H100.uuid: peak} if measured else {},
        run_seconds=ran,
        wait_seconds=wait,
        returncode=returncode,
        peak_approximate=approximate,
        time_to_peak=to_peak,
        samples=samples,
        free_at_peak_bytes={H100.uuid: 80 * GiB - peak},
        oom=oom,
        oom_evidence="torch.OutOfMemoryError: CUDA out of memory" if oom else None,
        stderr_watched="file",
    )


def sweep_history(state: Path, runs: int, seed: int = 5) -> tuple[list[Probe], float]:
    """`runs` runs over 130 days (10 past MAX_AGE) of six scripts: mostly sweeps (every command line different),
    some lines run again and again, a few --key runs. Returns the probes and the time after."""
    rng = random.Random(seed)
    scripts = [f"exp{i}/train.py" for i in range(6)]
    repeated = [["python", s, "--bs", str(bs)] for s in scripts[:3] for bs in (8, 32)]
    lines, probes = [], []
    at = START
    for n in range(runs):
        at += 130 * DAY / runs
        choice, key = rng.random(), None
        if choice < 0.25:
            argv = rng.choice(repeated)
        elif choice < 0.3:
            argv, key = ["python", rng.choice(scripts), "--data", f"/d/{n}"], "nightly"
        elif choice < 0.33:
            argv = ["bash", "run.sh", str(n)]
        else:
            argv = ["python", rng.choice(scripts), "--lr", f"{rng.random():.6f}", "--seed", str(n)]
        lines.append(record.encode(run_record(rng, argv, at, key)))
        # Runs older than MAX_AGE are forgotten by design (and count for no estimate).
        if rng.random() < 0.06 and at > START + 10 * DAY + 3600:
            probes.append((tuple(argv), key))
    probes += [(("python", s), None) for s in scripts] + [(tuple(r), None) for r in repeated]
    probes += [(("python", "unseen.py"), None), (("true",), "nightly")]
    state.mkdir(parents=True, exist_ok=True)
    path = store.history_path(state)
    path.write_bytes(b"".join(lines))
    os.chmod(path, 0o600)
    return probes, at + 60


def figures(state: Path, probe: Probe, now: float) -> tuple[Any, ...]:
    """Everything `gpuwait estimate` shows for a command."""
    learned = learn(state, list(probe[0]), CWD, key=probe[1], now=now)
    levels = [
        (
            lv.name,
            lv.total_runs,
            sum(1 for r in recent(lv.runs, now) if r.ok and not r.oom),
        )
        for lv in learned.levels
    ]
    return (
        learned.estimate,
        learned.basis(),
        learned.run_time,
        learned.wait_time,
        learned.load_time,
        levels,
        learned.warnings,
    )


@pytest.fixture
def small_recent(monkeypatch: pytest.MonkeyPatch) -> None:
    # 200 whole records instead of 1,000, so that a history of a few thousand runs shows it all.
    monkeypatch.setattr(store, "KEEP_RECENT", 200)


def trigger(state: Path, max_bytes: int) -> None:
    """Append a run of an unrelated command at a size that compacts."""
    assert store.append_record(
        state, {"started_at": START, "exit_status": 0, "keys": {"x": "0" * 20}}, max_bytes
    )


@pytest.mark.usefixtures("small_recent")
def test_compacting_a_sweep_keeps_every_estimate(tmp_path: Path) -> None:
    probes, now = sweep_history(tmp_path, 3000)
    path = store.history_path(tmp_path)
    size = path.stat().st_size
    before = {p: figures(tmp_path, p, now) for p in probes}
    assert len(probes) > 150
    assert sum(1 for f in before.values() if f[0].bytes is not None) > 100

    trigger(tmp_path, max_bytes=size)
    assert path.stat().st_size <= size // 2
    records = [r for _, r in store.read_from(path).records]
    slim = [r for r in records if record.is_slim(r)]
    assert len(records) - len(slim) == 200 and len(slim) > 2000
    assert not any("command" in r or "cwd" in r or "gpus" in r for r in slim)
    after = {p: figures(tmp_path, p, now) for p in probes}
    changed = [p for p in probes if after[p] != before[p]]
    assert changed == []


@pytest.mark.usefixtures("small_recent")
def test_beyond_the_limit_runs_of_lines_run_once_go_first(tmp_path: Path) -> None:
    probes, now = sweep_history(tmp_path, 3000)
    before = {p: figures(tmp_path, p, now) for p in probes}
    parsed = store.read_from(store.history_path(tmp_path))
    full = store.compacted(parsed, 10**9)
    budget = sum(len(line) for line in full.lines) * 2 // 3
    planned = store.compacted(parsed, budget)
    assert planned.dropped_unprotected > 0 and planned.dropped_protected == 0
    trigger(tmp_path, max_bytes=2 * budget)

    assert store.history_path(tmp_path).stat().st_size <= budget
    kept, changed = 0, 0
    for probe in probes:
        after = figures(tmp_path, probe, now)
        if all(runs == 0 or runs >= MIN_RUNS for _, runs, _ in before[probe][5]):
            # Every level it uses had the runs to estimate from: their windows are all there.
            assert after == before[probe], probe
            kept += 1
        else:
            changed += after != before[probe]
    assert kept > 20 and changed > 0


@pytest.mark.usefixtures("small_recent")
def test_records_after_compaction_count_on_and_the_index_follows(tmp_path: Path) -> None:
    _, now = sweep_history(tmp_path, 1500)
    size = store.history_path(tmp_path).stat().st_size
    script = ("python", "exp0/train.py", "--bs", "8")
    before = learn(tmp_path, list(script), CWD, now=now)
    trigger(tmp_path, max_bytes=size)
    rng = random.Random(9)
    for i in range(3):
        store.append_record(tmp_path, run_record(rng, list(script), now + i))
    after = learn(tmp_path, list(script), CWD, now=now + 10)
    assert [lv.total_runs for lv in after.levels] == [lv.total_runs + 3 for lv in before.levels]
    assert after.warnings == ()
    # A second compaction, where the runs kept whole before become slim, carries the counts on.
    with store.history_lock(tmp_path):
        store.compact(tmp_path, 10**9)
    again = learn(tmp_path, list(script), CWD, now=now + 10)
    assert [lv.total_runs for lv in again.levels] == [lv.total_runs for lv in after.levels]
    assert again.estimate == after.estimate


def test_the_files_of_a_compaction_killed_halfway_go_with_the_next(tmp_path: Path) -> None:
    # Killed halfway, a compaction leaves the new history (up to half the size limit) and a
    # link that keeps the whole old one on disk, and an index write its bucket; by the next
    # compaction the pid in their names may be a live process's, which changes nothing.
    script = ["python", "exp0/train.py", "--bs", "8"]
    _, now = sweep_history(tmp_path, 300)
    learn(tmp_path, script, CWD, now=now)  # the index, built
    index = tmp_path / "history.index"
    with subprocess.Popen(["sleep", "60"]) as reused:
        try:
            left = [
                tmp_path / f".history.jsonl.{reused.pid}.tmp",
                tmp_path / f".history.jsonl.1.{reused.pid}.tmp",
                index / f".b3a.json.{reused.pid}.tmp",
            ]
            for path in left:
                path.write_bytes(b"x" * 4096)
            # Not the history's: written without its lock, perhaps at this very moment.
            idle = tmp_path / f".idle.json.{reused.pid}.tmp"
            idle.write_bytes(b"{")
            trigger(tmp_path, max_bytes=store.history_path(tmp_path).stat().st_size)
            learn(tmp_path, script, CWD, now=now)  # the index, rebuilt for the new history
        finally:
            reused.kill()
    assert [p.name for p in left if p.exists()] == []
    assert idle.exists()
    assert learn(tmp_path, script, CWD, now=now).warnings == ()


@pytest.mark.usefixtures("small_recent")
def test_history_lists_compacted_runs_only_with_all(
    isolated_dirs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = isolated_dirs / "state" / "gpuwait"
    sweep_history(state, 1000)
    trigger(state, max_bytes=store.history_path(state).stat().st_size)
    assert main(["history", "--json", "-n", "5000"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert len(shown) == 200 and not any(record.is_slim(r) for r in shown)
    assert main(["history", "--all"]) == 0
    table = capsys.readouterr().out
    assert "(compacted: kept for estimates only)" in table
    assert table.count("\n") > 800


finite = st.floats(min_value=0, max_value=1e12, allow_nan=False)
maybe = st.one_of(st.none(), finite, st.integers(-5, 2**40), st.booleans(), st.text(max_size=3))


@settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(
    st.fixed_dictionaries(
        {"started_at": st.one_of(finite, st.integers(0, 2**40))},
        optional={name: maybe for name in record._STAT_FIELDS if name != "started_at"}
        | {
            "command": st.just(["python", "x.py"]),
            "cwd": st.just(CWD),
            "gpus": st.lists(
                st.one_of(
                    st.fixed_dictionaries({"uuid": st.sampled_from(["GPU-a", "GPU-b"])}), maybe
                ),
                max_size=3,
            ),
            "peak_by_gpu": st.one_of(
                st.dictionaries(st.sampled_from(["GPU-a", "GPU-b"]), st.integers(0, 2**40)), maybe
            ),
        },
    )
)
def test_a_slim_record_reads_the_same_as_the_whole(whole: dict[str, Any]) -> None:
    assume(record.run_stat(whole) is not None)  # compaction never meets the others
    cut = record.slim(whole)
    stat = record.run_stat(whole)
    assert stat is not None
    # The GPU of a run on one is not kept: only per-GPU run times read it, from whole records.
    # A run on several keeps them, and what it held on all: a job on fewer GPUs counts that.
    if len(stat.gpu_uuids) > 1:
        assert record.run_stat(cut) == stat
    else:
        assert record.run_stat(cut) == stat._replace(gpu_uuids=(), held_bytes=None)
    assert record.record_keys(cut) == record.record_keys(whole)
    assert json.loads(record.encode_existing(cut)) == cut


def test_a_history_on_a_file_system_without_hard_links_is_compacted_all_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # FAT, many FUSE file systems: link(2) fails with EPERM. The old history is kept by a copy.
    sweep_history(tmp_path, 300)
    path = store.history_path(tmp_path)
    old = path.read_bytes()

    def no_links(*args: object, **kw: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(store.os, "link", no_links)
    trigger(tmp_path, max_bytes=len(old))
    assert path.stat().st_size < len(old)
    assert path.with_name("history.jsonl.1").read_bytes().startswith(old)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.usefixtures("small_recent")
def test_a_run_dated_while_the_clock_was_ahead_makes_compaction_forget_nothing(
    tmp_path: Path,
) -> None:
    # A script's runs of the last days, then more of other scripts than are kept whole, and one
    # run recorded while the date was set a year ahead.
    rng = random.Random(3)
    now = time.time()
    script = ["python", "a.py", "--bs", "8"]
    runs = [run_record(rng, script, now - 10 * DAY + i * 60) for i in range(60)]
    runs += [run_record(rng, ["python", f"b{i}.py"], now - DAY + i) for i in range(300)]
    runs.append(run_record(rng, ["python", "c.py"], now + 365 * DAY))
    path = store.history_path(tmp_path)
    path.write_bytes(b"".join(record.encode(r) for r in runs))
    before = learn(tmp_path, script, CWD, now=now)
    assert before.estimate.bytes is not None
    with store.history_lock(tmp_path):
        store.compact(tmp_path, 10**9)
    assert learn(tmp_path, script, CWD, now=now).estimate == before.estimate


def with_runs_of_other_scripts(state: Path, runs: list[dict[str, Any]], now: float) -> Path:
    """The history path, holding `runs` and then, in the day before `now`, more runs of other
    scripts than compaction keeps whole (with `small_recent`)."""
    rng = random.Random(4)
    runs = runs + [run_record(rng, ["python", f"b{i}.py"], now - DAY + i) for i in range(300)]
    path = store.history_path(state)
    path.write_bytes(b"".join(record.encode(r) for r in runs))
    return path


@pytest.mark.usefixtures("small_recent")
def test_runs_on_two_cards_size_a_run_on_one_alike_before_and_after_compaction(
    tmp_path: Path,
) -> None:
    # A model split over the two cards it was given, 20 GiB on each: a run on one card needs
    # the 40 GiB it held in all. Compacted to slim records (no GPUs, no peak per GPU), those
    # runs counted for 20 GiB: the next run on one card asked for 22 GiB, and ran out.
    now = time.time()
    cards = [H100, H100._replace(index=1, uuid="GPU-1b2c3d4e-0000-4000-8000-000000000001")]
    split = ["python", "serve.py", "--model", "big"]
    runs = [
        a_run(
            split,
            CWD,
            now - 5 * DAY + i * 60,
            gpus=cards,
            peak_by_gpu={g.uuid: 20 * GiB for g in cards},
        )
        for i in range(5)
    ]
    path = with_runs_of_other_scripts(tmp_path, runs, now)
    before = learn(tmp_path, split, CWD, now=now, gpus=1)
    assert before.estimate.bytes == 44 * GiB
    with store.history_lock(tmp_path):
        store.compact(tmp_path, 10**9)
    kept = [r for _, r in store.read_from(path).records if record.is_slim(r)]
    assert len(kept) >= 5
    assert learn(tmp_path, split, CWD, now=now, gpus=1).estimate == before.estimate
    assert learn(tmp_path, split, CWD, now=now, gpus=2).estimate.bytes == 22 * GiB


@pytest.mark.usefixtures("small_recent")
def test_an_out_of_memory_failure_asks_for_what_its_message_said_also_after_compaction(
    tmp_path: Path,
) -> None:
    # Its message said it needed 30 GiB (a model loaded in a moment, which no sample saw): the
    # next run asks for 34. Compacted to a slim record, the figure was gone: it asked for 1.5
    # times the 4 GiB seen, and ran out again.
    now = time.time()
    big = ["python", "load.py"]
    runs = [
        a_run(
            big,
            CWD,
            now - 2 * DAY,
            peak_by_gpu={H100.uuid: 4 * GiB},
            reserved_bytes=4 * GiB,
            returncode=1,
            oom=True,
            oom_evidence="message",
            oom_wanted_bytes=30 * GiB,
        )
    ]
    path = with_runs_of_other_scripts(tmp_path, runs, now)
    before = learn(tmp_path, big, CWD, now=now)
    assert before.estimate.bytes == 34 * GiB  # 30 GiB and the margin, rounded up
    with store.history_lock(tmp_path):
        store.compact(tmp_path, 10**9)
    assert record.is_slim(next(r for _, r in store.read_from(path).records))
    assert learn(tmp_path, big, CWD, now=now).estimate == before.estimate
