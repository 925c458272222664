"""`gpuwait sim`: simulated GPUs for trying gpuwait and testing pipelines without a GPU."""

from __future__ import annotations

import argparse
import os
from typing import Any

from gpuwait.commands import output
from gpuwait.commands.parsing import Parser, whole_number
from gpuwait.core.errors import UsageError
from gpuwait.core.sizes import MAX_GPUS, format_size, parse_size
from gpuwait.core.text import shell_word


def build_parser() -> Parser:
    parser = Parser(
        prog="gpuwait sim",
        description="Simulated GPUs. `gpuwait sim init FILE` writes a simulation file; "
        "`export GPUWAIT_SIM=FILE`, its absolute path as init prints it, makes gpuwait use it; "
        "`gpuwait sim job --vram SIZE` is a "
        "simulated CUDA program (see `gpuwait sim job --help`).",
    )
    sub: Any = parser.add_subparsers(dest="action", metavar="{init,job}")
    init = sub.add_parser("init", help="write a simulation file")
    init.add_argument("path", metavar="FILE", help="file to write, e.g. ~/gpuwait-sim.toml")
    init.add_argument(
        "--gpus",
        type=whole_number(1, MAX_GPUS),
        default=2,
        metavar="N",
        help=f"number of simulated GPUs, at most {MAX_GPUS} (default: 2)",
    )
    init.add_argument(
        "--memory", default="24GiB", metavar="SIZE", help="VRAM of each (default: 24GiB)"
    )
    init.add_argument("--force", action="store_true", help="overwrite an existing file")
    init.add_argument(
        "--shared",
        action="store_true",
        help="root only: every user may run gpuwait and simulated jobs on it, and sees the "
        "others' jobs",
    )
    # Its options are the simulated program's own, parsed by it (`parse`): here for `--help`
    # and completion.
    from gpuwait.gpu import simjob

    sub.add_parser(
        "job", help="run a simulated CUDA job", parents=[simjob.build_parser()], add_help=False
    )
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    # `sim job`'s arguments are the simulated program's own, parsed by it.
    if argv and argv[0] == "job":
        return argparse.Namespace(action="job", job_args=argv[1:])
    return build_parser().parse_args(argv)


def run(args: argparse.Namespace) -> int:
    if args.action == "job":
        from gpuwait.gpu import simjob

        return simjob.main(args.job_args)
    if args.action != "init":
        raise UsageError("say `gpuwait sim init FILE` or `gpuwait sim job --vram SIZE`")
    from gpuwait.gpu.sim import make_shared_state_dir, write_sim_file

    try:
        memory = parse_size(args.memory)
    except ValueError as exc:
        raise UsageError(f"--memory {exc}") from None
    if memory <= 0:
        raise UsageError("--memory must be larger than zero")
    if not args.path.strip():
        # `sim init "$GPUWAIT_SIM"` with the variable unset: not the working directory.
        raise UsageError(
            "sim init: the file's path is empty",
            hint="name the file: gpuwait sim init ~/gpuwait-sim.toml (is GPUWAIT_SIM set here?)",
        )
    path = os.path.abspath(os.path.expanduser(args.path))
    if args.shared and os.geteuid() != 0:
        # gpuwait reads a simulation file only when it is the user's own or root's.
        raise UsageError(
            "only root can write a shared simulation: other users' gpuwait trusts no file of yours",
            hint=f"sudo gpuwait sim init {shell_word(path)} --shared",
        )
    try:
        write_sim_file(path, gpus=args.gpus, memory_bytes=memory, force=args.force)
        if args.shared:
            make_shared_state_dir(path)
    except FileExistsError:
        raise UsageError(f"{path} exists; use --force to overwrite it") from None
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror}") from None
    output.info(f"wrote {args.gpus} simulated GPU(s) of {format_size(memory)} to {path}")
    if args.shared:
        output.info(f"shared: every user may use it (its jobs' records are in {path}.d)")
    # A line to paste: quoted as the shell needs the path (a space, a quote in it); none where
    # GPUWAIT_SIM names the file already (the README exports it first).
    current = os.environ.get("GPUWAIT_SIM", "")
    if not current or os.path.abspath(os.path.expanduser(current)) != path:
        output.info(f"now: export GPUWAIT_SIM={shell_word(path)}")
    return 0
