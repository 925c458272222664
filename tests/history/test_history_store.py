"""The history file and its index: damage, compaction, privacy, old records."""

from __future__ import annotations

import json
import os
import random
import re
import stat
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.history import a_run
from hypothesis import given
from hypothesis import strategies as st

from gpuwait.cli import main
from gpuwait.core.cmdkey import command_key, runs_other_code
from gpuwait.core.estimate import estimate, usable_levels
from gpuwait.history import index, store
from gpuwait.history import record as run_record
from gpuwait.history.learn import learn, save_record

GiB = 2**30
CWD = "/home/me/proj"
NOW = 1_700_000_000.0


def record(argv: list[str], gib: float, at: float, **extra: Any) -> dict[str, Any]:
    return {
        "job_id": "x",
        "command": argv,
        "cwd": CWD,
        "keys": command_key(argv, CWD).hashes(),
        "peak_bytes": int(gib * GiB),
        "reserved_bytes": 0,
        "started_at": at,
        "exit_status": 0,
        "signal": None,
        "oom": False,
        "run_seconds": 10.0,
        "wait_seconds": 0.5,
        **extra,
    }


def estimate_bytes(state: Path, argv: list[str]) -> int | None:
    return learn(state, argv, CWD, now=NOW).estimate.bytes


def naive_estimate(state: Path, argv: list[str]) -> int | None:
    """The same estimate from a full scan of the history, without the index."""
    parsed = store.read_from(store.history_path(state))
    key = command_key(argv, CWD)
    hashes = key.hashes()
    levels = []
    for name, _ in key.levels:
        runs = [
            s
            for _, r in parsed.records
            if hashes[name] in run_record.record_keys(r).values()
            and (s := run_record.run_stat(r)) is not None
        ]
        levels.append((name, runs[-index.KEEP_RUNS :]))
    program = key.text("program")
    usable = usable_levels(levels, NOW, program is None or runs_other_code(program))
    return estimate(usable, NOW).bytes


TRAIN = ["python", "train.py", "--epochs", "3"]


def test_estimate_from_appended_records(tmp_path: Path) -> None:
    for i in range(3):
        store.append_record(tmp_path, record(TRAIN, 3, NOW - 100 + i))
    assert estimate_bytes(tmp_path, TRAIN) == int(3.375 * GiB)
    # Another script of the same interpreter learns nothing from these runs.
    assert estimate_bytes(tmp_path, ["python", "other.py"]) is None
    assert estimate_bytes(tmp_path, ["bash", "x.sh"]) is None


@pytest.mark.parametrize(
    "argv",
    [["python"], ["python3", "-q"], ["python", "-"], ["bash"], ["bash", "-l"], ["ipython"]],
)
def test_code_typed_or_piped_in_is_never_sized_by_earlier_sessions(
    tmp_path: Path, argv: list[str]
) -> None:
    # `python` at a prompt (the shell hook wraps it): one session looked at a tensor (300 MiB),
    # the next loads a 10 GiB model. Sized by the first, the second would take its 10 GiB from
    # its neighbours. Such a command has no estimate (default_vram), unless --key names it.
    state = tmp_path
    for i in range(3):
        store.append_record(state, record(argv, 0.3, NOW - 10 + i))
    learned = learn(state, argv, CWD, now=NOW)
    assert learned.estimate.bytes is None and "typed" in learned.basis()
    keyed = {**record(argv, 0.3, NOW - 1), "keys": {"key": run_record.key_hash("key", "repl")}}
    for i in range(3):
        store.append_record(state, {**keyed, "started_at": NOW - 5 + i})
    assert learn(state, argv, CWD, key="repl", now=NOW).estimate.bytes == 384 * 2**20


def test_files_are_private(tmp_path: Path) -> None:
    state = tmp_path / "state"
    store.append_record(state, record(TRAIN, 3, NOW))
    learn(state, TRAIN, CWD, now=NOW)
    files = [state / "history.jsonl", *(state / "history.index").iterdir()]
    assert len(files) > 2
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE(state.stat().st_mode) == 0o700


