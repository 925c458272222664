"""The optional NVML accounting hook: the better peak where accounting mode is on."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pynvml  # type: ignore[import-untyped]
import pytest
from helpers.fixtures_nvml import GIB, FakeGpu, FakeNvml

from gpuwait.gpu.nvml import NvmlBackend


@pytest.fixture
def backend(fake_nvml: FakeNvml) -> Iterator[NvmlBackend]:
    fake_nvml.set_gpus([FakeGpu(uuid="GPU-aaaa", total=80 * GIB)])
    b = NvmlBackend()
    yield b
    b.close()


def test_without_accounting_support_there_is_no_figure(backend: NvmlBackend) -> None:
    # The fake driver has no accounting functions, like a driver or GPU without support.
    assert backend.accounting_peak("GPU-aaaa", frozenset({100})) is None
    assert backend.accounting_peak("GPU-none", frozenset({100})) is None


def fake_accounting(
    monkeypatch: pytest.MonkeyPatch,
    enabled: bool,
    maxima: dict[int, int | None],
    started: dict[int, float] | None = None,
) -> None:
    """Accounting as the driver keeps it: per pid its maximum and (`started`, wall-clock
    seconds; default now) when it started."""
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByUUID", lambda uuid: "handle")
    monkeypatch.setattr(
        pynvml,
        "nvmlDeviceGetAccountingMode",
        lambda h: pynvml.NVML_FEATURE_ENABLED if enabled else pynvml.NVML_FEATURE_DISABLED,
    )
    monkeypatch.setattr(pynvml, "nvmlDeviceGetAccountingPids", lambda h: list(maxima))
    now = time.time()
    monkeypatch.setattr(
        pynvml,
        "nvmlDeviceGetAccountingStats",
        lambda h, pid: SimpleNamespace(
            maxMemoryUsage=maxima[pid],
            startTime=int((started or {}).get(pid, now) * 1e6),  # microseconds, as NVML's
        ),
    )


def test_accounting_maximum_of_the_tree(
    backend: NvmlBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_accounting(monkeypatch, True, {100: 6 * GIB, 101: GIB, 999: 40 * GIB, 102: 2**64 - 1})
    assert backend.accounting_peak("GPU-aaaa", frozenset({100, 101, 102})) == 7 * GIB
    assert backend.accounting_peak("GPU-aaaa", frozenset({5})) is None


def test_a_process_whose_maximum_is_not_available_leaves_the_others_figure(
    backend: NvmlBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    # pynvml answers "not available" with None: the whole figure was lost for one such pid,
    # and the run's history fell back to the sampled peak, which misses short spikes.
    fake_accounting(monkeypatch, True, {100: 6 * GIB, 101: None})
    assert backend.accounting_peak("GPU-aaaa", frozenset({100, 101})) == 6 * GIB
    assert backend.accounting_peak("GPU-aaaa", frozenset({101})) is None


def test_an_earlier_process_of_the_same_pid_is_no_part_of_the_figure(
    backend: NvmlBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The driver keeps the stats of ended processes (a circular buffer of thousands) and, for
    # a pid used twice, answers with the last one's. A process of the command's tree that never
    # used the GPU (its shell), whose pid an earlier 70 GiB job had had, lent the run that
    # job's peak: the history said 70 GiB of a 6 GiB command, and its next run without --vram
    # waited for 70 GiB.
    started = time.time()
    fake_accounting(
        monkeypatch, True, {100: 6 * GIB, 101: 70 * GIB}, {100: started + 1, 101: started - 3600}
    )
    assert backend.accounting_peak("GPU-aaaa", frozenset({100, 101}), since=started) == 6 * GIB
    assert backend.accounting_peak("GPU-aaaa", frozenset({101}), since=started) is None


def test_accounting_off_or_failing_gives_no_figure(
    backend: NvmlBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_accounting(monkeypatch, False, {100: 6 * GIB})
    assert backend.accounting_peak("GPU-aaaa", frozenset({100})) is None

    def refuse(handle: object, pid: int) -> object:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)

    fake_accounting(monkeypatch, True, {100: 6 * GIB})
    monkeypatch.setattr(pynvml, "nvmlDeviceGetAccountingStats", refuse)
    assert backend.accounting_peak("GPU-aaaa", frozenset({100})) is None


def test_the_run_record_prefers_accounting_then_per_process_then_growth() -> None:
    from gpuwait.runner.supervise import RunResult

    result = RunResult(
        returncode=0,
        peak_bytes={"A": 5 * GIB, "B": 0},
        attributed={"A"},
        growth_bytes={"B": 3 * GIB, "C": GIB},
        accounting_bytes={"A": 6 * GIB},
    )
    assert result.peaks() == ({"A": 6 * GIB, "B": 3 * GIB, "C": GIB}, True)
    exact = RunResult(returncode=0, peak_bytes={"A": 5 * GIB}, attributed={"A"})
    assert exact.peaks() == ({"A": 5 * GIB}, False)
    assert RunResult(returncode=0).peaks() == ({}, False)  # nothing known: the peak is unknown


def test_a_hung_accounting_call_does_not_hold_up_the_end_of_a_run(fake_nvml: FakeNvml) -> None:
    # Read once the command has ended, before its exit status is passed on: a wedged driver
    # (a GPU fallen off the bus, which may be why the command ended) held gpuwait for as long
    # as the call hung, for ever with nvml_timeout set to 0.3 s.
    fake_nvml.set_gpus([FakeGpu(uuid="GPU-aaaa"), FakeGpu(uuid="GPU-bbbb")])
    backend = NvmlBackend(timeout=0.3)
    try:
        fake_nvml.hang(None, "nvmlDeviceGetHandleByUUID", 5)
        started = time.monotonic()
        assert backend.accounting_peak("GPU-aaaa", frozenset({os.getpid()})) is None
        # The job's next GPU does not cost the deadline again.
        assert backend.accounting_peak("GPU-bbbb", frozenset({os.getpid()})) is None
        assert time.monotonic() - started < 1.5
    finally:
        fake_nvml.clear_failures()
        backend.close()
