"""Starting the command: is it there, what it is given, and how it starts.

The command starts as gpuwait's child (`spawn`) when gpuwait coordinates it, or replaces gpuwait
(`exec_bare`) when it runs uncoordinated (no GPU readings and on_no_gpu = run, an unusable
ledger and on_state_error = run, or a shell hook's rules saying no). Either way it sees what it
would see bare: the default SIGPIPE and SIGXFSZ (Python ignores them for itself), its own signal
mask, gpuwait's stdin, stdout and stderr.
"""

from __future__ import annotations

import errno
import os
import re
import shlex
import signal
import stat
import sys
import time
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from itertools import pairwise

from gpuwait.core.budget import BYTES_VAR
from gpuwait.core.errors import EXIT_NOT_EXECUTABLE, EXIT_NOT_FOUND, GpuwaitError, UsageError
from gpuwait.core.text import whole_number
from gpuwait.core.wrap import hides_every_gpu
from gpuwait.core.wrappers import (
    APPTAINER_ENGINES,
    APPTAINER_OPTION_VARIABLES,
    CONTAINER_ENGINES,
    GPU_VARIABLES,
    NVIDIA_DOCKER,
    Step,
    apptainer_cleans_env,
    apptainer_command,
    apptainer_env_files,
    apptainer_gpu_env,
    apptainer_nvccli_contained,
    apptainer_option_variable,
    apptainer_pid_namespace,
    apptainer_pid_variables,
    container_gpus,
    declaring,
    drops_gpus,
    makes_a_number,
    passed_on,
    passed_on_each,
    runs_gpuwait,
    steps,
)
from gpuwait.linux import proc, signals, turnstile
from gpuwait.linux.outlived import JOB_ID_VARIABLE as JOB_ID_VARIABLE
from gpuwait.linux.outlived import JOB_PID_VARIABLE, JOB_START_VARIABLE

TYPE_CHECKING = False
if TYPE_CHECKING:
    # A command the shell hook runs bare loads this module to become it: the queue's modules
    # (and json) would be loaded for nothing.
    from gpuwait.core.snapshot import GpuSnapshot
    from gpuwait.queue.entries import Job


class CommandProblem(GpuwaitError):
    """The command cannot be started: not found (127) or not executable (126)."""

    def __init__(self, message: str, exit_code: int, hint: str | None = None) -> None:
        super().__init__(message, hint)
        self.exit_code = exit_code


#: Programs whose misspelling (`pyhton`) is answered with the one meant, where it is installed.
_MEANT = ("python", "python3", "torchrun", "accelerate", "deepspeed")


def _not_found(argv: Sequence[str]) -> CommandProblem:
    """`argv[0]` is not in PATH: where it is `python` and python3 is (Debian and Ubuntu
    install no `python`), the hint is the line with python3; where it names a file here, the
    line that runs it; where it misspells one of _MEANT that is installed, the line with that
    one."""
    hint = None
    if not argv[0]:
        # `gpuwait --vram 4G "$PY" x.py` with PY unset: ": command not found" names nothing.
        return CommandProblem(
            "'': command not found: the command's name is empty",
            EXIT_NOT_FOUND,
            "a variable that names it is empty or not set?",
        )
    if argv[0] == "python" and which("python3") is not None:
        hint = f"python3 is installed: gpuwait ... -- {shlex.join(['python3', *argv[1:]])}"
    elif "/" not in argv[0] and os.path.isfile(argv[0]):
        # `gpuwait train.py`: a file here, which a shell too runs only by a path or through
        # its interpreter.
        python = _python()
        run = [python, *argv] if argv[0].endswith(".py") and python else [f"./{argv[0]}", *argv[1:]]
        hint = f"{argv[0]} is a file here, not a program on PATH: gpuwait ... -- {shlex.join(run)}"
    elif "/" not in argv[0]:
        from gpuwait.core.text import nearest  # only once a program was not found

        installed = [name for name in _MEANT if which(name) is not None]
        match = nearest(argv[0], installed, cutoff=0.75)
        if match is not None:
            hint = f"did you mean {match}? gpuwait ... -- {shlex.join([match, *argv[1:]])}"
    return CommandProblem(f"{argv[0]}: command not found", EXIT_NOT_FOUND, hint)


def _python() -> str | None:
    """The python a hint's line runs a script with: `python`, else `python3` (Debian and
    Ubuntu install no `python`), where installed."""
    return next((p for p in ("python", "python3") if which(p) is not None), None)


def _not_executable(argv: Sequence[str]) -> CommandProblem:
    """`argv[0]`, a path, names no file it may run: where it is a Python script, the hint is
    the line that runs it with python; where it is another script of the user's own (a `#!`
    line, or `.sh`), to make it executable. A file of another user's, or no script, gets none."""
    name = argv[0]
    hint = None
    python = _python()
    if name.endswith(".py") and python is not None and as_shell_script([name]) is not None:
        # A text file (a binary one named so is no script python would run).
        hint = f"a Python script: gpuwait ... -- {shlex.join([python, *argv])}"
    elif (first := _first_line(name) or b"").startswith(b"#!") or name.endswith(".sh"):
        try:
            own = os.path.isfile(name) and os.stat(name).st_uid == os.getuid()
            noexec = os.path.isfile(name) and bool(os.statvfs(name).f_flag & os.ST_NOEXEC)
        except OSError:
            own = noexec = False
        if noexec:
            # chmod +x changes nothing there: the kernel runs the interpreter of its #! line
            # (one word after it at most), /bin/sh where it has none, as one would by hand.
            words = (
                os.fsdecode(first[2:]).strip().split(maxsplit=1) if first.startswith(b"#!") else []
            )
            line = [*(words or ["/bin/sh"]), name, *argv[1:]]
            run = shlex.join(line)
            hint = f"its file system runs no program (mounted noexec): gpuwait ... -- {run}"
        elif own:
            hint = f"make it executable first: chmod +x {shlex.quote(name)}"
    return CommandProblem(f"{name}: not executable", EXIT_NOT_EXECUTABLE, hint)


def check_script(argv: Sequence[str], waits_for_others: bool) -> str | None:
    """A Python command line whose script is not there (`python trian.py`) would wait for its
    GPU, then fail: refused (UsageError) where a file beside it with its ending has a close
    name (`train.py`, not train.ipynb), a misspelling beyond doubt, unless the job waits for
    others (`--after`), which may write it, or the two are of a series (`run_3.py` beside
    `run_2.py`). Otherwise a warning to say before the wait, or None: a script that another
    step writes while this job waits must not cost the run."""
    from gpuwait.core.cmdkey import python_script_at  # only Python command lines pay for it

    try:
        cwd = os.getcwd()
    except OSError:
        return None
    found = python_script_at(argv, cwd)
    if found is None:
        return None
    script, at = found
    typed = argv[at]
    if os.path.exists(script):
        return None
    folder = os.path.dirname(script)
    # Only a name with its ending (train.py for trian.py): train.ipynb, or the config.py.in
    # config.py is made from, is no script python runs, and may be what a step writes it from.
    stem, ending = os.path.splitext(os.path.basename(typed))
    try:
        names = [
            n
            for n in os.listdir(folder)
            if os.path.splitext(n)[1] == ending and os.path.isfile(os.path.join(folder, n))
        ]
    except OSError:
        names = []
    from gpuwait.core.text import nearest  # only once a script is missing

    match = nearest(os.path.basename(typed), names, cutoff=0.75) if names else None
    if match is not None and nearest(stem, [os.path.splitext(match)[0]], cutoff=0.5) is None:
        match = None  # x.py and b.py: alike in their ending alone
    meant = None if match is None else os.path.join(os.path.dirname(typed), match)
    program = os.path.basename(argv[0])
    # Names apart only in their digits (run_3.py beside run_2.py): a series, whose next one a
    # step may be writing.
    series = match is not None and _digitless(match) == _digitless(os.path.basename(typed))
    if meant is not None and not waits_for_others and not series:
        fixed = [*argv[:at], meant, *argv[at + 1 :]]
        raise UsageError(
            f"no script {typed} here: {program} would wait for its GPU, then fail",
            hint=f"did you mean {meant}? gpuwait ... -- {shlex.join(fixed)}",
        )
    guess = "" if meant is None else f"; did you mean {meant}?"
    return (
        f"no script {typed} here (yet{guess}): {program} fails unless it is there once its GPU is"
    )


def _digitless(name: str) -> str:
    return re.sub(r"[0-9]+", "", name)


