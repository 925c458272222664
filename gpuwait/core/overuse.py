"""A running job that uses far more VRAM than it reserved: when to say so, why, and what to do.

Pure. gpuwait admits jobs by their reservations; a job above its own takes room the plan gave
to others, so their next allocation may fail. The usual causes are frameworks that preallocate
(JAX takes 75 % of the card at its first allocation, TensorFlow nearly all of it) and a `--vram`
smaller than what the command really needs.
"""

from __future__ import annotations

from gpuwait.core.budget import card_fraction, format_fraction
from gpuwait.core.record import Record
from gpuwait.core.sizes import format_size

#: Below this much over its reservation, a job is not worth a warning (allocator granularity).
MIN_EXCESS = 64 * 2**20
#: A job at this fraction of its card or more has most likely been given it by a framework that
#: preallocates, rather than grown into it.
PREALLOCATED_FRACTION = 0.7


class Overuse(Record, frozen=True):
    """A job's use above its reservation (per GPU), with the likely cause and the advice."""

    reserved_bytes: int
    used_bytes: int
    total_bytes: int
    preallocated: bool

    @classmethod
    def seen(cls, reserved_bytes: int, used_bytes: int, total_bytes: int) -> Overuse:
        """The overuse of a job that used `used_bytes` of a `total_bytes` card."""
        return cls(
            reserved_bytes=reserved_bytes,
            used_bytes=used_bytes,
            total_bytes=total_bytes,
            preallocated=total_bytes > 0 and used_bytes >= PREALLOCATED_FRACTION * total_bytes,
        )

    def cause(self) -> str:
        if self.preallocated:
            return (
                "most likely a framework that preallocates (JAX takes 75% of the card, "
                "TensorFlow nearly all of it)"
            )
        return "the command needs more than it reserved"

    def advice(self) -> str:
        need = f"--vram {_tidy_gib(self.used_bytes)}"
        if not self.preallocated or self.total_bytes <= 0:
            return f"reserve what it uses: {need}, or run it without --vram so gpuwait learns it"
        # Rounded down as gpuwait's own fraction is: rounded up, it would let JAX past it.
        fraction = format_fraction(card_fraction(self.reserved_bytes, [self.total_bytes]))
        return (
            f"keep it inside its reservation: XLA_PYTHON_CLIENT_MEM_FRACTION={fraction} "
            "(JAX), TF_FORCE_GPU_ALLOW_GROWTH=true (TensorFlow); or reserve what it takes: "
            f"{need}"
        )

    def describe(self) -> str:
        """`uses 18.0 GiB of its 6.0 GiB reservation: <cause>; <advice>`."""
        return (
            f"uses {format_size(self.used_bytes)} of its {format_size(self.reserved_bytes)} "
            f"reservation: {self.cause()}; {self.advice()}"
        )


def overuse(
    reserved_bytes: int, used_bytes: int, total_bytes: int, margin: float
) -> Overuse | None:
    """The overuse when `used_bytes` (one GPU) passes the reservation by more than `margin`
    (a fraction; the estimate margin) and by at least MIN_EXCESS; None otherwise. A job with no
    byte reservation (exclusive: the whole card) never overuses."""
    if reserved_bytes <= 0:
        return None
    excess = used_bytes - reserved_bytes
    if excess < MIN_EXCESS or used_bytes <= reserved_bytes * (1 + max(0.0, margin)):
        return None
    return Overuse.seen(reserved_bytes, used_bytes, total_bytes)


def _tidy_gib(n_bytes: int) -> str:
    """A size to type, rounded up: `7G`, or `900M` below a GiB."""
    if n_bytes >= 2**30:
        return f"{-(-n_bytes // 2**30)}G"
    return f"{-(-n_bytes // 2**20)}M"