def test_a_damaged_line_is_skipped_and_reported_once(tmp_path: Path) -> None:
    path = store.history_path(tmp_path)
    store.append_record(tmp_path, record(TRAIN, 3, NOW - 3))
    with path.open("ab") as f:
        f.write(b'{"schema": 2, "command": ["python", "tr\n')  # cut off mid-write
        f.write(b"\x00\xff garbage\n")
    store.append_record(tmp_path, record(TRAIN, 3, NOW - 2))
    store.append_record(tmp_path, record(TRAIN, 3, NOW - 1))
    first = learn(tmp_path, TRAIN, CWD, now=NOW)
    assert first.estimate.runs == 3
    assert len(first.warnings) == 1 and "skipped 2 damaged line(s)" in first.warnings[0]
    # The index took those bytes in once; the next lookups do not complain again.
    assert learn(tmp_path, TRAIN, CWD, now=NOW).warnings == ()


@pytest.mark.parametrize(
    "figures",
    [
        {"peak_bytes": 1e300},
        {"peak_bytes": 2**70},
        {"reserved_bytes": 1e300, "oom": True, "exit_status": 1},
        {"run_seconds": 1e300},
    ],
    ids=["peak", "huge-peak", "reservation", "run-time"],
)
def test_a_record_with_an_impossible_figure_is_damaged_not_learned(
    tmp_path: Path, figures: dict[str, Any]
) -> None:
    # A line edited by hand or damaged on disk says a run peaked at 10^300 bytes: it would make
    # every launch of the command ask for the largest card, and `estimate` print a 290-digit
    # size. It is a damaged line, skipped and reported, as any other.
    for i in range(3):
        store.append_record(tmp_path, record(TRAIN, 3, NOW - 10 + i))
    store.append_record(tmp_path, record(TRAIN, 3, NOW - 1, **figures))
    learned = learn(tmp_path, TRAIN, CWD, now=NOW)
    assert learned.estimate.bytes == int(3.375 * GiB)
    assert learned.run_time is not None and learned.run_time.high == 10.0
    assert len(learned.warnings) == 1 and "skipped 1 damaged line(s)" in learned.warnings[0]


def test_an_impossible_figure_the_index_took_in_before_is_not_learned(tmp_path: Path) -> None:
    # An index written while such figures were still read as real ones holds 10^300 bytes for
    # a run: it is taken for damaged and built again from the history.
    for i in range(3):
        store.append_record(tmp_path, record(TRAIN, 3, NOW - 10 + i))
    store.append_record(tmp_path, record(TRAIN, 3, NOW - 1))
    learn(tmp_path, TRAIN, CWD, now=NOW)
    for bucket in (tmp_path / index.DIRNAME).glob("b*.json"):
        entries = json.loads(bucket.read_text())
        for entry in entries.values():
            entry["runs"][-1][2] = 1e300
        bucket.write_text(json.dumps(entries))
    learned = learn(tmp_path, TRAIN, CWD, now=NOW)
    assert learned.estimate.bytes == int(3.375 * GiB)


def test_a_line_left_without_newline_does_not_swallow_the_next_record(tmp_path: Path) -> None:
    path = store.history_path(tmp_path)
    store.append_record(tmp_path, record(TRAIN, 3, NOW - 3))
    with path.open("ab") as f:
        f.write(b'{"schema": 2, "half')
    store.append_record(tmp_path, record(TRAIN, 3, NOW - 2))
    parsed = store.read_from(path)
    assert len(parsed.records) == 2 and parsed.damage.lines == 1


def test_index_follows_appends_and_matches_a_full_scan(tmp_path: Path) -> None:
    rng = random.Random(7)
    commands = [["python", f"s{i}.py", "--bs", str(b)] for i in range(4) for b in (8, 16)]
    for step in range(300):
        argv = rng.choice(commands)
        ok = rng.random() > 0.1
        store.append_record(
            tmp_path,
            record(argv, rng.uniform(1, 20), NOW - 10_000 + step, exit_status=0 if ok else 1),
        )
        if step % 37 == 0:
            learn(tmp_path, argv, CWD, now=NOW)  # take in part of the file now, the rest later
    for argv in [*commands, ["python", "new.py"]]:
        assert estimate_bytes(tmp_path, argv) == naive_estimate(tmp_path, argv)