def check_command(argv: Sequence[str]) -> str:
    """The executable `argv[0]` resolves to; raises CommandProblem (127, 126) otherwise."""
    name = argv[0]
    if "/" in name:
        if not os.path.exists(name):
            raise CommandProblem(f"{name}: no such file", EXIT_NOT_FOUND)
        if os.path.isdir(name) or not os.access(name, os.X_OK):
            raise _not_executable(argv)
        found: str | None = name
    else:
        found = which(name)
    if found is None:
        raise _not_found(argv)
    interpreter = _hash_bang(found)
    if interpreter is None:
        if found.endswith(".py") and as_shell_script([found]) is not None:
            # Without a #! line the kernel runs no script: /bin/sh would read the Python, once
            # the whole wait is over, and stop at its first line.
            python = _python()
            raise UsageError(
                f"{name} has no #! line: /bin/sh would run it once its GPU is free, not python",
                # By its path: one found in PATH is no file here for python to open.
                hint=f"gpuwait ... -- {shlex.join([python, found, *argv[1:]])}"
                if python is not None
                else "give it a first line #!/usr/bin/env python3",
            )
        return found
    # Found only when it starts, after the whole wait, unless looked at now. A relative one
    # (`#!python3`) the kernel looks for in the current directory, as done here: not in PATH.
    if not os.path.exists(interpreter):
        # A console script of a virtual environment moved or removed since.
        where = (
            ""
            if interpreter.startswith("/")
            else f" in {os.getcwd()}: a #! line takes a full path "
            f"(#!/usr/bin/env {interpreter} looks in PATH)"
        )
        raise CommandProblem(
            f"{name}: its #! line names {interpreter}, which does not exist{where}",
            EXIT_NOT_FOUND,
        )
    if os.path.isdir(interpreter) or not os.access(interpreter, os.X_OK):
        # The kernel refuses the script (a shell's "bad interpreter: Permission denied").
        raise CommandProblem(
            f"{name}: its #! line names {interpreter}, which is not executable",
            EXIT_NOT_EXECUTABLE,
        )
    return found


def _hash_bang(path: str) -> str | None:
    """The interpreter a script's #! line names, or None."""
    first = _first_line(path) or b""
    if not first.startswith(b"#!"):
        return None
    words = first[2:].split()
    return os.fsdecode(words[0]) if words else None


def _first_line(path: str, size: int = 256) -> bytes | None:
    """The first line of a plain file (at most `size` bytes), or None where it cannot be read
    or is no plain file."""
    try:
        # Never waited on: a FIFO named like a program is no program.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, size).split(b"\n", 1)[0]
    except OSError:
        return None
    finally:
        os.close(fd)


def _sh() -> str:
    """Which shell a command named sh is, told by the name of the program the `sh` found on
    PATH resolves to: dash (Debian's and Ubuntu's /bin/sh), which has no declare or typeset,
    its code read as dash's; "sh" where it is another or none, read as bash's."""
    found = which("sh")
    return "dash" if found and os.path.basename(os.path.realpath(found)) == "dash" else "sh"


def check_not_srun(argv: Sequence[str]) -> None:
    """Refuse Slurm's `srun` as the command (UsageError, 2): slurmstepd starts the step's tasks
    with CUDA_VISIBLE_DEVICES set to Slurm's GPUs (all of the job's, or the step's own), not the
    ones gpuwait reserved, so the task would run, unreserved, where gpuwait did not put it.
    Looked for through wrappers too (`env`, `nice`, `time`, `timeout 60`, `sudo -E` ...)."""
    if not any(step.program == "srun" for step in steps(argv, sh=_sh())):
        return
    raise UsageError(
        "srun starts its tasks with Slurm's own CUDA_VISIBLE_DEVICES, not the GPU gpuwait "
        "reserves: they would run on GPUs gpuwait did not give them",
        hint="run gpuwait inside the step instead: srun ... gpuwait --vram SIZE -- COMMAND",
    )


def _opens_engine(found: Sequence[Step], engines: frozenset[str] = CONTAINER_ENGINES) -> bool:
    """The first of `found` starts a container engine of `engines` with nothing after it:
    each step runs the next as its own last words. Where a shell's code runs more than the
    engine (`sudo sh -c 'docker pull img && python x.py'`), the rest runs under the wrapper
    too."""
    return bool(found) and _opening_engine(found, engines)[0]


def _opening_engine(
    found: Sequence[Step], engines: frozenset[str] = CONTAINER_ENGINES
) -> list[bool]:
    """_opens_engine(found[at:], engines) for each `at`, in one pass from the last step."""
    opens = [False] * len(found)
    for at in range(len(found) - 2, -1, -1):
        outer, inner = found[at], found[at + 1]
        if outer.argv[len(outer.argv) - len(inner.argv) :] == inner.argv:
            opens[at] = inner.program in engines or opens[at + 1]
    return opens


def check_keeps_gpus(argv: Sequence[str], by_index: bool = False) -> None:
    """Refuse a command that runs through a wrapper starting it without the CUDA_VISIBLE_DEVICES
    gpuwait sets (UsageError, 2): `sudo -u alice python x.py` (sudo's env_reset), doas, pkexec,
    `su -l`, `env -i`. The command would see every GPU, those given to other jobs too, and
    allocate on whichever it took. The hint is the line that keeps the variables, where there
    is one: sudo's --preserve-env=LIST, su's -w LIST.

    `by_index` (visible_devices = index): CUDA_VISIBLE_DEVICES names NVML's indices, in PCI
    order, which CUDA reads in its own fastest-first order without CUDA_DEVICE_ORDER: a
    wrapper must keep that too, or the index may name a card gpuwait gave another job.

    A wrapper may drop them before a gpuwait of the command's own (`env -u CUDA_VISIBLE_DEVICES
    gpuwait --vram 1G -- ...`, `sudo -u alice gpuwait ...`): that one sets them for its command."""
    _check_keeps(argv, steps(argv, sh=_sh()), by_index)


def _check_keeps(
    argv: Sequence[str],
    found: Sequence[Step],
    by_index: bool,
    start: Mapping[str, str] | None = None,
) -> None:
    """check_keeps_gpus for `found`, the steps of `argv` or those of a command an Apptainer
    container runs in it (`apptainer exec --nv img.sif env CUDA_VISIBLE_DEVICES=0 python
    x.py`), which sees every GPU; `start`: gpuwait's variables as such a command gets them
    (`_in_container`), None where not known (taken as gpuwait's own)."""
    if any(runs_gpuwait(step) for step in found):
        return
    # What reaches each step through the wrappers before it, once for all of them: a line of
    # many wrappers (`env A=1 env B=2 ...`) costs each once, not once for each after it.
    environs = _apptainer_environs(found)
    nvidia = passed_on_each(found, ("NVIDIA_VISIBLE_DEVICES", "NV_GPU"), os.environ)
    given = _given(found, start)
    fish = _in_fish_code(found)
    for at, step in enumerate(found):
        _check_container(argv, step, nvidia[at])
        _check_apptainer(argv, step, GPU_VARIABLES[: 2 if by_index else 1], environs[at])
        _check_nvccli(argv, step, by_index, found[:at], environs[at])
    engines = _opening_engine(found)
    apptainers = _opening_engine(found, APPTAINER_ENGINES)
    # The actions that clean their environment, with where each is.
    cleaning = [
        (later, inner)
        for later, inner in enumerate(found)
        if apptainer_cleans_env(inner, environs[later])
    ]
    for at, step in enumerate(found):
        if engines[at]:
            # `sudo docker run ...`: the engine passes no CUDA_VISIBLE_DEVICES into the
            # container anyway, whose GPUs are those its own options name.
            break
        # A container that cleans its environment (`apptainer exec --cleanenv`) takes its GPUs
        # from the APPTAINERENV_ (SINGULARITYENV_) copies: the wrapper must keep those too.
        copies = [
            f"{inner.program.upper()}ENV_{name}"
            for later, inner in cleaning
            if later > at
            for name in GPU_VARIABLES
        ]
        # An index the line passes on (`env CUDA_VISIBLE_DEVICES=1`, gpuwait held to 1) names
        # NVML's card only in the order gpuwait sets, as under visible_devices = index.
        # One that hides every GPU (`env -i CUDA_VISIBLE_DEVICES= python prep.py`) has none
        # to number.
        indexed = (by_index or _names_an_index(given[at + 1])) and not _hides_every_gpu(
            given[at + 1]
        )
        needed = GPU_VARIABLES[: 2 if indexed else 1]
        _check_sets(argv, step, needed, given[at], fish[at])
        if not by_index and makes_a_number(step, GPU_VARIABLES[0]):
            raise UsageError(
                f"the shell's code makes {GPU_VARIABLES[0]} a number before its command "
                f"({shlex.join(step.argv)}): {step.shell or 'the shell'} reads the GPU UUID "
                "gpuwait sets as arithmetic, and the command would run on GPU 0, whichever "
                "gpuwait reserved, or on none",
                hint=f"leave {GPU_VARIABLES[0]} to the command: make it no integer or float",
            )
        needed += tuple(c for c in copies if c.endswith(needed))
        # env makes its assignments after its -i and -u (`env -i CUDA_VISIBLE_DEVICES=
        # python prep.py`): one set again reaches the command, judged by _check_sets above.
        again = {w.partition("=")[0] for w in step.sets} if step.program == "env" else set()
        dropped = [v for v in needed if drops_gpus(step, v) and v not in again]
        if apptainers[at]:
            # Apptainer gives the container the APPTAINERENV_ (SINGULARITYENV_) copy over the
            # caller's variable: `env -u CUDA_VISIBLE_DEVICES apptainer exec` keeps its GPU.
            engine = next(
                inner.program for inner in found[at + 1 :] if inner.program in APPTAINER_ENGINES
            )
            dropped = [
                v
                for v in dropped
                if v not in GPU_VARIABLES or drops_gpus(step, f"{engine.upper()}ENV_{v}")
            ]
        if not dropped:
            continue
        variable = dropped[0]
        keeps = [*GPU_VARIABLES, *dict.fromkeys(copies)]
        keep = ",".join(keeps)
        under = f"{step.program} ... gpuwait --vram SIZE -- COMMAND"
        where = len(argv) - len(step.argv)
        suffix = tuple(argv[where:]) == step.argv
        if step.program == "sudo" and suffix:
            line = _extended(argv, where, step, ("--preserve-env",), keeps) or [
                *argv[: where + 1],
                f"--preserve-env={keep}",
                *argv[where + 1 :],
            ]
            hint = f"keep them: gpuwait ... -- {shlex.join(line)}"
        elif step.program in ("su", "runuser") and suffix:
            line = _extended(argv, where, step, ("-w", "--whitelist-environment"), keeps) or [
                *argv[: where + 1],
                "-w",
                keep,
                *argv[where + 1 :],
            ]
            hint = f"keep them: gpuwait ... -- {shlex.join(line)}"
        elif step.program == "env" and suffix and _drops_later(found, at, needed):
            # `env -i sudo python x.py`: sudo's refusal first, its line then judged for env,
            # whose line sets them again for a sudo that keeps them.
            continue
        elif step.program == "env" and suffix:
            hint = f"keep {variable}: gpuwait ... -- {_env_kept(argv, where, step, keeps)}"
        elif step.program == "env":
            hint = f"leave {variable} to the command: unset only what it must not see"
        elif step.program == "exec":
            hint = "leave out exec's -c, which starts the command with an empty environment"
        elif step.program == "unset":
            hint = f"leave {variable} to the command: unset it nowhere in the command"
        elif step.program in declaring(step.shell):
            hint = f"leave {variable} to the command: keep it exported, not an array"
        elif step.program == "set":
            hint = f"leave {variable} to the command: erase, unexport or shadow it nowhere"
        elif step.program == "setpriv":
            hint = f"leave out --reset-env, or run gpuwait under it instead: {under}"
        else:
            hint = f"run gpuwait under it instead: {under}"
        if step.program == "systemd-run":
            raise UsageError(
                "systemd-run starts its command in a unit of systemd's, not as gpuwait's child "
                "and without the CUDA_VISIBLE_DEVICES gpuwait sets: it would see every GPU, "
                "and the job would end before it",
                hint=f"run gpuwait in the unit instead: {under} (or use systemd-run --scope)",
            )
        what = (
            "it would see every GPU, those given to other jobs too"
            if variable.endswith(GPU_VARIABLES[0])
            else "it would number the GPUs fastest-first, and the index "
            + (
                "gpuwait gives (visible_devices = index)"
                if by_index
                else "CUDA_VISIBLE_DEVICES names"
            )
            + " could name a GPU given to another job"
        )
        doer = f"{step.program} starts its command"
        if step.program == "unset":
            doer = f"the shell's code unsets {variable} before its command, which starts"
        elif step.program in declaring(step.shell) or step.program == "set":
            doer = (
                f"the shell's code takes {variable} out of its environment before its "
                f"command ({shlex.join(step.argv)}), which starts"
            )
        raise UsageError(f"{doer} without the {variable} gpuwait sets: {what}", hint=hint)
    for index, inner in _container_commands(found):
        cleans = apptainer_cleans_env(found[index], environs[index])
        # Read up to an expansion (`sh -c 'exec apptainer ... env -i "A=$A" python x.py'`):
        # so are the words of the command in it.
        # Its `sh` is the image's, which may be bash where the host's is dash: read as bash's.
        start = _in_container(found[index], given[index], cleans)
        _check_keeps(argv, steps(inner, found[index].cut), by_index, start)


