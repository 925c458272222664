"""`gpuwait completion {bash,zsh,fish}`: completion scripts, generated from gpuwait's own parsers.

The options come from each command's `build_parser()` (the default command's and every
subcommand's) and the subcommand names from the SUBCOMMANDS table, so a new option or
subcommand is completed without touching this file.
"""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
from collections.abc import Callable, Iterable, Sequence

from gpuwait.commands import SUBCOMMANDS, module_name
from gpuwait.commands.parsing import Parser
from gpuwait.core.budget import ENFORCE_MODES
from gpuwait.core.policy import PICK_STRATEGIES
from gpuwait.core.record import Record

#: Values worth offering for options whose parser takes free text.
_VALUE_HINTS: dict[str, tuple[str, ...]] = {
    "--pick": tuple(PICK_STRATEGIES),
    "--enforce": ENFORCE_MODES,
    "--priority": ("1", "2", "3", "4", "5"),
}
_PATH_METAVARS = re.compile(r"FILE|PATH|DIR", re.IGNORECASE)


class OptionSpec(Record, frozen=True):
    flags: tuple[str, ...]
    help: str
    takes_value: bool
    metavar: str = ""
    choices: tuple[str, ...] = ()

    @property
    def wants_path(self) -> bool:
        return self.takes_value and not self.choices and bool(_PATH_METAVARS.search(self.metavar))


class CommandSpec(Record, frozen=True):
    """The options and fixed positional words (e.g. `sim init`) of a parser, and the
    subcommands those words name (`sim init` has options of its own)."""

    name: str
    help: str
    options: tuple[OptionSpec, ...]
    words: tuple[str, ...] = ()
    nested: tuple[CommandSpec, ...] = ()

    @property
    def value_flags(self) -> list[str]:
        return [f for o in self.options if o.takes_value for f in o.flags]

    @property
    def flags(self) -> list[str]:
        return [f for o in self.options for f in o.flags]


class CompletionSpec(Record, frozen=True):
    top: CommandSpec
    subcommands: tuple[CommandSpec, ...] = ()


def spec_of(parser: argparse.ArgumentParser, name: str, help_text: str = "") -> CommandSpec:
    options: list[OptionSpec] = []
    words: list[str] = []
    nested: list[CommandSpec] = []
    for action in parser._actions:
        if action.help == argparse.SUPPRESS:
            continue
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for word, sub in action.choices.items():
                words.append(word)
                nested.append(spec_of(sub, word, helps.get(word, "")))
            continue
        if not action.option_strings:
            words += [str(c) for c in action.choices or ()]
            continue
        takes_value = action.nargs != 0
        choices = tuple(str(c) for c in action.choices or ())
        for flag in action.option_strings:
            choices = choices or _VALUE_HINTS.get(flag, ())
        metavar = action.metavar if isinstance(action.metavar, str) else action.dest.upper()
        options.append(
            OptionSpec(
                flags=tuple(action.option_strings),
                help=_one_line(action.help or ""),
                takes_value=takes_value,
                metavar=metavar if takes_value else "",
                choices=choices,
            )
        )
    return CommandSpec(name, help_text, tuple(options), tuple(words), tuple(nested))


def _one_line(text: str) -> str:
    return " ".join(text.replace("%%", "%").split())


def build_spec() -> CompletionSpec:
    from gpuwait.commands import run

    top = spec_of(run.build_parser(), "gpuwait")
    subs = []
    for name, help_text in SUBCOMMANDS.items():
        module = importlib.import_module(module_name(name))
        subs.append(spec_of(module.build_parser(), name, help_text))
    return CompletionSpec(top, tuple(subs))


def script(shell: str, spec: CompletionSpec | None = None) -> str:
    spec = spec or build_spec()
    return {"bash": _bash, "zsh": _zsh, "fish": _fish}[shell](spec)


# bash -----------------------------------------------------------------------------------------


def _words(items: Iterable[str]) -> str:
    return shlex.quote(" ".join(items))


