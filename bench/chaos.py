"""Chaos: a long, seeded random sequence of operations on simulated GPUs, invariants checked.

Real `gpuwait` processes on a simulated machine (two 24 GiB cards by default) run simulated
CUDA jobs (`gpuwait sim job`) of random sizes, ramps, holds and exit statuses, some larger than
any card, some on two GPUs, some with a priority, a `--name`, a `--batch` or a `--timeout`,
some without `--vram` (the size learned from the history of a few repeated commands), some
lying (allocating more than they reserved), some `--after` the name of an earlier job, some
long `--pausable` jobs of priority 1 that checkpoint when asked (`sim job --checkpoint`) beside
urgent ones of priority 5 that make them step aside. In between, the driver sends `kill -9`,
`-TERM`, or `-STOP` and later `-CONT` to a random gpuwait or to its command, `kill -9` to a
gpuwait caught holding the ledger lock, `gpuwait cancel` (by id, name or batch, by the job's
owner or by the other user), starts simulated jobs outside gpuwait that take memory (some given
an entry with `gpuwait adopt`), asks `status`, `history` and `estimate`, changes the config
(safety, queue_order), and rarely damages the ledger or the history file. Run as root, a second
user (uid 47301, no account needed) shares the ledger directory (and the simulation) and does a
third of all this (`--users 1`: root alone, in a private ledger).

Invariants checked after every step and at the end (each one broken is printed):
  oom over-admission  a simulated job that ran out of memory while every other process on
                      its card was an honest gpuwait job (its size given, or learned and no
                      smaller than what it takes) or memory taken outside gpuwait over a
                      second before gpuwait admitted the job: gpuwait admitted it over them
                      (an OOM beside a liar, or beside outside memory taken after the
                      admission, even before the command started, is legitimate; a job
                      whose admission the driver did not see was admitted after its launch)
  hang                a gpuwait still running at the end (nothing may wait for ever: a request
                      that can never fit says so and exits 3)
  exit status         a gpuwait whose exit status is not what its command's was (or what its
                      signal, its timeout or an impossible request makes it)
  stale entry         an entry whose gpuwait and command are both gone, still in the ledger
                      after the next `gpuwait status` (which reaps it, unless a stopped gpuwait
                      holds the ledger lock: it then says it shows the ledger not tidied)
  traceback           a Traceback on the stderr of any gpuwait
  status/history      `status`, `history` or `estimate` exiting other than 0, or taking a minute
  ledger              a ledger file not valid JSON after a gpuwait operation
  cancel              `gpuwait cancel` of a live job exiting other than 0 (or 2: it ended
                      meanwhile), or, by the other (non-root) user, other than 8 (or 2); a
                      waiting job cancelled exits 7 with its entry gone, a running one as TERM
                      makes it
  --after             a job's command started while the command of a job it was started
                      `--after` still ran
  --timeout           a gpuwait still waiting for its first start 5 s past its --timeout
                      (never stopped by the driver)
  adopt               `gpuwait adopt` of a live outside job exiting other than 0; its entry is
                      reaped by the next `status` once the process has ended
  pausing             a paused job ends (no hang) with its command's own status, unless the
                      driver or a cancel stopped it (then the resume status may be its status);
                      the count `paused jobs that resumed and ended` says how many did
  other user          no job ends by a signal nobody sent it: the exit status check holds for
                      both users, so one user's gpuwait signalling another's job shows there

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

sys.path[:0] = [str(REPO / "tests")]

from _common import GPUWAIT, sandbox  # noqa: E402
from helpers.users import make_shared_ledger_dir, user_argv, user_home  # noqa: E402

from gpuwait.gpu.sim import live_allocations, load_sim_file  # noqa: E402
from gpuwait.linux import proc  # noqa: E402
from gpuwait.linux.lock import holders  # noqa: E402

GIB = 2**30
CARD_GIB = 24
#: Sizes that fit any safety the driver sets (0.75 .. 1.0 of 24 GiB), and sizes that fit none.
FITTING = [1, 2, 3, 4, 6, 8, 10, 12, 16, 18]
IMPOSSIBLE = [30, 40]
#: Repeated commands run without --vram, so that their size is learned from the history.
LEARNED = [("small", 3), ("medium", 7), ("large", 14)]
OOM = re.compile(r"out of memory|RESOURCE_EXHAUSTED", re.I)
HOLDERS = re.compile(r"Process (\d+) has")
#: The second user (numeric only: no account is needed) and the group that shares the ledger.
OTHER = 47301
GROUP = 47300
#: How the second user's commands run `gpuwait sim job`: the interpreter running the driver may
#: live where other users cannot reach it (a virtual environment under root's home).
USER_GPUWAIT = [shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or "python3"]
USER_GPUWAIT += ["-m", "gpuwait"]
#: Outside memory the driver saw this long before gpuwait admitted a job was there for gpuwait's
#: reading of the GPUs, taken just before it decides.
SAW_MARGIN = 1.0
#: What a --timeout may overrun by on a loaded machine before it counts as broken.
TIMEOUT_MARGIN = 5.0
#: The resume status (resume_exit's default), and the status of a waiting job cancelled.
RESUMED = 75
CANCELLED = 7
#: Each operation of a step, and how often it is chosen.
OPERATIONS = {
    "launch": 26,
    "pausable": 4,  # a long --pausable job of priority 1
    "urgent": 3,  # a priority-5 job, which may make a pausable one step aside
    "chain": 5,  # --after an earlier job's name
    "signal": 14,
    "cancel": 5,
    "grab": 5,  # memory taken outside gpuwait
    "adopt": 2,
    "lock kill": 1,  # kill -9 of a gpuwait holding the ledger lock
    "ask": 12,  # status, history, estimate
    "config": 2,
    "damage": 1,
    "idle": 20,
}


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
    #: When gpuwait admitted it (its running entry's started_at, wall clock), as last seen in
    #: the ledger; None before that, and again once seen waiting (a paused job queued again).
    admitted: float | None = None
    learned: int | None = None  # without --vram: what its entry reserved, learned from history
    uid: int = 0
    name: str | None = None
    after: list[int] = field(default_factory=list)  # launches it waits for (--after NAME)
    pausable: bool = False
    checkpoint: Path | None = None  # a pausable job's: written once it steps aside
    batch: str | None = None
    timeout_s: float | None = None
    cancelled: bool = False  # a `gpuwait cancel` of it succeeded
    stopped_ever: bool = False
    seen_waiting_late: bool = False
    queued: bool = False  # its entry was seen in the ledger
    text: str = ""  # its arguments, as printed

    def kind(self) -> str:
        """'liar' (allocates more than it reserved), 'learned' (reserved less than it uses,
        or not known yet, from the history) or 'honest'."""
        reserved = self.reserved if self.reserved is not None else self.learned
        if reserved is None:
            return "learned"
        if self.uses > reserved:
            return "liar" if self.reserved is not None else "learned"
        return "honest"


def shown(args: list[str]) -> str:
    text = " ".join(args).replace(" ".join(GPUWAIT), "gpuwait")
    return text.replace(" ".join(USER_GPUWAIT), "gpuwait")


@dataclass
class Owner:
    """Who a simulated process that holds memory is: 'honest', 'liar', 'learned', 'outside'."""

    kind: str
    launch: int | None
    seen: float = 0.0  # when the driver first saw its memory (wall clock)


def note_entry(launch: Launch, job: dict[str, object]) -> None:
    """What `launch`'s ledger entry `job`, seen now, tells: it queued; running, when gpuwait
    admitted it and (without --vram) what it reserved; waiting again, no admission yet."""
    launch.queued = True
    if job.get("state") != "running":
        launch.admitted = None
        return
    at, reserved = job.get("started_at"), job.get("reserved_bytes")
    if isinstance(at, (int, float)):
        launch.admitted = float(at)
    if launch.reserved is None:
        launch.learned = reserved if isinstance(reserved, int) else None


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
    def __init__(
        self, seed: int, gpus: int, verbose: bool, max_live: int = 16, users: int = 1
    ) -> None:
        self.seed = seed
        self.max_live = max_live
        self.rng = random.Random(seed)
        self.verbose = verbose
        shared = users > 1
        self.env = sandbox(gpus=gpus, memory=f"{CARD_GIB}GiB", shared=shared)
        self.env.pop("GPUWAIT_LEDGER_DIR", None)
        # Pausable jobs may be asked to step aside once they have run a second.
        self.env["GPUWAIT_PAUSE_MIN_RUNTIME"] = "1s"
        self.root = Path(self.env["XDG_STATE_HOME"]).parent
        self.state = Path(self.env["XDG_STATE_HOME"]) / "gpuwait"
        self.ledger_dir: Path | None = None
        #: Each user's environment (root's is self.env); with a second user, one shared ledger.
        self.envs = {0: self.env}
        if shared:
            self.ledger_dir = make_shared_ledger_dir(self.root, GROUP)
            self.env["GPUWAIT_LEDGER_DIR"] = str(self.ledger_dir)
            self.envs[OTHER] = {**self.env, **user_home(self.root, OTHER, OTHER)}
        self.adopted: list[tuple[int, subprocess.Popen[bytes]]] = []  # (uid, outside process)
        self.config = Path(self.env["XDG_CONFIG_HOME"]) / "gpuwait" / "config.toml"
        self.sim = load_sim_file(self.env["GPUWAIT_SIM"])
        self.launches: list[Launch] = []
        self.outside: list[subprocess.Popen[bytes]] = []
        self.owners: dict[int, Owner] = {}
        self.broken: list[str] = []
        self.log: list[str] = []
        self.counts: dict[str, int] = {}
        self.damaged_at = 0.0
        self.ledger_damaged_at = 0.0  # a damaged ledger forgets the jobs that finished

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

    def user(self) -> int:
        """Whose the next operation is: root's, or now and then the second user's."""
        others = [uid for uid in self.envs if uid != 0]
        return self.rng.choice(others) if others and self.rng.random() < 0.35 else 0

    @staticmethod
    def gpuwait_for(uid: int) -> list[str]:
        """How a command of `uid`'s runs gpuwait."""
        return GPUWAIT if uid == 0 else USER_GPUWAIT

    def argv_as(self, uid: int, args: list[str]) -> list[str]:
        """argv of `gpuwait ARGS` run by `uid`."""
        return [*GPUWAIT, *args] if uid == 0 else user_argv(uid, uid, [GROUP], args)

    def launch(self, kind: str = "plain") -> None:
        """kind: 'plain' (random), 'pausable' (a long --pausable job of priority 1 that
        checkpoints when asked), 'urgent' (priority 5, large enough to make one step aside),
        'chain' (--after the name of an earlier launch of the same user)."""
        rng = self.rng
        n = len(self.launches)
        uid = self.user()
        gpus = 2 if kind == "plain" and rng.random() < 0.2 else 1
        impossible = kind == "plain" and rng.random() < 0.08
        hold = round(rng.uniform(0.2, 2.5), 2)
        ramp = round(rng.choice([0, 0, rng.uniform(0.1, 1.0)]), 2)
        code = rng.choice([0, 0, 0, 0, 3, 7])
        args: list[str] = ["-q"]
        name = f"c{n}" if kind != "plain" or rng.random() < 0.5 else None
        if name:
            args += ["--name", name]
        batch = rng.choice(["b1", "b2"]) if rng.random() < 0.15 else None
        if batch:
            args += ["--batch", batch]
        after: list[int] = []
        if kind == "chain":
            # Behind a job seen in the queue: a name never queued is an error (exit 2).
            earlier = [x for x in self.launches if x.name and x.uid == uid and x.queued]
            if not earlier:
                return
            before = rng.choice(earlier[-8:])
            after = [before.n]
            args += ["--after", str(before.name)]
        learned = kind == "plain" and not impossible and gpus == 1 and rng.random() < 0.2
        if learned:
            key, gib = rng.choice(LEARNED)
            reserved = None
            uses = gib * GIB
            args += ["--key", key]
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
        checkpoint: list[str] = []
        saved = None
        if kind == "pausable":
            args += ["--pausable", "--priority", "1"]
            hold = round(rng.uniform(3, 6), 2)
            saved = (Path(self.envs[uid]["HOME"]) if uid else self.root) / f"ckpt.{n}"
            checkpoint = ["--checkpoint", str(saved)]
        elif kind == "urgent":
            args += ["--priority", "5"]
        elif rng.random() < 0.3:
            args += ["--priority", str(rng.randint(1, 5))]
        timeout = kind != "pausable" and rng.random() < 0.1
        timeout_s = round(rng.uniform(0.5, 3), 1) if timeout else None
        if timeout:
            args += ["--timeout", f"{timeout_s}s"]
        command = ["--", *self.gpuwait_for(uid), "sim", "job", "--vram", f"{uses // GIB}G"]
        command += ["--hold", f"{hold}s", "--exit", str(code), *checkpoint]
        if ramp:
            command += ["--ramp", f"{ramp}s"]
        if gpus == 2:
            command += ["--gpus", "2"]
        argv = self.argv_as(uid, [*args, *command])
        err = self.root / f"err.{n}"
        env = dict(self.envs[uid], CHAOS_TAG=f"{os.getpid()}.{n}")  # this driver's launch n
        with err.open("wb") as handle:
            popen = subprocess.Popen(
                argv, env=env, cwd="/", stdout=subprocess.DEVNULL, stderr=handle
            )
        launch = Launch(
            n, argv, popen, err, reserved, uses, gpus, code, impossible, timeout, time.time()
        )
        launch.uid, launch.name, launch.after, launch.batch = uid, name, after, batch
        launch.pausable, launch.checkpoint, launch.timeout_s = saved is not None, saved, timeout_s
        launch.text = shown(args + command)
        self.launches.append(launch)
        self.count("launches" if kind == "plain" else f"launches ({kind})")
        if uid:
            self.count("launches by the second user")
        self.say(f"launch #{n} (pid {popen.pid}, uid {uid}): gpuwait {launch.text}")

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
            launch.stopped_ever = True
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
        self.gpuwait(argv, what, self.user())

    def run_gpuwait(
        self, argv: list[str], env: dict[str, str], what: str
    ) -> subprocess.CompletedProcess[str] | None:
        """Run a gpuwait to its end (a minute at most, else broken)."""
        self.count(what)
        try:
            return subprocess.run(
                argv, env=env, cwd="/", capture_output=True, text=True, timeout=60
            )
        except subprocess.TimeoutExpired:
            self.fail(f"`gpuwait {what}` still running after 60 s")
            return None

    def gpuwait(
        self, argv: list[str], what: str, uid: int = 0
    ) -> subprocess.CompletedProcess[str] | None:
        done = self.run_gpuwait(self.argv_as(uid, argv), self.envs[uid], what)
        if done is None:
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
        ledger = self.state / "ledger.json"
        if self.ledger_dir is not None:
            ledger = self.ledger_dir / "ledger.0.json"  # root's own file only
        path = self.rng.choice([ledger, self.state / "history.jsonl"])
        name = path.name
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
        if self.ledger_dir is not None:
            with path.open("r+b") as handle:  # in place: its owner and mode stay
                handle.write(data)
                handle.truncate()
        else:
            tmp = path.with_name(path.name + ".chaos")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        self.damaged_at = time.time()
        if path != self.state / "history.jsonl":
            self.ledger_damaged_at = self.damaged_at
        self.count("damaged files")
        self.say(f"damage: {name} ({how})")

    def ledger_files(self) -> list[Path]:
        if self.ledger_dir is None:
            return [self.state / "ledger.json"]
        return sorted(self.ledger_dir.glob("ledger.*.json"))

    def entries(self) -> list[dict[str, object]]:
        """Every user's entries as the files stand (none of a file missing or mid-write)."""
        jobs: list[dict[str, object]] = []
        for path in self.ledger_files():
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                jobs += json.loads(path.read_bytes())["jobs"]
        return jobs

    def lock_may_be_stopped(self) -> bool:
        """Is a gpuwait stopped now (it may hold the ledger lock)? The driver's own `cancel`
        or `adopt` would then wait for the lock until it gave up, and resume nobody meanwhile."""
        return any(x.stopped == x.proc.pid for x in self.launches)

    def cancel(self) -> None:
        """`gpuwait cancel` of a live launch, by its id, its name or its batch, by its owner,
        or now and then by the other user (refused unless that one is root)."""
        live = [x for x in self.live() if x.stopped is None]
        if not live or self.lock_may_be_stopped():
            return
        launch = self.rng.choice(live)
        by_pid = {job.get("pid"): job for job in self.entries()}
        job = by_pid.get(launch.proc.pid)
        targets = [str(job["id"])] if job and job.get("id") else []
        if launch.name:
            targets.append(launch.name)
        if launch.batch:
            targets.append(f"--batch={launch.batch}")
        if not targets:
            return
        target = self.rng.choice(targets)
        asker = launch.uid
        if len(self.envs) > 1 and self.rng.random() < 0.2:
            asker = next(uid for uid in self.envs if uid != launch.uid)
        argv = self.argv_as(asker, ["cancel", target])
        hit = [launch]
        if target.startswith("--batch="):  # the batch's jobs in the queue now: the asker's,
            # where it has any (of either user's, as far as the driver tells)
            hit = [x for x in self.live() if x.batch == launch.batch]
        done = self.run_gpuwait(argv, self.envs[asker], f"cancel (uid {asker})")
        if done is None:
            return
        allowed = {0, 2}  # 2: it ended meanwhile (a name or id matching nothing)
        if asker not in (0, launch.uid):
            allowed = {2, 8}  # another user's job: refused (or, by name, none of theirs)
        if target.startswith("--batch=") and asker != 0:
            # Both users have these batches: the asker's jobs of it in the queue, or where
            # none is (any more), the other user's, refused.
            allowed = {0, 2, 8}
        if done.returncode not in allowed or "Traceback" in done.stderr:
            self.fail(
                f"`gpuwait cancel {target}` by uid {asker} of #{launch.n} (uid {launch.uid}) "
                f"exited {done.returncode}, expected one of {sorted(allowed)}: "
                f"{done.stderr.strip()[-400:]}"
            )
        if done.returncode == 0:
            for each in hit:
                each.cancelled = True
        self.say(f"cancel {target} (#{launch.n}) by uid {asker}: exit {done.returncode}")

    def adopt(self) -> None:
        """A simulated job started outside gpuwait, given an entry with `gpuwait adopt` once it
        holds its memory."""
        if self.lock_may_be_stopped():
            return
        uid = self.user()
        gpu = self.rng.randrange(len(self.sim.gpus))
        gib = self.rng.choice([1, 2, 4])
        hold = self.rng.uniform(0.5, 3)
        env = dict(self.envs[uid], CUDA_VISIBLE_DEVICES=str(gpu), CHAOS_TAG="outside")
        argv = [*self.gpuwait_for(uid), "sim", "job", "--vram", f"{gib}G"]
        argv += ["--hold", f"{hold:.1f}s"]
        if uid:
            argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv]
        outside = subprocess.Popen(
            argv, env=env, cwd="/", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.outside.append(outside)
        end = time.monotonic() + 5
        while time.monotonic() < end and outside.poll() is None:
            if any(a.pid == outside.pid for a in live_allocations(self.sim)):
                break
            time.sleep(0.02)
        args = ["adopt", str(outside.pid)]
        if self.rng.random() < 0.5:
            args += ["--vram", f"{gib}G"]
        if self.rng.random() < 0.5:
            args += ["--name", f"a{outside.pid}"]
        done = self.run_gpuwait(self.argv_as(uid, args), self.envs[uid], "adopt")
        if done is None:
            return
        self.adopted.append((uid, outside))
        # Ended, or past its hold and letting its memory go: nothing to adopt (exit 2).
        holds = any(a.pid == outside.pid for a in live_allocations(self.sim))
        if done.returncode not in ({0} if holds else {0, 2}) or "Traceback" in done.stderr:
            self.fail(
                f"`gpuwait adopt` of a live {gib}G simulated job of uid {uid} exited "
                f"{done.returncode}: {done.stderr.strip()[-400:]}"
            )
        self.say(f"adopt {outside.pid} ({gib}G on GPU {gpu}, uid {uid}): exit {done.returncode}")

    def lock_kill(self) -> None:
        """`kill -9` of a gpuwait caught holding the ledger lock."""
        lock = self.ledger_dir or self.state / "ledger.lock"
        try:
            fd = os.open(lock, os.O_RDONLY)
        except OSError:
            return
        ours = {x.proc.pid: x for x in self.live() if x.stopped is None}
        try:
            end = time.monotonic() + 1.0
            while time.monotonic() < end:
                held = [ours[pid] for pid in holders(fd) if pid in ours]
                if held:
                    launch = held[0]
                    os.kill(launch.proc.pid, signal.SIGKILL)
                    launch.signals.append(("gpuwait", signal.SIGKILL))
                    self.count("kill -9 of a gpuwait holding the ledger lock")
                    self.say(f"kill -KILL #{launch.n} holding the ledger lock")
                    return
                time.sleep(0.002)
        finally:
            os.close(fd)

    # -- what it checks ------------------------------------------------------------------

    def learn_owners(self) -> None:
        """Who every simulated process holding memory now is (read from its environment)."""
        children = proc.children_map()
        for launch in self.live():
            if launch.command_started is None:
                kids = children.get(launch.proc.pid, [])
                if kids:
                    launch.command_started = started_at(kids[0])
                    self.check_after(launch)
        by_pid = {launch.proc.pid: launch for launch in self.launches}
        for job in self.entries():
            pid = job.get("pid")
            seen = by_pid.get(pid) if isinstance(pid, int) else None
            if seen is None:
                continue
            note_entry(seen, job)
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
            launch = self.launches[int(tag.rpartition(".")[2])]
            self.owners[allocation.pid] = Owner(launch.kind(), launch.n, time.time())

    def check_after(self, launch: Launch) -> None:
        """A job started --after another: that one's command must be gone by now (one whose
        command the driver signalled may leave a rank behind, which it does not judge)."""
        tagged = self.tagged()
        for n in launch.after:
            before = self.launches[n]
            if any(target == "command" for target, _ in before.signals):
                continue
            left = tagged.get(n, set()) - {before.proc.pid}
            if left:
                self.fail(
                    f"#{launch.n} (--after {before.name}) started its command while #{n}'s "
                    f"command (pids {sorted(left)}) still ran"
                )
            else:
                self.count("--after checked")

    def check_timeouts(self) -> None:
        """A --timeout job still waiting well past its timeout (never stopped by the driver)."""
        now = time.time()
        waiting = {job.get("pid"): job.get("state") for job in self.entries()}
        children = proc.children_map()
        for launch in self.live():
            if launch.timeout_s is None or launch.stopped_ever or launch.seen_waiting_late:
                continue
            if launch.command_started is not None or children.get(launch.proc.pid):
                continue
            if now - launch.started < launch.timeout_s + TIMEOUT_MARGIN:
                continue
            if waiting.get(launch.proc.pid, "waiting") != "waiting":
                continue
            launch.seen_waiting_late = True
            self.fail(
                f"#{launch.n} (--timeout {launch.timeout_s}s) still waiting "
                f"{now - launch.started:.1f}s after its launch: gpuwait {launch.text}"
            )

    def finished(self, launch: Launch) -> None:
        launch.checked = True
        rc = launch.rc
        err = launch.err.read_text(errors="replace")
        what = f"#{launch.n} ({launch.text[:120]} ...)"
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
                if launch.pausable:
                    expected.add(RESUMED)  # stopped while it stepped aside
        if any(self.ledger_damaged_at > self.launches[n].started for n in launch.after):
            expected.add(2)  # its job was forgot with the damaged ledger: no such job
        if launch.cancelled:
            expected |= {CANCELLED, -signal.SIGTERM, 128 + signal.SIGTERM}
            expected |= {RESUMED} if launch.pausable else set()
            expected |= {1} if launch.gpus == 2 else set()
            self.count("cancelled jobs ended")
        if launch.checkpoint is not None and launch.checkpoint.exists():
            ended = "resumed and ended" if rc == launch.exit else f"ended {rc}"
            self.count(f"paused jobs that {ended}")
        if rc == CANCELLED and launch.cancelled and launch.exit != CANCELLED:
            left = [job for job in self.entries() if job.get("pid") == launch.proc.pid]
            if left:
                self.fail(f"{what} exited {CANCELLED} (cancelled) but left its entry: {left}")
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
        # Outside memory counts against gpuwait only where it was there when gpuwait decided:
        # seen a second before the admission (its reading is taken just before). Memory taken
        # after it admitted the job, however long before the command started, is not its fault.
        admitted = launch.admitted
        # Its entry never seen running (admitted and out of memory between two looks, or lost
        # with a damaged ledger): it was admitted after its launch, at least, so memory seen a
        # second before the launch was there when gpuwait decided.
        since = launch.started if admitted is None else admitted
        if all(
            o.kind == "honest" or (o.kind == "outside" and o.seen < since - SAW_MARGIN)
            for o in owners
        ):
            self.fail(
                f"#{launch.n} ran out of memory beside honest gpuwait jobs and outside memory "
                f"that was there a second before gpuwait admitted it: {err.strip()[-500:]}"
            )
            return
        if admitted is None and "outside" in kinds:
            # Memory that came after the launch: before or after the admission cannot be told.
            self.count("OOM beside outside memory, its admission not seen")
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
        names = {x.proc.pid: f"#{x.n}" for x in self.launches}
        for path in self.ledger_files():
            try:
                data = json.loads(path.read_bytes())
            except FileNotFoundError:
                continue
            except ValueError as exc:
                if time.time() - self.damaged_at > 1:
                    self.fail(f"{path.name} does not parse after `gpuwait status`: {exc}")
                continue
            for job in data.get("jobs", []):
                if job.get("pid") in reaped:
                    who = names.get(job["pid"], f"adopted process {job['pid']}")
                    self.fail(
                        f"entry of {who} (gone with its command) still in {path.name} "
                        f"after `gpuwait status`: {json.dumps(job)[:600]}"
                    )

    @staticmethod
    def tagged() -> dict[int, set[int]]:
        """The live processes of each launch (its gpuwait and every process it started), of
        this driver's (others may run beside it)."""
        tagged: dict[int, set[int]] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            match = re.search(rb"CHAOS_TAG=%d\.(\d+)" % os.getpid(), environ)
            if match:
                tagged.setdefault(int(match.group(1)), set()).add(int(entry.name))
        return tagged

    def gone(self) -> set[int]:
        """gpuwait pids that ended and whose commands (every process they started) are gone,
        and adopted processes that ended."""
        tagged = self.tagged()
        return {
            launch.proc.pid
            for launch in self.launches
            if launch.proc.poll() is not None and launch.n not in tagged
        } | {outside.pid for _, outside in self.adopted if outside.poll() is not None}

    def step(self) -> None:
        self.resume()
        self.learn_owners()
        self.check_timeouts()
        for launch in self.launches:
            if not launch.checked and launch.proc.poll() is not None:
                launch.rc = launch.proc.returncode
                self.finished(launch)
        op = self.rng.choices(list(OPERATIONS), weights=list(OPERATIONS.values()))[0]
        if op in ("launch", "pausable", "urgent", "chain"):
            if len(self.live()) < self.max_live:
                self.launch("plain" if op == "launch" else op)
        elif op == "cancel":
            self.cancel()
        elif op == "adopt":
            self.adopt()
        elif op == "lock kill":
            self.lock_kill()
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
            self.check_timeouts()
            time.sleep(0.05)
        for launch in self.live():
            self.fail(
                f"#{launch.n} still running {deadline:.0f}s after the last step: gpuwait "
                f"{launch.text}"
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
        tidied = True
        for uid in self.envs:  # each user's gpuwait tidies that user's own file
            done = self.gpuwait(["status", "--json"], "status --json", uid)
            tidied = tidied and done is not None and "not tidied" not in done.stdout + done.stderr
        if tidied:
            self.check_ledger(gone)

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def run(
    seed: int, steps: int, gpus: int, verbose: bool, keep: bool, max_live: int, users: int
) -> Chaos:
    chaos = Chaos(seed, gpus, verbose, max_live, users)
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
        # What broke and the steps that led there, beside the state they left: a break that a
        # rerun of the seed does not repeat (timing decides much) can still be read afterwards.
        said = [*(f"! {line}" for line in chaos.broken), *chaos.log]
        (chaos.root / "chaos.log").write_text("\n".join(said) + "\n", encoding="utf-8")
        print(f"  kept: {chaos.root} (its chaos.log: what broke, then every step)")
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
    parser.add_argument(
        "--users",
        type=int,
        choices=[1, 2],
        default=2 if os.geteuid() == 0 else 1,
        help="2: a second user shares the ledger (needs root; the default as root)",
    )
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
        chaos = run(seed, args.steps, args.gpus, args.verbose, args.keep, args.max_live, args.users)
        broken += len(chaos.broken)
    sys.exit(1 if broken else 0)


if __name__ == "__main__":
    main()