def test_missing_or_damaged_index_is_rebuilt(tmp_path: Path) -> None:
    for i in range(5):
        store.append_record(tmp_path, record(TRAIN, 4, NOW - i))
    expected = estimate_bytes(tmp_path, TRAIN)
    directory = index.index_dir(tmp_path)
    for bucket in directory.glob("b*.json"):
        bucket.write_text('{"oops": ')
    again = learn(tmp_path, TRAIN, CWD, now=NOW)
    assert again.estimate.bytes == expected
    assert any("history index" in w for w in again.warnings)
    for child in directory.iterdir():
        child.unlink()
    directory.rmdir()
    assert estimate_bytes(tmp_path, TRAIN) == expected
    (directory / index.META).write_text("not json")
    assert estimate_bytes(tmp_path, TRAIN) == expected


def test_an_older_gpuwaits_index_beside_this_ones_costs_neither_a_rebuild(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two environments with two versions of gpuwait, used in turn: each wrote its own schema in
    # the same meta.json, so each launch after the other's rebuilt the whole index (seconds on
    # a long history, the history lock held, other launches meanwhile without estimates).
    for i in range(5):
        store.append_record(tmp_path, record(TRAIN, 4, NOW - i))
    expected = estimate_bytes(tmp_path, TRAIN)
    directory = index.index_dir(tmp_path)
    history = store.history_path(tmp_path).stat()
    older = {"schema": 3, "dev": history.st_dev, "ino": history.st_ino}
    # What the older one writes after taking in the same history: its meta and its buckets.
    (directory / "meta.json").write_text(json.dumps({**older, "offset": history.st_size}))
    (directory / "b00.json").write_text("{}")
    rebuilds: list[Path] = []
    real = index._rebuild
    monkeypatch.setattr(index, "_rebuild", lambda d, p: (rebuilds.append(d), real(d, p)))
    save_record(tmp_path, record(TRAIN, 4, NOW + 1), max_bytes=2**30)
    assert estimate_bytes(tmp_path, TRAIN) == expected
    assert rebuilds == []
    # The older one's files are left to it while they describe the history as it is...
    assert {"meta.json", "b00.json"} <= {p.name for p in directory.iterdir()}
    # ...and go once they describe one a compaction replaced, which it rebuilds anyway.
    (directory / "meta.json").write_text(json.dumps({**older, "ino": 1, "offset": 10}))
    (directory / index.META).unlink()
    assert estimate_bytes(tmp_path, TRAIN) == expected
    assert rebuilds == [directory]
    assert not {"meta.json", "b00.json"} & {p.name for p in directory.iterdir()}


def an_index(state: Path) -> Path:
    """The index of a history of one run of TRAIN, built; its directory."""
    store.append_record(state, record(TRAIN, 4, NOW))
    learn(state, TRAIN, CWD, now=NOW)
    return index.index_dir(state)


class _Killed(BaseException):
    """A gpuwait killed (kill -9) at that point: nothing after it runs."""


def test_the_files_of_index_writes_killed_halfway_do_not_pile_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each gpuwait killed while it wrote the index leaves a file named for its pid; the next
    # record's index update, under the same lock, takes them away, not only a compaction.
    directory = an_index(tmp_path)
    left = [directory / f".b{n:03x}.json.{4_000_000 + n}.tmp" for n in range(20)]
    left.append(directory / f".{index.META}.4000100.tmp")
    real = os.replace

    def killed_halfway(source: Any, target: Any) -> None:
        # Each of these writers is killed with its file written, before it takes its place.
        for path in left:
            path.write_bytes(b'{"half a bucket')
        raise _Killed

    for n in range(3):
        monkeypatch.setattr(os, "replace", killed_halfway)
        with pytest.raises(_Killed):
            save_record(tmp_path, record(TRAIN, 5 + n, NOW + 1 + n), max_bytes=2**30)
        monkeypatch.setattr(os, "replace", real)
    save_record(tmp_path, record(TRAIN, 8, NOW + 4), max_bytes=2**30)
    assert [p.name for p in directory.iterdir() if p.name.endswith(".tmp")] == []
    assert estimate_bytes(tmp_path, TRAIN) == naive_estimate(tmp_path, TRAIN)


def test_an_index_update_after_a_run_does_not_list_a_year_of_buckets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A year of one-off lines fills all 4,096 buckets: listing them after every run, to find
    # the files of a writer killed halfway where there were none, took longer than the update.
    directory = an_index(tmp_path)
    listed: list[str] = []
    real = os.listdir

    def listdir(path: Any = ".") -> list[str]:
        listed.append(str(path))
        return real(path)

    monkeypatch.setattr(os, "listdir", listdir)
    for n in range(3):
        save_record(tmp_path, record(TRAIN, 5 + n, NOW + 1 + n), max_bytes=2**30)
        assert estimate_bytes(tmp_path, TRAIN) == naive_estimate(tmp_path, TRAIN)
    assert str(directory) not in listed


def test_compaction_keeps_what_estimates_use(tmp_path: Path) -> None:
    rng = random.Random(3)
    commands = [["python", f"s{i}.py", "--seed", str(seed)] for i in range(5) for seed in range(3)]
    at = NOW - 50 * 86400
    for _ in range(2500):
        at += 1500
        store.append_record(tmp_path, record(rng.choice(commands), rng.uniform(1, 30), at))
    probes = [*commands, ["python", "s0.py"], ["python", "fresh.py"]]
    before = {tuple(c): estimate_bytes(tmp_path, c) for c in probes}
    path = store.history_path(tmp_path)
    size = path.stat().st_size
    assert not store.append_record(tmp_path, record(["true"], 0, at + 1), max_bytes=size * 2)
    assert store.append_record(tmp_path, record(["true"], 0, at + 1), max_bytes=size // 2)
    assert path.stat().st_size < size // 4
    assert (tmp_path / "history.jsonl.1").stat().st_size > size
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    after = {tuple(c): estimate_bytes(tmp_path, c) for c in probes}
    assert after == before


def test_records_from_before_keys_existed_are_used(tmp_path: Path) -> None:
    path = store.history_path(tmp_path)
    lines = []
    for i in range(3):
        old = record(TRAIN, 5, NOW - i)
        del old["keys"]
        lines.append(json.dumps({"schema": 1, **old}) + "\n")
    path.write_text("".join(lines))
    os.chmod(path, 0o600)
    assert estimate_bytes(tmp_path, TRAIN) == int(5.5 * GiB)


def test_tail_reads_the_last_records(tmp_path: Path) -> None:
    for i in range(500):
        store.append_record(tmp_path, record(TRAIN, 1, NOW + i, job_id=str(i)))
    path = store.history_path(tmp_path)
    everything = path.stat().st_size
    assert [r["job_id"] for _, r in store.tail(path, 3, everything).records] == [
        "497",
        "498",
        "499",
    ]
    assert len(store.tail(path, 1000, everything).records) == 500
    # Never more than the last `limit` bytes, however many lines are asked for.
    line = everything // 500
    assert [r["job_id"] for _, r in store.tail(path, 1000, 10 * line).records][-2:] == [
        "498",
        "499",
    ]
    assert 8 <= len(store.tail(path, 1000, 10 * line).records) <= 10
    assert store.tail(tmp_path / "none", 3, everything).records == []


@pytest.mark.parametrize("argv", [TRAIN, ["python", "-m", "pkg"], ["sh", "-c", "secret=hunter2"]])
def test_hash_mode_estimates_the_same(tmp_path: Path, argv: list[str]) -> None:
    full_dir, hash_dir = tmp_path / "full", tmp_path / "hash"
    for state, mode in ((full_dir, "full"), (hash_dir, "hash")):
        for i in range(3):
            rec = a_run(argv, CWD, NOW - i, history_commands=mode, peak_by_gpu={"GPU-0": 2 * GiB})
            store.append_record(state, rec)
    assert estimate_bytes(full_dir, argv) == estimate_bytes(hash_dir, argv) is not None
    text = store.history_path(hash_dir).read_text()
    assert CWD + "/train" not in text and "hunter2" not in text and '"command":null' in text


def test_hash_mode_keeps_a_program_named_by_its_path_as_its_name_alone(tmp_path: Path) -> None:
    # The program's name is what hash mode keeps of it, not the directory it was run from.
    argv = ["/opt/acme-unreleased/bin/train", "--fast"]
    store.append_record(tmp_path, a_run(argv, CWD, NOW, history_commands="hash"))
    text = store.history_path(tmp_path).read_text()
    assert "acme-unreleased" not in text and json.loads(text)["program"] == "train", text


def test_an_unusable_state_dir_means_no_estimate_not_a_failure(tmp_path: Path) -> None:
    for i in range(3):
        store.append_record(tmp_path, record(TRAIN, 3, NOW - i))
    (tmp_path / "history.index").mkdir(exist_ok=True)
    (tmp_path / "history.lock").unlink()
    (tmp_path / "history.lock").mkdir()  # the lock cannot be opened
    learned = learn(tmp_path, TRAIN, CWD, now=NOW)
    assert learned.estimate.bytes is None
    assert len(learned.warnings) == 1 and "cannot be used" in learned.warnings[0]


def test_a_history_written_over_in_place_is_read_again_whole(tmp_path: Path) -> None:
    # `cp history.jsonl.1 history.jsonl` (an older history restored) keeps the file's inode:
    # the index took the restored file for the one it had read, took it in from the middle of
    # a line ("skipped 1 damaged line"), and never learned the runs before that point.
    for i in range(3):
        save_record(tmp_path, record(TRAIN, 3, NOW - 10 + i), store.DEFAULT_HISTORY_MAX_BYTES)
    path = store.history_path(tmp_path)
    inode = path.stat().st_ino
    other = ["python", "infer.py"]
    restored = [record(other, 5, NOW - 20 + i, job_id=f"r{i}") for i in range(3)]
    restored += [record(TRAIN, 3, NOW - 10 + i, job_id=f"t{i}") for i in range(3)]
    with path.open("r+b") as file:  # written over, as cp does
        file.write(b"".join(run_record.encode(r) for r in restored))
    assert path.stat().st_ino == inode
    learned = learn(tmp_path, other, CWD, now=NOW)
    assert learned.warnings == ()
    assert learned.estimate.runs == 3 and learned.estimate.bytes == naive_estimate(tmp_path, other)


def test_an_index_that_cannot_be_written_still_sizes_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The disk (or the user's quota) filled up after the last record went in: the index could
    # not take it in, and every launch asked for a whole GPU (default_vram), its three earlier
    # runs in the index left unread, "going on without what earlier runs used".
    for i in range(3):
        save_record(tmp_path, record(TRAIN, 3, NOW - 10 + i), store.DEFAULT_HISTORY_MAX_BYTES)
    sized = learn(tmp_path, TRAIN, CWD, now=NOW).estimate.bytes
    assert sized is not None
    store.append_record(tmp_path, record(TRAIN, 3, NOW - 1))

    def disk_full(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(index, "_write_cache", disk_full)
    learned = learn(tmp_path, TRAIN, CWD, now=NOW)
    assert learned.estimate.bytes == sized and learned.estimate.runs == 3
    (warning,) = learned.warnings
    assert "No space left on device" in warning and "without the newest runs" in warning


def test_a_run_recorded_whose_index_cannot_be_written_is_said_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The record went in, the index did not: the run said "could not record the run in the
    # history", which `gpuwait history` then listed.
    save_record(tmp_path, record(TRAIN, 3, NOW - 1), store.DEFAULT_HISTORY_MAX_BYTES)

    def disk_full(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(index, "_write_cache", disk_full)
    (warning,) = save_record(tmp_path, record(TRAIN, 3, NOW), store.DEFAULT_HISTORY_MAX_BYTES)
    assert "the run is recorded" in warning and "No space left on device" in warning
    assert len(store.read_from(store.history_path(tmp_path)).records) == 2


# --- a damaged history costs a bounded read ------------------------------------------------------


def _parse_line_by_line(data: bytes, base: int) -> tuple[list[int], int, int | None, int]:
    """What parse_lines must find, the plain way: each whole line decoded on its own."""
    end = data.rfind(b"\n") + 1
    offsets: list[int] = []
    damaged, first = 0, None
    position = 0
    while position < end:
        newline = data.index(b"\n", position)
        line = data[position:newline]
        if line.strip():
            if store._decode(line) is None:
                damaged += 1
                first = base + position if first is None else first
            else:
                offsets.append(base + position)
        position = newline + 1
    return offsets, damaged, first, base + end


_LINES = st.sampled_from(
    [
        store.encode(record(TRAIN, 3, NOW)).decode().strip(),
        "  " + store.encode(record(["python", "b.py"], 1, NOW)).decode().strip(),
        store.encode(record(TRAIN, 3, NOW)).decode()[:40],  # cut short
        '{"schema": 1}',  # an object, not a record
        "[1, 2]",
        "y",
        "",
        "   ",
        "\t\r",
        "\x0b{}",
        "{" * 50,
        "\x00\x00",
    ]
)


@given(
    lines=st.lists(_LINES, max_size=30),
    ending=st.sampled_from(["", "\n", "\n\n", "tail without newline"]),
    base=st.integers(0, 10**9),
)
def test_parse_lines_finds_what_a_line_by_line_parse_finds(
    lines: list[str], ending: str, base: int
) -> None:
    data = ("\n".join(lines) + ending).encode()
    parsed = store.parse_lines(data, base)
    offsets, damaged, first, end = _parse_line_by_line(data, base)
    if ending == "\n":  # every line whole: every record among them is found
        whole = [line for line in lines if line.rstrip().endswith("}") and "job_id" in line]
        assert len(offsets) == len(whole)
    assert [offset for offset, _ in parsed.records] == offsets
    assert (parsed.damage.lines, parsed.damage.first_offset, parsed.end) == (damaged, first, end)


def test_junk_longer_than_any_record_is_passed_over_without_a_newline() -> None:
    good = store.encode(record(TRAIN, 3, NOW))
    junk = b"x" * (store.MAX_LINE + 1)
    parsed = store.parse_lines(good + junk)
    assert len(parsed.records) == 1 and parsed.end == len(good) + len(junk)
    assert (parsed.damage.lines, parsed.damage.first_offset) == (1, len(good))
    # A record still being written is read next time.
    parsed = store.parse_lines(good + good[:-10])
    assert len(parsed.records) == 1 and parsed.end == len(good)


def test_a_history_far_over_its_limit_is_read_only_to_its_limit_then_recovered(
    tmp_path: Path,
) -> None:
    # Junk at the start, a few runs at the end, and a size limit far below the file's size.
    limit = 1 << 20
    path = store.history_path(tmp_path)
    path.write_bytes(b"y\n" * (8 * limit))
    os.chmod(path, 0o600)
    for i in range(5):
        store.append_record(tmp_path, record(TRAIN, 3, NOW - 100 + i))
    size = path.stat().st_size
    learned = learn(tmp_path, TRAIN, CWD, now=NOW, max_bytes=limit)
    assert learned.estimate.bytes is not None and learned.levels[0].total_runs == 5
    # Read: the newest 2 × limit bytes, never the rest (the warning says how much was not).
    (warning,) = learned.warnings
    assert f"left its first {(size - 2 * limit) / 2**20:.1f} MiB unread" in warning
    skipped = int(re.search(r"skipped (\d+) damaged line", warning).group(1))  # type: ignore[union-attr]
    assert limit - 4096 < skipped < limit  # the junk lines in the part read, 2 bytes each
    assert json.loads((index.index_dir(tmp_path) / index.META).read_text())["offset"] == size
    # The next run's record compacts the file: the junk goes, the runs stay, and the old file
    # is kept whole as evidence.
    compaction = store.append_record(tmp_path, record(TRAIN, 3, NOW), max_bytes=limit)
    assert compaction is not None and compaction.kept_as is not None
    assert compaction.kept_as.startswith("history.jsonl.damaged-")
    assert (tmp_path / compaction.kept_as).stat().st_size == size + len(
        store.encode(record(TRAIN, 3, NOW))
    )
    assert len(store.read_from(path).records) == 6 and path.stat().st_size < limit
    assert learn(tmp_path, TRAIN, CWD, now=NOW, max_bytes=limit).warnings == ()


def test_a_launch_reads_as_little_of_a_year_old_index_as_of_a_young_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A year of sweeps leaves tens of thousands of one-off lines (a seed, a date, a temp path
    each) in the index; the look-up of a launch, and the index update after its run, must not
    read theirs along with its own command's (docs/learning.md: "a few kilobytes whatever the
    history's size")."""
    frequent = ["python", "infer.py"]
    own = b"".join(store.encode(record(frequent, 4, NOW - 3600 + i)) for i in range(40))
    # As compaction keeps them: slim records.
    sweeps = b"".join(
        run_record.encode_existing(
            run_record.slim(
                {"schema": 2, **record(["python", "sweep.py", "--seed", str(n)], 2, NOW - n)}
            )
        )
        for n in range(10_000)
    )
    read: list[int] = []
    real = index.read_state_file

    def counted(*args: Any, **kwargs: Any) -> bytes | None:
        data = real(*args, **kwargs)
        read.append(len(data or b""))
        return data

    def launch_reads(state: Path, history: bytes) -> int:
        state.mkdir(mode=0o700)
        store.history_path(state).write_bytes(history)
        store.history_path(state).chmod(0o600)
        learn(state, frequent, CWD, now=NOW)  # the index, built once
        read.clear()
        with monkeypatch.context() as patch:
            patch.setattr(index, "read_state_file", counted)
            assert learn(state, frequent, CWD, now=NOW).estimate.level == "command"
            assert learn(state, ["python", "new.py"], CWD, now=NOW).estimate.bytes is None
            save_record(state, record(frequent, 4, NOW), 64 << 20)
        return sum(read)

    young = launch_reads(tmp_path / "young", own)
    old = launch_reads(tmp_path / "old", sweeps + own)
    assert old < 1.5 * young, (old, young)


def test_the_runs_of_one_script_show_as_fast_from_a_long_history_as_from_a_short_one(
    isolated_dirs: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`gpuwait history -- python eval.py` in a history that a year of other runs filled
    (12 MiB of them here; a history compacts at 64 MiB): not a second of reading every run."""
    state = isolated_dirs / "state" / "gpuwait"
    state.mkdir(mode=0o700)
    monkeypatch.chdir(CWD if os.path.isdir(CWD) else "/")
    cwd = os.getcwd()
    sweep = a_run(["python", "sweep.py", "--seed", "1"], cwd, NOW, peak_by_gpu={"GPU-0": GiB})
    own = [a_run(["python", "eval.py", "--day", str(d)], cwd, NOW + d) for d in range(3)]
    mine = b"".join(store.encode(r) for r in own)
    path = store.history_path(state)

    def shown() -> tuple[list[str], float]:
        started = time.thread_time()
        assert main(["history", "--", "python", "eval.py"]) == 0
        took = time.thread_time() - started
        return [ln for ln in capsys.readouterr().out.splitlines() if "eval.py --day" in ln], took

    path.write_bytes(mine)
    path.chmod(0o600)
    rows, took_short = shown()
    assert len(rows) == 3
    line = store.encode(sweep)
    path.write_bytes(line * (12 * 2**20 // len(line)) + mine)
    rows, took_long = shown()
    assert len(rows) == 3
    # Against reading every run, timed in the same process (a bound in seconds alone fails on
    # a loaded machine), in CPU time (a wall-clock time counts whatever else the machine ran
    # meanwhile): looking the script's runs up takes a small part of it.
    started = time.thread_time()
    assert len(store.parse_lines(path.read_bytes()).records) > 3
    every_run = time.thread_time() - started
    assert took_long - took_short < every_run / 3, (took_long, took_short, every_run)
