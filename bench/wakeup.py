"""Wake-up: from a release to the start of the next waiter's command, and an idle waiter's CPU.

Each trial: a gpuwait job holds 20 GiB of a simulated 24 GiB card; a second gpuwait waits for
10 GiB there. The holder's command writes the time just before it exits (the release); the
waiter's command writes the time as soon as it starts. The latency is the difference: gpuwait
noticing its command's end, leaving the ledger, the waiter noticing, re-planning under the lock
and starting its command. `--idle-waiters K` adds K more waiters that never get in (they wait
for a dependency), so every release also wakes them, as on a busy machine.

Then one waiter that cannot be admitted is left alone for a few seconds, and its CPU time is
read from /proc/PID/stat (utime + stime), against a `sleep` process over the same time.

Both with `wake = inotify` (the default) and with `wake = poll` (a stat every 10 ms) as the
baseline. Goals: median <= 50 ms, p99 <= 250 ms; idle waiter <= 1 % of a core.

`--against REV` also measures the gpuwait of another revision (a git revision of this
repository, or a directory holding a checkout), in `--rounds` rounds alternating with this one
in the same run, each in a sandbox of its own, and prints the ratios of the two medians and of
the idle waiters' CPU: a change must not make a waiter slower to start or costlier to keep.
"""

from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path

from _common import (
    GPUWAIT,
    REPO,
    cpu_seconds,
    ledger_jobs,
    median,
    percentile,
    sandbox,
    wait_until,
)
from launch_overhead import checkout

STAMP = "date +%s.%N > {}"  # GNU date: starts in about a millisecond


def ledger_states(env: dict[str, str]) -> list[str]:
    return [str(j.get("state")) for j in ledger_jobs(env)]


def trial(env: dict[str, str], workdir: Path, index: int, extra: int, hold: float) -> float:
    released = workdir / f"released-{index}"
    started = workdir / f"started-{index}"
    go = workdir / f"go-{index}"
    # The holder ends once told to (after the waiter is queued), `hold` seconds later.
    holder = subprocess.Popen(
        [
            *GPUWAIT,
            "--vram",
            "20G",
            "-q",
            "--",
            "sh",
            "-c",
            f"while [ ! -e {go} ]; do sleep 0.01; done; sleep {hold}; " + STAMP.format(released),
        ],
        env=env,
    )
    wait_until(
        lambda: ledger_states(env).count("running") >= 1 + (extra > 0), timeout=30, poll=0.005
    )
    waiter = subprocess.Popen(
        [*GPUWAIT, "--vram", "10G", "-q", "--", "sh", "-c", STAMP.format(started)], env=env
    )
    wait_until(lambda: len(ledger_states(env)) >= 2 + extra, timeout=30, poll=0.005)
    go.touch()
    holder.wait()
    waiter.wait()
    return float(started.read_text()) - float(released.read_text())


def idle_cpu(env: dict[str, str], seconds: float) -> tuple[float, float]:
    """CPU % of one waiter that cannot get in, and of `sleep` (the floor), over `seconds`."""
    blocker = subprocess.Popen(
        [*GPUWAIT, "--vram", "20G", "-q", "--", "sleep", str(seconds + 30)], env=env
    )
    wait_until(lambda: "running" in ledger_states(env), timeout=30, poll=0.005)
    waiter = subprocess.Popen([*GPUWAIT, "--vram", "10G", "-q", "--", "true"], env=env)
    sleeper = subprocess.Popen(["sleep", str(seconds + 30)])
    wait_until(lambda: len(ledger_states(env)) >= 2, timeout=30, poll=0.005)
    time.sleep(1.0)  # past start-up
    before = cpu_seconds(waiter.pid), cpu_seconds(sleeper.pid)
    time.sleep(seconds)
    after = cpu_seconds(waiter.pid), cpu_seconds(sleeper.pid)
    for proc in (waiter, blocker, sleeper):
        proc.terminate()
        proc.wait()
    return (
        100 * (after[0] - before[0]) / seconds,
        100 * (after[1] - before[1]) / seconds,
    )