def _names_an_index(given: Mapping[str, str] | None) -> bool:
    """Does the CUDA_VISIBLE_DEVICES in `given` (of `_given`), set by the line, not gpuwait's,
    name a GPU by its index (`1`, gpuwait's own value passed on), which CUDA numbers as NVML
    does only with CUDA_DEVICE_ORDER=PCI_BUS_ID?"""
    value = (given or {}).get(GPU_VARIABLES[0])
    if value is None or value == _GPUWAITS:
        return False
    entries = value.strip(" \"'").split(",")
    return any(whole_number(entry.strip()) is not None for entry in entries)


def _hides_every_gpu(given: Mapping[str, str] | None) -> bool:
    """Does the CUDA_VISIBLE_DEVICES in `given` (of `_given`), set by the line, hide every GPU
    from its command (`hides_every_gpu`)?"""
    value = (given or {}).get(GPU_VARIABLES[0])
    return value is not None and value != _GPUWAITS and hides_every_gpu(value.strip(" \"'"))


def _drops_later(found: Sequence[Step], at: int, names: Sequence[str]) -> bool:
    """Does a wrapper after `found[at]` (before any container engine) drop one of `names`?"""
    for later in range(at + 1, len(found)):
        if _opens_engine(found[later:]):
            return False
        if any(drops_gpus(found[later], name) for name in names):
            return True
    return False


#: A stand-in for gpuwait's own value of a variable it gives the command (`_given`).
_GPUWAITS = "\0gpuwait"


def _given(
    found: Sequence[Step], start: Mapping[str, str] | None = None
) -> list[dict[str, str] | None]:
    """The variables gpuwait gives the command that name its GPUs or their order, as each step
    of `found` gets them (passed_on_each): gpuwait's own value (_GPUWAITS), or one set before.
    `start`: those the first step starts with, where not gpuwait's own (`_in_container`)."""
    names = _given_names()
    return passed_on_each(found, names, dict.fromkeys(names, _GPUWAITS) if start is None else start)


def _given_names() -> tuple[str, ...]:
    """The variables gpuwait gives the command that name its GPUs or their order (`_given`)."""
    names = (*GPU_VARIABLES, *_container_names(GPU_VARIABLES))
    return (*names, "GPUWAIT_GPU_UUIDS", "GPUWAIT_GPU_INDICES")


def _in_container(
    step: Step, reaching: Mapping[str, str] | None, cleaned: bool
) -> dict[str, str] | None:
    """The variables of `_given_names` that the command an Apptainer action (`step`) runs
    gets, from those that reach the action (`reaching`, of `_given`; None: not known): each
    from its APPTAINERENV_ (SINGULARITYENV_) copy where there is one, else, but in a container
    that cleans its environment (`cleaned`), as it reaches the action, emptied or dropped by a
    wrapper before it (`env GPUWAIT_GPU_UUIDS= apptainer exec ...`) too."""
    if reaching is None:
        return None
    prefixes = sorted(CONTAINER_ENV_PREFIXES, key=lambda p: p != f"{step.program.upper()}ENV_")
    got: dict[str, str] = {}
    for name in _given_names():
        copies = [reaching[p + name] for p in prefixes if p + name in reaching]
        if copies:
            got[name] = copies[0]
        elif not cleaned and name in reaching:
            got[name] = reaching[name]
    return got


#: Expansions that keep whole entries of a list cut at its commas, so some of the GPUs it
#: names: the first (`${NAME%%,*}`), all but the last (`%,*`), all but the first (`#*,`), the
#: last (`##*,`); each the whole value where it names one GPU.
_KEEPS_ENTRIES: dict[str, Callable[[str], str]] = {
    "%%,*": lambda v: v.split(",", 1)[0],
    "%,*": lambda v: v.rsplit(",", 1)[0],
    "#*,": lambda v: v.split(",", 1)[-1],
    "##*,": lambda v: v.rsplit(",", 1)[-1],
}


def _reaching(value: str, names: str, given: Mapping[str, str] | None, fish: bool = False) -> str:
    """What `value`, set by a wrapper or a shell, gives its variable: where it passes on one of
    `names` (a pattern: `$GPUWAIT_GPU_UUIDS`, `"${CUDA_VISIBLE_DEVICES:-0}"`), that one's value
    as the step gets it (`given`, of `_given`; None: not known, taken as gpuwait's), or the
    default that fills it where a wrapper or the code emptied or unset it: _GPUWAITS where it is
    gpuwait's own, or some of its GPUs (`${CUDA_VISIBLE_DEVICES%%,*}`; `fish`: fish's code,
    where `$CUDA_VISIBLE_DEVICES[1]` is the whole value, fish splitting no such variable).
    `env GPUWAIT_GPU_UUIDS=0 sh -c 'CUDA_VISIBLE_DEVICES=$GPUWAIT_GPU_UUIDS ...'` gives 0."""
    # `${NAME:?message}`: NAME's, or none, the shell stopping where it has none.
    default = r"(?P<colon>:?)(?:[-=](?P<default>[^}]*)|\?[^}]*)"
    cut = "|".join(re.escape(c) for c in _KEEPS_ENTRIES)
    element = r"(?:\[-?1\])?" if fish else ""
    match = re.fullmatch(
        rf'"?\$(?:(?P<bare>{names}){element}|\{{(?P<name>{names})(?:{default}|(?P<cut>{cut}))?\}})"?',
        value,
    )
    if match is None:
        return value
    if given is None:
        return _GPUWAITS
    got = given.get(match["bare"] or match["name"])
    if match["default"] is not None and (
        got is None or (match["colon"] and got != _GPUWAITS and not got.strip(" \"'"))
    ):
        return match["default"]
    if got is None:
        return ""
    return got if got == _GPUWAITS or match["cut"] is None else _KEEPS_ENTRIES[match["cut"]](got)


