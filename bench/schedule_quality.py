"""Schedule quality: a mixed trace on 4 simulated GPUs, under gpuwait and two baselines.

The trace (seeded, so every run replays the same one): 120 jobs arriving over the first part of
the run - many small short ones, some of 20-40 GiB, a few 2-GPU gangs, priorities 1, 3 and 5.
Every job is a simulated CUDA job that ramps its memory up (like a model loading) and then holds
it, so a launcher that trusts the free memory it sees admits too much and jobs die of OOM.

Policies, each on a fresh simulated machine:
- gpuwait: every job is `gpuwait --vram ... [--gpus 2] --priority P -- <job>`, started at its
  arrival time; gpuwait decides when and where.
- poller: a free-memory poller, like ts -G / GPUtil / waitGPU: every `--poll` seconds it reads
  the GPUs and starts, in priority order, each waiting job whose request fits the free memory it
  sees (minus what it started in that same round). Jobs still ramping up are not seen.
- one-per-gpu: a job starts only on GPUs where nothing it started is running.

Printed per policy: makespan / lower bound (the issue's bound: the larger of total VRAM x time
over the usable capacity, and the longest job), VRAM-time utilisation, OOM count, jobs failed,
the p95 wait of priority-5 jobs, and the mean overrun of the jobs that succeeded (end - start -
their nominal run time: starting a Python process and reaping it, on a loaded machine). Goals for
gpuwait: 0 OOM, makespan <= 1.10 x the lower bound.

That bound ignores when jobs arrive and that jobs of 20-40 GiB rarely fit two to a card, so the
script also prints, as multiples of it and computed without running anything, what the trace
allows:
- two other lower bounds, both still valid for any scheduler: arrival-aware (work that arrives
  at t cannot start before t: makespan >= t + VRAM x time of the jobs arriving at or after t
  over the usable capacity, for every t, and >= each job's arrival + duration), and the same
  counting that two jobs over half a card never share one (so they run one per card at a time);
- gpuwait's own policy (`gpuwait.core.policy.plan`) replayed on the trace with no process start-up
  or machine load: what the queue discipline itself costs, without run-time estimates and with
  every run time known (as the history gives for repeated commands). gpuwait as run here is in
  between: its history files all the simulated jobs under one script, so a job submitted once
  others have ended is expected to take about as long as they took;
- greedy schedulers that start every waiting job that fits, best-fit, with no holds: in priority
  order (what gpuwait would do without its no-starvation holds), largest (VRAM x time) first and
  clairvoyant but respecting arrivals, and largest first with every job known at time 0
  (offline). None of these is a bound: they show what simple schedulers reach on this trace.

One trace is one sample: changing the run times by 1% moves a replay's ratio by up to 0.13
either way, as the 20-40 GiB jobs then pair up differently at the end. `--replay-seeds N` prints
the references' means over seeds 1..N, which is what to compare policies by.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from _common import GPUWAIT, REPO, percentile, sandbox

sys.path.insert(0, str(REPO))

GIB = 2**30
GPUS = 4
CARD_GIB = 48
SAFETY = 0.9
SIMJOB = [
    sys.executable,
    "-c",
    "import sys; from gpuwait.gpu.simjob import main; sys.exit(main(sys.argv[1:]))",
]


@dataclass
class TraceJob:
    name: str
    arrival: float
    vram_gib: int
    gpus: int
    ramp: float
    hold: float
    priority: int

    @property
    def duration(self) -> float:
        return self.ramp + self.hold


@dataclass
class Outcome:
    job: TraceJob
    start: float | None = None
    end: float | None = None
    returncode: int | None = None
    oom: bool = False


@dataclass
class Result:
    policy: str
    outcomes: list[Outcome] = field(default_factory=list)

    def makespan(self) -> float:
        return max(o.end for o in self.outcomes if o.end is not None)


def make_trace(seed: int, scale: float, arrive_within: float) -> list[TraceJob]:
    rng = random.Random(seed)
    kinds = ["small"] * 80 + ["large"] * 28 + ["gang"] * 12
    rng.shuffle(kinds)
    jobs = []
    for n, kind in enumerate(kinds):
        if kind == "small":
            vram, gpus, run = rng.randint(2, 6), 1, rng.uniform(2, 6)
        elif kind == "large":
            vram, gpus, run = rng.randint(20, 40), 1, rng.uniform(6, 14)
        else:
            vram, gpus, run = rng.randint(12, 24), 2, rng.uniform(5, 10)
        priority = rng.choices([1, 3, 5], weights=[15, 70, 15])[0]
        run *= scale
        # Arrivals thin at first, then denser: the queue ramps up.
        arrival = arrive_within * rng.random() ** 0.7
        jobs.append(
            TraceJob(
                f"j{n:03d}-{kind}",
                arrival,
                vram,
                gpus,
                round(0.3 * run, 2),
                round(0.7 * run, 2),
                priority,
            )
        )
    return sorted(jobs, key=lambda j: j.arrival)


def lower_bound(trace: list[TraceJob]) -> float:
    """The issue's bound: total VRAM x time over the usable capacity, or the longest job."""
    usable = GPUS * CARD_GIB * SAFETY
    area = sum(j.vram_gib * j.gpus * j.duration for j in trace)
    return max(area / usable, max(j.duration for j in trace))


