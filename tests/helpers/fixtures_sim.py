"""Fixtures for the GPU simulation: sim files and simulated CUDA jobs as real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

#: argv prefix that runs a simulated CUDA job (`gpuwait sim job`) in a fresh interpreter.
SIMJOB = [
    sys.executable,
    "-c",
    "import sys; from gpuwait.gpu.simjob import main; sys.exit(main(sys.argv[1:]))",
]

SimFileFactory = Callable[..., Path]


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    raise TypeError(f"no TOML form for {value!r}")


def sim_file_text(gpus: int, memory: str | int | list[Any], **overrides: Any) -> str:
    """[[gpu]] tables; each value is one for all cards, or a list with one per card (None: omit)."""
    keys: dict[str, Any] = {"memory": memory, **overrides}
    tables = []
    for index in range(gpus):
        lines = ["[[gpu]]"]
        for key, value in keys.items():
            item = value[index] if isinstance(value, list) else value
            if item is not None:
                lines.append(f"{key} = {toml_value(item)}")
        tables.append("\n".join(lines))
    return "\n\n".join(tables) + "\n" if tables else "gpu = []\n"


def write_atomically(path: Path, text: str) -> None:
    """Replace the file whole, so a reader running meanwhile never sees half of it."""
    temp = path.with_name(path.name + ".tmp")
    temp.write_text(text)
    os.replace(temp, path)


@pytest.fixture
def sim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Two simulated 24 GiB GPUs made by `gpuwait sim init`, selected through GPUWAIT_SIM."""
    from gpuwait.cli import main

    path = tmp_path / "sim.toml"
    assert main(["sim", "init", str(path), "--gpus", "2", "--memory", "24GiB"]) == 0
    monkeypatch.setenv("GPUWAIT_SIM", str(path))
    return path


@pytest.fixture
def sim_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SimFileFactory:
    """Factory: `sim_file(gpus=2, memory="24GiB", speed=[1.0, 2.0], ...)` -> path of the file.

    Writes (or rewrites) `file` (default tmp_path/sim.toml) and points GPUWAIT_SIM at it.
    """

    def make(
        gpus: int = 2,
        memory: str | int | list[Any] = "24GiB",
        *,
        file: Path | None = None,
        **kw: Any,
    ) -> Path:
        path = file or tmp_path / "sim.toml"
        write_atomically(path, sim_file_text(gpus, memory, **kw))
        monkeypatch.setenv("GPUWAIT_SIM", str(path))
        return path

    return make


def start_sim_job(
    *args: str, env: Mapping[str, str | None] | None = None, **popen: Any
) -> subprocess.Popen[str]:
    """Start `gpuwait sim job ARGS`; `env` adds to (or with None, removes from) os.environ."""
    full_env = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = value
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen([*SIMJOB, *args], env=full_env, text=True, **popen)


def wrapped_sim_job(gpuwait_cmd: list[str], options: list[str], *job: str) -> list[str]:
    """argv of `gpuwait OPTIONS -- gpuwait sim job JOB...`: a simulated CUDA job run as a job."""
    return [*gpuwait_cmd, *options, "--", *gpuwait_cmd, "sim", "job", *job]


def start_wrapped_sim_job(
    gpuwait_cmd: list[str], options: list[str], *job: str, **popen: Any
) -> subprocess.Popen[str]:
    """`gpuwait OPTIONS -- gpuwait sim job JOB...` started, its stdout and stderr piped unless
    `popen` (for subprocess.Popen) says otherwise."""
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen(wrapped_sim_job(gpuwait_cmd, options, *job), text=True, **popen)


def run_sim_job(
    gpuwait_cmd: list[str], options: list[str], *job: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`gpuwait OPTIONS -- gpuwait sim job JOB...`, run to its end; `env` adds to the tests'."""
    return subprocess.run(
        wrapped_sim_job(gpuwait_cmd, options, *job),
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def hold_card(
    gpuwait_cmd: list[str],
    vram: str,
    seconds: str,
    *extra: str,
    env: dict[str, str] | None = None,
    output: int = subprocess.PIPE,
) -> subprocess.Popen[str]:
    """A gpuwait job that holds `vram` of a simulated card for a while (`extra`: gpuwait's
    own options; `output`: where its stdout and stderr go)."""
    return start_wrapped_sim_job(
        gpuwait_cmd,
        ["--vram", vram, *extra],
        *("--vram", vram, "--hold", seconds),
        env=env,
        stdout=output,
        stderr=output,
    )


#: `run(*args, env={...}, **subprocess_kw)`: the gpuwait CLI in a child process, output captured.
Run = Callable[..., "subprocess.CompletedProcess[str]"]


@pytest.fixture
def run_gpuwait(gpuwait_cmd: list[str]) -> Run:
    """Runs the CLI with the test's environment plus `env`, text output captured, 60 s at most."""

    def run(
        *args: str, env: dict[str, str] | None = None, **kw: Any
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(  # type: ignore[no-any-return]
            [*gpuwait_cmd, *args],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, **(env or {})},
            **kw,
        )

    return run


@pytest.fixture
def sim_jobs() -> Iterator[list[subprocess.Popen[str]]]:
    """A list to append started jobs to; any still running at the end are killed."""
    jobs: list[subprocess.Popen[str]] = []
    yield jobs
    for job in jobs:
        if job.poll() is None:
            job.kill()
        job.communicate()
