"""`gpuwait status`: GPUs, running jobs, the queue and batches; `--json`, `--watch`.

The JSON report (`--json`) is versioned by its `schema` field and documented in docs/queue-and-status.md
("Queue, priorities and status"); fields are only ever added within a schema version.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from typing import Any

from gpuwait.commands import output
from gpuwait.commands.common import ledger_for, load_settings
from gpuwait.commands.parsing import Parser, terminal_columns
from gpuwait.config import Settings
from gpuwait.core.errors import EXIT_NO_GPU, BackendUnavailable, UsageError
from gpuwait.core.idle import IdleRule
from gpuwait.core.sizes import format_duration, format_size, parse_duration
from gpuwait.core.snapshot import COMPUTE_EXCLUSIVE_PROCESS, COMPUTE_PROHIBITED, MachineSnapshot
from gpuwait.core.text import columns, command_line, cut, printable, shell_word
from gpuwait.gpu import read_once
from gpuwait.linux import proc
from gpuwait.queue.bookkeeping import GPU_OK
from gpuwait.queue.conditions import name_processes
from gpuwait.queue.entries import RUNNING, Job, LedgerData
from gpuwait.queue.idle import record_reading, running_here
from gpuwait.queue.report import STATUS_SCHEMA, View, read_queue, report_from
from gpuwait.queue.wait import no_gpu_answers

_MIN_WIDTH = 80
_MAX_WIDTH = 160
#: The narrowest report (a tmux pane split in two): below 80 columns, columns are left out
#: (`render`); a terminal narrower still wraps its lines.
_NARROWEST = 60


def build_parser() -> Parser:
    parser = Parser(
        prog="gpuwait status",
        description="Show GPUs, running jobs, the queue and batches.",
    )
    parser.add_argument(
        "--json", action="store_true", help=f"machine-readable output (schema {STATUS_SCHEMA})"
    )
    parser.add_argument(
        "--watch",
        nargs="?",
        const="2s",
        metavar="INTERVAL",
        help="refresh every INTERVAL (default 2s) until Ctrl-C; in place on a terminal",
    )
    return parser


def run(options: argparse.Namespace) -> int:
    interval = None
    if options.watch is not None:
        try:
            interval = parse_duration(options.watch)
        except ValueError as exc:
            raise UsageError(f"--watch {exc}") from None
        if interval < 0.1:
            # As a duration past a year is told: what was given, and the bound.
            raise UsageError(f"--watch {options.watch.strip()!r} is too short (at least 0.1s)")
    settings = load_settings({})
    if interval is None:
        report = build_report(settings)
        _show(report, options.json, watching=False)
        # The queue is still shown, but a script asking whether the GPUs can be read must hear no.
        return EXIT_NO_GPU if report["backend_error"] else 0
    if output.redraws(sys.stdout) and not options.json:
        return _watch_screen(settings, interval)
    try:
        while True:
            _show(build_report(settings), options.json, watching=True)
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0


def _watch_screen(settings: Settings, interval: float) -> int:
    """`--watch` on a terminal, as `top` and `watch` do it: a screen of its own (the
    alternate screen, given back as it was on Ctrl-C), each report drawn over the last one,
    clipped to the window."""
    import signal

    def leave(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    # Closed or killed, the terminal gets its own screen back all the same.
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, leave)
    sys.stdout.write(_ENTER_SCREEN)
    try:
        while True:
            report = build_report(settings)
            across, rows = _terminal_size()
            title = f"gpuwait status, every {format_duration(interval)} (Ctrl-C to quit)"
            clock = output.local_time(report["generated_at"], "%H:%M:%S")
            lines = [title + clock.rjust(max(1, across - len(title))), ""]
            lines += [f"gpuwait: warning: {printable(w, 1000)}" for w in report["warnings"]]
            if report["backend_error"]:
                lines.append(f"gpuwait: error: {printable(report['backend_error'], 1000)}")
                if report["backend_hint"]:
                    lines.append(f"gpuwait: hint: {printable(report['backend_hint'], 1000)}")
            lines += render(report, terminal_width(across)).splitlines()
            # Home and clear, then the whole frame: one write, so the screen never shows half.
            sys.stdout.write("\033[H\033[2J" + "\n".join(fit_screen(lines, across, rows)))
            sys.stdout.flush()
            time.sleep(interval)
    except KeyboardInterrupt:
        return 0
    finally:
        sys.stdout.write(_LEAVE_SCREEN)
        sys.stdout.flush()


#: The alternate screen with the cursor hidden, and back (the shell's screen as it was).
_ENTER_SCREEN = "\033[?1049h\033[?25l"
_LEAVE_SCREEN = "\033[?25h\033[?1049l"


def fit_screen(lines: list[str], width: int, rows: int) -> list[str]:
    """`lines` as a screen of `width` x `rows` shows them: each cut at the width, and those
    past the height left out, the last row then saying how many. The report puts what matters
    most first (GPUs, running jobs, the queue), so it is the rest that goes."""
    lines = [cut(line, width) for line in lines]
    if len(lines) <= rows:
        return lines
    kept = max(0, rows - 1)
    hidden = len(lines) - kept
    return [*lines[:kept], f"… {hidden} more rows hidden; a taller window shows them"[:width]]


def _terminal_size() -> tuple[int, int]:
    try:
        size = os.get_terminal_size(sys.stdout.fileno())
    except (OSError, ValueError):
        return _MIN_WIDTH, 24
    return size.columns or _MIN_WIDTH, size.lines or 24


def build_report(settings: Settings) -> dict[str, Any]:
    """Read the GPUs and the ledger once; the whole dashboard as plain data."""
    snapshot: MachineSnapshot | None = None
    problem: str | None = None
    hint: str | None = None
    try:
        snapshot = read_once(settings.sim, settings.nvml_timeout)
    except BackendUnavailable as exc:
        problem, hint = exc.message, exc.hint
    # Not one GPU answering (every card lost, the driver gone) is a reading that failed, as a
    # launch takes it; the lost GPUs are still shown with what the ledger knows of them.
    if snapshot is not None and (silent := no_gpu_answers(snapshot)) is not None:
        problem, hint = silent.message, silent.hint
    ignore = frozenset(settings.ignore_processes)
    if snapshot is not None and ignore:
        snapshot = name_processes(snapshot)
    ledger = ledger_for(settings)
    data, now = read_queue(ledger, snapshot)
    fair = settings.fair_share()
    # A shared ledger's queue is planned in the site's order, whatever the user's own.
    view = View(
        safety=settings.safety,
        ignore_processes=ignore,
        fair=fair.in_shared_ledger() if ledger.shared else fair,
    )
    report = report_from(
        snapshot, data, now, view, ledger.take_warnings(), problem, proc.boot_clock()
    )
    report["ledger_shared"] = bool(ledger.shared)
    #: What to do about `backend_error` (install the driver, reboot after an upgrade), if known.
    report["backend_hint"] = hint
    _add_frozen(report, data)
    _add_visible_here(report, snapshot)
    quiet = idle_holders(settings, snapshot, data.jobs, ignore)
    report["idle"] = [h for h in quiet if h["idle_seconds"] >= settings.idle_after]
    #: Holding memory on a quiet GPU, but not seen so for `idle_after` yet.
    report["idle_watching"] = [h for h in quiet if h["idle_seconds"] < settings.idle_after]
    return report


def _add_frozen(report: dict[str, Any], data: LedgerData) -> None:
    """Each job's `frozen`: since when and on which GPUs (where it is thawed), or None."""
    entries = {j.id: j for j in data.jobs}
    index = {g["uuid"]: g["index"] for g in report["gpus"]}
    for shown in report["jobs"]:
        entry = entries.get(shown["id"])
        if entry is None or entry.frozen_at is None:
            shown["frozen"] = None
            continue
        shown["frozen"] = {
            "since": entry.frozen_at,
            "gpu_uuids": list(entry.frozen_gpus),
            "gpu_indices": [index.get(u) for u in entry.frozen_gpus],
        }