def arrival_bound(trace: list[TraceJob], pairing: bool = False) -> float:
    """A lower bound that also counts arrivals: the jobs arriving at or after t cannot start
    before t, so no schedule ends before t + their VRAM x time over the usable capacity.

    `pairing`: also count that two jobs over half a card never share one, so those run one per
    card at a time: none ends before t + their GPU x time, arriving at or after t, over the GPUs.
    """
    usable = GPUS * CARD_GIB * SAFETY
    big = CARD_GIB * SAFETY / 2
    bound = max(j.arrival + j.duration for j in trace)
    for t in sorted({j.arrival for j in trace}):
        later = [j for j in trace if j.arrival >= t]
        bound = max(bound, t + sum(j.vram_gib * j.gpus * j.duration for j in later) / usable)
        if pairing:
            paired = sum(j.gpus * j.duration for j in later if j.vram_gib > big)
            bound = max(bound, t + paired / GPUS)
    return bound


def replay_policy(trace: list[TraceJob], known: bool = False) -> float:
    """Makespan of gpuwait's plan() on the trace, with jobs taking exactly their run time.

    `known`: the plan is told every run time, as history-based estimates would.
    """
    return makespan(trace, replay_starts(trace, known))


def replay_starts(trace: list[TraceJob], known: bool = False) -> dict[str, float]:
    """When each job starts under gpuwait's plan() replayed on the trace (see replay_policy)."""
    from gpuwait.core.policy import Claim, plan
    from gpuwait.core.sizes import MemoryRequest
    from gpuwait.core.snapshot import GpuSnapshot

    cards = [GpuSnapshot(i, f"GPU-{i}", "sim", CARD_GIB * GIB, 0) for i in range(GPUS)]
    by_name = {j.name: j for j in trace}
    pending = list(trace)
    claims: list[Claim] = []
    ends: dict[str, float] = {}
    starts: dict[str, float] = {}
    order = 0
    while pending or claims:
        now = min([*(e for e in ends.values()), *(j.arrival for j in pending[:1])])
        while pending and pending[0].arrival <= now:
            job = pending.pop(0)
            order += 1
            request = MemoryRequest(bytes=job.vram_gib * GIB)
            expected = job.duration if known else None
            claims.append(
                Claim(
                    job.name,
                    False,
                    job.priority,
                    order,
                    request,
                    job.gpus,
                    expected_seconds=expected,
                )
            )
        done = {name for name, end in ends.items() if end <= now}
        for name in done:
            del ends[name]
        if known:  # a running job's estimate is what is left of it
            claims = [
                c._replace(expected_seconds=ends[c.job_id] - now) if c.job_id in ends else c
                for c in claims
            ]
        decided = plan(cards, [c for c in claims if c.job_id not in done], SAFETY)
        kept = []
        for c in claims:
            if c.job_id in done:
                continue
            if c.job_id in decided.admitted:
                ends[c.job_id] = now + by_name[c.job_id].duration
                starts[c.job_id] = now
                c = c._replace(
                    running=True,
                    gpu_uuids=decided.admitted[c.job_id],
                    reserved_bytes=decided.reserved[c.job_id],
                )
            elif decided.hold is not None and c.job_id == decided.hold.job_id:
                c = c._replace(held=decided.hold.gpu_uuids)
            kept.append(c)
        claims = kept
    return starts


