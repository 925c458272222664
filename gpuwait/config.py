"""Settings and where each one came from: `Settings` has one typed attribute per setting, and
each option (`OPTIONS`) knows how to read its value and how to show it.

Precedence is one pure function, `resolve`: command line > GPUWAIT_* environment > config.toml in
the user config dir > config.toml in the site config dir (an administrator's, e.g.
/etc/xdg/gpuwait/config.toml) > built-in default. Settings marked `site_only` (per-user limits,
fairness) come from the site file or the default only: a user cannot lift their own limits.
`gpuwait config` shows the result with its sources.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import stat
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gpuwait.core.budget import DEFAULT_ENFORCE, ENFORCE_MODES
from gpuwait.core.errors import DEFAULT_GPU_ERROR_TIMEOUT, GpuwaitError, StateError, UsageError
from gpuwait.core.estimate import DEFAULT_HISTORY_MAX_BYTES, DEFAULT_MARGIN
from gpuwait.core.pausing import (
    DEFAULT_GRACE_MAX,
    DEFAULT_MAX_PAUSES,
    DEFAULT_MIN_RUNTIME,
    DEFAULT_RESUME_EXIT,
)
from gpuwait.core.policy import PICK_STRATEGIES, FairShare, Lookahead, UserLimits
from gpuwait.core.record import Record, field
from gpuwait.core.sizes import (
    MemoryRequest,
    check_duration,
    format_setting_duration,
    format_size,
    parse_decimal,
    parse_duration,
    parse_request,
    parse_size,
    parse_whole,
)
from gpuwait.core.text import one_line, shell_word, whole_number
from gpuwait.linux import dirs, netfs
from gpuwait.linux.atomic import write_atomic
from gpuwait.linux.security import (
    UnsafePath,
    ensure_private_dir,
    mine,
    open_readable,
    read_capped,
    read_state_file,
    taken_over_hint,
)
from gpuwait.linux.stamp import file_stamp, may_change_unseen

EXCLUSIVE = "exclusive"


def _number(value: Any) -> float:
    """A number: a TOML integer or float, or text in the digits 0-9 (never '٣' or '１e3')."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError("expected a number such as 0.5 or 30")
    if isinstance(value, str):
        return parse_decimal(value)
    return float(value) if abs(value) < 2**63 else math.copysign(math.inf, value)


def _whole(value: Any, low: int, high: int) -> int:
    """A whole number from `low` to `high`: a TOML integer, or text in the digits 0-9."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"expected a whole number from {low} to {high}")
    return parse_whole(str(value), low, high)


#: The share of each GPU's memory gpuwait fills at most, unless told otherwise.
DEFAULT_SAFETY = 0.9


def _fraction(value: Any) -> float:
    try:
        number = _number(value)
    except ValueError:
        number = math.nan
    if not 0 < number <= 1:
        raise ValueError("expected a fraction above 0 and at most 1, e.g. 0.9")
    return number


def _duration(value: Any) -> float:
    """Seconds in a duration as typed (`90s`, `1h30m`) or a TOML number (seconds)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return check_duration(_number(value), str(value))
    return parse_duration(str(value))


def _positive_duration(value: Any) -> float:
    seconds = _duration(value)
    # At least a millisecond: shorter, a sampling or polling interval is a busy loop, and no
    # setting means anything shorter.
    if not seconds >= 0.001:
        raise ValueError("expected a duration of at least 1ms, e.g. 1s or 250ms")
    return seconds


def _optional_duration(value: Any) -> float | None:
    """A duration, or none: no such limit. A zero, however written (`0`, `"0s"`, `"0m"`), is
    none too, as configs have long written it: no such limit can be zero."""
    # `timeout = false` is refused, not read as 0 ("none"): TOML's booleans are Python's ints.
    if isinstance(value, bool):
        raise ValueError('expected a duration such as 30m, or "none"')
    if value in (None, "", "none") or _duration(value) == 0:
        return None
    return _positive_duration(value)


def _wait_timeout(value: Any) -> float | None:
    """`timeout`: none (or empty) waits as long as it takes; zero does not wait at all (the
    command starts if it fits at once, else exit 124), as `flock -w 0` does."""
    if isinstance(value, bool):
        raise ValueError('expected a duration such as 30m, 0 (no wait) or "none"')
    if value in (None, "", "none"):
        return None
    if value in ("0", 0):
        return 0.0
    seconds = _duration(value)
    if not seconds >= 0:
        raise ValueError('expected a duration such as 30m, 0 (no wait) or "none"')
    return seconds


def _wait_factor(value: Any) -> float:
    try:
        number = _number(value)
    except ValueError:
        number = math.nan
    if not 1 <= number <= 1000:
        raise ValueError("expected a factor from 1 to 1000, e.g. 5")
    return number


def _exit_status(value: Any) -> int:
    try:
        return _whole(value, 1, 125)
    except ValueError:
        raise ValueError("expected an exit status from 1 to 125, e.g. 75") from None


def _pause_count(value: Any) -> int:
    try:
        return _whole(value, 0, 1000)
    except ValueError:
        raise ValueError("expected a number of pauses from 0 to 1000") from None


