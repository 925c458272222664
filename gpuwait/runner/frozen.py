"""Freezing, the frozen job's side (`--freezable`, docs/freezing.md).

A more urgent waiter asks a `--freezable` job to step aside exactly as it asks a `--pausable` one
(gpuwait.queue.pausing). The job's own gpuwait then freezes it, with no help from the command:
each process of the command's tree that holds memory on the job's GPUs is locked and
checkpointed by `cuda-checkpoint` (its device memory moves to host memory, the driver releases
its GPU resources), then the whole tree is stopped. The ledger entry waits again, pinned to the
GPUs it had (lifecycle.freeze), and gpuwait waits for it as for any queued job; once a plan
admits it there, its room is reserved again and only then is it thawed: continued, restored and
unlocked (lifecycle.thaw).

A freeze that fails leaves the command running (what was done is undone) and is logged; a thaw
that fails is logged and tried again, with the job's room kept for it. Only where its memory
cannot come back for longer than `gpu_error_timeout` (its GPU lost while it is frozen, or every
restore failing) is the job given up: its command is ended (TERM, then KILL), its entry leaves
the queue, and gpuwait exits 4 saying why (`given_up`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from gpuwait.core.errors import BackendUnavailable
from gpuwait.core.policy import WaitReason
from gpuwait.core.sizes import format_duration, format_setting_duration
from gpuwait.gpu.freezing import TOOL
from gpuwait.linux import proc
from gpuwait.queue import lifecycle
from gpuwait.queue.entries import Job
from gpuwait.queue.ledger import Ledger
from gpuwait.queue.lifecycle import Admitted, Cancelled
from gpuwait.queue.wait import Interrupted, TimedOut, WaitPolicy, wait_for_admission

if TYPE_CHECKING:
    from gpuwait.gpu.backend import Backend
    from gpuwait.runner.session import Reporter

#: How long the lock may wait for the work a process has submitted (`--timeout`, in ms): a lock
#: that does not succeed in time leaves the process running, and the freeze is given up.
LOCK_TIMEOUT_MS = 10_000
#: How long one call of the tool may take: a checkpoint or restore copies the whole device
#: memory between the card and host memory.
TOOL_TIMEOUT_S = 300.0
#: Between two tries of a thaw that failed.
THAW_RETRY_S = 2.0
#: How often a frozen job that waits looks whether the GPU it was frozen on still answers (at
#: most: a quarter of gpu_error_timeout where that is shorter).
GPU_CHECK_S = 10.0
#: Between the TERM and the KILL of a command given up while frozen: a CUDA call it makes
#: blocks for good, and its handler of TERM may make one.
GIVE_UP_GRACE_S = 10.0
#: What to do about a job given up while frozen.
GIVEN_UP_HINT = (
    "check the GPU (nvidia-smi; a lost GPU needs a reset or a reboot), then run the command "
    "again: it lost what it had not saved"
)


class ToolFailed(Exception):
    """`cuda-checkpoint` exited non-zero or did not answer in time; the message is one line."""


class CheckpointTool:
    """`cuda-checkpoint --action ...` on one process (driver 570's utility, which gpuwait
    requires, has --action and a lock with a timeout; --toggle would not bound the lock)."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path or shutil.which(TOOL) or TOOL

    def action(self, action: str, pid: int, *extra: str) -> None:
        args = ["--action", action, "--pid", str(pid), *extra]
        try:
            done = subprocess.run(
                [self.path, *args],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                errors="replace",
                timeout=TOOL_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            raise ToolFailed(
                f"{TOOL} --action {action} --pid {pid}: no answer within {TOOL_TIMEOUT_S:g}s"
            ) from None
        except OSError as exc:
            raise ToolFailed(f"{TOOL}: {exc.strerror}") from None
        if done.returncode != 0:
            said = [line.strip() for line in (done.stderr + done.stdout).splitlines()]
            first = next((line for line in said if line), f"exit status {done.returncode}")
            raise ToolFailed(f"{TOOL} --action {action} --pid {pid}: {first[:300]}")

    def freeze(self, pids: Sequence[int]) -> None:
        """Lock and checkpoint each of `pids`; on a failure undo what was done, and raise."""
        done: list[tuple[int, bool]] = []  # (pid, checkpointed)
        try:
            for pid in pids:
                self.action("lock", pid, "--timeout", str(LOCK_TIMEOUT_MS))
                done.append((pid, False))
                self.action("checkpoint", pid)
                done[-1] = (pid, True)
        except ToolFailed:
            # Back as they were: a job that cannot be frozen runs on. Whatever fails here
            # leaves that process as the tool left it, which nothing better can mend.
            for pid, checkpointed in reversed(done):
                with contextlib.suppress(ToolFailed):
                    if checkpointed:
                        self.action("restore", pid)
                    self.action("unlock", pid)
            raise

    def thaw(self, pid: int, restored: bool) -> None:
        """Restore (unless `restored` already) and unlock one process."""
        if not restored:
            self.action("restore", pid)
        self.action("unlock", pid)


def _signal_all(pids: Iterable[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


class FreezeResponder:
    """Freeze the command once asked to step aside; wait for its room; thaw it there.

    `check` is called often by the supervisor (gpuwait.runner.supervise) and is cheap unless the
    ledger changed; while the job is frozen it does not return: the supervisor has nothing to
    sample or pass on then, and the wait for admission passes signals on itself.
    """

    #: As PauseResponder's: a freezable job has no checkpoint signal, and is never signalled.
    signum = 0
    signalled_at: float | None = None

    def tree(self, child: int) -> set[int]:
        """As PauseResponder's: the processes of the command."""
        return proc.process_tree([child])

    def __init__(
        self,
        ledger: Ledger,
        job: Job,
        backend: Backend,
        policy: WaitPolicy,
        reporter: Reporter,
        tool: CheckpointTool | None = None,
    ) -> None:
        self.ledger = ledger
        self.job = job
        self.backend = backend
        self.policy = policy
        self.reporter = reporter
        self.tool = tool or CheckpointTool()
        self.token: object = None
        #: The request a freeze failed for: not tried again (its asker waits for the job).
        self.failed_for: float | None = None
        #: Why the job was given up while frozen (its memory could not come back for longer
        #: than gpu_error_timeout): its command is ended, and gpuwait ends with this error.
        self.given_up: BackendUnavailable | None = None
        #: When the given-up command, sent TERM, gets KILL.
        self._kill_at: float | None = None
        #: How long its command has been stopped, frozen (monotonic): no run time of the job's,
        #: which did no work and held no room meanwhile.
        self.frozen_seconds = 0.0

    def check(self, child: int) -> None:
        if self.given_up is not None:
            if self._kill_at is not None and time.monotonic() >= self._kill_at:
                self._kill_at = None
                _signal_all(proc.process_tree([child]), signal.SIGKILL)
            return
        token = self.ledger.change_token()
        if token == self.token:
            return
        try:
            entry = self.ledger.read().find(self.job.id)
        except Exception:
            return  # unreadable for now: the command runs on, and the next check looks again
        self.token = token
        if (
            entry is None
            or entry.pause_requested_at is None
            or entry.pause_requested_at == self.failed_for
            or entry.pause_signalled_at is not None
        ):
            return
        # The token stays the one taken before the look: a request written meanwhile shows at
        # the next check (this freeze's own write costs that check one read).
        self._freeze(child, entry.pause_requested_at)

    def _holders(self, tree: set[int]) -> tuple[list[int], str]:
        """The processes of the tree that hold memory on the job's GPUs, as the driver lists
        them (only those have device memory to move), and the GPUs as the user knows them."""
        snapshot = self.backend.snapshot()
        gpus = [g for g in snapshot.gpus if g.uuid in self.job.gpu_uuids]
        pids = {p.pid for gpu in gpus for p in gpu.processes if p.pid in tree}
        return sorted(pids), ", ".join(f"GPU{g.index}" for g in gpus)

    def _freeze(self, child: int, asked_at: float) -> None:
        job = self.job
        tree = proc.process_tree([child])
        try:
            holders, gpus = self._holders(tree)
            if not holders:
                # Nothing to move: stopping it would hand over room it may fill at any moment.
                raise ToolFailed("no process of the job is listed on its GPU")
            self.tool.freeze(holders)
        except Exception as exc:  # a reading or the tool: either way the job runs on
            self.failed_for = asked_at
            error = str(exc) or type(exc).__name__
            with contextlib.suppress(Exception):
                lifecycle.freeze_failed(self.ledger, job.id, error, time.time(), proc.boot_clock())
            self.reporter.warn(f"job {job.id} could not be frozen and runs on: {error}")
            return
        # Stopped only now: lock and checkpoint are carried out inside the process by the
        # driver's own thread, which a stopped process could not run (the lock would time
        # out). Stopped at all so that its CPU side neither runs nor blocks half-way.
        _signal_all(tree, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            job = lifecycle.freeze(self.ledger, job, holders, time.time())
        except Exception as exc:  # the room cannot be handed over: run on where it was
            if not self._thaw_now(child, holders):
                return
            self.failed_for = asked_at
            self.reporter.warn(f"job {job.id} could not be frozen and runs on: {exc}")
            return
        self.reporter.info(
            f"job {job.id} frozen (its GPU memory in host memory); it is thawed on {gpus} "
            "once there is room"
        )
        label = job.name or job.id
        last: list[WaitReason] = []

        def said(reason: WaitReason) -> None:
            if last != [reason]:
                last[:] = [reason]
                self.reporter.waiting(reason, label)

        # Waited for in spells, between which it looks whether its GPU still answers: its
        # memory can come back nowhere else.
        spell = max(0.1, min(GPU_CHECK_S, self.policy.gpu_error_timeout / 4))
        silent_since: float | None = None
        try:
            while True:
                try:
                    job, outcome = wait_for_admission(
                        self.ledger,
                        self.backend,
                        job,
                        self.policy,
                        deadline=proc.boot_clock() + spell,
                        on_reason=said,
                    )
                except BackendUnavailable as exc:  # readings failing past gpu_error_timeout
                    self._give_up(child, exc.message)
                    return
                if not isinstance(outcome, TimedOut):
                    break
                problem = self._silent(job.frozen_gpus, gpus)
                if problem is None:
                    silent_since = None
                    continue
                now = time.monotonic()
                silent_since = now if silent_since is None else silent_since
                if now - silent_since >= self.policy.gpu_error_timeout:
                    lasted = format_duration(now - silent_since)
                    self._give_up(child, f"{problem[0]} for {lasted}{problem[1]}, {self._longer}")
                    return
        finally:
            self.reporter.waited()
            self.frozen_seconds += time.monotonic() - stopped_at
        if isinstance(outcome, Admitted):
            if not self._thaw_now(child, holders):
                return
            with contextlib.suppress(Exception):
                job = lifecycle.thaw(self.ledger, outcome.job, time.time())
            self.reporter.info(f"job {job.id} thawed on {gpus}")
        else:
            # Ended while frozen (a signal, `gpuwait cancel`): the command is continued and
            # told as it would be bare, TERM for a cancel. Its memory stays in host memory
            # (restoring it with no room reserved could take another job's), so a CUDA call
            # it makes now blocks; its end frees everything.
            signum = outcome.signum if isinstance(outcome, Interrupted) else signal.SIGTERM
            if isinstance(outcome, Cancelled):
                self.reporter.info(f"job {job.id} cancelled while frozen; its command gets TERM")
            _signal_all(proc.process_tree([child]), signal.SIGCONT)
            _signal_all([child], signum)
        self.job = job

    def _silent(self, uuids: Sequence[str], gpus: str) -> tuple[str, str] | None:
        """Whether the GPUs the job was frozen on (`gpus`, as the user knows them) all answer
        now: None where they do, else what does not answer and why, said around how long."""
        try:
            snapshot = self.backend.snapshot()
        except BackendUnavailable as exc:
            return "the GPUs could not be read", f" ({exc.message})"
        answering = {g.uuid for g in snapshot.gpus}
        missing = [u for u in uuids if u not in answering]
        if not missing:
            return None
        said = [
            w.removesuffix("; skipped").rpartition(": ")[2]
            for w in snapshot.warnings
            if missing[0] in w
        ]
        return f"{gpus}, where its memory can come back, has not answered", (
            f" ({said[0]})" if said else ""
        )

    @property
    def _longer(self) -> str:
        return (
            "longer than gpu_error_timeout = "
            f"{format_setting_duration(self.policy.gpu_error_timeout)}"
        )

    def _give_up(self, child: int, why: str) -> None:
        """The job's memory cannot come back: end its command (continued, TERM, KILL after
        GIVE_UP_GRACE_S), to be told as gpuwait's error once it has ended."""
        self.given_up = BackendUnavailable(
            f"job {self.job.id} could not be thawed: {why}; its command was ended",
            hint=GIVEN_UP_HINT,
        )
        tree = proc.process_tree([child])
        _signal_all(tree, signal.SIGCONT)
        _signal_all(tree, signal.SIGTERM)
        self._kill_at = time.monotonic() + GIVE_UP_GRACE_S

    def _thaw_now(self, child: int, holders: Sequence[int]) -> bool:
        """Continue the tree, then restore and unlock each process, trying again until it
        works (its room is reserved meanwhile), for gpu_error_timeout at most: False where it
        was given up then."""
        # Continued first, for the same reason it was stopped last: restore and unlock are
        # carried out inside the process. Until the unlock, its CUDA calls block.
        _signal_all(proc.process_tree([child]), signal.SIGCONT)
        restored: set[int] = set()
        pending = list(holders)
        said_once = False
        failing_since: float | None = None
        while pending:
            pid = pending[0]
            if proc.start_time(pid) is None:
                pending.pop(0)  # ended meanwhile: nothing of it to bring back
                continue
            try:
                self.tool.thaw(pid, pid in restored)
            except ToolFailed as exc:
                # Where only the unlock failed, the restore went through: unlock only next.
                if "--action unlock" in str(exc):
                    restored.add(pid)
                with contextlib.suppress(Exception):
                    lifecycle.thaw_failed(self.ledger, self.job.id, str(exc))
                now = time.monotonic()
                failing_since = now if failing_since is None else failing_since
                if now - failing_since >= self.policy.gpu_error_timeout:
                    lasted = format_duration(now - failing_since)
                    self._give_up(child, f"{exc} (failing for {lasted}), {self._longer}")
                    return False
                if not said_once:
                    said_once = True
                    self.reporter.warn(
                        f"job {self.job.id} could not be thawed yet ({exc}); trying again "
                        f"every {THAW_RETRY_S:g}s for up to gpu_error_timeout = "
                        f"{format_setting_duration(self.policy.gpu_error_timeout)}"
                    )
                time.sleep(
                    min(THAW_RETRY_S, max(0.0, failing_since + self.policy.gpu_error_timeout - now))
                )
                continue
            restored.add(pid)
            pending.pop(0)
        return True
