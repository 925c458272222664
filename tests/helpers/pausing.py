"""A job that may be asked to step aside, started as a user starts one."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from typing import Any


def start_pausable(
    gpuwait_cmd: list[str],
    *command: str,
    vram: str = "16G",
    priority: str | None = "1",
    options: Sequence[str] = (),
    **popen: Any,
) -> subprocess.Popen[str]:
    """`gpuwait --priority PRIORITY --pausable OPTIONS --vram VRAM -- COMMAND` started with its
    stderr piped (`priority` None: gpuwait's default); `popen` goes to subprocess.Popen."""
    chosen = [] if priority is None else ["--priority", priority]
    popen.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen(
        [*gpuwait_cmd, *chosen, "--pausable", *options, "--vram", vram, "--", *command],
        text=True,
        **popen,
    )