def _bash(spec: CompletionSpec) -> str:
    top = spec.top
    value_cases = []
    for option in top.options:
        if option.takes_value:
            action = (
                f'mapfile -t COMPREPLY < <(compgen -W {_words(option.choices)} -- "$cur"); '
                if option.choices
                else ""
            )
            value_cases.append(f"            {'|'.join(option.flags)}) {action}return ;;")
    sub_cases = []
    nested_cases = []
    for sub in spec.subcommands:
        sub_cases.append(
            f"        {shlex.quote(sub.name)}) opts={_words(sub.flags)};"
            f" words={_words(sub.words)}; values={_words(sub.value_flags)}"
            f"{'; nested=1' if sub.nested else ''} ;;"
        )
        for inner in sub.nested:
            nested_cases.append(
                f"            {shlex.quote(f'{sub.name} {inner.name}')}) opts={_words(inner.flags)};"
                f" words={_words(inner.words)}; values={_words(inner.value_flags)} ;;"
            )
    value_pattern = "|".join(top.value_flags) or "__none__"
    return f"""\
# gpuwait completion for bash (generated by `gpuwait completion bash`)
_gpuwait_complete() {{
    local cur=${{COMP_WORDS[COMP_CWORD]}} prev=${{COMP_WORDS[COMP_CWORD-1]}}
    local i=1 word first="" dashdash=""
    [[ $prev == = && COMP_CWORD -ge 2 ]] && prev=${{COMP_WORDS[COMP_CWORD-2]}}
    [[ $cur == = ]] && cur=""
    # gpuwait's own options come first; the first other word is a subcommand or the command.
    while (( i < COMP_CWORD )); do
        word=${{COMP_WORDS[i]}}
        case $word in
            --) dashdash=1; (( i++ )); break ;;
            {value_pattern})
                (( i += 2 ))
                [[ ${{COMP_WORDS[i-1]}} == = ]] && (( i++ )) ;;
            -*) (( i++ )) ;;
            *) first=$word; break ;;
        esac
    done
    if [[ -z $first && -n $dashdash && i -lt COMP_CWORD ]]; then
        first=${{COMP_WORDS[i]}}
    fi
    if [[ -z $first ]]; then
        if [[ -z $dashdash ]]; then
            case $prev in
{chr(10).join(value_cases)}
            esac
        fi
        if [[ -z $dashdash && $cur == -* ]]; then
            mapfile -t COMPREPLY < <(compgen -W {_words(top.flags)} -- "$cur")
        elif [[ -z $dashdash ]]; then
            mapfile -t COMPREPLY < <(compgen -W {_words(s.name for s in spec.subcommands)} -- "$cur"; compgen -c -- "$cur")
        else
            mapfile -t COMPREPLY < <(compgen -c -- "$cur")
        fi
        return
    fi
    local opts="" words="" values="" nested=""
    if [[ -z $dashdash ]]; then
        case $first in
{chr(10).join(sub_cases)}
        *)
            # The command's own arguments: its own completion where bash-completion is loaded.
            if declare -F _command_offset >/dev/null; then _command_offset "$i"; fi
            return ;;
        esac
    else
        if declare -F _command_offset >/dev/null; then _command_offset "$i"; fi
        return
    fi
    # A subcommand of the subcommand (`sim init`): its own options and words from there on.
    while [[ -n $nested ]] && (( ++i < COMP_CWORD )); do
        word=${{COMP_WORDS[i]}}
        case $word in
            -*) [[ " $values " == *" $word "* ]] && (( i++ )) ;;
            *)
                case "$first $word" in
{chr(10).join(nested_cases) or "            __none__) ;;"}
                esac
                break ;;
        esac
    done
    if [[ " $values " == *" $prev "* ]]; then return; fi
    if [[ $cur == -* ]]; then
        mapfile -t COMPREPLY < <(compgen -W "$opts" -- "$cur")
    else
        mapfile -t COMPREPLY < <(compgen -W "$words" -- "$cur")
    fi
}}
complete -o bashdefault -o default -F _gpuwait_complete gpuwait
"""


# zsh ------------------------------------------------------------------------------------------


def _zsh_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("[", "\\[").replace("]", "\\]").replace(":", "\\:")


def _zsh_option_specs(options: Sequence[OptionSpec]) -> list[str]:
    specs = []
    for option in options:
        help_text = _zsh_escape(option.help)
        exclusive = f"({' '.join(option.flags)})" if len(option.flags) > 1 else ""
        if option.takes_value:
            if option.choices:
                action = f"({' '.join(option.choices)})"
            elif option.wants_path:
                action = "_files"
            else:
                action = " "
            value = f":{_zsh_escape(option.metavar)}:{action}"
        else:
            value = ""
        for flag in option.flags:
            eq = "=" if option.takes_value and flag.startswith("--") else ""
            specs.append(shlex.quote(f"{exclusive}{flag}{eq}[{help_text}]{value}"))
    return specs


