"""Budgets: what keeps a job inside its reservation, so that one job growing past what it asked
for fails alone instead of taking its neighbours with it (docs/budgets.md).

`enforce` chooses how far gpuwait goes:

    off    nothing is exported but gpuwait's own GPUWAIT_* variables
    hint   the frameworks people run are told the reservation: JAX's and XLA's memory fraction,
           TensorFlow's on-demand growth; servers read GPUWAIT_VRAM_FRACTION on their command line
    limit  the hints, and the reservation enforced below the application wherever this machine
           offers a way: the cgroup dmem controller, a CUDA MPS memory limit, PyTorch's caching
           allocator capped; where none applies, the hints alone (said once)

Pure: what this machine offers (`Means`) is found by the runner, which also applies the plan.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

from gpuwait.core.record import Record

OFF, HINT, LIMIT = "off", "hint", "limit"
ENFORCE_MODES = (OFF, HINT, LIMIT)
DEFAULT_ENFORCE = HINT

# How a job's budget is held, as `status` says it.
HELD_DMEM = "cgroup dmem"
HELD_MPS = "MPS limit"
HELD_TORCH = "PyTorch allocator cap"
HELD_HINT = "hint only"
HELD_BY = (HELD_DMEM, HELD_MPS, HELD_TORCH, HELD_HINT)
#: The ways that refuse an allocation past the reservation (a hint refuses nothing).
ENFORCING = frozenset({HELD_DMEM, HELD_MPS, HELD_TORCH})

#: gpuwait's own variables: the fraction of the card the reservation is (always exported), and
#: the one that tells the PyTorch hook on PYTHONPATH what cap to apply (limit mode).
FRACTION_VAR = "GPUWAIT_VRAM_FRACTION"
#: The reservation per GPU in bytes (always exported).
BYTES_VAR = "GPUWAIT_VRAM_BYTES"
TORCH_FRACTION_VAR = "GPUWAIT_TORCH_MEMORY_FRACTION"
#: On a gang of cards of different sizes: the reservation in bytes, which the hook caps each card
#: at (one fraction of the largest card would leave a smaller card less than the reservation).
TORCH_BYTES_VAR = "GPUWAIT_TORCH_MEMORY_BYTES"
XLA_FRACTION_VAR = "XLA_PYTHON_CLIENT_MEM_FRACTION"
#: The newer name of the same setting (JAX reads both).
XLA_NEW_FRACTION_VAR = "XLA_CLIENT_MEM_FRACTION"
XLA_PREALLOCATE_VAR = "XLA_PYTHON_CLIENT_PREALLOCATE"
TF_GROWTH_VAR = "TF_FORCE_GPU_ALLOW_GROWTH"
MPS_LIMIT_VAR = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
#: PyTorch's allocator settings, in the order PyTorch 2.10+ reads its CUDA ones: the first set.
TORCH_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
TORCH_FRACTION_KEY = "per_process_memory_fraction"


def sizes_itself(command: Sequence[str]) -> bool:
    """Does the command line size the program from its reservation (vLLM told
    `--gpu-memory-utilization "$GPUWAIT_VRAM_FRACTION"` inside `sh -c`)? Such a program takes
    whatever it is given: its peak is its reservation, not what it needs."""
    return any(FRACTION_VAR in arg or BYTES_VAR in arg for arg in command)


#: Fractions are written with this many decimals, rounded down: never above the reservation.
_DECIMALS = 4

# How an out-of-memory failure came about (history's `oom_cause`, the log, --retry-oom).
OOM_OWN_LIMIT = "own limit"
OOM_CARD_FULL = "card full"
OOM_UNKNOWN = "unknown"


class Means(Record, frozen=True):
    """What this machine offers to hold one job's budget (found by the runner)."""

    #: The job's cgroup with its dmem limit is made (gpuwait.runner.budget), else why not.
    dmem: bool = False
    dmem_why_not: str = "no cgroup dmem controller (Linux 6.14+)"
    #: A CUDA MPS control daemon serves this user.
    mps: bool = False
    #: The command is a Python program (the PyTorch hook then applies when it imports torch).
    python: bool = False
    #: Where it is not: why the PyTorch cap is not claimed.
    python_why_not: str = "not a Python program, for the PyTorch cap"
    #: The directory holding gpuwait's PyTorch hook (sitecustomize.py).
    hook_dir: str = ""


