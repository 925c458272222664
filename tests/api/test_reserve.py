"""gpuwait.reserve(): a Python process holding room for itself, beside wrapped jobs, with real
processes on the simulation."""

from __future__ import annotations

import contextlib
import fcntl
import inspect
import json
import os
import select
import signal
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.fixtures_nvml import FakeGpu, FakeNvml
from helpers.fixtures_sim import SimFileFactory, hold_card
from helpers.history import a_run, recorded_runs
from helpers.status import job_named, job_of_pid, listed_jobs, state_of
from helpers.waiting import asleep_waiting, ledger_entries, process_state, sleeping_in, wait_for

GiB = 2**30

#: A program that reserves with the JSON arguments it is given, says what it got as a JSON
#: line, then takes orders from stdin: `sim ARGS` runs `gpuwait sim job ARGS` as its child,
#: `release`, `raise` (ends a `with` block by an error), `exit` (without releasing).
HOLDER = r"""
import json, os, subprocess, sys
import gpuwait

def say(**what):
    print(json.dumps(what), flush=True)

given = json.loads(sys.argv[1])
try:
    r = gpuwait.reserve(*given.get("args", []), **given.get("kwargs", {}))
except gpuwait.ReserveError as exc:
    say(error=exc.message, hint=exc.hint, exit_code=exc.exit_code)
    sys.exit(0)
say(pid=os.getpid(), job=r.job_id, gpus=r.gpus, uuids=r.uuids, vram=r.vram,
    vram_each=r.vram_each, cvd=os.environ.get("CUDA_VISIBLE_DEVICES"), vram_env=os.environ.get("GPUWAIT_VRAM_BYTES"))
for line in sys.stdin:
    word, *rest = line.split()
    if word == "sim":
        done = subprocess.run([sys.executable, "-m", "gpuwait", "sim", "job", *rest])
        say(sim=done.returncode)
    elif word == "release":
        r.release()
        say(released=True, cvd=os.environ.get("CUDA_VISIBLE_DEVICES"))
    elif word == "raise":
        try:
            with r:
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        except RuntimeError:
            say(raised=True)
    elif word == "exit":
        break
"""


