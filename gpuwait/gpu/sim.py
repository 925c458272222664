"""The simulation backend: GPUs described by a TOML file, used by simulated CUDA jobs.

No machine that builds or tests gpuwait has a GPU, so the simulation must be strict enough that a
mistake in admission shows up as a failure: simulated jobs (`gpuwait.gpu.simjob`) really claim memory
on their card and die with a CUDA-style out-of-memory error when it is full.

Layout next to the simulation file `sim.toml`:

    sim.toml.d/            created 0700 on demand
        lock               exclusive flock (gpuwait.linux.lock); serialises allocation decisions
        <pid>.json         one allocation record per simulated process (written atomically)

A simulation several users share is root's: `gpuwait sim init FILE --shared`, run as root,
makes `FILE.d` root's, writable by every user and sticky (an administrator may narrow it to a
group: chgrp GROUP, chmod 3770). There, as in a shared ledger directory, the directory itself
is the lock, each user writes only their own records (readable by all, under names nobody can
guess beforehand), and nobody can remove another's.

A record counts only while its process lives and still has the start time it recorded, so a
killed job stops holding memory, as the driver frees a dead process's memory.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import json
import os
import re
import stat
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from gpuwait.core.digest import sha256_hex
from gpuwait.core.errors import BackendUnavailable, UsageError
from gpuwait.core.record import Record
from gpuwait.core.sizes import format_size, parse_size
from gpuwait.core.snapshot import (
    COMPUTE_DEFAULT,
    COMPUTE_MODES,
    GpuSnapshot,
    MachineSnapshot,
    ProcessUsage,
)
from gpuwait.core.text import shell_word
from gpuwait.linux import proc
from gpuwait.linux.atomic import write_atomic
from gpuwait.linux.lock import exclusive, flock_within
from gpuwait.linux.security import (
    ANYONE,
    UnsafePath,
    check_dir,
    is_shared_dir,
    mine,
    open_readable,
    read_capped,
    read_state_file,
)
from gpuwait.linux.stamp import FileStamp, file_stamp, may_change_unseen, stamp_of

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEFAULT_NAME = "Simulated GPU"
RECORD_SCHEMA = 1
#: A simulation file larger than this is not one (1024 GPUs take about 100 KiB).
MAX_FILE_BYTES = 1 << 20
#: An allocation record larger than this is not one.
MAX_RECORD_BYTES = 1 << 16
_HINT = "fix the file, or write a fresh one with `gpuwait sim init PATH --gpus 2 --memory 24GiB`"
_SHARE_HINT = (
    "a simulation several users share is root's: `sudo gpuwait sim init FILE --shared`; "
    "or write one of your own with `gpuwait sim init FILE`"
)
_GPU_KEYS = frozenset(
    {
        "name",
        "memory",
        "uuid",
        "speed",
        "base_used",
        "driver_reserved",
        "lost",
        "utilization",
        "compute_capability",
        "per_process",
        "compute_mode",
    }
)
_RECORD_RE = re.compile(r"^([0-9]+)\.json\Z")
_TEMP_RE = re.compile(r"^\.([0-9]+)\..*\.tmp\Z")
_UUID_RE = re.compile(r"^GPU-[0-9A-Za-z-]+\Z")


class SimGpu(Record, frozen=True):
    """One simulated card as the file describes it."""

    #: Position in the file: the NVML (PCI bus order) index.
    index: int
    uuid: str
    name: str
    total_bytes: int
    speed: float
    base_used: int
    lost: bool
    utilization: int | None
    compute_capability: tuple[int, int] | None = None
    #: False: processes are listed without memory figures, as NVML does inside containers.
    per_process: bool = True
    #: "default", "exclusive-process" (one process at a time) or "prohibited" (none).
    compute_mode: str = COMPUTE_DEFAULT
    #: Memory the driver keeps for itself (NVML v2's "reserved"): used, but by no process.
    driver_reserved: int = 0

    @property
    def held_by_none(self) -> int:
        """Used memory no simulated process holds: the driver's own and `base_used`."""
        return self.base_used + self.driver_reserved


class SimConfig(Record, frozen=True):
    """A parsed simulation file."""

    #: Absolute, symlink-free path, so every process finds the same state directory.
    path: str
    gpus: tuple[SimGpu, ...]

    @property
    def state_dir(self) -> Path:
        return state_dir_for(self.path)


