"""Command keys: how runs of "the same command" are found again in the history. Pure (no I/O).

A command is known at three levels, finest first:

    command   python /home/me/proj/train.py --epochs 3     the whole line, script path resolved
    script    python /home/me/proj/train.py                 program and script (or module)
    program   python                                         the program alone

Paths are resolved against the working directory with plain path arithmetic (no file system
access), so `python train.py` and `python ./train.py` run from the same directory match, while
two `train.py` in different projects do not; inline code (`bash -c ...`) and a program that runs
what its directory's files say (`make train`) count with the directory. Interpreter options
before the script (`python -u`) are dropped: they do not change what the script allocates.
`--key NAME` replaces all of this with a single level named by the user. Code typed at a
prompt or piped in (`python`, `bash`, `python - < x.py`) is marked `typed_in`: no run of it
sizes another.
"""

from __future__ import annotations

import os.path
import re
import shlex
from collections.abc import Sequence

from gpuwait.core.digest import sha256_hex
from gpuwait.core.record import Record

COMMAND = "command"
SCRIPT = "script"
PROGRAM = "program"
EXPLICIT = "key"
#: Finest first: the order in which estimates look for enough runs.
LEVELS = (EXPLICIT, COMMAND, SCRIPT, PROGRAM)

_PYTHON_RE = re.compile(r"^(python|pypy)(\d+(\.\d+)*)?[a-z]?(\.exe)?\Z")
_SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "mksh", "fish"})
#: Python options that take a value (as the next token or glued on: -Wignore).
_PYTHON_VALUE_OPTIONS = frozenset("WX")
_PYTHON_LONG_VALUE_OPTIONS = frozenset({"--check-hash-based-pycs"})
#: Arguments with these endings are taken as the script of a launcher (torchrun, accelerate ...).
_SCRIPT_SUFFIXES = (".py", ".sh", ".bash", ".js", ".mjs", ".R", ".r", ".jl", ".rb", ".pl", ".lua")


#: Programs that run other code (interpreters, shells, launchers, wrappers): their own runs say
#: nothing about what the next script they run will allocate, so their program level never
#: gives an estimate (gpuwait.core.estimate).
_RUNS_OTHER_CODE = frozenset(
    {
        *_SHELLS,
        *("node", "nodejs", "deno", "bun", "Rscript", "R", "julia", "ruby", "perl", "java"),
        *("lua", "luajit", "php", "tclsh", "octave", "matlab", "jupyter", "ipython"),
        *("torchrun", "accelerate", "deepspeed", "horovodrun", "ray", "mpirun", "mpiexec"),
        *("srun", "salloc", "sbatch", "uv", "uvx", "conda", "mamba", "micromamba", "poetry"),
        *("pipx", "pdm", "hatch", "rye", "pixi", "npx", "env", "nice", "ionice", "nohup"),
        *("time", "timeout", "stdbuf", "taskset", "numactl", "chrt", "xargs", "sudo", "doas"),
        *("make", "gmake", "ninja", "docker", "podman", "apptainer", "singularity", "gpuwait"),
        *("setsid", "flock", "unbuffer", "script", "parallel", "watch", "strace", "gdb"),
        *("npm", "pnpm", "yarn", "just", "cargo", "snakemake", "dvc", "tox", "nox"),
        # Running a command as another user or elsewhere (a service's or root's cron job).
        *("runuser", "su", "setpriv", "sg", "chroot", "unshare", "nsenter", "systemd-run"),
    }
)


#: Interpreters and shells that read code typed at their prompt (or piped in) when given no
#: script: each such session runs code no earlier one did.
_PROMPTS = frozenset(
    {
        *_SHELLS,
        *("ipython", "jupyter", "node", "nodejs", "deno", "bun", "R", "julia", "ruby", "perl"),
        *("lua", "luajit", "php", "tclsh", "octave", "matlab"),
    }
)


def runs_other_code(program: str) -> bool:
    """Is `program` (as `command_key` names it) an interpreter, shell or launcher?"""
    base = os.path.basename(program)
    return bool(_PYTHON_RE.match(base)) or base in _RUNS_OTHER_CODE


