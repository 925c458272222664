"""Where the evidence of idle VRAM holders lives between readings, and who they are.

No daemon watches the GPUs, so each `gpuwait status` and `gpuwait idle` (and, with
`idle_action = pause`, each waiter's reading) adds its reading to the evidence (`core/idle`)
in `idle.json` in the user's state dir (this machine's directory under it, where several
machines share it: another machine's pids name other processes), and names the processes it
shows idle long enough: owner, command line, and the gpuwait job they belong to, if any.
The file is the user's own and only ever a hint: lost or damaged, the evidence starts again.

Its times are the machine's boot time (CLOCK_BOOTTIME, the same for every process, counting a
suspend too), not the wall clock: a wall clock stepped forward (NTP) is no idleness. The file
names the boot it was written in: what an earlier boot saw is dropped, both its times, which
were on that boot's clock, and its processes (pid and start time, which a process of this
boot may have again: the same service, started again at the same tick).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import Any

from gpuwait.core.idle import (
    Evidence,
    IdleHolder,
    IdleRule,
    idle_holders,
    observe,
    quiet,
    with_unused_rooms,
)
from gpuwait.core.record import Record
from gpuwait.core.snapshot import MachineSnapshot
from gpuwait.linux import proc, security
from gpuwait.linux.atomic import remove_left_temp_files, write_atomic
from gpuwait.queue.conditions import their_own_processes
from gpuwait.queue.entries import RUNNING, Job, LedgerData, elsewhere, of_an_earlier_boot

IDLE_FILE = "idle.json"
#: 2: times on the boot-time clock (1: the wall clock's, not read).
_VERSION = 2
#: A machine's GPU processes fit in far less; a bigger file is not ours.
_CAP = 1 << 20
_TEMP_RE = re.compile(r"^\.idle\.json\.[0-9]+\.tmp\Z")
#: Seconds: a temporary file unchanged this long is no live writer's (a write takes milliseconds).
_TEMP_AGE = 600.0


def record_reading(
    state_dir: Path,
    snapshot: MachineSnapshot,
    rule: IdleRule,
    running: Sequence[Job],
    ignore: Collection[str] = (),
    now: float | None = None,
) -> list[dict[str, Any]]:
    """Add `snapshot` to the evidence and return, as plain data, every process it shows
    holding at least `rule.min_bytes` on a quiet GPU, with how long it has been seen so
    (`idle_seconds`): those at `rule.after` or more are the idle ones.
    `running`: the running jobs whose commands are processes here (`running_here`): a process
    of one is named with its job, and a job holding room where none of its processes shows (a
    notebook's reservation not used) counts as holding it; `now`: on the evidence's clock
    (`proc.boot_clock`)."""
    now = proc.boot_clock() if now is None else now
    jobs = {j.child_pid: j.id for j in running if j.child_pid}
    rooms = {
        j.child_pid: {u: j.reserved_on(u) for u in j.gpu_uuids} for j in running if j.child_pid
    }
    # A job's room counts on a quiet GPU only: on none, no process tree needs walking.
    any_quiet = any(quiet(g, rule) for g in snapshot.gpus)
    members = _members(jobs) if rooms and any_quiet else {}
    snapshot, unused = with_unused_rooms(snapshot, rooms if any_quiet and rooms else {}, members)
    starts = {p.pid: proc.start_time(p.pid) for g in snapshot.gpus for p in g.processes}
    path = state_dir / IDLE_FILE
    previous = _load(path, now)
    evidence = observe(previous, snapshot, starts, rule, now, ignore, unused)
    if evidence != previous:
        _save(state_dir, path, evidence)
    # Those seen quiet for less than `after` too: evidence starts at the first reading, and a
    # user who asks once deserves to hear that a holder is watched, not that there is none.
    holders = idle_holders(evidence, snapshot, starts, rule._replace(after=0.0), now, unused)
    if holders and not members:
        members = _members(jobs)
    return [_describe(h, now, jobs.get(members.get(h.pid, -1))) for h in holders]


class IdleWatch(Record, frozen=True):
    """What a waiter needs to see idle jobs (`idle_action = pause`), as plain values."""

    rule: IdleRule
    state_dir: Path


def running_here(jobs: Iterable[Job]) -> list[Job]:
    """The running jobs whose command is a process of this pid namespace: another namespace's
    command is no process here, and its idleness is not seen. An entry whose command is
    another user's process (another member's file naming yours) has none here either: that
    process is never named for the room the entry keeps. One its gpuwait started, which runs
    as another user (`sudo`, `su` in the command), is its job's command as any."""
    return [
        j
        for j in jobs
        if j.state == RUNNING
        and j.child_pid
        and not elsewhere(j)
        and their_own_processes(j, {j.child_pid}).child_pid is not None
    ]


