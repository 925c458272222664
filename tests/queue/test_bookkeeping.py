"""The ledger's record of finished jobs, per-GPU counters, GPU health and batches."""

from __future__ import annotations

import json
import os
from pathlib import Path

from helpers.jobs import live_job

from gpuwait.core.snapshot import GpuSnapshot, MachineSnapshot
from gpuwait.queue import entries
from gpuwait.queue.bookkeeping import CANCELLED, FAILED, FINISHED_KEPT, OK, Book, Finished
from gpuwait.queue.ledger import Ledger


def machine(
    *uuids: str, warnings: tuple[str, ...] = (), index: dict[str, int] | None = None
) -> MachineSnapshot:
    """A reading of these GPUs (numbered by their names' last digit, or by `index`); each
    warning ("GPU 1: ...") says that GPU did not answer."""
    number = index or {}
    gpus = tuple(
        GpuSnapshot(number.get(u, int(u[-1])), u, "Test GPU", 2**34, 0) for u in sorted(uuids)
    )
    unanswered = tuple(int(w.split(":")[0].split()[1]) for w in warnings)
    return MachineSnapshot("sim", gpus, warnings, unanswered)


def test_counters_and_moving_throughput() -> None:
    book = Book()
    book.note_admitted(["GPU-0", "GPU-1"])
    for n in range(6):
        outcome = OK if n != 2 else FAILED
        book.note_finished(Finished(f"j{n}", outcome, 1000.0 + 60 * n), ["GPU-0"])
    counters = book.gpus["GPU-0"]
    assert (counters.dispatched, counters.completed, counters.failed) == (1, 5, 1)
    # Six ends a minute apart: five intervals in five minutes, 60 jobs an hour.
    assert counters.per_hour() == 60.0
    assert book.gpus["GPU-1"].per_hour() is None


def test_finished_list_is_bounded_and_keeps_the_latest() -> None:
    book = Book()
    for n in range(FINISHED_KEPT + 50):
        book.note_finished(Finished(f"j{n}", OK, 1000.0 + n))
    assert len(book.finished) == FINISHED_KEPT
    assert book.outcome(f"j{FINISHED_KEPT + 49}") is not None
    assert book.outcome("j0") is None


def test_batches_count_outcomes() -> None:
    book = Book()
    for n, outcome in enumerate([OK, OK, FAILED, CANCELLED]):
        book.note_finished(Finished(f"j{n}", outcome, 1000.0 + n, batch="sweep"))
    counts = book.batches["sweep"]
    assert (counts.done, counts.failed, counts.cancelled) == (2, 1, 1)


def test_health_lost_back_and_added() -> None:
    book = Book()
    assert book.note_health(machine("GPU-0", "GPU-1"), frozenset(), 100.0) == []
    lost = book.note_health(
        machine("GPU-0", warnings=("GPU 1: GPU is lost (NVML error 15); skipped",)),
        frozenset(),
        101.0,
    )
    assert lost == [
        {"kind": "gpu_lost", "gpu": "GPU-1", "index": 1, "detail": "GPU is lost (NVML error 15)"}
    ]
    assert list(book.lost_gpus()) == ["GPU-1"]
    assert book.note_health(machine("GPU-0"), frozenset(), 102.0) == []
    back = book.note_health(machine("GPU-0", "GPU-1", "GPU-2"), frozenset(), 103.0)
    assert back == [
        {"kind": "gpu_back", "gpu": "GPU-1", "index": 1},
        {"kind": "gpu_added", "gpu": "GPU-2", "index": 2},
    ]
    assert not book.health_would_change(machine("GPU-0", "GPU-1", "GPU-2"), frozenset(), 104.0)
    assert book.health_would_change(
        machine("GPU-0", warnings=("GPU 1: GPU is lost (NVML error 15); skipped",)),
        frozenset(),
        104.0,
    )


def test_a_reading_of_fewer_gpus_loses_and_renumbers_none() -> None:
    # A container given the machine's third card (its GPU 0) shares the ledger with the host:
    # its readings made the host's other cards lost, then back at the host's next reading,
    # and numbered the third card 0 and 2 by turns.
    book = Book()
    book.note_health(machine("GPU-0", "GPU-1", "GPU-2"), frozenset(), 100.0)
    in_container = machine("GPU-2", index={"GPU-2": 0})
    assert not book.health_would_change(in_container, frozenset(), 101.0)
    assert book.note_health(in_container, frozenset(), 101.0) == []
    assert book.lost_gpus() == {}
    assert {u: h.index for u, h in book.health.items()} == {"GPU-0": 0, "GPU-1": 1, "GPU-2": 2}


def test_book_round_trips_through_json() -> None:
    book = Book()
    book.note_admitted(["GPU-0"])
    book.note_finished(Finished("j", FAILED, 1000.0, name="n", batch="b", exit_status=3), ["GPU-0"])
    book.note_health(machine("GPU-0"), frozenset(), 100.0)
    again = entries.book_from_json(json.loads(json.dumps(entries.book_to_json(book))))
    assert again == book


def test_damaged_book_is_started_afresh_without_losing_the_queue(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    me = os.getpid()
    with ledger.transaction() as data:
        data.jobs.append(live_job("live", me))
        data.book.note_finished(Finished("old", OK, 1000.0))
    raw = json.loads((tmp_path / "ledger.json").read_text())
    raw["book"]["finished"] = [{"id": 7}]
    (tmp_path / "ledger.json").write_text(json.dumps(raw))
    with ledger.transaction() as data:
        assert [j.id for j in data.jobs] == ["live"]
        assert data.book.finished == []
    assert any("started it afresh" in w for w in ledger.warnings)
