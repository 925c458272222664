"""Exceptions that carry a user-facing message and the exit code the CLI ends with."""

from __future__ import annotations

# Documented in docs/exit-codes.md. The command's own status passes through unchanged;
# these are gpuwait's own failures, chosen to stay clear of the common 0/1 of commands.
EXIT_USAGE = 2
EXIT_IMPOSSIBLE = 3
EXIT_NO_GPU = 4
EXIT_STATE = 5
#: `--after-ok` named a job that did not succeed: this one never starts.
EXIT_DEPENDENCY_FAILED = 6
#: `gpuwait cancel` took the job out of the queue while it waited.
EXIT_CANCELLED = 7
#: cancel/pause/resume of another user's job, adopt of another user's process.
EXIT_NOT_PERMITTED = 8
#: `--once KEY`: a job with this key is already waiting or running; nothing was queued.
EXIT_ALREADY_QUEUED = 9
EXIT_TIMEOUT = 124
#: gpuwait's own output went to a reader that had gone away (128 + SIGPIPE).
EXIT_BROKEN_PIPE = 141
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127


class OutputError(OSError):
    """What gpuwait printed on stdout could not be written (a full disk behind `> file`)."""


class GpuwaitError(Exception):
    """A failure that the CLI reports as one line and turns into an exit code."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


class UsageError(GpuwaitError):
    exit_code = EXIT_USAGE


class ImpossibleRequest(GpuwaitError):
    exit_code = EXIT_IMPOSSIBLE


class StuckBehind(ImpossibleRequest):
    """Never beside running jobs that end only after this one (see gpuwait.queue.stuck)."""


class NoGpuTakesJobs(ImpossibleRequest):
    """No GPU here that a job can be placed on: every card in MIG mode, or none listed for this
    process (see gpuwait.core.devices.none_usable)."""


class AlreadyQueued(GpuwaitError):
    """`--once KEY` found a job with that key waiting or running."""

    exit_code = EXIT_ALREADY_QUEUED


#: gpu_error_timeout's default: how long GPU readings may keep failing before gpuwait gives up.
DEFAULT_GPU_ERROR_TIMEOUT = 300.0


class BackendUnavailable(GpuwaitError):
    """No GPU readings can be had (NVML missing or failing, simulation file unusable).

    `lasting`: nothing will change by waiting (no driver on this machine, no simulation file
    there); otherwise the failure may pass (a driver hiccup, a file being saved) and gpuwait
    retries for up to `gpu_error_timeout` before giving up.

    `gpus_here`: a lasting failure on a machine that has GPUs, only none usable until someone
    acts (a driver upgraded without a reboot): `on_no_gpu = run`, for machines without GPUs,
    does not start the command uncoordinated beside the others.
    """

    exit_code = EXIT_NO_GPU

    def __init__(
        self,
        message: str,
        hint: str | None = None,
        *,
        lasting: bool = False,
        gpus_here: bool = False,
    ) -> None:
        super().__init__(message, hint)
        self.lasting = lasting or gpus_here
        self.gpus_here = gpus_here

    @property
    def run_without(self) -> bool:
        """Whether `on_no_gpu = run` may run the command without gpuwait: no GPU can ever be
        read on this machine."""
        return self.lasting and not self.gpus_here


class StateError(GpuwaitError):
    """The state directory or ledger cannot be used."""

    exit_code = EXIT_STATE


class StateShortage(StateError):
    """The ledger cannot be read or written now for want of file descriptors or memory (the
    process's, or the machine's): nothing is wrong with it, and it may pass. A waiter retries
    for up to `lock_timeout`; a command that does not wait ends with exit 5."""
