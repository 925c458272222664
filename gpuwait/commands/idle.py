"""`gpuwait idle`: processes holding VRAM on a GPU that does no work, any user's, named.

The evidence is gathered by this command and `status` each time they read the GPUs (see
gpuwait.queue.idle); the rule is `idle_min_vram`, `idle_max_util` and `idle_after`.
"""

from __future__ import annotations

import argparse
import sys
import textwrap

from gpuwait.commands import output
from gpuwait.commands.common import load_settings
from gpuwait.commands.parsing import Parser
from gpuwait.commands.status import build_report, note, render_idle, terminal_width
from gpuwait.core.errors import EXIT_NO_GPU
from gpuwait.core.sizes import format_duration, format_size

IDLE_SCHEMA = 1


def build_parser() -> Parser:
    parser = Parser(
        prog="gpuwait idle",
        description="List processes (any user's) holding at least idle_min_vram on a GPU that "
        "stayed under idle_max_util for at least idle_after, with owner, command, VRAM and idle "
        "time. Each reading, this command's and `status`'s, adds to the evidence.",
    )
    parser.add_argument(
        "--json", action="store_true", help=f"machine-readable output (schema {IDLE_SCHEMA})"
    )
    return parser


def run(options: argparse.Namespace) -> int:
    settings = load_settings({})
    report = build_report(settings)
    holders = report["idle"]
    if options.json:
        rule = {
            "min_vram_bytes": settings.idle_min_vram,
            "max_util_pct": settings.idle_max_util,
            "after_seconds": settings.idle_after,
        }
        document = {
            "schema": IDLE_SCHEMA,
            "generated_at": report["generated_at"],
            "rule": rule,
            "backend_error": report["backend_error"],
            # As in status --json: what to do about backend_error, and the GPUs that were
            # skipped (lost, failing): nobody on those can be named.
            "backend_hint": report["backend_hint"],
            "warnings": report["warnings"],
            "idle": holders,
            "watching": report["idle_watching"],
        }
        print(output.json_text(document))
        return EXIT_NO_GPU if report["backend_error"] else 0
    for message in report["warnings"]:
        output.warn(message)
    if report["backend_error"]:
        output.error(report["backend_error"], report["backend_hint"])
        return EXIT_NO_GPU
    rule_text = (
        f"at least {format_size(settings.idle_min_vram)} on a GPU under "
        f"{settings.idle_max_util:g}% utilization for {format_duration(settings.idle_after)}"
    )
    # As narrow as `status` goes (a pane split in two), each line kept within it.
    width = terminal_width()
    if holders:
        lines = note(f"Idle VRAM holders ({len(holders)}; {rule_text})", width, indent="")
        lines += render_idle(holders, width, heading=False)
    else:
        lines = note(f"No idle VRAM holders ({rule_text}).", width, indent="")
    print("\n".join(lines))
    watching = report["idle_watching"]
    if watching:
        # Readings are the only evidence: say how far it goes, and how to keep it coming.
        text = (
            f"Watching {len(watching)} more on quiet GPUs, seen so for "
            f"{format_duration(max(h['idle_seconds'] for h in watching))} at most; gpuwait "
            "counts from its first reading that found them so (`gpuwait status --watch`, or "
            "`gpuwait idle` now and then, keeps the evidence coming)."
        )
        print(textwrap.fill(text, width))
    sys.stdout.flush()
    return 0