class Budget(Record, frozen=True):
    """How one job's reservation is held: what to export, and what `status` says."""

    mode: str
    #: Ways the budget is held, strongest first; () with enforce = off or a whole GPU.
    held_by: tuple[str, ...]
    #: Variables to set in the command's environment.
    env: Mapping[str, str]
    #: Framework variables the user set already, left as they are.
    kept: tuple[str, ...] = ()
    #: Variables to take out of the command's environment: the caps the gpuwait job this one
    #: runs inside exported to its command, which this budget does not set again (enforce =
    #: off, or no MPS limit of its own).
    unset: tuple[str, ...] = ()
    #: limit mode only: why nothing below the application holds the budget (said once).
    fallback: str | None = None

    @property
    def enforced(self) -> bool:
        """Something refuses the job's allocations past its reservation."""
        return any(way in ENFORCING for way in self.held_by)


def card_fraction(reserved_bytes: int, totals: Sequence[int]) -> float:
    """The reservation as a fraction of the largest of the job's cards, rounded down, so that
    no card lets the job past its reservation (a smaller card gets a little less).

    Rounded down in whole bytes: the fraction of a card is under the reservation plus one byte,
    so a share of the card (`--vram 30%`, a whole card's room at safety 0.9), which reserves
    that share rounded down to a whole byte, is told as itself (0.3), not as 0.2999."""
    largest = max((t for t in totals if t > 0), default=0)
    if largest <= 0 or reserved_bytes <= 0:
        return 0.0
    scale: int = 10**_DECIMALS
    steps = ((reserved_bytes + 1) * scale - 1) // largest
    return max(1, min(scale, steps)) / scale


def format_fraction(fraction: float) -> str:
    """0.075, 0.5, 1 as the frameworks read them (no exponent, no trailing zeros)."""
    text = f"{fraction:.{_DECIMALS}f}".rstrip("0").rstrip(".")
    return text or "0"


def mps_limit(
    reserved_bytes: int, gpu_uuids: Sequence[str], by_gpu: Mapping[str, int] | None = None
) -> str:
    """CUDA_MPS_PINNED_DEVICE_MEM_LIMIT: each of the job's GPUs, named by UUID as in
    CUDA_VISIBLE_DEVICES (no renumbering can point it at another card), limited to the
    reservation there (`by_gpu`, else `reserved_bytes`) in whole MB, rounded down
    ("GPU-…=6144MB")."""
    on = by_gpu or {}
    return ",".join(f"{uuid}={max(1, on.get(uuid, reserved_bytes) >> 20)}MB" for uuid in gpu_uuids)


def parse_mps_limit(text: str) -> dict[str, int]:
    """{device (ordinal or UUID, as written): bytes} from a CUDA_MPS_PINNED_DEVICE_MEM_LIMIT
    value; what cannot be read is left out."""
    units = {"": 1 << 20, "M": 1 << 20, "MB": 1 << 20, "G": 1 << 30, "GB": 1 << 30}
    limits: dict[str, int] = {}
    for part in text.split(","):
        match = re.fullmatch(r"\s*([\w-]+)\s*=\s*(\d+)\s*([MG]B?)?\s*", part, re.IGNORECASE)
        if match:
            unit = units[(match.group(3) or "").upper()]
            limits[match.group(1)] = int(match.group(2)) * unit
    return limits


def conf_fraction(conf: str) -> float | None:
    """per_process_memory_fraction from a PyTorch allocator setting ("a:1,b:2"), if given."""
    value = None
    for item in conf.split(","):
        key, sep, raw = item.partition(":")
        if sep and key.strip() == TORCH_FRACTION_KEY:
            try:
                value = float(raw.strip())
            except ValueError:
                value = None
    return value


def torch_conf(env: Mapping[str, str]) -> str:
    """The allocator settings PyTorch reads its CUDA options from: the first variable set."""
    for name in TORCH_CONF_VARS:
        if env.get(name):
            return env[name]
    return ""


def user_torch_cap(env: Mapping[str, str]) -> bool:
    """The user capped PyTorch's allocator themselves (in either allocator variable)."""
    return any(conf_fraction(env.get(name, "")) is not None for name in TORCH_CONF_VARS)


