"""Cooperative pausing, the paused job's side: its own gpuwait notices that a more urgent waiter
asked it to step aside (gpuwait.queue.pausing), sends the command its checkpoint signal, and,
with --grace-kill, TERM once the grace has passed. When the command then exits with the resume
status, the runner puts the job back in the queue (gpuwait.queue.lifecycle.step_aside).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

from gpuwait.linux import proc
from gpuwait.linux.checkpoint_signal import deliver, parse_signal
from gpuwait.queue import lifecycle
from gpuwait.queue.entries import Job
from gpuwait.queue.ledger import Ledger


class PauseResponder:
    """Signal the command once asked; TERM after the grace if told to."""

    def __init__(self, ledger: Ledger, job: Job) -> None:
        self.ledger = ledger
        self.job = job
        self.signum = parse_signal(job.checkpoint_signal)
        self.token: object = None
        self.requested = False
        #: When the command got its checkpoint signal, on the monotonic clock: the grace is
        #: timed there, so a wall clock stepped forward (NTP) never cuts it short.
        self.signalled_at: float | None = None
        self.killed = False
        #: As FreezeResponder's: a pausable job steps aside by ending, never frozen.
        self.frozen_seconds = 0.0

    def check(self, child: int) -> None:
        """Called often by the supervisor: cheap unless the ledger changed or a request waits."""
        token = self.ledger.change_token()
        if not self.killed and token != self.token:
            # Until the command has its signal (and, with --grace-kill, its TERM), the request
            # is looked up again on every change: one withdrawn meanwhile (its asker left, or
            # started elsewhere) is not carried out. Signalled once the command catches the
            # signal, it would step aside and reload for nobody; TERMed, it would die for nobody.
            try:
                entry = self.ledger.read().find(self.job.id)
            except Exception:
                # Unreadable for now (the system out of open files, say): the command runs on,
                # and the next check looks again.
                entry = None
            else:
                self.token = token
            self.requested = entry is not None and entry.pause_requested_at is not None
        if not self.requested:
            return
        if self.signalled_at is None:
            # Only processes that catch the signal get it: one that has not installed its
            # handler yet would be killed by the default action. Asked again next time.
            sent = deliver(proc.process_tree([child]), self.signum)
            if sent:
                self.signalled_at = time.monotonic()
                # Bookkeeping only: the command has its signal whatever the ledger says.
                with contextlib.suppress(Exception):
                    lifecycle.pause_signalled(
                        self.ledger, self.job.id, time.time(), sent, proc.boot_clock()
                    )
        elif (
            self.job.grace_kill
            and not self.killed
            and time.monotonic() - self.signalled_at > self.job.grace_seconds
        ):
            self.killed = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGTERM)
            # Bookkeeping only, as above.
            with contextlib.suppress(Exception):
                lifecycle.grace_killed(self.ledger, self.job.id)