def _in_fish_code(found: Sequence[Step]) -> list[bool]:
    """For each of `found`, whether its words are fish's code (`fish -c 'env A=$B[1] ...'`: env's
    and those of each wrapper after it), up to another shell's code (`bash -c`, `su -c`)."""
    inside: list[bool] = []
    fish = False
    for step in found:
        inside.append(fish or step.program == "fish")
        if any(name == "-c" for name, _ in step.options):
            fish = step.program == "fish"
    return inside


def _check_sets(
    argv: Sequence[str],
    step: Step,
    names: Sequence[str],
    given: Mapping[str, str] | None = None,
    fish_code: bool = False,
) -> None:
    """Refuse a wrapper that sets a variable of `names` for its command (UsageError, 2): `env
    CUDA_VISIBLE_DEVICES=0 python x.py`, `sudo -E CUDA_VISIBLE_DEVICES=0 ...`, `sh -c
    'CUDA_VISIBLE_DEVICES=0 python x.py'`, or its APPTAINERENV_ (SINGULARITYENV_) copy,
    which an Apptainer container takes over the caller's: the command would run on GPU 0,
    whichever gpuwait reserved. Let be: what gpuwait sets itself (CUDA_DEVICE_ORDER=PCI_BUS_ID),
    an empty value, -1 or none, which hides every GPU (a CPU step: `core.wrap.hides_every_gpu`),
    what gpuwait gives passed on by a shell (`"$CUDA_VISIBLE_DEVICES"`, `$GPUWAIT_GPU_UUIDS`,
    `${CUDA_VISIBLE_DEVICES:-0}`, whose default gpuwait's value always fills),
    and the one GPU gpuwait's own CUDA_VISIBLE_DEVICES names, passed on as it is (`env
    CUDA_VISIBLE_DEVICES="$CUDA_VISIBLE_DEVICES" ...`, expanded by the caller's shell), the only
    GPU gpuwait may reserve there. The hint is the line without it, where it is a word of the
    line's own; the GPUs gpuwait picks from are chosen before it. `given`: gpuwait's variables
    as the step gets them (`_given`), which a default fills where a wrapper emptied one.
    `fish_code`: the step's words are fish's code (`_in_fish_code`)."""
    before = None if given is None else dict(given)
    fish = fish_code or "fish" in (step.program, step.shell)
    for word in step.sets:
        name, _, value = word.partition("=")
        now = before
        if before is not None and name in before:
            # What it sets counts for one passed on after it (`export CUDA_VISIBLE_DEVICES=;
            # ...=${CUDA_VISIBLE_DEVICES:-0}`, `GPUWAIT_GPU_UUIDS=0; ...=$GPUWAIT_GPU_UUIDS`).
            known = "|".join(re.escape(n) for n in before)
            before = {**before, name: _reaching(value, known, before, fish)}
        variable = next((v for v in names if name in (v, *_container_names([v]))), None)
        if variable is None:
            continue
        gpuwaits = f"(?:{name}|{variable}|GPUWAIT_GPU_UUIDS|GPUWAIT_GPU_INDICES)"
        # What gpuwait gives, passed on by a shell (`...=$GPUWAIT_GPU_UUIDS`), is let be; one a
        # wrapper or the code set before (`env GPUWAIT_GPU_UUIDS=0 sh -c ...`), or the default
        # filling one emptied (`${CUDA_VISIBLE_DEVICES:-0}`), is judged as if set here.
        reached = _reaching(value, gpuwaits, now, fish)
        if reached == _GPUWAITS:
            continue
        if variable == GPU_VARIABLES[1] and reached.strip("\"'") == "PCI_BUS_ID":
            continue  # what gpuwait sets, quoted or not (`export CUDA_DEVICE_ORDER="PCI_BUS_ID"`)
        if variable == GPU_VARIABLES[0] and hides_every_gpu(reached.strip(" \"'")):
            continue  # empty, -1, none: CUDA sees no GPU at all (a CPU step), nobody else's
        own = os.environ.get(GPU_VARIABLES[0], "")
        if variable == GPU_VARIABLES[0] and reached == own and own.strip() and "," not in own:
            continue
        where = len(argv) - len(step.argv)
        # The word, or systemd-run's option that sets it (-E NAME=VALUE, --setenv=...).
        at = next(
            (where + n for n, w in enumerate(step.argv) if n and w in (word, f"--setenv={word}")),
            None,
        )
        if at is not None and tuple(argv[where:]) == step.argv:
            begin = at
            if step.program == "systemd-run" and argv[at] == word:
                begin -= argv[at - 1] in ("-E", "--setenv")
            words = [*argv[:begin], *argv[at + 1 :]]
            if step.program == "sudo" and drops_gpus(step):
                # Its env_reset would drop gpuwait's too: the line that keeps them.
                words = _extended(words, where, step, ("--preserve-env",)) or [
                    *words[: where + 1],
                    f"--preserve-env={','.join(GPU_VARIABLES)}",
                    *words[where + 1 :],
                ]
            if step.program == "env" and drops_gpus(step):
                # `env -i`: it would drop gpuwait's too, the line set them again, with the
                # copies a container that cleans its environment takes.
                inner = steps(words[where:], sh=_sh())
                keep = [
                    *GPU_VARIABLES,
                    *(
                        f"{s.program.upper()}ENV_{n}"
                        for s in dict.fromkeys(s for s in inner[1:] if apptainer_cleans_env(s))
                        for n in GPU_VARIABLES
                    ),
                ]
                line = f"gpuwait ... -- {_env_kept(words, where, inner[0], keep)}"
            else:
                line = f"gpuwait ... -- {shlex.join(words)}"
        else:
            line = f"set {name} nowhere in the command"
        if variable == GPU_VARIABLES[0]:
            what = "it would run on GPUs gpuwait did not give it, those given to other jobs too"
            choose = (
                f"; to have it pick from those GPUs: {shlex.quote(word)} gpuwait ... -- COMMAND"
                # GPUs named (0,1; GPU-UUID), not an expansion or xargs's {} and %
                if name == variable and re.fullmatch(r"[\w.:-]+(?:,[\w.:-]+)*", value)
                else ""
            )
        else:
            what = (
                "its CUDA could number the GPUs fastest-first, and the index gpuwait gives "
                "(visible_devices = index) name a GPU given to another job"
            )
            choose = ""
        raise UsageError(
            f"{step.program} sets {shlex.quote(word)} for its command, over the {variable} "
            f"gpuwait sets: {what}",
            hint=f"leave {variable} to gpuwait: {line}{choose}",
        )


def _check_container(argv: Sequence[str], step: Step, environ: Mapping[str, str] | None) -> None:
    """Refuse `docker run`, `podman run`, `nerdctl run` or `nvidia-docker run` giving the
    container GPUs of its own (UsageError, 2): `--gpus all`, `--gpus 2`, `--gpus device=1`,
    `--device nvidia.com/gpu=all`, `--device /dev/nvidia0`, the NVIDIA runtime with
    NVIDIA_VISIBLE_DEVICES (nvidia-docker's own too). The engine passes no
    CUDA_VISIBLE_DEVICES into the container, whose command would run on the GPUs named there,
    those given to other jobs too. The hint is the line that names the GPUs gpuwait reserves
    (GPUWAIT_GPU_UUIDS) instead. `environ`: the NVIDIA_VISIBLE_DEVICES and NV_GPU it reads,
    as the wrappers it runs under drop or set them (passed_on)."""
    spans = container_gpus(step, environ, _env_lines)
    if not spans:
        return
    given = " ".join(step.argv[spans[0][0] : spans[0][1]])
    if step.program == "podman":
        names = '--device "nvidia.com/gpu=$GPUWAIT_GPU_UUIDS"'
        also = "for one GPU"
    else:
        names = '--gpus "\\"device=$GPUWAIT_GPU_UUIDS\\""'
        also = "or contrib/docker's gpuwait-docker-run" if step.program == "docker" else ""
    # An --env-file stays, for its other variables: --gpus names the GPUs over it.
    # (nvidia-docker's runtime, where no option names the GPUs, is no word: at its end maybe.)
    cut = [(b, e) for b, e in spans if not (b < e and step.argv[b].startswith("--env-file"))]
    kept = [
        shlex.quote(word)
        for at, word in enumerate(step.argv)
        if not any(begin <= at < end for begin, end in cut)
    ]
    kept.insert(spans[0][0], names)
    what = f"the GPUs its own option names ({given})"
    where = len(argv) - len(step.argv)
    if step.program == NVIDIA_DOCKER:
        # It adds the NVIDIA runtime; docker itself takes --gpus.
        kept[0] = "docker"
        # And NVIDIA_VISIBLE_DEVICES=$NV_GPU where NV_GPU is set, before the options given.
        nv_gpu = (environ or {}).get("NV_GPU", "")
        if not given and nv_gpu:
            what = f"the GPUs NV_GPU names (NV_GPU={shlex.quote(nv_gpu)})"
        elif not given:
            what = "the GPUs of the NVIDIA runtime it adds (every GPU, for a CUDA image)"
    if tuple(argv[where:]) == step.argv:
        # The wrappers before it run inside the shell, which names the GPUs.
        code = " ".join(["exec", *(shlex.quote(word) for word in argv[:where]), *kept])
        line = f"gpuwait ... -- sh -c {shlex.quote(code)}"
    elif step.cut:
        # In a shell's code read up to an expansion: the words after it are not known here.
        instead = "before" if given.startswith("--env-file") else "in place of"
        line = f"in its code, {names} {instead} {given}" if given else f"in its code, {names}"
        # Each other option that gives it GPUs goes too (`--runtime=nvidia -e
        # NVIDIA_VISIBLE_DEVICES=all`), as in the line given where every word is read.
        # (Not the runtime nvidia-docker adds, no word, where its first option may begin.)
        others = [" ".join(step.argv[b:e]) for b, e in cut if (b, e) != spans[0]]
        if others:
            line += f", and leave out {', '.join(others)}"
        if step.program == NVIDIA_DOCKER:
            # Its runtime, which it adds whatever --gpus says: docker itself takes --gpus.
            line += f", and docker in place of {NVIDIA_DOCKER}"
    else:
        line = f"sh -c {shlex.quote(' '.join(['exec', *kept]))}"
    raise UsageError(
        f"{step.program} run gives the container {what}, not the one gpuwait reserves: the "
        "CUDA_VISIBLE_DEVICES gpuwait sets does not reach the container, which would run on "
        "GPUs given to other jobs too",
        hint=f"name the reserved GPUs (GPUWAIT_GPU_UUIDS) in a shell: {line}"
        + (f" ({also})" if also else ""),
    )


