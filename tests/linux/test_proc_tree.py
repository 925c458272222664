"""A command's process tree, as gpuwait samples its VRAM and signals it: every descendant,
grandchildren and children of the command's other threads included, with or without the
kernel's per-thread children lists. Real processes, always reaped."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.waiting import wait_for

from gpuwait.linux import proc

# A shell whose child shell has a child of its own, and a second child: four processes.
_NESTED = "sh -c 'sleep 60 & wait' & sleep 60 & wait"
# A Python process whose second thread starts the child (as a data loader's worker pool may).
_THREADED = (
    "import subprocess, threading, time\n"
    "t = threading.Thread(target=lambda: subprocess.Popen(['sleep', '60']))\n"
    "t.start(); t.join(); time.sleep(60)\n"
)


@pytest.fixture
def spawn() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        # Each in its own group: the whole tree goes, grandchildren included.
        with contextlib.suppress(OSError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def _start(started: list[subprocess.Popen[bytes]], argv: list[str]) -> int:
    p = subprocess.Popen(argv, start_new_session=True)
    started.append(p)
    return p.pid


def _scanned(root: int) -> set[int]:
    """The tree found by reading every process's parent (what every kernel offers)."""
    parents = proc.children_map()
    seen, stack = set(), [root]
    while stack:
        pid = stack.pop()
        if pid not in seen:
            seen.add(pid)
            stack.extend(parents.get(pid, ()))
    return seen


def _sleeps(pids: set[int]) -> int:
    return sum(proc.command_name(p) == "sleep" for p in pids)


@pytest.fixture(params=[True, False], ids=["children-lists", "scan"])
def walk(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test once through the kernel's children lists and once through the full scan."""
    if request.param and not proc.children_lists():
        pytest.skip("this kernel has no /proc/PID/task/TID/children")
    monkeypatch.setattr(proc, "_children_lists", request.param)


@pytest.mark.usefixtures("walk")
def test_the_tree_holds_grandchildren(spawn: list[subprocess.Popen[bytes]]) -> None:
    root = _start(spawn, ["sh", "-c", _NESTED])
    wait_for(lambda: _sleeps(_scanned(root)) == 2, timeout=10)

    tree = proc.process_tree([root])

    assert tree == _scanned(root)
    assert len(tree) == 4 and _sleeps(tree) == 2


@pytest.mark.usefixtures("walk")
def test_the_tree_holds_children_started_by_another_thread(
    spawn: list[subprocess.Popen[bytes]],
) -> None:
    root = _start(spawn, [sys.executable, "-c", _THREADED])
    wait_for(lambda: _sleeps(_scanned(root)) == 1, timeout=10)

    assert _sleeps(proc.process_tree([root])) == 1


def test_a_process_that_is_gone_is_its_own_tree(spawn: list[subprocess.Popen[bytes]]) -> None:
    root = _start(spawn, ["true"])
    spawn[-1].wait()  # reaped: its /proc entry is gone
    assert proc.process_tree([root]) == {root}


def test_many_children_are_all_found(spawn: list[subprocess.Popen[bytes]]) -> None:
    # More children than one read of the list holds (a pid and a space each).
    count = 800
    root = _start(spawn, ["sh", "-c", f"for i in $(seq {count}); do sleep 60 & done; wait"])
    wait_for(lambda: _sleeps(_scanned(root)) == count, timeout=60)

    assert proc.process_tree([root]) == _scanned(root)


#: A Python process that says "ready" once its SIGCHLD is set up as the test asks.
_SIGCHLD_SET = (
    "import signal, sys, threading, time\n"
    "how = sys.argv[1]\n"
    "if how != 'default':\n"
    "    signal.signal(signal.SIGCHLD, lambda *_: None)\n"
    "if how in ('blocked', 'blocked but in a thread'):\n"
    "    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})\n"
    "if how == 'blocked but in a thread':\n"
    "    unblocked = threading.Event()\n"
    "    threading.Thread(\n"
    "        target=lambda: (signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD}),\n"
    "                        unblocked.set(), time.sleep(60)), daemon=True).start()\n"
    "    unblocked.wait()\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


@pytest.mark.parametrize(
    ("how", "runs"),
    [
        ("default", False),
        ("caught", True),
        ("blocked", False),
        ("blocked but in a thread", True),
    ],
)
def test_a_process_runs_its_own_sigchld_handler_only_where_a_thread_takes_it(
    how: str, runs: bool
) -> None:
    # A program holding its GPU through gpuwait.reserve(), with a SIGCHLD handler of its own,
    # is not woken after a ledger's recovery: the signal would run its handler though no child
    # of its ended. One that blocks SIGCHLD in every thread (as a reservation's wait does), or
    # has no handler, takes no harm, and is woken.
    child = subprocess.Popen(
        [sys.executable, "-c", _SIGCHLD_SET, how], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        assert proc.runs_handler(child.pid, signal.SIGCHLD) is runs
        assert proc.runs_handler(child.pid, signal.SIGUSR2) is False
    finally:
        child.kill()
        child.wait()
    # Gone, it runs nothing.
    assert proc.runs_handler(child.pid, signal.SIGCHLD) is False


#: A Python process with a SIGCHLD handler and a thread open to SIGCHLD, whose main thread
#: waits for SIGCHLD in sigtimedwait (as a reservation's wait does) once it says "ready".
_MAIN_WAITS_FOR_SIGCHLD = (
    "import signal, threading, time\n"
    "signal.signal(signal.SIGCHLD, lambda *_: None)\n"
    "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})\n"
    "print('ready', flush=True)\n"
    "signal.sigtimedwait({signal.SIGCHLD}, 60)\n"
)


def test_a_sigchld_its_main_thread_waits_for_runs_no_handler_whatever_other_threads_do() -> None:
    # The kernel hands a process's signal to its main thread first where that one is open to
    # it: a main thread asleep in sigtimedwait for SIGCHLD (a program waiting for room in
    # gpuwait.reserve()) takes it there, though another thread of it would run the handler.
    # Such a program is woken after a ledger's recovery, its wait taking the signal.
    child = subprocess.Popen(
        [sys.executable, "-c", _MAIN_WAITS_FOR_SIGCHLD], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        wchan = f"/proc/{child.pid}/task/{child.pid}/wchan"
        wait_for(lambda: b"sigtimedwait" in Path(wchan).read_bytes())
        assert proc.runs_handler(child.pid, signal.SIGCHLD) is False
    finally:
        child.kill()
        child.wait()
