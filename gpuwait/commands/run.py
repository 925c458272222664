"""The default command: `gpuwait [OPTIONS] [--] COMMAND [ARGS...]`.

Its options become a typed request (gpuwait.runner.session.RunRequest) and its settings plain
values (RunConfig) here; the run itself is gpuwait.runner.session's.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gpuwait import __version__
from gpuwait.commands import SUBCOMMANDS
from gpuwait.commands.common import load_settings
from gpuwait.commands.output import Console
from gpuwait.commands.parsing import (
    Parser,
    RawHelpFormatter,
    add_gpus_option,
    check_name,
    terminal_columns,
    whole_number,
)
from gpuwait.config import OPTIONS, OPTIONS_BY_NAME, Settings, current_fair_share
from gpuwait.core.errors import EXIT_NOT_FOUND, GpuwaitError, UsageError
from gpuwait.core.pausing import DEFAULT_CHECKPOINT_SIGNAL, DEFAULT_GRACE_SECONDS, PauseRules
from gpuwait.core.sizes import (
    MemoryRequest,
    parse_decimal,
    parse_duration,
    parse_request,
    parse_size,
)
from gpuwait.core.text import one_line, printable
from gpuwait.queue.wait import WaitPolicy
from gpuwait.runner import session
from gpuwait.runner.session import Pausable, RunConfig, RunRequest

if TYPE_CHECKING:
    from gpuwait.queue.idle import IdleWatch

#: The most times --retry-oom queues a command again.
MAX_RETRY_OOM = 100

#: gpuwait's own exit statuses (gpuwait.core.errors), one row each; a test checks that none is
#: missing. Besides these, the command's own status passes through unchanged.
_EXIT_STATUSES = (
    (
        "2",
        "usage: a malformed option, setting or config file; a command line that would not"
        " run on the reserved GPU (env -i, sudo -u bob, srun, docker run --gpus all ...) or a"
        " mistyped script, refused before waiting with the line to type (docs/usage.md)",
    ),
    ("3", "the request can never fit on this machine's GPUs"),
    ("4", "no GPU readings (no driver, on_no_gpu = fail; a simulation file unusable)"),
    ("5", "the state dir or the ledger cannot be used"),
    ("6", "an --after-ok job did not succeed, so this one never starts"),
    ("7", "cancelled (`gpuwait cancel`) while waiting"),
    ("8", "not permitted: another user's job"),
    ("9", "--once KEY: a job with this key is already waiting or running"),
    (
        "75",
        "--pausable: asked to checkpoint while waiting (or once its command ran out, a retry"
        " left): start it again later (resume_exit sets another)",
    ),
    ("124", "--timeout passed while waiting"),
    ("126", "the command is not executable"),
    ("127", "the command was not found"),
    ("130, 143", "interrupted (INT, TERM) while waiting"),
    ("141", "gpuwait's output went to a reader that had gone away (e.g. head)"),
)


class _RunParser(Parser):
    """The default command's parser: its epilog (every setting's default) is built only for
    --help, since formatting the whole settings table would slow down every launch."""

    def format_help(self) -> str:
        if self.epilog is None:
            self.epilog = _settings_epilog(terminal_columns() - 2)
        return super().format_help()


def _rows(rows: list[tuple[str, str]], width: int, left: int = 16) -> list[str]:
    """Two columns laid out as argparse lays out options: a name too long for its column puts
    its text on the next line, and the text is wrapped to `width`."""
    import textwrap  # only --help pays for it

    indent = " " * (left + 4)
    lines: list[str] = []
    for name, text in rows:
        wrapped = textwrap.wrap(
            text, max(20, width - len(indent)), break_long_words=False, break_on_hyphens=False
        )
        if len(name) <= left:
            lines.append(f"  {name:<{left}}  {wrapped[0]}")
        else:
            lines += [f"  {name}", indent + wrapped[0]]
        lines += [indent + more for more in wrapped[1:]]
    return lines


def _shown_default(name: str) -> str:
    """Setting `name`'s default for a sentence: "(none)" reads as none there, and a list is
    spaced so that it wraps."""
    option = OPTIONS_BY_NAME[name]
    value = option.parse(option.default)
    shown = ", ".join(value) if isinstance(value, tuple) and value else option.show(value)
    return shown[1:-1] if shown.startswith("(") and shown.endswith(")") else shown


def _settings_epilog(width: int) -> str:
    lines = ["subcommands:", *_rows(list(SUBCOMMANDS.items()), width), ""]
    lines += ["A program named like a subcommand runs with `gpuwait -- status`.", ""]
    lines += ["exit status: the command's own, or one of gpuwait's:"]
    lines += _rows(list(_EXIT_STATUSES), width)
    lines += ["", "settings (command line > GPUWAIT_<NAME> > your config.toml > site's > default):"]
    rows = []
    for option in OPTIONS:
        text = option.help
        # A help text that says its default already ("the user state dir") is not given another.
        if "default" not in text:
            text += f" (default: {_shown_default(option.name)})"
        rows.append((option.name, text))
    return "\n".join(lines + _rows(rows, width))


def _setting_default(name: str) -> str:
    """ "(default: best-fit, the pick setting)": an option whose default is a setting's."""
    shown = _shown_default(name)
    # argparse formats help with %: a default with a percent sign must reach it doubled.
    return f"(default: the {name} setting, {shown})".replace("%", "%%")


