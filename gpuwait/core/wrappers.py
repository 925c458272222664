"""The commands a command line runs through wrappers (`nice`, `env`, `timeout 60`, `sudo -u
alice`): what gpuwait must look at before it starts the line. Pure (no I/O).

A wrapper's options are skipped as its own manual describes them (those that take a value take
the next word, or one glued on); a wrapper given options it does not know, or none of a command,
ends the walk, so that only what is sure to run is looked at.
"""

from __future__ import annotations

import os.path
import re
import shlex
from collections.abc import Callable, Mapping, Sequence

from gpuwait.core.cmdkey import python_runs
from gpuwait.core.record import Record


class _Spec(Record, frozen=True):
    #: Short options that take a value (`-n 5`, `-n5`).
    short_values: str = ""
    #: Long options that take a value as the next word unless glued on with `=`.
    long_values: frozenset[str] = frozenset()
    #: Words before the command that are no options (timeout's duration, taskset's mask).
    operands: int = 0
    #: NAME=VALUE words may come before the command (env, sudo).
    assignments: bool = False
    #: ... after the `--` that ends its options too (env's; sudo's first word after it runs).
    assignments_after_dashes: bool = False
    #: Options after which no command follows as words (taskset -p PID, env -S STRING).
    no_command: frozenset[str] = frozenset()
    #: Options whose value is a shell's command line (su -c 'python x.py').
    shell_command: frozenset[str] = frozenset()
    #: Options after which the words left are the command (runuser -u alice -- python x.py).
    command_follows: frozenset[str] = frozenset()
    #: Options may follow its other words (su alice -l -c CODE), as getopt takes them.
    permute: bool = False
    #: The word after its operands is a shell's command line, with or without the option
    #: in `shell_command` before it (sg GROUP CODE).
    code_operand: bool = False


_SPECS: dict[str, _Spec] = {
    "env": _Spec(
        short_values="uCS",
        long_values=frozenset({"--unset", "--chdir", "--split-string"}),
        assignments=True,
        assignments_after_dashes=True,
        no_command=frozenset({"-S", "--split-string"}),
    ),
    "nice": _Spec(short_values="n", long_values=frozenset({"--adjustment"})),
    "ionice": _Spec(
        short_values="cn",
        long_values=frozenset({"--class", "--classdata"}),
        no_command=frozenset({"-p", "-P", "-u", "--pid", "--pgid", "--uid"}),
    ),
    "nohup": _Spec(),
    # xargs runs its command with the words it reads added: -e, -i and -l take a value only
    # glued on, as --eof, --replace and --max-lines do with `=`.
    "xargs": _Spec(
        short_values="adEILnPs",
        long_values=frozenset(
            {
                *("--arg-file", "--delimiter", "--max-args", "--max-procs", "--max-chars"),
                "--process-slot-var",
            }
        ),
    ),
    "setsid": _Spec(),
    # unshare's -m, -U ... take a file only glued on with `=` (--mount=FILE), as do
    # --kill-child and --mount-proc.
    "unshare": _Spec(
        short_values="RwSG",
        long_values=frozenset(
            {
                *("--map-user", "--map-group", "--map-users", "--map-groups", "--propagation"),
                *("--setgroups", "--root", "--wd", "--setuid", "--setgid", "--monotonic"),
                "--boottime",
            }
        ),
    ),
    "time": _Spec(short_values="fo", long_values=frozenset({"--format", "--output"})),
    "timeout": _Spec(
        short_values="sk", long_values=frozenset({"--signal", "--kill-after"}), operands=1
    ),
    "stdbuf": _Spec(short_values="ioe", long_values=frozenset({"--input", "--output", "--error"})),
    "taskset": _Spec(operands=1, no_command=frozenset({"-p", "--pid"})),
    "numactl": _Spec(
        short_values="ipCNmPoLMISf",
        long_values=frozenset(
            {
                *("--interleave", "--preferred", "--preferred-many", "--physcpubind"),
                *("--cpunodebind", "--membind", "--offset", "--length", "--shmmode"),
                *("--shmid", "--shm", "--file"),
            }
        ),
    ),
    "chrt": _Spec(
        short_values="TPD",
        long_values=frozenset({"--sched-runtime", "--sched-period", "--sched-deadline"}),
        operands=1,
        no_command=frozenset({"-p", "--pid", "-m", "--max"}),
    ),
    "sudo": _Spec(
        short_values="ugCDprtTUR",
        long_values=frozenset(
            {
                *("--user", "--group", "--close-from", "--chdir", "--prompt", "--role"),
                *("--type", "--command-timeout", "--other-user", "--chroot", "--host"),
            }
        ),
        assignments=True,
        # -h alone is its help; with a host it lists what may run there, and refuses a
        # command ('a remote host may only be specified when listing privileges').
        no_command=frozenset({"-e", "--edit", "-l", "--list", "-v", "--validate", "-h", "--host"}),
    ),
    "doas": _Spec(short_values="uC"),
    "pkexec": _Spec(long_values=frozenset({"--user"})),
    "su": _Spec(
        short_values="cgGsw",
        long_values=frozenset(
            {
                *("--command", "--session-command", "--group", "--supp-group", "--shell"),
                "--whitelist-environment",
            }
        ),
        shell_command=frozenset({"-c", "--command", "--session-command"}),
        permute=True,
    ),
    "runuser": _Spec(
        short_values="cgGswu",
        long_values=frozenset(
            {
                *("--command", "--session-command", "--group", "--supp-group", "--shell"),
                *("--whitelist-environment", "--user"),
            }
        ),
        shell_command=frozenset({"-c", "--command", "--session-command"}),
        command_follows=frozenset({"-u", "--user"}),
        permute=True,
    ),
    "setpriv": _Spec(
        long_values=frozenset(
            {
                *("--ambient-caps", "--inh-caps", "--bounding-set", "--ruid", "--euid"),
                *("--rgid", "--egid", "--reuid", "--regid", "--groups", "--securebits"),
                *("--pdeathsig", "--selinux-label", "--apparmor-profile", "--landlock-access"),
                *("--landlock-rule", "--seccomp-filter"),
            }
        ),
        no_command=frozenset({"-d", "--dump"}),
    ),
    "systemd-run": _Spec(
        short_values="uHMpE",
        long_values=frozenset(
            {
                *("--host", "--machine", "--unit", "--property", "--description", "--slice"),
                *("--service-type", "--uid", "--gid", "--nice", "--working-directory"),
                *("--setenv", "--path-property", "--socket-property", "--timer-property"),
                *("--on-active", "--on-boot", "--on-startup", "--on-unit-active"),
                *("--on-unit-inactive", "--on-calendar"),
            }
        ),
    ),
    # flock FILE COMMAND, or flock FILE -c CODE.
    "flock": _Spec(
        short_values="wEc",
        long_values=frozenset({"--timeout", "--wait", "--conflict-exit-code", "--command"}),
        operands=1,
        shell_command=frozenset({"-c", "--command"}),
    ),
    # sg [-] GROUP [-c] CODE: CODE is run by /bin/sh.
    "sg": _Spec(short_values="c", shell_command=frozenset({"-c"}), operands=1, code_operand=True),
    # A shell's `exec [-cl] [-a NAME] COMMAND` (bash, zsh; sh's takes no options).
    "exec": _Spec(short_values="a"),
    # A shell's `command [-p] COMMAND`, which runs it past any function of that name; -v and -V
    # only say what it is.
    "command": _Spec(no_command=frozenset({"-v", "-V"})),
    # A shell's `builtin NAME`, which runs its builtin of that name (`builtin exec srun ...`),
    # and zsh's precommand modifiers, which run the command after them: without its names
    # expanded (noglob), corrected (nocorrect), or with a `-` before its name (`-`).
    "builtin": _Spec(),
    "noglob": _Spec(),
    "nocorrect": _Spec(),
    "-": _Spec(),
}

