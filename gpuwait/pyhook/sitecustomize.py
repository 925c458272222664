"""gpuwait's PyTorch memory cap, for jobs run with `--enforce limit` (docs/budgets.md).

gpuwait puts this directory first on the job's PYTHONPATH and the cap, as a fraction of each
card, in GPUWAIT_TORCH_MEMORY_FRACTION. Python runs this file at start-up; it only watches for
`import torch` (a process that never imports torch pays for one entry in sys.meta_path), then:

- a PyTorch whose CUDA allocator reads `per_process_memory_fraction` from its settings gets the
  key added to them before torch loads, so the C++ allocator enforces it from the first
  allocation, in this process and in every worker it starts;
- an older PyTorch gets `torch.cuda.set_per_process_memory_fraction` for every device, queued
  with torch's own lazy-initialisation hook, so importing torch does not start CUDA; so does any
  PyTorch on a gang of cards of different sizes, each card capped at the reservation
  (GPUWAIT_TORCH_MEMORY_BYTES), where one fraction would leave a smaller card less.

Either way an allocation past the cap fails with PyTorch's out-of-memory error in this job
alone. A cap the user set themselves is left alone, and so is the user's own sitecustomize,
which runs after this one. Standard library only; nothing here may break the job.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import os
import re
import sys
from typing import Any

_FRACTION_VAR = "GPUWAIT_TORCH_MEMORY_FRACTION"
#: Set on a gang of cards of different sizes: the reservation in bytes, each card capped at it.
_BYTES_VAR = "GPUWAIT_TORCH_MEMORY_BYTES"
#: PyTorch 2.10+ reads its CUDA allocator settings from the first of these that is set (2.9
#: added the second name; the first works in every release).
_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
_KEY = "per_process_memory_fraction"
#: The first PyTorch release whose CUDA allocator accepts the key (docs/budgets.md, sources);
#: an older one stops at an unknown key, so it never sees it.
KEY_SINCE = (2, 10)
_HERE = os.path.dirname(os.path.abspath(__file__))


def _say(text: str) -> None:
    with contextlib.suppress(Exception):
        sys.stderr.write(f"gpuwait: {text}\n")


def _fraction() -> float | None:
    raw = os.environ.get(_FRACTION_VAR, "")
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if 0 < value <= 1 else None


def _reserved_bytes() -> int | None:
    raw = os.environ.get(_BYTES_VAR, "")
    return int(raw) if raw.isascii() and raw.isdigit() and int(raw) > 0 else None


def device_fraction(cuda: Any, device: int, fraction: float, reserved: int | None) -> float:
    """The cap of one device: the reservation's share of that card where the cards differ in
    size (rounded down to 4 decimals, as gpuwait writes fractions), else the one fraction."""
    if reserved is None:
        return fraction
    try:
        total = int(cuda.get_device_properties(device).total_memory)
    except Exception:
        return fraction
    if total <= 0:
        return fraction
    return max(1, min(10_000, reserved * 10_000 // total)) / 10_000


def version_of(spec: importlib.machinery.ModuleSpec) -> tuple[int, int] | None:
    """(major, minor) of the torch that `spec` would load, read from its version.py without
    running it; None where it cannot be read."""
    for location in spec.submodule_search_locations or ():
        try:
            with open(os.path.join(location, "version.py"), encoding="utf-8") as handle:
                text = handle.read(4096)
        except OSError:
            continue
        found = re.search(r"""__version__\s*=\s*['"](\d+)\.(\d+)""", text)
        if found:
            return int(found.group(1)), int(found.group(2))
    return None


def user_capped() -> bool:
    """The user's own allocator settings already name a per-process fraction."""
    for name in _CONF_VARS:
        for item in os.environ.get(name, "").split(","):
            if item.partition(":")[0].strip() == _KEY:
                return True
    return False


def add_conf_key(fraction: float) -> str:
    """Add the key to the allocator settings PyTorch will read (the user's own, kept whole);
    returns the variable's name."""
    used = [n for n in _CONF_VARS if os.environ.get(n)]
    name = used[0] if used else _CONF_VARS[0]
    current = os.environ.get(name, "")
    os.environ[name] = f"{current},{_KEY}:{fraction}" if current else f"{_KEY}:{fraction}"
    return name


def cap_lazily(torch: Any, fraction: float) -> None:
    """Queue the cap for every device until torch initialises CUDA (at once if it has)."""
    cuda = torch.cuda

    reserved = _reserved_bytes()

    def cap() -> None:
        try:
            # PyTorch makes each device current to cap it and leaves the last one so: the
            # program's own current device (what `.cuda()` means) is put back afterwards.
            current = cuda.current_device()
        except Exception:
            current = None
        try:
            for device in range(cuda.device_count()):
                share = device_fraction(cuda, device, fraction, reserved)
                cuda.set_per_process_memory_fraction(share, device)
        except Exception as exc:
            _say(f"PyTorch memory cap not applied: {exc}")
        finally:
            if current is not None:
                try:
                    cuda.set_device(current)
                except Exception as exc:
                    _say(f"PyTorch device not restored after the memory cap: {exc}")

    queue = getattr(cuda, "_lazy_call", None)
    if queue is None:
        cap()
    else:
        queue(cap)


class _LoaderThenCap:
    """torch's own loader, followed by the cap once the module has run."""

    def __init__(self, loader: Any, fraction: float) -> None:
        self._loader = loader
        self._fraction = fraction

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        try:
            cap_lazily(module, self._fraction)
        except Exception as exc:
            _say(f"PyTorch memory cap not applied: {exc}")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class TorchWatch:
    """A meta path finder that acts once, on `import torch`, and then steps out of the way."""

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch":
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec("torch")
        except (ImportError, ValueError):
            return None
        if spec is None or spec.loader is None or user_capped():
            return spec
        try:
            version = version_of(spec)
            # One key caps every card at one fraction: not for cards of different sizes.
            if version is not None and version >= KEY_SINCE and _reserved_bytes() is None:
                add_conf_key(self.fraction)
            else:
                spec.loader = _LoaderThenCap(spec.loader, self.fraction)  # type: ignore[assignment]
        except Exception as exc:
            _say(f"PyTorch memory cap not applied: {exc}")
        return spec


def install() -> None:
    fraction = _fraction()
    if fraction is None:
        return
    torch = sys.modules.get("torch")
    if torch is not None:
        cap_lazily(torch, fraction)
    elif not any(isinstance(f, TorchWatch) for f in sys.meta_path):
        sys.meta_path.insert(0, TorchWatch(fraction))


def _a_hook(directory: str) -> bool:
    """Is `directory` this hook's, by another path (a symlink), or another gpuwait's (an
    enclosing job's, of another install)? Each runs the sitecustomize it hides: taken for the
    user's, two hooks would run each other for ever."""
    where = os.path.realpath(directory or os.curdir)
    if where == os.path.realpath(_HERE):
        return True
    parent, name = os.path.split(where)
    return name == "pyhook" and os.path.basename(parent) == "gpuwait"


def chain() -> None:
    """Run the sitecustomize this one hides (the next one on sys.path that is no gpuwait hook),
    as Python would have."""
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    while True:
        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
        if spec is None or spec.loader is None or spec.origin is None:
            return
        found = os.path.dirname(spec.origin)
        if not _a_hook(found):
            break
        left = [p for p in rest if os.path.abspath(p or os.curdir) != os.path.abspath(found)]
        if len(left) == len(rest):
            return  # found where no entry of the path names: nothing more is looked for
        rest = left
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


try:
    install()
except Exception as exc:  # never the job's problem
    _say(f"PyTorch memory cap not applied: {exc}")
chain()
