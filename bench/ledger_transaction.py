"""What one ledger transaction costs while it holds the lock, with 10, 100 and 300 entries.

Each entry names a live process of its own (a `sleep`), so reaping reads /proc for real and
keeps every entry. Two kinds of transaction:
- read-only: nothing changed, so nothing is written;
- read-modify-write: one entry's sample changes (what a running job's publication does), so
  the ledger (and wake.json) are rewritten.
Each kind runs in three situations:
- cold: a fresh `Ledger` and no cache in the process, as in a gpuwait process's first
  transaction (its submission);
- warm: the same process again, while another process rewrote a few entries in between (as
  under load: a job publishing, a waiter admitted);
- and for a shared ledger directory (checksums and a journal, rewritten in place), warm.
The time is from the moment the lock is granted to the moment it is let go (the lock's own
flock calls excluded), as `bench/release_latency.py --trace-lock` counts it. The breakdown
(read, checksum, parse, validate, reap = /proc reads, encode, write+fsync, other) times the
ledger's own functions, each wrapped in a timer, over the same transactions.

To compare two revisions, run this script from each (`--tree DIR` names another checkout, e.g.
one made with `git worktree add` or `git archive`), alternating, on the same machine.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from _common import REPO, median, percentile

STAGES = ("read", "crc", "parse", "validate", "reap", "encode", "write+fsync", "other")


class Clock:
    """Per-stage time of the transactions while `active`; nested stages are not counted twice."""

    def __init__(self) -> None:
        self.totals = dict.fromkeys(STAGES, 0.0)
        self.stack: list[list[float]] = []
        self.active = False

    def wrap(self, stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return fn(*args, **kwargs)
            frame = [time.perf_counter(), 0.0]  # start, time spent in nested stages
            self.stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self.stack.pop()
                spent = time.perf_counter() - frame[0]
                self.totals[stage] += spent - frame[1]
                if self.stack:
                    self.stack[-1][1] += spent

        return timed


def module(*names: str) -> Any:
    """The first of these modules the timed revision has (its layout changed over time), or
    None. Only modules of the timed tree count: where another checkout is installed in the
    same environment (pip install -e), a name this tree lacks would be found there."""
    tree = Path(importlib.import_module("gpuwait").__file__ or "").parent
    for name in names:
        try:
            found = importlib.import_module(name)
        except ImportError:
            continue
        if tree in Path(found.__file__ or "/").parents:
            return found
    return None


def instrument(clock: Clock) -> dict[str, float]:
    """Wrap the ledger's functions (those this revision has) in stage timers."""
    ledger = module("gpuwait.queue.ledger", "gpuwait._ledger")
    entries = module("gpuwait.queue.entries") or ledger
    lifecycle = module("gpuwait.queue.lifecycle") or ledger
    proc = module("gpuwait.linux.proc", "gpuwait._proc")
    atomic = module("gpuwait.linux.atomic", "gpuwait._atomic")
    wake = module("gpuwait.queue.wake", "gpuwait._wake")
    held = {"acquired": 0.0, "total": 0.0}

    def patch(owner: Any, name: str, stage: str) -> None:
        if hasattr(owner, name):
            setattr(owner, name, clock.wrap(stage, getattr(owner, name)))

    patch(ledger.Ledger, "_read_file", "read")
    patch(ledger, "_check_crc", "crc")
    patch(json, "loads", "parse")
    patch(ledger.Ledger, "_decode", "validate")  # less what is nested: parse, crc
    patch(proc, "is_alive", "reap")
    patch(getattr(proc, "LivenessReader", None), "alive", "reap")
    patch(lifecycle, "entry_owner_mismatch", "reap")
    patch(entries.LedgerData, "to_json", "encode")
    patch(entries, "to_document", "encode")
    patch(json, "dumps", "encode")
    patch(getattr(entries, "_ENCODED", None), "encode", "encode")
    patch(ledger.Ledger, "_write", "write+fsync")
    patch(ledger.Ledger, "_write_summary", "write+fsync")
    patch(atomic, "write_atomic", "write+fsync")
    patch(wake, "write_summary", "write+fsync")
    # The lock is held from the moment flock grants it until the transaction's end.
    flock = ledger.flock_within

    def traced_flock(*args: Any, **kwargs: Any) -> None:
        flock(*args, **kwargs)
        held["acquired"] = time.perf_counter()

    ledger.flock_within = traced_flock
    return held


