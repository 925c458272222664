"""Chaos: a long, seeded random sequence of operations on simulated GPUs, invariants checked.

Real `gpuwait` processes on a simulated machine (two 24 GiB cards by default) run simulated
CUDA jobs (`gpuwait sim job`) of random sizes, ramps, holds and exit statuses, some larger than
any card, some on two GPUs, some with a priority, some without `--vram` (the size learned from
the history of a few repeated commands), some lying (allocating more than they reserved). In
between, the driver sends `kill -9`, `-TERM`, or `-STOP` and later `-CONT` to a random gpuwait
or to its command, starts simulated jobs outside gpuwait that take memory, asks `status`,
`history` and `estimate`, changes the config (safety, queue_order), and rarely damages the
ledger or the history file.

Invariants checked after every step and at the end (each one broken is printed):
  oom over-admission  a simulated job that ran out of memory while every other process on
                      its card was an honest gpuwait job (its size given, or learned and no
                      smaller than what it takes) or memory taken outside gpuwait over a
                      second before the job started: gpuwait admitted it over them (an OOM
                      beside a liar, or beside outside memory taken later, is legitimate)
  hang                a gpuwait still running at the end (nothing may wait for ever: a request
                      that can never fit says so and exits 3)
  exit status         a gpuwait whose exit status is not what its command's was (or what its
                      signal, its timeout or an impossible request makes it)
  stale entry         an entry whose gpuwait and command are both gone, still in the ledger
                      after the next `gpuwait status` (which reaps it, unless a stopped gpuwait
                      holds the ledger lock: it then says it shows the ledger not tidied)
  traceback           a Traceback on the stderr of any gpuwait
  status/history      `status`, `history` or `estimate` exiting other than 0, or taking a minute
  ledger              ledger.json not valid JSON after a gpuwait operation

Run: `python bench/chaos.py --seed 1 --steps 300 -v` (or `--seeds 1-20`); exit 1 if anything
broke, and the sandbox of a seed that broke something (state dir, every gpuwait's stderr) is
kept and named.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO)]

from _common import GPUWAIT, sandbox  # noqa: E402

from gpuwait.gpu.sim import live_allocations, load_sim_file  # noqa: E402
from gpuwait.linux import proc  # noqa: E402

GIB = 2**30
CARD_GIB = 24
#: Sizes that fit any safety the driver sets (0.75 .. 1.0 of 24 GiB), and sizes that fit none.
FITTING = [1, 2, 3, 4, 6, 8, 10, 12, 16, 18]
IMPOSSIBLE = [30, 40]
#: Repeated commands run without --vram, so that their size is learned from the history.
LEARNED = [("small", 3), ("medium", 7), ("large", 14)]
OOM = re.compile(r"out of memory|RESOURCE_EXHAUSTED", re.I)
HOLDERS = re.compile(r"Process (\d+) has")


@dataclass
class Launch:
    n: int
    argv: list[str]
    proc: subprocess.Popen[bytes]
    err: Path
    reserved: int | None  # bytes asked per GPU (None: learned from history)
    uses: int  # bytes the command allocates per GPU
    gpus: int
    exit: int
    impossible: bool
    timeout: bool
    started: float
    signals: list[tuple[str, int]] = field(default_factory=list)  # (target, signal)
    stopped: int | None = None  # pid left stopped, to continue at `resume_at`
    resume_at: float = 0.0
    rc: int | None = None
    checked: bool = False
    command_started: float | None = None  # wall clock, from /proc
    learned: int | None = None  # without --vram: what its entry reserved, learned from history

    def kind(self) -> str:
        """'liar' (allocates more than it reserved), 'learned' (reserved less than it uses,
        or not known yet, from the history) or 'honest'."""
        reserved = self.reserved if self.reserved is not None else self.learned
        if reserved is None:
            return "learned"
        if self.uses > reserved:
            return "liar" if self.reserved is not None else "learned"
        return "honest"


@dataclass
class Owner:
    """Who a simulated process that holds memory is: 'honest', 'liar', 'learned', 'outside'."""

    kind: str
    launch: int | None
    seen: float = 0.0  # when the driver first saw its memory (wall clock)


def started_at(pid: int) -> float | None:
    """When process `pid` started (wall clock); None once it is gone."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None
    return BOOT + ticks / TICKS