def _zsh_arguments(sub: CommandSpec) -> str:
    """The `_arguments` call for a subcommand; for one with subcommands of its own (`sim
    init`), those words first, then theirs (`$words[1]` is the inner subcommand there)."""
    files = "'*:file:_files'"
    args = _zsh_option_specs(sub.options)
    if sub.words:
        args.append(shlex.quote(f"1:word:({' '.join(sub.words)})"))
    if not sub.nested:
        return " ".join(["_arguments -s", *args, files])
    inner = " ".join(
        " ".join([f"{shlex.quote(n.name)}) _arguments -s", *_zsh_option_specs(n.options), files])
        + " ;;"
        for n in sub.nested
    )
    nested = " ".join(["_arguments -s", *args, "'*::argument:->nested'"])
    return f"{nested}; [[ $state == nested ]] && case $words[1] in {inner} esac"


def _zsh(spec: CompletionSpec) -> str:
    described = " ".join(
        shlex.quote(f"{s.name.replace(':', chr(92) + ':')}:{_one_line(s.help)}")
        for s in spec.subcommands
    )
    sub_cases = []
    for sub in spec.subcommands:
        sub_cases.append(f"                {shlex.quote(sub.name)}) {_zsh_arguments(sub)} ;;")
    top_specs = " \\\n        ".join(_zsh_option_specs(spec.top.options))
    return f"""\
# gpuwait completion for zsh (generated by `gpuwait completion zsh`)
_gpuwait() {{
    local curcontext=$curcontext state state_descr line ret=1
    typeset -A opt_args
    local -a subcommands
    subcommands=({described})
    _arguments -s -S -A '-*' \\
        {top_specs} \\
        '(-):subcommand or command:->first' \\
        '*::arguments:->rest' && ret=0
    case $state in
        first)
            _describe -t subcommands 'gpuwait subcommand' subcommands && ret=0
            _command_names -e && ret=0 ;;
        rest)
            # A `--` right after gpuwait is still words[1] here (_arguments -S drops it only
            # after an option); what follows it is a command, never a subcommand.
            if [[ $words[1] == -- ]]; then
                shift words
                (( CURRENT-- ))
                _normal && ret=0
            else
                case $words[1] in
{chr(10).join(sub_cases)}
                *) _normal && ret=0 ;;
                esac
            fi ;;
    esac
    return ret
}}
if (( ${{+functions[compdef]}} )); then
    compdef _gpuwait gpuwait
fi
"""


# fish -----------------------------------------------------------------------------------------


def fish_quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _fish_option_lines(command_condition: str, options: Sequence[OptionSpec]) -> list[str]:
    lines = []
    for option in options:
        parts = ["complete -c gpuwait", "-n", fish_quote(command_condition)]
        for flag in option.flags:
            parts += ["-l", flag[2:]] if flag.startswith("--") else ["-s", flag[1:]]
        if option.takes_value:
            if option.choices:
                parts += ["-x", "-a", fish_quote(" ".join(option.choices))]
            elif option.wants_path:
                parts += ["-r", "-F"]
            else:
                parts += ["-x"]
        parts += ["-d", fish_quote(option.help)]
        lines.append(" ".join(parts))
    return lines