#: Shells whose `-c CODE` is looked into as far as its first command's plain words: fish's
#: too, whose `NAME=VALUE command`, `export NAME=VALUE` and `env ...` are sh's (its `set` is
#: not read: the walk ends there).
_SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "fish"})
#: Words a shell takes as they are: no quote, expansion or redirection in them.
_PLAIN = re.compile(r"[A-Za-z0-9_./=,:@%+-]+\Z")
#: What ends a command: `;`, `&`, `|` (`&&`, `||`) or the end of its line.
_SEPARATORS = re.compile(r"\s*(?:;|&|\||\n)")
#: A variable a shell sets for the command that follows it (`OMP_NUM_THREADS=4 python x.py`).
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
#: The shell's builtins that set variables of the environment, as `export` does: a variable
#: that came from it stays exported (`declare CUDA_VISIBLE_DEVICES=0`, `readonly ...`); with
#: some options they take one out of the environment, the shell keeping it (`export -n`,
#: `declare +x`, `declare -a`: an array), as the first command of its code (`unexports`).
DECLARING = frozenset({"export", "declare", "typeset", "readonly"})
#: zsh's other names of typeset, outside a function too (bash's local says it is not in one,
#: and does nothing).
_ZSH_DECLARING = DECLARING | {"local", "integer", "float"}


def declaring(shell: str) -> frozenset[str]:
    """The builtins of `DECLARING`'s kind in `shell` (a Step's): fish's `export` alone, dash's
    `export` and `readonly` (it has no declare or typeset: a command of that name is not
    found, and sets nothing), zsh's local, integer and float besides."""
    if shell == "fish":
        return frozenset({"export"})
    if shell == "dash":
        return frozenset({"export", "readonly"})
    return _ZSH_DECLARING if shell == "zsh" else DECLARING


#: Options of `declare`, `typeset` and `readonly` after which they still only set (and
#: export): -x, -r, -g, and the attributes -i, -l, -u, -t, given or taken away (`typeset -i
#: n=0`, `declare +i ...`), and `--`; but +x, which takes a variable out of the environment.
_KEEPS_EXPORTED = re.compile(r"-[xrgiltu]+|\+[iltu]+|--")
#: zsh's besides: -Z, -L and -R (the value padded or cut to a width, as the shell shows it,
#: never as it exports it), -E and -F (a number, `_numbering`); each of these and -i takes a
#: width (a base) glued on or as the next word, where it is a number (`local -Z 3 ...`).
_ZSH_KEEPS_EXPORTED = re.compile(r"-[xrgiltuZLREF]+[0-9]*|\+[iltuZLREF]+|--")


class Step(Record, frozen=True):
    """One command of the line: its words, and its wrapper's options as given (each with its
    value, if it takes one: `("-u", "alice")`, `("--preserve-env=A,B", None)`)."""

    argv: tuple[str, ...]
    options: tuple[tuple[str, str | None], ...] = ()
    #: Its words end where a shell's code stopped being plain before its command was found
    #: (`bash -c 'sudo --preserve-env=$KEEP python x.py'`): what its options are is not known.
    unsure: bool = False
    #: The NAME=VALUE words it sets for the command it runs: env's and sudo's, or, for a
    #: shell, those before its first command (`CUDA_VISIBLE_DEVICES=0 python x.py`, on a line
    #: of their own, or after `export`), as far as its words are plain.
    sets: tuple[str, ...] = ()
    #: Its words end where a shell's code stopped being plain (`sh -c 'docker run --gpus all
    #: -v "$PWD:/w" img'`): more of them follow, unread, and no line can be made of them.
    cut: bool = False
    #: The shell whose code this command is the first of (`zsh -c 'export -n ...; ...'`), as
    #: named (`zsh`, `bash`); empty where it is none's, or su's, flock's or sg's (`-c CODE`).
    shell: str = ""

    @property
    def program(self) -> str:
        return os.path.basename(self.argv[0])


def steps(argv: Sequence[str], cut: bool = False, sh: str = "sh") -> list[Step]:
    """`argv` and each command it runs through the wrappers above, outermost first.

    `nice -n 5 timeout 60 srun python x.py` is four steps: nice's, timeout's, srun's and (srun
    being no wrapper here) no further. su's and runuser's `-c 'CODE'` runs CODE, taken as a
    shell's words where it is simple enough to read so. `cut`: `argv` are words of a shell's
    code read up to an expansion (`Step.cut`), as the command of a container in it is. `sh`:
    the shell a command named sh is, as far as the caller could tell (`dash`), its code read
    as that one's; "sh" where it could not, read as bash's."""
    found: list[Step] = []
    current: tuple[str, ...] = tuple(argv)
    shell = ""
    while current:
        if os.path.basename(current[0]) in _SHELLS:
            shell = os.path.basename(current[0])
            shell = sh if shell == "sh" else shell
            code = _shell_code(current[1:], os.path.basename(current[0]) == "zsh")
            first = None if code is None else _first_command(code, shell)
            found.append(
                Step(
                    argv=current,
                    options=() if code is None else (("-c", code),),
                    sets=() if first is None else first[2],
                )
            )
            if not first or not first[0]:
                break
            current, cut = tuple(first[0]), not first[1]
            continue
        spec = _SPECS.get(os.path.basename(current[0]))
        split = _split_string(current) if os.path.basename(current[0]) == "env" else None
        if split is not None:
            current = split  # env -S 'A=1 python x.py': those words, in its place
            continue
        if spec is None:
            found.append(Step(argv=current, cut=cut, shell=shell))
            break
        options, inner, code, sets = _parse(spec, current[1:])
        if os.path.basename(current[0]) == "systemd-run":
            # -E NAME=VALUE: set for its command (--scope runs it as given).
            sets += tuple(v for n, v in options if n in ("-E", "--setenv") and v and "=" in v)
        unsure = cut and inner is None and code is None
        found.append(Step(argv=current, options=tuple(options), unsure=unsure, sets=sets))
        shell = ""
        if code is not None:
            # su -c, flock -c, sg -c: a shell's code, read as that of `bash -c`.
            first = _code_command(code)
            if first and first[2]:
                found[-1] = Step(
                    argv=current, options=tuple(options), unsure=unsure, sets=sets + first[2]
                )
            if not first or not first[0]:
                break
            current, cut = tuple(first[0]), not first[1]
            continue
        if inner is None:
            break
        current = tuple(inner)
    return found


def _split_string(argv: tuple[str, ...]) -> tuple[str, ...] | None:
    """`env -S STRING ...` (--split-string, the `#!/usr/bin/env -S` of a script) with STRING
    split into the words it stands for, in its place: `env -i -S 'A=1 python x.py'` is `env -i
    A=1 python x.py`. None where env is given no -S before its command, or STRING has what
    env itself would expand or unescape (`$`, `\\`)."""
    position = 1
    while position < len(argv):
        word = argv[position]
        if word == "--" or not word.startswith("-") or word == "-":
            return None
        after = position + 1
        if word.startswith("--"):
            name, glue, value = word.partition("=")
            if name in ("--unset", "--chdir") and not glue:
                position += 2
                continue
            if name != "--split-string":
                position += 1
                continue
            before: tuple[str, ...] = ()
            if not glue:
                value, after = " ".join(argv[after : after + 1]), after + 1
        else:
            letters = word[1:]
            taken = next((at for at, letter in enumerate(letters) if letter in "uCS"), None)
            if taken is None or letters[taken] != "S":
                position += 1 if taken is None or letters[taken + 1 :] else 2
                continue
            before = (f"-{letters[:taken]}",) if taken else ()
            value = letters[taken + 1 :]
            if not value:
                value, after = " ".join(argv[after : after + 1]), after + 1
        if any(char in value for char in "$\\"):
            return None
        try:
            words = shlex.split(value)
        except ValueError:
            return None
        return (*argv[:position], *before, *words, *argv[after:])
    return None