def _apptainer_environs(found: Sequence[Step]) -> list[dict[str, str]]:
    """The variables that give an Apptainer action options (APPTAINER_CONTAINALL=1 ...) as it
    starts under the wrappers before it, from gpuwait's environment: for each step of `found`
    (under found[:k], the k-th), and for the end of them all; none where a wrapper's options
    are not all known."""
    return [e or {} for e in passed_on_each(found, APPTAINER_OPTION_VARIABLES, os.environ)]


def _check_apptainer(
    argv: Sequence[str], step: Step, names: Sequence[str], environ: Mapping[str, str]
) -> None:
    """Refuse an `apptainer` or `singularity` action that sets a variable of `names` in the
    container with its own --env or --env-file, or the file APPTAINER_ENV_FILE names
    (UsageError, 2): those win over the APPTAINERENV_ (SINGULARITYENV_) ones gpuwait sets,
    and `--env CUDA_VISIBLE_DEVICES=0` would run the container on GPU 0, given to other jobs
    too. The hint is the line without them (gpuwait's own reach the container), or, for a
    file, one that names the reserved GPUs after it (--env wins over --env-file).
    `environ`: the variables it starts with, as the wrappers it runs under pass
    APPTAINER_ENV_FILE on (_apptainer_environs)."""
    where = len(argv) - len(step.argv)
    # The wrappers before it, where the step is the end of the line.
    before = list(argv[:where]) if tuple(argv[where:]) == step.argv else None
    options = apptainer_gpu_env(step, names)
    if options:
        begin, end, rest, variable = options[0]
        names = [variable]
        line = shlex.join([*step.argv[:begin], *rest, *step.argv[end:]])
        if before is not None:
            kept = [*before, *step.argv[:begin], *rest, *step.argv[end:]]
            line = f"gpuwait ... -- {shlex.join(kept)}"
        elif step.cut:
            # In a shell's code read up to an expansion: the words after it are not known here.
            taken = shlex.join(step.argv[begin:end])
            line = f"in its code, {shlex.join(rest)} in place of {taken}" if rest else ""
            line = line or f"in its code, leave out {taken}"
        hint = f"leave the GPUs to gpuwait: {line}"
    else:
        files = [
            (begin, end, named)
            for path, begin, end in apptainer_env_files(step, environ)
            if (named := [name for name in names if _sets(path, name)])
        ]
        if not files:
            return
        begin, end, names = files[0]
        values = {"CUDA_VISIBLE_DEVICES": "$GPUWAIT_GPU_UUIDS", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        after = [f'--env "{name}={values[name]}"' for name in names]
        kept = [*map(shlex.quote, step.argv[:end]), *after, *map(shlex.quote, step.argv[end:])]
        code = " ".join(["exec", *map(shlex.quote, before or []), *kept])
        line = shlex.join(["sh", "-c", code])
        if before is None and step.cut:
            line = f"in its code, {' '.join(after)} after {shlex.join(step.argv[begin:end])}"
        hint = "name the reserved GPUs after it, in a shell: " + (
            line if before is None else f"gpuwait ... -- {line}"
        )
    given = " ".join(step.argv[begin:end]) or apptainer_option_variable(step, "--env-file", environ)
    prefix = step.program.upper() + "ENV_"
    what = (
        "it would run on GPUs gpuwait did not give it, those given to other jobs too"
        if names[0] == GPU_VARIABLES[0]
        else "its CUDA could number the GPUs fastest-first, and the index gpuwait gives "
        "(visible_devices = index) name a GPU given to another job"
    )
    raise UsageError(
        f"{step.program} sets the container's {names[0]} with its own option ({given}), over "
        f"the {prefix}{names[0]} gpuwait gives it: {what}",
        hint=hint,
    )


def _check_nvccli(
    argv: Sequence[str],
    step: Step,
    by_index: bool,
    before: Sequence[Step],
    environ: Mapping[str, str],
) -> None:
    """Refuse `apptainer exec --nvccli --containall` (or --contain) as the command where
    gpuwait's environment has no NVIDIA_VISIBLE_DEVICES naming GPUs (UsageError, 2):
    nvidia-container-cli binds in only the GPUs it names, none where it is unset, and the
    job would fail once its turn came, its GPU missing from the container. The hint names the
    reserved GPUs there (or, with `visible_devices = index`, every GPU, which keeps CUDA's
    numbering that of NVML's). `before`: the wrappers it runs under, as they pass it on; where
    one drops it, a value set before them would not reach it either, and no line is given.
    `environ`: the variables that give it options, as they pass them on (_apptainer_environs)."""
    if not apptainer_nvccli_contained(step, environ):
        return
    name = "NVIDIA_VISIBLE_DEVICES"
    passed = passed_on(before, (name,), os.environ)
    if passed is None or passed.get(name, "").strip() not in ("", "none", "void"):
        return
    if not passed_on(before, (name,), {name: "all"}):
        return
    if by_index:
        hint = f"bind in every GPU: NVIDIA_VISIBLE_DEVICES=all gpuwait ... -- {shlex.join(argv)}"
    else:
        code = f'NVIDIA_VISIBLE_DEVICES="$GPUWAIT_GPU_UUIDS" exec {shlex.join(argv)}'
        hint = f"bind in the reserved GPUs: gpuwait ... -- {shlex.join(['sh', '-c', code])}"
    raise UsageError(
        f"{step.program} --nvccli in a contained container binds in only the GPUs "
        "NVIDIA_VISIBLE_DEVICES names, and it names none here: the command would find no GPU "
        "once its turn came",
        hint=hint,
    )


#: An Apptainer action's options that give it a PID namespace and may be left out alone.
_PID_NAMESPACE_OPTIONS = ("--containall", "-C", "--pid", "-p", "--compat")


def check_pausable_container(argv: Sequence[str]) -> None:
    """Refuse a --pausable job whose command runs in an Apptainer (Singularity) PID namespace,
    `apptainer exec --containall`, `--pid` or `--fusemount`, or APPTAINER_CONTAINALL=1 and the
    like in the environment Apptainer starts with (UsageError, 2): there the program cannot see the
    gpuwait above it, gpuwait.checkpoint takes its job for ended and catches no checkpoint
    signal, and Apptainer's starter, which catches every signal, passes it on: asked to step
    aside, the job would die of it. The hint is the line without the namespace (--containall
    is --contain --cleanenv --ipc --pid), where the APPTAINERENV_ copies of the job's variables
    tell the program it is pausable."""
    found = steps(argv, sh=_sh())
    if any(runs_gpuwait(step) for step in found):
        return
    environs = _apptainer_environs(found)
    for index, step in enumerate(found):
        spotted = apptainer_pid_namespace(step, environs[index])
        if spotted is None:
            continue
        at, end, given = spotted
        instead = {
            "--containall": ["--contain", "--cleanenv", "--ipc"],
            "-C": ["--contain", "--cleanenv", "--ipc"],
            "--compat": [
                *("--contain", "--cleanenv", "--ipc", "--no-init", "--no-umask", "--no-eval"),
                "--writable-tmpfs",
            ],
        }
        if at < 0:
            # Set in gpuwait's environment (or a wrapper's assignment in the line).
            name = given.partition("=")[0]
            prefix = name.partition("_")[0]
            # Each of them: one left would give the namespace all the same.
            unset = apptainer_pid_variables(environs[index]) or [name]
            rest = ("CONTAIN", "CLEANENV", "IPC") if name.endswith("_CONTAINALL") else ()
            kept = [f"{prefix}_{other}=1" for other in rest]
            if any(
                word.startswith(f"{name}=") for wrapper in found[:index] for word in wrapper.sets
            ):
                hint = f"leave out the PID namespace: take {given} out of the line"
            else:
                line = shlex.join(["env", *(w for n in unset for w in ("-u", n)), *kept, "gpuwait"])
                hint = f"leave out the PID namespace: {line} ... -- {shlex.join(argv)}"
        elif step.argv[at] == "--fusemount" or step.argv[at].startswith("--fusemount="):
            kept = [*step.argv[:at], *step.argv[end:]]
            where = len(argv) - len(step.argv)
            line = shlex.join(kept)
            if tuple(argv[where:]) == step.argv:
                line = f"gpuwait ... -- {shlex.join([*argv[:where], *kept])}"
            elif step.cut:  # a shell's code read up to an expansion: no line of its words
                line = f"in its code, leave out {shlex.join(step.argv[at:end])}"
            hint = f"leave out --fusemount, which implies --pid: {line}"
        elif (option := step.argv[at].partition("=")[0]) in _PID_NAMESPACE_OPTIONS:
            # `--containall=true` as well, as Go's flags take it.
            kept = [*step.argv[:at], *instead.get(option, []), *step.argv[at + 1 :]]
            where = len(argv) - len(step.argv)
            line = shlex.join(kept)
            if tuple(argv[where:]) == step.argv:
                line = f"gpuwait ... -- {shlex.join([*argv[:where], *kept])}"
            elif step.cut:  # a shell's code read up to an expansion: no line of its words
                put = " ".join(instead.get(option, []))
                line = f"in its code, {put} in place of {step.argv[at]}" if put else ""
                line = line or f"in its code, leave out {step.argv[at]}"
            hint = f"leave out the PID namespace: {line}"
        else:
            hint = "leave out the PID namespace: --contain --cleanenv --ipc for -C, nothing for -p"
        raise UsageError(
            f"{step.program} runs the command in a PID namespace of its own ({given}), where "
            "gpuwait.checkpoint cannot see the gpuwait above it and takes the --pausable job for "
            f"ended: the program would not catch the checkpoint signal {step.program} passes "
            "on, and would die of it when asked to step aside",
            hint=hint,
        )


def _sets(path: str, name: str) -> bool:
    """Does the environment file at `path` (shell code, NAME=VALUE lines) set `name`?"""
    return any(re.match(rf"(?:export\s+)?{name}=", line) for line in _env_lines(path))


def _env_lines(path: str) -> list[str]:
    """The lines of an engine's environment file (Apptainer's --env-file, docker's), blank
    ones and comments left out, each stripped; none where it cannot be read: the engine says
    so itself. None too where it is no regular file (`--env-file <(...)`, /dev/stdin): read
    here, a pipe would reach the engine empty, and a FIFO nobody writes to would keep gpuwait
    waiting for ever."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return []
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(1 << 20)
    except OSError:
        return []
    return [s for line in text.splitlines() if (s := line.strip()) and not s.startswith("#")]


def _env_kept(
    argv: Sequence[str], where: int, step: Step, keep: Sequence[str] = GPU_VARIABLES
) -> str:
    """`argv`, whose env at `where` drops variables of `keep` (GPU_VARIABLES, and the
    APPTAINERENV_ copies a container that cleans its environment takes), with env keeping
    them: its -u naming them left out, and after -i (`-`, --ignore-environment), which drops
    them all, the values gpuwait gives them set again, in a shell that expands them."""
    words = [step.argv[0]]
    ignore = False
    position = 1
    while position < len(step.argv):
        word = step.argv[position]
        if word == "--" or not word.startswith("-") or word == "-":
            ignore = ignore or word == "-"
            break
        name, glue, value = word.partition("=")
        taken = 1
        if word.startswith("--"):
            ignore = ignore or word == "--ignore-environment"
            if name in ("--unset", "--chdir") and not glue:
                value, taken = " ".join(step.argv[position + 1 : position + 2]), 2
            if name == "--unset" and value in keep:
                position += taken
                continue
        else:
            letters = word[1:]
            at = next((n for n, letter in enumerate(letters) if letter in "uC"), len(letters))
            ignore = ignore or "i" in letters[:at]
            value = letters[at + 1 :]
            if at < len(letters) and not value:
                value, taken = " ".join(step.argv[position + 1 : position + 2]), 2
            if letters[at : at + 1] == "u" and value in keep:
                if at:
                    words.append(f"-{letters[:at]}")
                position += taken
                continue
        words.extend(step.argv[position : position + taken])
        position += taken
    rest = list(step.argv[position:])
    if not ignore:
        return shlex.join([*argv[:where], *words, *rest])
    # After `--`, and the variables env sets, comes the command.
    command = 1 if rest[:1] in (["--"], ["-"]) else 0
    while command < len(rest) and "=" in rest[command] and not rest[command].startswith("="):
        command += 1
    # One env sets again itself (`env -i CUDA_VISIBLE_DEVICES=1`, an index passed on) is kept
    # as it is: only those it drops are set from gpuwait's.
    again = {word.partition("=")[0] for word in rest[:command]}
    given = [f'"{name}=${name}"' for name in keep if name not in again]
    code = " ".join(
        [
            "exec",
            *map(shlex.quote, [*argv[:where], *words, *rest[:command]]),
            *given,
            *map(shlex.quote, rest[command:]),
        ]
    )
    return shlex.join(["sh", "-c", code])


def _extended(
    argv: Sequence[str],
    where: int,
    step: Step,
    names: Sequence[str],
    keep: Sequence[str] = GPU_VARIABLES,
) -> list[str] | None:
    """`argv` with the first list of variables the wrapper at `where` keeps (the value of one
    of its options `names`: sudo's --preserve-env=LIST, su's -w LIST) naming those of `keep`
    too; None where it gives no such list."""
    for name, value in step.options:
        if name not in names or value is None:
            continue
        given = [v for v in value.split(",") if v]
        merged = ",".join([*given, *(v for v in keep if v not in given)])
        glue = "=" if name.startswith("--") else ""
        line = list(argv)
        for at in range(where + 1, len(line)):
            if line[at] == f"{name}{glue}{value}":
                line[at] = f"{name}{glue}{merged}"
                return line
            if line[at] == name and line[at + 1 : at + 2] == [value]:
                line[at + 1] = merged
                return line
    return None


#: Launchers' options that choose their workers' GPUs themselves, over CUDA_VISIBLE_DEVICES.
_LAUNCHER_GPU_OPTIONS = {
    "deepspeed": (
        "--num_gpus",
        "--num-gpus",
        "--num_accelerators",
        "--include",
        "-i",
        "--exclude",
        "-e",
    ),
    "accelerate": ("--gpu_ids", "--gpu-ids"),
}


#: Launchers' options after which their script is a module's name (`-m pkg.train`) or a
#: program (`--no_python bash run.sh`), not a .py file.
_LAUNCHER_NOT_A_SCRIPT = ("-m", "--module", "--no_python", "--no-python")


#: Launchers' own options that take a value as the next word (`--master_port 29500`), besides
#: their GPU options; an accelerate option named by one of the prefixes too (`--fsdp_...`).
#: Written with `_`, as `-` reads the same.
_LAUNCHER_VALUE_OPTIONS = {
    "deepspeed": (
        "-H",
        "--hostfile",
        "--num_nodes",
        "--min_elastic_nodes",
        "--max_elastic_nodes",
        "--master_port",
        "--master_addr",
        "--node_rank",
        "--launcher",
        "--launcher_args",
        "--enable_each_rank_log",
        "--autotuning",
        "--bind_core_list",
        "--ssh_port",
        "--venv_script",
        "--comment",
        "--account",
    ),
    "accelerate": (
        "--config_file",
        "--mixed_precision",
        "--num_processes",
        "--num_machines",
        "--num_cpu_threads_per_process",
        "--dynamo_backend",
        "--dynamo_mode",
        "--machine_rank",
        "--main_process_ip",
        "--main_process_port",
        "-t",
        "--tee",
        "--log_dir",
        "--role",
        "--rdzv_backend",
        "--rdzv_conf",
        "--max_restarts",
        "--monitor_interval",
        "--main_training_function",
        "--zero_stage",
        "--gradient_accumulation_steps",
        "--gradient_clipping",
        "--zero3_init_flag",
        "--zero3_save_16bit_model",
        "--tpu_name",
        "--tpu_zone",
        "--vm",
        "--env",
    ),
}
_LAUNCHER_VALUE_PREFIXES = {
    "accelerate": ("--deepspeed_", "--offload_", "--fsdp_", "--megatron_lm_", "--fp8_"),
}


def _launcher_script(own: Sequence[str], program: str) -> int:
    """Where a launcher's script begins among its words `own` (after `accelerate launch`): its
    first .py, or, after -m (--no_python) before any, the module's (the program's) name, the
    first word that is no option nor the value of one of the launcher's; 0 where neither is
    found (none is looked at). What follows is the script's own."""
    valued = {*_LAUNCHER_GPU_OPTIONS[program], *_LAUNCHER_VALUE_OPTIONS[program]}
    prefixes = _LAUNCHER_VALUE_PREFIXES.get(program, ())
    module = False
    at = 0
    while at < len(own):
        word = own[at]
        if not word.startswith("-"):
            if module or word.endswith(".py"):
                return at
        elif word in _LAUNCHER_NOT_A_SCRIPT:
            module = True
        elif "=" not in word:
            name = word[:2] + word[2:].replace("-", "_")
            if name in valued or name.startswith(prefixes):
                at += 1  # its value, whatever it looks like
        at += 1
    return 0


