"""`gpuwait adopt PID`: give a process started without gpuwait an entry in the ledger.

The entry is a running job whose gpuwait and command are both the adopted process: the queue
counts its VRAM as a job's (its reservation, not also as an outside process's use), `status`
shows it with the jobs, and the reaping of every transaction takes it out and records its run
in the history once the process has ended (gpuwait.queue.lifecycle.adopt). `adopt` itself
exits at once.
"""

from __future__ import annotations

import argparse
import os
import time

from gpuwait.commands import output
from gpuwait.commands.common import ledger_for, load_settings
from gpuwait.commands.parsing import Parser, check_name, whole_number
from gpuwait.core.errors import EXIT_NOT_PERMITTED, UsageError
from gpuwait.core.sizes import (
    REQUEST_UNIT_HINT,
    MemoryRequest,
    format_size,
    parse_request,
    parse_size,
)
from gpuwait.core.text import entry_command, printable
from gpuwait.gpu import read_once
from gpuwait.linux import proc
from gpuwait.queue import lifecycle
from gpuwait.queue.conditions import reserved_on_each
from gpuwait.queue.entries import RUNNING, Job


def build_parser() -> Parser:
    parser = Parser(
        prog="gpuwait adopt",
        description="Give a running process started without gpuwait (yours; root: anyone's) an "
        "entry in the queue: it is counted as a job with a reservation, shown by `status`, and "
        "its end is recorded in the history (exit status unknown).",
    )
    parser.add_argument("pid", type=whole_number(1, 2**31 - 1), metavar="PID", help="its pid")
    parser.add_argument(
        "--vram",
        metavar="SIZE",
        help="its reservation per GPU (e.g. 6G, or 50%%: that share of each card it is on); "
        "default: what it uses now",
    )
    parser.add_argument("--name", metavar="NAME", help="a name for the job, as --name gives one")
    return parser