@contextlib.contextmanager
def live_processes(count: int) -> Iterator[list[int]]:
    procs = [subprocess.Popen(["sleep", "3600"]) for _ in range(count)]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def fill(directory: Path, pids: list[int]) -> None:
    """A ledger of one entry per pid: a third running with samples, the rest waiting."""
    ledger = module("gpuwait.queue.ledger", "gpuwait._ledger")
    entries = module("gpuwait.queue.entries") or ledger
    proc = module("gpuwait.linux.proc", "gpuwait._proc")
    now = time.time()
    with ledger.Ledger(directory).transaction() as data:
        for i, pid in enumerate(pids):
            running = i % 3 == 0
            uuid = f"GPU-5e1a1d1e-{i % 4:04d}-4a4a-8b8b-00000000{i % 4:04d}"
            data.jobs.append(
                entries.Job(
                    id=f"{0x1000 + i:08x}",
                    pid=pid,
                    start_time=proc.start_time(pid),
                    uid=os.getuid(),
                    command=["python", "train.py", "--config", f"configs/run{i}.yaml"],
                    cwd="/home/someone/projects/model",
                    request={"bytes": (2 + i % 6) << 30},
                    order=i + 1,
                    priority=3 + i % 2,
                    state=entries.RUNNING if running else entries.WAITING,
                    gpu_uuids=[uuid] if running else [],
                    reserved_bytes=((2 + i % 6) << 30) if running else 0,
                    observed={uuid: 1 << 30} if running else {},
                    pids=[pid] if running else [],
                    child_pid=pid if running else None,
                    submitted_at=now - 100 + i,
                    started_at=now - 50 if running else None,
                    updated_at=now,
                    name=f"run{i}",
                    expected_seconds=120.0,
                    expected_by_gpu={uuid: 110.0},
                )
            )
        data.next_order = len(pids) + 1


def other_writer(directory: Path, round_: int) -> None:
    """Another process's transaction: a few entries' samples change (run in a subprocess, so
    that nothing of it is cached in this one)."""
    code = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "try:\n"
        "    from gpuwait.queue.ledger import Ledger\n"
        "except ImportError:\n"
        "    from gpuwait._ledger import Ledger\n"
        "with Ledger(Path(sys.argv[1])).transaction() as data:\n"
        "    for j in data.jobs[int(sys.argv[2]) % 3 :: max(1, len(data.jobs) // 3)]:\n"
        "        j.updated_at = time.time()\n"
        "        j.observed = {u: v + 2**20 for u, v in j.observed.items()}\n"
    )
    env = dict(os.environ, PYTHONPATH=os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, "-c", code, str(directory), str(round_)], env=env, check=True)


def measure(
    directory: Path,
    clock: Clock,
    held: dict[str, float],
    *,
    write: bool,
    warm: bool,
    rounds: int,
) -> tuple[list[float], dict[str, float]]:
    ledger_mod = module("gpuwait.queue.ledger", "gpuwait._ledger")
    lifecycle = module("gpuwait.queue.lifecycle")
    reset = getattr(lifecycle or ledger_mod, "forget_cached", None) or getattr(
        ledger_mod, "_forget_cached_entries", None
    )
    ledger = ledger_mod.Ledger(directory)
    times: list[float] = []
    totals_before = dict(clock.totals)
    for i in range(rounds):
        if warm and i % 2 == 0:
            other_writer(directory, i)  # every other round: a file changed by someone else
        if not warm:
            ledger = ledger_mod.Ledger(directory)
            if reset is not None:
                reset()
        # What gpuwait does: a running job publishes a new sample, or a transaction finds
        # nothing to change (it reaps, like every one). Read before the clock runs.
        mine = ledger.read().jobs[0] if lifecycle is not None and write else None
        clock.active = True
        try:
            if lifecycle is not None:
                if mine is not None:
                    usage = {u: v + i for u, v in mine.observed.items()}
                    lifecycle.publish_usage(ledger, mine, usage, mine.pids)
                else:
                    lifecycle.tidy(ledger, None)
            else:  # a revision whose storage reaped in every transaction itself
                with ledger.transaction() as data:
                    if write:
                        mine = data.jobs[0]
                        mine.observed = {u: v + i for u, v in mine.observed.items()}
                        mine.updated_at = time.time()
        finally:
            clock.active = False
        held_for = time.perf_counter() - held["acquired"]
        times.append(held_for)
        clock.totals["other"] += held_for
    stages = {s: (clock.totals[s] - totals_before[s]) / rounds for s in STAGES}
    stages["other"] -= sum(v for s, v in stages.items() if s != "other")
    return times, stages