class CommandKey(Record, frozen=True):
    """The levels of one command: (level, text) pairs, finest first, no two with the same text."""

    levels: tuple[tuple[str, str], ...]
    #: Its code is typed at a prompt or piped in (`python`, `bash`, `python - < x.py`): no two
    #: runs need be alike, so no run sizes another.
    typed_in: bool = False

    def hashes(self) -> dict[str, str]:
        """Level -> hash of its text: what the history stores and the index is keyed by."""
        return {level: key_hash(level, text) for level, text in self.levels}

    def text(self, level: str) -> str | None:
        return next((t for name, t in self.levels if name == level), None)

    @property
    def program(self) -> str:
        """The program's name without its directory (safe to show even in `hash` mode)."""
        text = self.text(PROGRAM) or self.levels[-1][1]
        return os.path.basename(text) or text


def python_script_file(argv: Sequence[str], cwd: str) -> str | None:
    """The file a Python command line runs as its script (`python -u train.py` in /w:
    /w/train.py), as the interpreter opens it from `cwd`; None where it runs no file (`-c`,
    `-m`, `-`, its prompt) or is no Python."""
    found = python_script_at(argv, cwd)
    return None if found is None else found[0]


def python_script_at(argv: Sequence[str], cwd: str) -> tuple[str, int] | None:
    """python_script_file, with where in `argv` the script is named (`python -u train.py`:
    2), for a line written again with another script."""
    runs = python_runs(argv)
    if runs is None or runs[0]:
        return None
    return _opened(runs[1], cwd), runs[2] - 1


#: Launchers run by their module (`python -m torch.distributed.run`): the program it stands for.
_LAUNCHER_SCRIPT_MODULES = {
    "torch.distributed.run": "torchrun",
    "torch.distributed.launch": "torchrun",
    "deepspeed": "deepspeed",
    "deepspeed.launcher.runner": "deepspeed",
}


def launcher_script_file(argv: Sequence[str], cwd: str) -> str | None:
    """The Python script a launcher's workers run (`torchrun --nproc_per_node 2 train.py`,
    `accelerate launch train.py`, `deepspeed train.py`, `python -m torch.distributed.run
    train.py` in /w: /w/train.py), as they open it from `cwd`: the first `.py` among its
    arguments; None where it runs a module or a program (`-m`, `--no-python`) or is no such
    launcher."""
    if not argv:
        return None
    program, args = os.path.basename(argv[0]), list(argv[1:])
    runs = python_runs(argv)
    if runs is not None and runs[0] == "-m" and runs[1] in _LAUNCHER_SCRIPT_MODULES:
        program, args = _LAUNCHER_SCRIPT_MODULES[runs[1]], list(argv[runs[2] :])
    if program == "accelerate" and args[:1] == ["launch"]:
        args = args[1:]
    elif program not in ("torchrun", "deepspeed"):
        return None
    for token in args:
        if token in ("-m", "--module", "--no-python", "--no_python"):
            return None
        if token.endswith(".py") and not token.startswith("-"):
            return _opened(token, cwd)
    return None


def key_hash(level: str, text: str) -> str:
    """A short stable hash; the level is part of it so equal texts at two levels stay apart."""
    return sha256_hex(f"{level}\0{text}")[:20]


def explicit_key(name: str) -> CommandKey:
    return CommandKey(levels=((EXPLICIT, name),))


def program_name(argv0: str, cwd: str) -> str:
    """`python3.11` and `/usr/bin/python3` are both `python`; other programs named by a path are
    made absolute; a bare program name stays as typed."""
    base = os.path.basename(argv0)
    match = _PYTHON_RE.match(base)
    if match:
        return match.group(1)
    if "/" in argv0:
        return _resolve(argv0, cwd)
    return argv0