def greedy_reference(
    trace: list[TraceJob], order: Callable[[TraceJob], tuple[float, ...]], arrivals: bool = True
) -> float:
    """Makespan of a greedy with no holds (see greedy_starts)."""
    return makespan(trace, greedy_starts(trace, order, arrivals))


def greedy_starts(
    trace: list[TraceJob], order: Callable[[TraceJob], tuple[float, ...]], arrivals: bool = True
) -> dict[str, float]:
    """When each job starts under a greedy with no holds: whenever a job ends or arrives, every
    waiting job that fits starts, looked at in `order`, best-fit (the card left with the least
    room). `arrivals`: jobs arrive at their times; else every job is there at time 0.
    """
    usable = CARD_GIB * SAFETY
    free = [usable] * GPUS
    pending = sorted(trace, key=lambda j: j.arrival) if arrivals else []
    waiting = [] if arrivals else list(trace)
    running: list[tuple[float, TraceJob, list[int]]] = []
    starts: dict[str, float] = {}
    now = 0.0
    while pending or waiting or running:
        while pending and pending[0].arrival <= now:
            waiting.append(pending.pop(0))
        for job in sorted(waiting, key=order):
            fits = sorted(
                (i for i in range(GPUS) if free[i] >= job.vram_gib), key=lambda i: free[i]
            )
            if len(fits) >= job.gpus:
                for i in fits[: job.gpus]:
                    free[i] -= job.vram_gib
                running.append((now + job.duration, job, fits[: job.gpus]))
                starts[job.name] = now
                waiting.remove(job)
        now = min([*(end for end, _, _ in running), *(j.arrival for j in pending[:1])])
        for end, job, where in [r for r in running if r[0] <= now]:
            running.remove((end, job, where))
            for i in where:
                free[i] += job.vram_gib
    return starts


def makespan(trace: list[TraceJob], starts: dict[str, float]) -> float:
    return max(starts[j.name] + j.duration for j in trace)


def urgent_wait(trace: list[TraceJob], starts: dict[str, float]) -> float:
    """p95 wait, from arrival to start, of the priority-5 jobs."""
    return percentile([starts[j.name] - j.arrival for j in trace if j.priority == 5], 95)


def by_priority(job: TraceJob) -> tuple[float, ...]:
    return (-job.priority, job.arrival)


def largest_first(job: TraceJob) -> tuple[float, ...]:
    return (-job.vram_gib * job.gpus * job.duration, job.arrival)


def offline_reference(trace: list[TraceJob]) -> float:
    """Makespan of a clairvoyant greedy: all jobs at time 0, largest area first, best-fit."""
    return greedy_reference(trace, largest_first, arrivals=False)


def job_command(job: TraceJob) -> list[str]:
    """The simulated job; a gang runs one simulated process per GPU it was given."""
    args = ["--vram", f"{job.vram_gib}G", "--ramp", f"{job.ramp}s", "--hold", f"{job.hold}s"]
    if job.gpus == 1:
        return [*SIMJOB, *args]
    one = " ".join(f"'{a}'" for a in [*SIMJOB, *args])
    script = (
        'pids=""; for d in $(echo "$CUDA_VISIBLE_DEVICES" | tr , " "); do '
        f'CUDA_VISIBLE_DEVICES=$d {one} & pids="$pids $!"; done; '
        "fail=0; for p in $pids; do wait $p || fail=1; done; exit $fail"
    )
    return ["sh", "-c", script]


def gpu_uuids(env: dict[str, str]) -> list[str]:
    from gpuwait.gpu.sim import SimBackend

    return [g.uuid for g in SimBackend(env["GPUWAIT_SIM"]).snapshot().gpus]


def free_bytes(env: dict[str, str]) -> dict[str, int]:
    from gpuwait.gpu.sim import SimBackend

    return {g.uuid: g.free_bytes for g in SimBackend(env["GPUWAIT_SIM"]).snapshot().gpus}