def measure(
    args: argparse.Namespace, wake: str, tree: Path = REPO, trials: int | None = None
) -> tuple[list[float], float, float]:
    """Latencies (ms), and the idle CPU % of a waiter and of `sleep`, with this `wake` setting,
    of the gpuwait in `tree` (`trials` of them, default --trials)."""
    env = {**sandbox(gpus=1, memory="24GiB"), "GPUWAIT_WAKE": wake, "PYTHONPATH": str(tree)}
    workdir = Path(env["XDG_STATE_HOME"]).parent
    # Idle waiters: blocked behind a dependency that does not end during the benchmark.
    anchor = subprocess.Popen(
        [*GPUWAIT, "--vram", "1M", "--name", "anchor", "-q", "--", "sleep", "3600"], env=env
    )
    wait_until(lambda: "running" in ledger_states(env), timeout=30, poll=0.005)
    idle = [
        subprocess.Popen(
            [*GPUWAIT, "--vram", "1M", "--after", "anchor", "-q", "--", "true"], env=env
        )
        for _ in range(args.idle_waiters)
    ]
    wait_until(lambda: len(ledger_states(env)) >= 1 + args.idle_waiters, timeout=30, poll=0.005)
    extra = 1 + args.idle_waiters
    try:
        count = args.trials if trials is None else trials
        latencies = [trial(env, workdir, i, extra, args.hold) * 1000 for i in range(count)]
    finally:
        for proc in [*idle, anchor]:
            proc.terminate()
            proc.wait()
    cpu_env = {**sandbox(gpus=1, memory="24GiB"), "GPUWAIT_WAKE": wake, "PYTHONPATH": str(tree)}
    waiter_cpu, sleep_cpu = idle_cpu(cpu_env, args.cpu_seconds)
    return latencies, waiter_cpu, sleep_cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--idle-waiters", type=int, default=4)
    parser.add_argument("--hold", type=float, default=0.4, help="seconds each holder holds")
    parser.add_argument("--cpu-seconds", type=float, default=10.0)
    parser.add_argument(
        "--against", metavar="REV", help="also measure this revision (or directory)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="alternations, with --against")
    args = parser.parse_args()
    print(f"trials: {args.trials} per mode, each with {args.idle_waiters} idle waiters woken too")
    if args.against:
        compare(args, checkout(args.against))
        return
    # wake = poll (a stat of the queue's summary every 10 ms) is the baseline for inotify.
    for wake in ("inotify", "poll"):
        latencies, waiter_cpu, sleep_cpu = measure(args, wake)
        print(
            f"wake = {wake:<8} release -> next start: median {median(latencies):6.1f} ms, "
            f"p99 {percentile(latencies, 99):6.1f} ms, max {max(latencies):6.1f} ms "
            "(goal <= 50 / 250 ms)"
        )
        print(
            f"{'':16} idle waiter: {waiter_cpu:5.2f} % of a core over {args.cpu_seconds:g}s "
            f"(sleep: {sleep_cpu:.2f} %; goal <= 1 %)",
            flush=True,
        )


def compare(args: argparse.Namespace, other: Path) -> None:
    """This tree against `other`, round after round, each round a share of the trials."""
    per_round = max(1, args.trials // args.rounds)
    for wake in ("inotify", "poll"):
        latencies: dict[str, list[float]] = {"this": [], "other": []}
        cpu: dict[str, list[float]] = {"this": [], "other": []}
        for _ in range(args.rounds):
            for name, tree in (("this", REPO), ("other", other)):
                found, waiter_cpu, _ = measure(args, wake, tree, per_round)
                latencies[name] += found
                cpu[name].append(waiter_cpu)
        for name, label in (("this", "this tree"), ("other", args.against)):
            print(
                f"wake = {wake:<8} {label}: release -> next start: median "
                f"{median(latencies[name]):6.1f} ms, p99 {percentile(latencies[name], 99):6.1f} ms"
                f"; idle waiter {median(cpu[name]):5.2f} % of a core"
            )
        ratio = median(latencies["this"]) / median(latencies["other"])
        idle = median(cpu["this"]) / max(median(cpu["other"]), 1e-9)
        print(
            f"wake = {wake:<8} this / {args.against}: median latency {ratio:5.2f}, "
            f"idle CPU {idle:5.2f}   (below 1: this tree is faster)",
            flush=True,
        )


if __name__ == "__main__":
    main()