#: Launchers run by their module (`python -m accelerate.commands.launch`): the program and
#: its words they stand for.
_LAUNCHER_MODULES = {
    "deepspeed": ("deepspeed",),
    "deepspeed.launcher.runner": ("deepspeed",),
    "accelerate.commands.launch": ("accelerate", "launch"),
    "accelerate.commands.accelerate_cli": ("accelerate",),
}


def _launcher(argv: Sequence[str]) -> tuple[str, int]:
    """The launcher a step runs (`deepspeed`, `accelerate` for `accelerate launch`), by its
    name or its module, and where its own words begin in `argv` (after `launch`); ("", 0)
    where it runs none."""
    program, skip = os.path.basename(argv[0]), 1
    if _PYTHON_NAMES.match(program) and program not in _LAUNCHER_GPU_OPTIONS:
        from gpuwait.core.cmdkey import python_runs  # only Python command lines pay for it

        runs = python_runs(argv)
        if runs is None or runs[0] != "-m" or runs[1] not in _LAUNCHER_MODULES:
            return "", 0
        words = _LAUNCHER_MODULES[runs[1]]
        if words == ("accelerate", "launch"):
            return "accelerate", runs[2]
        program, skip = words[0], runs[2]
    if program == "accelerate":
        if list(argv[skip : skip + 1]) != ["launch"]:
            return "", 0
        skip += 1
    return program, skip