class Allocation(Record, frozen=True):
    """One simulated process's memory on one card."""

    pid: int
    start_time: int
    gpu_uuid: str
    bytes: int

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": RECORD_SCHEMA,
            "pid": self.pid,
            "start_time": self.start_time,
            "gpu_uuid": self.gpu_uuid,
            "bytes": self.bytes,
        }


# --- the simulation file ---------------------------------------------------------------------


class _Invalid(ValueError):
    """One thing wrong with the file; becomes BackendUnavailable naming the file."""


def resolve_path(path: str | os.PathLike[str]) -> str:
    return os.path.realpath(os.fspath(path))


def state_dir_for(path: str | os.PathLike[str]) -> Path:
    return Path(resolve_path(path) + ".d")


def default_uuid(path: str, index: int) -> str:
    """A UUID that stays the same for the same file and position, formatted like NVML's."""
    digest = sha256_hex(f"{path}\0{index}")
    return f"GPU-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"


#: Parsed simulation files by path, with the stat figures they were read at: a snapshot re-reads
#: the file only when it changed (GPUs added, lost, resized) since the last time, or changed
#: less than RACY_SECONDS before (gpuwait.linux.stamp).
_parsed: dict[str, tuple[FileStamp, SimConfig]] = {}


#: Seconds since its last change after which a simulation file that does not read is taken as
#: written so (a mistake to fix), not caught half-saved by an editor that writes in place.
SETTLED_AFTER = 5.0


def _settled(stamp: FileStamp) -> bool:
    return time.time() - stamp.mtime_ns / 1e9 > SETTLED_AFTER  # its content's last change


#: Why a path can name no file (a component too long or the whole, one that is no directory).
_NO_SUCH_PATH = (errno.ENAMETOOLONG, errno.ENOTDIR)


def _left_so(path: str) -> bool:
    """Has the file at `path`, which cannot be read, not changed for SETTLED_AFTER, as one
    that does not parse: a file left so (chmod 000, another user's copy), not a save?"""
    stamp = file_stamp(Path(path))
    return stamp is not None and _settled(stamp)


def load_sim_file(path: str | os.PathLike[str]) -> SimConfig:
    """Read and check the file. Raises BackendUnavailable with a one-line message."""
    resolved = resolve_path(path)
    shown = os.fspath(path)
    try:
        # Resolved already: a link the user made to it was followed, one put in its place
        # since is not; never waited on (a FIFO), read up to the cap, theirs or root's only.
        fd = open_readable(resolved, mine())
        if fd is None:
            raise FileNotFoundError
        try:
            info = os.fstat(fd)
            stamp = stamp_of(info)
            known = _parsed.get(resolved)
            # A file changed in the last tick of a coarse clock may change again unseen.
            if known is not None and known[0] == stamp and not may_change_unseen(stamp):
                return known[1]
            raw = read_capped(fd, resolved, MAX_FILE_BYTES)
        finally:
            os.close(fd)
        # A byte-order mark, which Windows editors put first, is no part of the text.
        data = tomllib.loads(raw.removeprefix(b"\xef\xbb\xbf").decode("utf-8"))
    except FileNotFoundError:
        raise BackendUnavailable(
            f"simulation file {shown}: not found",
            hint=f"create it with `gpuwait sim init {shell_word(shown)} --gpus 2 --memory 24GiB`",
            lasting=True,
        ) from None
    except UnsafePath as exc:
        # Nothing a moment will change (a save in progress is a plain file of the user's).
        raise BackendUnavailable(
            f"simulation file {shown} {exc.what}; refusing to use it",
            hint=_SHARE_HINT if _owned_by_another(resolved) else _HINT,
            lasting=True,
        ) from None
    except OSError as exc:
        if exc.errno in _NO_SUCH_PATH:
            # A name too long for the file system, or one under a file: no moment will make
            # it name a file, as a file not found is waited for by nobody either.
            raise BackendUnavailable(
                f"simulation file {shown}: cannot read it ({exc.strerror or exc})",
                hint="give a path that can name a file, and create it with `gpuwait sim init "
                "PATH --gpus 2 --memory 24GiB`",
                lasting=True,
            ) from None
        raise BackendUnavailable(
            f"simulation file {shown}: cannot read it ({exc.strerror or exc})",
            hint=_HINT,
            lasting=exc.errno in (errno.EACCES, errno.EPERM) and _left_so(resolved),
        ) from None
    except (ValueError, RecursionError) as exc:  # TOMLDecodeError, UnicodeDecodeError among them
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if isinstance(exc, RecursionError):  # tomllib's answer to arrays nested thousands deep
            detail = "values nested too deeply"
        elif not isinstance(exc, (tomllib.TOMLDecodeError, UnicodeDecodeError)):
            # tomllib's int() of a number of more digits than it converts (4300).
            detail = "a number too long to read"
        raise BackendUnavailable(
            f"simulation file {shown}: not valid TOML ({detail})",
            hint=_HINT,
            lasting=_settled(stamp),
        ) from None
    try:
        gpus = _parse_gpus(data, resolved)
    except _Invalid as exc:
        raise BackendUnavailable(
            f"simulation file {shown}: {exc}", hint=_HINT, lasting=_settled(stamp)
        ) from None
    config = SimConfig(path=resolved, gpus=gpus)
    _parsed[resolved] = (stamp, config)
    return config