def _fish(spec: CompletionSpec) -> str:
    value_flags = " ".join(spec.top.value_flags)
    subcommand_names = " ".join(fish_quote(s.name) for s in spec.subcommands)
    lines = [
        "# gpuwait completion for fish (generated by `gpuwait completion fish`)",
        "function __gpuwait_first_word",
        "    # The first word after gpuwait's own options (and their values): a subcommand or",
        "    # the command to run. Prints it, or fails while there is none yet.",
        "    set -l tokens (commandline -opc)",
        "    set -e tokens[1]",
        "    set -l skip 0",
        "    for token in $tokens",
        "        if test $skip = 1",
        "            set skip 0",
        "            continue",
        "        end",
        "        switch $token",
        "            case --",
        "                echo --",
        "                return 0",
        f"            case {value_flags or '__none__'}",
        "                set skip 1",
        "            case '-*'",
        "            case '*'",
        "                echo -- $token",
        "                return 0",
        "        end",
        "    end",
        "    return 1",
        "end",
        "function __gpuwait_no_word",
        "    not __gpuwait_first_word >/dev/null",
        "end",
        "function __gpuwait_first_word_is",
        "    set -l first (__gpuwait_first_word); or return 1",
        '    test "$first" = "$argv[1]"',
        "end",
        "function __gpuwait_in_command",
        "    set -l first (__gpuwait_first_word); or return 1",
        f"    not contains -- $first {subcommand_names}",
        "end",
        "function __gpuwait_complete_command",
        "    # The command to run (after gpuwait's options and `--`), then its own completion.",
        "    # fish's __fish_complete_subcommand would take a `--` given to it (to end its own",
        "    # options) for an option with a value, and so skip the command after `gpuwait --`.",
        "    set -l tokens (commandline -opc) (commandline -ct)",
        "    set -e tokens[1]",
        "    set -l skip 0",
        "    while set -q tokens[1]",
        "        if test $skip = 1",
        "            set skip 0",
        "        else",
        "            switch $tokens[1]",
        "                case --",
        "                    set -e tokens[1]",
        "                    break",
        f"                case {value_flags or '__none__'}",
        "                    set skip 1",
        "                case '-*'",
        "                case '*'",
        "                    break",
        "            end",
        "        end",
        "        set -e tokens[1]",
        "    end",
        "    # Nothing left: the word being typed is the value of one of gpuwait's options.",
        "    set -q tokens[1]; or return",
        '    complete -C (string join -- " " $tokens)',
        "end",
        "complete -c gpuwait -e",
        "complete -c gpuwait -f",
        *_fish_option_lines("__gpuwait_no_word", spec.top.options),
    ]
    # The command to run, and then that command's own completions. Before the subcommands:
    # fish keeps the description of the entry defined last, and `status` is also fish's own.
    lines.append(
        "complete -c gpuwait -n '__gpuwait_no_word; or __gpuwait_in_command' "
        "-a '(__gpuwait_complete_command)'"
    )
    for sub in spec.subcommands:
        lines.append(
            "complete -c gpuwait -n __gpuwait_no_word -a "
            f"{fish_quote(sub.name)} -d {fish_quote(_one_line(sub.help))}"
        )
    for sub in spec.subcommands:
        condition = f"__gpuwait_first_word_is {fish_quote(sub.name)}"
        outer = condition
        if sub.nested:
            # Until a subcommand of its own is given (`sim init`); then that one's options.
            outer += f"; and not __fish_seen_subcommand_from {' '.join(sub.words)}"
        lines += _fish_option_lines(outer, sub.options)
        if sub.words:
            lines.append(
                f"complete -c gpuwait -n {fish_quote(outer)} -a {fish_quote(' '.join(sub.words))}"
            )
        for inner in sub.nested:
            inside = f"{condition}; and __fish_seen_subcommand_from {inner.name}"
            lines += _fish_option_lines(inside, inner.options)
            # Its other arguments are files (`sim init FILE`).
            lines.append(f"complete -c gpuwait -n {fish_quote(inside)} -F")
    return "\n".join(lines) + "\n"


# the command -----------------------------------------------------------------------------------

SHELLS = ("bash", "zsh", "fish")

#: Shells with no script of gpuwait's, whose names are near those of one that has (sh, ksh:
#: zsh; dash: bash): told so, not offered the near one.
OTHER_SHELLS = frozenset(
    ("sh", "ash", "dash", "ksh", "mksh", "csh", "tcsh", "nu", "xonsh", "elvish", "pwsh")
)


def shell_argument(what: str) -> Callable[[str], str]:
    """The `shell` argument's type: a shell gpuwait has no `what` for is refused as such."""

    def shell(word: str) -> str:
        if word in OTHER_SHELLS:
            raise argparse.ArgumentTypeError(
                f"gpuwait has no {what} for {word}, only for {', '.join(SHELLS[:-1])} "
                f"and {SHELLS[-1]}"
            )
        return word

    return shell


def build_parser() -> Parser:
    parser = Parser(
        prog="gpuwait completion",
        description="Print a completion script for gpuwait. `gpuwait shell-init` includes it; "
        "this is for completion without the hook, e.g. "
        "`gpuwait completion fish > ~/.config/fish/completions/gpuwait.fish`.",
    )
    parser.add_argument(
        "shell",
        type=shell_argument("completion"),
        choices=SHELLS,
        help="the shell to print completion for",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    print(script(args.shell), end="")
    return 0