class Holder:
    """A process running HOLDER (from the file `program`, where given: a program whose command
    line does not show gpuwait, as a user's script or a notebook kernel)."""

    def __init__(self, *args: Any, program: Path | None = None, **kwargs: Any) -> None:
        code = ["-c", HOLDER] if program is None else [str(program)]
        self.proc = subprocess.Popen(
            [sys.executable, *code, json.dumps({"args": args, "kwargs": kwargs})],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def said(self, timeout: float = 20) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"the holder said nothing within {timeout}s"
        line = self.proc.stdout.readline()
        assert line, f"the holder ended: {self.proc.stderr.read() if self.proc.stderr else ''}"
        return dict(json.loads(line))

    def tell(self, line: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.said()

    def end(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=20)
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


@pytest.fixture
def holders() -> Any:
    started: list[Holder] = []

    def start(*args: Any, **kwargs: Any) -> Holder:
        holder = Holder(*args, **kwargs)
        started.append(holder)
        return holder

    yield start
    for holder in started:
        holder.end()


def test_import_gpuwait_imports_nothing_of_its_own_until_reserve() -> None:
    script = (
        "import sys; before = set(sys.modules); import gpuwait; "
        "print(sorted(m for m in set(sys.modules) - before)); "
        "gpuwait.reserve; print(sorted(m for m in sys.modules if m.startswith('gpuwait')))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.splitlines()
    loaded = eval(first)
    assert [m for m in loaded if m.startswith("gpuwait")] == ["gpuwait"]
    assert not {"pynvml", "logging", "argparse", "threading"} & set(loaded)
    # Named, the API's own module comes; the queue and the GPUs only once it reserves.
    assert "gpuwait.api.reserve" in eval(second)
    assert "gpuwait.queue.lifecycle" not in eval(second)


def test_queued_behind_a_wrapped_job_then_seen_running_with_this_pid(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], holders: Any
) -> None:
    sim_file(gpus=1, memory="24GiB")
    # It holds the card until the test ends it: held for a set time, it could end before the
    # reserving process (a Python start-up) had queued, on a slow machine.
    first = hold_card(gpuwait_cmd, "16G", "10m", "--name", "first")
    try:
        wait_for(lambda: state_of(gpuwait_cmd, "first") == "running")
        holder = holders("10G", name="nb", priority=4)
        wait_for(lambda: state_of(gpuwait_cmd, "nb") == "waiting")
        first.terminate()
        got = holder.said()
        assert first.wait(timeout=20) == -signal.SIGTERM, first.communicate()[1]
    finally:
        if first.poll() is None:
            first.kill()
    assert got["vram"] == 10 * GiB
    assert got["cvd"] == got["uuids"][0] and got["gpus"] == [0]
    assert got["vram_env"] == str(10 * GiB)
    mine = job_of_pid(gpuwait_cmd, got["pid"])
    assert mine is not None
    assert (mine["state"], mine["name"], mine["child_pid"]) == ("running", "nb", got["pid"])
    assert mine["reserved_bytes"] == 10 * GiB
    # The reserving process's own allocations go through its CUDA_VISIBLE_DEVICES, beside a
    # wrapped job that fits the rest: neither runs out of memory.
    second = hold_card(gpuwait_cmd, "10G", "1s", "--name", "second")
    assert holder.tell("sim --vram 9G --hold 1s") == {"sim": 0}
    assert second.wait(timeout=20) == 0, second.communicate()[1]
    # Room for a third only once the reservation is released.
    third = hold_card(gpuwait_cmd, "20G", "0.2s", "--name", "third")
    wait_for(lambda: state_of(gpuwait_cmd, "third") == "waiting")
    time.sleep(0.5)
    assert state_of(gpuwait_cmd, "third") == "waiting"
    said = holder.tell("release")
    assert said["released"] and said["cvd"] is None
    assert third.wait(timeout=20) == 0, third.communicate()[1]
    assert job_of_pid(gpuwait_cmd, got["pid"]) is None
    (run,) = [r for r in recorded_runs() if r["job_id"] == got["job"]]
    assert (run["name"], run["exit_status"], run["oom"]) == ("nb", 0, False)
    assert (run["request_source"], run["reserved_bytes"]) == ("flag", 10 * GiB)
    # Its child's 9G, sampled as a wrapped command's tree is.
    assert 8 * GiB <= run["peak_bytes"] <= 10 * GiB


def test_sigkill_of_the_holder_gives_its_room_to_the_next(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], holders: Any
) -> None:
    sim_file(gpus=1, memory="24GiB")
    holder = holders("20G")
    got = holder.said()
    waiter = hold_card(gpuwait_cmd, "10G", "0.2s", "--name", "waiter")
    try:
        wait_for(lambda: state_of(gpuwait_cmd, "waiter") == "waiting")
        os.kill(got["pid"], signal.SIGKILL)
        assert waiter.wait(timeout=20) == 0, waiter.communicate()[1]
    finally:
        if waiter.poll() is None:
            waiter.kill()
    assert job_of_pid(gpuwait_cmd, got["pid"]) is None


def test_process_exit_releases_and_records(sim: Path, gpuwait_cmd: list[str], holders: Any) -> None:
    holder = holders("3G", name="ends")
    got = holder.said()
    assert holder.tell("sim --vram 2G --hold 0.3s") == {"sim": 0}
    # Ended without a release: the interpreter's exit releases it.
    holder.proc.stdin.close()  # type: ignore[union-attr]
    assert holder.proc.wait(timeout=20) == 0
    assert job_of_pid(gpuwait_cmd, got["pid"]) is None
    names = [r["name"] for r in recorded_runs() if r["job_id"] == got["job"]]
    assert names == ["ends"]


def test_an_error_in_the_with_block_is_recorded_as_a_failed_run(
    sim: Path, gpuwait_cmd: list[str], holders: Any
) -> None:
    holder = holders("2G")
    got = holder.said()
    assert holder.tell("raise") == {"raised": True}
    assert job_of_pid(gpuwait_cmd, got["pid"]) is None
    (run,) = [r for r in recorded_runs() if r["job_id"] == got["job"]]
    assert (run["exit_status"], run["oom"], run["oom_evidence"]) == (1, True, "message")


@pytest.mark.parametrize(("code", "status"), [(3, 3), ("bad input", 1), (None, 0)])
def test_sys_exit_in_the_with_block_is_recorded_with_its_status(
    sim: Path, code: object, status: int
) -> None:
    # `with gpuwait.reserve(...): main()` where main() ends with sys.exit(3): a failed run, as
    # the same program wrapped by gpuwait would be (and no success for --after-ok).
    script = (
        f"import sys, gpuwait\nwith gpuwait.reserve('1G', name='prep'):\n    sys.exit({code!r})\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == status, done.stderr
    (run,) = [r for r in recorded_runs() if r["name"] == "prep"]
    assert (run["exit_status"], run["signal"], run["oom"]) == (status, None, False)


def run_and_after_ok(
    gpuwait_cmd: list[str], name: str
) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    """The run recorded for the reservation `name`, and what `gpuwait --after-ok NAME` did."""
    (run,) = [r for r in recorded_runs() if r["name"] == name]
    after = subprocess.run(
        [*gpuwait_cmd, "-q", "--after-ok", name, "--", "true"], capture_output=True, text=True
    )
    return run, after


def test_ctrl_c_in_the_with_block_is_recorded_as_sigint(sim: Path, gpuwait_cmd: list[str]) -> None:
    # Ctrl-C cut the block short: no success for --after-ok, and nothing learned from a run
    # stopped half way (as a wrapped command stopped by Ctrl-C, or this script's own exit).
    script = (
        "import gpuwait\ntry:\n    with gpuwait.reserve('1G', name='cut'):\n"
        "        raise KeyboardInterrupt\nexcept KeyboardInterrupt:\n    pass\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    run, after = run_and_after_ok(gpuwait_cmd, "cut")
    assert (run["exit_status"], run["signal"]) == (None, 2)
    assert after.returncode == 6, after.stderr


@pytest.mark.parametrize(
    ("ending", "status"),
    [
        ("sys.exit(3)", 3),
        ("raise RuntimeError('CUDA out of memory. Tried to allocate 2.00 GiB')", 1),
        ("x = 1", 0),
        ("raise SystemExit(3)", None),  # no sys.exit to see: its status is unknown
    ],
)
def test_a_script_that_ends_holding_a_reservation_is_recorded_with_its_status(
    sim: Path, gpuwait_cmd: list[str], ending: str, status: int | None
) -> None:
    # `r = gpuwait.reserve(...)` with no `with` block: the interpreter's exit releases it, and
    # --after-ok starts what depends on it only if the script really succeeded.
    script = f"import sys, gpuwait\nr = gpuwait.reserve('1G', name='prep')\n{ending}\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == (3 if status is None else status), done.stderr
    run, after = run_and_after_ok(gpuwait_cmd, "prep")
    assert (run["exit_status"], run["signal"], run["oom"]) == (status, None, status == 1)
    assert after.returncode == (0 if status == 0 else 6), after.stderr


def test_timeout_gives_up_with_the_clis_status(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], holders: Any
) -> None:
    sim_file(gpus=1, memory="24GiB")
    first = hold_card(gpuwait_cmd, "20G", "5s", "--name", "first")
    try:
        wait_for(lambda: state_of(gpuwait_cmd, "first") == "running")
        got = holders("10G", timeout=0.5).said()
    finally:
        first.terminate()  # gpuwait passes it on to its command
        first.communicate()
    assert got["exit_code"] == 124
    assert got["error"].startswith("gave up after waiting")


@pytest.mark.parametrize(
    ("signum", "threaded"),
    [(signal.SIGINT, False), (signal.SIGINT, True), (signal.SIGTERM, False)],
    ids=["INT", "INT-with-threads", "TERM"],
)
def test_a_signal_while_waiting_leaves_the_queue(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], signum: int, threaded: bool
) -> None:
    sim_file(gpus=1, memory="24GiB")
    first = hold_card(gpuwait_cmd, "20G", "10s", "--name", "first")
    # With another thread (as in a Jupyter kernel) the signal may reach that thread instead.
    thread = "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    script = (
        "import gpuwait, threading, time\n"
        + (thread if threaded else "")
        + "try:\n    gpuwait.reserve('10G', name='patient')\n"
        "except KeyboardInterrupt:\n    print('KeyboardInterrupt')\n"
    )
    try:
        wait_for(lambda: state_of(gpuwait_cmd, "first") == "running")
        waiter = subprocess.Popen(
            [sys.executable, "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        wait_for(lambda: state_of(gpuwait_cmd, "patient") == "waiting")
        waiter.send_signal(signum)
        out, err = waiter.communicate(timeout=20)
    finally:
        first.terminate()  # gpuwait passes it on to its command
        first.communicate()
    if signum == signal.SIGINT:
        assert (waiter.returncode, out) == (0, "KeyboardInterrupt\n"), err
    else:
        assert waiter.returncode == -signal.SIGTERM  # as the process would have died bare
    assert state_of(gpuwait_cmd, "patient") is None


@pytest.mark.parametrize("shared", [False, True], ids=["private", "shared"])
def test_gpuwait_cancel_takes_a_reservation_out_of_the_queue_and_stops_a_held_one(
    sim_file: SimFileFactory,
    gpuwait_cmd: list[str],
    holders: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    shared: bool,
) -> None:
    # A user's own program (here train.py), whose command line names no gpuwait. On a shared
    # server, where jobs held no liveness lock then, cancel was refused (exit 8, 'not a gpuwait
    # process'): the program stayed in everyone's queue, and a held one could not be stopped.
    if shared:
        lab = tmp_path / "lab"
        lab.mkdir()
        lab.chmod(0o3770)
        monkeypatch.setenv("GPUWAIT_LEDGER_DIR", str(lab))
    program = tmp_path / "train.py"
    program.write_text(HOLDER)
    sim_file(gpus=1, memory="24GiB")
    first = hold_card(gpuwait_cmd, "20G", "10s", "--name", "first")
    try:
        wait_for(lambda: state_of(gpuwait_cmd, "first") == "running")
        waiting = holders("10G", name="patient", program=program)
        wait_for(lambda: state_of(gpuwait_cmd, "patient") == "waiting")
        done = subprocess.run([*gpuwait_cmd, "cancel", "patient"], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert waiting.said()["exit_code"] == 7
    finally:
        first.terminate()  # gpuwait passes it on to its command
        first.communicate()
    held = holders("1G", name="held", program=program)
    assert "job" in held.said()
    done = subprocess.run([*gpuwait_cmd, "cancel", "held"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert held.proc.wait(timeout=20) == -signal.SIGTERM  # as a wrapped command gets it
    assert state_of(gpuwait_cmd, "held") is None


def test_options_are_the_command_lines(sim: Path, holders: Any) -> None:
    assert holders("6X").said()["exit_code"] == 2
    assert holders("200G").said()["exit_code"] == 3
    got = holders("1G", pick="fastest").said()
    assert got["exit_code"] == 2 and "fastest" in got["error"]


@pytest.mark.parametrize(
    ("vram", "words"),
    [
        # 6 meant 6 GiB to whoever wrote it, as on the command line: 6 bytes would hold no
        # room at all, and the process would take its 6 GiB from its neighbours.
        (6, "write '6G' for 6 GiB"),
        (6.5, "write '6.5G' for 6.5 GiB"),
        (True, "not a size"),
    ],
)
def test_a_number_too_small_to_be_bytes_is_refused(
    sim: Path, gpuwait_cmd: list[str], vram: object, words: str
) -> None:
    import gpuwait

    with pytest.raises(gpuwait.ReserveError) as caught:
        gpuwait.reserve(vram)  # type: ignore[arg-type]
    assert caught.value.exit_code == 2
    assert words in caught.value.message
    assert listed_jobs(gpuwait_cmd) == []


@pytest.mark.parametrize(
    ("vram", "words"),
    [
        # Bytes computed as a float (model_bytes * 1.2): no one meant six billion GiB.
        (6e9, "give bytes as an int: 6000000000"),
        (1.5 * GiB, "give bytes as an int: 1610612736"),
        (-2.0, "not a size above zero"),
        (float("nan"), "not a size above zero"),
    ],
)
def test_a_float_is_told_how_to_write_it(
    sim: Path, gpuwait_cmd: list[str], vram: float, words: str
) -> None:
    import gpuwait

    with pytest.raises(gpuwait.ReserveError) as caught:
        gpuwait.reserve(vram)
    assert caught.value.exit_code == 2
    assert words in caught.value.message
    assert "e+" not in caught.value.message
    assert listed_jobs(gpuwait_cmd) == []


@pytest.mark.parametrize(
    ("timeout", "words"),
    [
        # Seconds as Python writes a small or a large float: a timeout, not a malformed word.
        (1e-05, None),
        (1e20, "too long (at most 365d)"),
        # An int past any float: OverflowError, from deep inside, was what came out.
        (10**400, "too long (at most 365d)"),
        (float("inf"), "timeout=inf: give seconds"),
        # The keyword as given, not the command line's word made of it ('-1s').
        (-1, "timeout=-1: give seconds (0: only if it fits at once)"),
        (True, "timeout=True: expected"),
    ],
)
def test_a_timeout_in_seconds_is_read_as_seconds(
    sim: Path, gpuwait_cmd: list[str], timeout: float, words: str | None
) -> None:
    import gpuwait

    if words is None:
        gpuwait.reserve("1G", timeout=timeout).release()
        return
    with pytest.raises(gpuwait.ReserveError) as caught:
        gpuwait.reserve("1G", timeout=timeout)
    assert caught.value.exit_code == 2
    assert words in caught.value.message
    assert listed_jobs(gpuwait_cmd) == []


def test_an_option_of_the_wrong_type_is_a_reserve_error(sim: Path, gpuwait_cmd: list[str]) -> None:
    import gpuwait

    for options in ({"after": 5}, {"name": 5}, {"ledger": 5}, {"ledger": ""}, {"devices": 1.5}):
        with pytest.raises(gpuwait.ReserveError) as caught:
            gpuwait.reserve("1G", **options)
        assert caught.value.exit_code == 2, options
        assert next(iter(options)) in caught.value.message
    assert listed_jobs(gpuwait_cmd) == []


def test_a_flag_or_a_count_of_the_wrong_type_is_not_taken_for_another(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    # gpus=True held one GPU (True == 1), and exclusive="false" a whole GPU (a string is
    # true): each was taken for what it was not, and held.
    import gpuwait

    for vram, options in (("1G", {"gpus": True}), (None, {"exclusive": "false"})):
        with pytest.raises(gpuwait.ReserveError) as caught:
            gpuwait.reserve(vram, **options)
        assert caught.value.exit_code == 2, options
        assert caught.value.message.startswith(f"{next(iter(options))}=")
    assert listed_jobs(gpuwait_cmd) == []


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"vram": "x"}, "vram 'x' is not a size"),
        # Was "argument gpus: 0 is too small (at least 1); see 'gpuwait --help'".
        ({"gpus": 0}, "gpus: 0 is too small (at least 1)"),
        ({"exclusive": True}, "exclusive takes whole GPUs; leave out vram"),
        # Was "priority: '9' is not valid for priority: expected ...".
        ({"priority": 9}, "priority: '9' is not valid: expected a priority from 1"),
        ({"timeout": "x"}, "timeout 'x' is not a duration"),
        ({"pick": "best_fit"}, "pick: 'best_fit' is not valid: expected one of best-fit"),
        ({"devices": 9}, "devices '9': no GPU '9' here"),
        ({"name": ""}, "name '': use up to 100 letters"),
        ({"batch": ""}, "batch '': use up to 100 letters"),
        ({"key": ""}, "key needs a non-empty name"),
        ({"after": "nosuchjob"}, "after: no job, name or batch 'nosuchjob'"),
        ({"after_ok": "nosuchjob"}, "after_ok: no job, name or batch 'nosuchjob'"),
        ({"safety": 2}, "safety: '2' is not valid: expected a fraction"),
        ({"enforce": "x"}, "enforce: 'x' is not valid: expected one of off, hint, limit"),
        # Was "ledger: 'shared' is not valid for ledger_dir: ...", a name the caller never wrote.
        ({"ledger": "shared"}, "ledger: 'shared' is not valid: expected an absolute path"),
        ({"min_total_vram": "x"}, "min_total_vram 'x' is not a size"),
        ({"gpu_name": ""}, "gpu_name needs a pattern"),
        ({"min_compute_capability": "x"}, "min_compute_capability 'x': use MAJOR.MINOR"),
        ({"max_util": 101}, "max_util '101': give a percentage above 0 and at most 100"),
    ],
)
def test_a_refused_value_is_told_by_its_keyword(
    sim: Path, gpuwait_cmd: list[str], options: dict[str, Any], words: str
) -> None:
    # reserve(max_util=101) was told of `--max-util`, a command line's option the caller never
    # wrote; reserve(gpus=0) of argparse's "argument" and of `gpuwait --help`, and
    # reserve(priority=9) heard its keyword's name twice.
    import gpuwait

    keyword = next(iter(options))
    with pytest.raises(gpuwait.ReserveError) as caught:
        gpuwait.reserve(**{"vram": "1G", "timeout": 0, **options})
    said = str(caught.value)
    assert caught.value.exit_code == 2
    assert caught.value.message.startswith(keyword), said
    assert words in caught.value.message, said
    assert "--" not in said and "argument " not in said, said
    assert "not valid for" not in said, said
    assert listed_jobs(gpuwait_cmd) == []


def test_no_dependency_given_as_none_is_none(sim: Path, gpuwait_cmd: list[str]) -> None:
    # after=None, after_ok=None, as every other keyword takes None: nothing to wait for.
    import gpuwait

    with gpuwait.reserve("1G", after=None, after_ok=None, timeout=0) as held:
        assert held.gpus


def test_every_keyword_given_as_none_is_left_out(sim: Path, gpuwait_cmd: list[str]) -> None:
    # As the docs say of every keyword: gpus=None was refused ("gpus: 'None' is not a whole
    # number"), the one keyword that took None for no value.
    import gpuwait

    keywords = inspect.signature(gpuwait.reserve).parameters
    given = {name: None for name in keywords if name != "vram"}
    with gpuwait.reserve("1G", **given) as held:
        assert len(held.gpus) == 1


def test_a_dependency_that_failed_is_told_by_its_keyword(sim: Path, gpuwait_cmd: list[str]) -> None:
    # reserve(after_ok="prep") of a prep that failed was told "--after-ok cannot be met", a
    # command line's option the caller never wrote.
    import gpuwait

    failed = subprocess.run([*gpuwait_cmd, "-q", "--name", "prep", "--", "sh", "-c", "exit 1"])
    assert failed.returncode == 1
    with pytest.raises(gpuwait.ReserveError) as caught:
        gpuwait.reserve("1G", after_ok="prep", timeout=0)
    said = str(caught.value)
    assert caught.value.exit_code == 6, said
    assert said.endswith("(prep) failed with exit status 1; after_ok cannot be met"), said
    assert "--" not in said, said
    assert listed_jobs(gpuwait_cmd) == []


def test_a_dependency_that_names_no_job_is_refused(sim: Path, gpuwait_cmd: list[str]) -> None:
    # after_ok=previous_id where previous_id came out empty: no room held as if it depended on
    # nothing.
    import gpuwait

    for options in ({"after_ok": ""}, {"after": ["", " "]}):
        with pytest.raises(gpuwait.ReserveError) as caught:
            gpuwait.reserve("1G", **options)
        assert (caught.value.exit_code, "names no job" in caught.value.message) == (2, True)
    assert listed_jobs(gpuwait_cmd) == []


def test_a_keyword_reserve_does_not_have_is_pythons_type_error(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    # As docs/python-api.md says: a misspelt keyword, or a command's option, is no ReserveError.
    import gpuwait

    for options in ({"pausable": True}, {"retry_oom": 1}, {"vrma": "1G"}):
        with pytest.raises(TypeError, match=next(iter(options))):
            gpuwait.reserve("1G", **options)  # type: ignore[call-arg]
    assert listed_jobs(gpuwait_cmd) == []


def test_a_value_that_starts_with_a_dash_is_the_options_value(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    # `--key=-exp1` on the command line: from Python, not refused as an option without its
    # value, and a refused value is told by its own option's words.
    import gpuwait

    with gpuwait.reserve("1G", key="-exp1", name="dashed") as r:
        assert r.held
    with pytest.raises(gpuwait.ReserveError) as caught:
        gpuwait.reserve("1G", gpu_name="-x")
    assert "expected one argument" not in caught.value.message
    assert caught.value.message.startswith("no GPU"), caught.value.message


def test_devices_takes_one_index_as_the_command_line_does(sim: Path) -> None:
    script = "import gpuwait\nprint(gpuwait.reserve('1G', devices=1).gpus)\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (0, "(1,)\n"), done.stderr


def test_refused_where_cuda_is_already_initialised(
    sim: Path, monkeypatch: pytest.MonkeyPatch, gpuwait_cmd: list[str]
) -> None:
    import gpuwait

    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(is_initialized=lambda: True)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", torch)
    with pytest.raises(gpuwait.ReserveError) as caught:
        gpuwait.reserve("1G")
    assert caught.value.exit_code == 2
    assert "CUDA is already initialised" in caught.value.message
    assert "torch.cuda.is_initialized()" in caught.value.message
    assert listed_jobs(gpuwait_cmd) == []
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def test_a_reservation_with_enforce_off_inside_a_limited_job_carries_none_of_its_caps(
    sim_file: SimFileFactory, gpuwait_cmd: list[str]
) -> None:
    # A sweep under --enforce limit holding 4 GiB runs a script that reserves 10 GiB with
    # enforce="off": its JAX kept the sweep's XLA_PYTHON_CLIENT_MEM_FRACTION=0.1666 (and its
    # apptainer copy), which `gpuwait --enforce off` takes out of its command's environment.
    sim_file(gpus=1, memory="24GiB")
    names = (
        "XLA_PYTHON_CLIENT_MEM_FRACTION",
        "XLA_PYTHON_CLIENT_PREALLOCATE",
        "TF_FORCE_GPU_ALLOW_GROWTH",
        "APPTAINERENV_XLA_PYTHON_CLIENT_MEM_FRACTION",
    )
    script = (
        "import json, os, gpuwait\n"
        f"names = {names!r}\n"
        "def seen():\n    return {n: os.environ.get(n) for n in names}\n"
        "before = seen()\n"
        "r = gpuwait.reserve('10G', enforce='off')\n"
        "during = seen()\n"
        "r.release()\n"
        "print(json.dumps([before, during, seen()]))\n"
    )
    done = subprocess.run(
        [*gpuwait_cmd, "--vram", "4G", "--enforce", "limit", "--", sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    before, during, after = json.loads(done.stdout)
    assert before["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.1666", before
    assert during == dict.fromkeys(names), during
    # Released, the process has the sweep's variables back, as it had them.
    assert after == before
    assert listed_jobs(gpuwait_cmd) == []


def test_one_reservation_per_process(sim: Path) -> None:
    script = (
        "import gpuwait\nr = gpuwait.reserve('1G')\n"
        "try:\n    gpuwait.reserve('1G')\n"
        "except gpuwait.ReserveError as exc:\n    print(exc.exit_code, exc.message)\n"
        "r.release()\nprint(gpuwait.reserve('1G').held)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    refused, again = done.stdout.splitlines()
    assert refused.startswith("2 this process already holds a reservation")
    assert again == "True"


def test_the_magic_says_what_it_did(sim: Path, gpuwait_cmd: list[str]) -> None:
    script = (
        "import os\nfrom gpuwait.api.magic import gpuwait_magic as m\n"
        "r = m('2G --name cell')\nprint(os.environ['CUDA_VISIBLE_DEVICES'] == r.uuids[0])\n"
        "m('status')\nm('2G --pausable')\nm('release')\nm('release')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "True\n"
    lines = done.stderr.splitlines()
    assert lines[0].startswith("gpuwait: reserved 2.0 GiB on GPU")
    assert lines[1].startswith("gpuwait: job ") and "holds 2.0 GiB" in lines[1]
    assert lines[2] == (
        "gpuwait: error: --pausable applies to a command gpuwait starts, not to a reservation"
    )
    assert lines[3].startswith("gpuwait: released job ")
    assert lines[4] == "gpuwait: no reservation in this kernel to release"
    assert listed_jobs(gpuwait_cmd) == []


def test_the_magic_takes_a_size_as_gpuwait_reserve_does(sim: Path, gpuwait_cmd: list[str]) -> None:
    # gpuwait.reserve("6 GiB") reserves 6 GiB; typed after %gpuwait, the unit is a word of its
    # own, and a negative size is a size, not an option.
    script = (
        "from gpuwait.api.magic import gpuwait_magic as m\n"
        "m('6 GiB --name cell')\nm('release')\nm('50 %')\nm('release')\nm('-6G')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert lines[0].startswith("gpuwait: reserved 6.0 GiB on GPU"), done.stderr
    assert lines[1].startswith("gpuwait: released job ")
    assert lines[2].startswith("gpuwait: reserved 12.0 GiB on GPU"), done.stderr
    assert lines[3].startswith("gpuwait: released job ")
    assert lines[4:] == [
        "gpuwait: error: --vram '-6G' is negative; give a size above zero, e.g. 6G"
    ]
    assert listed_jobs(gpuwait_cmd) == []


def test_the_magic_has_its_own_help(sim: Path, gpuwait_cmd: list[str]) -> None:
    # `%gpuwait --help` printed the command line's help: a COMMAND to run, subcommands, exit
    # statuses and options a reservation refuses.
    script = "from gpuwait.api.magic import gpuwait_magic as m\nm('--help')\nm('6G -h')\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    helps = done.stdout.split("usage: ")
    assert helps[0] == "" and helps[1] == helps[2], done.stdout
    shown = helps[1]
    assert shown.startswith("%gpuwait SIZE [OPTIONS] | %gpuwait release | %gpuwait status\n")
    assert "this kernel" in shown
    for option in ("--priority", "--timeout", "--name", "--quiet"):
        assert option in shown
    for other in ("COMMAND", "subcommands", "--pausable", "--retry-oom", "--grace", "exit status"):
        assert other not in shown, other
    assert listed_jobs(gpuwait_cmd) == []


def test_the_magic_takes_its_size_after_its_options(sim: Path, gpuwait_cmd: list[str]) -> None:
    # `%gpuwait -q 6G` was refused: "unexpected '6G': a reservation takes options only".
    script = (
        "from gpuwait.api.magic import gpuwait_magic as m\n"
        "r = m('-q 6G')\nprint(r.vram, r.name)\nm('release')\n"
        "r = m('--name cell 6 GiB --priority 4')\nprint(r.vram, r.name)\nm('release')\n"
        "m('6G --prority 4')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"{6 * 2**30} None", f"{6 * 2**30} cell"]
    lines = done.stderr.splitlines()
    assert lines[0].startswith("gpuwait: released job "), done.stderr
    assert lines[1].startswith("gpuwait: reserved 6.0 GiB on GPU"), done.stderr
    assert lines[2].startswith("gpuwait: released job ")
    # An error points at the magic's help, not the command line's.
    assert lines[3:] == [
        "gpuwait: error: unrecognized arguments: --prority; see '%gpuwait --help'",
        "gpuwait: hint: did you mean --priority?",
    ]
    assert listed_jobs(gpuwait_cmd) == []


def test_the_magics_status_and_release_take_no_more_words(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    # `%gpuwait status -q` was answered "--vram 'status' is not a size; give a unit".
    script = "from gpuwait.api.magic import gpuwait_magic as m\nm('status -q')\nm('release now')\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    usage = "%gpuwait SIZE [OPTIONS] | %gpuwait release | %gpuwait status"
    assert done.stderr.splitlines() == [
        "gpuwait: error: %gpuwait status takes nothing after it: '-q'",
        f"gpuwait: hint: usage: {usage}",
        "gpuwait: error: %gpuwait release takes nothing after it: 'now'",
        f"gpuwait: hint: usage: {usage}",
    ]
    assert listed_jobs(gpuwait_cmd) == []


def test_the_magics_status_and_release_take_no_options_before_them(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    # `%gpuwait -q status` was answered "--vram 'status' is not a size; give a unit".
    script = (
        "from gpuwait.api.magic import gpuwait_magic as m\n"
        "m('-q status')\nm('--quiet --name x release')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines() == [
        "gpuwait: error: %gpuwait status takes no options ('-q'): write %gpuwait status",
        "gpuwait: error: %gpuwait release takes no options ('--quiet --name x'): "
        "write %gpuwait release",
    ]
    assert listed_jobs(gpuwait_cmd) == []


def test_the_magic_says_words_it_refuses_quoted_once(sim: Path, gpuwait_cmd: list[str]) -> None:
    # `%gpuwait --name "it's" status` was answered "takes no options ('--name \\'it\\'"\\'"...')":
    # Python's quotes over the shell's. The words are said as they would be typed.
    script = (
        "from gpuwait.api.magic import gpuwait_magic as m\n"
        "m('--name \"it\\'s\" status')\nm('status \"a b\"')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert errors == [
        "gpuwait: error: %gpuwait status takes no options (--name 'it'\"'\"'s'): "
        "write %gpuwait status",
        "gpuwait: error: %gpuwait status takes nothing after it: 'a b'",
    ]
    assert listed_jobs(gpuwait_cmd) == []


def test_a_reservation_while_another_thread_waits_for_one_is_refused(
    sim_file: SimFileFactory, gpuwait_cmd: list[str]
) -> None:
    # A service's threads each reserving: the second must not queue beside the first (the
    # process would end up holding two, one of them never released before the process ends).
    sim_file(gpus=1, memory="24GiB")
    card = hold_card(gpuwait_cmd, "16G", "20s", "--name", "card")
    script = (
        "import threading, time, gpuwait\nfrom gpuwait.api import reserve as api\n"
        "got = []\n"
        "def first():\n"
        "    try:\n        gpuwait.reserve('10G', timeout='60s', name='first')\n"
        "    except gpuwait.ReserveError as exc:\n        got.append(exc.exit_code)\n"
        "t = threading.Thread(target=first)\nt.start()\n"
        "import subprocess, sys, json\n"
        "while not any(j['name'] == 'first' for j in json.loads(subprocess.run(\n"
        "    [sys.executable, '-m', 'gpuwait', 'status', '--json'], capture_output=True,\n"
        "    text=True).stdout)['jobs']):\n    time.sleep(0.05)\n"
        "try:\n    gpuwait.reserve('8G', timeout=0, name='second')\n"
        "except gpuwait.ReserveError as exc:\n    print(exc.exit_code, exc.message)\n"
        # Still waiting after the refusal: cancelled then (exit 7), not ended by it.
        "subprocess.run([sys.executable, '-m', 'gpuwait', 'cancel', 'first'], check=True,\n"
        "    capture_output=True)\n"
        "t.join()\nprint(got)\n"
    )
    try:
        wait_for(lambda: state_of(gpuwait_cmd, "card") == "running")
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
        )
    finally:
        card.kill()
        card.wait()
    assert done.returncode == 0, done.stderr
    refused, first = done.stdout.splitlines()
    assert refused.startswith("2 this process is already waiting for a reservation"), refused
    assert first == "[7]"


def test_a_released_reservation_is_not_entered_again(sim: Path, gpuwait_cmd: list[str]) -> None:
    # `with r:` in a loop: the first block's end gave the room back; a second block would run
    # on a GPU that another job may now be admitted to, with nothing said.
    script = (
        "import gpuwait\nr = gpuwait.reserve('1G')\nwith r:\n    pass\n"
        "try:\n    with r:\n        print('ran unreserved')\n"
        "except gpuwait.ReserveError as exc:\n    print(exc.exit_code, exc.message)\n"
        "with gpuwait.reserve('1G') as again:\n    print(again.held)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    refused, again = done.stdout.splitlines()
    assert refused.startswith("2 this reservation (job "), refused
    assert "was released" in refused
    assert again == "True"
    assert listed_jobs(gpuwait_cmd) == []


#: For a script: `jobs_now()`, the jobs `gpuwait status` lists now.
JOBS_NOW = (
    "import json, subprocess, sys\n"
    "def jobs_now():\n    return json.loads(subprocess.run([sys.executable, '-m', 'gpuwait',"
    " 'status', '--json'], capture_output=True, text=True).stdout)['jobs']\n"
)


@pytest.mark.parametrize(
    "where",
    [
        "gpuwait.queue.lifecycle.submit",
        "gpuwait.queue.lifecycle.started",
        "gpuwait.api.reserve._ending.watch",
    ],
    ids=["as-it-is-queued", "as-the-room-is-given", "as-the-reservation-is-handed-over"],
)
def test_ctrl_c_just_as_the_room_is_given_leaves_nothing_held(
    sim: Path, gpuwait_cmd: list[str], where: str
) -> None:
    # A Ctrl-C (interrupting the kernel) that lands just after a step of reserve() (queued,
    # admitted, handed over): the user gets KeyboardInterrupt and no Reservation to release,
    # so neither a place in the queue nor the room may stay the kernel's for as long as it
    # lives.
    module, name = where.rsplit(".", 1)
    script = (
        "import importlib, json, os, subprocess, sys, gpuwait\n"
        "from gpuwait.api import reserve as api\n"
        f"target = importlib.import_module({module!r}) if {module!r} != 'gpuwait.api.reserve._ending'"
        " else api._ending\n"
        f"real = getattr(target, {name!r})\n"
        "def interrupted(*args, **kwargs):\n    real(*args, **kwargs)\n    raise KeyboardInterrupt\n"
        f"setattr(target, {name!r}, interrupted)\n"
        "try:\n    gpuwait.reserve('20G', name='cut')\n"
        "except KeyboardInterrupt:\n    print('KeyboardInterrupt')\n"
        f"setattr(target, {name!r}, real)\n"
        + JOBS_NOW
        + "cvd = os.environ.get('CUDA_VISIBLE_DEVICES')\n"
        "print(json.dumps([jobs_now(), cvd, api.current() is None]))\n"
        "r = gpuwait.reserve('20G', name='again', timeout=5)\n"
        "print(json.dumps([j['name'] for j in jobs_now()]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    said, after, again = done.stdout.splitlines()
    assert said == "KeyboardInterrupt"
    assert json.loads(after) == [[], None, True]
    assert json.loads(again) == ["again"]
    assert [r["name"] for r in recorded_runs()] == ["again"]


def test_a_forked_child_reserves_for_itself(sim: Path, gpuwait_cmd: list[str]) -> None:
    # A pool worker forked from a notebook that holds a reservation, reserving its own GPU:
    # the parent's reservation is not the child's to hold, nor to release.
    script = (
        "import json, os, sys, gpuwait\nr = gpuwait.reserve('1G', name='parent')\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    try:\n        mine = gpuwait.reserve('2G', name='child', timeout=5)\n"
        "    except gpuwait.ReserveError as exc:\n"
        "        print(exc.message, flush=True)\n        os._exit(1)\n"
        "    print(json.dumps([mine.job_id != r.job_id, mine.vram >> 30,\n"
        "        os.environ['GPUWAIT_JOB_ID'] == mine.job_id]), flush=True)\n"
        "    mine.release()\n    os._exit(0)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print(json.dumps([os.waitstatus_to_exitcode(status), r.held,\n"
        "    os.environ['GPUWAIT_JOB_ID'] == r.job_id]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    child, parent = done.stdout.splitlines()
    assert json.loads(child) == [True, 2, True], child
    assert json.loads(parent) == [0, True, True]
    assert [r["name"] for r in recorded_runs()] == ["child", "parent"]


def test_a_release_while_cuda_still_runs_in_the_process_says_so(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    # A notebook that used the GPU, then released: its CUDA context and cached memory stay on
    # the card, and what it allocates next lands there unreserved, beside whoever is admitted.
    script = (
        "import sys, types\nfrom gpuwait.api.magic import gpuwait_magic as m\n"
        "r = m('2G --name cell')\n"
        "torch = types.ModuleType('torch')\n"
        "torch.cuda = types.SimpleNamespace(is_initialized=lambda: True)\n"
        "sys.modules['torch'] = torch\n"
        "m('release')\nprint(r.held)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "False\n"
    warned = [line for line in done.stderr.splitlines() if "warning" in line]
    assert len(warned) == 1, done.stderr
    assert "still" in warned[0] and "GPU" in warned[0] and "restart the kernel" in warned[0]
    assert listed_jobs(gpuwait_cmd) == []


def test_ctrl_c_while_releasing_still_gives_the_room_back(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    # `r.release()` interrupted (the kernel interrupted while the release waits for the usage
    # sampler): r is no longer held, so nothing could release it again; the room must not stay
    # held by the kernel for as long as it lives.
    script = (
        "import json, os, subprocess, sys, gpuwait\n"
        "from gpuwait.runner import supervise\n"
        "r = gpuwait.reserve('1G', name='cut')\n"
        "def interrupted(self, *args, **kwargs):\n    raise KeyboardInterrupt\n"
        "supervise.UsageSampler.finish = interrupted\n"
        "try:\n    r.release()\n"
        "except KeyboardInterrupt:\n    print('KeyboardInterrupt')\n"
        + JOBS_NOW
        + "print(json.dumps([jobs_now(), r.held, os.environ.get('CUDA_VISIBLE_DEVICES')]))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    said, after = done.stdout.splitlines()
    assert said == "KeyboardInterrupt"
    assert json.loads(after) == [[], False, None]


def test_a_share_of_cards_of_different_sizes_says_what_it_holds_on_each(
    sim_file: SimFileFactory, holders: Any
) -> None:
    # Half of a 24 GiB and of an 80 GiB card: 12 GiB on the small one, 40 on the big one. A
    # notebook capping its allocator at r.vram on each card (the docs' "bytes reserved on
    # each") capped the small card at 40 GiB, that is not at all.
    sim_file(gpus=2, memory=["24GiB", "80GiB"])
    got = holders("50%", gpus=2).said()
    on = dict(zip(got["gpus"], got["vram_each"], strict=True))
    assert on == {0: 12 * GiB, 1: 40 * GiB}
    assert got["vram"] == 40 * GiB


def test_a_reservation_held_unused_on_a_quiet_gpu_is_named_idle(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], holders: Any, monkeypatch: Any
) -> None:
    # A notebook that reserved 20 GiB and has not touched the GPU since (or freed what it
    # used) keeps everyone else waiting just the same as one holding the memory.
    sim_file(gpus=1, memory="24GiB", utilization=0)
    monkeypatch.setenv("GPUWAIT_IDLE_AFTER", "0.5s")
    got = holders("20G", name="nb").said()

    def named() -> list[dict[str, Any]]:
        done = subprocess.run([*gpuwait_cmd, "idle", "--json"], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return list(json.loads(done.stdout)["idle"])

    wait_for(lambda: bool(named()), timeout=15)
    (holder,) = named()
    assert (holder["pid"], holder["job"], holder["gpu_index"]) == (got["pid"], got["job"], 0)
    assert (holder["used_bytes"], holder["reserved_bytes"]) == (0, 20 * GiB)
    shown = subprocess.run([*gpuwait_cmd, "idle"], capture_output=True, text=True).stdout
    assert "20.0G reserved" in shown, shown


def test_a_job_started_from_the_holder_is_not_counted_as_the_holders_use(
    sim: Path, gpuwait_cmd: list[str], monkeypatch: Any
) -> None:
    # A notebook holding 2 GiB for itself that runs `!gpuwait --vram 10G python train.py`:
    # the job's 9 GiB are that job's, under its own reservation. Counted as the notebook's
    # too, the notebook was said to use 9 GiB of its 2 (and learned so), and its room was
    # counted as 9 GiB beside the job's 10, keeping others waiting for room that was free.
    monkeypatch.setenv("GPUWAIT_SAMPLE_INTERVAL", "0.1s")
    script = (
        "import subprocess, sys, gpuwait\n"
        "r = gpuwait.reserve('2G', name='nb')\n"
        "done = subprocess.run([sys.executable, '-m', 'gpuwait', '-q', '--vram', '10G', '--name',"
        " 'inner', '--', sys.executable, '-m', 'gpuwait', 'sim', 'job', '--vram', '9G', '--hold',"
        " '1s'])\nsys.exit(done.returncode)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    runs = {r["name"]: r for r in recorded_runs()}
    assert runs["inner"]["peak_bytes"] == 9 * GiB
    assert (runs["nb"]["peak_bytes"] or 0) < GiB, runs["nb"]
    assert "over its reservation" not in done.stderr


def test_sys_exit_caught_by_ipython_does_not_become_the_kernels_status(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    # In a notebook, `sys.exit(2)` in a cell (argparse's parse_args() meets the kernel's own
    # -f argument) is caught by IPython and the kernel goes on; shut down cleanly later, the
    # reservation was recorded as failed with status 2, and --after-ok never started.
    pytest.importorskip("IPython", reason="IPython is not installed (pip install -e '.[test]')")
    cells = [
        "import gpuwait; r = gpuwait.reserve('1G', name='nb')",
        "import sys; sys.exit(2)",
        "print('still here')",
    ]
    script = (
        "from IPython.core.interactiveshell import InteractiveShell\n"
        "shell = InteractiveShell.instance()\n"
        f"for cell in {cells!r}:\n    shell.run_cell(cell)\n"
    )
    # -i: an interactive session, as a kernel is; its prompt reads the end of stdin and exits.
    done = subprocess.run(
        [sys.executable, "-i", "-c", script],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "still here" in done.stdout
    run, after = run_and_after_ok(gpuwait_cmd, "nb")
    assert (run["exit_status"], run["signal"]) == (0, None)
    assert after.returncode == 0, after.stderr


#: A pipeline's first stage: reserves, says how that ended, and waits for stdin to close.
STAGE = r"""
import sys
import gpuwait

try:
    gpuwait.reserve("15G", name="stage")
    print("held", flush=True)
except gpuwait.ReserveError as exc:
    print(f"refused {exc.exit_code}", flush=True)
sys.stdin.read()
"""


def test_a_reservation_given_up_behind_its_own_pipeline_leaves_the_queue(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # A job outside the pipeline holds 10 GiB of the 21.6 usable: the first stage's 15 GiB
    # waits. The next stage (urgent: it goes first) starts with 10 GiB, and the first stage can
    # never start beside it, so reserve() gives up; the program goes on (a notebook would).
    sim_file(gpus=1, memory="24G")
    other = hold_card(gpuwait_cmd, "10G", "60s", "--name", "other")
    try:
        wait_for(lambda: state_of(gpuwait_cmd, "other") == "running", timeout=20)
        go = tmp_path / "go"
        stage = tmp_path / "stage.py"
        stage.write_text(STAGE)
        later = " ".join([*gpuwait_cmd, "--priority", "5", "--vram", "10G", "--", "cat"])
        pipeline = subprocess.Popen(
            [
                "sh",
                "-c",
                f"{sys.executable} {stage} | "
                f"(while [ ! -e {go} ]; do sleep 0.02; done; exec {later})",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            waiting = wait_for(lambda: job_named(gpuwait_cmd, "stage"), timeout=20)
            wait_for(lambda: asleep_waiting(waiting["pid"]), timeout=20)
            go.touch()
            assert pipeline.stdout is not None
            assert pipeline.stdout.readline() == "refused 3\n"
            # Its process lives on: its entry must not wait on in the queue for nobody.
            assert job_named(gpuwait_cmd, "stage") is None
        finally:
            assert pipeline.stdin is not None
            pipeline.stdin.close()
            try:
                pipeline.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(pipeline.pid, signal.SIGKILL)
                pipeline.wait()
    finally:
        other.terminate()  # passed on to its command, which ends with it
        try:
            other.wait(timeout=20)
        except subprocess.TimeoutExpired:
            other.kill()
            other.wait()


@contextlib.contextmanager
def _ledger_lock_kept() -> Iterator[Path]:
    """The user's ledger lock held by this process (as by a gpuwait stopped mid-transaction)."""
    from gpuwait.linux import dirs

    lock = Path(dirs.user_state_dir()) / "ledger.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield lock
    finally:
        os.close(fd)


def test_a_timeout_holds_while_a_stopped_process_keeps_the_ledger_lock(
    sim: Path, holders: Any
) -> None:
    # A gpuwait of the user's own stopped (Ctrl-Z) in the middle of a transaction keeps the
    # ledger's lock: reserve(timeout=0.5) waited lock_timeout (a minute), then failed with
    # exit 5, where the command line's --timeout gives up with 124 at its time.
    with _ledger_lock_kept():
        started = time.monotonic()
        got = holders("1G", timeout=0.5).said(timeout=30)
    assert time.monotonic() - started < 10
    assert got["exit_code"] == 124, got
    assert got["error"].startswith("gave up after waiting"), got
    assert f"held by process {os.getpid()}" in got["error"], got


def test_the_command_line_and_reserve_give_up_on_a_kept_ledger_lock_in_the_same_words(
    sim: Path, holders: Any, gpuwait_cmd: list[str]
) -> None:
    # Each phrased its own line for a --timeout that ran out while another process kept the
    # ledger's lock; both now say how long they waited and who held the lock, in one wording.
    with _ledger_lock_kept() as lock:
        wrapped = subprocess.Popen(
            [*gpuwait_cmd, "--vram", "1G", "--timeout", "0.3", "--", "true"],
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            reserved = holders("1G", timeout=0.3).said(timeout=30)
        finally:
            _, err = wrapped.communicate(timeout=30)
    assert (reserved["exit_code"], wrapped.returncode) == (124, 124), (reserved, err)
    said = [line for line in err.splitlines() if "gave up" in line]
    assert len(said) == 1, err
    held = f"(the ledger lock on {lock} was held by process {os.getpid()}"
    for line in (reserved["error"], said[0].partition("error: ")[2]):
        assert line.startswith("gave up after waiting "), line
        assert held in line and line.endswith(" all the while)"), line


#: A program with a heartbeat on SIGALRM that reserves, and says how it ended and how often
#: its handler ran.
TICKING = (
    "import gpuwait, json, signal\n"
    "rang = []\n"
    "signal.signal(signal.SIGALRM, lambda signum, frame: rang.append(signum))\n"
    "signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)\n"
    "try:\n"
    "    gpuwait.reserve('10G', name='ticking', timeout=1.5)\n"
    "except gpuwait.ReserveError as exc:\n"
    "    print(json.dumps({'exit_code': exc.exit_code, 'error': exc.message}))\n"
    "signal.setitimer(signal.ITIMER_REAL, 0)\n"
    "print(json.dumps({'rang': len(rang)}))\n"
)


def _ticking() -> list[dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, "-c", TICKING], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_a_programs_own_periodic_timer_lets_the_wait_for_room_go_on(
    sim_file: SimFileFactory, gpuwait_cmd: list[str]
) -> None:
    # Each tick runs the program's handler, and the wait goes on to its timeout (or its room);
    # the first tick gave the reservation up instead, with a ReserveError for SIGALRM.
    sim_file(gpus=1, memory="24GiB")
    first = hold_card(gpuwait_cmd, "20G", "10s", "--name", "first")
    try:
        wait_for(lambda: state_of(gpuwait_cmd, "first") == "running")
        said = _ticking()
    finally:
        first.terminate()  # gpuwait passes it on to its command
        first.communicate()
    assert said[0]["exit_code"] == 124, said
    assert said[0]["error"].startswith("gave up after waiting"), said
    assert said[1]["rang"] >= 1, said


def test_a_programs_own_periodic_timer_lets_the_wait_for_the_ledger_lock_go_on(sim: Path) -> None:
    from gpuwait.linux import dirs

    lock = Path(dirs.user_state_dir()) / "ledger.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        said = _ticking()
    finally:
        os.close(fd)
    assert said[0]["exit_code"] == 124, said
    assert f"held by process {os.getpid()}" in said[0]["error"], said
    assert said[1]["rang"] >= 1, said


def _program(code: str) -> subprocess.Popen[str]:
    """A Python program running `code`, its stdin, stdout and stderr pipes of the test's."""
    return subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


#: A notebook's cell that reserves, and carries on after a signal whose handler returns ends
#: the wait (the kernel lives on, as a notebook's does, until stdin closes).
LIVES_ON = (
    "import gpuwait, json, signal, sys\n"
    "signal.signal(signal.SIGUSR1, lambda signum, frame: None)\n"
    "print(json.dumps({'pid': __import__('os').getpid()}), flush=True)\n"
    "try:\n"
    "    gpuwait.reserve('4G', name='cell')\n"
    "except gpuwait.ReserveError as exc:\n"
    "    print(json.dumps({'exit_code': exc.exit_code}), flush=True)\n"
    "sys.stdin.read()\n"
)


def test_a_wait_given_up_while_the_ledger_lock_is_kept_ends_at_once_and_leaves_the_queue_later(
    sim_file: SimFileFactory, gpuwait_cmd: list[str]
) -> None:
    # A program whose wait ended (a signal its handler took, or its timeout) while another
    # process kept the ledger's lock goes on living, a notebook kernel. Its entry was left for
    # a reaper that only comes once the process is gone: it stayed in the queue, to be
    # admitted by another's plan, and held room nobody used for as long as the kernel lived.
    # And the signal's handler ran, and reserve raised, only once lock_timeout (a minute) had
    # passed: the CLI gives such a lock a second.
    sim_file(gpus=1, base_used="24GiB")
    with _given_up_under_a_kept_lock() as (cell, free):
        free()
        wait_for(lambda: job_of_pid(gpuwait_cmd, cell.pid) is None, timeout=5)
        assert cell.poll() is None


@contextlib.contextmanager
def _waiting_as_the_ledger_lock_is_kept(
    code: str,
) -> Iterator[tuple[subprocess.Popen[str], int, Callable[[], None]]]:
    """A program running `code`, which says its pid (a JSON line) and reserves; once it waits
    for room, the test keeps the ledger's lock until `free()` (or the block's end). Yields the
    program, its pid and `free`; the program is ended with the block."""
    from gpuwait.linux import dirs

    cell = _program(code)
    fd = -1

    def free() -> None:
        nonlocal fd
        if fd >= 0:
            os.close(fd)
            fd = -1

    try:
        assert cell.stdout is not None
        pid = json.loads(cell.stdout.readline())["pid"]
        wait_for(lambda: asleep_waiting(pid), timeout=30)
        fd = os.open(Path(dirs.user_state_dir()) / "ledger.lock", os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield cell, pid, free
    finally:
        free()
        cell.kill()
        cell.communicate()


@contextlib.contextmanager
def _given_up_under_a_kept_lock() -> Iterator[tuple[subprocess.Popen[str], Callable[[], None]]]:
    """A program running LIVES_ON whose wait a USR1 ended while the test kept the ledger's
    lock, which it keeps until `free()` (or the block's end); the program is ended with it."""
    with _waiting_as_the_ledger_lock_is_kept(LIVES_ON) as (cell, pid, free):
        os.kill(pid, signal.SIGUSR1)
        ready, _, _ = select.select([cell.stdout], [], [], 10)
        assert ready, "reserve waited on for the lock after the signal"
        assert json.loads(cell.stdout.readline()) == {"exit_code": 128 + signal.SIGUSR1}
        yield cell, free


#: A program with a SIGCHLD handler of its own (a server that reaps its workers as they end)
#: whose worker ends while it waits in reserve; it says how often its handler ran.
REAPS_ITS_CHILDREN = (
    "import gpuwait, json, signal, subprocess, sys\n"
    "ended = []\n"
    "signal.signal(signal.SIGCHLD, lambda signum, frame: ended.append(signum))\n"
    "worker = subprocess.Popen(['sleep', '60'])\n"
    "print(json.dumps({'worker': worker.pid}), flush=True)\n"
    "r = gpuwait.reserve('4G', name='reaper')\n"
    "print(json.dumps({'handled': len(ended)}), flush=True)\n"
    "r.release()\n"
    "worker.wait()\n"
)


def test_a_programs_own_child_that_ends_while_it_waits_still_reaches_its_sigchld_handler(
    sim_file: SimFileFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The wait takes SIGCHLD (a ledger writer's wake-up), and took the program's own as well:
    # its handler never heard that its worker had ended, and never reaped it.
    sim_file(gpus=1, base_used="24GiB")
    monkeypatch.setenv("GPUWAIT_NVML_INTERVAL", "0.1s")
    program = _program(REAPS_ITS_CHILDREN)
    try:
        assert program.stdout is not None
        worker = json.loads(program.stdout.readline())["worker"]
        wait_for(lambda: asleep_waiting(program.pid), timeout=30)
        os.kill(worker, signal.SIGTERM)
        wait_for(lambda: Path(f"/proc/{worker}/stat").read_text().split()[2] == "Z", timeout=10)
        sim_file(gpus=1)  # room at last
        said = json.loads(program.stdout.readline())
        assert program.wait(timeout=20) == 0, program.stderr.read() if program.stderr else ""
    finally:
        program.kill()
        program.communicate()
    assert said["handled"] >= 1, said


#: A program that holds a reservation and forks a worker (a data loader's, with the fork start
#: method) just as its sampling thread holds the ledger's lock to publish the tree it saw
#: change; the worker lives on. It says the worker's pid.
FORKS_A_WORKER = r"""
import fcntl, json, os, threading, time
import gpuwait
holding = threading.Event()
real = fcntl.flock
def flock(fd, operation):
    real(fd, operation)
    if operation & fcntl.LOCK_EX and threading.current_thread() is not threading.main_thread():
        holding.set()
        time.sleep(0.3)  # the transaction takes a moment, as on a busy disk
fcntl.flock = flock
r = gpuwait.reserve("1G")
first = os.fork()  # the tree changes: the sampler publishes it
if first == 0:
    time.sleep(60)
    os._exit(0)
holding.wait(10)
worker = os.fork()
if worker == 0:
    time.sleep(60)
    os._exit(0)
print(json.dumps({"worker": worker, "first": first}), flush=True)
import sys
sys.stdin.read()
for pid in (first, worker):
    os.kill(pid, 9)
"""


def test_a_worker_forked_while_the_sampler_holds_the_ledger_lock_does_not_keep_it(
    sim: Path, gpuwait_cmd: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The worker inherited the lock's descriptor, and with it the lock, for as long as it
    # lived: every gpuwait on the machine then waited for it, and gave up (exit 5).
    monkeypatch.setenv("GPUWAIT_SAMPLE_INTERVAL", "0.1s")
    # Past the sampler's transaction, which the launch below waits for.
    monkeypatch.setenv("GPUWAIT_LOCK_TIMEOUT", "5s")
    program = _program(FORKS_A_WORKER)
    children: list[int] = []
    try:
        assert program.stdout is not None
        said = json.loads(program.stdout.readline())
        children += [said["worker"], said["first"]]
        done = subprocess.run(
            [*gpuwait_cmd, "--vram", "1G", "--", "true"], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        program.kill()
        program.communicate()


#: A program that holds a reservation, opens files of its own (whose numbers the ledger's lock
#: had before) and forks a worker, which opens more and forks one of its own: it says which of
#: their files the worker and its own worker found closed.
FORKS_WITH_FILES_OPEN = r"""
import json, os
import gpuwait
gpuwait.reserve("1G")
def opened():
    return [os.open(os.devnull, os.O_RDONLY) for _ in range(16)]
def closed(fds):
    lost = []
    for fd in fds:
        try:
            os.fstat(fd)
        except OSError:
            lost.append(fd)
    return lost
mine = opened()
read, write = os.pipe()
if os.fork() == 0:
    lost = closed(mine)
    theirs = opened()
    if os.fork() == 0:
        os.write(write, json.dumps({"grandchild": closed(theirs)}).encode() + b"\n")
        os._exit(0)
    os.wait()
    os.write(write, json.dumps({"child": lost}).encode() + b"\n")
    os._exit(0)
os.wait()
os.close(write)
print(os.read(read, 4096).decode(), end="", flush=True)
"""


def test_a_worker_forked_by_a_program_holding_a_reservation_keeps_its_files_open(
    sim: Path,
) -> None:
    # Only the ledger's lock, where another thread holds it at the fork, is closed in a child:
    # a file opened later under a number the lock had before is the program's own.
    done = subprocess.run(
        [sys.executable, "-c", FORKS_WITH_FILES_OPEN], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    said = [json.loads(line) for line in done.stdout.splitlines()]
    assert said == [{"grandchild": []}, {"child": []}], said


@contextlib.contextmanager
def released_under_a_kept_lock(holders: Any) -> Iterator[tuple[Holder, int]]:
    """A holder (1G, named cell) whose release() returned while another process keeps the
    ledger's lock, as it keeps it until the block ends: the holder and its pid."""
    holder = holders("1G", name="cell")
    pid = holder.said()["pid"]
    with _ledger_lock_kept():
        assert holder.tell("release")["released"] is True
        yield holder, pid


def test_a_release_while_the_ledger_lock_is_kept_returns_at_once_and_gives_the_room_back_later(
    sim: Path, gpuwait_cmd: list[str], holders: Any
) -> None:
    # release() (a `with` block's end) while another process kept the ledger's lock waited
    # lock_timeout (a minute) for it, then left the entry running, its room held for nobody
    # for as long as the program lived on.
    with released_under_a_kept_lock(holders) as (holder, pid):
        pass
    wait_for(lambda: job_of_pid(gpuwait_cmd, pid) is None, timeout=5)
    assert holder.proc.poll() is None
    runs = recorded_runs()
    assert [r["name"] for r in runs] == ["cell"], runs


def test_a_release_under_a_ledger_lock_kept_past_lock_timeout_still_gives_the_room_back(
    sim: Path, gpuwait_cmd: list[str], holders: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The thread that takes the released entry out once the lock is free keeps trying past
    # each lock_timeout: given up, the room would stay held for as long as the program lives.
    from gpuwait.linux import dirs

    monkeypatch.setenv("GPUWAIT_LOCK_TIMEOUT", "0.2s")
    with released_under_a_kept_lock(holders) as (holder, pid):
        time.sleep(0.6)  # kept past the thread's lock_timeout, more than once
        assert job_of_pid(gpuwait_cmd, pid) is not None
    # Out of the queue, and the word of how it ended, left for a reaper meanwhile, taken away.
    words = Path(dirs.user_state_dir()) / "ended"
    wait_for(lambda: job_of_pid(gpuwait_cmd, pid) is None and not any(words.iterdir()), timeout=5)
    assert holder.proc.poll() is None


#: A notebook's cell whose Ctrl-C lands just as reserve() was admitted, before it noted the
#: process as running in its room (the kernel lives on until stdin closes).
INTERRUPTED_AS_ADMITTED = (
    "import gpuwait, json, os, sys\n"
    "from gpuwait.queue import lifecycle\n"
    "def ctrl_c(*args, **kwargs):\n"
    "    raise KeyboardInterrupt\n"
    "lifecycle.started = ctrl_c\n"
    "try:\n"
    "    gpuwait.reserve('1G', name='cell')\n"
    "except KeyboardInterrupt:\n"
    "    print(json.dumps({'pid': os.getpid()}), flush=True)\n"
    "sys.stdin.read()\n"
)


def test_a_ctrl_c_as_reserve_is_admitted_gives_the_room_back_while_the_program_lives_on(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    program = _program(INTERRUPTED_AS_ADMITTED)
    try:
        assert program.stdout is not None
        said = program.stdout.readline()
        assert said, program.stderr.read() if program.stderr else ""
        assert job_of_pid(gpuwait_cmd, json.loads(said)["pid"]) is None
        assert program.poll() is None
    finally:
        program.kill()
        program.communicate()


#: A program that reserves and ends holding its reservation (released at its exit); before
#: that, where this Python lets threads start then, it refuses them at its shutdown as Python
#: 3.12 does ("can't create new thread at interpreter shutdown").
ENDS_HOLDING = (
    "import atexit, json, os, sys, threading\n"
    "import gpuwait\n"
    "gpuwait.reserve('1G', name='ends-holding')\n"
    "def shutting_down():\n"
    "    def refused(self):\n"
    '        raise RuntimeError("can\'t create new thread at interpreter shutdown")\n'
    "    threading.Thread.start = refused\n"
    "atexit.register(shutting_down)  # runs before gpuwait's (registered first)\n"
    "print(json.dumps({'pid': os.getpid()}), flush=True)\n"
    "sys.stdin.readline()\n"
)


def test_a_program_ending_holding_while_the_ledger_lock_is_kept_exits_at_once_with_its_run_recorded(
    sim: Path, gpuwait_cmd: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Python 3.12 starts no thread once the interpreter is shutting down, where the exit's
    # release hands the entry to one while another process keeps the ledger's lock: the
    # program's exit then waited lock_timeout for that lock, and recorded no run.
    monkeypatch.setenv("GPUWAIT_LOCK_TIMEOUT", "10s")
    with _lock_kept_as_it_goes_on(ENDS_HOLDING) as told:
        started = time.monotonic()  # told to end just now
        pid = told.first["pid"]
        status = told.program.wait(timeout=30)
        took = time.monotonic() - started
    err = told.err
    assert status == 0, err
    assert took < 5, (took, err)
    assert [r["name"] for r in recorded_runs()] == ["ends-holding"], err
    wait_for(lambda: job_of_pid(gpuwait_cmd, pid) is None, timeout=5)


#: A program whose Ctrl-C lands just as reserve() begins to wait (its handler runs at the wait's
#: first step), that carries on (a notebook kernel), and then waits to be interrupted again.
INTERRUPTED_AS_IT_BEGINS = (
    "import json, time\n"
    "import gpuwait\n"
    "from gpuwait.linux import signals\n"
    "first = signals.child_news\n"
    "def ctrl_c_lands():\n"
    "    signals.child_news = first\n"
    "    raise KeyboardInterrupt\n"
    "signals.child_news = ctrl_c_lands\n"
    "try:\n"
    "    gpuwait.reserve('1G')\n"
    "except KeyboardInterrupt:\n"
    "    print(json.dumps({'interrupted': True}), flush=True)\n"
    "time.sleep(30)\n"
)


def test_a_ctrl_c_as_the_wait_begins_leaves_the_program_answering_the_next_one(sim: Path) -> None:
    # The signals the wait takes were blocked before the wait's cleanup was in place: a Ctrl-C
    # whose handler ran there left Ctrl-C, TERM, HUP, USR1 and SIGCHLD blocked in the program
    # for good: the kernel's "interrupt" did nothing any more.
    program = _program(INTERRUPTED_AS_IT_BEGINS)
    try:
        assert program.stdout is not None
        assert json.loads(program.stdout.readline()) == {"interrupted": True}
        program.send_signal(signal.SIGINT)
        status = program.wait(timeout=10)
    finally:
        program.kill()
        _, err = program.communicate()
    assert status == -signal.SIGINT, (status, err)  # as Python ends of a Ctrl-C


#: A program with a timeout of its own (signal.setitimer, its handler raising TimeoutError, as
#: such handlers are most often written) that reserves; it says how the reservation ended.
#: The alarm repeats every 0.2 s until its handler has raised once, then stops: one that fires
#: while reserve() imports a module is lost inside Python's import system, which reads a
#: cached .pyc under `except OSError` (TimeoutError is one) and compiles the source instead.
#: Under load the first alarm can fall there; a later one falls in the lock's wait.
TIMED_BY_ITS_ALARM = (
    "import json, signal\n"
    "import gpuwait\n"
    "def on_alarm(signum, frame):\n"
    "    signal.setitimer(signal.ITIMER_REAL, 0)\n"
    "    raise TimeoutError('took too long')\n"
    "signal.signal(signal.SIGALRM, on_alarm)\n"
    "signal.setitimer(signal.ITIMER_REAL, 0.2, 0.2)\n"
    "try:\n"
    "    gpuwait.reserve('1G')\n"
    "except TimeoutError as exc:\n"
    "    print(json.dumps({'timeout': str(exc)}))\n"
    "except gpuwait.ReserveError as exc:\n"
    "    print(json.dumps({'error': exc.message, 'hint': exc.hint}))\n"
)


def test_a_programs_alarm_raising_timeouterror_while_the_ledger_lock_is_kept_reaches_it(
    sim: Path,
) -> None:
    # The handler's TimeoutError, an OSError, was taken for the lock's own failure: reserve
    # raised "the ledger lock ... cannot be taken: None", with the hint that the file system
    # does not lock files, and the program never saw its timeout.
    with _ledger_lock_kept():
        done = subprocess.run(
            [sys.executable, "-c", TIMED_BY_ITS_ALARM], capture_output=True, text=True, timeout=30
        )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"timeout": "took too long"}, done.stdout


class _Told:
    """A program told to go on while a lock of the state dir is kept (`_lock_kept_as_it_goes_on`):
    what it said first, and, once it is over, its stderr."""

    def __init__(self, program: subprocess.Popen[str]) -> None:
        self.program = program
        self.first: dict[str, Any] = {}
        self.err = ""
        self.fd = -1

    def said(self) -> dict[str, Any]:
        assert self.program.stdout is not None
        return json.loads(self.program.stdout.readline() or "{}")

    def free(self) -> None:
        """Let the lock go."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@contextlib.contextmanager
def _lock_kept_as_it_goes_on(code: str, lock_name: str = "ledger.lock") -> Iterator[_Told]:
    """Runs `code`, a program that reserves, says so (a JSON line) and waits for a line on
    stdin; then keeps the state dir's lock `lock_name` and tells it to go on. The lock is let go
    and the program ended after the block."""
    from gpuwait.linux import dirs

    told = _Told(_program(code))
    try:
        assert told.program.stdin is not None
        told.first = told.said()
        told.fd = os.open(Path(dirs.user_state_dir()) / lock_name, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(told.fd, fcntl.LOCK_EX)
        told.program.stdin.write("\n")
        told.program.stdin.flush()
        yield told
    finally:
        told.free()
        told.program.kill()
        _, told.err = told.program.communicate()


def _goes_on_with_the_lock_kept(code: str, lock_name: str) -> tuple[dict[str, Any], str]:
    """What `code` (as `_lock_kept_as_it_goes_on` runs it) says once told to go on, and its
    stderr."""
    with _lock_kept_as_it_goes_on(code, lock_name) as told:
        said = told.said()
    return said, told.err


#: A program holding a reservation whose own alarm (a timeout whose handler raises) falls due
#: just as its release begins to wait for the ledger's lock: the handler runs at the wait's
#: first look at the timer. It goes on, and says whether its next alarm rang.
ALARMED_AS_THE_LOCK_WAIT_BEGINS = (
    "import json, signal, sys, time\n"
    "import gpuwait\n"
    "r = gpuwait.reserve('1G')\n"
    "print(json.dumps({'held': r.job_id}), flush=True)\n"
    "sys.stdin.readline()\n"
    "first = signal.getitimer\n"
    "def alarm_handled_here(which):\n"
    "    signal.getitimer = first\n"
    "    raise TimeoutError('the alarm rang')\n"
    "signal.getitimer = alarm_handled_here\n"
    "try:\n"
    "    r.release()\n"
    "except TimeoutError:\n"
    "    pass\n"
    "rang = []\n"
    "signal.signal(signal.SIGALRM, lambda signum, frame: rang.append(signum))\n"
    "signal.setitimer(signal.ITIMER_REAL, 0.05)\n"
    "deadline = time.monotonic() + 3\n"
    "while not rang and time.monotonic() < deadline:\n"
    "    time.sleep(0.01)\n"
    "print(json.dumps({'rang': bool(rang)}), flush=True)\n"
)


def test_an_alarm_that_ends_a_wait_for_the_ledger_lock_as_it_begins_leaves_the_next_one_ringing(
    sim: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SIGALRM was blocked before the lock wait's cleanup was in place: an alarm whose handler
    # raised there ended the wait, as it should, but left SIGALRM blocked for good, and the
    # program's later alarms (pytest-timeout's, a watchdog's) never rang.
    monkeypatch.setenv("GPUWAIT_LOCK_TIMEOUT", "0.2s")  # the release's second try, given up
    said, err = _goes_on_with_the_lock_kept(ALARMED_AS_THE_LOCK_WAIT_BEGINS, "ledger.lock")
    assert said == {"rang": True}, err


#: A program holding a reservation, with a timeout of its own (its alarm's handler raising
#: TimeoutError) that falls due as its release records the run; it says how the release ended.
#: The alarm repeats until it has raised once, as TIMED_BY_ITS_ALARM's does, and for its reason.
TIMED_OUT_AS_IT_RECORDS = (
    "import json, signal, sys\n"
    "import gpuwait\n"
    "r = gpuwait.reserve('1G')\n"
    "print(json.dumps({'held': r.job_id}), flush=True)\n"
    "sys.stdin.readline()\n"
    "def on_alarm(signum, frame):\n"
    "    signal.setitimer(signal.ITIMER_REAL, 0)\n"
    "    raise TimeoutError('took too long')\n"
    "signal.signal(signal.SIGALRM, on_alarm)\n"
    "signal.setitimer(signal.ITIMER_REAL, 0.2, 0.2)\n"
    "try:\n"
    "    r.release()\n"
    "except TimeoutError as exc:\n"
    "    print(json.dumps({'timeout': str(exc)}), flush=True)\n"
    "else:\n"
    "    print(json.dumps({'released': True}), flush=True)\n"
)


def test_a_programs_alarm_raising_timeouterror_while_the_history_lock_is_kept_reaches_it(
    sim: Path,
) -> None:
    # The history's lock kept by another process (a compaction, a stopped gpuwait): the
    # handler's TimeoutError, an OSError, was taken for the history's own failure, said as
    # "could not record the run in the history: took too long", and release() returned as if
    # nothing had happened.
    from gpuwait.history.store import LOCK_NAME

    said, err = _goes_on_with_the_lock_kept(TIMED_OUT_AS_IT_RECORDS, LOCK_NAME)
    assert said == {"timeout": "took too long"}, err


#: A program holding a reservation that releases it when told, and says how that ended.
RELEASES_WHEN_TOLD = (
    "import json, os, sys\n"
    "import gpuwait\n"
    "r = gpuwait.reserve('1G', name='cell')\n"
    "print(json.dumps({'held': r.job_id, 'pid': os.getpid()}), flush=True)\n"
    "sys.stdin.readline()\n"
    "try:\n"
    "    r.release()\n"
    "except KeyboardInterrupt:\n"
    "    print(json.dumps({'interrupted': True}), flush=True)\n"
    "sys.stdin.readline()\n"
)


def test_a_ctrl_c_as_a_release_waits_for_a_kept_ledger_lock_acts_within_a_second(
    sim: Path, gpuwait_cmd: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # release() waits a second for a ledger lock another process keeps; a Ctrl-C in that
    # second was then held up lock_timeout (here 10 s, a minute by default) while the release
    # waited for the lock all over again to give the room back.
    monkeypatch.setenv("GPUWAIT_LOCK_TIMEOUT", "10s")
    with _lock_kept_as_it_goes_on(RELEASES_WHEN_TOLD) as told:
        pid = told.first["pid"]
        wait_for(lambda: sleeping_in(pid, "flock"), timeout=10)
        told.program.send_signal(signal.SIGINT)
        ready, _, _ = select.select([told.program.stdout], [], [], 3)
        assert ready, "the Ctrl-C waited for the ledger lock"
        assert told.said() == {"interrupted": True}
        told.free()
        wait_for(lambda: job_of_pid(gpuwait_cmd, pid) is None, timeout=5)
        assert told.program.poll() is None


def test_a_wait_given_up_under_a_kept_ledger_lock_by_a_program_that_ends_is_logged_as_it_ended(
    sim_file: SimFileFactory, gpuwait_cmd: list[str]
) -> None:
    # The program's wait ended (a signal its handler took) while another process kept the
    # ledger's lock, and the program ended before the lock was free: the thread that would
    # take its entry out ended with it, and the next gpuwait reaped the entry as lost (a
    # `reap` in `gpuwait log`), not as the wait it gave up.
    from gpuwait.linux import dirs
    from gpuwait.queue.bookkeeping import INTERRUPTED
    from gpuwait.queue.events import read_events

    sim_file(gpus=1, base_used="24GiB")
    with _given_up_under_a_kept_lock() as (cell, _):
        (job_id,) = [j["id"] for j in ledger_entries()]
        cell.communicate("", timeout=20)  # the kernel ends, the lock still kept
        assert cell.returncode == 0
    sim_file(gpus=1)
    assert subprocess.run([*gpuwait_cmd, "--vram", "1G", "--", "true"]).returncode == 0
    ends = [e for e in read_events(Path(dirs.user_state_dir())) if e.get("job") == job_id]
    assert [(e["kind"], e.get("outcome")) for e in ends][-1] == ("leave", INTERRUPTED), ends
    assert not list((Path(dirs.user_state_dir()) / "ended").glob("*.json"))


#: A program whose reservation is given back unused (a Ctrl-C as it was handed over, here
#: once the test keeps the ledger's lock); it says how long reserve took to raise.
ABANDONS = r"""
import json, sys, time
import gpuwait
from gpuwait.runner import hold
def env(self):
    print(json.dumps({"admitted": True}), flush=True)
    sys.stdin.readline()
    raise KeyboardInterrupt
hold.Holding.env = property(env)
try:
    gpuwait.reserve("1G", name="cell")
except KeyboardInterrupt:
    pass
print(json.dumps({"pid": __import__("os").getpid()}), flush=True)
sys.stdin.read()
"""


def test_a_reservation_abandoned_while_the_ledger_lock_is_kept_returns_at_once(
    sim: Path, gpuwait_cmd: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A Ctrl-C as the room was handed over gave it back unused, waiting for the ledger's lock
    # lock_timeout (a minute) where another process kept it, as release() no longer does.
    from gpuwait.linux import dirs

    monkeypatch.setenv("GPUWAIT_LOCK_TIMEOUT", "30s")
    program = _program(ABANDONS)
    fd = -1
    try:
        assert program.stdout is not None and program.stdin is not None
        assert json.loads(program.stdout.readline()) == {"admitted": True}
        fd = os.open(Path(dirs.user_state_dir()) / "ledger.lock", os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
        program.stdin.write("go\n")
        program.stdin.flush()
        ready, _, _ = select.select([program.stdout], [], [], 10)
        assert ready, "the Ctrl-C waited for the ledger lock"
        pid = json.loads(program.stdout.readline())["pid"]
        os.close(fd)
        fd = -1
        wait_for(lambda: job_of_pid(gpuwait_cmd, pid) is None, timeout=5)
        assert program.poll() is None
    finally:
        if fd >= 0:
            os.close(fd)
        program.kill()
        program.communicate()


def test_ctrl_c_just_after_a_release_gave_the_room_back_keeps_how_the_run_ended(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    # A Ctrl-C that landed once the release had taken the entry out (as the event was logged):
    # the room was given back again, as if the run had been interrupted, and `--after-ok`
    # read the run that ended well as failed (exit 6).
    script = (
        "import gpuwait\n"
        "from gpuwait.queue import events\n"
        "real = events.emit\n"
        "def interrupted(*args, **kwargs):\n"
        "    events.emit = real\n"
        "    raise KeyboardInterrupt\n"
        "r = gpuwait.reserve('1G', name='done')\n"
        "events.emit = interrupted\n"
        "try:\n    r.release()\n"
        "except KeyboardInterrupt:\n    print('KeyboardInterrupt')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (0, "KeyboardInterrupt\n"), done.stderr
    after = subprocess.run(
        [*gpuwait_cmd, "-q", "--after-ok", "done", "--", "true"], capture_output=True, text=True
    )
    assert after.returncode == 0, after.stderr


#: TIMED_OUT_AS_IT_RECORDS that lives on once it has said how the release ended (a notebook).
TIMED_OUT_AS_IT_RELEASES_AND_LIVES_ON = TIMED_OUT_AS_IT_RECORDS + "sys.stdin.readline()\n"


def test_a_programs_alarm_raising_timeouterror_as_its_release_waits_for_a_kept_ledger_lock_reaches_it(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    # release() waits a second for a ledger lock another process keeps; the program's own
    # timeout falling due there raised its TimeoutError inside that wait, which the release
    # took for a failure of its own: it warned "took too long", returned as if nothing had
    # happened, and left the entry running, its room held for nobody while the program lived.
    with _lock_kept_as_it_goes_on(TIMED_OUT_AS_IT_RELEASES_AND_LIVES_ON) as told:
        said = told.said()
        told.free()
        pid = told.program.pid
        wait_for(lambda: job_of_pid(gpuwait_cmd, pid) is None, timeout=5)
        assert told.program.poll() is None
    assert said == {"timeout": "took too long"}, told.err


#: A program with a timeout of its own (its alarm's handler raising TimeoutError) that falls
#: due just as reserve() hands the room over, while the ledger notes the program as the room's
#: user (on a slow disk, say); it says how reserve() ended and lives on (a notebook).
TIMED_OUT_AS_THE_ROOM_IS_HANDED_OVER = (
    "import json, os, signal, sys, time\n"
    "import gpuwait\n"
    "from gpuwait.queue import lifecycle\n"
    "def on_alarm(signum, frame):\n"
    "    raise TimeoutError('took too long')\n"
    "signal.signal(signal.SIGALRM, on_alarm)\n"
    "noted = lifecycle.started\n"
    "def slowly_noted(*args, **kwargs):\n"
    "    signal.setitimer(signal.ITIMER_REAL, 0.05)\n"
    "    time.sleep(2)\n"
    "    return noted(*args, **kwargs)\n"
    "lifecycle.started = slowly_noted\n"
    "try:\n"
    "    r = gpuwait.reserve('1G')\n"
    "except TimeoutError as exc:\n"
    "    print(json.dumps({'timeout': str(exc), 'pid': os.getpid()}), flush=True)\n"
    "else:\n"
    "    print(json.dumps({'held': r.job_id, 'pid': os.getpid()}), flush=True)\n"
    "sys.stdin.readline()\n"
)


def test_a_programs_alarm_raising_timeouterror_as_the_room_is_handed_over_reaches_it(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    # The handler's TimeoutError, raised as the ledger noted the program as the room's user,
    # was taken for a failure of that note: reserve() warned "took too long" and returned a
    # reservation, and the program never saw its timeout.
    program = _program(TIMED_OUT_AS_THE_ROOM_IS_HANDED_OVER)
    try:
        assert program.stdout is not None
        said = json.loads(program.stdout.readline() or "{}")
        pid = program.pid
        # Nobody holds it: the room goes back while the program lives on.
        wait_for(lambda: job_of_pid(gpuwait_cmd, pid) is None, timeout=5)
        assert program.poll() is None
    finally:
        program.kill()
        _, err = program.communicate()
    assert said == {"timeout": "took too long", "pid": pid}, err


#: A program that reserves when told, with a timeout of its own (its alarm's handler raising
#: TimeoutError); it says how reserve() ended, and lives on (a notebook). The alarm is rung by
#: the test once reserve() waits for the kept lock: a timer of the program's own fell, on a
#: loaded machine, as a module reserve() imports was compiled, where Python loses what a
#: signal's handler raises, and reserve() went on to hold the room. Its history lookup waits
#: for the lock as long as a record's write does, not a launch's second, so that the alarm
#: finds it waiting however late the test rings it.
TIMED_OUT_AS_IT_RESERVES = (
    "import json, os, signal, sys\n"
    "import gpuwait\n"
    "from gpuwait.history import index\n"
    "index.LAUNCH_LOCK_WAIT = 60.0\n"
    "print(json.dumps({'pid': os.getpid()}), flush=True)\n"
    "sys.stdin.readline()\n"
    "def on_alarm(signum, frame):\n"
    "    raise TimeoutError('took too long')\n"
    "signal.signal(signal.SIGALRM, on_alarm)\n"
    "try:\n"
    "    r = gpuwait.reserve('1G')\n"
    "except TimeoutError as exc:\n"
    "    print(json.dumps({'timeout': str(exc)}), flush=True)\n"
    "else:\n"
    "    print(json.dumps({'held': r.job_id}), flush=True)\n"
    "sys.stdin.readline()\n"
)


def _timed_out_as_it_reserves(gpuwait_cmd: list[str], lock_name: str) -> None:
    """TIMED_OUT_AS_IT_RESERVES, run while the state dir's lock `lock_name` is kept, its alarm
    rung once it waits for that lock: its TimeoutError reaches it, and nothing is left held or
    queued for it."""
    with _lock_kept_as_it_goes_on(TIMED_OUT_AS_IT_RESERVES, lock_name) as told:
        pid = told.first["pid"]
        # Nothing else takes a lock here: the one it waits for is the kept one.
        wait_for(lambda: sleeping_in(pid, "flock"), timeout=30)
        os.kill(pid, signal.SIGALRM)
        ready, _, _ = select.select([told.program.stdout], [], [], 10)
        assert (told.said() if ready else {}) == {"timeout": "took too long"}
        told.free()
        wait_for(lambda: job_of_pid(gpuwait_cmd, pid) is None, timeout=5)
        assert told.program.poll() is None


def test_a_programs_alarm_raising_timeouterror_as_reserve_reads_the_history_reaches_it(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    # The history's index, behind the history, is brought up to date as reserve() looks the
    # program up, under the history lock (kept here by another process, compacting say): the
    # handler's TimeoutError there was taken for an unusable history, said as "history index
    # ... could not be brought up to date (took too long)", and reserve() held the room.
    from gpuwait.history import store
    from gpuwait.linux import dirs

    store.append_record(Path(dirs.user_state_dir()), a_run(["python"], "/", time.time() - 60))
    _timed_out_as_it_reserves(gpuwait_cmd, store.LOCK_NAME)


def test_a_programs_alarm_raising_timeouterror_as_reserve_records_a_run_found_ended_reaches_it(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    # A reservation whose process died holding it is reaped by the next transaction, which
    # records its run under the history lock (kept here by another process): the handler's
    # TimeoutError there was taken for a record that could not be written, and reserve()
    # held the room.
    from gpuwait.history.store import LOCK_NAME

    died = subprocess.run(
        [sys.executable, "-c", "import gpuwait, os; gpuwait.reserve('1G'); os._exit(0)"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert died.returncode == 0, died.stderr
    assert len(ledger_entries()) == 1
    _timed_out_as_it_reserves(gpuwait_cmd, LOCK_NAME)


#: A program holding a reservation, with a timeout of its own (its alarm's handler raising
#: TimeoutError) that falls due as its release compacts the history, grown past its size
#: limit; it says how the release ended.
TIMED_OUT_AS_IT_COMPACTS = (
    "import json, signal, sys, time\n"
    "import gpuwait\n"
    "from gpuwait.history import store\n"
    "r = gpuwait.reserve('1G')\n"
    "def on_alarm(signum, frame):\n"
    "    raise TimeoutError('took too long')\n"
    "signal.signal(signal.SIGALRM, on_alarm)\n"
    "compact = store.compact\n"
    "def slowly(*args, **kwargs):\n"
    "    signal.setitimer(signal.ITIMER_REAL, 0.05)\n"
    "    time.sleep(2)\n"
    "    return compact(*args, **kwargs)\n"
    "store.compact = slowly\n"
) + TIMED_OUT_AS_IT_RECORDS[TIMED_OUT_AS_IT_RECORDS.index("try:") :]


def test_a_programs_alarm_raising_timeouterror_as_its_release_compacts_the_history_reaches_it(
    sim: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The handler's TimeoutError inside the compaction was taken for a compaction that
    # failed: release() warned "the history ... could not be compacted: None" and returned.
    from gpuwait.history import store
    from gpuwait.linux import dirs

    monkeypatch.setenv("GPUWAIT_HISTORY_MAX_SIZE", "1MiB")
    history = store.history_path(Path(dirs.user_state_dir()))
    history.parent.mkdir(parents=True, exist_ok=True)
    history.write_bytes(b"\n" * 2**20)
    done = subprocess.run(
        [sys.executable, "-c", TIMED_OUT_AS_IT_COMPACTS], capture_output=True, text=True, timeout=30
    )
    assert json.loads(done.stdout or "{}") == {"timeout": "took too long"}, done.stderr


#: A notebook's cell (a program with another thread, as a Jupyter kernel has several) that
#: reserves; on a Ctrl-C it says how many threads gpuwait left to give the room back once the
#: ledger's lock is free, and lives on.
INTERRUPTED_WITH_THREADS = (
    "import json, os, signal, sys, threading\n"
    "import gpuwait\n"
    "def ctrl_c_when_told():\n"
    "    sys.stdin.readline()\n"
    "    signal.pthread_kill(threading.get_ident(), signal.SIGINT)\n"
    "threading.Thread(target=ctrl_c_when_told, daemon=True).start()\n"
    "print(json.dumps({'pid': os.getpid()}), flush=True)\n"
    "try:\n"
    "    gpuwait.reserve('4G', name='cell')\n"
    "except KeyboardInterrupt:\n"
    "    names = [t.name for t in threading.enumerate()]\n"
    "    print(json.dumps({'leaving': names.count('gpuwait-leave')}), flush=True)\n"
    "sys.stdin.readline()\n"
)


def test_a_ctrl_c_while_a_threaded_program_waits_and_the_ledger_lock_is_kept_gives_back_once(
    sim_file: SimFileFactory, gpuwait_cmd: list[str]
) -> None:
    # The wait cut short gave the room back, then the reservation's end gave it back again:
    # two threads waited to take the one entry out, and the KeyboardInterrupt came only after
    # a second second waited for the lock.
    sim_file(gpus=1, base_used="24GiB")
    with _waiting_as_the_ledger_lock_is_kept(INTERRUPTED_WITH_THREADS) as (cell, pid, free):
        assert cell.stdin is not None
        cell.stdin.write("\n")  # a Ctrl-C, taken by the program's other thread
        cell.stdin.flush()
        ready, _, _ = select.select([cell.stdout], [], [], 10)
        assert ready, "reserve waited on for the lock after the Ctrl-C"
        assert json.loads(cell.stdout.readline()) == {"leaving": 1}
        free()
        wait_for(lambda: job_of_pid(gpuwait_cmd, pid) is None, timeout=5)
        assert cell.poll() is None


#: A --pausable job's program that reserves room of its own, and says what its pausing
#: variables and gpuwait.checkpoint tell it while it holds the room.
RESERVES_INSIDE_A_PAUSABLE_JOB = (
    "import json, os\n"
    "import gpuwait\n"
    "from gpuwait import checkpoint\n"
    "with gpuwait.reserve('1G'):\n"
    "    print(json.dumps({\n"
    "        'pausable': os.environ.get('GPUWAIT_PAUSABLE'),\n"
    "        'signal': os.environ.get('GPUWAIT_CHECKPOINT_SIGNAL'),\n"
    "        'listens': checkpoint.install(),\n"
    "    }))\n"
)


def test_a_reservation_inside_a_pausable_job_leaves_that_jobs_checkpoint_protocol_to_it(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    # The command line takes a --pausable job's variables away from a job started inside it,
    # whose own process its outer job does not own. A reservation is the same process (or one
    # of the outer job's tree): the outer job's gpuwait still asks it to checkpoint, so its
    # checkpoint.install() must go on listening for that job's signal.
    program = [sys.executable, "-c", RESERVES_INSIDE_A_PAUSABLE_JOB]
    done = subprocess.run(
        [*gpuwait_cmd, "--pausable", "--checkpoint-signal", "USR2", "--vram", "1G", "--", *program],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"pausable": "1", "signal": "USR2", "listens": True}


#: A program with a timeout of its own (its alarm's handler raising TimeoutError) that falls
#: due as reserve() reads the GPUs; it says how reserve() ended. The alarm repeats until it has
#: raised once, as TIMED_BY_ITS_ALARM's does, and for its reason.
TIMED_OUT_AS_IT_READS_THE_GPUS = (
    "import json, signal\n"
    "import gpuwait\n"
    "from gpuwait.api import reserve as loaded  # its modules, before the alarm runs\n"
    "from gpuwait.gpu import nvml as also_loaded\n"
    "def on_alarm(signum, frame):\n"
    "    signal.setitimer(signal.ITIMER_REAL, 0)\n"
    "    raise TimeoutError('took too long')\n"
    "signal.signal(signal.SIGALRM, on_alarm)\n"
    "signal.setitimer(signal.ITIMER_REAL, 0.3, 0.3)\n"
    "try:\n"
    "    r = gpuwait.reserve('1G')\n"
    "except TimeoutError as exc:\n"
    "    print(json.dumps({'timeout': str(exc)}), flush=True)\n"
    "except gpuwait.ReserveError as exc:\n"
    "    print(json.dumps({'error': exc.message}), flush=True)\n"
    "else:\n"
    "    print(json.dumps({'held': r.job_id}), flush=True)\n"
)


def test_a_programs_alarm_raising_timeouterror_as_reserve_reads_the_gpus_reaches_it(
    fake_nvml: FakeNvml,
) -> None:
    # NVML is asked in a thread of gpuwait's while the caller waits for the answer (so that a
    # driver that stops answering holds nobody for ever): the handler's TimeoutError there was
    # taken for the driver's failure, "NVML could not count the GPUs: took too long", and
    # reserve() raised a ReserveError, or read the GPUs again and held the room.
    fake_nvml.set_gpus([FakeGpu()])
    fake_nvml.hang(None, "nvmlDeviceGetCount_v2", 1.5)
    done = subprocess.run(
        [sys.executable, "-c", TIMED_OUT_AS_IT_READS_THE_GPUS],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert json.loads(done.stdout or "{}") == {"timeout": "took too long"}, done.stderr


#: A program holding a reservation, with a timeout of its own (its alarm's handler raising
#: TimeoutError) that falls due as its release reads the run's last figures from the driver
#: (NVML accounting's peak, slow on a busy driver); it says how the release ended.
TIMED_OUT_AS_IT_READS_THE_LAST_FIGURES = (
    "import json, signal, sys, time\n"
    "import gpuwait\n"
    "from gpuwait.runner.supervise import UsageSampler\n"
    "r = gpuwait.reserve('1G')\n"
    "def on_alarm(signum, frame):\n"
    "    raise TimeoutError('took too long')\n"
    "signal.signal(signal.SIGALRM, on_alarm)\n"
    "def slowly(self):\n"
    "    signal.setitimer(signal.ITIMER_REAL, 0.05)\n"
    "    time.sleep(2)\n"
    "UsageSampler.finish = slowly\n"
) + TIMED_OUT_AS_IT_RECORDS[TIMED_OUT_AS_IT_RECORDS.index("try:") :]


def test_a_programs_alarm_raising_timeouterror_as_its_release_reads_the_last_figures_reaches_it(
    sim: Path,
) -> None:
    # Taken for a failed reading, which must not fail a release: release() returned as if
    # nothing had happened.
    done = subprocess.run(
        [sys.executable, "-c", TIMED_OUT_AS_IT_READS_THE_LAST_FIGURES],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert json.loads(done.stdout or "{}") == {"timeout": "took too long"}, done.stderr
    assert ledger_entries() == []


def test_what_only_helps_passes_over_its_own_failures_but_not_a_programs_timeout() -> None:
    """A release whose last reading of the GPUs fails, a waiter whose note of silent GPUs finds
    the ledger kept locked: those failures (a driver's error, a lock's: no OSError) are passed
    over, and the release or the report goes on; a program's own alarm raising TimeoutError
    meanwhile reaches the program."""
    from gpuwait.core.errors import StateError
    from gpuwait.linux import signals

    for failure in (ValueError("driver"), StateError("kept locked"), OSError(5, "EIO")):
        with signals.suppress_failures(Exception):
            raise failure
    with pytest.raises(TimeoutError), signals.suppress_failures(Exception):
        raise TimeoutError("the program's own alarm")


@pytest.mark.parametrize("own", ["SIGRTMIN+2", "SIGUSR2"])
def test_a_signal_the_program_blocks_for_itself_is_left_to_it_while_it_waits(
    sim_file: SimFileFactory, gpuwait_cmd: list[str], own: str
) -> None:
    # A program taking a signal with its own sigwait (blocked, one pending) that reserved
    # while another job held the room: the wait took the signal as its own, and ended in a
    # traceback, "ValueError: 36 is not a valid Signals", or gave the reservation up,
    # "SIGUSR2 arrived while waiting", and sent the program the signal again.
    sim_file(gpus=1, memory="24GiB")
    first = hold_card(gpuwait_cmd, "20G", "60s", "--name", "first")
    script = (
        "import os, signal, sys, gpuwait\n"
        f"own = {own.replace('SIG', 'signal.SIG')}\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, {own})\n"
        "os.kill(os.getpid(), own)\n"
        "r = gpuwait.reserve('10G', name='patient')\n"
        "print('held', r.gpus, flush=True)\n"
        "r.release()\n"
        "print('taken', signal.sigtimedwait({own}, 0) is not None)\n"
        "print('again', signal.sigtimedwait({own}, 0) is not None)\n"
    )
    waiter = None
    try:
        wait_for(lambda: state_of(gpuwait_cmd, "first") == "running")
        waiter = subprocess.Popen(
            [sys.executable, "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        wait_for(lambda: waiter.poll() is not None or state_of(gpuwait_cmd, "patient") == "waiting")
    finally:
        first.terminate()  # gpuwait passes it on to its command
        first.communicate()
        if waiter is not None:
            out, err = waiter.communicate(timeout=60)
    assert (waiter.returncode, out) == (0, "held (0,)\ntaken True\nagain False\n"), err


def test_a_term_the_program_blocks_for_itself_is_left_to_it_as_its_run_is_recorded(
    sim_file: SimFileFactory,
) -> None:
    # A program that blocks SIGTERM around its last steps (save, then give the GPU back) and
    # got one meanwhile released its reservation while another gpuwait held the history's
    # lock past a second (a compaction): the record took that TERM as sent to gpuwait, said
    # "could not record the run in the history: SIGTERM arrived while gpuwait waited for a
    # lock", and the run was lost to the estimates.
    from gpuwait.linux import dirs

    sim_file(gpus=1, memory="24GiB")
    program = _program(
        "import os, signal, sys, gpuwait\n"
        "r = gpuwait.reserve('4G', name='saver')\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "print('held', flush=True)\n"
        "sys.stdin.readline()\n"
        "r.release()\n"
        "print('pending', signal.SIGTERM in signal.sigpending(), flush=True)\n"
    )
    lock = Path(dirs.user_state_dir()) / "history.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert program.stdout is not None and program.stdin is not None
        assert program.stdout.readline() == "held\n"
        fcntl.flock(fd, fcntl.LOCK_EX)
        program.stdin.write("release\n")
        program.stdin.flush()
        # Held past the patience a TERM gets (1 s), then let go.
        wait_for(lambda: sleeping_in(program.pid, "flock"), timeout=30)
        time.sleep(2)
    finally:
        os.close(fd)
        out, err = program.communicate(timeout=60)
    assert (program.returncode, out, err) == (0, "pending True\n", ""), err
    assert [r.get("name") for r in recorded_runs()] == ["saver"]


def test_a_whole_gpu_waited_for_from_default_vram_names_reserves_keyword(
    sim_file: SimFileFactory, gpuwait_cmd: list[str]
) -> None:
    # gpuwait.reserve() with no size, no earlier runs: default_vram asks for a whole GPU, and
    # the wait, logged, said "--vram SIZE asks for less", an option no Python caller has.
    sim_file(gpus=1, memory="24GiB")
    first = hold_card(gpuwait_cmd, "4G", "60s", "--name", "first")
    try:
        wait_for(lambda: state_of(gpuwait_cmd, "first") == "running")
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                "import logging, gpuwait\n"
                "logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
                "try:\n"
                "    gpuwait.reserve(name='whole', timeout=1)\n"
                "except gpuwait.ReserveError as exc:\n"
                "    print(exc.exit_code, exc)\n",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        first.terminate()  # gpuwait passes it on to its command
        first.communicate()
    assert done.stdout.startswith("124 gave up after waiting"), done.stderr
    assert "--vram" not in done.stdout, done.stdout
    assert "default_vram" in done.stderr, done.stderr
    assert "vram SIZE asks for less" in done.stderr, done.stderr
    assert "--vram" not in done.stderr, done.stderr


def test_a_release_in_a_thread_leaves_the_next_reservations_wait_to_its_own_signals(
    sim_file: SimFileFactory, gpuwait_cmd: list[str]
) -> None:
    # A program releasing its reservation in a thread (the history's lock held a moment by
    # another gpuwait) while its main thread reserved again, a SIGUSR2 of its own blocked and
    # pending: the release, done, left the new wait taking every signal as its own, and it
    # gave the reservation up, "SIGUSR2 arrived while waiting".
    from gpuwait.linux import dirs

    sim_file(gpus=1, memory="24GiB")
    program = _program(
        "import os, signal, sys, threading, time, gpuwait\n"
        "r = gpuwait.reserve('4G', name='one')\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})\n"
        "os.kill(os.getpid(), signal.SIGUSR2)\n"
        "print('held', flush=True)\n"
        "sys.stdin.readline()\n"
        "t = threading.Thread(target=lambda: (r.release(), print('released', flush=True)))\n"
        "t.start()\n"
        "while r.held or not t.is_alive():\n"
        "    time.sleep(0.01)\n"
        "again = gpuwait.reserve('8G', name='two')\n"
        "t.join()\n"
        "print('held again', signal.SIGUSR2 in signal.sigpending(), flush=True)\n"
        "again.release()\n"
    )
    lock = Path(dirs.user_state_dir()) / "history.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    first = None
    try:
        assert program.stdout is not None and program.stdin is not None
        assert program.stdout.readline() == "held\n"
        first = hold_card(gpuwait_cmd, "16G", "60s", "--name", "first")
        wait_for(lambda: state_of(gpuwait_cmd, "first") == "running", timeout=30)
        fcntl.flock(fd, fcntl.LOCK_EX)
        program.stdin.write("release\n")
        program.stdin.flush()
        wait_for(lambda: state_of(gpuwait_cmd, "two") == "waiting", timeout=30)
        fcntl.flock(fd, fcntl.LOCK_UN)
        # Released, while the second reservation still waits for the card.
        assert program.stdout.readline() == "released\n"
        first.terminate()  # gpuwait passes it on to its command
        first.communicate()
    finally:
        os.close(fd)
        if first is not None and first.poll() is None:
            first.kill()
            first.communicate()
        out, err = program.communicate(timeout=60)
    assert (program.returncode, out) == (0, "held again True\n"), err


def test_a_programs_log_says_a_wait_again_only_where_more_than_its_moving_figures_changed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # reserve() says why it waits through the "gpuwait" logger, at INFO: a program logging at
    # INFO got a line at each reading of a wait that went on as it was, the start it is
    # expected at counting down ("expected in 3m05s", "3m03s") and the room on the best card
    # moving with what other programs use there, where a wait line on a file writes one.
    from gpuwait.api.reserve import _LoggingReporter
    from gpuwait.core.policy import WaitReason

    reason = WaitReason(
        needed="20.0 GiB",
        best_gpu_index=0,
        best_room=int(1.6 * GiB),
        running=2,
        ahead=0,
        note="first in line, GPU0 held for it, expected in 3m05s",
    )
    reporter = _LoggingReporter(keywords=True)
    with caplog.at_level("INFO", logger="gpuwait"):
        reporter.waiting(reason, "train")
        reporter.waiting(
            reason._replace(note="first in line, GPU0 held for it, expected in 3m03s"), "train"
        )
        reporter.waiting(reason._replace(best_room=int(1.7 * GiB)), "train")
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 1, said
        # What is said changes: the card held for it is another.
        reporter.waiting(
            reason._replace(note="first in line, GPU1 held for it, expected in 3m"), "train"
        )
        reporter.waiting(reason._replace(ahead=1), "train")
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 3 and "GPU1 held" in said[1] and "1 ahead" in said[2], said


def test_a_continue_the_program_blocks_for_itself_is_left_to_it_after_a_ctrl_z_in_its_wait(
    sim_file: SimFileFactory,
) -> None:
    # A program that blocks SIGCONT to learn of its own continues (sigwait, a signalfd: a
    # screen to draw again) and was stopped with Ctrl-Z while it waited for its reservation:
    # the SIGCONT that continued it was taken by the wait as its own, and the program never
    # learnt it had been stopped.
    sim_file(gpus=1, memory="24GiB", base_used="10GiB")
    script = (
        "import signal, gpuwait\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCONT})\n"
        "try:\n"
        "    gpuwait.reserve('20G', name='drawn', timeout='4s')\n"
        "except gpuwait.ReserveError as exc:\n"
        "    print('gave up', exc.exit_code)\n"
        "print('pending', signal.SIGCONT in signal.sigpending(), flush=True)\n"
    )
    # A process group of its own, as a job control shell starts a job: the kernel ignores
    # Ctrl-Z in an orphaned group.
    waiter = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        process_group=0,
    )
    try:
        wait_for(lambda: asleep_waiting(waiter.pid), timeout=30)
        os.killpg(waiter.pid, signal.SIGTSTP)  # Ctrl-Z
        wait_for(lambda: process_state(waiter.pid) == "T", timeout=10)
        os.killpg(waiter.pid, signal.SIGCONT)  # fg
        out, err = waiter.communicate(timeout=60)
    finally:
        waiter.kill()
        waiter.wait()
    assert out == "gave up 124\npending True\n", err


def test_a_release_with_a_flag_of_the_wrong_type_is_refused_and_keeps_the_room(
    sim: Path, gpuwait_cmd: list[str]
) -> None:
    # release(failed="no") recorded a failed run (a string is true), and so no success for
    # --after-ok: refused as reserve(exclusive="false") is, the room still held.
    import gpuwait

    held = gpuwait.reserve("1G", name="flagged")
    for options in ({"failed": "no"}, {"out_of_memory": "False"}, {"failed": 2}):
        with pytest.raises(gpuwait.ReserveError) as caught:
            held.release(**options)  # type: ignore[arg-type]
        assert caught.value.exit_code == 2, options
        assert caught.value.message.startswith(f"{next(iter(options))}="), options
        assert held.held, options
    held.release(failed=0)  # type: ignore[arg-type]
    assert not held.held
    (run,) = [r for r in recorded_runs() if r["name"] == "flagged"]
    assert run["exit_status"] == 0