def _parse_gpus(data: dict[str, Any], path: str) -> tuple[SimGpu, ...]:
    unknown = sorted(set(data) - {"gpu"})
    if unknown:
        raise _Invalid(f"unknown top-level key {unknown[0]!r} (only [[gpu]] tables are allowed)")
    if "gpu" not in data:
        raise _Invalid("no [[gpu]] tables; describe each card in a [[gpu]] table")
    tables = data["gpu"]
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise _Invalid("'gpu' must be an array of tables ([[gpu]])")
    gpus = tuple(_parse_gpu(index, table, path) for index, table in enumerate(tables))
    _check_uuids(gpus)
    return gpus


def _check_uuids(gpus: Sequence[SimGpu]) -> None:
    """Each card's UUID names it alone, also as CUDA_VISIBLE_DEVICES and --devices read one
    (case aside, or a prefix): real UUIDs, all of one length, never begin one another."""
    # Sorted, a UUID that begins others comes just before one of them.
    ordered = sorted(gpus, key=lambda g: (g.uuid.lower(), g.index))
    for first, second in itertools.pairwise(ordered):
        if not second.uuid.lower().startswith(first.uuid.lower()):
            continue
        if first.uuid == second.uuid:
            raise _Invalid(
                f"gpu {second.index}: uuid {second.uuid!r} is also used by gpu {first.index}"
            )
        later, earlier = sorted((first, second), key=lambda g: -g.index)
        how = "begins with" if later is second else "is how"
        tail = "" if later is second else " begins"
        raise _Invalid(
            f"gpu {later.index}: uuid {later.uuid!r} {how} gpu {earlier.index}'s "
            f"{earlier.uuid!r}{tail}, so a CUDA_VISIBLE_DEVICES naming "
            f"{first.uuid!r} names both; give each card a UUID no other begins with"
        )


def _parse_gpu(index: int, table: dict[str, Any], path: str) -> SimGpu:
    try:
        unknown = sorted(set(table) - _GPU_KEYS)
        if unknown:
            raise _Invalid(f"unknown key {unknown[0]!r}; known: {', '.join(sorted(_GPU_KEYS))}")
        if "memory" not in table:
            raise _Invalid("'memory' is required (e.g. memory = \"24GiB\")")
        total = _size(table, "memory", None)
        if total <= 0:
            raise _Invalid("memory must be larger than zero")
        base_used = _size(table, "base_used", 0)
        if base_used > total:
            raise _Invalid("base_used is larger than memory")
        driver_reserved = _size(table, "driver_reserved", 0)
        if base_used + driver_reserved > total:
            raise _Invalid("base_used and driver_reserved together are larger than memory")
        return SimGpu(
            index=index,
            uuid=_uuid(table, path, index),
            name=_string(table, "name", DEFAULT_NAME),
            total_bytes=total,
            speed=_speed(table),
            base_used=base_used,
            lost=_bool(table, "lost"),
            utilization=_utilization(table),
            compute_capability=_compute_capability(table),
            per_process=_bool(table, "per_process", default=True),
            compute_mode=_compute_mode(table),
            driver_reserved=driver_reserved,
        )
    except _Invalid as exc:
        raise _Invalid(f"gpu {index}: {exc}") from None


