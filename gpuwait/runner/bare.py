"""Watching a command gpuwait started as its child, whether as a job (`supervise`) or bare
(`run_bare`): passing signals on as the command would have them bare, and stopping, going on
and ending with it.

Light on purpose: a command run bare from a shell hook's subshell starts here, and must not
pay for loading the ledger's or the history's code, which it never uses.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Sequence

from gpuwait.linux import signals
from gpuwait.runner.launch import (
    StartInterrupted,
    command_problem,
    exec_bare,
    spawn_when_possible,
)


def take_stops() -> tuple[tuple[int, ...], set[int | signal.Signals]]:
    """Block SIGTSTP to take it with the rest (unless gpuwait's caller left it ignored: then it
    stops neither gpuwait nor the command, as bare); the signals taken, and the mask before."""
    stops = (signal.SIGTSTP,) if signal.getsignal(signal.SIGTSTP) != signal.SIG_IGN else ()
    return stops, signal.pthread_sigmask(signal.SIG_BLOCK, stops)


def ended(child: int) -> int | None:
    """The command's exit status (os.waitstatus_to_exitcode's) once it has ended, else None. A
    command that stopped by itself meanwhile stops gpuwait with it (`stopped_itself`)."""
    while True:
        waited_pid, status = os.waitpid(child, os.WNOHANG | os.WUNTRACED)
        if waited_pid != child:
            return None
        if not os.WIFSTOPPED(status):
            returncode = os.waitstatus_to_exitcode(status)
            signals.command_ended(child, returncode)
            return returncode
        stopped_itself(child, os.WSTOPSIG(status))


def subshell_ended_with_its_job(info: signal.struct_siginfo, witness: signals.GroupWitness) -> bool:
    """Whether `info` is the TERM asked for the end of the subshell that runs the hook's
    function (`python serve.py &`), which ended of a signal sent to the whole job (`kill -HUP
    %1`, the terminal closed): the command had that signal too, and goes on, or not, as it
    would bare. Not passed on."""
    return signals.parents_end(info) and witness.signalled_lately()


def command_has_it(info: signal.struct_siginfo, witness: signals.GroupWitness) -> bool:
    """Whether `info`'s signal was sent to the whole group (typed at the terminal; kill -PGID,
    `kill %1`, timeout, systemd): the command has it already, and a second copy would not be
    what it would get bare. One that came before the command started (`command_starting`) it
    has not, wherever it came from."""
    if witness.came_before_command(info.si_signo):
        return False
    return witness.sent_to_group(info.si_signo) or signals.came_from_terminal(info)


def run_bare(command: Sequence[str]) -> int:
    """Run the command without a job, as the shell would have run it. gpuwait becomes the
    command (exec), but in a subshell of a shell hook that is to end it with that subshell
    (`python serve.py &`, then `kill $!`: `signals.end_with_parent`). There the command would
    keep that TERM, and have it too where the subshell ended of a signal sent to the whole job,
    which the command had already and may outlive (`kill -HUP %1`, the terminal closed). So
    there gpuwait starts the command as its child and passes signals on as for a job: the
    subshell's end alone ends the command, the job's signal reaches it once. Returns the
    command's exit status; gpuwait ends by the signal that ended the command."""
    if not signals.ends_with_parent():
        return exec_bare(command)
    signals.block_handled()
    # In the group before the command: a signal sent to the group once the command is there
    # (as soon as it has started, ready or not) is one the witness shows too.
    witness = signals.GroupWitness()

    def short_of_processes(exc: OSError) -> tuple[()]:
        witness.close()  # a process too: the command comes first
        return ()

    try:
        child = spawn_when_possible(command, os.environ, (), short_of_processes, witness)
    except StartInterrupted as exc:
        witness.close()
        signals.die_by_signal(exc.signum)
        return 128 + exc.signum
    except OSError as exc:
        witness.close()
        raise command_problem(command, exc) from None
    stops, held = take_stops()
    try:
        while True:
            returncode = ended(child)
            if returncode is not None:
                break
            info = signals.next_signal(1.0, also=stops)
            if info is None or info.si_signo == signal.SIGCHLD:
                continue
            if info.si_signo == signal.SIGTSTP:
                stop_with(child, info, witness)
            elif not (subshell_ended_with_its_job(info, witness) or command_has_it(info, witness)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, info.si_signo)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        witness.close()
    if returncode < 0:
        sys.stdout.flush()
        signals.die_by_signal(-returncode)
        return 128 - returncode
    return returncode


def stop_with(child: int, info: signal.struct_siginfo, witness: signals.GroupWitness) -> None:
    """SIGTSTP taken: the command stops with gpuwait, as the job would bare, and goes on with
    it once gpuwait is continued: by the whole job (`fg`), or by gpuwait's pid alone (`kill
    -CONT PID`, `gpuwait cancel`, which continues a stopped job pid by pid). A command left
    stopped from the job's own stop would otherwise be taken, at the next look, for one that
    stopped by itself, and gpuwait would stop again, for good."""
    if not (signals.came_from_terminal(info) or witness.sent_to_group(signal.SIGTSTP)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGTSTP)
    signals.stop_by(signal.SIGTSTP)
    with contextlib.suppress(ProcessLookupError):
        os.kill(child, signal.SIGCONT)


def stopped_itself(child: int, signum: int) -> None:
    """The command stopped while gpuwait was not (a program's own suspend, as ssh's `~^Z`; a
    `kill -STOP` aimed at it): where gpuwait leads a job of a job control shell, the job stops
    with it, by the same signal, as it would bare: the shell says `Stopped` and takes the
    terminal back, where it would otherwise wait for a command that waits to be continued.
    Continued (`fg`, `bg`), the command goes on with gpuwait; the command continued alone
    (`kill -CONT PID`, or ended), gpuwait goes on too (`signals.waker`). Elsewhere (a script,
    a service) nobody would take the terminal back, and gpuwait waits for its command as the
    caller would bare; stopped too, it would stay stopped once the command alone was
    continued."""
    if not signals.leads_a_job():
        return
    # Continued by its pid alone (`kill -CONT PID`), the command goes on as it would bare, and
    # gpuwait with it: the shell sees the job run on and end.
    waker = signals.waker(child)
    try:
        if signum in signals.TERMINAL_STOPS and signal.getsignal(signum) != signal.SIG_IGN:
            signals.stop_by(signum)
        else:
            os.kill(os.getpid(), signal.SIGSTOP)
    finally:
        signals.end_waker(waker)
    with contextlib.suppress(ProcessLookupError):
        os.kill(child, signal.SIGCONT)