def _shell_code(words: Sequence[str], glued: bool = False) -> str | None:
    """The CODE of `bash -c CODE` (`sh -lc CODE`, `bash -e -c CODE`): the first word after
    the options, where -c is among them; None for a script or a shell given no -c. `glued`:
    zsh, which takes a value glued on to -o (`-opipefail`), as bash does not, and whose -O is
    a letter taking no value (CORRECT_ALL), where bash's -O takes the next word; its
    --emulate takes the next word too."""
    valued = "o" if glued else "oO"
    command = False
    position = 0
    while position < len(words):
        word = words[position]
        if (
            (len(word) == 2 and word[0] in "-+" and word[1] in valued)
            or word in ("--rcfile", "--init-file")
            or (glued and word == "--emulate")
        ):
            position += 2
            continue
        if word == "--" or word == "-":
            position += 1
            break
        if word.startswith("--"):
            position += 1
            continue
        if len(word) > 1 and word[0] in "-+":
            position += 1
            for offset, letter in enumerate(word[1:], start=1):
                if glued and letter == "o" and word[offset + 1 :]:
                    break  # zsh's value glued on: the rest of the word (`-opipefail`)
                if letter in valued:
                    # Each takes the next word (`bash -eo pipefail -c CODE`).
                    position += 1
                elif letter == "c" and word[0] == "-":
                    command = True
            continue
        break
    return words[position] if command and position < len(words) else None


def _first_command(code: str, shell: str = "") -> tuple[list[str], bool, tuple[str, ...]] | None:
    """The words of the first command of shell CODE where each is plain (`srun python x.py`
    of `srun python x.py && echo done`, or of `OMP_NUM_THREADS=4 srun python x.py`: the
    variables set before it are no command), whether they are all of its words, and the
    NAME=VALUE words set before it: no shell is parsed, so a quote, an expansion or a
    redirection ends what is looked at, and with it the walk (its words then may be none). A
    line ends a command as `;` does; blank lines, and those that only set variables
    (`OMP_NUM_THREADS=4` on a line of its own, or after `export`), run none, and are passed
    over, as is an `unset` only of names with a lowercase letter (`unset tmp`), which no
    variable gpuwait or a container engine reads has. `shell`: the shell whose code it is
    (`declaring`)."""
    fish = shell == "fish"
    builtins = declaring(shell)
    sets: list[str] = []
    for part in _SEPARATORS.split(code):
        said = part.split()
        fished = _fish_set(said[1:]) if fish and said[:1] == ["set"] else None
        if fished is not None:
            name, value = fished
            if value is None and name != name.upper():
                # A local of the code's own (`set -l i 0`, `set -e tmp`): no variable of the
                # environment gpuwait or a container engine reads has a lowercase letter.
                if not all(_PLAIN.match(word) for word in said):
                    return [], False, tuple(sets)
                continue
            if value is None:
                # It takes the variable out of the environment: a command of its own, which
                # ends the walk (`drops_gpus`).
                return said, True, tuple(sets)
            sets.append(f"{name}={value}")
            if not all(_PLAIN.match(word) for word in said):
                return [], False, tuple(sets)
            continue
        if (
            said[:1] == ["unset"]
            and all(_PLAIN.match(word) for word in said)
            and all(name != name.upper() for name in said[1:] if name[:1] != "-")
        ):
            # `unset tmp`: a local of the code's own, as fish's `set -e tmp` is.
            continue
        words: list[str] = []
        #: `export`, or bash's `declare`, `typeset` or `readonly` and its options that keep a
        #: variable exported (`declare -x`), before the variables it sets.
        exported: list[str] = []
        taken = 0
        for index, word in enumerate(said):
            if index < taken:
                continue  # a word of the quoted value before it
            if not _PLAIN.match(word):
                if (
                    _ASSIGNMENT.match(word)
                    and word.rfind("${") <= word.rfind("}")
                    and _in_env_arguments(words)
                ):
                    # env's own assignment from an expansion (`env -i HOME="$HOME" python
                    # x.py`): env's options end before it, whatever it expands to. A quoted
                    # value is one word with its spaces (`NOTE="a CUDA_VISIBLE_DEVICES=0"`).
                    taken = index + 1
                    while not _quotes_closed(word) and taken < len(said):
                        word += " " + said[taken]
                        taken += 1
                    if not _quotes_closed(word):
                        return words, False, tuple(sets)
                    words.append(word)
                    continue
                if not words and _ASSIGNMENT.match(word):
                    # Set from an expansion (`CUDA_VISIBLE_DEVICES=$SLOT`): set all the same,
                    # with the words a `${` open in it takes in (`${NAME:?no GPU}`).
                    while word.rfind("${") > word.rfind("}") and index + 1 < len(said):
                        index += 1
                        word += " " + said[index]
                    sets.append(word)
                    if _numbering(exported):
                        # `integer CUDA_VISIBLE_DEVICES="$CUDA_VISIBLE_DEVICES"`: the builtin
                        # is the command still, which reads the value as arithmetic
                        # (`makes_a_number`), and each name after it (`integer n="$1"
                        # CUDA_VISIBLE_DEVICES`).
                        return [*exported, word, *_named(said[index + 1 :])], False, tuple(sets)
                elif _ASSIGNMENT.match(word) and words[0] in builtins and _numbering(words):
                    # The same, `local -F ...`.
                    return [*words, word, *_named(said[index + 1 :])], False, tuple(sets)
                return (words, False, tuple(sets)) if words or sets else None
            if not words and not exported and word in builtins:
                exported = [word]
            elif (
                exported
                # bash's export has none of these; zsh's all but -x and -g ("bad option").
                and (
                    exported[0] != "export"
                    or word == "--"
                    or (shell == "zsh" and not set(word) & set("xg"))
                )
                and (_ZSH_KEEPS_EXPORTED if shell == "zsh" else _KEEPS_EXPORTED).fullmatch(word)
            ):
                exported.append(word)
            elif (
                shell == "zsh"
                and word.isdigit()
                and exported[-1:]
                and exported[-1][:1] in "-+"
                and exported[-1][-1] in "ZLREFi"
            ):
                exported.append(word)  # the width of `local -Z 3`
            elif (words and not exported) or not _ASSIGNMENT.match(word):
                if exported:
                    words += exported
                    exported = []
                words.append(word)
            else:
                sets.append(word)
        if words:
            return words, True, tuple(sets)
    return ([], True, tuple(sets)) if sets else None


def _named(words: Sequence[str]) -> list[str]:
    """The words of a declaring builtin's command after one that is not plain, up to a
    comment: the names it goes on to declare, as far as they can be told."""
    named: list[str] = []
    for word in words:
        if word[:1] == "#":
            break
        named.append(word)
    return named


def _numbering(exported: Sequence[str]) -> bool:
    """Do `exported`, a declaring builtin and its options (`_first_command`), make a number of
    what they set: zsh's integer and float, -i (zsh's -E and -F too)?"""
    options = [word for word in exported[1:] if word[:1] == "-" and word != "--"]
    return bool(exported) and (
        exported[0] in ("integer", "float") or any(set(w[1:]) & set("iEF") for w in options)
    )