def plan(
    mode: str,
    reserved_bytes: int,
    gpus: Mapping[str, int],
    env: Mapping[str, str],
    means: Means,
    *,
    whole_gpus: bool = False,
    by_gpu: Mapping[str, int] | None = None,
) -> Budget:
    """The budget of a job holding `reserved_bytes` on each of `gpus` (UUID -> total bytes, in
    CUDA_VISIBLE_DEVICES order), or less on those `by_gpu` names (a share of each card: the
    same fraction of every card), given the user's environment `env` (whose framework
    variables are never overridden) and `means`."""
    undone = _hooks_settings_undone(env)
    own = _users_own(env)
    theirs = sorted(n for n in env if n not in own)
    env = {**own, **undone}
    planned = _plan(mode, reserved_bytes, gpus, env, means, whole_gpus=whole_gpus, by_gpu=by_gpu)
    unset = tuple(n for n in theirs if n not in planned.env)
    if unset:
        planned = planned._replace(unset=unset)
    # The PyTorch hook an enclosing job put on PYTHONPATH caps this job's Python at that job's
    # share unless told otherwise: at this job's own where it caps it, else at none (""). A
    # PyTorch that reads the cap from its allocator settings was given it there, in the
    # enclosing job's process that imported torch and started this one: those are put back.
    cleared = {n: "" for n in (TORCH_FRACTION_VAR, TORCH_BYTES_VAR) if env.get(n)}
    cleared.update(undone)
    return planned._replace(env={**cleared, **planned.env}) if cleared else planned


def _hooks_settings_undone(env: Mapping[str, str]) -> dict[str, str]:
    """The allocator settings in `env` the hook added its cap to (the key, at the fraction an
    enclosing job gave it in GPUWAIT_TORCH_MEMORY_FRACTION), each without that key."""
    try:
        given = float(env.get(TORCH_FRACTION_VAR, ""))
    except ValueError:
        return {}
    undone = {}
    for name in TORCH_CONF_VARS:
        items = env.get(name, "").split(",")
        kept = [i for i in items if conf_fraction(i) != given]
        if len(kept) < len(items):
            undone[name] = ",".join(kept)
    return undone


def _users_own(env: Mapping[str, str]) -> Mapping[str, str]:
    """`env` without the framework variables that the gpuwait job this one runs inside (or ran
    inside: a shell that outlived it) exported to its command: its share of the card, which is
    not this job's, the on-demand settings that go with it, and its MPS limit. They are no
    user's."""
    enclosing = env.get(FRACTION_VAR, "") if env.get("GPUWAIT_JOB_ID") else ""
    if not enclosing:
        return env
    theirs = {
        XLA_FRACTION_VAR: enclosing,
        XLA_NEW_FRACTION_VAR: enclosing,
        XLA_PREALLOCATE_VAR: "false",
        TF_GROWTH_VAR: "true",
    }
    # Its MPS limit, as gpuwait writes one, on every GPU this job has (a job inside another
    # gets some of its GPUs): each process of this job is an MPS client limited on its own.
    limit = env.get(MPS_LIMIT_VAR, "")
    uuids = {u for u in env.get("GPUWAIT_GPU_UUIDS", "").split(",") if u}
    written = re.fullmatch(r"GPU-[\w-]+=\d+MB(?:,GPU-[\w-]+=\d+MB)*", limit)
    if uuids and written and uuids <= set(parse_mps_limit(limit)):
        theirs[MPS_LIMIT_VAR] = limit
    if env.get(XLA_FRACTION_VAR, enclosing) != enclosing:
        theirs = {MPS_LIMIT_VAR: theirs[MPS_LIMIT_VAR]} if MPS_LIMIT_VAR in theirs else {}
    return {n: v for n, v in env.items() if theirs.get(n) != v}


