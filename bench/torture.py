"""Torture: hundreds of gpuwait processes against one ledger while a killer SIGKILLs them.

Peers are real `gpuwait --vram NG -q -- sleep T` processes on a simulated machine, kept
`--peers` at a time until `--launches` have started. A killer sends SIGKILL at random moments:
to a random peer, or (one kill in three) to whichever peer holds the ledger lock right now, that
is, in the middle of a ledger transaction and often of its write. A checker reads the ledger all
along. With `--users 2` (as root) the peers run as two unprivileged users against a shared
ledger directory set up as an administrator would.

Printed, with the goal of each:
  corrupt files       ledger files that did not parse, damaged copies set aside    (goal 0)
  lost entries        a peer whose command runs, but whose entry is not running     (goal 0)
  stale entries       a killed peer's entry still in a ledger written 2 s later     (goal 0)
                      (its command, orphaned, keeps the entry while it runs: 0.8 s at most)
  leaked reservations entries left once every peer and command is gone and one more gpuwait
                      ran (goal 0)
  over-admissions     a GPU whose running reservations exceed total × safety        (goal 0)
  failed peers        peers not killed that did not exit 0                          (goal 0)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from helpers.users import make_shared_ledger_dir, shared_root, user_argv, user_home  # noqa: E402

from gpuwait.queue.ledger import Ledger  # noqa: E402

GIB = 2**30
SAFETY = 0.9


@dataclass
class Figures:
    peers: int = 0
    launches: int = 0
    users: int = 1
    shared: bool = False
    kills: int = 0
    kills_holding_lock: int = 0
    kills_mid_write: int = 0
    reads: int = 0
    corrupt_files: int = 0
    lost_entries: int = 0
    stale_entries: int = 0
    leaked_reservations: int = 0
    over_admissions: int = 0
    max_fill: float = 0.0
    failed_peers: int = 0
    failures: list[str] = field(default_factory=list)
    reap_seconds: float = 0.0
    dead_before_reap: int = 0
    wall_seconds: float = 0.0

    def ok(self) -> bool:
        return not (
            self.corrupt_files
            or self.lost_entries
            or self.stale_entries
            or self.leaked_reservations
            or self.over_admissions
            or self.failed_peers
            or self.reap_seconds > 2.0
        )

    def report(self) -> str:
        who = f"{self.users} users, shared ledger" if self.shared else "1 user, private ledger"
        return "\n".join(
            [
                f"torture: {self.launches} launches, {self.peers} peers at a time, {who}",
                f"  kills               {self.kills} ({self.kills_holding_lock} holding the "
                "ledger lock"
                # A private ledger's write shows as its temporary file; a shared one's does not.
                + ("" if self.shared else f", {self.kills_mid_write} with a write in flight")
                + ")",
                f"  ledger reads        {self.reads}",
                f"  corrupt files       {self.corrupt_files}  (goal 0)",
                f"  lost entries        {self.lost_entries}  (goal 0)",
                f"  stale entries       {self.stale_entries}  (goal 0)",
                f"  leaked reservations {self.leaked_reservations}  (goal 0; "
                f"{self.dead_before_reap} dead entries before the reaping operation, which "
                f"took {self.reap_seconds:.2f}s, goal < 2s)",
                f"  over-admissions     {self.over_admissions}  (goal 0; fullest GPU "
                f"{self.max_fill:.0%} of total × safety)",
                f"  failed peers        {self.failed_peers}  (goal 0)",
                f"  wall                {self.wall_seconds:.1f}s",
            ]
        )


class Machine:
    """A simulated machine, a ledger, and how to start a peer as each user."""

    def __init__(self, users: int, gpus: int, memory_gib: int) -> None:
        self.users = users
        self.shared = users > 1
        self.root = shared_root() if self.shared else Path(tempfile.mkdtemp(prefix="gpuwait-t-"))
        self.sim = self.root / "sim.toml"
        self.sim.write_text(f'[[gpu]]\nmemory = "{memory_gib}GiB"\n' * gpus)
        os.chmod(self.sim, 0o644)
        self.gpu_usable = int(memory_gib * GIB * SAFETY)
        base = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "GPUWAIT_SIM": str(self.sim),
            # Hundreds of waiters on a small machine: poll the ledger less often than the
            # default 10 ms, or the pollers alone fill the CPUs.
            "GPUWAIT_POLL_INTERVAL": "50ms",
            "GPUWAIT_LOCK_TIMEOUT": "120s",
        }
        self.identities: list[tuple[int, int, list[int]]] = []
        self.envs: list[dict[str, str]] = []
        if self.shared:
            group = 47100
            self.ledger_dir = make_shared_ledger_dir(self.root, group)
            base["GPUWAIT_LEDGER_DIR"] = str(self.ledger_dir)
            for n in range(users):
                uid = 47101 + n
                self.identities.append((uid, uid, [group]))
                self.envs.append({**base, **user_home(self.root, uid, uid)})
        else:
            home = self.root / "home"
            self.ledger_dir = home / "state" / "gpuwait"
            self.envs.append(
                {
                    **base,
                    "HOME": str(home),
                    "XDG_STATE_HOME": str(home / "state"),
                    "XDG_CONFIG_HOME": str(home / "config"),
                    "PYTHONPATH": str(REPO),
                }
            )
        self.ledger = Ledger(self.ledger_dir)

    def argv(self, n: int, args: list[str]) -> tuple[list[str], dict[str, str]]:
        if self.shared:
            uid, gid, groups = self.identities[n % self.users]
            return user_argv(uid, gid, groups, args), self.envs[n % self.users]
        return [sys.executable, "-m", "gpuwait", *args], self.envs[0]

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _lock_holders(lock_path: Path) -> set[int]:
    """Pids holding a flock on the ledger lock (file or directory) right now (/proc/locks)."""
    try:
        inode = os.stat(lock_path).st_ino
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return set()
    holders = set()
    for line in lines:
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 00:2a:5678 0 EOF" ("->" marks a blocked waiter)
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5].endswith(f":{inode}"):
            holders.add(int(parts[4]))
    return holders


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            raw = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        ppid = int(raw[raw.rfind(")") + 2 :].split()[1])
        tree.setdefault(ppid, []).append(int(name))
    return tree


def _alive(pid: int) -> bool:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return raw[raw.rfind(")") + 2] not in "ZX"


class Checker:
    """Reads the ledger over and over and counts what must never be seen."""

    def __init__(self, machine: Machine, figures: Figures) -> None:
        self.machine = machine
        self.figures = figures
        self.killed_at: dict[int, float] = {}

    def check(self, peers: dict[int, subprocess.Popen[str]]) -> None:
        before = _children()
        running_before = {p: before.get(p, []) for p in peers if before.get(p)}
        try:
            # A shared ledger is every user's file together: each is replaced by rename.
            stamp = os.stat(
                self.machine.ledger_dir if self.machine.shared else self.machine.ledger.path
            ).st_mtime
        except OSError:
            return
        try:
            text = self.machine.ledger.path.read_bytes() if not self.machine.shared else b""
            data = self.machine.ledger.read()
        except Exception as exc:
            self.figures.corrupt_files += 1
            self.figures.failures.append(f"read failed: {exc}")
            return
        if text:
            try:
                json.loads(text)
            except ValueError:
                self.figures.corrupt_files += 1
                self.figures.failures.append("a lock-free read saw half a file")
        self.figures.reads += 1
        after = _children()
        entries = {j.pid: j for j in data.jobs}
        for pid, kids in running_before.items():
            still = [k for k in kids if k in after.get(pid, [])]
            if still and _alive(pid) and all(_alive(k) for k in still):
                job = entries.get(pid)
                if job is None or job.state != "running":
                    self.figures.lost_entries += 1
                    self.figures.failures.append(f"peer {pid} runs its command without an entry")
        for job in data.jobs:
            killed = self.killed_at.get(job.pid)
            if killed is not None and stamp > killed + 2.0:
                self.figures.stale_entries += 1
                self.figures.failures.append(f"killed peer {job.pid} still listed")
        fill: dict[str, int] = {}
        for job in data.jobs:
            if job.state == "running":
                for uuid in job.gpu_uuids:
                    fill[uuid] = fill.get(uuid, 0) + job.reserved_bytes
        for used in fill.values():
            ratio = used / self.machine.gpu_usable
            self.figures.max_fill = max(self.figures.max_fill, ratio)
            if ratio > 1.0:
                self.figures.over_admissions += 1


def torture(
    peers: int = 200,
    launches: int = 400,
    users: int = 1,
    kill_every: float = 0.1,
    kill_chance: float = 0.3,
    gpus: int = 2,
    memory_gib: int = 24,
    seed: int | None = None,
    deadline_s: float = 600.0,
) -> Figures:
    """Run the torture and return its figures."""
    rng = random.Random(seed)
    machine = Machine(users, gpus, memory_gib)
    figures = Figures(peers=peers, launches=launches, users=users, shared=machine.shared)
    checker = Checker(machine, figures)
    live: dict[int, subprocess.Popen[str]] = {}
    killed: set[int] = set()
    done: list[tuple[int, subprocess.Popen[str]]] = []
    started = time.monotonic()
    next_kill = started
    next_check = started
    launched = 0
    all_launched_at: float | None = None
    try:
        while (launched < launches or live) and time.monotonic() - started < deadline_s:
            if launched == launches and all_launched_at is None:
                all_launched_at = time.monotonic()
            if all_launched_at is not None and time.monotonic() - all_launched_at > 0.5:
                # The last peers die all at once: nobody is left to reap them but the final
                # operation below.
                for _ in range(len(live)):
                    _kill_one(machine, figures, checker, live, killed, rng, exclude=killed)
                all_launched_at = float("inf")
            while launched < launches and len(live) < peers:
                vram = rng.choice(["1G", "2G", "3G", "4G"])
                hold = f"{rng.uniform(0.05, 0.8):.2f}"
                argv, env = machine.argv(launched, ["--vram", vram, "-q", "--", "sleep", hold])
                proc = subprocess.Popen(
                    argv,
                    env=env,
                    cwd="/",
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                live[proc.pid] = proc
                launched += 1
            now = time.monotonic()
            if launched < launches and now >= next_kill:
                next_kill = now + kill_every
                if rng.random() < kill_chance:
                    _kill_one(machine, figures, checker, live, killed, rng)
            if now >= next_check:
                next_check = now + 0.1
                checker.check(live)
            for pid, proc in list(live.items()):
                if proc.poll() is not None:
                    del live[pid]
                    done.append((pid, proc))
            time.sleep(0.005)
    finally:
        for proc in live.values():
            proc.kill()
            proc.wait()
    for pid, proc in done:
        err = proc.stderr.read() if proc.stderr else ""
        if pid not in killed and proc.returncode != 0:
            figures.failed_peers += 1
            figures.failures.append(f"peer {pid} exited {proc.returncode}: {err.strip()[-300:]}")
    if live:
        figures.failures.append(f"{len(live)} peers still running at the deadline")
        figures.failed_peers += len(live)
    # Every peer is gone. A killed peer's command (a short sleep) may still run: its entry keeps
    # its room until it ends (orphaned), so wait for those commands first.
    orphans_until = time.monotonic() + 5.0
    while time.monotonic() < orphans_until and any(
        job.child_pid is not None and _alive(job.child_pid) for job in machine.ledger.read().jobs
    ):
        time.sleep(0.05)
    # One more operation must reap every entry at once. (In a shared ledger the entries of
    # another user's dead processes are left in that user's file, where nobody counts them:
    # the files are counted here, the ledger as everyone reads it below.)
    figures.dead_before_reap = sum(
        len(json.loads(path.read_bytes()).get("jobs", []))
        for path in machine.ledger_dir.glob("ledger*.json")
    )
    reap_started = time.monotonic()
    argv, env = machine.argv(0, ["status", "--json"])
    status = subprocess.run(argv, env=env, cwd="/", capture_output=True, text=True, timeout=60)
    figures.reap_seconds = time.monotonic() - reap_started
    if status.returncode != 0:
        figures.failures.append(f"status failed: {status.stderr.strip()}")
    figures.leaked_reservations = len(machine.ledger.read().jobs)
    damaged = list(machine.ledger_dir.glob("*.damaged-*"))
    figures.corrupt_files += len(damaged)
    # Every file of the ledger (in a shared one, each user's own) must be whole and valid.
    pattern = "ledger.*.json" if machine.shared else "ledger.json"
    for path in sorted(machine.ledger_dir.glob(pattern)) or [machine.ledger.path]:
        try:
            machine.ledger._decode(path.read_bytes(), repair=False)
        except (OSError, ValueError) as exc:
            figures.corrupt_files += 1
            figures.failures.append(f"final ledger invalid: {exc}")
    temps = [p for p in machine.ledger_dir.iterdir() if p.name.endswith(".tmp")]
    if temps:
        figures.failures.append(f"temporary files left: {[p.name for p in temps]}")
    figures.wall_seconds = time.monotonic() - started
    machine.cleanup()
    return figures


def _kill_one(
    machine: Machine,
    figures: Figures,
    checker: Checker,
    live: dict[int, subprocess.Popen[str]],
    killed: set[int],
    rng: random.Random,
    exclude: set[int] | frozenset[int] = frozenset(),
) -> None:
    candidates = set(live) - exclude
    # A shared ledger's lock is its directory.
    lock = machine.ledger_dir if machine.shared else machine.ledger.lock_path
    holders = _lock_holders(lock) & candidates
    if holders and rng.random() < 1 / 3:
        victim = rng.choice(sorted(holders))
    elif candidates:
        victim = rng.choice(sorted(candidates))
    else:
        return
    in_flight = (machine.ledger_dir / f".ledger.json.{victim}.tmp").exists()
    try:
        os.kill(victim, signal.SIGKILL)
    except ProcessLookupError:
        return
    killed.add(victim)
    checker.killed_at[victim] = time.time()
    figures.kills += 1
    figures.kills_holding_lock += victim in holders
    figures.kills_mid_write += in_flight


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=200, help="gpuwait processes at a time")
    parser.add_argument("--launches", type=int, default=400, help="gpuwait processes in all")
    parser.add_argument(
        "--users", type=int, default=1, help="2 or more: a shared ledger (needs root)"
    )
    parser.add_argument("--kill-every", type=float, default=0.1, help="seconds between tries")
    parser.add_argument("--kill-chance", type=float, default=0.3, help="chance of each try")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    if args.users > 1 and os.geteuid() != 0:
        parser.error("--users 2 runs peers as other users: run it as root")
    figures = torture(
        peers=args.peers,
        launches=args.launches,
        users=args.users,
        kill_every=args.kill_every,
        kill_chance=args.kill_chance,
        seed=args.seed,
    )
    print(figures.report())
    for failure in figures.failures[:10]:
        print(f"  ! {failure}")
    sys.exit(0 if figures.ok() else 1)


if __name__ == "__main__":
    main()