def _quotes_closed(word: str) -> bool:
    """Does `word` close every quote it opens (`NOTE="a b"`, not `NOTE="a`)?"""
    try:
        shlex.split(word)
    except ValueError:
        return False
    return True


def _in_env_arguments(words: Sequence[str]) -> bool:
    """Do `words` end in env's options and assignments, before its command (`env -i`, `env -u
    NAME A=1`, `env -iu NAME`)?"""
    for start in range(len(words) - 1, -1, -1):
        if os.path.basename(words[start]) == "env":
            break
    else:
        return False
    # An assignment after them is env's (not an option's value, as after `-iu`, nor -S's).
    sets: list[str] = []
    _, rest, _ = _options(_SPECS["env"], [*words[start + 1 :], _NEXT_ASSIGNMENT], sets)
    return rest is None and sets[-1:] == [_NEXT_ASSIGNMENT]


#: The assignment `_in_env_arguments` puts after env's words.
_NEXT_ASSIGNMENT = "NAME=VALUE"


#: fish's `set` options, as their letters.
_FISH_SET_LONG = {
    **{"--erase": "e", "--unexport": "u", "--export": "x", "--query": "q", "--names": "n"},
    **{"--show": "S", "--append": "a", "--prepend": "p", "--local": "l", "--global": "g"},
    **{"--universal": "U", "--function": "f", "--long": "L", "--path": "", "--unpath": ""},
}


#: A variable fish's `set` gives a value, or an element of it (`CUDA_VISIBLE_DEVICES[1]`).
_FISH_NAME = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(\[[0-9.]+\])?")


def _fish_set(args: Sequence[str]) -> tuple[str, str | None] | None:
    """What fish's `set ARGS` gives a variable of the environment: its name and value (`set
    -gx CUDA_VISIBLE_DEVICES 0`: 0; `-a`, `-p`: added to its own, `$NAME`), the value None
    where it takes it out (-e, -u, or -l without -x: a local, not exported, in its place);
    None where it sets none (-q, -n, -S) or its words are not read."""
    letters = ""
    position = 0
    while position < len(args) and args[position].startswith("-"):
        word = args[position]
        position += 1
        if word == "--":
            break
        if word.startswith("--"):
            if word not in _FISH_SET_LONG:
                return None
            letters += _FISH_SET_LONG[word]
        elif all(letter in "euxqnSaplgUfL" for letter in word[1:]):
            letters += word[1:]
        else:
            return None
    named = _FISH_NAME.fullmatch(args[position]) if position < len(args) else None
    if named is None:
        return None
    # `NAME[1]`: an element of the list, the whole of it where gpuwait gives one GPU; one
    # erased leaves the variable exported.
    name, values = named[1], " ".join(args[position + 1 :])
    if set(letters) & set("qnS") or (named[2] and "e" in letters):
        return None
    if set(letters) & set("eu") or ("l" in letters and "x" not in letters):
        return name, None
    if "a" in letters:
        values = " ".join(w for w in (f"${name}", values) if w)
    elif "p" in letters:
        values = " ".join(w for w in (values, f"${name}") if w)
    return name, values


def _code_command(code: str) -> tuple[list[str], bool, tuple[str, ...]] | None:
    """`_first_command` of shell CODE, whose words, where it has nothing a shell reads but
    quotes (`python "my script.py"`), are all read, past the variables set before them."""
    if not any(char in code for char in ";&|`$()<>\n\\#"):
        try:
            words = shlex.split(code)
        except ValueError:
            return _first_command(code)
        sets: list[str] = []
        while words and _ASSIGNMENT.match(words[0]):
            sets.append(words.pop(0))
        return (words, True, tuple(sets)) if words or sets else None
    return _first_command(code)


def _parse(
    spec: _Spec, words: Sequence[str]
) -> tuple[list[tuple[str, str | None]], Sequence[str] | None, str | None, tuple[str, ...]]:
    """A wrapper's options, the command it runs (None where none is sure), the shell code it
    runs (su -c CODE), if any, and the NAME=VALUE words it sets for its command."""
    sets: list[str] = []
    options, rest, code = _options(spec, words, sets)
    return options, rest, code, tuple(sets)


def _options(
    spec: _Spec, words: Sequence[str], sets: list[str]
) -> tuple[list[tuple[str, str | None]], Sequence[str] | None, str | None]:
    options: list[tuple[str, str | None]] = []
    position = 0
    operands = spec.operands
    shell_code: str | None = None
    while position < len(words):
        word = words[position]
        if word == "--":
            position += 1
            while spec.assignments_after_dashes and position < len(words):
                if "=" not in words[position] or words[position].startswith("="):
                    break
                sets.append(words[position])
                position += 1
            break
        if word.startswith("--"):
            name = word.split("=", 1)[0]
            value: str | None = None
            if "=" in word:
                value = word.split("=", 1)[1]
            elif name in spec.long_values:
                if position + 1 >= len(words):
                    return options, None, None
                position += 1
                value = words[position]
            options.append((name if value is not None else word, value))
            if name in spec.no_command:
                return options, None, None
            if name in spec.shell_command:
                shell_code = value
            position += 1
            continue
        if word.startswith("-") and len(word) > 1 and not word[1:].isdigit():
            # A cluster of short options (-Eu alice, -n5); the first that takes a value ends it.
            for offset, letter in enumerate(word[1:], start=1):
                flag = f"-{letter}"
                if flag in spec.no_command:
                    options.append((flag, None))
                    return options, None, None
                if letter in spec.short_values:
                    glued = word[offset + 1 :]
                    if not glued:
                        if position + 1 >= len(words):
                            return options, None, None
                        position += 1
                        glued = words[position]
                    options.append((flag, glued))
                    if flag in spec.shell_command:
                        shell_code = glued
                    break
                options.append((flag, None))
            position += 1
            continue
        if word == "-" or (word.startswith("-") and word[1:].isdigit()):
            # su's `-` (a login), nice's old `-10`.
            options.append((word, None))
            position += 1
            continue
        if spec.assignments and "=" in word and not word.startswith("="):
            sets.append(word)
            position += 1
            continue
        if operands:
            operands -= 1
            position += 1
            continue
        if spec.code_operand and shell_code is None:
            shell_code = word
            break
        if spec.permute and not any(name in spec.command_follows for name, _ in options):
            position += 1  # su's user, or an argument of the user's shell
            continue
        break
    if shell_code is not None:
        return options, None, shell_code
    rest = words[position:]
    if (
        spec.shell_command
        and spec.permute
        and not any(name in spec.command_follows for name, _ in options)
    ):
        # su alice [ARGS]: the user's shell, given ARGS; no command of ours runs as words.
        return options, None, None
    return options, rest or None, None


def runs_gpuwait(step: Step) -> bool:
    """Is this step a gpuwait (`gpuwait ...`, `python -m gpuwait ...`), which reserves GPUs of
    its own for its command and sets the variables for it?"""
    if step.program == "gpuwait":
        return True
    # The interpreter's own options may come first (`python3 -I -m gpuwait`, `-Im`, `-X utf8`).
    runs = python_runs(step.argv)
    return runs is not None and runs[:2] == ("-m", "gpuwait")


#: What gpuwait gives a job's command that binds it to its GPUs (CUDA_DEVICE_ORDER numbers the
#: cards as NVML does where visible_devices = index).
GPU_VARIABLES = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")