class Runner:
    """Starts trace jobs at their arrival (or when a baseline decides) and reaps them."""

    def __init__(self, policy: str, trace: list[TraceJob], env: dict[str, str]) -> None:
        self.result = Result(policy, [Outcome(j) for j in trace])
        self.env = env
        self.logs = Path(env["XDG_STATE_HOME"]).parent / "logs"
        self.logs.mkdir()
        self.running: dict[subprocess.Popen[bytes], Outcome] = {}
        self.t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def start(self, outcome: Outcome, argv: list[str], env: dict[str, str]) -> None:
        log = open(self.logs / outcome.job.name, "wb")  # noqa: SIM115 - closed by the child's end
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=log)
        log.close()
        self.running[proc] = outcome

    def reap(self) -> list[Outcome]:
        ended = []
        for proc, outcome in list(self.running.items()):
            code = proc.poll()
            if code is None:
                continue
            del self.running[proc]
            outcome.end, outcome.returncode = self.now(), code
            outcome.oom = "out of memory" in (self.logs / outcome.job.name).read_text(
                errors="replace"
            )
            ended.append(outcome)
        return ended


def run_gpuwait(trace: list[TraceJob]) -> Result:
    env = sandbox(gpus=GPUS, memory=f"{CARD_GIB}GiB")
    runner = Runner("gpuwait", trace, env)
    pending = list(runner.result.outcomes)
    while pending or runner.running:
        while pending and pending[0].job.arrival <= runner.now():
            outcome = pending.pop(0)
            job = outcome.job
            argv = [
                *GPUWAIT,
                "--vram",
                f"{job.vram_gib}G",
                "--gpus",
                str(job.gpus),
                "--priority",
                str(job.priority),
                "--name",
                job.name,
                "--batch",
                "trace",
                "-q",
                "--",
                *job_command(job),
            ]
            runner.start(outcome, argv, env)
        runner.reap()
        time.sleep(0.02)
    # Start times from gpuwait's own event log: when each job was admitted.
    events = Path(env["XDG_STATE_HOME"]) / "gpuwait" / "events.jsonl"
    started = {}
    for line in events.read_text().splitlines():
        event = json.loads(line)
        if event["kind"] == "admit":
            started[event["name"]] = event["time"]
    wall0 = time.time() - runner.now()
    for outcome in runner.result.outcomes:
        if outcome.job.name in started:
            outcome.start = started[outcome.job.name] - wall0
    return runner.result