def _launcher_steps(
    argv: Sequence[str], cut: bool = False, sh: str | None = None
) -> Iterator[Step]:
    """The steps of `argv` (`steps`), and those of the command an Apptainer container runs
    where it sees every GPU, each after the step that starts it: but for one given only the
    GPUs NVIDIA_VISIBLE_DEVICES names (--nvccli in a contained /dev), unless it names all.
    `cut`: `argv` are the words of a shell's code read up to an expansion (`Step.cut`). `sh`:
    the shell a command named sh is (`steps`), the host's where None; a container's is its
    image's, read as bash's."""
    found = steps(argv, cut, _sh() if sh is None else sh)
    commands = dict(_container_commands(found))
    for at, step in enumerate(found):
        yield step
        if at in commands:
            yield from _launcher_steps(commands[at], step.cut, "sh")


def _container_commands(found: Sequence[Step]) -> Iterator[tuple[int, tuple[str, ...]]]:
    """The commands the Apptainer `exec` actions of `found` run where the container sees
    every GPU, each with where its step is: but for one given only the GPUs
    NVIDIA_VISIBLE_DEVICES names (--nvccli in a contained /dev), unless it names all."""
    environs = _apptainer_environs(found)
    nvidia = passed_on_each(found, ("NVIDIA_VISIBLE_DEVICES",), os.environ)
    for index, step in enumerate(found):
        inner = apptainer_command(step)
        if inner is None:
            continue
        given = (nvidia[index] or {}).get("NVIDIA_VISIBLE_DEVICES", "")
        if not apptainer_nvccli_contained(step, environs[index]) or given.strip() == "all":
            yield index, inner


def check_launcher_gpus(argv: Sequence[str]) -> None:
    """Refuse a launcher told to choose its workers' GPUs itself (UsageError, 2): `deepspeed
    --num_gpus 2` runs them on the machine's GPUs 0 and 1, `--include` and `--exclude` on those
    they leave, `accelerate launch --gpu_ids 0` on those it lists (`all` excepted), whatever
    GPUs gpuwait reserved: in other jobs' room. Only the launcher's own options count, those
    before its script (`deepspeed train.py --num_gpus 2` passes it to train.py), a .py or,
    after -m or --no_python, a module or a program; a launcher with neither is not looked
    at, but in a shell's code read up to an expansion (`sh -c 'deepspeed --num_gpus 2
    "$PWD/x.py"'`), where the words before the first that is no option are its own. So is one
    an Apptainer container runs (`apptainer exec --nv img.sif deepspeed --num_gpus 2 x.py`),
    which sees every GPU, but for one given only those NVIDIA_VISIBLE_DEVICES names (--nvccli
    in a contained /dev), where it names not all."""
    for step in _launcher_steps(argv):
        program, skip = _launcher(step.argv)
        names = _LAUNCHER_GPU_OPTIONS.get(program)
        if names is None:
            continue
        own = list(step.argv[skip:])
        script = _launcher_script(own, program)
        if not script and step.cut:
            # Read up to an expansion (`deepspeed --num_gpus 2 "$PWD/x.py"`): the words before
            # its first that is no option nor a GPU option's value are the launcher's own.
            script = next(
                (
                    n
                    for n, t in enumerate(own)
                    if t[:1] != "-" and (not n or own[n - 1] not in names)
                ),
                len(own),
            )
        own = own[:script]
        for at, token in enumerate(own):
            name, glued, value = token.partition("=")
            if name not in names:
                continue
            if not glued and at + 1 >= len(own) and step.cut:
                continue  # its value an expansion (`--num_gpus "$N"`), not known here
            value = value if glued else (own[at + 1] if at + 1 < len(own) else "")
            if value.strip() == ("all" if program == "accelerate" else "-1"):
                continue  # all of what it is given; deepspeed's default
            where = len(argv) - len(step.argv)
            start = where + skip + at
            fixed = [*argv[:start], *argv[start + (1 if glued else 2) :]]
            # Run through sh -c or su -c, the line is not argv's own words: no line to give.
            line = shlex.join(fixed) if tuple(argv[where:]) == step.argv else "COMMAND"
            gpus = value if name.startswith("--num") and value.isdecimal() else "N"
            hint = (
                "leave it out, and ask gpuwait for the GPUs as numbers: GPUWAIT_VISIBLE_DEVICES="
                f"index gpuwait --gpus {gpus} ... -- {line}"
                if program == "deepspeed"
                else f"leave it out (or give all): gpuwait ... -- {line}"
            )
            raise UsageError(
                f"{program} {name} runs its workers on GPUs it chooses itself, not on those "
                "gpuwait reserves: they would run in other jobs' room",
                hint=hint,
            )


def which(name: str) -> str | None:
    """The first executable file `name` in PATH, as shutil.which finds it on POSIX.

    Not shutil itself: importing it (with the compression modules it pulls in) costs more than
    a launch can spare.
    """
    for directory in os.environ.get("PATH", os.defpath).split(os.pathsep):
        path = os.path.join(directory or ".", name)
        if os.access(path, os.X_OK) and not os.path.isdir(path):
            return path
    return None


#: Programs that are Python (or start Python) by name, whatever their first line says.
_PYTHON_NAMES = re.compile(
    r"^(python|pypy|ipython)[0-9.]*\Z|^(torchrun|accelerate|deepspeed|jupyter)\Z"
)


def python_program(argv: Sequence[str]) -> bool:
    """The command is a Python program: a Python interpreter, or a script whose #! line names
    one (console scripts such as torchrun, accelerate or deepspeed among them)."""
    name = argv[0]
    if _PYTHON_NAMES.match(os.path.basename(name)):
        return True
    path = name if "/" in name else which(name)
    if path is None:
        return False
    first = _first_line(path) or b""
    return first.startswith(b"#!") and b"python" in first


def exec_bare(command: Sequence[str]) -> int:
    """Become the command, as if the shell had started it. Returns only if that fails, by
    raising CommandProblem."""
    sys.stdout.flush()
    sys.stderr.flush()
    # Python ignores these for itself; a command started by a shell gets the default.
    for signum in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(signum, signal.SIG_DFL)
    try:
        try:
            os.execvp(command[0], list(command))
        except OSError as exc:
            script = as_shell_script(command) if exc.errno == errno.ENOEXEC else None
            if script is None:
                raise
            os.execv(script[0], script)
    except OSError as exc:
        raise command_problem(command, exc) from None
    return 0  # pragma: no cover - execvp does not return


def command_problem(command: Sequence[str], exc: OSError) -> CommandProblem:
    """What to say, and exit with, where the command could not be run bare."""
    if isinstance(exc, FileNotFoundError):
        return _not_found(command)
    return CommandProblem(f"{command[0]}: {exc.strerror}", EXIT_NOT_EXECUTABLE)


def as_shell_script(argv: Sequence[str]) -> list[str] | None:
    """How to run `argv`, whose file the kernel would not execute (ENOEXEC), as execvp(3) and
    shells run it: a script without a #! line, read by /bin/sh. None for a binary file (as
    bash tells them: an ELF header, or a NUL byte in its first line), which is no script."""
    path = argv[0] if "/" in argv[0] else which(argv[0])
    if path is None:
        return None
    first = _first_line(path, 80)
    if first is None or first.startswith(b"\x7fELF") or b"\0" in first:
        return None
    return ["/bin/sh", path, *argv[1:]]


def spawn(
    argv: Sequence[str],
    env: Mapping[str, str],
    file_actions: Sequence[tuple[int, int, int]] = (),
) -> int:
    """Start the command with a clean signal mask (gpuwait blocks its own signals).

    `file_actions`: posix_spawn dup2 actions, e.g. the stderr relay pipe of
    gpuwait.runner.stderrwatch.
    """
    # The launch is over once its command starts: the next one in the turnstile loads now.
    turnstile.leave()

    def start(args: Sequence[str]) -> int:
        return os.posix_spawnp(
            args[0],
            list(args),
            dict(env),
            file_actions=list(file_actions) or None,
            setsigmask=(),
            # Python ignores SIGPIPE for itself; the command gets the default, as in a shell.
            # Handlers gpuwait installed are reset by exec; signals ignored by gpuwait's own
            # caller (nohup, `&` in a script) stay ignored, as they would for the bare command.
            setsigdef=(signal.SIGPIPE, signal.SIGXFSZ),
        )

    try:
        return start(argv)
    except OSError as exc:
        script = as_shell_script(argv) if exc.errno == errno.ENOEXEC else None
        if script is None:
            raise
        return start(script)