def _add_visible_here(report: dict[str, Any], snapshot: MachineSnapshot | None) -> None:
    """Each GPU's `visible_here`: may a job started from this shell be placed on it, as
    CUDA_VISIBLE_DEVICES (a Slurm allocation's, a container's) leaves it visible, read as a
    launch reads it; None where the GPUs could not be read. `visible_from` says the value.
    In a Slurm job or step given no GPU where Slurm hands GPUs out, where a launch is refused,
    none is: `slurm_gave_no_gpu` names the slurm.conf that says so."""
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    report["visible_from"] = inherited
    report["slurm_gave_no_gpu"] = None
    if inherited is None and "SLURMD_NODENAME" in os.environ:
        from gpuwait.linux.slurm import job_without_gpus

        report["slurm_gave_no_gpu"] = job_without_gpus(os.environ)
    visible: set[str] | None = set() if report["slurm_gave_no_gpu"] else None
    if inherited is not None and snapshot is not None:
        from gpuwait.core.devices import parse_inherited_visible

        visible = set(
            parse_inherited_visible(inherited, snapshot.gpus, snapshot.in_mig_mode, snapshot.hidden)
        )
    for g in report["gpus"]:
        if inherited is None and visible is None:
            g["visible_here"] = True
        else:
            g["visible_here"] = None if visible is None else g["uuid"] in visible


