"""`gpuwait config`: every effective setting and the place it came from."""

from __future__ import annotations

import argparse
import json

from gpuwait.commands import Parser
from gpuwait.config import OPTIONS, load_settings


def build_parser() -> Parser:
    parser = Parser(
        prog="gpuwait config", description="Show every effective setting and its source."
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def run(args: argparse.Namespace) -> int:
    settings = load_settings({})
    rows = [(o.name, settings.shown(o.name), settings.sources[o.name]) for o in OPTIONS]
    if args.json:
        print(
            json.dumps(
                {
                    "config_file": str(settings.config_file),
                    "site_config_file": str(settings.site_file) if settings.site_file else None,
                    "state_dir": str(settings.state_path),
                    "ledger_dir": str(settings.ledger_path),
                    "settings": {n: {"value": v, "source": s} for n, v, s in rows},
                },
                indent=2,
            )
        )
        return 0
    width = max(len(n) for n, _, _ in rows)
    value_width = max(len(v) for _, v, _ in rows)
    for name, value, source in rows:
        print(f"{name:<{width}}  {value:<{value_width}}  ({source})")
    print(f"\nconfig file: {settings.config_file}")
    print(f"site config: {settings.site_file}")
    print(f"state dir:   {settings.state_path}")
    print(f"ledger dir:  {settings.ledger_path}")
    return 0
