"""`gpuwait config`: every effective setting and the place it came from."""

from __future__ import annotations

import argparse
import json

from gpuwait._config import OPTIONS, load_settings, show_value


def main(argv: list[str], parser_class: type[argparse.ArgumentParser]) -> int:
    parser = parser_class(
        prog="gpuwait config", description="Show every effective setting and its source."
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    settings = load_settings({})
    rows = [
        (o.name, show_value(o.name, settings[o.name]), settings.sources[o.name]) for o in OPTIONS
    ]
    if args.json:
        print(
            json.dumps(
                {
                    "config_file": str(settings.config_file),
                    "site_config_file": str(settings.site_file) if settings.site_file else None,
                    "state_dir": str(settings.state_dir),
                    "ledger_dir": str(settings.ledger_dir),
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
    print(f"state dir:   {settings.state_dir}")
    print(f"ledger dir:  {settings.ledger_dir}")
    return 0