def _size(table: dict[str, Any], key: str, default: int | None) -> int:
    value = table.get(key, default)
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise _Invalid(f"{key} must not be negative")
        return value
    if isinstance(value, str):
        try:
            return parse_size(value)
        except ValueError as exc:
            raise _Invalid(f"{key} {exc}") from None
    raise _Invalid(f'{key} must be a size such as "24GiB" or an integer of bytes')


def _string(table: dict[str, Any], key: str, default: str) -> str:
    value = table.get(key, default)
    if not isinstance(value, str) or not value.strip():
        raise _Invalid(f"{key} must be a non-empty string")
    return value


def _uuid(table: dict[str, Any], path: str, index: int) -> str:
    if "uuid" not in table:
        return default_uuid(path, index)
    value = table["uuid"]
    if not isinstance(value, str) or not _UUID_RE.match(value):
        raise _Invalid(f"uuid {value!r} must look like \"GPU-\" followed by letters, digits, '-'")
    return value


def _speed(table: dict[str, Any]) -> float:
    value = table.get("speed", 1.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise _Invalid(f"speed {value!r} must be a number above zero")
    return float(value)


def _bool(table: dict[str, Any], key: str, default: bool = False) -> bool:
    value = table.get(key, default)
    if not isinstance(value, bool):
        raise _Invalid(f"{key} must be true or false")
    return value


def _utilization(table: dict[str, Any]) -> int | None:
    value = table.get("utilization")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 100:
        raise _Invalid(f"utilization {value!r} must be an integer percent from 0 to 100")
    return value


def _compute_capability(table: dict[str, Any]) -> tuple[int, int] | None:
    value = table.get("compute_capability")
    if value is None:
        return None
    match = re.fullmatch(r"([0-9]{1,2})\.([0-9]{1,2})", value) if isinstance(value, str) else None
    if match is None:
        raise _Invalid(f'compute_capability {value!r} must be a string such as "8.0"')
    return int(match.group(1)), int(match.group(2))


def _compute_mode(table: dict[str, Any]) -> str:
    value = table.get("compute_mode", COMPUTE_DEFAULT)
    if value not in COMPUTE_MODES:
        raise _Invalid(f"compute_mode {value!r} must be one of: {', '.join(COMPUTE_MODES)}")
    return str(value)


def write_sim_file(
    path: str | os.PathLike[str],
    gpus: int,
    memory_bytes: int,
    name: str = DEFAULT_NAME,
    speeds: Sequence[float] | None = None,
    *,
    force: bool = False,
) -> None:
    """Write a commented simulation file of `gpus` identical cards (speeds may differ)."""
    if gpus < 0:
        raise UsageError(f"--gpus {gpus}: the number of GPUs cannot be negative")
    if memory_bytes <= 0:
        raise UsageError("--memory must be larger than zero")
    if speeds is not None and len(speeds) != gpus:
        raise UsageError(f"{len(speeds)} speeds given for {gpus} GPUs")
    text = _sim_file_text(gpus, memory_bytes, name, speeds)
    target = os.fspath(path)
    if os.path.lexists(target) and not force:
        raise UsageError(f"{target} already exists", hint="pass --force to replace it")
    with contextlib.suppress(OSError):
        kind = os.lstat(target).st_mode
        # --force replaces a simulation file, not a device, a FIFO or a directory (as root,
        # /dev/null would become a plain file).
        if not (stat.S_ISREG(kind) or stat.S_ISLNK(kind)):
            raise UsageError(
                f"{target} is not a plain file; gpuwait sim init replaces only plain files",
                hint="give the path of a simulation file, or a new one",
            )
    try:
        write_atomic(Path(target), text.encode(), mode=0o644)
    except OSError as exc:
        # A path the user gave that cannot be written: a usage error (exit 2).
        parent = os.path.dirname(os.path.abspath(target))
        if isinstance(exc, FileNotFoundError) and not os.path.isdir(parent):
            raise UsageError(
                f"cannot write {target}: directory {parent} does not exist",
                hint="create the directory first, or write the file elsewhere",
            ) from None
        raise UsageError(f"cannot write {target}: {exc.strerror or exc}") from None


def _sim_file_text(gpus: int, memory_bytes: int, name: str, speeds: Sequence[float] | None) -> str:
    lines = [
        "# gpuwait simulation file: `export GPUWAIT_SIM=<this file>` makes gpuwait use it.",
        "# Each [[gpu]] is one simulated card, in PCI order: its NVML index is its position.",
        '# Keys: name, memory (required; "24GiB" or bytes), uuid (default derived from this',
        "# file's path and the position), speed (CUDA's default FASTEST_FIRST order sorts by it,",
        "# descending), base_used (memory held by no process, e.g. a desktop), driver_reserved",
        '# (what the driver keeps for itself, NVML\'s "reserved", a few hundred MiB from R510 on),',
        "# lost (true: the card answers like NVML_ERROR_GPU_IS_LOST), utilization (percent),",
        '# compute_capability (e.g. "8.0"), per_process (false: processes are listed without',
        '# memory figures, as NVML does inside containers), compute_mode ("default",',
        '# "exclusive-process": one process at a time, as `nvidia-smi -c 3` sets; "prohibited":',
        "# none).",
        "# The file is read again on every reading, so it may be edited while jobs run.",
    ]
    if gpus == 0:
        lines += ["", "gpu = []"]
    for index in range(gpus):
        lines += ["", "[[gpu]]", f"name = {json.dumps(name, ensure_ascii=False)}"]
        lines.append(f"memory = {_size_literal(memory_bytes)}")
        if speeds is not None:
            lines.append(f"speed = {float(speeds[index])!r}")
        lines += ["base_used = 0", "lost = false"]
    return "\n".join(lines) + "\n"


def _size_literal(n_bytes: int) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes % scale == 0:
            return f'"{n_bytes // scale}{unit}"'
    return f"{n_bytes}  # {format_size(n_bytes)}"


# --- CUDA's view -------------------------------------------------------------------------------


def cuda_order(config: SimConfig, env: Mapping[str, str]) -> list[SimGpu]:
    """All cards in the order CUDA enumerates them before CUDA_VISIBLE_DEVICES applies."""
    if env.get("CUDA_DEVICE_ORDER", "").strip() == "PCI_BUS_ID":
        return list(config.gpus)
    # FASTEST_FIRST, CUDA's default; ties keep PCI order (sorted() is stable).
    return sorted(config.gpus, key=lambda gpu: -gpu.speed)


def cuda_visible_gpus(config: SimConfig, env: Mapping[str, str]) -> list[SimGpu]:
    """The cards a CUDA program would see, in CUDA device order (device 0 first).

    As CUDA does: entries of CUDA_VISIBLE_DEVICES are indices into CUDA's order or (unique
    prefixes of) UUIDs, and parsing stops at the first entry that is invalid, unknown or repeated.
    """
    ordered = cuda_order(config, env)
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return ordered
    visible: list[SimGpu] = []
    if not value.strip():
        return visible
    for entry in value.split(","):
        gpu = _match_entry(entry.strip(), ordered)
        if gpu is None or gpu in visible:
            break
        visible.append(gpu)
    return visible


def _match_entry(entry: str, ordered: list[SimGpu]) -> SimGpu | None:
    if re.fullmatch(r"[0-9]+", entry):
        position = int(entry)
        return ordered[position] if position < len(ordered) else None
    if not entry.startswith("GPU-"):
        return None
    matches = [gpu for gpu in ordered if gpu.uuid.startswith(entry)]
    return matches[0] if len(matches) == 1 else None


# --- allocation records ------------------------------------------------------------------------


def _owned_by_another(path: str) -> bool:
    try:
        return os.stat(path).st_uid not in mine()
    except OSError:
        return False


def _unshared(directory: Path, owner: int) -> BackendUnavailable:
    return BackendUnavailable(
        f"the simulated jobs' directory {directory} is uid {owner}'s alone: your simulated jobs "
        "can neither record their memory there nor see the others'",
        hint="to share a simulation, root writes it with `gpuwait sim init FILE --shared`; "
        "or use a simulation file of your own (`gpuwait sim init FILE`)",
        lasting=True,
    )


def ensure_state_dir(config: SimConfig) -> Path:
    """The directory of the allocation records: created private when missing; a shared one
    (`sim init --shared`) must be as safe as a shared ledger directory. Raises
    BackendUnavailable for one this user cannot use."""
    directory = config.state_dir
    try:
        directory.mkdir(mode=0o700, parents=False, exist_ok=True)
        st = os.lstat(directory)
    except OSError as exc:
        raise BackendUnavailable(
            f"the simulated jobs' directory {directory} cannot be used: {exc.strerror or exc}",
            hint=_SHARE_HINT,
            lasting=True,
        ) from None
    shared = is_shared_dir(st)
    if not shared and stat.S_ISDIR(st.st_mode) and st.st_uid != os.getuid():
        raise _unshared(directory, st.st_uid)
    try:
        check_dir(directory, st, private=not shared)
    except UnsafePath as exc:
        raise BackendUnavailable(
            f"{exc.what}; refusing to use it for simulated jobs", lasting=True
        ) from None
    return directory


def make_shared_state_dir(path: str | os.PathLike[str]) -> Path:
    """Root's: the records' directory of a simulation every user may run jobs on (sticky, so
    nobody removes another's records)."""
    directory = state_dir_for(path)
    directory.mkdir(mode=0o700, exist_ok=True)
    if not stat.S_ISDIR(os.lstat(directory).st_mode):
        raise UsageError(f"{directory} is not a directory; remove it first")
    os.chown(directory, 0, 0)
    os.chmod(directory, 0o1777)
    return directory


@contextlib.contextmanager
def sim_lock(config: SimConfig) -> Iterator[Path]:
    """Hold the exclusive simulation lock; yields the state directory."""
    directory = ensure_state_dir(config)
    if not is_shared_dir(os.lstat(directory)):
        with exclusive(directory / "lock"):
            yield directory
        return
    # Shared: the directory itself, root's, which no member can replace or make unusable.
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        flock_within(fd, fcntl.LOCK_EX, None)
        yield directory
    finally:
        os.close(fd)


def _record_path(directory: Path, pid: int) -> Path:
    return directory / f"{pid}.json"


def write_allocation(directory: Path, allocation: Allocation) -> None:
    """Replace the process's record; readers see the old or the new one, never a part."""
    data = json.dumps(allocation.to_json()).encode()
    st = os.lstat(directory)
    if is_shared_dir(st):
        # Readable by the other users' gpuwait; the temporary name is unguessable there. Its
        # group is the one a new file gets anyway (the directory's when setgid): never changed.
        group = st.st_gid if st.st_mode & stat.S_ISGID else os.getegid()
        write_atomic(_record_path(directory, allocation.pid), data, mode=0o644, group=group)
    else:
        write_atomic(_record_path(directory, allocation.pid), data)


def remove_allocation(directory: Path, pid: int) -> None:
    # PermissionError: another user's record in a shared (sticky) directory, left by a dead
    # process; it counts for nothing, and its owner's next job or root removes it.
    with contextlib.suppress(FileNotFoundError, PermissionError):
        _record_path(directory, pid).unlink()


def checkpoint_holds(directory: Path, pid: int, start_time: int) -> bool:
    """cuda-checkpoint holds the simulated process locked (or checkpointed), so that, as the
    driver blocks such a process's CUDA calls until it is unlocked, it allocates nothing.

    The stand-in of a clone (tests/helpers/fake_cuda_checkpoint) keeps the driver's state of a
    process here, in `checkpoint.<pid>.state` ("<state> <start time>"), written under the
    simulation's lock; only this user's (or root's) counts.
    """
    try:
        raw = read_state_file(directory / f"checkpoint.{pid}.state", MAX_RECORD_BYTES, mine())
    except OSError:
        return False
    if raw is None:
        return False
    state, _, since = raw.decode("ascii", errors="replace").strip().partition(" ")
    return state in ("locked", "checkpointed") and since == str(start_time)


def _parse_record(raw: bytes, pid: int) -> Allocation | None:
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):  # damaged, or nested thousands deep
        return None
    if not isinstance(data, dict) or data.get("schema") != RECORD_SCHEMA:
        return None
    fields = (data.get("pid"), data.get("start_time"), data.get("bytes"))
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in fields):
        return None
    uuid = data.get("gpu_uuid")
    if data["pid"] != pid or not isinstance(uuid, str) or data["bytes"] < 0:
        return None
    return Allocation(pid=pid, start_time=data["start_time"], gpu_uuid=uuid, bytes=data["bytes"])


