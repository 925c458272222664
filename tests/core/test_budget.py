"""Budgets, as decided: what each enforce mode exports, what it leaves alone, how it is held."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuwait.core import budget
from gpuwait.core.budget import LIMIT, Means, plan

GiB = 2**30
CARD = {"GPU-a": 80 * GiB}
HOOK = "/opt/gpuwait/pyhook"


def test_off_exports_only_gpuwaits_own_fraction() -> None:
    held = plan("off", 6 * GiB, CARD, {}, Means())
    assert held.env == {"GPUWAIT_VRAM_FRACTION": "0.075"}
    assert held.held_by == ()
    assert not held.enforced


def test_hint_tells_jax_and_tensorflow() -> None:
    held = plan("hint", 6 * GiB, CARD, {}, Means())
    assert held.env == {
        "GPUWAIT_VRAM_FRACTION": "0.075",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.075",
        "XLA_CLIENT_MEM_FRACTION": "0.075",
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "TF_FORCE_GPU_ALLOW_GROWTH": "true",
    }
    assert held.held_by == (budget.HELD_HINT,)
    assert not held.enforced
    # PyTorch's allocator settings are left alone in hint mode.
    assert not any(name.startswith("PYTORCH") for name in held.env)


def test_user_set_variables_are_kept() -> None:
    env = {
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5",
        "TF_FORCE_GPU_ALLOW_GROWTH": "false",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1G",
    }
    held = plan(LIMIT, 6 * GiB, CARD, env, Means(mps=True, python=True, hook_dir=HOOK))
    for name in env:
        assert name not in held.env
        assert name in held.kept
    # The newer XLA name is not set beside the user's own older one (it would win over it).
    assert "XLA_CLIENT_MEM_FRACTION" not in held.env
    # MPS is not gpuwait's way when the user set their own limit.
    assert budget.HELD_MPS not in held.held_by


def test_user_setting_the_newer_xla_name_is_kept_too() -> None:
    held = plan("hint", 6 * GiB, CARD, {"XLA_CLIENT_MEM_FRACTION": "0.3"}, Means())
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in held.env
    assert "XLA_CLIENT_MEM_FRACTION" in held.kept


def test_limit_held_by_the_driver() -> None:
    gpus = {"GPU-a": 80 * GiB, "GPU-b": 80 * GiB}
    held = plan(
        LIMIT,
        6 * GiB,
        gpus,
        {"PYTHONPATH": "/home/me/lib"},
        Means(dmem=True, mps=True, python=True, hook_dir=HOOK),
    )
    assert held.held_by == (budget.HELD_DMEM, budget.HELD_MPS)
    assert held.enforced
    assert held.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "GPU-a=6144MB,GPU-b=6144MB"
    # No fraction stacked on the driver's limit: JAX allocates on demand up to the whole card
    # (told nothing, it would stop at 75 % of it), PyTorch is not capped a second time, and the
    # user's PYTHONPATH is theirs alone.
    assert held.env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert held.env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "1"
    assert held.env["XLA_CLIENT_MEM_FRACTION"] == "1"
    assert "PYTHONPATH" not in held.env and "GPUWAIT_TORCH_MEMORY_FRACTION" not in held.env
    assert held.env["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"
    assert held.fallback is None


def test_limit_held_by_the_pytorch_cap() -> None:
    held = plan(
        LIMIT, 6 * GiB, CARD, {"PYTHONPATH": "/home/me/lib"}, Means(python=True, hook_dir=HOOK)
    )
    assert held.held_by == (budget.HELD_TORCH,)
    assert held.enforced
    # The hook comes first; the user's own path stays after it.
    assert held.env["PYTHONPATH"] == f"{HOOK}:/home/me/lib"
    assert held.env["GPUWAIT_TORCH_MEMORY_FRACTION"] == "0.075"
    assert held.env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.075"
    assert held.fallback is None


def test_a_failed_job_near_its_limit_ran_out_there() -> None:
    assert budget.near_limit(int(1.9 * GiB), 2 * GiB)
    assert not budget.near_limit(GiB, 2 * GiB)
    assert not budget.near_limit(None, 2 * GiB)


def test_limit_without_a_way_falls_back_to_hint_and_says_why() -> None:
    held = plan(LIMIT, 6 * GiB, CARD, {}, Means(python=False, hook_dir=HOOK))
    assert held.held_by == (budget.HELD_HINT,)
    assert not held.enforced
    assert held.fallback is not None
    assert "only hinted" in held.fallback
    assert "MPS" in held.fallback and "dmem" in held.fallback and "Python" in held.fallback
    # The hook still goes on PYTHONPATH: a shell script may start Python that imports torch.
    assert held.env["PYTHONPATH"] == HOOK


def test_a_users_own_torch_cap_is_kept() -> None:
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,per_process_memory_fraction:0.3"}
    held = plan(LIMIT, 6 * GiB, CARD, env, Means(python=True, hook_dir=HOOK))
    assert "PYTHONPATH" not in held.env
    assert "GPUWAIT_TORCH_MEMORY_FRACTION" not in held.env
    assert budget.HELD_TORCH not in held.held_by


def test_the_hook_is_not_put_twice_on_pythonpath() -> None:
    held = plan(LIMIT, GiB, CARD, {"PYTHONPATH": f"{HOOK}:/x"}, Means(python=True, hook_dir=HOOK))
    assert held.env["PYTHONPATH"] == f"{HOOK}:/x"


def test_whole_gpus_need_no_budget_but_frameworks_still_take_memory_on_demand() -> None:
    held = plan(
        LIMIT, 80 * GiB, CARD, {}, Means(mps=True, python=True, hook_dir=HOOK), whole_gpus=True
    )
    # No cap below the card, and the run is learned at what it used, not JAX's 75 %.
    assert held.env == {
        "GPUWAIT_VRAM_FRACTION": "1",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "1",
        "XLA_CLIENT_MEM_FRACTION": "1",
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
        "TF_FORCE_GPU_ALLOW_GROWTH": "true",
    }
    assert held.held_by == ()
    assert plan("off", 80 * GiB, CARD, {}, Means(), whole_gpus=True).env == {
        "GPUWAIT_VRAM_FRACTION": "1"
    }
    # A preallocation the user asked for stays theirs.
    mine = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95"}
    held = plan("hint", 6 * GiB, CARD, mine, Means(), whole_gpus=True)
    assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in held.env
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" in held.kept


def test_fraction_of_mixed_cards_fits_the_largest() -> None:
    # 12 GiB of a 24 GiB and of a 48 GiB card: 0.25, so neither card lets the job past 12 GiB.
    assert budget.card_fraction(12 * GiB, [24 * GiB, 48 * GiB]) == 0.25


@given(
    reserved=st.integers(min_value=1, max_value=2**40),
    totals=st.lists(st.integers(min_value=2**20, max_value=2**40), min_size=1, max_size=8),
)
def test_the_fraction_never_lets_a_job_past_its_reservation(
    reserved: int, totals: list[int]
) -> None:
    fraction = budget.card_fraction(reserved, totals)
    assert 0 < fraction <= 1
    text = budget.format_fraction(fraction)
    assert "e" not in text
    if reserved >= max(totals) / 10_000:  # above the smallest fraction written
        # In whole bytes, as a framework takes its share of a card: never past the reservation.
        assert all(Fraction(text) * total < reserved + 1 for total in totals)


def test_a_share_of_a_card_is_told_as_that_share() -> None:
    # 30 % of a 24 GiB card is 7730941132.8 bytes; the reservation is a whole number of them.
    assert budget.card_fraction(int(0.3 * 24 * GiB), [24 * GiB]) == 0.3
    assert budget.card_fraction(int(0.9 * 24 * GiB), [24 * GiB]) == 0.9
    assert budget.card_fraction(int(0.9 * 24 * GiB) - 1, [24 * GiB]) == 0.8999


def test_mps_limit_reads_back() -> None:
    assert budget.parse_mps_limit("GPU-a=6144MB,1=2G, 2 = 512M,junk") == {
        "GPU-a": 6 * GiB,
        "1": 2 * GiB,
        "2": 512 * 2**20,
    }


@pytest.mark.parametrize(
    ("conf", "fraction"),
    [
        ("per_process_memory_fraction:0.25", 0.25),
        ("expandable_segments:True, per_process_memory_fraction: 0.5", 0.5),
        ("expandable_segments:True", None),
        ("per_process_memory_fraction:abc", None),
        ("", None),
    ],
)
def test_conf_fraction(conf: str, fraction: float | None) -> None:
    assert budget.conf_fraction(conf) == fraction


def test_pytorch_reads_its_cuda_settings_from_the_first_variable_set() -> None:
    both = {"PYTORCH_CUDA_ALLOC_CONF": "a:1", "PYTORCH_ALLOC_CONF": "b:2"}
    assert budget.torch_conf(both) == "a:1"
    assert budget.torch_conf({"PYTORCH_ALLOC_CONF": "b:2"}) == "b:2"


@pytest.mark.parametrize(
    ("enforced", "card_full", "cause"),
    [
        (True, False, budget.OOM_OWN_LIMIT),
        (True, True, budget.OOM_CARD_FULL),
        (False, True, budget.OOM_CARD_FULL),
        (False, False, budget.OOM_UNKNOWN),
    ],
)
def test_oom_cause(enforced: bool, card_full: bool, cause: str) -> None:
    assert budget.oom_cause(enforced, card_full) == cause


def test_a_share_of_each_card_is_held_on_each_card_at_that_share() -> None:
    # Half of a 24 GiB and of an 80 GiB card: 12 GiB on the small one, 40 on the big one. One
    # fraction (0.5) says both; a cap of 40 GiB in bytes would leave the small card uncapped.
    mixed = {"GPU-s": 24 * GiB, "GPU-b": 80 * GiB}
    small = {"GPU-s": 12 * GiB}
    held = plan(LIMIT, 40 * GiB, mixed, {}, Means(python=True, hook_dir=HOOK), by_gpu=small)
    assert held.env["GPUWAIT_TORCH_MEMORY_FRACTION"] == "0.5"
    assert "GPUWAIT_TORCH_MEMORY_BYTES" not in held.env
    held = plan(LIMIT, 40 * GiB, mixed, {}, Means(mps=True), by_gpu=small)
    assert held.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "GPU-s=12288MB,GPU-b=40960MB"


def test_a_command_line_that_reads_the_reservation_sizes_itself() -> None:
    vllm = 'exec vllm serve M --gpu-memory-utilization "$GPUWAIT_VRAM_FRACTION"'
    assert budget.sizes_itself(["sh", "-c", vllm])
    assert budget.sizes_itself(["sh", "-c", "exec ./serve --bytes ${GPUWAIT_VRAM_BYTES}"])
    assert not budget.sizes_itself(["python", "train.py", "--lr", "0.1"])
