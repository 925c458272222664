"""The house's plan, checked: which folder may import which, the pure core, the one home of every
change of a job's state, and who prints (ARCHITECTURE.md)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO

PACKAGE = REPO / "gpuwait"

#: Each part of the package and the parts it may import (besides itself and the standard
#: library). Lower layers never import higher ones; nothing below commands/ imports the CLI.
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "linux": {"core"},
    # The application side of pausing: standard library and the protocol's constants only.
    "checkpoint": {"core", "linux"},
    "gpu": {"core", "linux", "checkpoint"},
    "history": {"core", "linux"},
    "queue": {"core", "linux", "gpu", "history"},
    "runner": {"core", "linux", "gpu", "history", "queue"},
    "config": {"core", "linux"},
    "commands": {"core", "linux", "gpu", "history", "queue", "runner", "config", "version"},
    # The console script takes its turn at the start-up turnstile before it loads the rest.
    "cli": {"core", "commands", "linux"},
    # The Python API and its IPython magic: a front end beside the CLI, reading the command
    # line's options with its parser and saying things (the magic) through its output.
    "api": {"core", "linux", "gpu", "history", "queue", "runner", "config", "commands"},
    # The PyTorch hook runs inside the user's job, put there on PYTHONPATH: standard library only.
    "pyhook": set(),
    "main": {"cli"},
    # The package's front door: the version, and the API's names, imported when first used.
    "version": {"api", "core"},
}

#: What the pure core may import from the standard library: no I/O, no clock, no processes.
CORE_STDLIB = {
    "__future__",
    "bisect",
    "collections",
    "collections.abc",
    "difflib",
    "fnmatch",
    "math",
    "os.path",
    "re",
    "shlex",
    "types",
    "typing",
    "unicodedata",
    # SHA-256 without OpenSSL (gpuwait.core.digest), hashlib only where a build lacks it.
    "_sha256",
    "_sha2",
    "hashlib",
}


def part_of(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    if len(relative.parts) > 1:
        return relative.parts[0]
    return {"__init__.py": "version", "__main__.py": "main"}.get(path.name, path.stem)


def modules() -> Iterator[tuple[Path, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def imports(tree: ast.Module) -> Iterator[tuple[int, str, list[str]]]:
    """(line, module, names) of every import, those inside functions too."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            yield node.lineno, node.module, [a.name for a in node.names]


def gpuwait_part(module: str, names: list[str]) -> list[str]:
    """The parts of gpuwait an import reaches."""
    if module == "gpuwait":
        return [n if n != "__version__" else "version" for n in names]
    if module.startswith("gpuwait."):
        return [module.split(".")[1]]
    return []


def test_every_part_imports_only_the_parts_below_it() -> None:
    wrong = []
    for path, tree in modules():
        part = part_of(path)
        assert part in ALLOWED, f"{path} is in no known layer: add it to ARCHITECTURE.md and here"
        for line, module, names in imports(tree):
            for reached in gpuwait_part(module, names):
                if reached != part and reached not in ALLOWED[part]:
                    wrong.append(f"{path.relative_to(REPO)}:{line} ({part}) imports {reached}")
    assert wrong == []


def test_the_core_is_pure() -> None:
    wrong = []
    for path, tree in modules():
        if part_of(path) != "core":
            continue
        for line, module, _ in imports(tree):
            if not module.startswith("gpuwait.core") and module not in CORE_STDLIB:
                wrong.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert wrong == []


#: What of `os` the pure core may use: `import os.path` binds all of `os` (its clock, its
#: processes, its files), and `os.path` reads the file system (`exists`, `realpath`), the
#: working directory (`abspath`) and the environment or the password database (`expanduser`).
#: Only arithmetic on path text is pure.
CORE_OS_PATH = {"basename", "dirname", "join", "normpath", "split", "splitext", "isabs", "sep"}


def test_the_core_uses_os_path_for_text_only() -> None:
    wrong = []
    for path, tree in modules():
        if part_of(path) != "core":
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            if isinstance(node.value, ast.Name) and node.value.id == "os" and node.attr != "path":
                wrong.append(f"{path.relative_to(REPO)}:{node.lineno} os.{node.attr}")
            if (
                isinstance(node.value, ast.Attribute)
                and isinstance(node.value.value, ast.Name)
                and (node.value.value.id, node.value.attr) == ("os", "path")
                and node.attr not in CORE_OS_PATH
            ):
                wrong.append(f"{path.relative_to(REPO)}:{node.lineno} os.path.{node.attr}")
    assert wrong == []


def calls_of(tree: ast.Module, attribute: str) -> Iterator[int]:
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == attribute
        ):
            yield node.lineno


@pytest.mark.parametrize(
    ("attribute", "home"),
    [
        # Every write transaction changes jobs, so only the lifecycle opens one...
        ("transaction", {"queue/lifecycle.py"}),
        # ... and every event reports such a change, logged once it committed.
        ("emit", {"queue/lifecycle.py"}),
    ],
)
def test_only_the_lifecycle_changes_a_job(attribute: str, home: set[str]) -> None:
    found = {
        f"{path.relative_to(PACKAGE)}:{line}"
        for path, tree in modules()
        for line in calls_of(tree, attribute)
        if str(path.relative_to(PACKAGE)) not in home
    }
    assert found == set()


#: Besides commands/ and the CLI: the simulated CUDA program writes its own errors, as a CUDA
#: program would (it is a program of its own, run by `gpuwait sim job`), and the PyTorch hook
#: says why a cap could not be applied from inside the user's program, where no reporter is.
PRINTS_OF_ITS_OWN = {"gpu/simjob.py", "pyhook/sitecustomize.py"}


def test_only_commands_print() -> None:
    found = []
    for path, tree in modules():
        relative = str(path.relative_to(PACKAGE))
        if part_of(path) in ("commands", "cli") or relative in PRINTS_OF_ITS_OWN:
            continue
        for node in ast.walk(tree):
            is_print = isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            if is_print and node.func.id == "print":  # type: ignore[attr-defined]
                found.append(f"{relative}:{node.lineno}")
            if isinstance(node, ast.Attribute) and node.attr == "write":
                value = node.value
                if isinstance(value, ast.Attribute) and value.attr in ("stdout", "stderr"):
                    found.append(f"{relative}:{node.lineno}")
    assert found == []


def test_no_argparse_namespace_below_commands() -> None:
    found = []
    for path, tree in modules():
        if part_of(path) in ("commands", "cli", "gpu", "api"):
            # gpu/simjob parses the simulated program's own command line; the API reads the
            # command line's options.
            continue
        for line, module, _ in imports(tree):
            if module == "argparse":
                found.append(f"{path.relative_to(REPO)}:{line}")
    assert found == []


def test_architecture_names_every_folder() -> None:
    text = (REPO / "ARCHITECTURE.md").read_text()
    for folder in sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()):
        assert f"gpuwait/{folder}/" in text, f"ARCHITECTURE.md does not describe gpuwait/{folder}/"
