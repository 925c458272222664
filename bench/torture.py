"""Torture: hundreds of gpuwait processes against one ledger while a killer SIGKILLs them.

Peers are real `gpuwait --vram NG -q -- sleep T` processes on a simulated machine, kept
`--peers` at a time until `--launches` have started. A killer sends SIGKILL at random moments:
to a random peer, or (one kill in three) to whichever peer holds the ledger lock right now, that
is, in the middle of a ledger transaction and often of its write. A checker reads the ledger all
along. With `--users 2` (as root) the peers run as two unprivileged users against a shared
ledger directory set up as an administrator would. `--hostile` adds a third member of the group
who runs no jobs but attacks all along: writes forged entries into its own file (copies of the
others' entries naming their live gpuwait processes, root's pid 1 holding every GPU, a thousand
entries at once, cancel and pause requests for the others' jobs), swaps its own files (its
ledger file and its wake-up summary) for a FIFO, a link to /dev/zero, 20 MiB of junk or (the
summary) lies that every job runs and room was freed, holds the ledger lock for up to half a
second at a time, and tries to write the others' files.

Printed, with the goal of each:
  corrupt files       ledger files that did not parse, damaged copies set aside    (goal 0)
  lost entries        a peer whose command runs, but whose entry is not running     (goal 0)
  stale entries       a killed peer's entry still in a ledger written 2 s later     (goal 0)
                      (its command, orphaned, keeps the entry while it runs: 0.8 s at most)
  leaked reservations entries left once every peer and command is gone and one more gpuwait
                      ran (goal 0)
  over-admissions     a GPU whose running reservations exceed total × safety        (goal 0)
  failed peers        peers not killed that did not exit 0                          (goal 0)
With --hostile, also:
  forgeries counted   reads of the ledger (as any member plans from it) in which one of the
                      hostile member's entries or requests counted                  (goal 0)
  others' files written  times the hostile member could write another member's file (goal 0)
  hangs               peers still running at the deadline (10 minutes)           (goal 0)
"""

from __future__ import annotations

import argparse
import contextlib
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

from gpuwait.linux import proc  # noqa: E402
from gpuwait.queue.ledger import Ledger  # noqa: E402

GIB = 2**30
SAFETY = 0.9
GROUP = 47100
HOSTILE_UID = 47199