def _hidden_note(report: dict[str, Any]) -> str | None:
    """The GPUs no job started from this shell goes to (`_add_visible_here`), in words."""
    hidden = [str(g["index"]) for g in report["gpus"] if g.get("visible_here") is False]
    if not hidden:
        return None
    them = "it" if len(hidden) == 1 else "them"
    why = f"CUDA_VISIBLE_DEVICES={shell_word(report['visible_from'])}"
    conf = report["slurm_gave_no_gpu"]
    if conf:
        given = (
            "this step none of its job's GPUs"
            if os.environ.get("SLURM_JOB_GPUS")
            else "this job no GPU"
        )
        why = f"Slurm gave {given}; {conf} hands this node's GPUs out as GRES"
    return (
        f"GPU {', '.join(hidden)} not visible here ({why}): gpuwait places no job "
        f"started from this shell on {them}"
    )


def idle_rule(settings: Settings) -> IdleRule:
    return IdleRule(
        min_bytes=settings.idle_min_vram,
        max_util_pct=settings.idle_max_util,
        after=settings.idle_after,
    )


def idle_holders(
    settings: Settings,
    snapshot: MachineSnapshot | None,
    jobs: Sequence[Job],
    ignore: frozenset[str],
) -> list[dict[str, Any]]:
    """This reading added to the evidence of idle VRAM holders, and every process holding
    `idle_min_vram` on a quiet GPU, with how long it has been seen so."""
    if snapshot is None:
        return []
    return record_reading(
        settings.machine_path, snapshot, idle_rule(settings), running_here(jobs), ignore
    )


def _show(report: dict[str, Any], as_json: bool, watching: bool) -> None:
    if as_json:
        # Watching, one report per line (JSON Lines), so a reader can take them one by one.
        print(output.json_text(report, indent=None if watching else 2))
        sys.stdout.flush()
        return
    for message in report["warnings"]:
        output.warn(message)
    if report["backend_error"]:
        output.error(report["backend_error"], report["backend_hint"])
    sys.stdout.write(render(report, terminal_width()))
    sys.stdout.flush()


def terminal_width(columns: int | None = None) -> int:
    """The width a report is laid out in: the terminal's (or `columns`), within _NARROWEST and
    _MAX_WIDTH (`status`, `idle`)."""
    if columns is None:
        # As shutil.get_terminal_size measures it, but without importing shutil (and the
        # compression modules it loads): some 2 ms of every `status`.
        columns = terminal_columns()
    return min(max(columns, _NARROWEST), _MAX_WIDTH)


