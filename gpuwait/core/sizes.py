"""Parsing and formatting of memory sizes and durations, as users type them."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable

from gpuwait.core.record import Record

_BINARY = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_DECIMAL = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}

# re.ASCII: `\d` is 0-9 only. Python would read '٣' (an Arabic-Indic three) or a fullwidth '３' as
# a digit too, and no one who typed one meant a number.
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?|\.\d+)\s*([KMGT]?)(I?B?)\s*$", re.IGNORECASE | re.ASCII)
_PERCENT_RE = re.compile(r"^\s*(\d+(?:\.\d+)?|\.\d+)\s*%\s*$", re.ASCII)
_WHOLE_RE = re.compile(r"^\s*[+-]?\d+\s*$", re.ASCII)
_DECIMAL_RE = re.compile(r"^\s*[+-]?(?:\d+(?:\.\d*)?|\.\d+)\s*$", re.ASCII)

# The bounds of every number a user gives gpuwait (documented in docs/configuration.md). Far
# above any sensible value, they keep an absurd one from reaching the kernel (a timer, a sleep)
# or a file (a ledger entry) that would refuse it later, with a traceback or a dropped entry.
#: The largest size: 1 PiB, a thousand times the largest GPU's memory (a request, a limit, a card).
MAX_SIZE = 2**50
MAX_SIZE_TEXT = "1024T"
#: The smallest VRAM request in bytes: less is no GPU job's memory, but a unit mistyped (6K).
MIN_REQUEST = 2**20
#: The longest duration: a year (a wait, an interval, a timeout, a half-life).
MAX_DURATION = 365 * 86400.0
MAX_DURATION_TEXT = "365d"
#: The most GPUs: what a ledger entry holds.
MAX_GPUS = 1024
#: A negative number as a size, a duration or a count is written on a command line (`-1s`,
#: `-1G`, `-.5`): a value to refuse as negative, not an option (argparse's own pattern takes
#: none with a unit).
NEGATIVE_VALUE = re.compile(r"^-(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[A-Za-z%]+)?\Z")


class OutOfRange(ValueError):
    """A number written as gpuwait takes it, but outside its bounds; `why` says so as a clause
    ("it is too long (at most 365d)")."""

    def __init__(self, message: str, why: str) -> None:
        super().__init__(message)
        self.why = why


class MemoryRequest(Record, frozen=True):
    """A VRAM request per GPU: either bytes, or a fraction of each card's total."""

    bytes: int | None = None
    fraction: float | None = None

    def on(self, total_bytes: int) -> int:
        """Bytes this request needs on a card of `total_bytes`."""
        if self.bytes is not None:
            return self.bytes
        assert self.fraction is not None
        # Rounded down, as the room under the safety factor is (int(total * safety)): the same
        # fraction on both sides (`--vram 90%` at safety 0.9) fits, whatever byte it falls in.
        return max(1, int(self.fraction * total_bytes))

    def describe(self) -> str:
        if self.bytes is not None:
            return format_size(self.bytes)
        assert self.fraction is not None
        return f"{self.fraction * 100:g}% of a GPU"

    def to_json(self) -> dict[str, float | int]:
        return (
            {"bytes": self.bytes} if self.bytes is not None else {"fraction": self.fraction or 0.0}
        )


def _digits(text: str, hint: str) -> str:
    """`hint`, unless `text` has digits other than 0-9 ('٣', '３') or a space other than the
    plain one (a non-breaking space, pasted from a page: '6\u00a0GiB'): then what to write
    instead."""
    if any(c.isdigit() and not c.isascii() for c in text):
        return "write numbers in the digits 0-9"
    if any(c.isspace() and not c.isascii() for c in text):
        return "type the space in it again: it is a non-breaking or other Unicode space"
    return hint


#: What every refusal of a size without a unit says.
UNIT_HINT = "give a unit: 6G (GiB), 6GB or 6000M"
REQUEST_UNIT_HINT = "give a unit: 6G (GiB), 6GB, 6000M or 50%"


