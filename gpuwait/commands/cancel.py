"""`gpuwait cancel JOB...`: take waiting jobs out of the queue; stop running ones like `kill`."""

from __future__ import annotations

import argparse
import os

from gpuwait.commands import output
from gpuwait.commands.common import ledger_for, load_settings
from gpuwait.commands.parsing import Parser
from gpuwait.core.errors import EXIT_NOT_PERMITTED, EXIT_USAGE, UsageError
from gpuwait.core.text import printable, shell_word
from gpuwait.queue import lifecycle
from gpuwait.queue.entries import Job


def build_parser() -> Parser:
    parser = Parser(
        prog="gpuwait cancel",
        description="Cancel jobs of yours: a waiting one leaves the queue (its gpuwait exits 7); "
        "a running one gets TERM, as from `kill`. A process adopted with `gpuwait adopt` is "
        "not signalled: stop it as you started it.",
    )
    parser.add_argument("jobs", nargs="*", metavar="JOB", help="job ids or names")
    parser.add_argument("--batch", metavar="NAME", help="every job of this batch")
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
    return parser


def run(options: argparse.Namespace) -> int:
    if not options.jobs and options.batch is None:
        raise UsageError("name the jobs to cancel (ids or names), or --batch NAME")
    settings = load_settings({})
    done = lifecycle.cancel(ledger_for(settings), options.jobs, options.batch, os.getuid())
    for job in done.cancelled:
        if not options.quiet:
            output.info(f"cancelled {_label(job)}: it was waiting")
    for job in done.stopped:
        if not options.quiet:
            output.info(f"sent TERM to {_label(job)}: it was running")
    for job, why in done.refused:
        output.error(f"{_label(job)} cannot be cancelled: {printable(why)}")
    ended = dict(done.ended)
    for ref in done.unmatched:
        if ref in ended:
            over = ended[ref]
            name = f" ({printable(over.name, 100)})" if over.name else ""
            output.error(
                f"job {printable(over.id, 16)}{name} has already ended: it {over.describe()}; "
                "nothing to cancel"
            )
            continue
        output.error(
            f"no waiting or running job matches {printable(shell_word(ref))}; see `gpuwait status`"
        )
    for ref, jobs in done.ambiguous:
        ids = ", ".join(f"{printable(j.id, 16)} (uid {j.uid})" for j in jobs)
        users = len({j.uid for j in jobs})
        output.error(
            f"jobs of {users} users are named {printable(ref)}, and none of them is yours: "
            f"nothing cancelled; name the one you mean by its id: {ids}"
        )
    if done.refused:
        return EXIT_NOT_PERMITTED
    return EXIT_USAGE if done.unmatched or done.ambiguous else 0


def _label(job: Job) -> str:
    # Another user's entry may hold anything: never print their escape sequences.
    name = f" ({printable(job.name, 100)})" if job.name else ""
    return f"job {printable(job.id, 16)}{name}"