BOOT = next(
    int(line.split()[1])
    for line in Path("/proc/stat").read_text().splitlines()
    if line.startswith("btime ")
)
TICKS = os.sysconf("SC_CLK_TCK")


class Chaos:
    def __init__(self, seed: int, gpus: int, verbose: bool, max_live: int = 16) -> None:
        self.seed = seed
        self.max_live = max_live
        self.rng = random.Random(seed)
        self.verbose = verbose
        self.env = sandbox(gpus=gpus, memory=f"{CARD_GIB}GiB")
        self.env.pop("GPUWAIT_LEDGER_DIR", None)
        self.root = Path(self.env["XDG_STATE_HOME"]).parent
        self.state = Path(self.env["XDG_STATE_HOME"]) / "gpuwait"
        self.config = Path(self.env["XDG_CONFIG_HOME"]) / "gpuwait" / "config.toml"
        self.sim = load_sim_file(self.env["GPUWAIT_SIM"])
        self.launches: list[Launch] = []
        self.outside: list[subprocess.Popen[bytes]] = []
        self.owners: dict[int, Owner] = {}
        self.broken: list[str] = []
        self.log: list[str] = []
        self.counts: dict[str, int] = {}
        self.damaged_at = 0.0

    # -- what the driver does ------------------------------------------------------------

    def say(self, line: str) -> None:
        self.log.append(line)
        if self.verbose:
            print(f"  {line}", flush=True)

    def fail(self, line: str) -> None:
        self.broken.append(line)
        print(f"  ! seed {self.seed}: {line}", flush=True)

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def launch(self) -> None:
        rng = self.rng
        n = len(self.launches)
        gpus = 2 if rng.random() < 0.2 else 1
        impossible = rng.random() < 0.08
        hold = round(rng.uniform(0.2, 2.5), 2)
        ramp = round(rng.choice([0, 0, rng.uniform(0.1, 1.0)]), 2)
        code = rng.choice([0, 0, 0, 0, 3, 7])
        args: list[str] = ["-q"]
        learned = not impossible and gpus == 1 and rng.random() < 0.2
        if learned:
            name, gib = rng.choice(LEARNED)
            reserved = None
            uses = gib * GIB
            args += ["--key", name]
            code = 0
        else:
            gib = rng.choice(IMPOSSIBLE if impossible else FITTING)
            reserved = gib * GIB
            lie = not impossible and rng.random() < 0.1
            uses = reserved + (rng.choice([2, 4, 8]) * GIB if lie else 0)
            args += ["--vram", f"{gib}G"]
        if gpus == 2:
            args += ["--gpus", "2"]
            impossible = impossible or len(self.sim.gpus) < 2
        if rng.random() < 0.3:
            args += ["--priority", str(rng.randint(1, 5))]
        timeout = rng.random() < 0.1
        if timeout:
            args += ["--timeout", f"{rng.uniform(0.5, 3):.1f}s"]
        command = ["--", *GPUWAIT, "sim", "job", "--vram", f"{uses // GIB}G"]
        command += ["--hold", f"{hold}s", "--exit", str(code)]
        if ramp:
            command += ["--ramp", f"{ramp}s"]
        if gpus == 2:
            command += ["--gpus", "2"]
        argv = [*GPUWAIT, *args, *command]
        err = self.root / f"err.{n}"
        env = dict(self.env, CHAOS_TAG=str(n))
        with err.open("wb") as handle:
            popen = subprocess.Popen(
                argv, env=env, cwd="/", stdout=subprocess.DEVNULL, stderr=handle
            )
        launch = Launch(
            n, argv, popen, err, reserved, uses, gpus, code, impossible, timeout, time.time()
        )
        self.launches.append(launch)
        self.count("launches")
        shown = " ".join(argv[len(GPUWAIT) :]).replace(" ".join(GPUWAIT), "gpuwait")
        self.say(f"launch #{n} (pid {popen.pid}): gpuwait {shown}")

    def live(self) -> list[Launch]:
        return [launch for launch in self.launches if launch.proc.poll() is None]

    def signal(self) -> None:
        live = self.live()
        if not live:
            return
        launch = self.rng.choice(live)
        sig = self.rng.choice([signal.SIGKILL, signal.SIGTERM, signal.SIGTERM, signal.SIGSTOP])
        target = "gpuwait"
        pid = launch.proc.pid
        kids = proc.children_map().get(pid, [])
        if kids and self.rng.random() < 0.5:
            target = "command"
            pid = kids[0]
        if launch.stopped is not None and sig == signal.SIGSTOP:
            return
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        launch.signals.append((target, sig))
        self.count(f"{signal.Signals(sig).name} {target}")
        if sig == signal.SIGSTOP:
            launch.stopped = pid
            launch.resume_at = time.monotonic() + self.rng.choice([0.3, 1.0, 4.0])
        self.say(f"kill -{signal.Signals(sig).name[3:]} #{launch.n}'s {target} ({pid})")

    def resume(self) -> None:
        now = time.monotonic()
        for launch in self.launches:
            if launch.stopped is not None and now >= launch.resume_at:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(launch.stopped, signal.SIGCONT)
                self.say(f"kill -CONT #{launch.n} ({launch.stopped})")
                launch.stopped = None

    def grab(self) -> None:
        gpu = self.rng.randrange(len(self.sim.gpus))
        gib = self.rng.choice([2, 4, 8])
        hold = self.rng.uniform(0.5, 3)
        env = dict(self.env, CUDA_VISIBLE_DEVICES=str(gpu), CHAOS_TAG="outside")
        argv = [*GPUWAIT, "sim", "job", "--vram", f"{gib}G", "--hold", f"{hold:.1f}s"]
        self.outside.append(
            subprocess.Popen(
                argv, env=env, cwd="/", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
        )
        self.count("outside grabs")
        self.say(f"outside: {gib}G on GPU {gpu} for {hold:.1f}s")

    def ask(self) -> None:
        what = self.rng.choice(["status", "status --json", "history", "estimate"])
        if what == "estimate":
            name, gib = self.rng.choice(LEARNED)
            argv = ["estimate", "--key", name, "--", *GPUWAIT, "sim", "job"]
            argv += ["--vram", f"{gib}G"]
        else:
            argv = what.split()
        self.gpuwait(argv, what)

    def gpuwait(self, argv: list[str], what: str) -> subprocess.CompletedProcess[str] | None:
        self.count(what)
        try:
            done = subprocess.run(
                [*GPUWAIT, *argv],
                env=self.env,
                cwd="/",
                capture_output=True,
                text=True,
                timeout=60,
            )
        except subprocess.TimeoutExpired:
            self.fail(f"`gpuwait {what}` still running after 60 s")
            return None
        if done.returncode != 0 or "Traceback" in done.stderr:
            self.fail(f"`gpuwait {what}` exited {done.returncode}: {done.stderr.strip()[-600:]}")
        return done

    def reconfigure(self) -> None:
        safety = self.rng.choice([0.75, 0.8, 0.9, 0.95, 1.0])
        order = self.rng.choice(["lookahead", "fifo"])
        self.config.parent.mkdir(parents=True, exist_ok=True)
        self.config.write_text(f'safety = {safety}\nqueue_order = "{order}"\n')
        self.count("config changes")
        self.say(f"config: safety = {safety}, queue_order = {order}")

    def damage(self) -> None:
        name = self.rng.choice(["ledger.json", "history.jsonl"])
        path = self.state / name
        try:
            data = path.read_bytes()
        except OSError:
            return
        how = self.rng.choice(["truncate", "garbage"])
        if how == "truncate":
            data = data[: self.rng.randrange(max(1, len(data)))]
        else:
            at = self.rng.randrange(max(1, len(data)))
            data = data[:at] + b"\x00{garbage" + data[at + 9 :]
        tmp = path.with_name(path.name + ".chaos")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        self.damaged_at = time.time()
        self.count("damaged files")
        self.say(f"damage: {name} ({how})")

    # -- what it checks ------------------------------------------------------------------

    def learn_owners(self) -> None:
        """Who every simulated process holding memory now is (read from its environment)."""
        for launch in self.live():
            if launch.command_started is None:
                kids = proc.children_map().get(launch.proc.pid, [])
                if kids:
                    launch.command_started = started_at(kids[0])
        by_pid = {launch.proc.pid: launch for launch in self.launches}
        with contextlib.suppress(OSError, ValueError, AttributeError, TypeError):
            for job in json.loads((self.state / "ledger.json").read_bytes())["jobs"]:
                launch = by_pid.get(job["pid"])
                if launch and launch.reserved is None and job.get("state") == "running":
                    launch.learned = job.get("reserved_bytes")
        for allocation in live_allocations(self.sim):
            if allocation.pid in self.owners:
                continue
            try:
                environ = Path(f"/proc/{allocation.pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            tag = next((e[10:].decode() for e in environ if e.startswith(b"CHAOS_TAG=")), None)
            if tag is None:
                continue
            if tag == "outside":
                self.owners[allocation.pid] = Owner("outside", None, time.time())
                continue
            launch = self.launches[int(tag)]
            self.owners[allocation.pid] = Owner(launch.kind(), launch.n, time.time())

    def finished(self, launch: Launch) -> None:
        launch.checked = True
        rc = launch.rc
        err = launch.err.read_text(errors="replace")
        what = f"#{launch.n} ({' '.join(launch.argv[len(GPUWAIT) : len(GPUWAIT) + 8])} ...)"
        if "Traceback" in err:
            self.fail(f"traceback from {what}: {err.strip()[-800:]}")
        expected = {launch.exit}
        if launch.impossible:
            expected = {3}
        if launch.timeout:
            expected.add(124)
        oom = bool(OOM.search(err))
        if oom:
            self.count("OOM")
            expected.add(1)
            self.judge_oom(launch, err)
        for target, sig in launch.signals:
            if sig in (signal.SIGKILL, signal.SIGTERM):
                expected |= {-sig, 128 + sig}
                if target == "command" and launch.gpus == 2:
                    expected.add(1)  # a rank's partner ended by the signal
        if rc not in expected:
            self.fail(f"{what} exited {rc}, expected one of {sorted(expected)}: {err[-600:]}")

    def judge_oom(self, launch: Launch, err: str) -> None:
        own = launch.kind()
        if own != "honest":
            self.count(f"OOM of a {own} job (legitimate)")
            return
        if time.time() - self.damaged_at < 35:
            self.count("OOM near a damaged ledger")
        holders = [int(p) for p in HOLDERS.findall(err)]
        owners = [self.owners.get(pid, Owner("unknown", None)) for pid in holders]
        kinds = [o.kind for o in owners]
        started = launch.command_started
        if started is not None and all(
            o.kind == "honest" or (o.kind == "outside" and o.seen < started - 1.0) for o in owners
        ):
            self.fail(
                f"#{launch.n} ran out of memory beside honest gpuwait jobs and outside memory "
                f"that was there a second before it started: {err.strip()[-500:]}"
            )
            return
        if any(k in ("outside", "liar", "learned") for k in kinds):
            self.count("OOM beside outside memory or a liar (legitimate)")
            return
        if "unknown" in kinds:
            self.count("OOM beside an unattributed process")
            return
        others = [self.owners[p].launch for p in holders]
        self.fail(
            f"#{launch.n} ran out of memory beside honest gpuwait jobs {others}: "
            f"{err.strip()[-500:]}"
        )

    def check_ledger(self, reaped: set[int]) -> None:
        path = self.state / "ledger.json"
        try:
            data = json.loads(path.read_bytes())
        except FileNotFoundError:
            return
        except ValueError as exc:
            if time.time() - self.damaged_at > 1:
                self.fail(f"ledger.json does not parse after `gpuwait status`: {exc}")
            return
        for job in data.get("jobs", []):
            if job.get("pid") in reaped:
                n = next(x.n for x in self.launches if x.proc.pid == job.get("pid"))
                self.fail(
                    f"entry of #{n} (gpuwait {job.get('pid')}, gone with its command) still in "
                    f"the ledger after `gpuwait status`: {json.dumps(job)[:600]}"
                )

    def gone(self) -> set[int]:
        """gpuwait pids that ended and whose commands (every process they started) are gone."""
        tagged = set()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            match = re.search(rb"CHAOS_TAG=(\d+)", environ)
            if match:
                tagged.add(int(match.group(1)))
        return {
            launch.proc.pid
            for launch in self.launches
            if launch.proc.poll() is not None and launch.n not in tagged
        }

    def step(self) -> None:
        self.resume()
        self.learn_owners()
        for launch in self.launches:
            if not launch.checked and launch.proc.poll() is not None:
                launch.rc = launch.proc.returncode
                self.finished(launch)
        op = self.rng.choices(
            ["launch", "signal", "grab", "ask", "config", "damage", "idle"],
            weights=[35, 14, 5, 12, 2, 1, 20],
        )[0]
        if op == "launch":
            if len(self.live()) < self.max_live:
                self.launch()
        elif op == "signal":
            self.signal()
        elif op == "grab":
            self.grab()
        elif op == "ask":
            if self.rng.random() < 0.5:
                self.ask()
            else:
                self.status_reaps()
        elif op == "config":
            self.reconfigure()
        elif op == "damage":
            self.damage()
        else:
            time.sleep(self.rng.uniform(0.05, 0.3))

    def finish(self, deadline: float) -> None:
        """Wait for every gpuwait (continuing stopped ones); those left at the deadline hang."""
        for launch in self.launches:
            launch.resume_at = 0
        end = time.monotonic() + deadline
        while self.live() and time.monotonic() < end:
            self.resume()
            self.learn_owners()
            time.sleep(0.05)
        for launch in self.live():
            self.fail(
                f"#{launch.n} still running {deadline:.0f}s after the last step: "
                f"{' '.join(launch.argv[len(GPUWAIT) :])}"
            )
            launch.proc.kill()
            launch.proc.wait()
            launch.checked = True
        for launch in self.launches:
            if not launch.checked:
                launch.rc = launch.proc.returncode
                self.finished(launch)
        for other in self.outside:
            other.wait()
        # Wait for orphaned commands, then one status reaps every entry.
        wait_end = time.monotonic() + 15
        while self.gone() != {launch.proc.pid for launch in self.launches}:
            if time.monotonic() > wait_end:
                break
            time.sleep(0.1)
        self.status_reaps()
        self.gpuwait(["history", "--all"], "history")

    def status_reaps(self) -> None:
        """`status` reaps the entries of the gpuwait processes gone with their commands (unless
        a stopped gpuwait holds the ledger lock: it then says it shows the ledger untidied)."""
        gone = self.gone()
        done = self.gpuwait(["status", "--json"], "status --json")
        if done is not None and "not tidied" not in done.stdout + done.stderr:
            self.check_ledger(gone)

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def run(seed: int, steps: int, gpus: int, verbose: bool, keep: bool, max_live: int) -> Chaos:
    chaos = Chaos(seed, gpus, verbose, max_live)
    started = time.monotonic()
    try:
        for _ in range(steps):
            chaos.step()
        chaos.finish(deadline=90)
    finally:
        for launch in chaos.launches:
            if launch.proc.poll() is None:
                launch.proc.kill()
                launch.proc.wait()
        for other in chaos.outside:
            if other.poll() is None:
                other.kill()
                other.wait()
    counts = ", ".join(f"{k} {v}" for k, v in sorted(chaos.counts.items()))
    print(
        f"seed {seed}: {steps} steps in {time.monotonic() - started:.0f}s, "
        f"{len(chaos.broken)} invariants broken; {counts}",
        flush=True,
    )
    if keep or chaos.broken:
        print(f"  kept: {chaos.root}")
    else:
        chaos.cleanup()
    return chaos


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--seeds", help="a range of seeds, e.g. 1-20 (instead of --seed)")
    parser.add_argument("--steps", type=int, default=300, help="operations per seed")
    parser.add_argument("--gpus", type=int, default=2, help="simulated 24 GiB GPUs")
    parser.add_argument("--max-live", type=int, default=16, help="gpuwait processes at most")
    parser.add_argument("--keep", action="store_true", help="keep the sandbox (state, stderr)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every operation")
    args = parser.parse_args()
    if args.seeds:
        first, _, last = args.seeds.partition("-")
        seeds = list(range(int(first), int(last or first) + 1))
    else:
        seeds = [args.seed]
    broken = 0
    for seed in seeds:
        broken += len(
            run(seed, args.steps, args.gpus, args.verbose, args.keep, args.max_live).broken
        )
    sys.exit(1 if broken else 0)


if __name__ == "__main__":
    main()