def command_key(argv: Sequence[str], cwd: str) -> CommandKey:
    """The levels of `argv` run in `cwd`.

    Every level is kept even when two have the same text (`python train.py` without arguments):
    the runs behind them differ, since the script level also holds the runs with arguments.
    """
    if not argv:
        raise ValueError("empty command")
    program = program_name(argv[0], cwd)
    args = list(argv[1:])
    base = os.path.basename(argv[0])
    if _PYTHON_RE.match(base):
        script, tail = _python_script(args, cwd)
    elif base in _SHELLS:
        script, tail = _shell_script(args, cwd)
    else:
        # A launcher (torchrun, accelerate launch ...) or the program itself: its options stay
        # in place, only a script among them is resolved.
        script, tail = _launcher_script(args, cwd)
    line = _join([program]) + (f" {tail}" if tail else "")
    here = f" (in {_join([cwd])})"
    # Inline code (`bash -c 'python train.py'`) names what it runs relative to its directory.
    inline = script is not None and script.startswith("-c <")
    if inline:
        script = f"{script}{here}"
    if not line.startswith(f"{_join([program])} -m ") and (
        inline
        # `make train`, `npm run train`: what runs is what the directory's files say.
        or (script is None and runs_other_code(program))
        # `run.py job.cfg` reads another file in every directory.
        or _names_relative_paths(tail)
    ):
        # The whole line is that directory's (a `-m` module's identity has it already).
        line += here
    levels = [(COMMAND, line)]
    if script is not None:
        levels.append((SCRIPT, f"{_join([program])} {script}"))
    levels.append((PROGRAM, program))
    # No script, no inline code (-c), no module (-m: Python's then has a tail): what runs is
    # typed at the prompt, or piped in.
    typed_in = script == "-" or (
        script is None and (base in _PROMPTS or (not tail and bool(_PYTHON_RE.match(base))))
    )
    return CommandKey(levels=tuple(levels), typed_in=typed_in)


#: A file name with a suffix (`job.cfg`, `train.yaml`); a number (`0.001`) has no letter before it.
_FILE_NAME_RE = re.compile(r"[^\s/]*[A-Za-z_][^\s/]*\.[A-Za-z][A-Za-z0-9]{0,9}")


def _names_relative_paths(tail: str) -> bool:
    """Does an argument name a file relative to the working directory (`job.cfg`,
    `configs/big.yaml`, `--config=../x.toml`)? The script itself is resolved already."""
    try:
        tokens = shlex.split(tail)
    except ValueError:
        return False
    for token in tokens:
        value = _script_value(token)
        if not value or value.startswith(("-", "/", "~", "<")) or "://" in value:
            continue
        if "/" in value or _FILE_NAME_RE.fullmatch(value):
            return True
    return False


def _resolve(path: str, cwd: str) -> str:
    """`path` as the program opens it from `cwd`. A `~` that reached the program was expanded
    by no shell (quoted, or after `--script=`): the program opens `./~/...`, so it is no home
    directory here either, and nothing is looked up (the environment, the password database)."""
    return os.path.normpath(os.path.join(cwd, path))


def _opened(path: str, cwd: str) -> str:
    """The file `path` names for a program run in `cwd`, for a look at whether it is there:
    as _resolve says it, but where it goes up (`runs/../train.py`), which is above the folder
    a link leads to, not beside the link, as the kernel reads it."""
    if ".." in path.split("/"):
        return os.path.join(cwd, path)
    return _resolve(path, cwd)


def _join(parts: Sequence[str]) -> str:
    return shlex.join(parts)


def _short_hash(text: str) -> str:
    return sha256_hex(text)[:12]


def python_runs(argv: Sequence[str]) -> tuple[str, str, int] | None:
    """The module or script a Python command line runs: `(what, name, at)`, `what` being `-m`
    (`name` the module), `-c` (`name` the code), `-` (code piped in) or `""` (`name` the script
    as given), and `argv[at:]` its arguments. None where `argv` is no Python or runs what is
    typed at its prompt (`python`, `python -u`).

    The interpreter's options before it are passed over, clustered or not (`-u`, `-X dev`,
    `-Wignore`, `-Im`, `--check-hash-based-pycs never`)."""
    if not argv or not _PYTHON_RE.match(os.path.basename(argv[0])):
        return None
    position = 1
    while position < len(argv):
        token = argv[position]
        if token == "-":
            return "-", "-", position + 1
        if token in _PYTHON_LONG_VALUE_OPTIONS:
            position += 2
            continue
        if token.startswith("--"):
            position += 1
            continue
        if not token.startswith("-"):
            return "", token, position + 1
        # Short options, possibly several glued together (-uB); the last may take a value.
        for offset, letter in enumerate(token[1:], start=1):
            glued = token[offset + 1 :]
            if letter in "cm":
                if glued:
                    return f"-{letter}", glued, position + 1
                value = argv[position + 1] if position + 1 < len(argv) else ""
                return f"-{letter}", value, position + 2
            if letter in _PYTHON_VALUE_OPTIONS:
                position += 0 if glued else 1
                break
        position += 1
    return None