def parse_size(text: str, *, hint: str = UNIT_HINT) -> int:
    """Bytes in `text`: `6G`/`6GiB` are 6*2^30, `6GB` is 6*10^9, `4096B` is bytes.

    A number without a unit is refused: `--vram 6` meant 6 GiB to whoever typed it, and taking
    it as 6 bytes would admit a job with no room at all. Raises ValueError with a message that
    says what is accepted (`hint`).
    """
    match = _SIZE_RE.match(text)
    if not match:
        unsigned = _SIZE_RE.match(text.strip().removeprefix("-"))
        if unsigned and float(unsigned.group(1)) == 0:
            return 0  # -0G: zero, not negative; the caller says where zero will not do
        if unsigned:
            raise ValueError(f"{text.strip()!r} is negative; give a size above zero, e.g. 6G")
        _decimal_comma(text, _SIZE_RE)
        _exponent(text, hint)
        _bare_point(text, "size", lambda pointless: parse_size(pointless, hint=hint))
        raise ValueError(f"{text!r} is not a size; {_digits(text, hint)}")
    number, unit, suffix = match.group(1), match.group(2).upper(), match.group(3).upper()
    if not unit and not suffix and float(number) != 0:  # zero is zero in every unit
        raise ValueError(f"{text.strip()!r} has no unit; {hint}")
    if suffix == "B" and unit:
        scale = _DECIMAL[unit]
    elif suffix in ("IB", "I") and not unit:
        raise ValueError(f"{text!r} is not a size; {_digits(text, hint)}")
    else:
        scale = _BINARY[unit]
    value = float(number) * scale
    if not math.isfinite(value) or value > MAX_SIZE:
        why = f"is too large (at most {MAX_SIZE_TEXT})"
        raise OutOfRange(f"{text.strip()!r} {why}", f"it {why}")
    return math.ceil(value)


_EXPONENT_RE = re.compile(
    r"^\s*(-?)((?:\d+(?:\.\d*)?|\.\d+)e[+-]?\d+)\s*((?:[KMGT]I?)?B?|%)\s*$",
    re.IGNORECASE | re.ASCII,
)


def _exponent(text: str, hint: str, *, share: bool = False) -> None:
    """Raise ValueError saying so where `text` is a size (or, with `share`, a share: 5e1%)
    written with an exponent (1e3M, as Python and JSON write numbers), with the line to type
    where it is short; one below zero (-1e3M) is told so."""
    match = _EXPONENT_RE.match(text)
    if not match or (match.group(3) == "%") != share:
        return
    sign, number, unit = match.groups()
    if sign and float(number) != 0:
        kind, example = ("share", "50%") if share else ("size", "6G")
        raise ValueError(f"{text.strip()!r} is negative; give a {kind} above zero, e.g. {example}")
    said = f"{text.strip()!r} is not a size: it takes no exponent"
    value = float(number) * _BINARY.get(unit[:1].upper(), 1)
    if not math.isfinite(value) or value > MAX_SIZE:
        raise ValueError(f"{said}, and it is too large (at most {MAX_SIZE_TEXT})")
    plain = _written_out(number)
    if not plain:
        raise ValueError(f"{said}; write it in digits, e.g. 6G")
    if unit:
        raise ValueError(f"{said}; write {plain}{unit}")
    wanted = hint.removeprefix("give a unit")
    raise ValueError(f"{said}; write {plain} with a unit{wanted}" if wanted != hint else said)


def _written_out(number: str) -> str:
    """`number`, written with an exponent, in digits alone (`_in_digits`) where that is short
    enough to suggest (an exponent of two digits at most, 20 digits at most); else ""."""
    exponent = number.lower().partition("e")[2].lstrip("+-").lstrip("0")
    plain = _in_digits(number) if len(exponent) <= 2 else ""
    return plain if len(plain) <= 20 else ""