def live_allocations(config: SimConfig, *, prune: bool = False) -> list[Allocation]:
    """Records of processes that still run, sorted by pid.

    `prune` deletes the records of dead processes; do it only while holding `sim_lock`, or a
    new process that got a dead one's pid could lose the record it just wrote.
    """
    directory = config.state_dir
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    except OSError as exc:
        if not prune:
            raise
        raise BackendUnavailable(
            f"the simulated jobs' directory {directory} cannot be read: {exc.strerror}",
            hint=_SHARE_HINT,
            lasting=True,
        ) from None
    live: list[Allocation] = []
    for name in names:
        match = _RECORD_RE.match(name)
        if match is None:
            if prune:
                _prune_temp(directory, name)
            continue
        allocation = _read_record(directory / name, int(match.group(1)))
        if allocation is not None and proc.is_alive(allocation.pid, allocation.start_time):
            live.append(allocation)
        elif allocation is not None and prune:
            remove_allocation(directory, allocation.pid)
    return sorted(live, key=lambda a: a.pid)


def _read_record(path: Path, pid: int) -> Allocation | None:
    # Written by whichever user's simulated job it is; anything but a small plain file is none.
    try:
        raw = read_state_file(path, MAX_RECORD_BYTES, ANYONE)
    except OSError:
        return None
    if raw is None:
        return None
    return _parse_record(raw, pid)


