"""A command that counts the signals it receives, for tests of how signals reach it."""

from __future__ import annotations

import textwrap
from pathlib import Path

from helpers.waiting import wait_for

#: `python -c TRAP FLAG [GO]`: writes "ready" to FLAG once its handlers are in place, then, a
#: moment after the first signal (or, given GO, once the file GO exists), the signal numbers it
#: received (comma-separated), and exits 40 + their count.
TRAP = textwrap.dedent(
    """
    import os, signal, sys, time
    got = []
    def handler(signum, frame):
        got.append(signum)
    for s in (
        signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1,
        signal.SIGUSR2, signal.SIGALRM, signal.SIGVTALRM, signal.SIGPROF, signal.SIGXCPU,
        signal.SIGPWR, signal.SIGRTMIN + 2,
    ):
        signal.signal(s, handler)
    open(sys.argv[1], "w").write("ready")
    deadline = time.monotonic() + 20
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    # Not a precondition but the window under test: were the signal passed on twice, the second
    # would arrive within it. A delivery that never comes shows no state to wait for, but a
    # test can say when whoever would pass it on is done (GO): then nothing is left to chance.
    if len(sys.argv) > 2:
        while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:
            time.sleep(0.01)
    else:
        time.sleep(0.3)
    open(sys.argv[1], "w").write(",".join(str(s) for s in got))
    sys.exit(40 + len(got))
    """
)


def wait_for_text(path: Path, text: str | None = None, timeout: float = 90) -> str:
    def said() -> str | None:
        content = path.read_text() if path.exists() else ""
        return content if content and (text is None or content == text) else None

    content: str = wait_for(
        said, timeout=timeout, interval=0.02, message=f"{path} never said {text!r}"
    )
    return content