def _in_digits(number: str) -> str:
    """`number` (1.5e3, its exponent of two digits at most, leading zeros aside) written
    without its exponent: 1500."""
    mantissa, _, exponent = number.lower().partition("e")
    whole, _, fraction = mantissa.partition(".")
    digits = whole + fraction
    # Its leading zeros left out: thousands of them would be past int()'s limit on digits.
    shift = int(exponent.lstrip("+-").lstrip("0") or "0")
    point = len(whole) + (-shift if exponent.startswith("-") else shift)
    if point <= 0:
        plain = "0." + "0" * -point + digits
    elif point >= len(digits):
        plain = digits + "0" * (point - len(digits))
    else:
        plain = f"{digits[:point]}.{digits[point:]}"
    if "." in plain:
        plain = plain.rstrip("0").rstrip(".")
    plain = plain.lstrip("0")
    return "0" + plain if plain[:1] in ("", ".") else plain


def _decimal_comma(text: str, pattern: re.Pattern[str]) -> None:
    """Raise ValueError saying so where `text` is `pattern` written with a decimal comma (6,5G)."""
    pointed = text.strip().replace(",", ".", 1)
    if "," not in text or not pattern.match(pointed):
        return
    if re.search(r",\d{3}(?!\d)", text):
        # 1,000G: a thousand, or one in a locale with a decimal comma? Guess neither.
        raise ValueError(
            f"{text.strip()!r} is not a size; write it without a comma (thousands as 1000G, "
            "decimals with a point: 1.5G)"
        )
    raise ValueError(f"{text.strip()!r} is not a size; write decimals with a point: {pointed}")


def _bare_point(text: str, kind: str, parse: Callable[[str], object]) -> None:
    """Raise ValueError saying so where `text` is one `parse` takes but for a point with no
    digits after it (6.G, 50.%, 1.h): "give a unit" would point at the unit it has. Where
    that number is out of bounds (400.d), it is said so, the line to type being none."""
    pointless = re.sub(r"(?<=\d)\.(?!\d)", "", text.strip(), flags=re.ASCII)
    if pointless == text.strip():
        return
    said = f"{text.strip()!r} is not a {kind}: a point needs digits after it"
    try:
        parse(pointless)
    except OutOfRange as out:
        raise ValueError(f"{said}, and {out.why}") from None
    except ValueError:
        return
    raise ValueError(f"{said}; write {pointless}")


def parse_request(text: str) -> MemoryRequest:
    """A `--vram` value: a size, or a percentage of each card's total (`50%`). Must be > 0."""
    unsigned = _PERCENT_RE.match(text.strip().removeprefix("-"))
    if unsigned and text.strip().startswith("-") and float(unsigned.group(1)) != 0:
        raise ValueError(f"{text.strip()!r} is negative; give a share above zero, e.g. 50%")
    percent = unsigned if unsigned and text.strip().startswith("-") else _PERCENT_RE.match(text)
    if percent:
        value = float(percent.group(1))
        if not 0 < value <= 100:
            why = "a percentage of a GPU must be above 0% and at most 100%"
            raise OutOfRange(f"{text!r}: {why}", why)
        return MemoryRequest(fraction=value / 100)
    _decimal_comma(text, _PERCENT_RE)
    _exponent(text, REQUEST_UNIT_HINT, share=True)
    _bare_point(text, "size", parse_request)
    size = parse_size(text, hint=REQUEST_UNIT_HINT)
    if size <= 0:
        why = "a VRAM request must be larger than zero"
        raise OutOfRange(f"{text!r}: {why}", why)
    if size < MIN_REQUEST:
        # `--vram 6K`: no GPU job fits in 6 KiB; a unit mistyped, where 6G was meant.
        match = _SIZE_RE.match(text)
        assert match is not None
        suffix = {"B": "B", "IB": "iB", "I": "i"}.get(match.group(3).upper(), "")
        meant = f"{match.group(1)}G{suffix if match.group(2) else ''}"
        why = f"it is under 1 MiB, less than any GPU job uses; did you mean {meant}?"
        raise OutOfRange(f"{text.strip()!r} {why.removeprefix('it ')}", why)
    return MemoryRequest(bytes=size)