def compare(args: argparse.Namespace) -> None:
    """Run this script for `--against` and for `--tree` in turn, `--repeat` times each, and
    print per case the median over the runs of each run's median and p95, and their ratio."""
    trees = {"before": args.against, "after": args.tree}
    results: dict[str, dict[str, list[tuple[float, float]]]] = {k: {} for k in trees}
    for _ in range(args.repeat):
        for label, tree in trees.items():
            command = [sys.executable, __file__, "--tree", str(tree), "--json"]
            command += ["--rounds", str(args.rounds), "--entries", *map(str, args.entries)]
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            for case, figures in json.loads(out.splitlines()[-1]).items():
                results[label].setdefault(case, []).append((figures[0], figures[1]))
    print(f"lock held, ms: median over {args.repeat} alternating runs of each run's median / p95")
    print(f"{'':44s} {'before':>15s} {'after':>15s}  ratio")
    for case, before in results["before"].items():
        after = results["after"][case]
        b = (median([m for m, _ in before]), median([p for _, p in before]))
        a = (median([m for m, _ in after]), median([p for _, p in after]))
        print(
            f"{case:44s} {b[0]:6.2f} / {b[1]:6.2f} {a[0]:6.2f} / {a[1]:6.2f}  "
            f"{b[0] / a[0]:4.1f}x / {b[1] / a[1]:3.1f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, default=REPO, help="checkout whose gpuwait to time")
    parser.add_argument("--against", type=Path, help="compare with this checkout (alternating)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each, with --against")
    parser.add_argument("--entries", type=int, nargs="+", default=[10, 100, 300])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = parser.parse_args()
    if args.against is not None:
        compare(args)
        return
    sys.path.insert(0, str(args.tree.resolve()))
    os.environ["PYTHONPATH"] = str(args.tree.resolve())
    clock = Clock()
    held = instrument(clock)
    revision = subprocess.run(
        ["git", "-C", str(args.tree), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    print(f"gpuwait from {args.tree} {revision}".rstrip())
    print("lock held per transaction, ms: median / p95; breakdown of the mean, ms:")
    print("  " + " ".join(f"{s:>9}" for s in STAGES))
    figures: dict[str, tuple[float, float]] = {}
    for count in args.entries:
        with live_processes(count) as pids:
            for shared in (False, True):
                root = Path(tempfile.mkdtemp(prefix="gpuwait-bench-ledger-"))
                directory = root / "ledger"
                directory.mkdir(mode=0o700)
                if shared:
                    os.chmod(directory, 0o1770)  # group-writable with the sticky bit
                fill(directory, pids)
                situations = [("warm", True)] if shared else [("cold", False), ("warm", True)]
                for label, warm in situations:
                    for write in (False, True):
                        times, stages = measure(
                            directory, clock, held, write=write, warm=warm, rounds=args.rounds
                        )
                        kind = "read-modify-write" if write else "read-only"
                        where = "shared" if shared else "private"
                        print(
                            f"{count:4d} entries {where:7s} {label} {kind:17s} "
                            f"{1e3 * median(times):6.2f} / {1e3 * percentile(times, 95):6.2f}"
                        )
                        print("  " + " ".join(f"{1e3 * stages[s]:9.3f}" for s in STAGES))
                        figures[f"{count:4d} entries {where:7s} {label} {kind}"] = (
                            1e3 * median(times),
                            1e3 * percentile(times, 95),
                        )
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