#: The hostile member: `python -c HOSTILE UID GROUP DIR STOP SEED`, started as root; it imports
#: what it needs, becomes the member, and attacks until the file STOP exists, then prints what
#: it did as JSON.
HOSTILE = r"""
import errno, json, os, random, stat, sys, time, fcntl
uid, group, directory, stop, seed = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
os.setgroups([group]); os.setgid(uid); os.setuid(uid)
rng = random.Random(seed)
done = dict.fromkeys(["forged_files", "forged_entries", "forged_requests", "swaps", "lock_holds",
                      "lock_seconds", "others_files_tried", "others_files_written"], 0)
own = os.path.join(directory, "ledger.%d.json" % uid)
init_start = int(open("/proc/1/stat").read().rsplit(")", 1)[1].split()[19])

def read_plain(path):
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, 1 << 24)
    finally:
        os.close(fd)

def others():
    documents = []
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if not (name.startswith("ledger.") and name.endswith(".json")) or path == own:
            continue
        try:
            raw = read_plain(path)
            if raw:
                documents.append(json.loads(raw))
        except (OSError, ValueError):
            pass
    return documents

def put(path, make):
    tmp = "%s.%d.hostile" % (path, os.getpid())
    try:
        os.unlink(tmp)
    except OSError:
        pass
    make(tmp)
    os.replace(tmp, path)

def write_plain(tmp, body):
    with open(tmp, "wb") as f:
        f.write(body)
    os.chmod(tmp, 0o640)

def forge():
    documents = others()
    if not documents:
        return
    jobs = [j for d in documents for j in d.get("jobs", []) if isinstance(j, dict)]
    forged = [dict(j) for j in jobs]  # the others' entries, naming their live gpuwait processes
    uuids = sorted({u for j in jobs for u in j.get("gpu_uuids", [])})
    if jobs:
        base = jobs[0]
        for k in range(rng.choice([1, 20, 1100])):  # root's pid 1 holding every GPU
            forged.append(dict(base, id="f%07x" % k, pid=1, start_time=init_start, uid=0,
                               state="running", gpu_uuids=uuids, reserved_bytes=1 << 40,
                               child_pid=1, child_start_time=init_start))
    requests = [dict(kind=rng.choice(["cancel", "pause"]), uid=j["uid"], job=j["id"],
                     pid=j["pid"], start_time=j["start_time"], at=time.time(), by_job=None)
                for j in jobs]
    document = dict(documents[0], jobs=forged, requests=requests)
    put(own, lambda tmp: write_plain(tmp, json.dumps(document).encode()))
    done["forged_files"] += 1
    done["forged_entries"] += len(forged)
    done["forged_requests"] += len(requests)

def swap():
    # Its own ledger file and its own wake-up summary (and the single summary of old, if it
    # made that one).
    targets = [own, os.path.join(directory, "wake.%d.json" % uid)]
    wake = os.path.join(directory, "wake.json")
    try:
        if os.lstat(wake).st_uid == uid:
            targets.append(wake)
    except OSError:
        pass
    target = rng.choice(targets)
    kind = rng.choice(["fifo", "zero", "junk", "mode000", "lie"])
    if kind == "lie":  # a summary saying every job runs and the queue moved: wake everyone
        ids = [j.get("id") for d in others() for j in d.get("jobs", []) if isinstance(j, dict)]
        body = json.dumps(dict(schema=1, release=rng.randrange(1 << 30), running=ids, waiting=[]))
        put(target, lambda tmp: write_plain(tmp, body.encode()))
    elif kind == "fifo":
        put(target, os.mkfifo)
    elif kind == "zero":
        put(target, lambda tmp: os.symlink("/dev/zero", tmp))
    elif kind == "junk":
        put(target, lambda tmp: write_plain(tmp, b"y\n" * (10 << 20)))
    else:
        try:
            os.chmod(target, 0)
        except OSError:
            return
    done["swaps"] += 1

def hold_lock():
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        held = rng.uniform(0.05, 0.5)
        time.sleep(held)
        done["lock_holds"] += 1
        done["lock_seconds"] += int(held * 1000)
    finally:
        os.close(fd)

def write_others():
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid == uid or not stat.S_ISREG(st.st_mode):
            continue
        done["others_files_tried"] += 1
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW))
        except OSError:
            pass
        else:
            done["others_files_written"] += 1
        for attempt in (lambda: os.rename(path, path + ".taken"), lambda: os.unlink(path)):
            try:
                attempt()
            except OSError:
                pass
            else:
                done["others_files_written"] += 1

actions = [forge] * 4 + [swap] * 2 + [hold_lock, write_others]
while not os.path.exists(stop):
    try:
        rng.choice(actions)()
    except OSError:
        pass
    time.sleep(rng.uniform(0.01, 0.05))
print(json.dumps(done))
"""


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
    #: Readings the GPUs' fill was judged from (a shared ledger's, where no file was replaced
    #: as it was read): none would leave over-admission unchecked.
    fills_judged: int = 0
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
    hostile: dict[str, int] = field(default_factory=dict)
    forgeries_counted: int = 0
    hangs: int = 0
    longest_peer: float = 0.0

    def ok(self) -> bool:
        return not (
            self.forgeries_counted
            or self.hostile.get("others_files_written", 0)
            or self.hangs
            or self.corrupt_files
            or self.lost_entries
            or self.stale_entries
            or self.leaked_reservations
            or self.over_admissions
            or self.failed_peers
            or self.reap_seconds > 2.0
            or not self.fills_judged
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
                f"{self.max_fill:.0%} of total × safety; judged in {self.fills_judged} "
                "readings, goal > 0)",
                f"  failed peers        {self.failed_peers}  (goal 0)",
                f"  wall                {self.wall_seconds:.1f}s (longest peer "
                f"{self.longest_peer:.1f}s)",
                *self._hostile_lines(),
            ]
        )

    def _hostile_lines(self) -> list[str]:
        if not self.hostile:
            return []
        h = self.hostile
        return [
            f"  hostile member      {h.get('forged_files', 0)} forged files written "
            f"({h.get('forged_entries', 0)} entries, {h.get('forged_requests', 0)} requests), "
            f"{h.get('swaps', 0)} files swapped, lock held {h.get('lock_holds', 0)} times "
            f"({h.get('lock_seconds', 0) / 1000:.1f}s in all); its own CPU "
            f"{h.get('cpu_ms', 0) / 1000:.1f}s",
            f"  forgeries counted   {self.forgeries_counted}  (goal 0)",
            f"  others' files written {h.get('others_files_written', 0)} of "
            f"{h.get('others_files_tried', 0)} tries  (goal 0)",
            f"  hangs               {self.hangs}  (goal 0: peers still running at the deadline)",
        ]


