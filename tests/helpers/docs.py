"""The code blocks of a markdown page, and running its shell blocks the way a reader would.

A page's code blocks are fenced, each with a language:

- `sh`: commands a reader types; they run, in order, in one bash process per page (so an
  `export` in one block holds in the next), each command expected to succeed;
- `toml`: a config file (or, with `[[gpu]]` tables, a simulation file), read by gpuwait's own
  parser; `python`: compiled; `text`, `make`, `json`: shown only.

An HTML comment on the line before a block changes what is expected of it:

- `<!-- docs-test: skip (WHY) -->`: not run; the reason is required, so nothing is skipped
  silently;
- `<!-- docs-test: exit N -->`: the block's last command exits N (earlier ones are not checked);
- `<!-- docs-test: site-config -->`: a `toml` block that is the site config file;
- `<!-- docs-test: after-install -->`: an `sh` block that begins with INSTALL (below): it runs
  without it, with this checkout's gpuwait on PATH in its place.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from conftest import REPO

from helpers.fixtures_sim import sim_file_text
from helpers.shellbin import make_bin

SHELL = "sh"
SHOWN_ONLY = frozenset({"text", "make", "json"})
LANGUAGES = frozenset({SHELL, "toml", "python"}) | SHOWN_ONLY

_FENCE = re.compile(r"^(```+|~~~+)\s*(\S*)")
_MARKER = re.compile(r"^<!--\s*docs-test:\s*(.*?)\s*-->$")
_SKIP = re.compile(r"^skip \((.+)\)$")
_EXIT = re.compile(r"^exit ([0-9]+)$")

#: How a reader installs gpuwait; the tests run the rest of such a command without it.
INSTALL = "python3 -m venv .venv && .venv/bin/pip install . && "


@dataclass(frozen=True)
class Block:
    page: str
    #: Line of the opening fence, 1-based.
    line: int
    language: str
    text: str
    #: Why it is not run, or None.
    skip: str | None = None
    #: The exit status its last command is expected to end with, or None for "every command 0".
    exit: int | None = None
    site_config: bool = False

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(path: Path, name: str | None = None) -> list[Block]:
    """Every fenced block of the page; a malformed page raises ValueError saying where."""
    page = name or path.name
    lines = path.read_text().splitlines()
    found: list[Block] = []
    marker: str | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = _FENCE.match(line)
        if fence is None:
            if line.startswith(("    ", "\t")) and i > 0 and not lines[i - 1].strip():
                raise ValueError(
                    f"{page}:{i + 1}: an indented code block; fence it with a language instead"
                )
            if line.strip():
                match = _MARKER.match(line.strip())
                marker = match.group(1) if match else None
            i += 1
            continue
        if line != line.lstrip():
            raise ValueError(f"{page}:{i + 1}: an indented fence; start it in the first column")
        opening, language = fence.group(1), fence.group(2)
        if language not in LANGUAGES:
            raise ValueError(
                f"{page}:{i + 1}: code block in {language or 'no language'!r}; use one of "
                + ", ".join(sorted(LANGUAGES))
            )
        end = i + 1
        while end < len(lines) and not lines[end].startswith(opening[:3]):
            end += 1
        if end == len(lines):
            raise ValueError(f"{page}:{i + 1}: the code block is never closed")
        found.append(_block(page, i + 1, language, "\n".join(lines[i + 1 : end]) + "\n", marker))
        marker = None
        i = end + 1
    return found


def _block(page: str, line: int, language: str, text: str, marker: str | None) -> Block:
    block = Block(page=page, line=line, language=language, text=text)
    if marker is None:
        return block
    if skip := _SKIP.match(marker):
        return replace(block, skip=skip.group(1))
    if (status := _EXIT.match(marker)) and language == SHELL:
        return replace(block, exit=int(status.group(1)))
    if marker == "site-config" and language == "toml":
        return replace(block, site_config=True)
    if marker == "after-install" and language == SHELL:
        if not text.startswith(INSTALL):
            raise ValueError(f"{page}:{line}: an after-install block begins with {INSTALL!r}")
        return replace(block, text=text.removeprefix(INSTALL))
    raise ValueError(f"{page}:{line}: docs-test marker {marker!r} means nothing here")


def script(shell_blocks: list[Block]) -> str:
    """One bash script that runs the blocks in order and stops at the first unexpected status.

    Each failure names its block (`DOCS-TEST FAILED page:line`), so the test can say which.
    """
    parts = [
        "set +o pipefail",
        '__docs_failed() { echo "DOCS-TEST FAILED $1: $2" >&2; exit 99; }',
    ]
    for block in shell_blocks:
        parts.append(f"echo '>>> {block.where}'")
        if block.exit is None:
            # ERR fires for every command that fails where `set -e` would stop, and for no other.
            parts.append(f"trap '__docs_failed {block.where} \"exit $? from: $BASH_COMMAND\"' ERR")
            parts.append(block.text.rstrip("\n"))
            parts.append("trap - ERR")
        else:
            parts.append(block.text.rstrip("\n"))
            parts.append(
                f"__status=$?; [ $__status = {block.exit} ] || "
                f'__docs_failed {block.where} "expected exit {block.exit}, got $__status"'
            )
    # Background jobs a page started end before the page is done.
    parts.append("wait")
    return "\n".join(parts) + "\n"


#: The reader's own programs that the pages run: stand-ins that start and end at once.
STANDINS = ("train.py", "infer.py", "eval.py", "sweep.py", "big.py", "serve.py")

#: What a reader's clone has that the pages use, linked into the directory the pages run in.
FROM_CLONE = ("contrib", "bench", "shell", "gpuwait", "pyproject.toml", "tests")


def assert_page_runs(page: Path, tmp_path: Path, timeout: float = 180) -> str:
    """Run the page's shell blocks as a reader would: from a directory laid out like the top of
    a clone, with this checkout's gpuwait on PATH, a fresh home (the tests' isolated one) and
    two fresh simulated 24 GiB GPUs. Fails the test at the first unexpected exit status, with the
    output; returns the output."""
    home = Path(os.environ["HOME"])
    runtime = home / "runtime"
    runtime.chmod(0o700)
    work = tmp_path / "clone"
    work.mkdir()
    for name in FROM_CLONE:
        (work / name).symlink_to(REPO / name)
    for name in STANDINS:
        (work / name).write_text("import sys\n")
    bin_dir = make_bin(tmp_path / "bin")
    sim = tmp_path / "sim.toml"
    sim.write_text(sim_file_text(2, "24GiB"))
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "XDG_RUNTIME_DIR": str(runtime),
        "GPUWAIT_SIM": str(sim),
        "COLUMNS": "80",
        "TMPDIR": str(tmp_path),
    }
    env.pop("PYTHONPATH", None)  # the page runs the gpuwait on PATH, as a reader's shell does
    name = str(page.relative_to(REPO))
    runnable = [b for b in blocks(page, name) if b.language == SHELL and b.skip is None]
    (tmp_path / "page.sh").write_text(script(runnable))
    proc = subprocess.Popen(
        ["bash", str(tmp_path / "page.sh")],
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{name}: its commands did not finish in {timeout:.0f} s:\n{out[-4000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # anything the page left running in background
    if os.environ.get("DOCS_TEST_SHOW"):
        print(out)
    failed = re.findall(r"DOCS-TEST FAILED .*", out)
    assert proc.returncode == 0 and not failed, (
        f"{failed[0] if failed else f'exit {proc.returncode}'}\n{out[-6000:]}"
    )
    assert "Traceback" not in out, out[-6000:]
    return out
