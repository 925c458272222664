"""gpuwait: admission control for GPUs on one machine, with no daemon.

From Python, `gpuwait.reserve("6G")` waits in the same queue and holds the room for the calling
process (docs/python-api.md); `%load_ext gpuwait` adds the `%gpuwait` magic to IPython. Both are
imported only when first used, so that `import gpuwait` costs nothing beyond this file.
"""

from __future__ import annotations

__version__ = "0.1.0"

# Not `from typing import TYPE_CHECKING`: typing (and the collections, re and enum it loads) is
# some 5 ms, and every launch reads this file before its start-up turnstile (gpuwait.cli).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from gpuwait.api.reserve import Reservation, ReserveError, reserve
    from gpuwait.core.errors import GpuwaitError

#: What `gpuwait.NAME` gives, and the module it comes from (imported on first use).
_LAZY = {
    "reserve": "gpuwait.api.reserve",
    "Reservation": "gpuwait.api.reserve",
    "ReserveError": "gpuwait.api.reserve",
    "GpuwaitError": "gpuwait.core.errors",
}

__all__ = ["GpuwaitError", "Reservation", "ReserveError", "__version__", "reserve"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gpuwait' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


def load_ipython_extension(ipython: Any) -> None:
    """`%load_ext gpuwait`: registers the `%gpuwait` line magic."""
    from gpuwait.api.magic import load_ipython_extension as load

    load(ipython)