class Machine:
    """A simulated machine, a ledger, and how to start a peer as each user."""

    def __init__(self, users: int, gpus: int, memory_gib: int, hostile: bool = False) -> None:
        self.users = users
        self.shared = users > 1
        self.hostile_env: dict[str, str] | None = None
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
            self.ledger_dir = make_shared_ledger_dir(self.root, GROUP)
            base["GPUWAIT_LEDGER_DIR"] = str(self.ledger_dir)
            for n in range(users):
                uid = 47101 + n
                self.identities.append((uid, uid, [GROUP]))
                self.envs.append({**base, **user_home(self.root, uid, uid)})
            if hostile:
                self.hostile_env = {**base, **user_home(self.root, HOSTILE_UID, HOSTILE_UID)}
        else:
            home = self.root / "home"
            home.mkdir(mode=0o700)  # a home that does not exist is one gpuwait never makes
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

    def honest_files(self, pattern: str) -> list[Path]:
        """The ledger dir's files matching `pattern`, but the hostile member's own."""
        found = []
        for path in sorted(self.ledger_dir.glob(pattern)):
            try:
                if path.lstat().st_uid != HOSTILE_UID:
                    found.append(path)
            except OSError:
                pass
        return found

    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class Hostile:
    """The hostile member of the group (see HOSTILE), started once the directory is in use."""

    def __init__(self, machine: Machine, seed: int | None) -> None:
        env = machine.hostile_env
        assert env is not None
        # First a job of its own, like any member: the summary and stamp it makes are its own.
        first = subprocess.run(
            user_argv(HOSTILE_UID, HOSTILE_UID, [GROUP], ["--vram", "1G", "--", "true"]),
            env=env,
            cwd="/",
            capture_output=True,
            text=True,
            timeout=60,
        )
        if first.returncode != 0:
            raise SystemExit(f"torture: the hostile member's first job failed: {first.stderr}")
        self.stop = machine.root / "hostile.stop"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                HOSTILE,
                str(HOSTILE_UID),
                str(GROUP),
                str(machine.ledger_dir),
                str(self.stop),
                str(seed if seed is not None else random.randrange(1 << 30)),
            ],
            cwd="/",
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def finish(self) -> dict[str, int]:
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            cpu_ms = (int(fields[11]) + int(fields[12])) * 1000 // os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            cpu_ms = -1
        self.stop.touch()
        try:
            out, _ = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        try:
            return {**json.loads(out.strip().splitlines()[-1]), "cpu_ms": cpu_ms}
        except (ValueError, IndexError):
            return {"failed": 1}


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
    return proc.children_map()


