"""Room held for the calling process itself, not for a command it starts (gpuwait.api).

    choose the request ─> submit ─> wait ─> admitted: started, with this process as the
        entry's command ─> sample its usage (a daemon thread) ─> release: finish, record the run

It is the wrapped run of gpuwait.runner.session with the command taken out: the same request,
job, queue and history, through the same helpers. The entry's pid and its command's pid are both
this process's, so however the process ends (SIGKILL too) the next transaction reaps the entry:
no command outlives it, so it is never kept as an orphan.

The waiting blocks gpuwait's signals in the calling thread only, as long as it waits, and takes
them with `sigtimedwait` as the CLI does; the thread's mask is put back afterwards. A signal that
ended the wait is handed back to the process (`Interrupted`). In a process with other threads (a
Jupyter kernel has several) a signal sent to the process may be taken by any thread that does
not block it, so there the waiter polls the queue's summary every `poll_interval` instead of
being woken by a signal, and a Ctrl-C reaches it through Python's own handler.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from gpuwait.core import budget as policy
from gpuwait.core.budget import Budget, Means
from gpuwait.core.errors import (
    EXIT_CANCELLED,
    EXIT_DEPENDENCY_FAILED,
    EXIT_IMPOSSIBLE,
    EXIT_TIMEOUT,
    BackendUnavailable,
    GpuwaitError,
    StateError,
)
from gpuwait.core.estimate import looks_like_oom, near_full
from gpuwait.core.policy import WaitReason
from gpuwait.core.snapshot import GpuSnapshot
from gpuwait.gpu import open_backend
from gpuwait.history.learn import RequestChoice
from gpuwait.linux import proc, signals
from gpuwait.queue import lifecycle
from gpuwait.queue.bookkeeping import ENDED, FAILED, INTERRUPTED, OK, TIMED_OUT
from gpuwait.queue.entries import Job
from gpuwait.queue.ledger import LEAVE_PATIENCE, Ledger, LockBusy, LockPastDeadline
from gpuwait.queue.lifecycle import Cancelled, DependencyFailed
from gpuwait.queue.stuck import Surroundings
from gpuwait.queue.wait import Interrupted, Stuck, TimedOut, wait_for_admission
from gpuwait.runner import session
from gpuwait.runner.launch import command_env, drop_inherited
from gpuwait.runner.session import RunConfig, RunRequest
from gpuwait.runner.supervise import UsageSampler

if TYPE_CHECKING:
    from gpuwait.gpu.backend import Backend
    from gpuwait.runner.session import Reporter


#: How often (seconds) a holding looks, between two samples, whether its entry was lost from a
#: ledger replaced meanwhile (UsageSampler.look_if_changed): a stat(2) of the ledger, which is
#: read only where it changed.
_LOOK_INTERVAL = 1.0


class NotHeld(GpuwaitError):
    """The wait ended without room: timed out, cancelled, a dependency failed (its exit code is
    the CLI's for the same end)."""

    def __init__(self, message: str, exit_code: int, hint: str | None = None) -> None:
        super().__init__(message, hint)
        self.exit_code = exit_code


class WaitInterrupted(Exception):
    """A signal ended the wait (the entry is gone); the caller hands it back to the process."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Holding:
    """Room held for this process on `gpus` (in CUDA_VISIBLE_DEVICES order) until `release`."""

    def __init__(
        self,
        request: RunRequest,
        config: RunConfig,
        reporter: Reporter,
        ledger: Ledger,
        backend: Backend,
        job: Job,
        gpus: Sequence[GpuSnapshot],
        choice: RequestChoice,
        budget: Budget,
        wait_seconds: float,
    ) -> None:
        self.request, self.config, self.reporter = request, config, reporter
        self.ledger, self.backend = ledger, backend
        self.job = job
        self.gpus = tuple(gpus)
        self.choice = choice
        self.budget = budget
        self.wait_seconds = wait_seconds
        self.started_at = time.time()
        #: The process that holds it: a child forked from it holds nothing.
        self.pid = os.getpid()
        self.released = False
        #: Out of the queue: its entry is finished.
        self._out = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sampler = UsageSampler(
            self.pid,
            job,
            ledger,
            backend,
            config.sample_interval,
            baseline_used={g.uuid: g.used_bytes for g in gpus},
            margin=config.estimate_margin,
            baseline_pids={g.uuid: frozenset(p.pid for p in g.processes) for g in gpus},
        )
        self._thread = threading.Thread(target=self._sample, name="gpuwait-usage", daemon=True)
        signals.start_deaf(self._thread)

    @property
    def env(self) -> dict[str, str | None]:
        """What a wrapped command would be given (its GPUs, job and budget), for this process;
        None for what it would not: the caps of the gpuwait job this process runs inside that
        this budget does not set again (enforce = off), taken out as for a command."""
        given = command_env(
            self.job,
            self.gpus,
            self.config.resume_exit,
            by_index=self.config.visible_by_index,
        )
        left = dict(os.environ)
        drop_inherited(left, self.budget.unset)
        wanted: dict[str, str | None] = {name: None for name in os.environ if name not in left}
        wanted.update({k: v for k, v in given.items() if os.environ.get(k) != v})
        wanted.update(self.budget.env)
        return wanted

    def _stop_holding(self) -> bool:
        """Mark it released and stop the sampling; False where this process does not hold it
        (a forked child) or it was released already."""
        if os.getpid() != self.pid:
            return False
        self._stop.set()
        with self._lock:
            if self.released:
                return False
            self.released = True
        return True

    def abandon(self) -> None:
        """Give the room back unused, recording no run: the holder never got it (a Ctrl-C
        as it was handed over)."""
        if not self._stop_holding():
            return
        try:
            with _programs_own_signals():
                _leave(self.config, self.ledger, self.job, INTERRUPTED, self.reporter)
        finally:
            self.backend.close()

    def peak_bytes(self) -> int:
        """The most this process's tree used on one of its GPUs so far."""
        peaks, _ = self._sampler.result.peaks()
        return max(peaks.values(), default=0)

    def _sample(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                if self.released:
                    return
                # A failed reading must never take the holder down with it.
                with contextlib.suppress(Exception):
                    self._sampler.look_if_changed()
                    self._sampler.sample_if_due(time.monotonic())
                wait = self._sampler.next_sample - time.monotonic()
            # Nothing wakes this thread when a damaged ledger is recovered without the entry:
            # it looks at least every _LOOK_INTERVAL, well within the recovery's grace.
            self._stop.wait(max(0.01, min(wait, _LOOK_INTERVAL)))

    def release(self, returncode: int | None = 0, said_oom: bool = False) -> None:
        """Give the room back and record the run; `returncode` 0: ended well, < 0: killed by
        that signal, None: how it ended is unknown (recorded as ENDED, which is no success).
        `said_oom`: the holder ended with an out-of-memory error. Only the process that holds
        it releases."""
        if not self._stop_holding():
            return
        with _programs_own_signals():
            self._release(returncode, said_oom)

    def _release(self, returncode: int | None, said_oom: bool) -> None:
        try:
            self._thread.join(timeout=5)
            result = self._sampler.result
            result.returncode = 0 if returncode is None else returncode
            result.run_seconds = time.monotonic() - self._sampler.started
            # A failed reading of the last figures fails no release; the program's own
            # timeout falling due as the driver answers is the program's.
            with signals.suppress_failures(Exception):
                self._sampler.finish()
            self._finish_and_record(said_oom, known=returncode is not None)
        except BaseException:
            if not self._out:
                # A Ctrl-C halfway: it is released already, so nothing would give the room
                # back before the process ends; it goes back now, with no run recorded.
                _leave(self.config, self.ledger, self.job, INTERRUPTED, self.reporter)
            raise
        finally:
            self.backend.close()

    def _finish_and_record(self, said_oom: bool, known: bool) -> None:
        result, job, config = self._sampler.result, self.job, self.config
        code = result.returncode
        card_full = any(
            near_full(result.free_at_peak_bytes.get(u), total)
            for u, total in result.total_bytes.items()
        )
        oom = known and looks_like_oom(code, said_oom, card_full)
        cause = policy.oom_cause(False, card_full) if oom else None
        evidence = "message" if said_oom else "card full"
        try:
            _leave(
                config,
                self.ledger,
                job,
                (OK if code == 0 else FAILED) if known else ENDED,
                self.reporter,
                exit_status=code if known and code >= 0 else None,
                signal=-code if known and code < 0 else None,
                run_seconds=result.run_seconds,
                charge_usage=(
                    job.reserved_in_all() * result.run_seconds,
                    config.wait.fair.half_life,
                ),
                oom=cause,
            )
        finally:
            # Out, or left to go once the lock is free where a Ctrl-C or the program's own
            # alarm cut the wait for it short: not to be given back a second time.
            self._out = True
        session._record(
            self.request,
            config,
            self.reporter,
            job,
            self.gpus,
            result,
            self.wait_seconds,
            self.started_at,
            self.choice,
            (cause, evidence) if cause else None,
            "off",
            0.0,
            self.budget,
            exit_known=known,
        )


@contextlib.contextmanager
def _signals_taken() -> Iterator[None]:
    """The signals that end a program's wait for room blocked in this thread while it waits
    (they queue up for the waiting loop); the thread's mask as it was afterwards. Its own timers
    and real-time signals stay its own (signals.RESERVING)."""
    mine = signals.taken(signals.RESERVING)
    before = signal.pthread_sigmask(signal.SIG_BLOCK, mine)
    try:
        # Inside: a handler that raises (a Ctrl-C just now) may run at this call, and the
        # signals must not stay blocked after it.
        signals.child_news()  # only what comes while it waits
        # One the program blocked itself is its own (taken by its sigwait), as is any other.
        with signals.waits_blocking(tuple(s for s in mine if s not in before)):
            yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
        # SIGCHLD is also a ledger writer's wake-up: one the wait took for a child of the
        # program's own (a worker that ended) reaches the program's handler now.
        if signals.child_news() and callable(signal.getsignal(signal.SIGCHLD)):
            os.kill(os.getpid(), signal.SIGCHLD)


def _programs_own_signals() -> contextlib.AbstractContextManager[None]:
    """Within: gpuwait's waits for a lock take no signal of the program's, outside the wait for
    room (`_signals_taken`), where gpuwait blocks none: one pending there is one the program
    blocked itself (a TERM held off as it saves), for it to take, not to end gpuwait's wait
    for the ledger's or the history's lock."""
    return signals.waits_blocking(())


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def hold(request: RunRequest, config: RunConfig, reporter: Reporter) -> Holding | None:
    """Wait for room as `request` asks and hold it for this process. None: nothing to hold
    it on, and the settings say to go on anyway (on_no_gpu = run, on_state_error = run).

    Raises NotHeld when the wait ends without room, WaitInterrupted for a signal, and
    gpuwait's other errors as the CLI would end with them.
    """
    # Its timeout counts from the call, on the boot clock, as a launch's --timeout does.
    called = proc.boot_clock()
    choice = session._request(request, config, reporter)
    try:
        backend = session._read_gpus(
            lambda: open_backend(config.sim, config.nvml_timeout), config, reporter, called
        )
    except BackendUnavailable as exc:
        if config.on_no_gpu == "fail" or not exc.run_without:
            raise
        reporter.warn(f"{exc.message}; going on without a reservation (on_no_gpu = run)")
        return None
    try:
        with _programs_own_signals():
            held = _hold(request, config, reporter, backend, choice, called)
    except BaseException:
        backend.close()
        raise
    if held is None:
        backend.close()
    return held


def _hold(
    request: RunRequest,
    config: RunConfig,
    reporter: Reporter,
    backend: Backend,
    choice: RequestChoice,
    called: float,
) -> Holding | None:
    around = Surroundings()
    job, choice = session.prepare_job(
        request,
        config,
        reporter,
        backend,
        choice,
        spell=str,  # reserve()'s keywords: vram, gpus, gpu_name
        around=around,
        counted_from=called,
    )
    wait = config.wait
    if _threads() > 1:
        wait = wait._replace(use_inotify=False)
    ledger = session._ledger(config, reporter)
    label = job.name or job.id

    def said(reason: WaitReason) -> None:
        session._show_warnings(ledger, reporter)
        if choice.note:
            reason = reason._replace(source=choice.note)
        reporter.waiting(reason, label)

    queued = job
    #: Given back already (out, or left to a thread to take out once the lock is free): a
    #: Ctrl-C or the program's own exception that follows must not give it back again.
    given_back = False

    def give_back(outcome: str) -> None:
        nonlocal given_back
        given_back = True
        _leave(config, ledger, job, outcome, reporter)

    try:
        with _signals_taken():
            submitted_from = called
            try:
                deadline = None if config.timeout is None else submitted_from + config.timeout
                with ledger.lock_deadline(deadline):
                    job = session.submit(ledger, job, request, config)
            except signals.SignalPending as exc:
                raise WaitInterrupted(exc.signum) from None
            except LockPastDeadline as exc:
                # Not queued: another process kept the ledger's lock all through the timeout.
                lasted = proc.boot_clock() - submitted_from
                raise NotHeld(session.gave_up(lasted, exc.message), EXIT_TIMEOUT) from None
            except StateError as exc:
                if config.on_state_error != "run":
                    raise
                reporter.warn(
                    f"{exc.message}; going on without a reservation (on_state_error = run)"
                )
                return None
            session._show_warnings(ledger, reporter)
            # The timeout counts a suspend (see wait_for_admission), and the wait for the lock
            # to queue (the deadline above); the wait learned does not.
            waited_from = time.monotonic()
            #: Why it timed out, where another process kept the ledger's lock past the deadline.
            locked_out: str | None = None
            try:
                with ledger.lock_deadline(deadline):
                    job, outcome = wait_for_admission(
                        ledger,
                        backend,
                        job,
                        wait,
                        deadline=deadline,
                        on_reason=said,
                        around=around,
                    )
            except LockPastDeadline as exc:
                outcome, locked_out = TimedOut(None), exc.message
            except BaseException:
                give_back(INTERRUPTED)
                raise
            finally:
                reporter.waited()
                session._show_warnings(ledger, reporter)
            waited = time.monotonic() - waited_from
            waited_in_all = proc.boot_clock() - submitted_from
            if isinstance(outcome, Interrupted):
                give_back(INTERRUPTED)
                raise WaitInterrupted(outcome.signum)
        if isinstance(outcome, TimedOut):
            with ledger.lock_deadline(deadline):
                give_back(TIMED_OUT)
            raise NotHeld(
                session.gave_up(waited_in_all, locked_out or outcome.reason), EXIT_TIMEOUT
            )
        if isinstance(outcome, Cancelled):
            by = outcome.by_uid
            someone = "" if by is None or by == job.uid else f" by uid {by}"
            raise NotHeld(f"job {job.id} cancelled while waiting{someone}", EXIT_CANCELLED)
        if isinstance(outcome, DependencyFailed):
            raise NotHeld(f"job {job.id} will not start: {outcome.message}", EXIT_DEPENDENCY_FAILED)
        if isinstance(outcome, Stuck):
            # The process lives on (a notebook, a program that carries on without): its entry
            # would wait on for nobody, and be admitted into room nobody uses.
            give_back(INTERRUPTED)
            raise NotHeld(outcome.reason, EXIT_IMPOSSIBLE)
        chosen = list(outcome.gpus)
        budget = _budget(config.enforce, job, chosen, reporter)
        try:
            job = lifecycle.started(ledger, job, os.getpid(), budget.held_by)
        except Exception as exc:  # the room is this process's: never give it up over bookkeeping
            if signals.raised_by_a_handler(exc):
                raise  # the program's own timeout: no Reservation reaches it, the room goes back
            reporter.warn(str(exc))
            job = job._replace(child_pid=os.getpid(), pids=[os.getpid()])
        return Holding(
            request, config, reporter, ledger, backend, job, chosen, choice, budget, waited
        )
    except (NotHeld, WaitInterrupted):
        raise
    except BaseException:
        # A Ctrl-C (KeyboardInterrupt) that landed between two steps (just queued, just
        # admitted): nobody got a Holding, and the process, a notebook kernel, lives on, so
        # no reaper would take its place in the queue or its room back.
        if not given_back:
            _leave_if_listed(config, ledger, queued, reporter)
        raise


def _leave(
    config: RunConfig, ledger: Ledger, job: Job, outcome: str, reporter: Reporter, **how: Any
) -> None:
    """`job` out of the queue (lifecycle.finish, with `how`), its wait ended without room or its
    room released, in a program that lives on (a notebook kernel). A lock another process
    keeps is waited for LEAVE_PATIENCE at most, as a launch leaving the queue waits (the signal
    that ended the wait is the program's to handle, its timeout its own, its release its
    own), and the entry is not left for a reaper, which comes only once the process is gone,
    to be admitted meanwhile into room nobody uses (or to keep it): a thread takes it out once
    the lock is free. A Ctrl-C or a handler of the program's that raises (its alarm's
    TimeoutError) in that second leaves the entry to the thread too, and reaches the program."""
    #: The program's own exception that cut the wait for the lock short (a Ctrl-C, its alarm's
    #: handler raising TimeoutError): it reaches the program, the entry left to the thread.
    cut_short: BaseException | None = None
    try:
        with ledger.leaving(), ledger.lock_wait(LEAVE_PATIENCE):
            lifecycle.finish(ledger, job, outcome, **how)
        return
    except (signals.SignalPending, LockBusy):  # past its timeout too (LockPastDeadline)
        pass
    except OSError as exc:
        if not signals.raised_by_a_handler(exc):
            reporter.warn(str(exc))
            return
        cut_short = exc
    except Exception as exc:
        reporter.warn(str(exc))
        return
    except BaseException as exc:
        cut_short = exc
    # Should the program end before the lock is free, its reaper takes the entry out as it
    # ended (taken away again once the thread has taken the entry out).
    lifecycle.leave_word(ledger, job, outcome, **how)

    def later() -> None:
        # A ledger of its own: not bound by the deadline or the patience of the one given.
        mine = session._ledger(config)
        while True:
            try:
                lifecycle.finish(mine, job, outcome, **how)
            except LockBusy:
                continue
            except Exception:  # nothing to say it to: the entry is reaped with the process
                return
            return

    # Where the interpreter is shutting down (a release at the program's exit), Python 3.12
    # starts no thread: the process ends now, and its entry is reaped with it.
    with contextlib.suppress(RuntimeError):
        signals.start_deaf(threading.Thread(target=later, name="gpuwait-leave", daemon=True))
    if cut_short is not None:
        raise cut_short


def _leave_if_listed(config: RunConfig, ledger: Ledger, job: Job, reporter: Reporter) -> None:
    """`job` out of the queue, where it is still in it."""
    with contextlib.suppress(Exception):
        if any(j.id == job.id for j in ledger.read().jobs):
            _leave(config, ledger, job, INTERRUPTED, reporter)


def _budget(mode: str, job: Job, gpus: Sequence[GpuSnapshot], reporter: Reporter) -> Budget:
    """How the reservation is held: only hinted to the frameworks, since the process already
    runs (no cgroup or MPS daemon can be put under it from inside, nor PyTorch's cap before it
    starts)."""
    if mode == policy.LIMIT:
        reporter.warn(
            "enforce = limit holds wrapped commands only; a reservation made from Python is "
            "hinted to the frameworks (enforce = hint)"
        )
        mode = policy.HINT
    return policy.plan(
        mode,
        job.reserved_bytes,
        {g.uuid: g.total_bytes for g in gpus},
        os.environ,
        Means(),
        whole_gpus=not job.request,
    )
