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

from gpuwait.linux import proc, security
from gpuwait.linux.checkpoint_signal import catches, deliver, parse_signal
from gpuwait.queue import lifecycle
from gpuwait.queue.entries import PAUSE, Job, elsewhere
from gpuwait.queue.ledger import Ledger

#: How often a request is looked up again while its asker's gpuwait is stopped (Ctrl-Z) or
#: may have been since the last look: stopping or continuing a process writes nothing in the
#: ledger, so no change of it tells.
LOOK_AGAIN_EVERY = 1.0


class PauseResponder:
    """Signal the command once asked; TERM after the grace if told to."""

    def __init__(self, ledger: Ledger, job: Job) -> None:
        self.ledger = ledger
        self.job = job
        self.signum = parse_signal(job.checkpoint_signal)
        self.token: object = None
        self.requested = False
        #: A request for this job stands whose asker's gpuwait is stopped: no mark
        #: (entries.mark_pause_requests) until it is continued.
        self.unmarked = False
        #: When the request was last looked up (monotonic clock).
        self.looked_at: float | None = None
        #: When the command got its checkpoint signal, on the monotonic clock: the grace is
        #: timed there, so a wall clock stepped forward (NTP) never cuts it short.
        self.signalled_at: float | None = None
        self.killed = False
        #: The other entries of the job's user's as of the last look, and the gpuwait
        #: processes among them (`others`), once asked for.
        self._entries: list[Job] = []
        self._others: frozenset[int] | None = frozenset()
        #: As FreezeResponder's: a pausable job steps aside by ending, never frozen.
        self.frozen_seconds = 0.0

    def look(self, token: object, now: float) -> None:
        """Look the request up (`requested`, `unmarked`) in the ledger as it is now."""
        try:
            data = self.ledger.read()
        except Exception:
            # Unreadable for now (the system out of open files, say): the command runs on,
            # and the next check looks again.
            self.requested = False
            return
        self.token, self.looked_at = token, now
        # Their processes are read once a signal is to be sent (`others`), not on every change
        # of the ledger: a sweep of a thousand entries costs tens of milliseconds to read.
        self._entries, self._others = data.jobs, None
        entry = data.find(self.job.id)
        self.requested = entry is not None and entry.pause_requested_at is not None
        self.unmarked = (
            entry is not None
            and not self.requested
            and any(r.kind == PAUSE and r.targets(entry) for r in data.requests)
        )

    @property
    def others(self) -> frozenset[int]:
        """The gpuwait processes of the other jobs: one in the command's tree runs a job of its
        own (a pipeline's step), whose processes the checkpoint signal is not for."""
        if self._others is None:
            self._others = frozenset(
                j.pid
                for j in self._entries
                if j.id != self.job.id
                # A step runs as the job's own user: another member's entry, naming a process
                # of this job's, must not keep it from its signal.
                and j.uid == self.job.uid
                and not elsewhere(j)
                # A program holding room through gpuwait.reserve() (or %gpuwait) is its own
                # entry's "gpuwait": still this job's command, whose signal it is.
                and j.child_pid != j.pid
                and proc.is_alive(j.pid, j.start_time)
                and security.looks_like_gpuwait(j.pid)
            )
        return self._others

    def tree(self, child: int) -> set[int]:
        """The processes of the command, but for those of the jobs run inside it."""
        return proc.process_tree([child], self.others)

    def check(self, child: int) -> None:
        """Called often by the supervisor: cheap unless the ledger changed or a request waits."""
        if self.killed:
            return
        token = self.ledger.change_token()
        now = time.monotonic()
        stale = self.looked_at is None or now - self.looked_at >= LOOK_AGAIN_EVERY
        if token != self.token or (self.unmarked and stale):
            # Until the command has its signal (and, with --grace-kill, its TERM), the request
            # is looked up again on every change: one withdrawn meanwhile (its asker left, or
            # started elsewhere, or its gpuwait is stopped) is not carried out. Signalled once
            # the command catches the signal, it would step aside and reload for nobody;
            # TERMed, it would die for nobody.
            self.look(token, now)
            stale = False
        if not self.requested:
            return
        if self.signalled_at is None:
            # Only processes that catch the signal get it: one that has not installed its
            # handler yet would be killed by the default action. Asked again next time.
            tree = self.tree(child)
            if not any(catches(pid, self.signum) for pid in tree):
                return
            if stale:
                # Its asker may have been stopped since the last look: looked up again first.
                self.look(token, now)
                if not self.requested:
                    return
            sent = deliver(tree, self.signum)
            if sent:
                self.signalled_at = time.monotonic()
                # Bookkeeping only: the command has its signal whatever the ledger says.
                with contextlib.suppress(Exception):
                    lifecycle.pause_signalled(
                        self.ledger, self.job.id, time.time(), sent, proc.boot_clock()
                    )
        elif self.job.grace_kill and now - self.signalled_at > self.job.grace_seconds:
            if stale:
                # As before the signal: its asker may have been stopped since the last look.
                self.look(token, now)
                if not self.requested:
                    return
            self.killed = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGTERM)
            # Bookkeeping only, as above.
            with contextlib.suppress(Exception):
                lifecycle.grace_killed(self.ledger, self.job.id)
