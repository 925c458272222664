"""Watch the command's stderr for CUDA out-of-memory messages, without changing what it shows.

What gpuwait's stderr is decides how (or whether) it is watched:
- a terminal: not watched. Putting a pipe between the command and the terminal would change
  what the command sees (isatty, colours, progress bars), so OOMs are told by the card filling up.
- a regular file (`2>log`): not touched at all; once the command has ended, what it appended is
  read back from the file.
- a pipe (`2>&1 | tee log`, a CI runner, subprocess capture): the command writes into a pipe read
  by a small relay process, which passes every byte on unchanged, as soon as it arrives, and gives
  gpuwait a copy to read. When stdout is the same pipe, both go through the one relay pipe, so
  their order is kept. The relay is a process of its own, not a part of gpuwait, so that the
  command's output outlives gpuwait however gpuwait ends (even by SIGKILL: the command would
  otherwise die of SIGPIPE at its next write), and so that what a process the command left behind
  writes later still arrives: the relay ends when the last writer has closed the pipe.
- anything else (a socket, /dev/null): not watched.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import sys
import time
from typing import TYPE_CHECKING

from gpuwait.core.estimate import oom_wanted
from gpuwait.linux import signals
from gpuwait.linux.signals import FORWARDED

if TYPE_CHECKING:
    import threading

#: Lower-case markers of a GPU out-of-memory failure, as PyTorch, TensorFlow, JAX/XLA, CuPy,
#: cuBLAS and the CUDA runtime and driver APIs print them.
OOM_MARKERS = (
    b"cuda out of memory",
    b"outofmemoryerror",
    b"cuda_error_out_of_memory",
    b"cuda error: out of memory",
    b"cudaerrormemoryallocation",
    b"cublas_status_alloc_failed",
    b"cudnn_status_alloc_failed",
    b"resource_exhausted: out of memory",
    b"oom when allocating tensor",
)
#: Lower-case marks of a program that read CUDA_VISIBLE_DEVICES as numbers and stopped at a
#: UUID: Python's int() of a `GPU-...` or `MIG-...` entry, as vLLM does.
NUMBERS_MARKERS = (
    b"invalid literal for int() with base 10: 'gpu-",
    b"invalid literal for int() with base 10: 'mig-",
)
_KEEP = max(len(m) for m in (*OOM_MARKERS, *NUMBERS_MARKERS)) - 1
#: How much of an OOM message is kept from its marker on: PyTorch's says what the process had
#: and tried to allocate within its first few hundred bytes.
SAID_BYTES = 2048
#: How much of a log file is read back: an OOM traceback sits near the end.
READ_BACK_BYTES = 1 << 20
#: After the command ended, read the relay's copy at most this long (what a process left behind
#: writes later still reaches stderr, only unwatched).
_DRAIN_SECONDS = 0.5
#: How long `give_up` waits for the relay to end (it ends at once unless its output is stuck).
_REAP_SECONDS = 1.0

#: The relay: fd 0 the command's pipe, fd 1 gpuwait's stderr, fd 3 gpuwait's copy. Its stderr is
#: /dev/null and the signals a group gets are blocked: it ends when every writer has closed the
#: pipe, or as soon as nobody reads its own stderr any more (the reader of `2>&1 | head` gone:
#: poll tells, before the command writes again), so that the command's next write breaks its
#: pipe, as it would bare.
RELAY = """
import os, select
try:  # its name in top and `ps -o comm` (a fork of gpuwait would otherwise pass for gpuwait)
    with open("/proc/self/comm", "w") as f:
        f.write("gpuwait-stderr")
except OSError:
    pass
def put(fd, data):
    while data:
        data = data[os.write(fd, data):]
copy = True
poller = select.poll()
poller.register(0, select.POLLIN)
poller.register(1, 0)  # only its error: the reader downstream has gone
while True:
    if any(fd == 1 for fd, _ in poller.poll()):
        break
    data = os.read(0, 65536)
    if not data:
        break
    try:
        put(1, data)
    except OSError:
        break
    if copy:
        try:
            put(3, data)
        except OSError:
            copy = False