def _alive(pid: int) -> bool:
    return proc.is_alive(pid, None)


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
        files = self._files()
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
        # As any member plans from it, the ledger holds nothing of the hostile member's: it
        # runs no job, so none of its entries names a live gpuwait of its own.
        if any(job.uid == HOSTILE_UID for job in data.jobs) or any(
            job.pause_requested_at is not None for job in data.jobs
        ):
            self.figures.forgeries_counted += 1
            self.figures.failures.append("a forged entry or request counted")
        for job in data.jobs:
            killed = self.killed_at.get(job.pid)
            if killed is not None and stamp > killed + 2.0:
                self.figures.stale_entries += 1
                self.figures.failures.append(f"killed peer {job.pid} still listed")
        if self.machine.shared and self._files() != files:
            # A shared ledger's files are read one after another without the lock: one user's
            # job ended and another's admitted into its room meanwhile would show as both
            # running. A reading during which no file was replaced is one the planners saw
            # (an over-admitted job stays listed as long as it runs). A private ledger is one
            # file, read whole: every reading is.
            return
        self.figures.fills_judged += 1
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

    def _files(self) -> set[tuple[str, int, int]]:
        """Each ledger file's name, inode and change time: a write replaces its file."""
        found = set()
        for path in self.machine.ledger_dir.glob("ledger*.json"):
            with contextlib.suppress(OSError):
                st = path.lstat()
                found.add((path.name, st.st_ino, st.st_mtime_ns))
        return found


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
    hostile: bool = False,
) -> Figures:
    """Run the torture and return its figures (`hostile`: with a hostile member, users > 1)."""
    rng = random.Random(seed)
    machine = Machine(users, gpus, memory_gib, hostile=hostile)
    figures = Figures(peers=peers, launches=launches, users=users, shared=machine.shared)
    checker = Checker(machine, figures)
    adversary = Hostile(machine, seed) if hostile else None
    born: dict[int, float] = {}
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
                born[proc.pid] = time.monotonic()
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
                    figures.longest_peer = max(figures.longest_peer, time.monotonic() - born[pid])
            time.sleep(0.005)
    finally:
        for proc in live.values():
            proc.kill()
            proc.wait()
        if adversary is not None:
            figures.hostile = adversary.finish()
    for pid, proc in done:
        err = proc.stderr.read() if proc.stderr else ""
        if pid not in killed and proc.returncode != 0:
            figures.failed_peers += 1
            figures.failures.append(f"peer {pid} exited {proc.returncode}: {err.strip()[-300:]}")
    if live:
        figures.failures.append(f"{len(live)} peers still running at the deadline")
        figures.failed_peers += len(live)
        figures.hangs = len(live)
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
        for path in machine.honest_files("ledger*.json")
    )
    reap_started = time.monotonic()
    argv, env = machine.argv(0, ["status", "--json"])
    status = subprocess.run(argv, env=env, cwd="/", capture_output=True, text=True, timeout=60)
    figures.reap_seconds = time.monotonic() - reap_started
    if status.returncode != 0:
        figures.failures.append(f"status failed: {status.stderr.strip()}")
    figures.leaked_reservations = len(machine.ledger.read().jobs)
    damaged = machine.honest_files("*.damaged-*")
    figures.corrupt_files += len(damaged)
    # Every file of the ledger (in a shared one, each user's own) must be whole and valid: the
    # hostile member's own is whatever it made it.
    pattern = "ledger.*.json" if machine.shared else "ledger.json"
    for path in machine.honest_files(pattern) or [machine.ledger.path]:
        try:
            machine.ledger._decode(path.read_bytes(), repair=False)
        except (OSError, ValueError) as exc:
            figures.corrupt_files += 1
            figures.failures.append(f"final ledger invalid: {exc}")
    # A writer killed halfway leaves its temporary file to its own user's next operation (in a
    # shared directory nobody removes another user's files): one operation of each other user.
    for n in range(1, machine.users if machine.shared else 1):
        argv, env = machine.argv(n, ["status", "--json"])
        subprocess.run(argv, env=env, cwd="/", capture_output=True, timeout=60)
    temps = [p for p in machine.honest_files("*") if p.name.endswith(".tmp")]
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
    parser.add_argument(
        "--hostile", action="store_true", help="a hostile member attacks all along (--users 2+)"
    )
    args = parser.parse_args()
    if args.users > 1 and os.geteuid() != 0:
        parser.error("--users 2 runs peers as other users: run it as root")
    if args.hostile and args.users < 2:
        parser.error("--hostile needs a shared ledger: --users 2 or more")
    figures = torture(
        peers=args.peers,
        launches=args.launches,
        users=args.users,
        kill_every=args.kill_every,
        kill_chance=args.kill_chance,
        seed=args.seed,
        hostile=args.hostile,
    )
    print(figures.report())
    for failure in figures.failures[:10]:
        print(f"  ! {failure}")
    sys.exit(0 if figures.ok() else 1)


if __name__ == "__main__":
    main()
