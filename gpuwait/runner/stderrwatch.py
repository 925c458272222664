"""Watch the command's stderr for CUDA out-of-memory messages, without changing what it shows.

What gpuwait's stderr is decides how (or whether) it is watched:
- a terminal: not watched. Putting a pipe between the command and the terminal would change
  what the command sees (isatty, colours, progress bars), so OOMs are told by the card filling up.
- a regular file (`2>log`): not touched at all; once the command has ended, what it appended is
  read back from the file.
- a pipe (`2>&1 | tee log`, a CI runner, subprocess capture): the command writes into a pipe of
  gpuwait's, and gpuwait passes every byte on unchanged, as soon as it arrives. When stdout is the
  same pipe, both go through the one relay pipe, so their order is kept. If a process the command
  left behind still holds the pipe when the command ends, the rest is handed to a detached `cat`,
  so nothing it writes later is lost.
- anything else (a socket, /dev/null): not watched.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import threading

#: Lower-case markers of a GPU out-of-memory failure, as PyTorch, TensorFlow, JAX/XLA, CuPy,
#: cuBLAS and the CUDA runtime and driver APIs print them.
OOM_MARKERS = (
    b"cuda out of memory",
    b"outofmemoryerror",
    b"cuda_error_out_of_memory",
    b"cudaerrormemoryallocation",
    b"cublas_status_alloc_failed",
    b"cudnn_status_alloc_failed",
    b"resource_exhausted: out of memory",
    b"oom when allocating tensor",
)
_KEEP = max(len(m) for m in OOM_MARKERS) - 1
#: How much of a log file is read back: an OOM traceback sits near the end.
READ_BACK_BYTES = 1 << 20
#: After the command ended, keep relaying at most this long before handing over to `cat`.
_DRAIN_SECONDS = 0.5


class OomScanner:
    """Finds OOM markers in a byte stream fed in pieces (a marker may span two pieces). Pure."""

    def __init__(self) -> None:
        self.found = False
        self._tail = b""

    def feed(self, data: bytes) -> None:
        if self.found or not data:
            return
        text = self._tail + data.lower()
        if any(marker in text for marker in OOM_MARKERS):
            self.found = True
        self._tail = text[-_KEEP:]


class StderrWatch:
    """Set up before the command starts; `finish()` after it ended says whether it printed an OOM."""

    def __init__(self, enabled: bool = True) -> None:
        self.scanner = OomScanner()
        self.mode = "off"
        self.why_off = "disabled (watch_stderr = off)"
        self._read_fd: int | None = None
        self._write_fd: int | None = None
        self._target = 2
        self._also_stdout = False
        self._file_start = 0
        self._thread: threading.Thread | None = None
        self._stop: threading.Event | None = None
        self._eof = False
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
            self._read_fd, self._write_fd = os.pipe()  # both close-on-exec
            self.mode = "pipe"
        else:
            self.why_off = "stderr is neither a file nor a pipe"

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
        self._thread = threading.Thread(target=self._relay, name="gpuwait-stderr", daemon=True)
        self._thread.start()

    def _relay(self) -> None:
        try:
            self._relay_until_done()
        except OSError:
            self._eof = True  # the pipe broke: nothing more can come through it

    def _relay_until_done(self) -> None:
        import select

        fd, stop = self._read_fd, self._stop
        assert fd is not None and stop is not None
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        drain_until: float | None = None
        while True:
            if stop.is_set() and drain_until is None:
                drain_until = time.monotonic() + _DRAIN_SECONDS
            if drain_until is not None and time.monotonic() > drain_until:
                return
            if not poller.poll(0 if drain_until is not None else 100):
                if drain_until is not None:
                    return  # nothing more for now: whoever still holds the pipe gets `cat`
                continue
            data = os.read(fd, 65536)
            if not data:
                self._eof = True
                return
            self.scanner.feed(data)
            if not _write_all(self._target, data):
                # Our stderr is gone: the command must see a broken pipe too, as it would bare.
                self._eof = True
                return

    def finish(self) -> bool | None:
        """After the command ended: True if it printed an OOM marker, None if not watched."""
        if self.mode == "file":
            return self._read_back()
        if self.mode != "pipe":
            return None
        if self._stop is not None:
            self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._close(handover=not self._eof)
        return self.scanner.found

    def abandon(self) -> None:
        """The command never started."""
        for fd in (self._write_fd, self._read_fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._write_fd = self._read_fd = None

    def _close(self, handover: bool) -> None:
        fd = self._read_fd
        if fd is None:
            return
        self._read_fd = None
        if handover:
            with contextlib.suppress(OSError):
                os.posix_spawnp(
                    "cat",
                    ["cat"],
                    dict(os.environ),
                    file_actions=[(os.POSIX_SPAWN_DUP2, fd, 0), (os.POSIX_SPAWN_DUP2, 2, 1)],
                    setsid=True,
                    setsigmask=(),
                )
        os.close(fd)

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
            scanner = OomScanner()
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


def _write_all(fd: int, data: bytes) -> bool:
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except InterruptedError:
            continue
        except OSError:
            return False
        view = view[written:]
    return True
