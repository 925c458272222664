"""Settings and where each one came from.

Precedence is one pure function, `resolve`: command line > GPUWAIT_* environment > config.toml in
the user config dir > built-in default. `gpuwait config` shows the result with its sources.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import platformdirs

from gpuwait._errors import UsageError
from gpuwait._policy import PICK_STRATEGIES
from gpuwait._sizes import MemoryRequest, format_size, parse_duration, parse_request, parse_size

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

APP = "gpuwait"
EXCLUSIVE = "exclusive"


def _fraction(value: Any) -> float:
    number = float(value)
    if not 0 < number <= 1:
        raise ValueError("expected a fraction above 0 and at most 1, e.g. 0.9")
    return number


def _positive_duration(value: Any) -> float:
    seconds = float(value) if isinstance(value, (int, float)) else parse_duration(str(value))
    if seconds <= 0:
        raise ValueError("expected a duration above zero, e.g. 1s or 250ms")
    return seconds


def _optional_duration(value: Any) -> float | None:
    if value in (None, "", "none", "0", 0):
        return None
    return _positive_duration(value)


def _choice(*choices: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        text = str(value).strip().lower()
        if text not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return text

    return parse


def _priority(value: Any) -> int:
    number = int(str(value).strip())
    if not 1 <= number <= 5:
        raise ValueError("expected a priority from 1 (low) to 5 (urgent)")
    return number


def _default_vram(value: Any) -> MemoryRequest | None:
    text = str(value).strip()
    if text.lower() == EXCLUSIVE:
        return None
    return parse_request(text)


def _string_list(value: Any) -> tuple[str, ...]:
    """A TOML array of strings, or (from the environment) one string of comma-separated items."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
        raise ValueError("expected a list of strings, or comma-separated text")
    return tuple(i.strip() for i in items if i.strip())


#: Names a shell hook must never redefine: its own machinery relies on them.
_UNWRAPPABLE = frozenset({"command", "builtin", "exec", "eval", "source", "test", "gpuwait"})


def _command_names(value: Any) -> tuple[str, ...]:
    names = _string_list(value)
    for name in names:
        # These become shell function names: nothing a shell would read as syntax.
        if name.startswith("-") or not all(c.isalnum() or c in "._+-" for c in name):
            raise ValueError(f"{name!r} is not a plain command name")
        if name in _UNWRAPPABLE:
            raise ValueError(f"{name!r} cannot be wrapped")
    return names


def _margin(value: Any) -> float:
    text = str(value).strip()
    number = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    if not 0 <= number <= 2:
        raise ValueError("expected a fraction from 0 to 2, e.g. 0.1 or 10%")
    return number


def _size_limit(value: Any) -> int:
    size = value if isinstance(value, int) and not isinstance(value, bool) else None
    size = parse_size(str(value)) if size is None else size
    if size < 2**20:
        raise ValueError("expected a size of at least 1MiB, e.g. 64MiB")
    return size


def _path(value: Any) -> str:
    text = str(value).strip()
    return os.path.abspath(os.path.expanduser(text)) if text else ""


@dataclass(frozen=True)
class Option:
    """One setting: its name, how to read it, its default and what it means."""

    name: str
    parse: Callable[[Any], Any]
    default: Any
    help: str

    @property
    def env_var(self) -> str:
        return "GPUWAIT_" + self.name.upper()