def _listed(options: Sequence[tuple[str, str | None]], names: Sequence[str], variable: str) -> bool:
    return any(
        name in names and value is not None and variable in value.split(",")
        for name, value in options
    )


#: sudo's options after which it runs no command of the line: -v and -K (its credentials), -l
#: (what one may run), -e (sudoedit: an editor on a file), --help and -V (its help, its version;
#: -h too), and -h HOST (what may run there: given a command, sudo refuses it).
_SUDO_RUNS_NOTHING = frozenset(
    {
        *("-v", "--validate", "-K", "--remove-timestamp", "-l", "--list", "-e", "--edit"),
        *("--help", "-V", "--version", "-h", "--host"),
    }
)
#: sudo's options that run nothing where no command follows (`sudo -k`), and it otherwise.
_SUDO_ALONE_RUNS_NOTHING = frozenset({"-k", "--reset-timestamp"})


def drops_gpus(step: Step, variable: str = GPU_VARIABLES[0]) -> bool:
    """Does this wrapper start its command without the `variable` it was given
    (CUDA_VISIBLE_DEVICES unless said)?

    sudo resets the environment (env_reset, on by default) unless told to keep it (-E,
    --preserve-env, or a --preserve-env=LIST naming the variable); doas and pkexec always
    do; su and runuser do for a login (-, -l) unless -w names it; env does with -i (or `-`)
    or -u naming it; setpriv with --reset-env; sg for a login (-); a shell's exec with -c;
    systemd-run unless --scope: its command runs in a unit of systemd's, with its environment;
    a shell's code that unsets it before its first command, or takes it out of the
    environment (`export -n`, `declare +x`: `unexports`)."""
    if step.program == "unset":
        # A shell's code that unsets it before its command (`unset CUDA_VISIBLE_DEVICES; python
        # x.py`), but for a function of that name (-f).
        # fish has no unset: "Unknown command", and it carries on.
        return step.shell != "fish" and variable in step.argv[1:] and "-f" not in step.argv[1:]
    if step.program in declaring(step.shell):
        return unexports(step, variable)
    if step.program == "set" and step.shell == "fish":
        fished = _fish_set(step.argv[1:])
        return fished is not None and fished == (variable, None)
    names = {name for name, _ in step.options}
    # What is read of its options already drops the variables, whatever words follow.
    if step.program == "doas":
        # doas -L forgets the password, -C checks its rules: neither runs a command.
        return not names & {"-L", "-C"}
    if step.program == "pkexec":
        return not names & {"--version", "--help"}
    if step.program == "setpriv":
        return "--reset-env" in names
    if step.program == "sg":
        return "-" in names
    if step.unsure:
        return False  # its options are not all known: it may well keep the variables
    if step.program == "sudo":
        if names & _SUDO_RUNS_NOTHING:
            return False  # sudo -v, -l: it asks for the password, or lists; -e edits a file
        values = {value for _, value in step.options if value is not None}
        if names & _SUDO_ALONE_RUNS_NOTHING and all(
            word.startswith("-") or word in values for word in step.argv[1:]
        ):
            return False  # sudo -k: it forgets the password, and runs nothing
        return not (
            "-E" in names
            or any(name == "--preserve-env" and value is None for name, value in step.options)
            or _listed(step.options, ("--preserve-env",), variable)
        )
    if step.program == "systemd-run":
        # A unit of systemd's, started with systemd's environment; --scope runs the command
        # itself, with the environment it was given.
        return "--scope" not in names
    if step.program == "exec":
        return "-c" in names  # exec -c: an empty environment
    if step.program in ("su", "runuser"):
        login = bool(names & {"-", "-l", "--login"})
        return login and not _listed(step.options, ("-w", "--whitelist-environment"), variable)
    if step.program == "env":
        return bool(names & {"-i", "-", "--ignore-environment"}) or _listed(
            step.options, ("-u", "--unset"), variable
        )
    return False


#: The options that make an array of a variable, which no shell exports, by builtin: bash's
#: `declare -a` (-A), `readonly -a`; zsh's `export -a` too (bash has none: it keeps it).
_ARRAYS = {"declare": "aA", "typeset": "aA", "readonly": "a"}
_ZSH_ARRAYS = {**_ARRAYS, "export": "a", "readonly": "aA", "local": "aA"}


def makes_a_number(step: Step, variable: str) -> bool:
    """Does a shell's code make `variable` a number before its command, with no value given
    (zsh's `integer CUDA_VISIBLE_DEVICES`, `float ...`, `typeset -i ...`, `local -F ...`) or
    one that passes gpuwait's on (`integer CUDA_VISIBLE_DEVICES="$CUDA_VISIBLE_DEVICES"`, bash's
    `declare -i` too)? The shell reads the value as arithmetic: a GPU UUID's words and numbers
    (`GPU-...`) give 0, or less, or an error. bash's `declare -i` reads only a value assigned
    after it; any other value is one the line sets (`_check_sets`)."""
    if step.shell == "fish" or step.program not in declaring(step.shell):
        return False
    assigned = any(word.startswith(variable + "=") for word in step.argv[1:])
    if not assigned and (step.shell != "zsh" or variable not in step.argv[1:]):
        return False
    if step.shell != "zsh" and step.program not in ("declare", "typeset"):
        return False  # bash's export and readonly have no -i: "invalid option", nothing set
    options = [word for word in step.argv[1:] if word[:1] == "-" and word not in ("-", "--")]
    numbers = "iEF" if step.shell == "zsh" else "i"
    return step.program in ("integer", "float") or any(set(w[1:]) & set(numbers) for w in options)


def unexports(step: Step, variable: str) -> bool:
    """Does a shell's code take `variable` out of the environment before its command (`export
    -n CUDA_VISIBLE_DEVICES; python x.py`, `declare +x ...`), or makes an array of it (`declare
    -a CUDA_VISIBLE_DEVICES=0`), which is not exported, but for a function (-f)? Not
    zsh's `export -n`: zsh has no -n, says "bad option", carries on and keeps it exported."""
    options = [word for word in step.argv[1:] if word[:1] in "-+" and word != "--"]
    names = [word.partition("=")[0] for word in step.argv[1:] if word[:1] not in "-+"]
    if variable not in names or any("f" in word or "F" in word for word in options):
        return False
    if step.shell == "fish":
        return False  # fish has no declare, typeset or readonly, and its export no options
    arrays = (_ZSH_ARRAYS if step.shell == "zsh" else _ARRAYS).get(step.program, "")
    if any(word[0] == "-" and set(word) & set(arrays) for word in options):
        return True
    if step.program == "export":
        # bash's options: the words from the first to `--` or a name (`-n +x NAME`: +x is a
        # name), each of -a, -A, -f, -n, -p; any other letter (`export -nx`) is an invalid
        # option, and export does nothing.
        given: list[str] = []
        for word in step.argv[1:]:
            if word[:1] != "-" or word in ("-", "--"):
                break
            given.append(word)
        return (
            step.shell != "zsh"
            and any("n" in word for word in given)
            and all(set(word[1:]) <= set("aAfnp") for word in given)
        )
    return any(word[0] == "+" and "x" in word for word in options)


def passed_on(
    before: Sequence[Step], names: Sequence[str], environ: Mapping[str, str]
) -> dict[str, str] | None:
    """The variables of `names` that the command run by the last of `before` starts with,
    from `environ` (gpuwait's) through each wrapper: those it drops left out (`drops_gpus`:
    sudo's env_reset, env -u, env -i ...), those it sets (`env NV_GPU=1`, a shell's
    `NVIDIA_VISIBLE_DEVICES=all docker ...`) put in. None where a wrapper's options are not
    all known."""
    return passed_on_each(before, names, environ)[-1]


