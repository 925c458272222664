"""How GPUs in MIG mode are named, alike where no GPU here takes a job and where a waiter's
GPUs went into MIG mode."""

from __future__ import annotations

import pytest

from gpuwait.core.devices import MIG_MODE_HINT, in_mig_mode_words, none_usable
from gpuwait.core.snapshot import MachineSnapshot


@pytest.mark.parametrize(
    ("indices", "words"),
    [([0], "GPU 0 is in MIG mode"), ([0, 1], "GPU 0, GPU 1 are in MIG mode")],
)
def test_gpus_in_mig_mode_are_named_with_is_for_one_and_are_for_more(
    indices: list[int], words: str
) -> None:
    assert in_mig_mode_words(indices) == words
    snapshot = MachineSnapshot(
        backend="nvml", gpus=(), in_mig_mode=tuple((i, f"GPU-{i}") for i in indices)
    )
    assert none_usable(snapshot) == (
        f"no GPU here takes a job: {words}, and gpuwait places jobs on whole GPUs only",
        MIG_MODE_HINT,
    )