OPTIONS: tuple[Option, ...] = (
    Option(
        "safety", _fraction, 0.9, "fraction of each GPU's total VRAM that gpuwait fills at most"
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
    ),
    Option(
        "timeout",
        _optional_duration,
        None,
        "longest wait before giving up (none: wait as long as it takes)",
    ),
    Option(
        "on_no_gpu",
        _choice("run", "fail"),
        "run",
        "without NVML: 'run' the command at once with a warning, or 'fail'",
    ),
    Option("sample_interval", _positive_duration, 1.0, "how often a running job's VRAM is sampled"),
    Option(
        "poll_interval",
        _positive_duration,
        0.01,
        "how often a waiter checks the ledger for a change",
    ),
    Option(
        "nvml_interval",
        _positive_duration,
        1.0,
        "how often a waiter re-reads the GPUs when the ledger did not change",
    ),
    Option(
        "sim",
        _path,
        "",
        "simulation file: use simulated GPUs instead of NVML (see `gpuwait sim init`)",
    ),
    Option(
        "state_dir", _path, "", "where the ledger and history live (default: the user state dir)"
    ),
    Option(
        "wrap_commands",
        _command_names,
        ("python", "python3", "torchrun", "accelerate", "deepspeed"),
        "commands that `gpuwait shell-init` wraps in gpuwait",
    ),
    Option(
        "wrap_only_in",
        _string_list,
        (),
        "shell hooks wrap only in these directories (globs) and below; empty: everywhere",
    ),
    Option(
        "never_wrap",
        _string_list,
        ("* --help", "* -h", "* --version", "* -V", "* -m pip", "* -m pip *", "* -m venv *"),
        "shell hooks run command lines matching these globs bare",
    ),
    Option(
        "estimate_margin",
        _margin,
        0.1,
        "added on top of a VRAM estimate learned from earlier runs (0.1 = 10%)",
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
        "64MiB",
        "size at which the history is compacted (what estimates use is kept)",
    ),
    Option(
        "watch_stderr",
        _choice("auto", "off"),
        "auto",
        "look for out-of-memory messages on a command's stderr when it is a file or pipe",
    ),
)

OPTIONS_BY_NAME = {o.name: o for o in OPTIONS}


@dataclass(frozen=True)
class Settings:
    """Effective settings, and for each the place it came from."""

    values: Mapping[str, Any]
    sources: Mapping[str, str]
    config_file: Path

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    @property
    def state_dir(self) -> Path:
        custom: str = self.values["state_dir"]
        return Path(custom) if custom else Path(platformdirs.user_state_dir(APP))


def config_file_path(env: Mapping[str, str]) -> Path:
    """GPUWAIT_CONFIG, else config.toml in the platformdirs user config dir."""
    custom = env.get("GPUWAIT_CONFIG")
    if custom:
        return Path(custom).expanduser()
    return Path(platformdirs.user_config_dir(APP)) / "config.toml"


def load_config_file(path: Path) -> dict[str, Any]:
    """The table in `path`; {} when there is none. Raises UsageError for a broken file."""
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        return {}
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"config file {path}: {exc}; fix or remove it") from None
    except OSError as exc:
        raise UsageError(f"config file {path} cannot be read: {exc.strerror}") from None
    unknown = sorted(set(data) - set(OPTIONS_BY_NAME))
    if unknown:
        raise UsageError(
            f"config file {path}: unknown setting {unknown[0]!r}; known settings: "
            + ", ".join(OPTIONS_BY_NAME)
        )
    return data


def resolve(
    cli: Mapping[str, Any],
    env: Mapping[str, str],
    file_values: Mapping[str, Any],
    config_file: Path,
) -> Settings:
    """Pick each setting from the first place that has it: CLI, environment, file, default."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for option in OPTIONS:
        if cli.get(option.name) is not None:
            raw, source = cli[option.name], "command line"
        elif env.get(option.env_var, "") != "":
            raw, source = env[option.env_var], f"environment {option.env_var}"
        elif option.name in file_values:
            raw, source = file_values[option.name], f"config file {config_file}"
        else:
            values[option.name] = option.parse(option.default)
            sources[option.name] = "default"
            continue
        try:
            values[option.name] = option.parse(raw)
        except (ValueError, TypeError) as exc:
            shown = {"command line": f"--{option.name.replace('_', '-')}"}.get(source, source)
            raise UsageError(f"{shown}: {raw!r} is not valid for {option.name}: {exc}") from None
        sources[option.name] = source
    return Settings(values=values, sources=sources, config_file=config_file)


def load_settings(cli: Mapping[str, Any], env: Mapping[str, str] | None = None) -> Settings:
    """Read the environment and config file, and resolve against `cli`."""
    environ = os.environ if env is None else env
    path = config_file_path(environ)
    return resolve(cli, environ, load_config_file(path), path)


def show_value(name: str, value: Any) -> str:
    """A setting as a user would type it."""
    if name == "default_vram":
        return EXCLUSIVE if value is None else value.describe()
    if value is None:
        return "none"
    if isinstance(value, tuple):
        return ", ".join(value) if value else "(none)"
    if name.endswith("interval") or name == "timeout":
        return f"{value:g}s"
    if name == "history_max_size":
        return format_size(value)
    if name == "estimate_margin":
        return f"{value * 100:g}%"
    return str(value) if value != "" else "(not set)"