#: How long a command the kernel could not start for want of processes or memory (fork's
#: EAGAIN at `ulimit -u` or a full pids cgroup, ENOMEM) is tried again, its room held: a
#: moment's shortage, another program's fork storm, must not cost a job the turn it waited for.
START_RETRY_SECONDS = 30.0
#: The first pause between tries, doubled after each up to the last.
START_RETRY_FIRST, START_RETRY_LAST = 0.1, 2.0
SHORT_OF_PROCESSES = (errno.EAGAIN, errno.ENOMEM)


class StartInterrupted(Exception):
    """A signal (TERM, Ctrl-C) came while gpuwait waited to try starting its command again."""

    def __init__(self, signum: int) -> None:
        super().__init__(signals.signal_name(signum))
        self.signum = signum


def spawn_when_possible(
    argv: Sequence[str],
    env: Mapping[str, str],
    file_actions: Sequence[tuple[int, int, int]],
    on_retry: Callable[[OSError], Sequence[tuple[int, int, int]]],
    witness: signals.GroupWitness | None = None,
) -> int:
    """`spawn`, tried again for up to START_RETRY_SECONDS while it fails for want of processes
    or memory. `on_retry` is told of the first such failure and returns the file actions to
    start with from then on. The waits end at a forwarded signal (gpuwait's are blocked), by
    StartInterrupted; the last failure is raised. `witness`, started before, is told of each
    attempt (`GroupWitness.command_starting`) and of the start (`command_started`)."""
    deadline = time.monotonic() + START_RETRY_SECONDS
    pause = START_RETRY_FIRST
    told = False
    while True:
        try:
            if witness is not None:
                witness.command_starting()
            child = spawn(argv, env, file_actions)
            signals.command_started(child)
            if witness is not None:
                witness.command_started()
            return child
        except OSError as exc:
            left = deadline - time.monotonic()
            if exc.errno not in SHORT_OF_PROCESSES or left <= 0:
                raise
            if not told:
                told = True
                file_actions = on_retry(exc)
                # Straight away: what on_retry let go of may be just what was missing.
                continue
        info = signals.next_signal(min(pause, left))
        if info is not None and info.si_signo != signal.SIGCHLD:
            raise StartInterrupted(info.si_signo)
        pause = min(pause * 2, START_RETRY_LAST)


#: Apptainer (APPTAINERENV_) and Singularity (SINGULARITYENV_) set a variable of these names,
#: prefix taken off, inside the container, even with --cleanenv or --containall, which leave
#: out CUDA_VISIBLE_DEVICES: the container's CUDA would see every GPU that --nv binds in.
CONTAINER_ENV_PREFIXES = ("APPTAINERENV_", "SINGULARITYENV_")


def _in_containers(values: Mapping[str, str]) -> dict[str, str]:
    """The APPTAINERENV_ and SINGULARITYENV_ copies of `values`."""
    return {
        prefix + name: value for prefix in CONTAINER_ENV_PREFIXES for name, value in values.items()
    }


def _container_names(names: Sequence[str]) -> list[str]:
    """The names of the APPTAINERENV_ and SINGULARITYENV_ copies of `names`."""
    return [prefix + name for prefix in CONTAINER_ENV_PREFIXES for name in names]


def container_copies(exported: Mapping[str, str]) -> dict[str, str]:
    """APPTAINERENV_ and SINGULARITYENV_ copies of what a job's budget tells its frameworks
    (`exported`: JAX's fraction, TensorFlow's growth), for a container that cleans its
    environment: told nothing, JAX there takes 75 % of the card. But for PYTHONPATH: the
    hook's directory is the host's, and a copy would replace the image's own PYTHONPATH."""
    return _in_containers({name: v for name, v in exported.items() if name != "PYTHONPATH"})


def drop_inherited(env: MutableMapping[str, str], names: Sequence[str]) -> None:
    """Take `names` out of `env`, and the APPTAINERENV_ and SINGULARITYENV_ copies of each that
    hold its value (the enclosing job's caps, exported with their copies)."""
    for name in names:
        value = env.pop(name, None)
        for copy in _container_names([name]):
            if value is not None and env.get(copy) == value:
                del env[copy]


def forget_job(env: MutableMapping[str, str]) -> None:
    """Take out of `env` what `command_env` gave an ended job's command, for a process that
    outlived the job: its GPUs (an inherited CUDA_VISIBLE_DEVICES binds a launch to them) and
    its name are no new job's."""
    indices = env.get("GPUWAIT_GPU_INDICES")
    given = {env.get("GPUWAIT_GPU_UUIDS"), indices} - {None}
    for name in ("CUDA_VISIBLE_DEVICES", *_container_names(["CUDA_VISIBLE_DEVICES"])):
        value = env.get(name)
        if value in given or (value and indices and _cuda_numbers_of(value, indices)):
            del env[name]
    named = (JOB_ID_VARIABLE, JOB_PID_VARIABLE, JOB_START_VARIABLE)
    # A --pausable job's copies too, for a container that cleans its environment.
    for name in (*named, "GPUWAIT_GPU_UUIDS", "GPUWAIT_GPU_INDICES", *_container_names(named)):
        env.pop(name, None)


def _cuda_numbers_of(value: str, indices: str) -> bool:
    """Whether `value` is CUDA's numbers for the NVML `indices` (GPUWAIT_GPU_INDICES) as
    `command_env` gives them where a device cgroup hides GPUs: each index less the hidden GPUs
    before it, so by no less than the one before, and the numbers still in order."""
    numbers = [whole_number(n) for n in value.split(",")]
    nvml = [whole_number(i) for i in indices.split(",")]
    if len(numbers) != len(nvml):
        return False
    pairs = sorted(
        (i, n) for i, n in zip(nvml, numbers, strict=True) if i is not None and n is not None
    )
    if len(pairs) != len(nvml) or any(n > i for i, n in pairs):
        return False
    return all(n2 > n1 and i2 - n2 >= i1 - n1 for (i1, n1), (i2, n2) in pairwise(pairs))


def command_env(
    job: Job, chosen: Sequence[GpuSnapshot], resume_exit: int, *, by_index: bool = False
) -> dict[str, str]:
    """The command's environment: gpuwait's own, with its GPUs (`chosen`) and job made known
    (docs/usage.md, 'What the command gets'). CUDA_VISIBLE_DEVICES names UUIDs in PCI order,
    which no difference between CUDA's and NVML's numbering can put on the wrong card;
    `by_index` (visible_devices = index) names CUDA's numbers instead, for programs that read
    it as numbers: with CUDA_DEVICE_ORDER=PCI_BUS_ID, NVML's indices where both see the same
    GPUs, less the GPUs before each that this process may not use (a device cgroup's)."""
    uuids = ",".join(job.gpu_uuids)
    indices = ",".join(str(g.index) for g in chosen)
    env = dict(os.environ)
    gpus = {
        "CUDA_VISIBLE_DEVICES": ",".join(str(g.cuda_number) for g in chosen) if by_index else uuids,
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }
    env.update(
        {
            **gpus,
            **_in_containers(gpus),
            JOB_ID_VARIABLE: job.id,
            JOB_PID_VARIABLE: str(os.getpid()),
            JOB_START_VARIABLE: proc.start_field(os.getpid()) or "",
            "GPUWAIT_GPU_UUIDS": uuids,
            "GPUWAIT_GPU_INDICES": indices,
            BYTES_VAR: str(job.reserved_bytes),
        }
    )
    # For a container that cleans its environment (`apptainer exec --cleanenv`): what tells a
    # gpuwait or a hooked shell in it that it runs inside this job, as it would outside.
    named = (JOB_ID_VARIABLE, JOB_PID_VARIABLE, JOB_START_VARIABLE)
    env.update(_in_containers({name: env[name] for name in named}))
    pausing = {
        "GPUWAIT_PAUSABLE": "1",
        "GPUWAIT_CHECKPOINT_SIGNAL": job.checkpoint_signal.upper().removeprefix("SIG"),
        "GPUWAIT_RESUME_COUNT": str(job.pauses),
    }
    if job.pausable:
        # The `resume_exit` setting, by which its command says "checkpointed, resume me".
        pausing["GPUWAIT_RESUME_EXIT"] = str(resume_exit)
        env.update(pausing)
        # And for a container that cleans its environment, whose starter passes the checkpoint
        # signal on: the program must know it is pausable to catch it.
        env.update(_in_containers({name: env[name] for name in pausing}))
    else:
        # Inherited from a --pausable job this one runs in (a pipeline's step): that job's, to
        # be asked to checkpoint by its signal, not this one's. GPUWAIT_RESUME_EXIT stays: it
        # is a setting (`resume_exit`) the user may have set for a pausable step further in.
        for name in (*pausing, *_container_names(list(pausing))):
            env.pop(name, None)
    return env