"""


class OomScanner:
    """Finds OOM markers in a byte stream fed in pieces (a marker may span two pieces), and a
    program that wanted GPU numbers where it found UUIDs (`numbers`). Pure.

    `said`: the last OOM message, from its marker on (SAID_BYTES at most): where frameworks
    say how much they had and tried to allocate. The last, as the one that ended the program:
    an earlier one it caught and went on from (a server refusing one huge request, a batch
    size halved) says nothing of what it needed."""

    def __init__(self) -> None:
        self.found = False
        self.numbers = False
        self.said = b""
        self._tail = b""
        #: What an earlier message said it needed, for a last one that says no size.
        self._wanted_before: int | None = None

    def feed(self, data: bytes) -> None:
        if not data:
            return
        data = data.lower()
        text = self._tail + data
        starts = sorted(
            {
                at
                for marker in OOM_MARKERS
                for at in _occurrences(text, marker)
                if at + len(marker) > len(self._tail)  # not one seen in the last piece
            }
        )
        if self.found and len(self.said) < SAID_BYTES:
            # The message goes on, up to where the next one starts.
            upto = starts[0] - len(self._tail) if starts else len(data)
            self.said = (self.said + data[: max(0, upto)])[:SAID_BYTES]
        for at, end in zip(starts, [*starts[1:], len(text)], strict=False):
            self._wanted_before = self.wanted_bytes or self._wanted_before
            self.found = True
            self.said = text[at : min(end, at + SAID_BYTES)]
        if not self.numbers and any(marker in text for marker in NUMBERS_MARKERS):
            self.numbers = True
        self._tail = text[-_KEEP:]

    @property
    def wanted_bytes(self) -> int | None:
        """What the last OOM message says the program needed at the least
        (core.estimate.oom_wanted), or where it says no size, the last one that did."""
        if not self.found:
            return None
        return oom_wanted(self.said.decode("utf-8", "replace")) or self._wanted_before


def _occurrences(text: bytes, marker: bytes) -> list[int]:
    found: list[int] = []
    at = text.find(marker)
    while at >= 0:
        found.append(at)
        at = text.find(marker, at + 1)
    return found


class StderrWatch:
    """Set up before the command starts; `finish()` after it ended says whether it printed an OOM."""

    def __init__(self, enabled: bool = True) -> None:
        self.scanner = OomScanner()
        self.mode = "off"
        self.why_off = "disabled (watch_stderr = off)"
        #: The read end of the relay's copy, and the write end the command gets.
        self._copy_fd: int | None = None
        self._write_fd: int | None = None
        self._relay_pid: int | None = None
        self._also_stdout = False
        self._file_start = 0
        self._thread: threading.Thread | None = None
        self._stop: threading.Event | None = None
        if enabled:
            self._decide()

    def _decide(self) -> None:
        try:
            err = os.fstat(2)
        except OSError:
            self.why_off = "stderr is closed"
            return
        if os.isatty(2):
            self.why_off = "stderr is a terminal"
        elif stat.S_ISREG(err.st_mode):
            self.mode, self._file_start = "file", err.st_size
        elif stat.S_ISFIFO(err.st_mode):
            with contextlib.suppress(OSError):
                out = os.fstat(1)
                self._also_stdout = (out.st_dev, out.st_ino) == (err.st_dev, err.st_ino)
            if self._start_relay():
                self.mode = "pipe"
            else:
                self.why_off = "the stderr relay could not start"
        else:
            self.why_off = "stderr is neither a file nor a pipe"

    def _start_relay(self) -> bool:
        # Every pipe is close-on-exec: only the relay's copies survive into it.
        try:
            read_end, write_end = os.pipe()
        except OSError:
            return False  # no descriptors left (`ulimit -n`): the command runs unwatched
        try:
            copy_read, copy_write = os.pipe()
        except OSError:
            os.close(read_end)
            os.close(write_end)
            return False
        try:
            self._relay_pid = _fork_relay(read_end, copy_write)
            if self._relay_pid is None:
                self._relay_pid = _spawn_relay(read_end, copy_write)
        except (OSError, ValueError):
            for fd in (write_end, copy_read):
                os.close(fd)
            return False
        finally:
            os.close(read_end)
            os.close(copy_write)
        self._write_fd, self._copy_fd = write_end, copy_read
        return True

    def file_actions(self) -> list[tuple[int, int, int]]:
        """posix_spawn file actions that give the command the relay pipe."""
        if self._write_fd is None:
            return []
        actions = [(os.POSIX_SPAWN_DUP2, self._write_fd, 2)]
        if self._also_stdout:
            actions.insert(0, (os.POSIX_SPAWN_DUP2, self._write_fd, 1))
        return actions

    def started(self) -> None:
        """The command runs: from now on only it holds the write end."""
        if self._write_fd is None:
            return
        # Imported here: only a pipe needs a thread, and a launch should not pay for it otherwise.
        import threading

        os.close(self._write_fd)
        self._write_fd = None
        self._stop = threading.Event()
        thread = threading.Thread(target=self._scan, name="gpuwait-stderr", daemon=True)
        try:
            signals.start_deaf(thread)
        except RuntimeError:
            # No thread to be had (a pids cgroup or `ulimit -u` reached): the command runs, so
            # gpuwait goes on without the copy. The relay, its copy gone, passes output on.
            self.mode, self.why_off = "off", "no thread could be started to read it"
            self._close()
            return
        self._thread = thread

    def _scan(self) -> None:
        with contextlib.suppress(OSError):
            self._scan_until_done()

    def _scan_until_done(self) -> None:
        import select

        fd, stop = self._copy_fd, self._stop
        assert fd is not None and stop is not None
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        drain_until: float | None = None
        while True:
            if stop.is_set() and drain_until is None:
                drain_until = time.monotonic() + _DRAIN_SECONDS
            if drain_until is not None and time.monotonic() > drain_until:
                return
            if not poller.poll(100):
                continue
            data = os.read(fd, 65536)
            if not data:
                return  # the relay passed on everything and ended
            self.scanner.feed(data)

    def finish(self) -> bool | None:
        """After the command ended: True if it printed an OOM marker, None if not watched.

        In pipe mode, waits (briefly) until the relay has passed on the command's last bytes, so
        gpuwait's own last words come after them."""
        if self.mode == "file":
            return self._read_back()
        if self.mode != "pipe":
            return None
        if self._stop is not None:
            self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._close()
        return self.scanner.found

    def abandon(self) -> None:
        """The command never started: the relay sees the pipe close and ends."""
        self._close()

    def give_up(self) -> None:
        """Before the command starts, where it cannot for want of processes: the relay is one,
        and the command comes first. The relay sees its pipe close, ends and is reaped (given
        a moment), and the command's stderr is gpuwait's own, unwatched."""
        relay = self._relay_pid
        self._relay_pid = None
        self._close()
        if self.mode == "pipe":
            self.mode, self.why_off = "off", "no process to spare for the relay"
        deadline = time.monotonic() + _REAP_SECONDS
        while relay is not None and time.monotonic() < deadline:
            try:
                if os.waitpid(relay, os.WNOHANG)[0]:
                    return
            except ChildProcessError:
                return
            time.sleep(0.005)

    def _close(self) -> None:
        for fd in (self._write_fd, self._copy_fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._write_fd = self._copy_fd = None
        if self._relay_pid is not None:
            # Reaped when it is done; one still relaying for a process left behind is
            # reaped by init once gpuwait exits.
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self._relay_pid, os.WNOHANG)
            self._relay_pid = None

    def _read_back(self) -> bool | None:
        try:
            fd = os.open("/proc/self/fd/2", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None  # a log file we may write but not read
        try:
            end = os.fstat(fd).st_size
            start = max(self._file_start, end - READ_BACK_BYTES)
            if end < self._file_start:
                start = max(0, end - READ_BACK_BYTES)  # truncated meanwhile
            scanner = self.scanner = OomScanner()
            position = start
            while position < end:
                data = os.pread(fd, min(65536, end - position), position)
                if not data:
                    break
                scanner.feed(data)
                position += len(data)
            return scanner.found
        except OSError:
            return None
        finally:
            os.close(fd)


def _fork_relay(read_end: int, copy_write: int) -> int | None:
    """The relay as a fork of gpuwait (about 1 ms, against 10 ms for a new interpreter), or None
    while other threads run: a fork would copy them mid-call (an NVML reading, say)."""
    threading = sys.modules.get("threading")
    if threading is not None and threading.active_count() > 1:
        return None
    pid = os.fork()
    if pid:
        return pid
    try:  # pragma: no cover - runs in the relay
        os.setsid()
        os.dup2(2, 1)
        os.dup2(read_end, 0)
        os.dup2(copy_write, 3)
        # None of gpuwait's files (the ledger's lock, NVML's device files) stay open in it; and
        # closed first, so that /dev/null has a descriptor to open where gpuwait had none left
        # (a relay ending here would kill the command by SIGPIPE at its first write).
        os.closerange(4, os.sysconf("SC_OPEN_MAX"))
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 2)
        os.close(null)
        signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
        exec(RELAY, {})
    finally:
        os._exit(0)


def _spawn_relay(read_end: int, copy_write: int) -> int:
    return os.posix_spawn(
        sys.executable,
        [sys.executable, "-I", "-S", "-c", RELAY],
        {},
        file_actions=[
            (os.POSIX_SPAWN_DUP2, 2, 1),
            (os.POSIX_SPAWN_DUP2, read_end, 0),
            (os.POSIX_SPAWN_DUP2, copy_write, 3),
            (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0),
        ],
        # Out of the terminal's and the group's reach: it must pass on what the command writes
        # after Ctrl-C or a TERM, and end only when the command's output does.
        setsid=True,
        setsigmask=FORWARDED,
    )
