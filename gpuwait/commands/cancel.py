"""`gpuwait cancel JOB...`: take waiting jobs out of the queue; stop running ones like `kill`."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import time

from gpuwait import _events, _output
from gpuwait._bookkeeping import CANCELLED, Finished
from gpuwait._config import load_settings
from gpuwait._errors import EXIT_NOT_PERMITTED, UsageError
from gpuwait._ledger import RUNNING, Job, ledger_for
from gpuwait._security import NotPermitted, printable, require_control


def main(argv: list[str], parser_class: type[argparse.ArgumentParser]) -> int:
    parser = parser_class(
        prog="gpuwait cancel",
        description="Cancel jobs of yours: a waiting one leaves the queue (its gpuwait exits 7); "
        "a running one gets TERM, as from `kill`.",
    )
    parser.add_argument("jobs", nargs="*", metavar="JOB", help="job ids or names")
    parser.add_argument("--batch", metavar="NAME", help="every job of this batch")
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
    args = parser.parse_args(argv)
    if not args.jobs and args.batch is None:
        raise UsageError("name the jobs to cancel (ids or names), or --batch NAME")
    settings = load_settings({})
    ledger = ledger_for(settings)
    me = os.getuid()
    unmatched: list[str] = []
    refused: list[tuple[Job, str]] = []
    cancelled: list[Job] = []
    stopped: list[Job] = []
    with ledger.transaction() as data:
        chosen: list[Job] = []
        for ref in args.jobs:
            matches = [j for j in data.jobs if ref in (j.id, j.name)]
            if not matches:
                unmatched.append(ref)
            chosen.extend(j for j in matches if j not in chosen)
        if args.batch is not None:
            batch = [j for j in data.jobs if j.batch == args.batch]
            if not batch:
                unmatched.append(f"--batch {args.batch}")
            chosen.extend(j for j in batch if j not in chosen)
        for job in chosen:
            try:
                # Owner (or root) only, and only when the entry names that owner's own gpuwait
                # process: a forged entry must never make this signal someone else's process.
                require_control(job, me)
            except NotPermitted as exc:
                refused.append((job, exc.message))
            else:
                if job.state == RUNNING:
                    stopped.append(job)
                else:
                    data.remove(job.id)
                    data.book.note_finished(
                        Finished(job.id, CANCELLED, time.time(), name=job.name, batch=job.batch)
                    )
                    cancelled.append(job)
            _events.emit(
                ledger.directory,
                "cancel",
                job=job.id,
                name=job.name,
                state=job.state,
                by_uid=me,
                refused=any(job is r for r, _ in refused),
            )
    for job in stopped:
        # gpuwait forwards TERM to the command and ends the way the command does.
        with contextlib.suppress(ProcessLookupError):
            os.kill(job.pid, signal.SIGTERM)
    for job in cancelled:
        if not args.quiet:
            _output.info(f"cancelled {_label(job)} (it was waiting)")
    for job in stopped:
        if not args.quiet:
            _output.info(f"sent TERM to {_label(job)} (running)")
    for job, why in refused:
        _output.error(f"{_label(job)} cannot be cancelled: {printable(why)}")
    for ref in unmatched:
        _output.error(f"no waiting or running job matches {printable(ref)}; see `gpuwait status`")
    if refused:
        return EXIT_NOT_PERMITTED
    return 2 if unmatched else 0


def _label(job: Job) -> str:
    # Another user's entry may hold anything: never print their escape sequences.
    name = f" ({printable(job.name, 100)})" if job.name else ""
    return f"job {printable(job.id, 16)}{name}"