def _plan(
    mode: str,
    reserved_bytes: int,
    gpus: Mapping[str, int],
    env: Mapping[str, str],
    means: Means,
    *,
    whole_gpus: bool,
    by_gpu: Mapping[str, int] | None,
) -> Budget:
    totals = list(gpus.values())
    # On whole cards too the room the job was given, not 1: some of a card is always taken
    # (the driver's, the job's own CUDA context), and vLLM refuses to start where the card's
    # free memory is short of its fraction of the whole.
    fraction = card_fraction(reserved_bytes, totals) or (1.0 if whole_gpus else 0.0)
    exported: dict[str, str] = {FRACTION_VAR: format_fraction(fraction)}
    if mode == OFF or fraction <= 0:
        return Budget(mode=mode, held_by=(), env=exported)
    kept: list[str] = []

    def offer(name: str, value: str) -> bool:
        if env.get(name, "") != "":
            kept.append(name)
            return False
        exported[name] = value
        return True

    if whole_gpus:
        # A whole card needs no budget: nothing else is admitted beside it. The frameworks are
        # still told to take memory as they need it, the whole card theirs (JAX's fraction 1),
        # so that the run is learned at what it used: JAX would take 75 % of the card at once,
        # TensorFlow nearly all of it, and a first run with no history (on a whole card) would
        # size every later one so.
        _on_demand(offer, env, kept, exported, "1")
        return Budget(mode=mode, held_by=(), env=exported, kept=tuple(kept))
    held: list[str] = []
    if mode == LIMIT:
        if means.dmem:
            held.append(HELD_DMEM)
        if means.mps and offer(MPS_LIMIT_VAR, mps_limit(reserved_bytes, list(gpus), by_gpu)):
            held.append(HELD_MPS)
    # Under a limit the driver holds, the frameworks are told to allocate on demand up to the
    # whole card, the driver refusing past the reservation: whether it then reports the limit
    # as the card's total is unconfirmed (docs/budgets.md), and a fraction of that would be a
    # fraction of the reservation. Told nothing, JAX would stop at its default 75 % of the card.
    driver_held = bool(held)
    _on_demand(offer, env, kept, exported, "1" if driver_held else format_fraction(fraction))
    if mode != LIMIT:
        return Budget(mode=mode, held_by=(HELD_HINT,), env=exported, kept=tuple(kept))
    if means.hook_dir and not driver_held:
        # The hook is harmless where Python never imports torch, so it goes wherever a Python
        # process may start; status claims the cap only for a Python program.
        if user_torch_cap(env):
            kept.append("PyTorch's per_process_memory_fraction")
        else:
            path = env.get("PYTHONPATH", "")
            # An empty entry is the current directory to Python (what `export
            # PYTHONPATH=$PYTHONPATH:/lib` leaves with nothing before it): kept, so a job
            # importing from there does as bare. An empty PYTHONPATH names nothing.
            parts = [p for p in path.split(":") if p != means.hook_dir] if path else []
            exported["PYTHONPATH"] = ":".join([means.hook_dir, *parts])
            exported[TORCH_FRACTION_VAR] = format_fraction(fraction)
            if len({t for t in totals if t > 0}) > 1 and not by_gpu:
                exported[TORCH_BYTES_VAR] = str(reserved_bytes)
            if means.python:
                held.append(HELD_TORCH)
    fallback = None
    if not held:
        held.append(HELD_HINT)
        fallback = _why_hint_only(means)
    return Budget(
        mode=mode,
        held_by=tuple(held),
        env=exported,
        kept=tuple(kept),
        fallback=fallback,
    )


def _on_demand(
    offer: Callable[[str, str], bool],
    env: Mapping[str, str],
    kept: list[str],
    exported: dict[str, str],
    fraction: str,
) -> None:
    """Tell JAX its `fraction` as a cap, below which it takes memory on demand, and TensorFlow
    to grow as it needs (`offer`: unless the user set the variable). Preallocating, JAX would
    hold all its room from its first operation, and each run would be learned at the room it
    was given instead of what it used: a job of known size 10 % more at every run."""
    if env.get(XLA_NEW_FRACTION_VAR, "") != "":
        kept.append(XLA_NEW_FRACTION_VAR)  # the user's own, under the newer name
    elif offer(XLA_FRACTION_VAR, fraction):
        exported[XLA_NEW_FRACTION_VAR] = fraction
        offer(XLA_PREALLOCATE_VAR, "false")
    offer(TF_GROWTH_VAR, "true")


def _why_hint_only(means: Means) -> str:
    reasons = [means.dmem_why_not, "no CUDA MPS daemon serves you"]
    if not means.python:
        reasons.append(means.python_why_not)
    return "enforce = limit: the reservation is only hinted here: " + "; ".join(reasons)


#: A failed job whose budget was enforced and whose peak came this close to its limit ran out
#: at the limit, whether or not its out-of-memory message was seen (a terminal is not watched).
NEAR_LIMIT = 0.9


def near_limit(peak_bytes: int | None, limit_bytes: int) -> bool:
    return peak_bytes is not None and limit_bytes > 0 and peak_bytes >= NEAR_LIMIT * limit_bytes


def oom_cause(budget_enforced: bool, card_full: bool) -> str:
    """Why an out-of-memory failure happened, as far as gpuwait can tell.

    A job whose budget something enforced, and that failed while its card still had room, hit
    its own limit: the job needs more than it asked for. A full card is the other case: the job
    or a neighbour filled it.
    """
    if budget_enforced and not card_full:
        return OOM_OWN_LIMIT
    if card_full:
        return OOM_CARD_FULL
    return OOM_UNKNOWN
