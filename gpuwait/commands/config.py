"""`gpuwait config`: every effective setting and the place it came from."""

from __future__ import annotations

import argparse
import os
import re
import sys

from gpuwait.commands.common import load_settings
from gpuwait.commands.output import json_text
from gpuwait.commands.parsing import Parser, terminal_columns
from gpuwait.config import OPTIONS, Settings
from gpuwait.core.text import columns as shown_width
from gpuwait.core.text import cut, printable
from gpuwait.linux import netfs
from gpuwait.linux.security import is_shared_dir

#: The version of `config --json` (docs/configuration.md); fields are only ever added within it.
CONFIG_SCHEMA = 1


def build_parser() -> Parser:
    parser = Parser(
        prog="gpuwait config", description="Show every effective setting and its source."
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def run(args: argparse.Namespace) -> int:
    settings = _as_used(load_settings({}))
    rows = [(o.name, settings.shown(o.name), settings.sources[o.name]) for o in OPTIONS]
    if args.json:
        print(
            json_text(
                {
                    "schema": CONFIG_SCHEMA,
                    "config_file": str(settings.config_file) if settings.config_file else None,
                    "site_config_file": str(settings.site_file) if settings.site_file else None,
                    "state_dir": str(settings.state_path),
                    "ledger_dir": str(settings.ledger_path),
                    "settings": {
                        n: {"value": v, "source": s, "parsed": settings.data(n)} for n, v, s in rows
                    },
                }
            )
        )
        return 0
    columns = terminal_columns() if sys.stdout.isatty() else None
    # A value or a path is any text (a variable, a config file): an escape sequence in it is
    # shown as '?', never sent to the terminal as one.
    rows = [(n, printable(v, _LONGEST), s) for n, v, s in rows]
    for line in settings_table(rows, columns):
        print(line)
    print()
    ledger = str(settings.ledger_path)
    if settings.ledger_dir is None and settings.ledger_path != settings.state_path:
        shared = netfs.network_type(settings.state_path)
        ledger += f" (this machine's own: the state dir is on {shared}, shared by machines)"
    for label, path in (
        ("config file:", settings.config_file or "(none: no home directory)"),
        ("site config:", settings.site_file),
        ("state dir:  ", settings.state_path),
        ("ledger dir: ", ledger),
    ):
        # A path is never cut (it is there to be copied): one too long goes on a line of its own.
        path = printable(str(path), _LONGEST)
        line = f"{label} {path}"
        fits = columns is None or shown_width(line) <= columns
        print(line if fits else f"{label.strip()}\n  {path}")
    return 0


def _as_used(settings: Settings) -> Settings:
    """`settings` as gpuwait uses them with its ledger: in a shared one, the site's queue
    order and budgets where the user's own are not used there (the ledger tells a shared
    directory by its mode; one not there yet, or not to be looked at, is taken as private)."""
    try:
        shared = is_shared_dir(os.lstat(settings.ledger_path))
    except OSError:
        return settings
    return settings.in_shared_ledger(settings.ledger_path) if shared else settings


#: Longer than any path or value a setting can hold (shown whole, never cut).
_LONGEST = 1 << 16
#: Values up to this long line their sources up in one column; a longer one (a list, a path)
#: is followed by its source, and does not push every other source out to its own length.
_SHORT_VALUE = 24


def settings_table(rows: list[tuple[str, str, str]], columns: int | None) -> list[str]:
    """`name  value  (source)` rows. On a terminal `columns` wide none is wider (a Chinese
    character counted as the two columns it takes): a long value is wrapped (a list after its
    commas) and a source that no longer fits goes on the next line, under the others. With
    `columns` None (piped), one line per setting, whole."""
    names = max(len(name) for name, _, _ in rows)
    values = max([shown_width(v) for _, v, _ in rows if shown_width(v) <= _SHORT_VALUE], default=0)
    indent = " " * (names + 2)
    out = []
    for name, value, source in rows:
        source = f"({source})"
        head = f"{name:<{names}}  "
        if columns is None:
            out.append(f"{head}{value:<{values}}  {source}")
            continue
        lines = _wrap_value(value, max(8, columns - len(head)))
        out.append(head + lines[0])
        out += [indent + line for line in lines[1:]]
        last = out[-1]
        padded = last + " " * (names + 2 + values - shown_width(last)) + f"  {source}"
        if shown_width(padded) <= columns:
            out[-1] = padded
        else:
            # Under the other sources where there is room for it, else as far right as it fits.
            column = min(names + 2 + values + 2, max(0, columns - len(source)))
            out.append(" " * column + source)
    return out


def _wrap_value(value: str, width: int) -> list[str]:
    """`value` in lines of at most `width` columns: a list broken after its commas (a pattern
    such as `* -m pip *` is never split), anything else cut where it must be."""
    if shown_width(value) <= width:
        return [value]
    items = re.findall(r"[^,]*,\s*|[^,]+$", value)
    if len(items) < 2:
        pieces = []
        while value:
            piece = cut(value, width) or value[0]
            pieces.append(piece)
            value = value[len(piece) :]
        return pieces
    lines: list[str] = []
    current = ""
    for item in items:
        if current and shown_width((current + item).rstrip()) > width:
            lines.append(current.rstrip())
            current = item
        else:
            current += item
    lines.append(current.rstrip())
    return [piece for line in lines for piece in _wrap_value(line, width)]