def passed_on_each(
    found: Sequence[Step], names: Sequence[str], environ: Mapping[str, str]
) -> list[dict[str, str] | None]:
    """passed_on(found[:k], names, environ) for each k from 0 to len(found), in one pass: a
    line of many wrappers costs each of them once."""
    passed = {name: environ[name] for name in names if name in environ}
    each: list[dict[str, str] | None] = [dict(passed)]
    unsure = False
    for step in found:
        unsure = unsure or step.unsure
        passed = {name: value for name, value in passed.items() if not drops_gpus(step, name)}
        for word in step.sets:
            name, _, value = word.partition("=")
            if name in names:
                passed[name] = value
        each.append(None if unsure else dict(passed))
    return each


#: docker's wrapper that adds the NVIDIA runtime to `run` (and NVIDIA_VISIBLE_DEVICES=$NV_GPU):
#: a CUDA image, which sets NVIDIA_VISIBLE_DEVICES=all, gets every GPU.
NVIDIA_DOCKER = "nvidia-docker"
#: Container engines whose `run` gives the container the GPUs its own options name: the
#: CUDA_VISIBLE_DEVICES gpuwait sets stays outside the container (containerd's nerdctl takes
#: docker's options).
CONTAINER_ENGINES = frozenset({"docker", "podman", "nerdctl", NVIDIA_DOCKER})
#: Their options before the subcommand that take a value (`docker --context lab run`).
_ENGINE_VALUES = frozenset(
    {
        *("-H", "--host", "-c", "--context", "--config", "-l", "--log-level", "--tlscacert"),
        *("--tlscert", "--tlskey", "--connection", "--url", "--identity", "--root", "--runroot"),
        *("--storage-driver", "--storage-opt", "--cgroup-manager", "--conmon", "--runtime"),
        *("--runtime-flag", "--events-backend", "--hooks-dir", "--module", "--tmpdir"),
        *("--network-cmd-path", "--network-config-dir", "--volumepath", "--imagestore"),
        *("--db-backend", "--ssh", "--out"),
        # nerdctl's.
        *("-n", "--namespace", "-a", "--address", "--snapshotter", "--cni-path"),
        *("--cni-netconfpath", "--data-root", "--hosts-dir", "--host-gateway-ip", "--bridge-ip"),
    }
)
#: `run`'s long options that take no value (every other one takes the next word, unless glued
#: on with `=`), and its short ones (every other letter takes a value, glued on or next).
_RUN_FLAGS = frozenset(
    {
        *("--detach", "--disable-content-trust", "--help", "--init", "--interactive"),
        *("--no-healthcheck", "--oom-kill-disable", "--privileged", "--publish-all", "--quiet"),
        *("--read-only", "--rm", "--sig-proxy", "--tty", "--use-api-socket", "--env-host"),
        *("--http-proxy", "--no-hosts", "--passwd", "--read-only-tmpfs", "--replace", "--rmi"),
        *("--tls-verify",),
    }
)
_RUN_SHORT_FLAGS = "ditPq"
#: NVIDIA_VISIBLE_DEVICES values that give the container no GPU.
_NO_GPUS = frozenset({"", "none", "void"})


def container_gpus(
    step: Step,
    environ: Mapping[str, str] | None = None,
    read: Callable[[str], Sequence[str]] | None = None,
) -> list[tuple[int, int]]:
    """Where a `docker run`, `podman run` or `nerdctl run` step gives the container GPUs of its
    own (`--gpus all`, `--gpus=2`, `--device nvidia.com/gpu=0`, `--device /dev/nvidia0`,
    `--runtime=nvidia` or `-e NVIDIA_VISIBLE_DEVICES=all`, which the NVIDIA runtime reads):
    each such option's words, as
    (start, end) in `step.argv`; none where it gives none, or runs no container. Only the
    options before its image are looked at: the words after it are its command's. `environ`:
    the engine's environment, whose NVIDIA_VISIBLE_DEVICES `-e NVIDIA_VISIBLE_DEVICES` (no
    value) passes on; where it is not known, that option gives nothing. `read`: the lines of an
    `--env-file`, whose NVIDIA_VISIBLE_DEVICES counts as an -e's does, an -e winning over it
    wherever it is given (a name alone passes on the engine's); unread where not given. An -e
    or --env-file whose value is not known (a shell's code read up to an expansion) may set
    it: the NVIDIA runtime then gives no GPUs known here."""
    if step.program not in CONTAINER_ENGINES:
        return []
    argv = step.argv
    position = 1
    while position < len(argv) and argv[position].startswith("-"):
        position += 2 if argv[position] in _ENGINE_VALUES else 1
    if argv[position : position + 2] == ("container", "run"):
        position += 1
    if argv[position : position + 1] != ("run",):
        return []
    found: list[tuple[str, str, int, int]] = []
    #: The NVIDIA_VISIBLE_DEVICES its --env-file options set, in their order.
    files: list[tuple[str, str, int, int]] = []
    position += 1
    options = position
    #: An -e, --env or --env-file whose value is not known (cut where a shell's code stopped
    #: being plain: `-e "NVIDIA_VISIBLE_DEVICES=$GPUWAIT_GPU_UUIDS"`), which may set anything.
    unknown = False
    while position < len(argv):
        word, begin = argv[position], position
        if word in ("--", "-") or not word.startswith("-"):
            break
        name, value = word, ""
        if word.startswith("--"):
            name, glue, value = word.partition("=")
            if not glue and name not in _RUN_FLAGS:
                if position + 1 >= len(argv):
                    # Its value is not known (cut where a shell's code stopped being plain).
                    unknown = name in ("--env", "--env-file")
                    break
                position += 1
                value = argv[position]
        else:
            for offset, letter in enumerate(word[1:], start=1):
                if letter in _RUN_SHORT_FLAGS:
                    continue
                name, value = f"-{letter}", word[offset + 1 :]
                if not value:
                    if position + 1 >= len(argv):
                        # Its value is not known, as a long option's: the options before it
                        # still count, and it names nothing.
                        unknown, name = letter == "e", ""
                        break
                    position += 1
                    value = argv[position]
                break
        position += 1
        if name == "--env-file" and read is not None:
            for line in read(value):
                if line == _NVIDIA_ENV[:-1] and (environ or {}).get(line) is not None:
                    files.append((name, _NVIDIA_ENV + (environ or {})[line], begin, position))
                elif line.startswith(_NVIDIA_ENV):
                    files.append((name, line, begin, position))
        if name in ("-e", "--env") and value == _NVIDIA_ENV[:-1]:
            # The engine's own value, where it has one; the container gets none where not.
            passed = (environ or {}).get(value)
            value = value if passed is None else _NVIDIA_ENV + passed
        found.append((name, value, begin, position))
    named = [(n, v) for n, v, _, _ in found if n in ("-e", "--env") and v.startswith(_NVIDIA_ENV)]
    given = [v for _, v, _, _ in files] + [v for _, v in named]
    nvidia = not unknown and (not given or given[-1][len(_NVIDIA_ENV) :] not in _NO_GPUS)
    if files and not named and nvidia:
        # The file's own: the last one naming GPUs.
        found.append(files[-1])
    # nvidia-docker's runtime, where no option names the GPUs: where its options begin.
    implied = [(options, options)] if step.program == NVIDIA_DOCKER and nvidia and not given else []
    return implied + sorted(
        (begin, end)
        for name, value, begin, end in found
        if name == "--gpus"
        or (name == "--device" and (value.startswith("nvidia.com/gpu=") or _GPU_NODE.match(value)))
        or (nvidia and name == "--runtime" and value == "nvidia")
        or (given and nvidia and name in ("-e", "--env") and value.startswith(_NVIDIA_ENV))
        or (name == "--env-file" and nvidia and value.startswith(_NVIDIA_ENV))
    )