_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?|\.\d+)\s*(ms|s|m|h|d)?", re.IGNORECASE | re.ASCII)
_DURATION_HINT = "use e.g. 30s, 250ms, 10m, 2h, 1h30m"
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
#: The unit a number after another one's would most likely be meant in (1h30: 1h30m).
_NEXT_UNIT = {"d": "h", "h": "m", "s": "ms", "ms": "ms"}


def parse_duration(text: str) -> float:
    """Seconds in `text`: `90`, `1.5s`, `250ms`, `10m`, `2h`, `1h30m`, at most a year.

    Raises ValueError."""
    stripped = text.strip()
    if stripped.startswith("-") and _DURATION_RE.match(stripped, 1):
        try:
            unsigned: float | None = parse_duration(stripped[1:])
        except ValueError:
            unsigned = None
        if unsigned == 0:
            return 0.0  # -0s: zero, not negative; the caller says where zero will not do
        raise ValueError(f"{stripped!r} is negative; give a duration such as 30s")
    # Before the parts are read: `1h30.m` is no 1h30 whose 30 has no unit.
    _bare_point(text, "duration", parse_duration)
    position = 0
    total = 0.0
    parts = 0
    while position < len(stripped):
        match = _DURATION_RE.match(stripped, position)
        if not match or match.end() == position:
            _duration_comma(text)
            _duration_exponent(text)
            raise ValueError(f"{text!r} is not a duration; {_digits(text, _DURATION_HINT)}")
        before = stripped[:position].rstrip().lower()
        last = next((u for u in ("ms", "s", "m", "h", "d") if before.endswith(u)), None)
        if parts and match.group(2) is None and last != "m":
            # `1h30`: the 1h30m meant, not an hour and 30 s (`2m30` is 2m30s, as a clock says).
            if last is None:
                raise ValueError(f"{text!r} is not a duration; {_DURATION_HINT}")
            meant = re.sub(r"\s+", "", stripped) + _NEXT_UNIT[last]
            raise ValueError(f"{stripped!r} gives {match.group(1)} no unit; write {meant}")
        unit = (match.group(2) or "s").lower()
        total += float(match.group(1)) * _DURATION_UNITS[unit]
        position = match.end()
        while position < len(stripped) and stripped[position] == " ":
            position += 1
        parts += 1
    if parts == 0:
        raise ValueError(f"{text!r} is not a duration; {_DURATION_HINT}")
    return check_duration(total, text.strip())


def _duration_comma(text: str) -> None:
    """Raise ValueError saying so where `text` is a duration written with a decimal comma
    (1,5h), as sizes are told (6,5G). Three digits after it (1,000s) may be thousands: no
    guess is made."""
    if re.fullmatch(r"\s*\d+,\d{1,2}\s*(?:ms|s|m|h|d)?\s*", text, re.IGNORECASE | re.ASCII):
        pointed = text.strip().replace(",", ".")
        raise ValueError(
            f"{text.strip()!r} is not a duration; write decimals with a point: {pointed}"
        )


_DURATION_EXPONENT_RE = re.compile(
    r"^\s*((?:\d+(?:\.\d*)?|\.\d+)e[+-]?\d+)\s*(ms|s|m|h|d)?\s*$", re.IGNORECASE | re.ASCII
)


