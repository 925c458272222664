"""Release latency: from a job's exit to its room's release in the ledger, with many waiters.

Each run: two simulated 24 GiB cards, each taken by one job reserving 12 GiB (so a card holds
one at a time); N more gpuwait processes queue behind them for the same. Once all are queued,
the jobs run one after another on each card, each command ending `--hold` seconds after it
starts by writing its exit time. From gpuwait's event log (events.jsonl) and those times, for
each of the first `--releases` jobs to end (the queue stays about N long meanwhile):
- exit -> release: the command's exit to its ledger entry's removal (the `finish` event,
  written inside the releasing transaction);
- release -> admit: that release to the next admission (the next `admit` event);
- release -> start: to the next command's start (the next `start` event).
With `--trace-lock`, every gpuwait process records each ledger transaction (who called it, how
long it waited for the lock, how long it held it), through a sitecustomize module on
PYTHONPATH, so the product carries no tracing code; the waiting processes' CPU time over the
measured window is read from /proc either way.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import subprocess
import tempfile
import time
from pathlib import Path

from _common import GPUWAIT, cpu_seconds, ledger_jobs, median, percentile, sandbox, wait_until

TRACER = """
import os, sys, time, contextlib
_out = os.environ.get("BENCH_LOCK_TRACE")
if _out:
    import gpuwait.queue.ledger as _ledger
    _acquired = [0.0]
    _flock = _ledger.flock_within
    def _traced_flock(*a, **k):
        _flock(*a, **k)
        _acquired[0] = time.monotonic()
    _ledger.flock_within = _traced_flock
    _transaction = _ledger.Ledger.transaction
    def _caller():
        # The function that changed the ledger (a gpuwait.queue.lifecycle step), past the
        # context managers on the way.
        f = sys._getframe(2)
        while f is not None and (
            f.f_code.co_filename.endswith(("contextlib.py", "ledger.py", "sitecustomize.py"))
            or f.f_code.co_name == "_change"
        ):
            f = f.f_back
        return f.f_code.co_name if f is not None else "?"
    @contextlib.contextmanager
    def _traced(self, *args, **kwargs):
        who = _caller()
        start = time.monotonic()
        _acquired[0] = 0.0
        try:
            with _transaction(self, *args, **kwargs) as data:
                yield data
        finally:
            end = time.monotonic()
            got = _acquired[0] or start
            line = "%d %s %.6f %.6f %.6f\\n" % (os.getpid(), who, time.time(), got - start, end - got)
            fd = os.open(_out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            os.write(fd, line.encode())
            os.close(fd)
    _ledger.Ledger.transaction = _traced
    # Per process, while the measured window runs (the `go` file exists): how often its waiting
    # loop woke (it looks at the summary first thing), read the GPUs, read the whole ledger
    # (a supervising gpuwait's readings are not counted);
    # kept in OUT.PID, rewritten at most twice a second (a terminated waiter runs no atexit).
    import gpuwait.queue.wake as _wake, gpuwait.gpu.sim as _sim
    _go = os.environ["BENCH_GO"]
    _counts = {"wakes": 0, "snapshots": 0, "reads": 0}
    _dumped = [0.0]
    def _waiting():
        f = sys._getframe(2)
        while f is not None and f.f_code.co_name != "wait_for_admission":
            f = f.f_back
        return f is not None
    def _counting(name, fn):
        def counted(*a, **k):
            if os.path.exists(_go) and _waiting():
                _counts[name] += 1
                if time.monotonic() - _dumped[0] > 0.5:
                    _dumped[0] = time.monotonic()
                    with open("%s.%d" % (_out, os.getpid()), "w") as f:
                        f.write("%(wakes)d %(snapshots)d %(reads)d" % _counts)
            return fn(*a, **k)
        return counted
    _wake.file_token = _counting("wakes", _wake.file_token)
    _ledger.Ledger.read = _counting("reads", _ledger.Ledger.read)
    _sim.SimBackend.snapshot = _counting("snapshots", _sim.SimBackend.snapshot)
"""


def cpu_so_far(pid: int) -> float:
    """cpu_seconds, or 0 for a waiter that has gone (admitted and ended meanwhile)."""
    try:
        return cpu_seconds(pid)
    except OSError:
        return 0.0


def events(env: dict[str, str]) -> list[dict[str, object]]:
    path = Path(env["XDG_STATE_HOME"]) / "gpuwait" / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(
    waiters: int, releases: int, hold: float, trace: bool, gpus: int, ramp: float | None
) -> dict[str, object]:
    env = sandbox(gpus=gpus, memory="24GiB")
    releases = min(releases, waiters // 2)  # so that the queue stays long meanwhile
    work = Path(env["XDG_STATE_HOME"]).parent
    go = work / "go"
    trace_file = work / "locks.txt"
    if trace:
        site = Path(tempfile.mkdtemp(prefix="gpuwait-trace-"))
        (site / "sitecustomize.py").write_text(TRACER)
        env["PYTHONPATH"] = f"{site}:{env['PYTHONPATH']}"
        env["BENCH_LOCK_TRACE"] = str(trace_file)
        env["BENCH_GO"] = str(go)
    # Every command waits for `go` (so the whole queue forms first), holds, and stamps its exit.
    # With --ramp, a simulated CUDA job (a Python process whose memory grows, so its gpuwait
    # publishes samples) instead of `sleep`: closer to a real job's load on the ledger.
    job = (
        f"sleep {hold}"
        if ramp is None
        else f"{' '.join(GPUWAIT)} sim job --vram 12G --ramp {ramp}s --hold {hold}s"
    )
    body = (
        f"while [ ! -e {go} ]; do sleep 0.01; done; {job}; "
        f"date +%s.%N > {work}/exit-$GPUWAIT_JOB_ID"
    )
    cmd = [*GPUWAIT, "--vram", "12G", "-q", "--", "sh", "-c", body]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    procs = [subprocess.Popen(cmd, env=env, **quiet) for _ in range(gpus)]  # type: ignore[call-overload]
    wait_until(
        lambda: sum(j.get("state") == "running" for j in ledger_jobs(env)) >= gpus, timeout=120
    )
    for i in range(waiters):
        procs.append(subprocess.Popen(cmd, env=env, **quiet))  # type: ignore[call-overload]
        if i % 10 == 9:  # launching a hundred at once would only measure the launches
            wait_until(lambda n=i: len(ledger_jobs(env)) >= n + 1 + gpus, timeout=120)
    wait_until(lambda: len(ledger_jobs(env)) >= waiters + gpus, timeout=120)
    time.sleep(1.0)  # past start-up
    if trace:
        trace_file.unlink(missing_ok=True)
    waiting_pids = [p.pid for p in procs[gpus:]]
    # First with nothing happening: what waiting alone costs.
    idle_before = sum(cpu_so_far(pid) for pid in waiting_pids)
    time.sleep(3.0)
    idle_cpu = 100 * (sum(cpu_so_far(pid) for pid in waiting_pids) - idle_before) / 3.0
    if trace:
        trace_file.unlink(missing_ok=True)
    cpu_before = sum(cpu_so_far(pid) for pid in waiting_pids)
    began = time.time()
    go.touch()
    wait_until(lambda: len(list(work.glob("exit-*"))) >= releases + gpus, timeout=120)
    time.sleep(0.5)
    ended = time.time()
    window = ended - began
    cpu_after = sum(cpu_so_far(pid) for pid in waiting_pids)
    counts = []
    for pid in waiting_pids:
        with contextlib.suppress(OSError, ValueError):
            counts.append([int(x) for x in Path(f"{trace_file}.{pid}").read_text().split()])
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait()

    log = events(env)
    finish = {e["job"]: float(e["time"]) for e in log if e["kind"] == "finish"}  # type: ignore[arg-type]
    admits = sorted(float(e["time"]) for e in log if e["kind"] == "admit")  # type: ignore[arg-type]
    starts = sorted(float(e["time"]) for e in log if e["kind"] == "start")  # type: ignore[arg-type]
    exit_to_release, release_to_admit, release_to_start = [], [], []
    for stamp in sorted(work.glob("exit-*"), key=lambda p: float(p.read_text() or 0))[:releases]:
        job = stamp.name.removeprefix("exit-")
        if job not in finish or not stamp.read_text().strip():
            continue
        exited, released = float(stamp.read_text()), finish[job]
        exit_to_release.append(released - exited)
        nxt = [t for t in admits if t >= released]
        if nxt:
            release_to_admit.append(nxt[0] - released)
        nxt = [t for t in starts if t >= released]
        if nxt:
            release_to_start.append(nxt[0] - released)
    result: dict[str, object] = {
        "exit_to_release": exit_to_release,
        "release_to_admit": release_to_admit,
        "release_to_start": release_to_start,
        "waiter_cpu_pct": 100 * (cpu_after - cpu_before) / window,
        "window": window,
        "idle_cpu_pct": idle_cpu,
    }
    if trace and trace_file.exists():
        rows = [line.split() for line in trace_file.read_text().splitlines()]
        result["counts"] = [sum(c[i] for c in counts) for i in range(3)]
        # Only the measured window: not the leaves of the processes terminated after it.
        result["locks"] = [
            (r[1], float(r[2]), float(r[3]), float(r[4])) for r in rows if float(r[2]) <= ended
        ]
    return result


def summary(name: str, values: list[float]) -> str:
    if not values:
        return f"{name}: none"
    ms = [v * 1000 for v in values]
    return (
        f"{name}: median {median(ms):7.1f} ms, p95 {percentile(ms, 95):7.1f} ms, "
        f"max {max(ms):7.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--waiters", type=int, nargs="+", default=[20, 50, 100])
    parser.add_argument("--releases", type=int, default=16)
    parser.add_argument("--hold", type=float, default=0.5)
    parser.add_argument("--gpus", type=int, default=2, help="simulated 24 GiB cards")
    parser.add_argument("--ramp", type=float, help="run simulated jobs ramping over this")
    parser.add_argument("--trace-lock", action="store_true")
    args = parser.parse_args()
    for n in args.waiters:
        r = run(n, args.releases, args.hold, args.trace_lock, args.gpus, args.ramp)
        kind = "sleep" if args.ramp is None else f"sim job, ramp {args.ramp}s"
        print(
            f"N = {n} waiters, {len(r['exit_to_release'])} releases "  # type: ignore[arg-type]
            f"({args.gpus} cards; {kind}, hold {args.hold}s)"
        )
        for key in ("exit_to_release", "release_to_admit", "release_to_start"):
            print("   ", summary(f"{key.replace('_', ' '):>18}", r[key]))  # type: ignore[arg-type]
        print(
            f"    CPU of the queued gpuwait processes (incl. those admitted meanwhile): {r['waiter_cpu_pct']:.0f} % of a core "
            f"over {r['window']:.1f}s; idle before: {r['idle_cpu_pct']:.0f} %"
        )
        counts = r.get("counts")
        if counts:
            wakes, snapshots, reads = counts  # type: ignore[misc]
            per_s = float(r["window"])  # type: ignore[arg-type]
            print(
                f"    waiting processes, per second: {wakes / per_s:.0f} wake-ups, "
                f"{snapshots / per_s:.1f} GPU readings, {reads / per_s:.1f} unlocked ledger reads"
            )
        locks = r.get("locks")
        if locks:
            by = collections.defaultdict(list)
            for who, _, waited, held in locks:  # type: ignore[attr-defined]
                by[who].append((waited, held))
            print(f"    ledger transactions: {len(locks)} in {r['window']:.1f}s")  # type: ignore[arg-type]
            for who, rows in sorted(by.items(), key=lambda kv: -len(kv[1])):
                waits = [w * 1000 for w, _ in rows]
                holds = [h * 1000 for _, h in rows]
                print(
                    f"      {who:<22} {len(rows):5d}x  wait median {median(waits):6.1f} "
                    f"max {max(waits):7.1f} ms   hold median {median(holds):5.1f} "
                    f"max {max(holds):6.1f} ms"
                )
        print(flush=True)


if __name__ == "__main__":
    main()