def run_baseline(trace: list[TraceJob], policy: str, poll: float) -> Result:
    env = sandbox(gpus=GPUS, memory=f"{CARD_GIB}GiB")
    runner = Runner(policy, trace, env)
    uuids = gpu_uuids(env)
    busy: dict[str, int] = dict.fromkeys(uuids, 0)  # jobs this baseline runs on each GPU
    where: dict[int, list[str]] = {}
    waiting: list[Outcome] = []
    pending = list(runner.result.outcomes)
    next_poll = 0.0
    while pending or waiting or runner.running:
        while pending and pending[0].job.arrival <= runner.now():
            waiting.append(pending.pop(0))
        for outcome in runner.reap():
            for uuid in where.pop(id(outcome)):
                busy[uuid] -= 1
        if runner.now() >= next_poll and waiting:
            next_poll = runner.now() + poll
            free = free_bytes(env)
            for outcome in sorted(waiting, key=lambda o: (-o.job.priority, o.job.arrival)):
                job = outcome.job
                if policy == "poller":
                    fits = [u for u in uuids if free[u] >= job.vram_gib * GIB]
                else:
                    fits = [u for u in uuids if busy[u] == 0]
                if len(fits) < job.gpus:
                    continue
                chosen = fits[: job.gpus]
                for uuid in chosen:
                    free[uuid] -= job.vram_gib * GIB
                    busy[uuid] += 1
                where[id(outcome)] = chosen
                waiting.remove(outcome)
                outcome.start = runner.now()
                child_env = {
                    **env,
                    "CUDA_VISIBLE_DEVICES": ",".join(chosen),
                    "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                }
                runner.start(outcome, job_command(job), child_env)
        time.sleep(0.02)
    return runner.result


def references(trace: list[TraceJob]) -> dict[str, float]:
    """The bounds and reference schedules, as ratios to the issue's bound; waits in seconds."""
    bound = lower_bound(trace)
    figures = {
        "arrival": arrival_bound(trace) / bound,
        "pairing": arrival_bound(trace, pairing=True) / bound,
        "offline": offline_reference(trace) / bound,
    }
    runs = {
        "replay": replay_starts(trace),
        "informed": replay_starts(trace, known=True),
        "priority": greedy_starts(trace, by_priority),
        "largest": greedy_starts(trace, largest_first),
    }
    for name, starts in runs.items():
        figures[name] = makespan(trace, starts) / bound
        figures[f"{name} wait"] = urgent_wait(trace, starts)
    return figures


def print_references(r: dict[str, float]) -> None:
    print(
        f"  other lower bounds  arrival-aware {r['arrival']:4.2f}, also counting that no two"
        f" jobs over half a card share one {r['pairing']:4.2f}"
    )
    print(
        f"  gpuwait's policy    replayed without overheads {r['replay']:4.2f}"
        f" [{r['replay wait']:.1f}s], with run times known {r['informed']:4.2f}"
        f" [{r['informed wait']:.1f}s]"
    )
    print(
        f"  greedy, no holds    priority order {r['priority']:4.2f} [{r['priority wait']:.1f}s],"
        f" largest first respecting arrivals {r['largest']:4.2f} [{r['largest wait']:.1f}s],"
        f" offline largest first {r['offline']:4.2f}"
    )


def report(result: Result, bound: float) -> str:
    outcomes = result.outcomes
    span = result.makespan()
    usable = GPUS * CARD_GIB * SAFETY
    done = [o for o in outcomes if o.returncode == 0]
    area = sum(o.job.vram_gib * o.job.gpus * o.job.duration for o in done)
    urgent = [
        o.start - o.job.arrival for o in outcomes if o.job.priority == 5 and o.start is not None
    ]
    # What the replays do not have: starting the job's process, and noticing that it ended.
    overruns = [
        o.end - o.start - o.job.duration for o in done if o.start is not None and o.end is not None
    ]
    return (
        f"{result.policy:<12} makespan {span:6.1f}s = {span / bound:4.2f} x bound   "
        f"VRAM-time used {100 * area / (usable * span):4.1f}%   "
        f"OOM {sum(o.oom for o in outcomes):3d}   failed {sum(o.returncode != 0 for o in outcomes):3d}   "
        f"p95 wait (priority 5) {percentile(urgent, 95) if urgent else float('nan'):5.1f}s   "
        f"overrun {statistics.mean(overruns) if overruns else float('nan'):4.2f}s"
    )


def main() -> None:
    global CARD_GIB
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=4)
    parser.add_argument("--scale", type=float, default=0.6, help="multiply every run time")
    parser.add_argument("--arrive-within", type=float, default=10.0, help="seconds")
    parser.add_argument("--poll", type=float, default=0.5, help="baselines' polling interval")
    parser.add_argument("--card-gib", type=int, default=CARD_GIB, help="memory of each GPU")
    parser.add_argument(
        "--policies", default="gpuwait,poller,one-per-gpu", help="comma-separated subset"
    )
    parser.add_argument(
        "--replay-seeds",
        type=int,
        default=0,
        metavar="N",
        help="also print the references' means over seeds 1..N (one trace moves a lot)",
    )
    args = parser.parse_args()
    CARD_GIB = args.card_gib
    trace = make_trace(args.seed, args.scale, args.arrive_within)
    bound = lower_bound(trace)
    kinds = {k: sum(k in j.name for j in trace) for k in ("small", "large", "gang")}
    print(
        f"trace: {len(trace)} jobs ({kinds['small']} small 2-6 GiB, {kinds['large']} of 20-40 GiB, "
        f"{kinds['gang']} 2-GPU gangs), arriving within {args.arrive_within:g}s, on {GPUS} x "
        f"{CARD_GIB} GiB at safety {SAFETY}; lower bound {bound:.1f}s"
    )
    print("ratios to that bound, computed without running anything [p95 wait of priority-5 jobs]:")
    print_references(references(trace))
    if args.replay_seeds:
        each = [
            references(make_trace(seed, args.scale, args.arrive_within))
            for seed in range(1, args.replay_seeds + 1)
        ]
        print(f"the same, means over seeds 1-{args.replay_seeds}:")
        print_references({k: statistics.mean(r[k] for r in each) for k in each[0]})
    for policy in filter(None, args.policies.split(",")):
        if policy == "gpuwait":
            result = run_gpuwait(trace)
        else:
            result = run_baseline(trace, policy, args.poll)
        print(report(result, bound), flush=True)


if __name__ == "__main__":
    main()