def _duration_exponent(text: str) -> None:
    """Raise ValueError saying so where `text` is a duration written with an exponent (1e3s,
    as Python and JSON write numbers), with the line to type where it is short, as a size
    with one is told."""
    match = _DURATION_EXPONENT_RE.match(text)
    if not match:
        return
    number, unit = match.group(1), (match.group(2) or "s").lower()
    said = f"{text.strip()!r} is not a duration: it takes no exponent"
    if float(number) * _DURATION_UNITS[unit] > MAX_DURATION:
        raise ValueError(f"{said}, and it is too long (at most {MAX_DURATION_TEXT})")
    plain = _written_out(number)
    if not plain:
        raise ValueError(f"{said}; {_DURATION_HINT}")
    raise ValueError(f"{said}; write {plain}{unit}")


def check_duration(seconds: float, text: str) -> float:
    """`seconds` (the duration a user typed as `text`) if it is at most MAX_DURATION."""
    if math.isnan(seconds):
        raise ValueError(f"{text!r} is not a duration; {_DURATION_HINT}")
    if seconds > MAX_DURATION:
        why = f"is too long (at most {MAX_DURATION_TEXT})"
        raise OutOfRange(f"{text!r} {why}", f"it {why}")
    return seconds


def parse_whole(text: str, low: int, high: int) -> int:
    """A whole number from `low` to `high` in the digits 0-9. Raises ValueError."""
    if not _WHOLE_RE.match(text):
        hint = _digits(text, f"give one from {low} to {high}")
        raise ValueError(f"{text.strip()!r} is not a whole number; {hint}")
    digits = text.strip()
    # int() of thousands of digits is slow, and refused past 4300: too large either way.
    number = int(digits) if len(digits) <= 30 else (high + 1 if digits[0] != "-" else low - 1)
    if number < low:
        raise ValueError(f"{digits} is too small (at least {low})")
    if number > high:
        raise ValueError(f"{digits} is too large (at most {high})")
    return number


def parse_decimal(text: str) -> float:
    """A number such as 0.9, 30 or .5 in the digits 0-9 (no exponent, no inf, no nan).

    Raises ValueError."""
    if not _DECIMAL_RE.match(text):
        raise ValueError(f"{text.strip()!r} is not a number; {_digits(text, 'e.g. 0.5 or 30')}")
    return float(text)


def format_size(n_bytes: int | float) -> str:
    """`6.0 GiB`, `512 MiB`, `0 B`: binary units, as nvidia-smi's MiB figures."""
    value = float(n_bytes)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        # A figure the unit below would round up to 1024 of it (1023.6 MiB) is said in this one.
        if round(value / scale * 1024) >= 1024:
            shown = value / scale
            return (
                f"{sign}{shown:.1f} {unit}"
                if round(shown, 1) < 100
                else f"{sign}{shown:.0f} {unit}"
            )
    return f"{sign}{value:.0f} B"


def format_duration(seconds: float) -> str:
    """`850ms`, `4.2s`, `3m05s`, `2h10m`: a figure that rounds up to its unit's next step
    (999.6 ms, 59.96 s) is said in the next unit."""
    if round(seconds * 1000) < 1000:
        return f"{seconds * 1000:.0f}ms"
    if round(seconds, 1) < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(max(60, int(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def sizes_on_gpus(each: Iterable[tuple[int, str]]) -> str:
    """`12.0 GiB on GPU0, 40.0 GiB on GPU1`: each size on the GPU named beside it."""
    return ", ".join(f"{format_size(n)} on {gpu}" for n, gpu in each)


def format_setting_duration(value: float | None) -> str:
    """A duration setting as gpuwait says a duration elsewhere (`10ms`, `5m00s`, `23h00m`), but
    whole seconds under a minute as `5s`, and a value that form would round (`90.5s`, not
    `1m30s`) in seconds: what is shown (`gpuwait config`, a message naming the setting), typed
    back in, is the same setting. None: `none`."""
    if value is None:
        return "none"
    shown = format_duration(value)
    if 1 <= value < 60 or parse_duration(shown) != value:
        return f"{value:g}s"
    return shown