def run(options: argparse.Namespace) -> int:
    pid: int = options.pid
    # The arguments before the process: a name no job can have is refused as it is by
    # `gpuwait --name`, whatever the process is.
    check_name("--name", options.name)
    reserve: MemoryRequest | None = None
    if options.vram is not None:
        try:
            # A share (`50%`) of each card the process is on, as `gpuwait --vram 50%` takes it.
            reserve = (
                parse_request(options.vram)
                if options.vram.strip().endswith("%")
                else MemoryRequest(bytes=parse_size(options.vram, hint=REQUEST_UNIT_HINT))
            )
        except ValueError as exc:
            raise UsageError(f"--vram {exc}") from None
        if reserve.bytes is not None and reserve.bytes <= 0:
            raise UsageError("--vram: reserve more than 0 bytes")
    start = proc.start_time(pid)
    owner = proc.owner_uid(pid)
    if start is None or owner is None:
        raise UsageError(f"no process {pid}", hint="see `ps` for the pid")
    me = os.getuid()
    settings = load_settings({})
    if owner != me and me != 0:
        output.error(f"process {pid} belongs to uid {owner}: only your own can be adopted")
        return EXIT_NOT_PERMITTED
    if owner != me and settings.ledger_dir is not None:
        # In a shared ledger directory each user's entries live in a file only they write.
        output.error(
            f"process {pid} belongs to uid {owner}: in a shared ledger directory only its "
            "owner can adopt it"
        )
        return EXIT_NOT_PERMITTED
    ledger = ledger_for(settings)
    # Before the GPUs are read: a job's command still loading uses no memory yet, and is no
    # process to adopt either way.
    tree = proc.process_tree([pid])
    data = ledger.read()
    lifecycle.refuse_a_jobs_process(data, pid)
    # Jobs below it (a shell that runs one) keep their own reservations.
    tree = set(tree) - lifecycle.jobs_processes(data, tree)
    snapshot = read_once(settings.sim, settings.nvml_timeout)
    if os.getpid() in tree:
        if not any(p.pid == pid for g in snapshot.gpus for p in g.processes):
            # `gpuwait adopt $$`, 1: a shell or session lives on, and holds all that runs
            # below it.
            raise UsageError(
                f"process {pid} runs this gpuwait below it (a shell, a session or init), and "
                "would hold for as long as it lives what every program below it uses",
                hint="adopt the process that uses the GPU itself (see `nvidia-smi`)",
            )
        # A program on the GPU itself adopting itself (a notebook's kernel, from a cell:
        # `!gpuwait adopt {os.getpid()}`): the shell and this gpuwait below it are not its. A
        # child of its between them that is on a GPU itself (a worker adopting the program
        # it runs under) is: its memory is the program's, as any child's is.
        on_gpu = {p.pid for g in snapshot.gpus for p in g.processes}
        tree -= {os.getpid(), *proc.ancestors(os.getpid())} - {pid} - on_gpu
    using = {g.uuid: g.process_bytes(tree) for g in snapshot.gpus}
    using = {uuid: used for uuid, used in using.items() if used > 0}
    # Listed by the driver without a memory figure (NVML's "not available": WDDM under WSL2,
    # some containers): on that card all the same, its use unknown.
    untold = [
        g
        for g in snapshot.gpus
        if g.uuid not in using and any(p.pid in tree and p.used_bytes is None for p in g.processes)
    ]
    if untold and reserve is None:
        raise UsageError(
            f"the driver does not tell how much GPU memory process {pid} uses (on GPU "
            f"{', '.join(str(g.index) for g in untold)})",
            hint="give its reservation: gpuwait adopt PID --vram SIZE",
        )
    if reserve is not None:
        using.update({g.uuid: 0 for g in untold})
    if not using:
        what = "" if reserve is None else f" for its {reserve.describe()}"
        raise UsageError(
            f"process {pid} uses no GPU memory that gpuwait can see: no GPU to reserve{what} on",
            hint="adopt it once it has allocated memory on its GPUs",
        )
    # Without --vram, what it uses on each of its GPUs, not its most on every one; with a
    # share, that share of each.
    totals = {g.uuid: g.total_bytes for g in snapshot.gpus}
    per_gpu = using if reserve is None else {u: reserve.on(totals[u]) for u in using}
    reserved = max(per_gpu.values())
    command = entry_command(proc.command_line(pid) or [proc.command_name(pid) or str(pid)])
    now, boot_now = time.time(), proc.boot_clock()
    job = Job(
        id=os.urandom(4).hex(),
        pid=pid,
        start_time=start,
        uid=owner,
        command=command,
        cwd=proc.working_dir(pid) or "/",
        request={"bytes": reserved},
        gpus=len(using),
        state=RUNNING,
        gpu_uuids=sorted(using, key=lambda u: next(g.index for g in snapshot.gpus if g.uuid == u)),
        reserved_bytes=reserved,
        reserved_by_gpu={u: b for u, b in per_gpu.items() if b < reserved},
        observed={uuid: used for uuid, used in using.items() if used > 0},
        pids=sorted(tree),
        child_pid=pid,
        child_start_time=start,
        submitted_at=now,
        started_at=now,
        submitted_boot=boot_now,
        started_boot=boot_now,
        started_slept=proc.slept(boot_now),
        updated_at=now,
        name=options.name,
        adopted_history=str(settings.state_path),
        adopted_commands=settings.history_commands,
    )
    job = lifecycle.adopt(ledger, job, snapshot.gpus, settings.fair_share().limits)
    indexes = ",".join(str(g.index) for g in snapshot.gpus if g.uuid in using)
    each = reserved_on_each(job, snapshot.gpus)
    held = f"{each} reserved" if each else f"{format_size(reserved)} reserved on GPU {indexes}"
    name = f" ({printable(job.name, 100)})" if job.name else ""
    output.info(f"adopted process {pid} as job {job.id}{name}: {held}")
    return 0
