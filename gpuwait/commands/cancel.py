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
from gpuwait._errors import UsageError
from gpuwait._ledger import RUNNING, Job, Ledger


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
    ledger = Ledger(settings.state_dir)
    me = os.getuid()
    unmatched: list[str] = []
    refused: list[Job] = []
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
            if job.uid != me and me != 0:
                refused.append(job)
            elif job.state == RUNNING:
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
                refused=job in refused,
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
    for job in refused:
        _output.error(f"{_label(job)} belongs to uid {job.uid}; only its owner can cancel it")
    for ref in unmatched:
        _output.error(f"no waiting or running job matches {ref}; see `gpuwait status`")
    return 2 if unmatched or refused else 0


def _label(job: Job) -> str:
    return f"job {job.id} ({job.name})" if job.name else f"job {job.id}"
