"""`%gpuwait`, the IPython line magic (`%load_ext gpuwait`): `gpuwait.reserve` for a notebook.

    %gpuwait 6G --priority 4 --timeout 30m    reserve (the command line's options)
    %gpuwait release                          give the room back
    %gpuwait status                           this kernel's reservation

It says what it does as the CLI does (gpuwait.commands.output: warnings, the waiting line,
`gpuwait: error: ...`), in the cell's output, and returns the Reservation. Only this module
knows IPython, and only as the object it is handed.
"""

from __future__ import annotations

import shlex
from typing import Any

from gpuwait.api.reserve import Reservation, ReserveError, current, reserve_argv
from gpuwait.commands import output
from gpuwait.core.sizes import format_size

USAGE = "usage: %gpuwait SIZE [OPTIONS] | %gpuwait release | %gpuwait status"


def load_ipython_extension(ipython: Any) -> None:
    ipython.register_magic_function(gpuwait_magic, magic_kind="line", magic_name="gpuwait")


def gpuwait_magic(line: str) -> Reservation | None:
    try:
        words = shlex.split(line)
    except ValueError as exc:
        output.error(f"{exc}; {USAGE}")
        return None
    if not words or words == ["status"]:
        return _status()
    if words == ["release"]:
        _release()
        return None
    argv = words if words[0].startswith("-") else ["--vram", *words]
    quiet = "-q" in argv or "--quiet" in argv
    try:
        reservation = reserve_argv(argv, output.Console(quiet))
    except SystemExit:
        return None  # --help or --version: argparse has said it
    except ReserveError as exc:
        output.error(exc.message, exc.hint)
        return None
    if reservation.held and not quiet:
        output.info(f"reserved {_where(reservation)} for this kernel (job {reservation.job_id})")
    return reservation


def _where(reservation: Reservation) -> str:
    gpus = ", ".join(f"GPU{i}" for i in reservation.gpus)
    return f"{format_size(reservation.vram)} on {gpus}"


def _status() -> Reservation | None:
    held = current()
    if held is None:
        output.info(f"no reservation in this kernel; {USAGE}")
        return None
    output.info(f"job {held.job_id} holds {_where(held)}; peak so far {format_size(held.peak)}")
    return held


def _release() -> None:
    held = current()
    if held is None:
        output.info("no reservation in this kernel to release")
        return
    held.release()
    output.info(f"released job {held.job_id} ({_where(held)}; peak {format_size(held.peak)})")