def build_parser() -> Parser:
    """The default command's options (their defaults are shown from the settings table)."""
    parser = _RunParser(
        prog="gpuwait",
        usage="gpuwait [OPTIONS] [--] COMMAND [ARGS...]\n"
        "       gpuwait SUBCOMMAND ...  (subcommands below)",
        description="Wait until COMMAND's VRAM fits on a GPU, pick the GPU, and run it there.",
        formatter_class=RawHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"gpuwait {__version__}")
    parser.add_argument(
        "--vram",
        metavar="SIZE",
        help="VRAM per GPU: 6G or 6GiB (2^30 bytes), 6GB (10^9), 512M, or 50%% of a card "
        "(default: learned from earlier runs of the command, else default_vram)",
    )
    parser.add_argument(
        "--key",
        metavar="NAME",
        help="name the command for the history: runs with the same --key share their estimate",
    )
    parser.add_argument(
        "--retry-oom",
        type=whole_number(0, MAX_RETRY_OOM),
        default=0,
        metavar="N",
        help="if the command runs out of GPU memory, queue it again up to N times, "
        "with a raised estimate (default: 0)",
    )
    parser.add_argument(
        "--pausable",
        action="store_true",
        help="the command may be asked to checkpoint and step aside for more urgent work; it "
        "is then resumed (see docs/pausing.md)",
    )
    parser.add_argument(
        "--freezable",
        action="store_true",
        help="when more urgent work needs its room, freeze the command (its VRAM moved to "
        "host memory, its processes stopped) and thaw it there later; needs cuda-checkpoint "
        "and driver 570+ (see docs/freezing.md)",
    )
    parser.add_argument(
        "--checkpoint-signal",
        metavar="SIG",
        help="signal asking a --pausable command to checkpoint "
        f"(default: {DEFAULT_CHECKPOINT_SIGNAL})",
    )
    parser.add_argument(
        "--grace",
        metavar="DURATION",
        help="how long a --pausable command has to step aside once asked "
        f"(default: {DEFAULT_GRACE_SECONDS:g}s)",
    )
    parser.add_argument(
        "--grace-kill",
        action="store_true",
        help="send TERM to a --pausable command that has not stepped aside after --grace",
    )
    add_gpus_option(parser, "number of GPUs, all at once (default: 1)")
    parser.add_argument(
        "--timeout",
        metavar="DURATION",
        help="give up waiting after this long, e.g. 30m (exit 124) " + _setting_default("timeout"),
    )
    parser.add_argument(
        "--pick",
        metavar="STRATEGY",
        help="best-fit, most-free, round-robin, least-loaded, weighted or adaptive-throughput "
        + _setting_default("pick"),
    )
    parser.add_argument(
        "--devices", metavar="LIST", help="only these GPUs: NVML indices or UUIDs, e.g. 0,2"
    )
    parser.add_argument(
        "--prefer",
        metavar="LIST",
        help="take these GPUs (NVML indices or UUIDs, e.g. 2,3) where the command fits; others "
        "only where none of them fits " + _setting_default("prefer"),
    )
    parser.add_argument(
        "--priority",
        metavar="1-5",
        help="queue priority, 5 is most urgent " + _setting_default("priority"),
    )
    parser.add_argument(
        "--safety",
        metavar="FRACTION",
        help="fill each GPU up to this fraction of its VRAM " + _setting_default("safety"),
    )
    parser.add_argument(
        "--enforce",
        metavar="MODE",
        help="keep the command inside its reservation: off, hint (tell JAX and TensorFlow) or "
        "limit (also enforce it where this machine can: cgroup dmem, CUDA MPS, PyTorch's "
        "allocator cap; see docs/budgets.md) " + _setting_default("enforce"),
    )
    parser.add_argument(
        "--exclusive",
        action="store_true",
        help="whole GPUs: no other gpuwait job is admitted there while this one runs",
    )
    parser.add_argument("--name", metavar="NAME", help="name the job (for --after, status, log)")
    parser.add_argument(
        "--once",
        metavar="KEY",
        help="queue nothing if a job of yours with this key is already waiting or running "
        "(exit 9); for cron and make",
    )
    parser.add_argument(
        "--batch", metavar="NAME", help="group jobs; status shows the batch's progress as a line"
    )
    parser.add_argument(
        "--after",
        metavar="JOB",
        action="append",
        default=[],
        help="start only after these jobs ended (ids, names or batches; repeat or use commas)",
    )
    parser.add_argument(
        "--after-ok",
        metavar="JOB",
        action="append",
        default=[],
        help="start only after these jobs succeeded; if one fails, give up (exit 6)",
    )
    parser.add_argument(
        "--min-total-vram", metavar="SIZE", help="only GPUs with at least this much VRAM in all"
    )
    parser.add_argument(
        "--gpu-name", metavar="PATTERN", help="only GPUs whose name matches, e.g. A100 or '*H100*'"
    )
    parser.add_argument(
        "--min-compute-capability", metavar="X.Y", help="only GPUs of this CUDA capability or more"
    )
    parser.add_argument(
        "--max-util",
        metavar="PCT",
        help="only GPUs whose recent utilization (mean of several readings) is under PCT",
    )
    parser.add_argument(
        "--ledger",
        metavar="DIR",
        help="coordinate through the ledger in DIR (e.g. a shared one) (default: the ledger_dir "
        "setting, else the state dir)",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="say where and when the command starts"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def run(options: argparse.Namespace) -> int:
    """Validate the options, read the settings, and run the command as a job."""
    request, config = prepare(options)
    if request.freezable:
        from gpuwait.gpu.freezing import detect  # only --freezable looks for CUDA checkpointing

        refusal = detect(config.nvml_timeout, simulated=config.sim is not None).refusal()
        if refusal is not None:
            raise UsageError(refusal)
    console = Console(options.quiet, request.command[0] if request.from_hook else None)
    stray = _stray_vram(options)
    if stray is not None:
        program = printable(os.path.basename(request.command[0]), 100)
        # `--vram` last, `--vram=`, or another option after it (`--vram --epochs 3`): no
        # size typed, the word for one said.
        size = printable(stray, 100) if stray.strip() and stray[:1] != "-" else "SIZE"
        console.warn(
            f"--vram {size} after the command is {program}'s, not gpuwait's, "
            "which asks for the size learned from earlier runs, else default_vram: put it "
            f"before the command, `gpuwait --vram {size} {program} ...`, or "
            f"`--` before the command where it is {program}'s"
        )
    if (request.pausable or request.freezable) and request.gpus > 1:
        # Only one-GPU jobs are asked (room freed on one of a gang's cards serves nobody).
        way = "--pausable" if request.pausable else "--freezable"
        console.warn(
            f"a job on {request.gpus} GPUs is never asked to step aside: {way} changes "
            "nothing for it (docs/pausing.md)"
        )
    try:
        return session.run(request, config, console)
    except GpuwaitError as exc:
        if exc.exit_code == EXIT_NOT_FOUND and exc.hint is None:
            exc.hint = (
                _unit_apart_hint(options, request.command[0])
                or _option_after_dashes(list(request.command))
                or _subcommand_hint(request.command[0])
            )
        raise


#: A duration's unit as a word of its own (`--timeout 30 min`), and how a duration writes it.
_UNIT_WORDS = {
    **dict.fromkeys(("ms", "msec", "millisecond", "milliseconds"), "ms"),
    **dict.fromkeys(("s", "sec", "secs", "second", "seconds"), "s"),
    **dict.fromkeys(("m", "min", "mins", "minute", "minutes"), "m"),
    **dict.fromkeys(("h", "hr", "hrs", "hour", "hours"), "h"),
    **dict.fromkeys(("d", "day", "days"), "d"),
}


def _unit_apart_hint(options: argparse.Namespace, program: str) -> str | None:
    """For a program not found that is a duration's unit (`--timeout 30 min python x.py`):
    the option with its unit in the same word. A number alone is seconds, so the option took
    `30` and the unit became the command."""
    import re  # only once a program was not found

    unit = _UNIT_WORDS.get(program.lower())
    if unit is None:
        return None
    for option in ("--timeout", "--grace"):
        value = getattr(options, option[2:], None)
        if isinstance(value, str) and re.fullmatch(r"[0-9]+(\.[0-9]+)?", value.strip()):
            try:
                parse_duration(f"{value.strip()}{unit}")
            except ValueError as exc:  # past its bound: a line refused in turn is no hint
                return f"{option} takes its unit in the same word, and {exc}"
            return (
                f"did you mean {option} {value.strip()}{unit}? a duration takes its unit in "
                "the same word"
            )
    return None


def _stray_vram(options: argparse.Namespace) -> str | None:
    """The size of a `--vram` typed after the command (`gpuwait python train.py --vram 6G`),
    where gpuwait was given none and no `--` says the command's arguments begin there: most
    often meant for gpuwait, and the command gets it."""
    command: list[str] = list(options.command)
    if options.vram is not None or options.exclusive or getattr(options, "from_hook", False):
        return None
    if not command or command[0] == "--":
        return None
    for n, word in enumerate(command[1:], start=1):
        if word == "--vram":
            return command[n + 1] if n + 1 < len(command) else ""
        if word.startswith("--vram="):
            return word.removeprefix("--vram=")
    return None


def prepare(options: argparse.Namespace) -> tuple[RunRequest, RunConfig]:
    """The options as a typed request, and the settings (which some options override) as
    plain values; gpuwait.api reserves with the same options through here."""
    # Set to nothing (`--ledger "$LAB"` with $LAB empty), these would read as not set, over
    # the settings': another ledger than the one the config names, or no timeout at all.
    for option, value, hint in (
        ("--ledger", options.ledger, "give the ledger's directory, or leave the option out"),
        ("--timeout", options.timeout, "give a duration (30m), 0 (no wait) or none"),
    ):
        if value is not None and not value.strip():
            what = "names no directory" if option == "--ledger" else "is empty"
            raise UsageError(f"{option} {value!r} {what}", hint=hint)
    cli = {
        "timeout": options.timeout,
        "pick": options.pick,
        "priority": options.priority,
        "safety": options.safety,
        "ledger_dir": options.ledger,
        "enforce": options.enforce,
        "prefer": options.prefer,
    }
    return _request(options), _config(settings=load_settings(cli), cli=cli)


def _option_after_dashes(command: list[str]) -> str | None:
    """For a command that begins with one of gpuwait's options (`gpuwait -- --vram 6G python
    x.py`: after `--`, every word is the command's), or with a second `--`: the line to type."""
    from gpuwait.core.text import command_line  # only once a program was not found

    if command[0] == "--":
        # `gpuwait -- -- python x.py`: one `--` ends the options, the next is the command.
        rest = command[1:] or ["COMMAND"]
        return f"-- is typed twice, the second taken for the command: gpuwait ... -- {command_line(rest)}"
    name, equals, _ = command[0].partition("=")
    action = next((a for a in build_parser().options if name in a.option_strings), None)
    if action is None or not name.startswith("-"):
        return None
    moved = [name] if action.nargs == 0 else command[:1] if equals else command[:2]
    if action.nargs != 0 and not _valid_options([*moved, "--", "true"]):
        # Its value missing or malformed (`gpuwait -- --vram python x.py`): its placeholder,
        # not the command's first word, which the line would refuse in turn.
        moved = [name, action.metavar if isinstance(action.metavar, str) else "VALUE"]
        rest = command[1:] or ["COMMAND"]
    else:
        rest = command[len(moved) :] or ["COMMAND"]
    return (
        f"{printable(name, 100)} is gpuwait's option, after the -- that ends them: "
        f"gpuwait ... {command_line(moved)} -- {command_line(rest)}"
    )


def _valid_options(argv: list[str]) -> bool:
    """Whether the command line `argv` is one the parser and `_request` take."""
    try:
        _request(build_parser().parse_args(argv))
    except (GpuwaitError, SystemExit):
        return False
    return True


def _subcommand_hint(program: str) -> str | None:
    """For a program not found that looks like a subcommand: the subcommand it likely meant.
    What runs stays what was typed (a program may be named like a subcommand)."""
    if program in SUBCOMMANDS:
        # `gpuwait --vram 4G log`: after an option, every word is the command's.
        return f"`{program}` is a subcommand: `gpuwait {program} ...` runs it (before any option)"
    if "/" in program:
        return None
    # `—vram`: an option pasted from a page or a chat that made its `--` one long dash (an
    # em or en dash, a minus sign), and so taken for the command.
    dashed = program.lstrip("\u2014\u2013\u2212")
    if dashed != program and dashed:
        option = "--" + dashed.split("=", 1)[0]
        if any(option in action.option_strings for action in build_parser().options):
            return (
                f"did you mean {option}? ({program[0]} is a long dash, as an editor or a chat "
                "writes --)"
            )
    from gpuwait.core.text import nearest  # only once a program was not found

    match = (
        _OTHER_WORDS.get(program.lower())
        or nearest(program, SUBCOMMANDS, cutoff=0.75)
        # `lgo`: two letters swapped, which leaves a short word too far from `log` in letters.
        or next((sub for sub in SUBCOMMANDS if sorted(sub) == sorted(program.lower())), None)
    )
    return None if match is None else f"did you mean `gpuwait {match}`?"


#: What other queues call their subcommands (`why` a job waits, `stop` it), and `help` and
#: `version` as git and pip take them: gpuwait's word.
_OTHER_WORDS = {
    **dict.fromkeys(("why", "queue", "list", "jobs", "show", "info", "ps", "top"), "status"),
    **dict.fromkeys(("stop", "remove", "delete", "del", "abort", "dequeue"), "cancel"),
    "help": "--help",
    "version": "--version",
}


def _request(options: argparse.Namespace) -> RunRequest:
    """The options as a typed request; raises UsageError for anything malformed."""
    command = list(options.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("no command given; usage: gpuwait [OPTIONS] [--] COMMAND [ARGS...]")
    if options.key is not None and not options.key.strip():
        raise UsageError("--key needs a non-empty name")
    if options.key is not None and not one_line(options.key):
        # Read from a file with its line end, say: learned apart, shown as `train?`.
        raise UsageError(
            f"--key {options.key!r}: a key is one line of text, without control characters"
        )
    if options.freezable and options.pausable:
        # Two answers to one request to step aside: a job is asked once, and does one thing.
        raise UsageError(
            "--freezable and --pausable are two ways to step aside; give one (see docs/freezing.md)"
        )
    vram: MemoryRequest | None = None
    if options.exclusive and options.vram is not None:
        raise UsageError("--exclusive takes whole GPUs; leave out --vram")
    if options.vram is not None:
        if options.vram.strip().lower() == "exclusive":
            # What default_vram takes for a whole GPU; the option for one is its own.
            raise UsageError(f"--vram {options.vram!r} is no size: a whole GPU is --exclusive")
        try:
            vram = parse_request(options.vram)
        except ValueError as exc:
            raise UsageError(f"--vram {exc}", hint=_unit_apart(options.vram, command)) from None
    requirements = _requirements(options)
    for option, value in (
        ("--name", options.name),
        ("--batch", options.batch),
        ("--once", options.once),
    ):
        check_name(option, value)
    return RunRequest(
        command=tuple(command),
        vram=vram,
        exclusive=options.exclusive,
        key=options.key,
        retry_oom=options.retry_oom,
        gpus=options.gpus,
        devices=options.devices,
        requirements=requirements,
        name=options.name,
        batch=options.batch,
        after=_references("--after", options.after),
        after_ok=_references("--after-ok", options.after_ok),
        pausable=_pausable(options),
        freezable=options.freezable,
        verbose=options.verbose and not options.quiet,
        once=options.once,
        from_hook=getattr(options, "from_hook", False),
    )


def _unit_apart(size: str, command: list[str]) -> str | None:
    """For `--vram 6 GB python x.py`, whose unit was taken for the command: the size with its
    unit in the same word, where that is one."""
    joined = size.strip() + command[0]
    if not size.strip() or not command[0].strip() or any(c.isdigit() for c in command[0]):
        return None  # `--vram 6 6G`: a number of its own, no unit
    try:
        parse_request(joined)
    except ValueError:
        return None
    return f"did you mean --vram {printable(joined, 100)}? a size takes its unit in the same word"


def _pausable(options: argparse.Namespace) -> Pausable | None:
    given = [
        option
        for option, value in (
            ("--checkpoint-signal", options.checkpoint_signal),
            ("--grace", options.grace),
            ("--grace-kill", options.grace_kill or None),
        )
        if value is not None
    ]
    if not options.pausable:
        if given:
            raise UsageError(f"{given[0]} applies to --pausable jobs only; add --pausable")
        return None
    from gpuwait.linux.checkpoint_signal import parse_signal, signal_name  # only --pausable
    from gpuwait.linux.signals import FORWARDED

    # An empty one (`--checkpoint-signal "$SIG"`, $SIG unset) is refused, as an empty --timeout.
    asked: str | None = options.checkpoint_signal
    typed = DEFAULT_CHECKPOINT_SIGNAL if asked is None else asked
    try:
        number = parse_signal(typed)
    except ValueError as exc:
        raise UsageError(f"--checkpoint-signal {exc}") from None
    if number not in FORWARDED:
        # Sent to gpuwait (Slurm's --signal=B:SIG@N before a time limit), it would never reach
        # the job, or (SIGIO, gpuwait's own wake-up) would end gpuwait and leave it unwatched.
        raise UsageError(
            f"--checkpoint-signal {typed!r} is not a signal gpuwait passes on to its "
            "command; use e.g. USR1, USR2, TERM"
        )
    grace = DEFAULT_GRACE_SECONDS
    if options.grace is not None:
        try:
            grace = parse_duration(options.grace)
        except ValueError as exc:
            raise UsageError(f"--grace {exc}") from None
    # By its name (USR2 for 12, ' usr2', SIGUSR2), as GPUWAIT_CHECKPOINT_SIGNAL tells it.
    return Pausable(signal_name(number), grace, options.grace_kill)


def _requirements(options: argparse.Namespace) -> dict[str, Any]:
    """The capability options as a ledger entry stores them. Raises UsageError."""
    wanted: dict[str, Any] = {}
    if options.min_total_vram is not None:
        try:
            wanted["min_total_bytes"] = parse_size(options.min_total_vram)
        except ValueError as exc:
            raise UsageError(f"--min-total-vram {exc}") from None
    if options.gpu_name is not None:
        if not options.gpu_name.strip():
            raise UsageError("--gpu-name needs a pattern, e.g. A100 or '*H100*'")
        wanted["name_pattern"] = options.gpu_name.strip()
    capability = options.min_compute_capability
    if capability is not None:
        match = re.fullmatch(r"\s*([0-9]{1,2})(?:\.([0-9]{1,2}))?\s*", capability)
        if match is None:
            raise UsageError(f"--min-compute-capability {capability!r}: use MAJOR.MINOR, e.g. 8.0")
        wanted["min_compute_capability"] = [int(match.group(1)), int(match.group(2) or 0)]
    if options.max_util is not None:
        try:
            percent = parse_decimal(options.max_util.strip().removesuffix("%"))
        except ValueError:
            percent = -1.0
        if not 0 < percent <= 100:
            raise UsageError(
                f"--max-util {options.max_util!r}: give a percentage above 0 and at most 100, e.g. 30"
            )
        wanted["max_util_pct"] = percent
    return wanted


def _references(option: str, values: list[str]) -> tuple[str, ...]:
    """The jobs `--after`/`--after-ok` name. Raises UsageError for a value that names none
    (`--after-ok "$PREV"` with $PREV empty): the job would start as if it depended on nothing."""
    refs: list[str] = []
    for value in values:
        named = [ref.strip() for ref in value.split(",") if ref.strip()]
        if not named:
            raise UsageError(
                f"{option} {value!r} names no job",
                hint="give a job's id, name or batch, or leave the option out where the job "
                "depends on none (docs/queue-and-status.md)",
            )
        refs += named
    return tuple(refs)


def _config(settings: Settings, cli: Mapping[str, Any]) -> RunConfig:
    weights: Mapping[str, float] = settings.gpu_weights
    return RunConfig(
        state_dir=settings.state_path,
        ledger_dir=settings.ledger_path,
        ledger_must_exist=settings.ledger_dir is not None,
        lock_timeout=settings.lock_timeout,
        sim=settings.sim,
        nvml_timeout=settings.nvml_timeout,
        on_no_gpu=settings.on_no_gpu,
        on_state_error=settings.on_state_error,
        default_vram=settings.default_vram,
        estimate_margin=settings.estimate_margin,
        history_commands=settings.history_commands,
        history_max_size=settings.history_max_size,
        pick=settings.pick,
        priority=settings.priority,
        timeout=settings.timeout,
        gpu_weights=weights,
        prefer=settings.prefer,
        wait=WaitPolicy(
            safety=settings.safety,
            poll_interval=settings.poll_interval,
            nvml_interval=settings.nvml_interval,
            ignore_processes=frozenset(settings.ignore_processes),
            use_inotify=settings.wake == "inotify",
            fair=settings.fair_share(),
            current_fair=current_fair_share(cli, settings),
            pause_rules=PauseRules(
                min_runtime=settings.pause_min_runtime,
                max_pauses=settings.pause_max,
                grace_max=settings.pause_grace_max,
            ),
            gpu_error_timeout=settings.gpu_error_timeout,
            idle=_idle_watch(settings),
        ),
        sample_interval=settings.sample_interval,
        resume_exit=settings.resume_exit,
        watch_stderr=settings.watch_stderr != "off",
        enforce=settings.enforce,
        visible_by_index=settings.visible_devices == "index",
    )


def _idle_watch(settings: Settings) -> IdleWatch | None:
    """What a waiter needs to ask the user's idle jobs to step aside (`idle_action = pause`)."""
    if settings.idle_action != "pause":
        return None
    from gpuwait.commands.status import idle_rule
    from gpuwait.queue.idle import IdleWatch

    return IdleWatch(rule=idle_rule(settings), state_dir=settings.machine_path)