_NVIDIA_ENV = "NVIDIA_VISIBLE_DEVICES="
#: A GPU's device node (`/dev/nvidia0`, `/dev/nvidia1:/dev/nvidia0:rwm`): the container gets
#: that GPU whatever CUDA_VISIBLE_DEVICES says; /dev/nvidiactl and /dev/nvidia-uvm are no GPU.
_GPU_NODE = re.compile(r"/dev/nvidia[0-9]+(?::|\Z)")


#: Apptainer, and Singularity (SingularityCE, or Apptainer's own `singularity`): their actions
#: take the container's variables from APPTAINERENV_ (SINGULARITYENV_) ones, which gpuwait
#: sets, but from their own --env and --env-file options over those.
APPTAINER_ENGINES = frozenset({"apptainer", "singularity"})
_APPTAINER_ACTIONS = frozenset({"exec", "run", "shell", "test"})
#: The actions' options that take a value (the next word, unless glued on with `=`); every
#: other one takes none. The short ones: -B (--bind), -H (--home), -o (--overlay), -S
#: (--scratch), -W (--workdir), -s (--shell).
_APPTAINER_VALUES = frozenset(
    {
        *("--add-caps", "--app", "--apply-cgroups", "--authfile", "--bind", "--blkio-weight"),
        *("--blkio-weight-device", "--cpu-shares", "--cpus", "--cpuset-cpus", "--cpuset-mems"),
        *("--device", "--dns", "--docker-host", "--drop-caps", "--env", "--env-file"),
        *("--fusemount", "--gid", "--home", "--hostname", "--memory", "--memory-reservation"),
        *("--memory-swap", "--mount", "--network", "--network-args", "--overlay", "--pem-path"),
        *("--pids-limit", "--pwd", "--scratch", "--security", "--uid", "--workdir"),
        # --no-mount's list of mounts, --cwd (--pwd's other name), shell's -s (--shell), and
        # the hidden or experimental ones: each takes the next word, not the image.
        *("--no-mount", "--cwd", "--shell", "--containlibs", "--tmpdir", "--dmtcp-launch"),
        *("--dmtcp-restart", "--vm-ram", "--vm-cpu", "--vm-ip"),
    }
)
_APPTAINER_SHORT_VALUES = "BHoSWs"


#: Apptainer's options that its environment sets too, by the name after APPTAINER_ (or the
#: older SINGULARITY_, which Apptainer still reads, and SingularityCE alone): on where the
#: value is true as Go's strconv.ParseBool reads it (1, t, true), unless the command line
#: gives the option itself. FUSESPEC is --fusemount's value, ENV_FILE --env-file's.
_APPTAINER_ENV_FLAGS = {
    "CONTAINALL": "--containall",
    "CONTAIN": "--contain",
    "CLEANENV": "--cleanenv",
    "COMPAT": "--compat",
    "PID": "--pid",
    "UNSHARE_PID": "--pid",
    "NVCCLI": "--nvccli",
}
_APPTAINER_ENV_VALUES = {"FUSESPEC": "--fusemount", "ENV_FILE": "--env-file"}
_APPTAINER_ENV_PREFIXES = ("APPTAINER_", "SINGULARITY_")
#: The variables of the caller's environment an action reads as its options.
APPTAINER_OPTION_VARIABLES = tuple(
    prefix + key
    for prefix in _APPTAINER_ENV_PREFIXES
    for key in (*_APPTAINER_ENV_FLAGS, *_APPTAINER_ENV_VALUES)
)