# --- text --------------------------------------------------------------------------------------


def _size(n: int | None) -> str:
    """Compact: 24.0G, 512M, 1.5T; '-' when unknown."""
    if n is None:
        return "-"
    for unit, scale in (("T", 2**40), ("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n >= scale:
            value = n / scale
            return f"{value:.1f}{unit}" if value < 100 else f"{value:.0f}{unit}"
    return f"{n}B"


def _ago(seconds: float) -> str:
    # Under a second is "just now": "0ms ago" reads like a clock gone wrong.
    return "just now" if seconds < 1 else format_duration(seconds) + " ago"


def _clip(text: str, width: int) -> str:
    # Another user's entry may hold anything: never print their escape sequences.
    return printable(text, max(1, width))


def _owner_cell(report: dict[str, Any]) -> Callable[[dict[str, Any] | None], str]:
    """The USER column of the job tables (the heading for None): where users share the ledger,
    or jobs of several users are shown, whose each job is, so that "held until a job ends"
    says whose. A private ledger's single user would only see their own name again."""
    if not report.get("ledger_shared") and len({j.get("uid") for j in report["jobs"]}) < 2:
        return lambda job: ""

    def cell(job: dict[str, Any] | None) -> str:
        uid = None if job is None else job.get("uid")
        name = "USER" if job is None else "?" if uid is None else proc.user_name(uid)
        return _cell(name, 10) + " "

    return cell


def _cell(text: str, width: int) -> str:
    """`text` as a column of a table, `width` columns of the terminal wide whatever its
    characters (a Chinese one takes two)."""
    shown = _clip(text, width)
    return shown + " " * (width - columns(shown))


def _extern(gpu: dict[str, Any]) -> int | None:
    """Memory used outside gpuwait by processes: the driver's own memory is no process's."""
    if gpu["external_bytes"] is None:
        return None
    return max(0, int(gpu["external_bytes"]) - int(gpu.get("driver_bytes") or 0))


def _driver_note(gpus: list[dict[str, Any]]) -> str | None:
    """What the driver keeps for itself, where it says: nvidia-smi leaves it out of "used",
    so the dashboard says why its "used" is higher on an idle card."""
    kept = [g["driver_bytes"] for g in gpus if g.get("driver_bytes")]
    if not kept:
        return None
    low, high = _size(min(kept)), _size(max(kept))
    amount = low if low == high else f"{low} to {high}"
    each = "some GPUs" if len(kept) < len(gpus) else "the GPU" if len(gpus) == 1 else "each GPU"
    return f"the NVIDIA driver keeps {amount} of {each}: part of used, not of extern"


#: What a GPU's compute mode (other than the default) means for the jobs placed on it.
_MODE_NOTES = {
    COMPUTE_EXCLUSIVE_PROCESS: "one process at a time, so one job at a time",
    COMPUTE_PROHIBITED: "runs no CUDA work; never chosen",
}


def render(report: dict[str, Any], width: int = _MIN_WIDTH) -> str:
    """The dashboard as text, no line longer than `width` (at least 60). Narrower than 80
    columns, these are left out: the GPUs' name and extern, the running jobs' USED and ELAPSED,
    and the queue's PRI; notes are wrapped onto more lines."""
    now = report["generated_at"]
    wide = width >= _MIN_WIDTH
    out: list[str] = []
    backend = report["backend"] or "unavailable"
    out.append(f"GPUs ({backend}, safety {report['safety']:g}; job counts since the ledger began)")
    name_head, extern_head = (f"{'name':<16} ", f"{'extern':>6} ") if wide else ("", "")
    out.append(
        f" {'GPU':>3} {name_head}{'total':>6} {'used':>6} {extern_head}{'reserv':>6} "
        f"{'free':>6} {'util':>4}  health"
    )
    for g in report["gpus"]:
        util = "-" if g["utilization_pct"] is None else f"{g['utilization_pct']}%"
        if g["health"] == GPU_OK:
            health = "ok" if not g["held_for"] else f"held for {g['held_for']}"
        else:
            health = f"LOST {_ago(now - g['health_since'])}"
        name = f"{_cell(g['name'], 16)} " if wide else ""
        extern = f"{_size(_extern(g)):>6} " if wide else ""
        out.append(
            _clip(
                f" {g['index']:>3} {name}{_size(g['total_bytes']):>6} "
                f"{_size(g['used_bytes']):>6} {extern}"
                f"{_size(g['reserved_bytes']):>6} {_size(g['free_bytes']):>6} {util:>4}  {health}",
                width,
            )
        )
        c = g["counters"]
        rate = c["throughput_per_hour"]
        line = (
            f"jobs: {len(g['running_jobs'])} running, {c['dispatched']} dispatched, "
            f"{c['completed']} completed, {c['failed']} failed"
        )
        if c.get("oom"):
            line += f", {c['oom']} out of memory"
        if rate is not None:
            line += f", {rate:.1f}/h"
        out.extend(note(line, width))
        mode = _MODE_NOTES.get(g.get("compute_mode") or "")
        if mode:
            out.extend(note(f"compute mode {g['compute_mode']}: {mode}", width))
        if g["health"] != GPU_OK:
            detail = f" ({g['health_detail']})" if g["health_detail"] else ""
            jobs = ", ".join(g["running_jobs"]) or "none"
            out.extend(note(f"not answering{detail}; jobs still on it: {jobs}", width))
    not_here = _hidden_note(report)
    if not_here:
        out.extend(note(not_here, width))
    driver = _driver_note(report["gpus"])
    if driver:
        out.extend(note(driver, width))
    running = [j for j in report["jobs"] if j["state"] == RUNNING]
    waiting = [j for j in report["jobs"] if j["state"] != RUNNING]
    owner = _owner_cell(report)
    out.append("")
    out.append(f"Running ({len(running)})")
    if running:
        used_head = f"{'USED':>6} {'ELAPSED':>7} " if wide else ""
        fixed = f" {'ID':<8} {'NAME':<12} {owner(None)}{'GPU':<5} {'RESERV':>6} {used_head}{'LEFT':>7}  "
        out.append(fixed + "COMMAND")
    for j in running:
        gpus = ",".join("?" if i is None else str(i) for i in j["gpu_indices"])
        left = j["expected_remaining_seconds"]
        # Past its expected run time: say so, not "~0ms" (it may run on for long yet).
        left_text = "-" if left is None else "overdue" if left <= 0 else "~" + format_duration(left)
        used = (
            f"{_size(j['observed_bytes']):>6} {format_duration(j['elapsed_seconds'] or 0):>7} "
            if wide
            else ""
        )
        line = (
            f" {printable(j['id'], 16):<8} {_cell(j['name'] or '-', 12)} {owner(j)}"
            f"{_clip(gpus, 5):<5} "
            f"{_size(j['reserved_bytes']):>6} {used}{left_text:>7}  "
        )
        out.append(line + _clip(command_line(j["command"]), width - columns(line)))
        if j["lost_gpus"]:
            out.extend(note("on a GPU that is not answering now", width))
        if j["held_by"]:
            out.extend(note("budget held by: " + ", ".join(j["held_by"]), width))
        if j["overuse"]:
            out.extend(
                textwrap.wrap(
                    "over its reservation: " + j["overuse"]["text"],
                    width,
                    initial_indent="     ",
                    subsequent_indent="       ",
                )
            )
        if j["pause_asked_by"]:
            asked = j["pause_asked_by"]
            out.extend(
                note(
                    f"asked to checkpoint and step aside by job {printable(asked['job'], 24)}"
                    f" (uid {asked['uid']}){', signalled' if asked['signalled'] else ''}",
                    width,
                )
            )
        if j["orphaned"]:
            out.extend(
                note(
                    f"orphaned: its gpuwait is gone; command pid {j['child_pid']} keeps "
                    "its room until it ends",
                    width,
                )
            )
    out.append("")
    out.append(f"Queue ({len(waiting)})")
    if waiting:
        pri_head = f"{'PRI':<3} " if wide else ""
        fixed = (
            f" {'#':>3} {'ID':<8} {'NAME':<12} {owner(None)}{pri_head}{'NEEDS':<11} {'ETA':>6}  "
        )
        out.append(fixed + "COMMAND")
    for j in waiting:
        eta = j["eta_seconds"]
        eta_text = "-" if eta is None else "~" + format_duration(eta)
        pri = f"p{j['priority']:<2} " if wide else ""
        line = (
            f" {j['position']:>3} {printable(j['id'], 16):<8} {_cell(j['name'] or '-', 12)} "
            f"{owner(j)}{pri}{_clip(_needs(j), 11):<11} {eta_text:>6}  "
        )
        out.append(line + _clip(command_line(j["command"]), width - columns(line)))
        frozen = j.get("frozen")
        if frozen:
            on = ",".join("?" if i is None else str(i) for i in frozen["gpu_indices"])
            out.extend(
                note(
                    f"frozen {_ago(report['generated_at'] - frozen['since'])}: its memory is in "
                    f"host memory; thawed on GPU {on} once there is room",
                    width,
                    "      ",
                )
            )
        elif j.get("pauses"):
            out.extend(
                note(
                    f"stepped aside {j['pauses']}× (checkpointed); resumes from its "
                    f"checkpoint, queued at p{j.get('queued_priority', j['priority'])}",
                    width,
                    "      ",
                )
            )
        if j["waiting_reason"]:
            out.extend(
                textwrap.wrap(
                    printable(j["waiting_reason"], 1000),
                    width=width,
                    initial_indent="      ",
                    subsequent_indent="        ",
                )
            )
    out.extend(render_idle(report.get("idle", []), width, heading=True))
    if report["batches"]:
        out.append("")
        out.append(f"Batches ({len(report['batches'])})")
        shown = _batches_shown(report["batches"])
        tallies = []
        for b in shown:
            extra = f", {b['cancelled']} cancelled" if b["cancelled"] else ""
            tallies.append(
                f"{b['done']}/{b['total']} done, {b['running']} running, "
                f"{b['waiting']} waiting, {b['failed']} failed{extra}"
            )
        # Names as long as the lines leave room for: batches named alike (by date, by run)
        # often differ only at the end.
        longest = max(columns(b["name"]) for b in shown)
        room = width - 2 - max(len(t) for t in tallies)
        column = max(20, min(longest, room))
        for b, tally in zip(shown, tallies, strict=True):
            out.append(_clip(f" {_cell(b['name'], column)} {tally}", width))
        hidden = len(report["batches"]) - len(shown)
        if hidden:
            more = f" … {hidden} more that ended earlier (`gpuwait status --json` lists them)"
            out.append(_clip(more, width))
    out.extend(_render_users(report, width))
    return "\n".join(out) + "\n"


def note(text: str, width: int, indent: str = "     ") -> list[str]:
    """A note under a row of a table: indented, and wrapped where it is longer than the width
    (rather than cut, which would take its end, often what it says)."""
    return textwrap.wrap(
        printable(text, 1000), width, initial_indent=indent, subsequent_indent=indent + "  "
    )


#: Batches whose jobs have all ended that `status` shows, those that ended last: the ledger
#: remembers a hundred (a batch a night, named by its date, for months).
ENDED_BATCHES_SHOWN = 5


def _batches_shown(batches: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The batches with jobs running or waiting, and the ENDED_BATCHES_SHOWN that ended last,
    in the report's order (by name)."""
    ended = [b for b in batches if not (b["running"] or b["waiting"])]
    latest = sorted(ended, key=lambda b: b["ended_at"] or 0.0, reverse=True)
    hidden = {id(b) for b in latest[ENDED_BATCHES_SHOWN:]}
    return [b for b in batches if id(b) not in hidden]


def render_idle(holders: list[dict[str, Any]], width: int, heading: bool) -> list[str]:
    """Idle VRAM holders, one line each; under `heading` only where there is one."""
    if heading and not holders:
        return []
    out = ["", f"Idle VRAM holders ({len(holders)})"] if heading else []
    if holders:
        fixed = f" {'GPU':>3} {'PID':>7} {'USER':<10} {'VRAM':>6} {'IDLE':>7} {'JOB':<8}  "
        out.append(fixed + "COMMAND")
    for h in holders:
        line = (
            f" {h['gpu_index']:>3} {h['pid']:>7} {_cell(h['user'] or '?', 10)} "
            f"{_size(h['used_bytes'] or h['reserved_bytes']):>6} "
            f"{format_duration(h['idle_seconds']):>7} "
            f"{printable(h['job'] or '-', 16):<8}  "
        )
        # The program's name is what tells a forgotten kernel from a server; its directory
        # (often a long venv path, for the interpreter and its script) would leave no room for
        # the arguments. `--json` has them whole.
        command = [
            os.path.basename(w) if i < 2 and w.startswith("/") else w
            for i, w in enumerate(h["command"])
        ]
        what = command_line(command) or "?"
        if h["reserved_bytes"]:
            # Nothing of the job on the GPU: its room, held reserved, keeps others waiting.
            what = f"[{_size(h['reserved_bytes'])} reserved, unused] {what}"
        out.append(line + _clip(what, width - columns(line)))
    return out


def _needs(job: dict[str, Any]) -> str:
    request = job["request"]
    if job["exclusive"]:
        per = "whole"
    elif "bytes" in request:
        per = _size(int(request["bytes"]))
    else:
        per = f"{float(request['fraction']) * 100:g}%"
    return per if job["gpus"] == 1 else f"{per} x{job['gpus']}"


def _render_users(report: dict[str, Any], width: int) -> list[str]:
    """Who holds and waits for what, and the usage fair share orders users by: only where more
    than one user can meet (a shared ledger, or several users with jobs) or per-user limits
    apply. A private ledger's single user would only see their own jobs counted again."""
    users: list[dict[str, Any]] = report["users"]
    fair_share: dict[str, Any] = report["fair_share"]
    limited = (
        fair_share["user_max_gpus"] is not None or fair_share["user_max_vram_bytes"] is not None
    )
    if not users or not (report.get("ledger_shared") or len(users) > 1 or limited):
        return []
    caps = []
    if fair_share["user_max_gpus"] is not None:
        caps.append(f"at most {fair_share['user_max_gpus']} GPUs")
    if fair_share["user_max_vram_bytes"] is not None:
        caps.append(f"at most {format_size(fair_share['user_max_vram_bytes'])}")
    half_life = fair_share["half_life_seconds"]
    share = "off" if half_life is None else f"half-life {format_duration(half_life)}"
    extra = f"; per user {', '.join(caps)}" if caps else ""
    out = ["", _clip(f"Users (fair share {share}{extra})", width)]
    for u in users:
        # Jobs that use more than they reserved hold, and count against a limit, that much.
        held = u.get("vram_counted_bytes", u["vram_held_bytes"])
        row = (
            f" {_cell(u['user'], 12)} {u['running']:>3} running {u['waiting']:>3} "
            f"waiting {u['gpus_held']:>2} GPUs {format_size(held):>8} held "
        )
        if held != u["vram_held_bytes"]:
            row = f"{row.rstrip()} ({format_size(u['vram_held_bytes'])} reserved) "
        usage = f"usage {u['usage_vram_seconds'] / 2**30 / 3600:.2f} GiB·h"
        # Narrower than the row, the usage goes on a line of its own, under the counts.
        fits = columns(row + usage) <= width
        out.extend([row + usage] if fits else [_clip(row.rstrip(), width), " " * 14 + usage])
    return out