def _choice(*choices: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        text = str(value).strip().lower()
        if text not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return text

    return parse


def _priority(value: Any) -> int:
    number = None if isinstance(value, (bool, float)) else whole_number(str(value).strip())
    if number is None or not 1 <= number <= 5:
        raise ValueError("expected a priority from 1 (low) to 5 (urgent)")
    return number


def _default_vram(value: Any) -> MemoryRequest | None:
    text = str(value).strip()
    if text.lower() == EXCLUSIVE:
        return None
    return parse_request(text)


def _names(value: Any) -> tuple[str, ...]:
    """A list of process names: a TOML array, or a comma-separated string ("" for none)."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise ValueError("expected process names: a list of strings, or comma-separated text")
    names = tuple(item.strip() for item in items if item.strip())
    if any(len(n) > 15 for n in names):
        raise ValueError("process names are at most 15 characters (as in /proc/PID/comm)")
    return names


def _weights(value: Any) -> dict[str, float]:
    """GPU -> weight: a TOML table, or "0=2,GPU-8932=1"; keys are NVML indices or UUIDs."""
    if isinstance(value, dict):
        pairs = [(str(k), v) for k, v in value.items()]
    else:
        pairs = []
        for part in str(value).split(","):
            if not part.strip():
                continue
            key, sep, weight = part.partition("=")
            if not sep:
                raise ValueError("expected GPU=WEIGHT pairs, e.g. 0=2,1=1")
            pairs.append((key.strip(), weight.strip()))
    weights: dict[str, float] = {}
    for key, weight in pairs:
        if not ((key.isascii() and key.isdigit()) or key.upper().startswith(("GPU-", "MIG-"))):
            raise ValueError(f"{key!r} is not a GPU index or UUID")
        number = _number(weight)
        if not 0 < number < 1e6:
            raise ValueError(f"weight of {key!r} must be above zero and below 1000000")
        weights[key] = number
    return weights


def _string_list(value: Any) -> tuple[str, ...]:
    """A TOML array of strings, or (from the environment) one string of comma-separated items."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
        raise ValueError("expected a list of strings, or comma-separated text")
    return tuple(i.strip() for i in items if i.strip())


def _gpu_names(value: Any) -> tuple[str, ...]:
    """GPUs by NVML index or UUID: a TOML array (of numbers or strings), or "2,3"."""
    if isinstance(value, list):
        value = [str(v) if isinstance(v, int) and not isinstance(v, bool) else v for v in value]
    names = _string_list(value)
    for name in names:
        if not ((name.isascii() and name.isdigit()) or name.upper().startswith(("GPU-", "MIG-"))):
            raise ValueError(f"{name!r} is not a GPU index or UUID")
    return names


#: Names a shell hook must never redefine: its own machinery relies on them, and the builtins
#: its functions call (shell/: bash's, zsh's and fish's), which wrapped would make the hook
#: call itself without end (bash dies of it).
_UNWRAPPABLE = frozenset(
    {"command", "builtin", "exec", "eval", "source", "test", "gpuwait"}
    | {"local", "read", "printf", "hash", "return", "shopt", "emulate", "zmodload"}
    | {"set", "string", "count", "functions", "status"}
)


def _command_names(value: Any) -> tuple[str, ...]:
    names = _string_list(value)
    for name in names:
        # These become shell function names: nothing a shell would read as syntax.
        if name.startswith("-") or not all(c.isalnum() or c in "._+-" for c in name):
            raise ValueError(f"{name!r} is not a plain command name")
        if name in _UNWRAPPABLE:
            raise ValueError(f"{name!r} cannot be wrapped")
    return names


def _share(value: Any, high: float, example: str) -> float:
    """A share of a whole, 0 to `high` (1 is all of it), written alike for every setting that
    takes one: `10%` or `0.1` (text or a TOML number)."""
    text = str(value).strip() if isinstance(value, str) else value
    is_percent = isinstance(text, str) and text.endswith("%")
    try:
        number = _number(text[:-1]) / 100 if is_percent else _number(text)
    except ValueError:
        number = math.nan
    if not 0 <= number <= high:
        expected = (
            f"expected a fraction from 0 to {high:g} or a percent up to {100 * high:g}%, "
            f"e.g. {example}"
        )
        if not is_percent and high < number <= 100 * high:
            # `5` for five percent: a number without % is a fraction of the whole.
            raise ValueError(f"{expected}; write {number:g}% for a percent")
        raise ValueError(expected)
    return number


def _margin(value: Any) -> float:
    return _share(value, 2, "0.1 or 10%")


def _size_limit(value: Any) -> int:
    # A TOML integer is a number without a unit, refused like "64" typed anywhere else.
    size = parse_size(str(value))
    if size < 2**20:
        raise ValueError("expected a size of at least 1MiB, e.g. 64MiB")
    return size


def _percent(value: Any) -> float:
    """A utilization in percent, 0 to 100: `5%`, or `5` as nvidia-smi and `--max-util` write
    it. A number without %, however small, is a percent, as every release has read it
    (`0.5`: half a percent; `gpuwait config` shows it as `0.5%`): refused, a config that has
    worked would stop every launch."""
    text = str(value).strip() if isinstance(value, str) else value
    expected = "expected a percent from 0 to 100, e.g. 5%"
    if isinstance(text, str) and text.endswith("%"):
        # Refused in its own words: a share's offer of "a fraction from 0 to 1" would have a
        # user write 0.05 for 5%, which reads as a twentieth of a percent here.
        try:
            return 100 * _share(text, 1, "5%")
        except ValueError:
            raise ValueError(expected) from None
    try:
        number = _number(text)
    except ValueError:
        number = math.nan
    if not 0 <= number <= 100:
        raise ValueError(expected)
    return number


def _home_expanded(text: str, example: str) -> str:
    """`text` with its leading `~` or `~user` made the home directory it names; ValueError
    where that home is not known (a user's name mistyped, or no home to be had), or where it
    holds a NUL (TOML writes one as \\u0000), which every look at the path would raise for."""
    if "\0" in text:
        raise ValueError("a path holds no NUL character")
    expanded = os.path.expanduser(text)
    if expanded.startswith("~"):
        home = expanded.split("/", 1)[0]
        raise ValueError(
            f"the home directory {home if one_line(home) else '~user'} is not known here; "
            f"expected an absolute path such as {example}"
        )
    return expanded


def _sim_file(value: Any) -> Path | None:
    """The simulation file: absolute, or under `~`, as `state_dir`. A relative one would be
    another file in every working directory: a job started beside it and `gpuwait status` run
    elsewhere would see two machines, or none."""
    if not isinstance(value, str):
        raise ValueError('expected a path in quotes, e.g. "~/gpuwait-sim.toml"')
    text = _home_expanded(value.strip(), "~/gpuwait-sim.toml")
    if not text:
        return None
    if not os.path.isabs(text):
        # The examples are made of the name given where it is one line (it is quoted already).
        name = text if one_line(text) else "gpuwait-sim.toml"
        raise ValueError(
            f"expected an absolute path such as {shell_word(os.path.abspath(name))} or "
            f"~/{shell_word(os.path.basename(name) or 'gpuwait-sim.toml')} (a relative one is "
            "another file in every working directory, and jobs would not see each other's GPUs)"
        )
    return Path(os.path.abspath(text))


def _absolute_dir(value: Any) -> Path | None:
    """A directory every gpuwait process must find the same: absolute, or under `~`.

    A relative one would name another directory in every working directory, and jobs started
    from two of them would not see each other: coordination would silently stop."""
    if not isinstance(value, str):
        raise ValueError('expected a path in quotes, e.g. "/srv/gpuwait"')
    text = _home_expanded(value.strip(), "/srv/gpuwait or ~/gpuwait")
    if not text:
        return None
    if not os.path.isabs(text):
        raise ValueError(
            "expected an absolute path such as /srv/gpuwait or ~/gpuwait (a relative one is "
            "another directory in every working directory, and jobs would not see each other)"
        )
    path = os.path.abspath(text)
    _not_a_directory_of_others(path)
    return Path(path)


def _not_a_directory_of_others(path: str) -> None:
    """Raise ValueError where `path` (absolute) is plainly no directory of gpuwait's: the root
    directory or the home directory itself, whose files it would lie loose among, or one of
    the kernel's (/proc, /sys), where no file is kept."""
    own = "give one of its own, such as /srv/gpuwait or ~/gpuwait"
    home = dirs.home_or_none()
    if not path.strip("/"):
        raise ValueError(f"the root directory is no directory of gpuwait's; {own}")
    if home is not None and os.path.abspath(home) == path:
        raise ValueError(f"your home directory is no directory of gpuwait's; {own}")
    top = path.strip("/").split("/", 1)[0]
    if top in ("proc", "sys"):
        raise ValueError(f"/{top} is the kernel's, where no file is kept; {own}")


def _count_limit(value: Any) -> int | None:
    """A per-user count limit; 0 or "none" means no limit."""
    if isinstance(value, bool):
        raise ValueError("expected a whole number of GPUs, or 0 / none for no limit")
    if value in (None, "", "none", 0, "0"):
        return None
    number = whole_number(str(value).strip())
    if number is None:
        raise ValueError("expected a whole number of GPUs, or 0 / none for no limit")
    if number > 1024:
        raise ValueError("expected at most 1024 GPUs")
    # A zero however written ("00", " 0 ") is none too: a limit of no GPU would refuse every job.
    return number or None


def _vram_limit(value: Any) -> int | None:
    """A per-user VRAM limit; 0 or "none" means no limit."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 48G, or none")
    if value in (None, "", "none", 0, "0"):
        return None
    number = parse_size(str(value))
    if number <= 0:
        raise ValueError("expected a size above zero, or none")
    return number


# --- how each setting is shown, as a user would type it -----------------------------------------


def _show_plain(value: Any) -> str:
    return "none" if value is None else str(value)


def _show_request(value: MemoryRequest | None) -> str:
    return EXCLUSIVE if value is None else value.describe()


def _show_joined(value: tuple[str, ...]) -> str:
    return ",".join(value) if value else "(none)"


def _show_list(value: tuple[str, ...]) -> str:
    return ", ".join(value) if value else "(none)"


def _show_weights(value: dict[str, float]) -> str:
    return ",".join(f"{k}={v:g}" for k, v in value.items()) if value else "(none)"


def _show_size(value: int | None) -> str:
    return "none" if value is None else format_size(value)


def _show_util(value: float) -> str:
    return f"{value:g}%"


def _show_percent(value: float) -> str:
    return f"{value * 100:g}%"


def _show_path(value: Path | None) -> str:
    return "(not set)" if value is None else str(value)


def _data(value: Any) -> Any:
    """A setting's value as JSON data (`config --json`): numbers as numbers (sizes in bytes,
    durations in seconds), lists as lists, a path as text, none as null."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (tuple, list)):
        return [_data(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _data(item) for key, item in value.items()}
    return value


def _request_data(value: MemoryRequest | None) -> dict[str, float | int]:
    """A request as a job's `request` in `status --json`: {} is a whole GPU (exclusive)."""
    return {} if value is None else value.to_json()


class Option(Record, frozen=True):
    """One setting: its name, how to read it, its default and what it means."""

    name: str
    parse: Callable[[Any], Any]
    default: Any
    help: str
    #: The value as a user would type it (`gpuwait config`, --help).
    show: Callable[[Any], str] = _show_plain
    #: The value as JSON data, for scripts (`config --json`).
    data: Callable[[Any], Any] = _data
    #: Read from the site config file only (an administrator's policy), never from the user.
    site_only: bool = False

    @property
    def env_var(self) -> str:
        return "GPUWAIT_" + self.name.upper()


OPTIONS: tuple[Option, ...] = (
    Option(
        "safety",
        _fraction,
        DEFAULT_SAFETY,
        "fraction of each GPU's total VRAM that gpuwait fills at most",
    ),
    Option(
        "pick", _choice(*PICK_STRATEGIES), "best-fit", "how a GPU is chosen among those that fit"
    ),
    Option("priority", _priority, 3, "queue priority of a job, 1 (low) to 5 (urgent)"),
    Option(
        "default_vram",
        _default_vram,
        EXCLUSIVE,
        "request when --vram is not given: a size, a percentage, or 'exclusive' (a whole GPU)",
        show=_show_request,
        data=_request_data,
    ),
    Option(
        "timeout",
        _wait_timeout,
        None,
        "longest wait before giving up (none: wait as long as it takes; 0: start only if it "
        "fits at once)",
        show=format_setting_duration,
    ),
    Option(
        "on_no_gpu",
        _choice("run", "fail"),
        "run",
        "without NVML (and, for the shell hook, with every GPU in MIG mode): 'run' the "
        "command at once with a warning, or 'fail'",
    ),
    Option(
        "sample_interval",
        _positive_duration,
        1.0,
        "how often a running job's VRAM is sampled",
        show=format_setting_duration,
    ),
    Option(
        "resume_exit",
        _exit_status,
        DEFAULT_RESUME_EXIT,
        "exit status by which a --pausable job says 'checkpointed, resume me'",
    ),
    Option(
        "pause_min_runtime",
        _positive_duration,
        DEFAULT_MIN_RUNTIME,
        "a --pausable job is not asked to step aside before it has run this long",
        show=format_setting_duration,
    ),
    Option(
        "pause_max",
        _pause_count,
        DEFAULT_MAX_PAUSES,
        "a --pausable job is asked to step aside at most this often (a --freezable one frozen)",
    ),
    Option(
        "pause_grace_max",
        _positive_duration,
        DEFAULT_GRACE_MAX,
        "site config only: a waiter waits at most this long for one job it asked to step aside "
        "(whatever that job's --grace) before asking others",
        show=format_setting_duration,
        # It cuts other users' jobs' grace short: a waiter's own 1s would have every job it
        # asked step aside, a second apart, for one need.
        site_only=True,
    ),
    Option(
        "wake",
        _choice("inotify", "poll"),
        "inotify",
        "how waiters notice the queue changing: inotify (signalled by the writer; inotify in a "
        "shared ledger dir), or poll every poll_interval",
    ),
    Option(
        "poll_interval",
        _positive_duration,
        0.01,
        "how often a waiter checks the queue for a change when wake = poll",
        show=format_setting_duration,
    ),
    Option(
        "nvml_interval",
        _positive_duration,
        1.0,
        "how often a waiter re-reads the GPUs when the ledger did not change",
        show=format_setting_duration,
    ),
    Option(
        "ignore_processes",
        _names,
        "Xorg,Xwayland,gnome-shell,kwin_x11,kwin_wayland,plasmashell",
        "process names that never count as load on a GPU (desktops, display servers)",
        show=_show_joined,
    ),
    Option(
        "gpu_weights",
        _weights,
        "",
        "per-GPU weights for --pick weighted, e.g. 0=2,1=1 (GPU index or UUID; a GPU not named "
        "weighs 1)",
        show=_show_weights,
    ),
    Option(
        "prefer",
        _gpu_names,
        "",
        "GPUs taken first where a job fits, e.g. 2,3 (NVML indices or UUIDs); others only where "
        "none of them fits",
        show=_show_joined,
    ),
    Option(
        "sim",
        _sim_file,
        "",
        "simulation file: use simulated GPUs instead of NVML (see `gpuwait sim init`)",
        show=_show_path,
    ),
    Option(
        "state_dir",
        _absolute_dir,
        "",
        "where the ledger and history live (default: the user state dir)",
        show=_show_path,
    ),
    Option(
        "wrap_commands",
        _command_names,
        ("python", "python3", "torchrun", "accelerate", "deepspeed"),
        "commands that `gpuwait shell-init` wraps in gpuwait",
        show=_show_list,
    ),
    Option(
        "wrap_only_in",
        _string_list,
        (),
        "shell hooks wrap only in these directories (globs) and below; empty: everywhere",
        show=_show_list,
    ),
    Option(
        "never_wrap",
        _string_list,
        (
            "* --help",
            "* -h",
            "* --version",
            "* -V",
            "* -VV",
            # accelerate's setup and report: no GPU to wait for (`accelerate launch` has one).
            "accelerate config",
            "accelerate config *",
            "accelerate env",
            "accelerate env *",
            "* -m pip",
            "* -m pip *",
            "* -m venv",
            "* -m venv *",
        ),
        "shell hooks run command lines matching these globs bare",
        show=_show_list,
    ),
    Option(
        "estimate_margin",
        _margin,
        DEFAULT_MARGIN,
        "added on top of a VRAM estimate learned from earlier runs (0.1 = 10%)",
        show=_show_percent,
    ),
    Option(
        "history_commands",
        _choice("full", "hash"),
        "full",
        "what the history keeps of a command: the 'full' line, or only a 'hash' of it",
    ),
    Option(
        "history_max_size",
        _size_limit,
        f"{DEFAULT_HISTORY_MAX_BYTES >> 20}MiB",
        "size at which the history is compacted (what estimates use is kept)",
        show=_show_size,
    ),
    Option(
        "enforce",
        _choice(*ENFORCE_MODES),
        DEFAULT_ENFORCE,
        "how a job is kept inside its reservation: 'off', 'hint' (tell JAX and TensorFlow), or "
        "'limit' (also enforce it: cgroup dmem, CUDA MPS, PyTorch's allocator cap)",
    ),
    Option(
        "visible_devices",
        _choice("uuid", "index"),
        "uuid",
        "how a command's CUDA_VISIBLE_DEVICES names its GPUs: 'uuid', or NVML 'index' for "
        "programs that read it as numbers (docs/usage.md)",
    ),
    Option(
        "watch_stderr",
        _choice("auto", "off"),
        "auto",
        "look for out-of-memory messages on a command's stderr when it is a file or pipe",
    ),
    Option(
        "ledger_dir",
        _absolute_dir,
        "",
        "directory of the ledger; a shared one (group-writable, sticky) coordinates several "
        "users (default: the state dir)",
        show=_show_path,
    ),
    Option(
        "on_state_error",
        _choice("fail", "run"),
        "fail",
        "when the ledger cannot be used: 'fail' (exit 5), or 'run' the command uncoordinated",
    ),
    Option(
        "nvml_timeout",
        _positive_duration,
        5.0,
        "longest wait for one NVML reading; a GPU that does not answer is left out",
        show=format_setting_duration,
    ),
    Option(
        "gpu_error_timeout",
        _positive_duration,
        DEFAULT_GPU_ERROR_TIMEOUT,
        "how long GPU readings may keep failing before a waiter gives up (exit 4); shorter "
        "failures are retried",
        show=format_setting_duration,
    ),
    Option(
        "lock_timeout",
        _positive_duration,
        60.0,
        "longest wait for the ledger lock before giving up (exit 5)",
        show=format_setting_duration,
    ),
    Option(
        "idle_min_vram",
        _size_limit,
        "1G",
        "a process holding at least this much on a quiet GPU can be named idle "
        "(`gpuwait idle`, `status`)",
        show=_show_size,
    ),
    Option(
        "idle_max_util",
        _percent,
        "5%",
        "a GPU under this utilization at every reading is quiet: `5%` or `5`",
        show=_show_util,
    ),
    Option(
        "idle_after",
        _positive_duration,
        3600.0,
        "a process is named idle once it has held memory on a quiet GPU this long",
        show=format_setting_duration,
    ),
    Option(
        "idle_action",
        _choice("none", "pause"),
        "none",
        "what is done to your own idle `--pausable` jobs while others wait for room: 'none', or "
        "'pause' (asked to step aside whatever their priority)",
    ),
    Option(
        "user_max_gpus",
        _count_limit,
        None,
        "site config only: GPUs one user may hold at once (none: no limit)",
        site_only=True,
    ),
    Option(
        "user_max_vram",
        _vram_limit,
        None,
        "site config only: VRAM one user may hold at once, over all GPUs (none: no limit)",
        show=_show_size,
        site_only=True,
    ),
    Option(
        "fair_share_half_life",
        _optional_duration,
        86400.0,
        "site config only: how fast past VRAM-time stops counting against a user "
        "(none or 0: no fair share, first come first served)",
        show=format_setting_duration,
        site_only=True,
    ),
    Option(
        "queue_order",
        _choice("fifo", "lookahead"),
        "lookahead",
        "'lookahead': start what a plan of the whole queue in time starts now (urgent jobs "
        "first, no job waits past its budget); 'fifo': priority, then submission, with holds "
        "and backfill",
    ),
    Option(
        "max_wait_factor",
        _wait_factor,
        Lookahead.max_wait_factor,
        "lookahead: a job waits at most this many times what strict order would take to run it "
        "(its wait there plus its run time) before it goes first",
    ),
    Option(
        "max_wait",
        _optional_duration,
        None,
        "lookahead: and at most this long (none or 0: no absolute cap)",
        show=format_setting_duration,
    ),
    Option(
        "plan_budget",
        _positive_duration,
        Lookahead.budget_ms / 1000,
        "lookahead: the longest a plan's search may take",
        show=format_setting_duration,
    ),
)

OPTIONS_BY_NAME = {o.name: o for o in OPTIONS}

#: GPUWAIT_* variables a user may set besides the settings' own.
_USER_VARIABLES = ("GPUWAIT_CONFIG", "GPUWAIT_DISABLE")
#: GPUWAIT_* variables that are no setting and still belong here: gpuwait exports them to the
#: commands it runs (a gpuwait started inside a job, or its shell hook, inherits them), and the
#: contrib scripts read theirs. A test checks that every GPUWAIT_ name in the package and in
#: contrib is a setting's or listed here.
_OTHER_VARIABLES = frozenset(
    {
        "GPUWAIT_JOB_ID",
        "GPUWAIT_JOB_PID",
        "GPUWAIT_JOB_START",
        "GPUWAIT_GPU_UUIDS",
        "GPUWAIT_GPU_INDICES",
        "GPUWAIT_VRAM_BYTES",
        "GPUWAIT_VRAM_FRACTION",
        "GPUWAIT_TORCH_MEMORY_FRACTION",
        "GPUWAIT_TORCH_MEMORY_BYTES",
        "GPUWAIT_PAUSABLE",
        "GPUWAIT_CHECKPOINT_SIGNAL",
        "GPUWAIT_RESUME_EXIT",
        "GPUWAIT_RESUME_COUNT",
        "GPUWAIT_CRON_LOG_DIR",
    }
)


def known_variables() -> frozenset[str]:
    """Every GPUWAIT_* name gpuwait reads, exports, or leaves to its contrib scripts."""
    settings = {o.env_var for o in OPTIONS}
    return frozenset(settings | set(_USER_VARIABLES) | _OTHER_VARIABLES)


#: Where the unknown GPUWAIT_* names a quiet gpuwait (-q) said are kept (the state dir: the
#: `state_dir` setting, else the user state dir), at most this many of them, one a line.
SAID_VARIABLES = "said-variables"
_SAID_MOST = 256
_SAID_SCHEMA = "# gpuwait said-variables 1"


def not_said_quietly(names: Iterable[str]) -> set[str]:
    """The names among `names` that no quiet gpuwait (-q) of this user has said yet, noted
    as said from now on: a script that runs its every step with -q is told of a misspelled
    variable once, not in every step. All of them where that cannot be told (the state dir
    unreadable or not writable): said again rather than never."""
    wanted = set(names)
    try:
        path = load_settings({}).state_path / SAID_VARIABLES
    except (GpuwaitError, OSError, ValueError):
        # Settings that cannot be read: the command says so itself, in its own words.
        path = Path(dirs.user_state_dir()) / SAID_VARIABLES
    try:
        text = read_state_file(path, _SAID_MOST * 128, mine())
        lines = (text or b"").decode("utf-8", "replace").splitlines()
        # The first line names the file's schema; a file of another schema counts as empty.
        said = set(lines[1:]) if lines[:1] == [_SAID_SCHEMA] else set()
        new = wanted - said
        if new:
            kept = sorted(new) + sorted(said - new)
            body = "".join(f"{n}\n" for n in [_SAID_SCHEMA, *kept[:_SAID_MOST]])
            ensure_private_dir(path.parent)
            write_atomic(path, body.encode(), sync=False)
    except (OSError, ValueError):
        return wanted
    return new


def unknown_variables(names: Iterable[str]) -> list[tuple[str, str | None]]:
    """The GPUWAIT_* names among `names` that gpuwait does not know, each with the setting's
    variable it most likely misspells (None: none is close). A misspelled variable is otherwise
    ignored without a word, and its setting silently keeps its default."""
    known = known_variables()
    unknown = sorted(n for n in names if n.startswith("GPUWAIT_") and n not in known)
    if not unknown:
        return []
    # Only what a user sets is offered: the exported variables are gpuwait's own to write.
    offered = [o.name for o in OPTIONS] + [
        v.removeprefix("GPUWAIT_").lower() for v in _USER_VARIABLES
    ]
    found: list[tuple[str, str | None]] = []
    for name in unknown:
        # Compared without the prefix every name shares (which would make any two look alike).
        match = _likely_setting(name.removeprefix("GPUWAIT_").lower(), offered)
        found.append((name, None if match is None else "GPUWAIT_" + match.upper()))
    return found


def _unquoted_hint(text: str, error: str) -> str | None:
    """`pick = best-fit`, `ledger_dir = /srv/gpuwait`, `default_vram = 6G`: what TOML says of
    text without quotes, answered with the line that has them."""
    import re  # only once a file was refused

    at = re.search(
        r"^(?:Invalid value|Expected newline or end of document after a statement) "
        r"\(at line ([0-9]+), column [0-9]+\)",
        error,
    )
    lines = text.splitlines()
    if at is None or not 0 < int(at.group(1)) <= len(lines):
        return None
    line = re.fullmatch(
        r"\s*([A-Za-z0-9_-]+)\s*=\s*([^\s\"'\[{#][^#]*?)\s*(#.*)?", lines[int(at.group(1)) - 1]
    )
    if line is None or '"' in line.group(2) or re.fullmatch(r"[0-9.,_ +-]+", line.group(2)):
        return None  # `safety = 0,8`, as text, would be refused for its comma all the same
    return f'text takes quotes: {line.group(1)} = "{line.group(2)}"'


def _likely_setting(word: str, offered: Sequence[str]) -> str | None:
    """The name in `offered` that `word` (a variable without its prefix, a config key) most
    likely misspells: the nearest one, else the first with `word` as a word of its name (VRAM:
    default_vram); None where none is close."""
    from gpuwait.core.text import nearest  # only once something is misspelled

    return nearest(word, offered) or next(
        (name for name in offered if word and word in name.split("_")), None
    )


class Settings(Record):
    """Effective settings: one typed attribute per setting (see OPTIONS), and where each came from.

    A test checks that the attributes and OPTIONS name the same settings, in the same order.
    """

    safety: float
    pick: str
    priority: int
    #: None: a whole GPU ('exclusive').
    default_vram: MemoryRequest | None
    timeout: float | None
    on_no_gpu: str
    sample_interval: float
    resume_exit: int
    pause_min_runtime: float
    pause_max: int
    pause_grace_max: float
    wake: str
    poll_interval: float
    nvml_interval: float
    ignore_processes: tuple[str, ...]
    gpu_weights: dict[str, float]
    prefer: tuple[str, ...]
    sim: Path | None
    state_dir: Path | None
    wrap_commands: tuple[str, ...]
    wrap_only_in: tuple[str, ...]
    never_wrap: tuple[str, ...]
    estimate_margin: float
    history_commands: str
    history_max_size: int
    enforce: str
    visible_devices: str
    watch_stderr: str
    ledger_dir: Path | None
    on_state_error: str
    nvml_timeout: float
    gpu_error_timeout: float
    lock_timeout: float
    idle_min_vram: int
    #: Percent, 0 to 100.
    idle_max_util: float
    idle_after: float
    idle_action: str
    user_max_gpus: int | None
    user_max_vram: int | None
    fair_share_half_life: float | None
    queue_order: str
    max_wait_factor: float
    max_wait: float | None
    plan_budget: float
    #: Setting name -> "default", "command line", "environment GPUWAIT_X", "config file F", ...
    sources: dict[str, str] = field(default_factory=dict)
    #: None where there is none: no home directory to hold one (`config_file_path`).
    config_file: Path | None = Path("config.toml")
    site_file: Path | None = None
    #: max_wait_factor and max_wait as the site file (else the default) sets them.
    site_wait: tuple[float, float | None] = (Lookahead.max_wait_factor, None)
    #: safety as the site file (else the default) sets it.
    site_safety: float = DEFAULT_SAFETY
    #: queue_order as the site file (else the default) sets it: a shared ledger's.
    site_queue_order: str = "lookahead"
    #: What the commands say of the files the settings come from (load_settings).
    notes: tuple[str, ...] = ()

    @property
    def state_path(self) -> Path:
        """Where the history (and, unless ledger_dir says otherwise, the ledger) lives."""
        return self.state_dir or Path(dirs.user_state_dir())

    @property
    def machine_path(self) -> Path:
        """This machine's part of the user's state: the state dir, or this machine's directory
        under it where several machines share it (linux/netfs). What is true of this machine
        only (the idle holders' evidence) is kept here, wherever `ledger_dir` is."""
        return netfs.ledger_home(self.state_path)

    @property
    def ledger_path(self) -> Path:
        """Where the ledger lives: `ledger_dir` when set (maybe shared), else `machine_path`."""
        return self.ledger_dir or self.machine_path

    def fair_share(self) -> FairShare:
        """The fairness policy these settings ask for (an administrator's, from the site file)."""
        max_gpus, max_vram = self.user_max_gpus, self.user_max_vram
        limits = None if max_gpus is None and max_vram is None else UserLimits(max_gpus, max_vram)
        order = (
            None
            if self.queue_order == "fifo"
            else Lookahead(
                budget_ms=self.plan_budget * 1000,
                max_wait_factor=self.max_wait_factor,
                max_wait=self.max_wait,
            )
        )
        factor, max_wait = self.site_wait
        site = Lookahead(
            budget_ms=self.plan_budget * 1000, max_wait_factor=factor, max_wait=max_wait
        )
        return FairShare(
            half_life=self.fair_share_half_life,
            limits=limits,
            order=order,
            site_order=site,
            site_in_order=self.site_queue_order == "fifo",
            site_safety=self.site_safety,
            safety_from_site=self.sources.get("safety", "default") == "default"
            or self.sources["safety"].startswith("site config file"),
        )

    def in_shared_ledger(self, directory: Path) -> Settings:
        """The settings as they act in the shared ledger `directory`: its queue in the site's
        order, and wait budgets no shorter than the site's (`FairShare.in_shared_ledger`). A
        setting whose own value is not used there has the one in force, and a source that
        says so."""
        order = self.fair_share().in_shared_ledger().order
        used: dict[str, Any] = {"queue_order": "fifo" if order is None else "lookahead"}
        if order is not None:
            used |= {"max_wait_factor": order.max_wait_factor, "max_wait": order.max_wait}
        changed = {name: value for name, value in used.items() if value != getattr(self, name)}
        sources = dict(self.sources)
        for name in changed:
            source = sources.get(name, "default")
            own = (
                f"the default, {self.shown(name)}"
                if source == "default"
                else f"yours, {self.shown(name)} from {source}"
            )
            sources[name] = (
                f"the site's, in the shared ledger {directory}; {own}, is not used there"
            )
        return self._replace(**changed, sources=sources)

    def shown(self, name: str) -> str:
        """Setting `name` as a user would type it."""
        return OPTIONS_BY_NAME[name].show(getattr(self, name))

    def data(self, name: str) -> Any:
        """Setting `name` as JSON data: sizes in bytes, durations in seconds, lists, null."""
        return OPTIONS_BY_NAME[name].data(getattr(self, name))


def config_file_path(env: Mapping[str, str]) -> Path | None:
    """GPUWAIT_CONFIG, else config.toml in the user config dir ($XDG_CONFIG_HOME/gpuwait);
    None where there is no home directory to hold one (a uid with no entry in the password file
    and no HOME: `env -i` in a container run as an arbitrary uid). The state dir, which such a
    user still needs, says so when it is asked for."""
    custom = env.get("GPUWAIT_CONFIG")
    if custom:
        try:
            return Path(custom).expanduser()
        except RuntimeError:
            # `~nosuchuser/config.toml`, or `~/...` with no home to be had.
            raise UsageError(
                f"GPUWAIT_CONFIG names {custom}, whose home directory is not known",
                hint="fix the path, or unset GPUWAIT_CONFIG to use the usual config file",
            ) from None
    try:
        return Path(dirs.user_config_dir()) / "config.toml"
    except StateError:
        return None


def site_config_file_path() -> Path:
    """config.toml in the site config dir (first entry of XDG_CONFIG_DIRS)."""
    return Path(dirs.site_config_dir()) / "config.toml"


#: A config file larger than this is not a config file.
_MAX_CONFIG_BYTES = 1 << 20


def _own_link_target(path: Path) -> Path:
    """What `path` names: where it leads when it is a symlink of this user's (or root's)."""
    try:
        st = os.lstat(path)
    except OSError:
        return path
    if stat.S_ISLNK(st.st_mode) and st.st_uid in mine():
        return Path(os.path.realpath(path))
    return path


def _in_a_home_not_yours(path: Path) -> bool:
    """Whether a directory on the way to `path` keeps this user out, and none on the way is
    theirs: a home that is not theirs at all (HOME=/root under `docker run --user`, an old
    `sudo -u`), where no file of theirs can be."""
    try:
        os.stat(path)
        return False
    except PermissionError:
        pass
    except OSError:
        return False
    me = os.getuid()
    for directory in path.parents:
        with contextlib.suppress(OSError):
            if os.lstat(directory).st_uid == me:
                return False
    return True


def _site_unreadable_hint(path: Path) -> str:
    """What makes the site config file `path` readable to every user: its administrator's
    chmod of the first directory on the way that keeps others out (made by `mkdir -p` under
    root's umask 077), else of the file. Neither the user's own chmod nor a config file of
    their own would do: the file is root's, and read whatever GPUWAIT_CONFIG names."""
    for directory in reversed(path.parents):
        if not os.access(directory, os.X_OK):
            return f"an administrator runs: chmod o+rx {shell_word(directory)}"
    return f"an administrator runs: chmod o+r {shell_word(path)}"


def load_config_file(path: Path, *, site: bool = False) -> dict[str, Any]:
    """The table in `path`; {} when there is none. Raises UsageError for a broken file.

    A broken file is the user's (or the administrator's) own text: it is reported, never moved
    or rewritten.
    """
    return _checked(_config_table(path, site), path, site)


def _config_table(path: Path, site: bool) -> dict[str, Any]:
    """The table in `path` as TOML reads it, whatever its keys; {} when there is none.
    UsageError where it cannot be read or is no TOML."""
    kind = "site config file" if site else "config file"
    try:
        # Never waited on (a FIFO), never read past the cap, and a user's file is theirs or
        # root's, the site file root's (or the user's own, trying it out). A link is followed
        # only when it is theirs or root's too (dotfiles kept elsewhere), and its target must
        # be such a file itself.
        fd = open_readable(_own_link_target(path), mine())
        if fd is None:
            return {}
        try:
            if site and os.fstat(fd).st_mode & 0o002:
                raise UsageError(
                    f"{kind} {path} is writable by every user, so anyone could change the "
                    "limits in it; refusing to use it",
                    hint=f"an administrator runs: chmod o-w {shell_word(path)}",
                )
            raw = read_capped(fd, path, _MAX_CONFIG_BYTES)
        finally:
            os.close(fd)
    except UnsafePath as exc:
        raise UsageError(f"{kind} {path} {exc.what}; refusing to use it") from None
    except OSError as exc:
        hint = None
        if exc.errno in (errno.EACCES, errno.EPERM) and site:
            hint = _site_unreadable_hint(path)
        elif exc.errno in (errno.EACCES, errno.EPERM):
            hint = (
                f"make it readable (chmod u+r {shell_word(path)}), or set GPUWAIT_CONFIG to "
                "another file"
            )
            if not site and _in_a_home_not_yours(path):
                return {}
            # A directory of another user's in their own home that keeps them out is named.
            hint = taken_over_hint(path) or hint
        raise UsageError(f"{kind} {path} cannot be read: {exc.strerror}", hint=hint) from None
    # Imported here, not at the top: most launches have no config file, and a launch should
    # not pay for the TOML parser then.
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on Python 3.10 only
        import tomli as tomllib
    try:
        # A byte-order mark, which Windows editors put first, is no part of the text.
        text = raw.removeprefix(b"\xef\xbb\xbf").decode("utf-8")
        data = tomllib.loads(text)
    except UnicodeDecodeError:
        raise UsageError(f"{kind} {path}: not UTF-8 text; fix or remove it") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(
            f"{kind} {path}: {exc}; fix or remove it", hint=_unquoted_hint(text, str(exc))
        ) from None
    except RecursionError:  # tomllib's answer to arrays or tables nested thousands deep
        raise UsageError(
            f"{kind} {path}: damaged, values nested too deeply to read; fix or remove it"
        ) from None
    except ValueError:  # tomllib's int() of a number of more digits than it converts (4300)
        raise UsageError(
            f"{kind} {path}: damaged, a number too long to read; fix or remove it"
        ) from None
    return data


def _checked(data: dict[str, Any], path: Path, site: bool) -> dict[str, Any]:
    """`data`, read from `path`, where its keys are settings a user may set there (any, in
    the site file); UsageError otherwise."""
    kind = "site config file" if site else "config file"
    unknown = sorted(set(data) - set(OPTIONS_BY_NAME))
    # In the site file a setting this gpuwait does not know is skipped (load_settings says so):
    # it is an administrator's, maybe for a newer gpuwait than a user's own copy, and refused
    # it would stop every command of every user, every wrapped `python` included.
    if unknown and not site:
        match = _likely_setting(unknown[0], list(OPTIONS_BY_NAME))
        hint = None if match is None else f"did you mean {match}?"
        table = _table_of_settings(data, unknown)
        if table is not None:
            hint = f"settings go at the top of the file: remove the [{table}] line"
        # Every setting's name is the help there is only where the hint has none to give.
        known = "" if hint is not None else "; known settings: " + ", ".join(OPTIONS_BY_NAME)
        raise UsageError(f"{kind} {path}: unknown setting {unknown[0]!r}{known}", hint=hint)
    if not site:
        reserved = [o.name for o in OPTIONS if o.site_only and o.name in data]
        if reserved:
            raise UsageError(
                f"{kind} {path}: {reserved[0]} can only be set by an administrator, in the "
                f"site config file {site_config_file_path()}"
            )
    return data


def _table_of_settings(data: dict[str, Any], unknown: list[str]) -> str | None:
    """The dotted name of a table that holds settings (`[gpuwait]`, `[tool.gpuwait]`, as other
    tools' files have), among the unknown keys: the settings belong at the top level."""
    for name in unknown:
        path, value = [name], data[name]
        while isinstance(value, dict):
            if set(value) & set(OPTIONS_BY_NAME):
                return ".".join(path)
            if len(value) != 1:
                break
            ((key, value),) = value.items()
            path.append(key)
    return None


def _flag(name: str) -> str:
    """The command-line option that sets setting `name`."""
    return "--ledger" if name == "ledger_dir" else f"--{name.replace('_', '-')}"


def resolve(
    cli: Mapping[str, Any],
    env: Mapping[str, str],
    file_values: Mapping[str, Any],
    config_file: Path | None,
    site_values: Mapping[str, Any] | None = None,
    site_file: Path | None = None,
) -> Settings:
    """Pick each setting from the first place that has it: CLI, environment, user file, site
    file, default. A site-only setting comes from the site file or the default."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    site = site_values or {}
    for option in OPTIONS:
        user_set = cli.get(option.name) is not None or env.get(option.env_var, "") != ""
        if option.site_only and user_set:
            where = (
                _flag(option.name)
                if cli.get(option.name) is not None
                else f"environment {option.env_var}"
            )
            raise UsageError(
                f"{where}: {option.name} can only be set by an administrator, in the site "
                f"config file {site_file or 'config.toml'}"
            )
        if cli.get(option.name) is not None:
            raw, source = cli[option.name], "command line"
        elif env.get(option.env_var, "") != "":
            raw, source = env[option.env_var], f"environment {option.env_var}"
        elif option.name in file_values and not option.site_only:
            raw, source = file_values[option.name], f"config file {config_file}"
        elif option.name in site:
            raw, source = site[option.name], f"site config file {site_file}"
        else:
            values[option.name] = option.parse(option.default)
            sources[option.name] = "default"
            continue
        values[option.name] = _parsed(option, raw, source)
        sources[option.name] = source
    # The site's queue order and wait budgets act in a shared ledger over a user's own (and its
    # safety under one they did not set): one the site file spells wrong is refused here too,
    # as it is for every user who has none of their own, not taken for the default unsaid.
    for name in _SITE_WIDE:
        if name in site:
            _parsed(OPTIONS_BY_NAME[name], site[name], f"site config file {site_file}")
    site_wait = (_site_value("max_wait_factor", site), _site_value("max_wait", site))
    return Settings(
        **values,
        sources=sources,
        config_file=config_file,
        site_file=site_file,
        site_wait=site_wait,
        site_safety=_site_value("safety", site),
        site_queue_order=_site_value("queue_order", site),
    )


#: Settings whose site value is used even where a user sets their own (`Settings.site_wait`,
#: `site_safety`, `site_queue_order`).
_SITE_WIDE = ("max_wait_factor", "max_wait", "safety", "queue_order")


def _parsed(option: Option, raw: Any, source: str) -> Any:
    """`raw` parsed for `option`, or a UsageError naming where it came from (`source`)."""
    try:
        return option.parse(raw)
    except (ValueError, TypeError) as exc:
        shown = _flag(option.name) if source == "command line" else source
        reason = str(exc)
        if not isinstance(raw, bool) and reason.startswith(
            (repr(str(raw)), repr(str(raw).strip()))
        ):
            # The reason says the value already ("'1h30' gives 30 no unit"): said once, after
            # the option, as `--vram` is refused, or after the setting's name.
            named = shown if source == "command line" else f"{source}: {option.name}"
            raise UsageError(f"{named} {reason}") from None
        # A TOML boolean as the file spells it, not as Python prints it.
        value = ("true" if raw else "false") if isinstance(raw, bool) else repr(raw)
        if source == "command line":
            # The option names the setting already: "--safety '1x' is not valid: ...".
            raise UsageError(f"{shown} {value} is not valid: {reason}") from None
        raise UsageError(f"{shown}: {value} is not valid for {option.name}: {reason}") from None


def _site_value(name: str, site: Mapping[str, Any]) -> Any:
    """Setting `name` as the site file (else the default) sets it (`resolve` has refused one
    that is not valid)."""
    option = OPTIONS_BY_NAME[name]
    return option.parse(site.get(name, option.default))


def current_fair_share(cli: Mapping[str, Any], settings: Settings) -> Callable[[], FairShare]:
    """The fairness policy (`Settings.fair_share`) as the config files say at each call: an
    administrator who adds a per-user limit to the site file, or changes the queue's order,
    reaches the jobs that already wait. The settings are read again only when the site file
    changed, or changed less than RACY_SECONDS before (gpuwait.linux.stamp); a file broken
    now (an editor's half-written one) leaves the last policy read in force until it changes
    again."""
    site = site_config_file_path()
    seen: list[Any] = [file_stamp(site), settings.fair_share()]

    def current() -> FairShare:
        key = file_stamp(site)
        # One changed in the last tick of a coarse clock may change again unseen.
        if key != seen[0] or (key is not None and may_change_unseen(key)):
            seen[0] = key
            with contextlib.suppress(UsageError, StateError):
                seen[1] = load_settings(cli).fair_share()
        fair: FairShare = seen[1]
        return fair

    return current


def _lookup_error(path: Path) -> OSError | None:
    """Why `path` cannot be looked up (FileNotFoundError: nothing there; a directory shut to
    the user, a component too long); None where it can."""
    try:
        path.stat()
    except OSError as exc:
        return exc
    return None


def wrap_rules(env: Mapping[str, str] | None = None) -> tuple[tuple[str, ...], ...] | None:
    """wrap_only_in and never_wrap as `load_settings` takes them, read where another setting
    cannot be (a value not valid, a setting not known, GPUWAIT_SIM refused): the shell hook's
    own rules, which run a line bare that needs no settings. None where they cannot be told: a
    config file that cannot be read or is no TOML, or either of them not valid."""
    environ = os.environ if env is None else env
    try:
        path = config_file_path(environ)
        if path is not None and environ.get("GPUWAIT_CONFIG") and _lookup_error(path):
            return None
        own = {} if path is None else _config_table(path, site=False)
        site = _config_table(site_config_file_path(), site=True)
        rules = []
        for name in ("wrap_only_in", "never_wrap"):
            option = OPTIONS_BY_NAME[name]
            raw = environ.get(option.env_var) or own.get(name, site.get(name, option.default))
            rules.append(_parsed(option, raw, name))
    except UsageError:
        return None
    return tuple(rules)


def load_settings(cli: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Settings:
    """Read the environment and both config files, and resolve against `cli`."""
    environ = os.environ if env is None else env
    path = config_file_path(environ)
    site = site_config_file_path()
    error = _lookup_error(path) if path is not None and environ.get("GPUWAIT_CONFIG") else None
    if error is not None:
        # Named on purpose: a typo must not silently leave every setting at its default, nor a
        # path that cannot be looked up (a directory shut to the user, a name too long).
        missing = isinstance(error, (FileNotFoundError, NotADirectoryError))
        raise UsageError(
            f"GPUWAIT_CONFIG names {path}, which "
            + ("does not exist" if missing else f"cannot be looked up: {error.strerror}"),
            hint="fix the path, or unset GPUWAIT_CONFIG to use the usual config file",
        )
    own = {} if path is None else load_config_file(path)
    site_data = load_config_file(site, site=True)
    settings = resolve(cli, environ, own, path, site_data, site)
    unknown = sorted(set(site_data) - set(OPTIONS_BY_NAME))
    if not unknown:
        return settings
    names = ", ".join(map(repr, unknown))
    return settings._replace(
        notes=(
            f"site config file {site}: {names} is not a setting this gpuwait knows (a newer "
            "gpuwait's?) and is skipped; upgrade gpuwait to use it",
        )
    )