def _python_script(args: list[str], cwd: str) -> tuple[str | None, str]:
    """(script identity, command line after the program) for a Python command line.

    Interpreter options before the script are left out of both.
    """
    runs = python_runs(["python", *args])
    if runs is None:
        return None, ""
    what, name, at = runs
    rest = args[at - 1 :]
    if what == "-":
        return "-", _join(["-", *rest])
    if what == "-c":
        identity = f"-c <{_short_hash(name)}>"
        return identity, f"{identity} {_join(rest)}".rstrip()
    if what == "-m":
        return _module(name, rest, cwd)
    script = _join([_resolve(name, cwd)])
    return script, _join([_resolve(name, cwd), *rest])


#: Modules that run other code (`python -m torch.distributed.run train.py`): without a script
#: among their arguments they have no script level, since their runs are anybody's.
_LAUNCHER_MODULES = frozenset(
    {
        "gpuwait",
        "torch.distributed.run",
        "torch.distributed.launch",
        "accelerate.commands.launch",
        "deepspeed",
        "deepspeed.launcher.runner",
        "runpy",
        "uv",
        "pip",
        "jupyter",
        "IPython",
        "ipykernel",
        "ipykernel_launcher",
        "xdist",
    }
)


def _module(module: str, rest: list[str], cwd: str) -> tuple[str | None, str]:
    """`-m pkg.mod` run from `cwd` (a local package depends on it), with the script a launcher
    module runs (`-m torch.distributed.run ... train.py`)."""
    identity = f"-m {_join([module])} (in {_join([cwd])})"
    script, tail = _launcher_script(rest, cwd)
    whole = f"{identity} {tail}" if tail else identity
    if script:
        return f"{identity} {script}", whole
    return (None if module in _LAUNCHER_MODULES else identity), whole


def _shell_script(args: list[str], cwd: str) -> tuple[str | None, str]:
    """(script identity, command line after the program) for a shell's command line.

    Options may be clustered, as CI and containers write them (`bash -lc CODE`, `bash -eo
    pipefail -c CODE`): a `c` among them makes the first operand inline code, and each `o`
    or `O` takes the next word as its option's name."""
    position = 0
    inline = False
    while position < len(args):
        token = args[position]
        if token == "--":
            position += 1
            break
        if not token.startswith(("-", "+")) or token in ("-", "+"):
            break
        if token.startswith("--"):
            position += 1
            continue
        letters = token[1:]
        inline = inline or "c" in letters
        position += 1 + sum(letter in "oO" for letter in letters)
    if inline:
        value = args[position] if position < len(args) else ""
        identity = f"-c <{_short_hash(value)}>"
        return identity, f"{identity} {_join(args[position + 1 :])}".rstrip()
    if position < len(args):
        script = _resolve(args[position], cwd)
        return _join([script]), _join([script, *args[position + 1 :]])
    return None, ""


def _script_value(token: str) -> str:
    return token.split("=", 1)[1] if token.startswith("-") and "=" in token else token


def _launcher_script(args: Sequence[str], cwd: str) -> tuple[str | None, str]:
    """The first argument that names a script (train.py, --script=x.py), resolved, and the
    arguments with that one replaced by its resolved form."""
    for position, token in enumerate(args):
        value = _script_value(token)
        if value.endswith(_SCRIPT_SUFFIXES) and not value.startswith("-"):
            resolved = _resolve(value, cwd)
            shown = list(args)
            shown[position] = f"{token.split('=', 1)[0]}={resolved}" if value != token else resolved
            return _join([resolved]), _join(shown)
    return None, _join(args)