def _apptainer_env_options(environ: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """The options an action takes from `environ` (the variables it starts with), each by its
    name (`--containall`) as (value, the variable's NAME=VALUE): `--containall` for
    APPTAINER_CONTAINALL=1, APPTAINER_ over SINGULARITY_."""
    found: dict[str, tuple[str, str]] = {}
    for prefix in reversed(_APPTAINER_ENV_PREFIXES):
        for key, option in {**_APPTAINER_ENV_FLAGS, **_APPTAINER_ENV_VALUES}.items():
            value = environ.get(prefix + key, "").strip()
            if not value or (key in _APPTAINER_ENV_FLAGS and value not in _GO_TRUE):
                continue
            found[option] = (value, f"{prefix}{key}={value}")
    return found


#: What Go's strconv.ParseBool takes for true.
_GO_TRUE = frozenset({"1", "t", "T", "TRUE", "true", "True"})


def _apptainer_start(step: Step) -> int | None:
    """Where an `apptainer` or `singularity` action's options begin in `step.argv` (after
    `exec`, `instance start`), None where the step runs no action."""
    if step.program not in APPTAINER_ENGINES:
        return None
    argv = step.argv
    position = 1
    while position < len(argv) and argv[position].startswith("-"):  # -d, --config FILE
        position += 2 if argv[position] in ("-c", "--config") else 1
    if argv[position : position + 2] in (("instance", "start"), ("instance", "run")):
        position += 1
    elif argv[position : position + 1] and argv[position] not in _APPTAINER_ACTIONS:
        return None
    return position + 1


def runs_apptainer(argv: Sequence[str]) -> bool:
    """Does the line run an `apptainer` or `singularity` action (`exec`, `run` ...), itself or
    through the wrappers above?"""
    return any(_apptainer_start(step) is not None for step in steps(argv))


def apptainer_command(step: Step) -> tuple[str, ...] | None:
    """The command an `apptainer` or `singularity` `exec` runs in the container (`apptainer
    exec --nv img.sif deepspeed x.py`: `deepspeed x.py`); None for another action (`run`
    gives its words to the image's runscript), or where its options are not all known."""
    start = _apptainer_start(step)
    # No action named (`apptainer` alone, `sh -c 'exec apptainer "$@"'` read up to "$@").
    if start is None or step.argv[start - 1 : start] != ("exec",):
        return None
    found, unknown = _apptainer_options(step)
    if unknown:
        return None
    image = found[-1][3] if found else start
    if step.argv[image : image + 1] == ("--",):
        image += 1
    return step.argv[image + 1 :] or None


def _apptainer_options(step: Step) -> tuple[list[tuple[str, str, int, int]], bool]:
    """An `apptainer` or `singularity` action's options before its image, each as (name,
    value, start, end) in `step.argv`, none where the step runs no action; and whether they
    end in one whose value is not known (cut where a shell's code stopped being plain: `--env
    "CUDA_VISIBLE_DEVICES=$GPUWAIT_GPU_UUIDS"`), which may set anything."""
    start = _apptainer_start(step)
    if start is None:
        return [], False
    argv = step.argv
    found: list[tuple[str, str, int, int]] = []
    position = start
    while position < len(argv):
        word, begin = argv[position], position
        if word in ("--", "-") or not word.startswith("-"):
            break
        name, glue, value = word.partition("=")
        if not word.startswith("--"):
            # Letters run together (`-eB /data`): those before the first that takes a value
            # take none; that one takes the rest of the word, or the next word.
            rest = word[1 + len(_short_flags(word)) :]
            if rest:
                name, value = "-" + rest[0], rest[1:]
                glue = "=" if value else ""
            else:
                name, glue, value = word[:2], "=", word[2:]
        if not glue and name in _APPTAINER_VALUES | {f"-{c}" for c in _APPTAINER_SHORT_VALUES}:
            if position + 1 >= len(argv):
                return found, True
            position += 1
            value = argv[position]
        position += 1
        found.append((name, value, begin, position))
    return found, False


def apptainer_gpu_env(
    step: Step, names: Sequence[str] = GPU_VARIABLES[:1]
) -> list[tuple[int, int, tuple[str, ...], str]]:
    """Where an `apptainer` or `singularity` action sets a variable of `names` in the container
    with its own `--env` (`--env CUDA_VISIBLE_DEVICES=0`, `--env=A=1,CUDA_VISIBLE_DEVICES=0`),
    over the APPTAINERENV_ one gpuwait gives it: each such option as (start, end) in
    `step.argv`, with the words that would set the rest of its list (none where it sets
    nothing else), and the first of `names` it sets."""
    found: list[tuple[int, int, tuple[str, ...], str]] = []
    for name, value, begin, end in _apptainer_options(step)[0]:
        if name != "--env":
            continue
        # NAME=A,B is one variable; A=1,B=2 two.
        pairs = [value] if value.count("=") == 1 else value.split(",")
        rest = [pair for pair in pairs if pair.partition("=")[0] not in names]
        if len(rest) < len(pairs):
            named = next(pair.partition("=")[0] for pair in pairs if pair not in rest)
            found.append((begin, end, ("--env", ",".join(rest)) if rest else (), named))
    return found


def apptainer_env_files(
    step: Step, environ: Mapping[str, str] | None = None
) -> list[tuple[str, int, int]]:
    """The files an `apptainer` or `singularity` action's `--env-file` options name (whose
    variables it sets in the container over the APPTAINERENV_ ones), each with its option's
    (start, end) in `step.argv`; without one, the file APPTAINER_ENV_FILE names in `environ`
    (the variables the action starts with), at (start, start) of its options. None where an
    option's value is not known: it may be an --env setting the same variables, which wins
    over the files."""
    options, cut = _apptainer_options(step)
    if cut:
        return []
    files = [(value, begin, end) for name, value, begin, end in options if name == "--env-file"]
    start = _apptainer_start(step)
    given = _apptainer_env_options(environ or {}).get("--env-file")
    if not files and given and start is not None:
        return [(given[0], start, start)]
    return files


def apptainer_option_variable(step: Step, option: str, environ: Mapping[str, str]) -> str:
    """The NAME=VALUE of `environ` that gives an `apptainer` or `singularity` action its
    `option` (`APPTAINER_CONTAINALL=1` for --containall), "" where none does."""
    if _apptainer_start(step) is None:
        return ""
    return _apptainer_env_options(environ).get(option, ("", ""))[1]


def apptainer_pid_namespace(
    step: Step, environ: Mapping[str, str] | None = None
) -> tuple[int, int, str] | None:
    """Where an `apptainer` or `singularity` action runs its command in a PID namespace of its
    own (`--containall`, `-C`, `--pid`, `-p`, or a short one among others, `-Cp`; `--compat`,
    which is --containall and more; `--fusemount`, which implies --pid): that option's (start,
    end) in `step.argv`, and the name it was given by; None where it does not. Without such an
    option, the variable of `environ` (what the action starts with) that sets one
    (APPTAINER_CONTAINALL=1, APPTAINER_FUSESPEC=...), at (-1, -1)."""
    options = _apptainer_options(step)[0]
    for name, value, begin, end in options:
        if _turned_off(name, value):
            continue
        if name in ("--containall", "--pid", "--compat", "--fusemount"):
            return begin, end, name
        found = [letter for letter in _short_flags(step.argv[begin]) if letter in "Cp"]
        if found:
            return begin, end, f"-{found[0]}"
    if _apptainer_start(step) is None:
        return None
    given = _apptainer_env_options(environ or {})
    named = {name for name, *_ in options}  # the command line's, over the variables'
    for option in ("--containall", "--compat", "--pid", "--fusemount"):
        if option in given and option not in named:
            return -1, -1, given[option][1]
    return None


def apptainer_pid_variables(environ: Mapping[str, str]) -> list[str]:
    """The variables of `environ` (what an action starts with) that each give it a PID
    namespace of its own (APPTAINER_CONTAINALL=1, SINGULARITY_PID=t, APPTAINER_FUSESPEC=...):
    a site may export the APPTAINER_ and the SINGULARITY_ form both."""
    options = ("--containall", "--compat", "--pid", "--fusemount")
    return [
        prefix + key
        for prefix in _APPTAINER_ENV_PREFIXES
        for key, option in {**_APPTAINER_ENV_FLAGS, **_APPTAINER_ENV_VALUES}.items()
        if option in options
        and (value := environ.get(prefix + key, "").strip())
        and (key not in _APPTAINER_ENV_FLAGS or value in _GO_TRUE)
    ]


def _apptainer_names(step: Step, environ: Mapping[str, str] | None) -> set[str]:
    """The options an `apptainer` or `singularity` action is given, on its command line (each
    letter of `-Cp` as one) or by `environ`, the variables it starts with."""
    names: set[str] = set()
    options = _apptainer_options(step)[0]
    for name, value, begin, _ in options:
        if not _turned_off(name, value):
            names.add(name)
        names.update(f"-{letter}" for letter in _short_flags(step.argv[begin]))
    if _apptainer_start(step) is not None:
        named = {name for name, *_ in options}  # the command line's, over the variables'
        names.update(set(_apptainer_env_options(environ or {})) - named)
    return names


#: What Go's strconv.ParseBool takes for false.
_GO_FALSE = frozenset({"0", "f", "F", "FALSE", "false", "False"})


def _turned_off(name: str, value: str) -> bool:
    """Is an action's flag given as false on its command line (`--containall=false`), which
    turns it off whatever the variables say?"""
    return name.startswith("--") and name not in _APPTAINER_VALUES and value in _GO_FALSE


def apptainer_nvccli_contained(step: Step, environ: Mapping[str, str] | None = None) -> bool:
    """Does an `apptainer` or `singularity` action set its GPUs up with nvidia-container-cli
    (`--nvccli`) in a contained /dev (`--contain`, `-c`, `--containall`, `-C`, `--compat`)?
    There it binds in only the GPUs the caller's NVIDIA_VISIBLE_DEVICES names, none where it
    is unset. `environ`: the variables it starts with, which give it options too
    (APPTAINER_NVCCLI=1, APPTAINER_CONTAIN=1)."""
    names = _apptainer_names(step, environ)
    contained = {"--contain", "-c", "--containall", "-C", "--compat"}
    return "--nvccli" in names and bool(names & contained)


def apptainer_cleans_env(step: Step, environ: Mapping[str, str] | None = None) -> bool:
    """Does an `apptainer` or `singularity` action start its command without the caller's
    environment (`--cleanenv`, `-e`, `--containall`, `-C`, or `--compat`, which is --containall
    and more; or APPTAINER_CLEANENV=1 and the like in `environ`, the variables it starts
    with)? There the container's CUDA_VISIBLE_DEVICES comes from the APPTAINERENV_
    (SINGULARITYENV_) copy alone."""
    names = _apptainer_names(step, environ)
    return bool(names & {"--cleanenv", "-e", "--containall", "-C", "--compat"})


def _short_flags(word: str) -> str:
    """The letters of a word of an action's short options (`-Cp`) that take no value: those
    before the first that does (`-cB/data`: c)."""
    if word.startswith("--") or not word.startswith("-"):
        return ""
    return re.split(f"[{_APPTAINER_SHORT_VALUES}]", word[1:], maxsplit=1)[0]