def _prune_temp(directory: Path, name: str) -> None:
    """Temporary files left by a writer that was killed mid-write."""
    match = _TEMP_RE.match(name)
    if match and proc.start_time(int(match.group(1))) is None:
        with contextlib.suppress(OSError):
            (directory / name).unlink()


# --- the backend -------------------------------------------------------------------------------


class SimBackend:
    """Backend that reads the simulation file and the live allocation records."""

    name = "sim"

    def __init__(self, path: str) -> None:
        self.path = path
        # Resolved once: the same file through another name or a relative path is one source.
        self._source = os.path.realpath(path)
        load_sim_file(path)

    def snapshot(self) -> MachineSnapshot:
        config = load_sim_file(self.path)
        gpus: list[GpuSnapshot] = []
        warnings: list[str] = []
        try:
            allocations = live_allocations(config)
        except OSError as exc:
            # Another user's private simulation: its jobs' memory is invisible, and a card
            # would look emptier than it is. Said, not hidden behind "0 B used".
            allocations = []
            warnings.append(
                f"the simulated jobs' memory in {config.state_dir} cannot be read "
                f"({exc.strerror or exc}): used memory is shown without it; a simulation "
                "several users share is made with `gpuwait sim init FILE --shared` (by root)"
            )
        unanswered: list[int] = []
        for gpu in config.gpus:
            if gpu.lost:
                warnings.append(f"GPU {gpu.index} ({gpu.uuid}): GPU is lost; skipped")
                unanswered.append(gpu.index)  # as NVML's GPU_IS_LOST
                continue
            gpus.append(_gpu_snapshot(gpu, allocations))
        return MachineSnapshot(
            backend=self.name,
            gpus=tuple(gpus),
            warnings=tuple(warnings),
            unanswered=tuple(unanswered),
            source=self._source,
        )

    def close(self) -> None:
        pass


def _gpu_snapshot(gpu: SimGpu, allocations: list[Allocation]) -> GpuSnapshot:
    mine = [a for a in allocations if a.gpu_uuid == gpu.uuid]
    processes = tuple(
        ProcessUsage(pid=a.pid, used_bytes=a.bytes if gpu.per_process else None) for a in mine
    )
    return GpuSnapshot(
        index=gpu.index,
        uuid=gpu.uuid,
        name=gpu.name,
        total_bytes=gpu.total_bytes,
        used_bytes=gpu.held_by_none + sum(a.bytes for a in mine),
        driver_bytes=gpu.driver_reserved,
        processes=processes,
        utilization_pct=gpu.utilization,
        compute_capability=gpu.compute_capability,
        compute_mode=gpu.compute_mode,
    )
