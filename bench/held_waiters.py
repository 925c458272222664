"""Waiters held after damage: what N of them cost while held, and what they do when let go.

A ledger started afresh after damage holds every launch of a user for its grace (30 s) while
a job of theirs holds a liveness lock without an entry: each held waiter looks four times a
second at that job's lock (gpuwait.linux.alive.still_held), in every lock directory of the
ledger directory. Here the lock is held by a process of its own, taken before the ledger
began, and N waiters of 4 GiB each (5 fit on the simulated 24 GiB card) are held; the
grace is made 5 minutes so that a slow machine's launches all fall in it.

`--lock-dirs D --jobs-per-dir J` (root only) adds D lock directories of other users with J
lock files each, as a shared ledger with D other members has; without root, none.

Printed for both runs, in the same process, one after the other:
- the CPU of the N waiters together over `--seconds` (utime + stime, /proc), in % of a core:
  held, and (the baseline) the same waiters waiting for room behind a job that fills the card;
- once let go (the lock's holder killed; the baseline's job ending), the plans (note_planned)
  and ledger transactions the waiters make in the `--after` seconds that follow.
The ratios held / baseline are the figures to watch.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from _common import GPUWAIT, cpu_seconds, ledger_jobs, sandbox, wait_until

#: gpuwait with a 5 min grace, that writes a line to $NOTES/PID for each plan it makes
#: ("plan") and each ledger transaction it opens ("tx").
COUNTED = """
import os
from gpuwait.queue import lifecycle, wake
from gpuwait.queue.ledger import Ledger
lifecycle.RECOVERY_GRACE = 300.0
notes = open(os.path.join(os.environ["NOTES"], str(os.getpid())), "a", buffering=1)
planned, transaction = wake.note_planned, Ledger.transaction
def note_planned(state_dir):
    notes.write("plan\\n")
    planned(state_dir)
def counted(self, *args, **kwargs):
    notes.write("tx\\n")
    return transaction(self, *args, **kwargs)
wake.note_planned = note_planned
Ledger.transaction = counted
from gpuwait.cli import entry_point
entry_point()
"""

#: Holds the liveness lock of this user's job 0a1b2c3d in the ledger directory argv[1].
HOLDS = (
    "import sys, time; from pathlib import Path; from gpuwait.linux import alive; "
    "alive.hold(Path(sys.argv[1]), '0a1b2c3d'); print(flush=True); time.sleep(3600)"
)


def other_members(state: Path, dirs: int, jobs: int) -> None:
    """`dirs` lock directories of other users in `state`, `jobs` lock files in each."""
    for n in range(dirs):
        uid = 20000 + n
        lock_dir = state / f"alive.{uid}"
        lock_dir.mkdir(mode=0o700)
        for j in range(jobs):
            (lock_dir / f"{n:04x}{j:04x}").touch()
            os.chown(lock_dir / f"{n:04x}{j:04x}", uid, uid)
        os.chown(lock_dir, uid, uid)


def notes_of(notes: Path) -> tuple[int, int]:
    """(plans, transactions) the waiters have noted so far."""
    plans = txs = 0
    for path in notes.iterdir():
        lines = path.read_text().splitlines()
        plans += lines.count("plan")
        txs += lines.count("tx")
    return plans, txs


def run(args: argparse.Namespace, held: bool) -> tuple[float, int, int, int]:
    """CPU % of the waiters over --seconds, then (plans, transactions, started) in --after s
    once let go."""
    env = sandbox(gpus=1, memory="24GiB")
    state = Path(env["XDG_STATE_HOME"]) / "gpuwait"
    state.mkdir(parents=True, exist_ok=True)
    notes = state.parent.parent / "notes"
    notes.mkdir()
    env.update(
        {"NOTES": str(notes), "GPUWAIT_NVML_INTERVAL": "120s", "GPUWAIT_SAMPLE_INTERVAL": "60s"}
    )
    if os.getuid() == 0 and args.lock_dirs:
        other_members(state, args.lock_dirs, args.jobs_per_dir)
    if held:
        release = subprocess.Popen(
            [sys.executable, "-c", HOLDS, str(state)], env=env, stdout=subprocess.PIPE, text=True
        )
        assert release.stdout is not None and release.stdout.readline() == "\n"
        time.sleep(0.05)  # the ledger, made by the first waiter, begins after the lock
    else:
        release = subprocess.Popen(
            [*GPUWAIT, "--vram", "21G", "-q", "--name", "full", "--", "sleep", "3600"], env=env
        )
        wait_until(lambda: any(j.get("state") == "running" for j in ledger_jobs(env)), 60)
    waiters = []
    try:
        for _ in range(args.waiters):
            argv = [sys.executable, "-c", COUNTED, "--vram", "4G", "-q", "--", "sleep", "600"]
            waiters.append(subprocess.Popen(argv, env=env))
        wait_until(
            lambda: sum(j.get("state") == "waiting" for j in ledger_jobs(env)) >= args.waiters,
            120,
            poll=0.5,
        )
        if any(j.get("state") == "running" for j in ledger_jobs(env) if j.get("name") != "full"):
            raise SystemExit("bench: a waiter started; nothing is measured")
        time.sleep(3.0)  # past start-up
        pids = [w.pid for w in waiters]
        before = sum(cpu_seconds(p) for p in pids)
        time.sleep(args.seconds)
        cpu = 100 * (sum(cpu_seconds(p) for p in pids) - before) / args.seconds
        plans0, txs0 = notes_of(notes)
        release.terminate()  # the holder of the lock, or the job's gpuwait (its job with it)
        release.wait()
        time.sleep(args.after)
        plans, txs = notes_of(notes)
        started = sum(j.get("state") == "running" for j in ledger_jobs(env))
        return cpu, plans - plans0, txs - txs0, started
    finally:
        # Told to end as a user would: a started waiter's gpuwait ends its command too.
        for proc in [*waiters, release]:
            if proc.poll() is None:
                proc.terminate()
        for proc in [*waiters, release]:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(state.parent.parent, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--waiters", type=int, default=50)
    parser.add_argument("--lock-dirs", type=int, default=20, help="other members (root only)")
    parser.add_argument("--jobs-per-dir", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=5.0, help="CPU measured over this")
    parser.add_argument("--after", type=float, default=3.0, help="plans counted this long")
    args = parser.parse_args()
    # Killed (by timeout(1)): the waiters are reaped all the same.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    dirs = args.lock_dirs if os.getuid() == 0 else 0
    print(
        f"{args.waiters} waiters, {dirs} other members' lock directories of "
        f"{args.jobs_per_dir} files; CPU over {args.seconds:g}s, plans over {args.after:g}s"
    )
    results = {}
    for held in (False, True):
        results[held] = run(args, held)
        cpu, plans, txs, started = results[held]
        print(
            f"{'held' if held else 'baseline':>9}: CPU {cpu:6.2f} % of a core; let go: "
            f"{plans} plans, {txs} transactions, {started} started",
            flush=True,
        )
    base, held_ = results[False], results[True]
    print(
        f"held / baseline: CPU {held_[0] / max(base[0], 0.01):.1f}x, "
        f"plans {held_[1] / max(base[1], 1):.1f}x, transactions {held_[2] / max(base[2], 1):.1f}x"
    )


if __name__ == "__main__":
    main()