def idle_jobs(
    watch: IdleWatch, snapshot: MachineSnapshot, data: LedgerData, ignore: Collection[str] = ()
) -> frozenset[str]:
    """The running jobs whose command (or a process below it) this reading, with the evidence
    before it, shows idle: a waiter's reading adds to the evidence as `status`'s does."""
    here = running_here(data.jobs)
    if not here:
        return frozenset()
    found = record_reading(watch.state_dir, snapshot, watch.rule, here, ignore)
    return frozenset(h["job"] for h in found if h["job"] and h["idle_seconds"] >= watch.rule.after)


def _load(path: Path, now: float) -> Evidence:
    try:
        raw = security.read_state_file(path, _CAP, security.mine())
        data = json.loads(raw) if raw else {}
    except (OSError, ValueError, RecursionError):  # UnsafePath is an OSError
        return {}
    if not isinstance(data, dict) or data.get("version") != _VERSION:
        return {}
    if of_an_earlier_boot(data.get("boot")):
        return {}
    found = data.get("evidence")
    if not isinstance(found, dict):
        return {}
    # Seen quiet since a moment of this boot up to `now`, on its clock: any other figure is
    # damage (before the boot, it would name a process just seen idle for ages).
    return {
        k: float(v)
        for k, v in found.items()
        if isinstance(k, str) and type(v) in (int, float) and 0 <= v <= now
    }


def _save(state_dir: Path, path: Path, evidence: Evidence) -> None:
    written = {"version": _VERSION, "boot": proc.boot_id(), "evidence": evidence}
    data = json.dumps(written, sort_keys=True).encode()
    try:
        security.ensure_private_dir(state_dir)
        write_atomic(path, data, sync=False)
        # Written with no lock, so a temporary file may be another gpuwait's, being written
        # now: only one older than any write is a killed writer's.
        remove_left_temp_files(state_dir, _TEMP_RE, older_than=_TEMP_AGE)
    except OSError:
        # Only a hint: without it, the next reading starts the evidence again.
        pass


def _members(commands: Collection[int]) -> dict[int, int]:
    """Every pid in each job's process tree -> its command's pid (a job's CUDA work often runs
    in a child of its command)."""
    found: dict[int, int] = {}
    for pid in commands:
        for member in proc.process_tree([pid]):
            found.setdefault(member, pid)
    return found


def _describe(holder: IdleHolder, now: float, job: str | None) -> dict[str, Any]:
    uid = proc.owner_uid(holder.pid)
    idle_seconds = max(0.0, now - holder.idle_since)
    return {
        "pid": holder.pid,
        "gpu_index": holder.gpu_index,
        "gpu_uuid": holder.gpu_uuid,
        "used_bytes": holder.used_bytes,
        "reserved_bytes": holder.reserved_bytes,
        "idle_since": time.time() - idle_seconds,  # shown as a moment: the wall clock's
        "idle_seconds": idle_seconds,
        "uid": uid,
        "user": None if uid is None else proc.user_name(uid),
        "command": _command_line(holder.pid),
        "job": job,
    }


def _command_line(pid: int) -> list[str]:
    """The process's arguments; its command name where they cannot be read (another user's
    process under hidepid); empty when it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read(1 << 16)
    except OSError:
        raw = b""
    words = [w.decode(errors="replace") for w in raw.split(b"\0") if w]
    if words:
        return words
    name = proc.command_name(pid)
    return [name] if name else []
