"""The text behind the screens, piece by piece: the wait line fitted to a width, commands
quoted alike everywhere, the history and config tables, the watch frame, and which sections
`status` shows."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.history import a_run

from gpuwait.commands import history, log, status
from gpuwait.commands.config import settings_table
from gpuwait.commands.output import WaitLine
from gpuwait.core.policy import WaitReason
from gpuwait.core.snapshot import GpuSnapshot
from gpuwait.history import record
from gpuwait.history.store import append_record

GiB = 2**30

REASON = WaitReason(
    needed="20.0 GiB",
    best_gpu_index=0,
    best_room=int(1.6 * GiB),
    running=2,
    ahead=1,
    note="first in line, GPU0 held for it, expected in 3m05s",
    source="estimated from 3 runs of this script",
)


def test_the_wait_reason_keeps_what_matters_most_as_it_narrows() -> None:
    full = REASON.describe()
    assert full == (
        "waiting for 20.0 GiB (estimated from 3 runs of this script): best GPU0 has 1.6 GiB; "
        "first in line, GPU0 held for it, expected in 3m05s (2 running, 1 ahead of you)"
    )
    assert REASON.describe(len(full)) == full
    previous = full
    for width in range(len(full) - 1, 0, -1):
        text = REASON.describe(width)
        assert len(text) <= width
        assert len(text) <= len(previous)
        previous = text
        if width >= len("waiting for 20.0 GiB"):
            # What it waits for always comes first, whole.
            assert text.startswith("waiting for 20.0 GiB"), (width, text)
    assert REASON.describe(64) == "waiting for 20.0 GiB: best GPU0 has 1.6 GiB (2 running, 1 ahead)"
    assert REASON.describe(40) == "waiting for 20.0 GiB (1 ahead)"
    assert REASON.describe(10) == "waiting f…"


def test_other_reasons_narrow_too() -> None:
    blocked = REASON._replace(blocked="waiting for job 1a2b3c4d (prep) to finish")
    assert blocked.describe(64) == "waiting for job 1a2b3c4d (prep) to finish (2 running, 1 ahead)"
    failing = REASON._replace(gpu_error="NVML_ERROR_UNKNOWN: the driver said no")
    assert failing.describe(50) == "waiting for 20.0 GiB: GPU readings failing"
    limited = REASON._replace(limit="your per-user limit of 1 GPUs is reached")
    assert limited.describe(70) == "waiting for 20.0 GiB: your per-user limit of 1 GPUs is reached"


def test_the_wait_line_names_its_job_and_says_each_change_once_off_a_terminal() -> None:
    stream = io.StringIO()
    line = WaitLine(quiet=False, job="train", stream=stream)
    line.update(REASON)
    line.update(REASON._replace(best_room=GiB))  # the room moved: not a new situation
    line.update(REASON._replace(ahead=0))
    line.clear()
    assert stream.getvalue().splitlines() == [
        "gpuwait[train]: " + REASON.describe(),
        "gpuwait[train]: " + REASON._replace(ahead=0).describe(),
    ]


COMMAND = ["python3", "-c", "import time; time.sleep(3)"]
QUOTED = "python3 -c 'import time; time.sleep(3)'"


def job_row(**fields: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "id": "1a2b3c4d",
        "name": None,
        "state": "waiting",
        "position": 1,
        "priority": 3,
        "request": {"bytes": GiB},
        "exclusive": False,
        "gpus": 1,
        "command": COMMAND,
        "eta_seconds": None,
        "waiting_reason": None,
    }
    return {**row, **fields}


def a_report(jobs: list[dict[str, Any]], users: int = 1, **fields: Any) -> dict[str, Any]:
    report: dict[str, Any] = {
        "generated_at": time.time(),
        "backend": "sim",
        "safety": 0.9,
        "gpus": [],
        "jobs": jobs,
        "batches": [],
        "users": [
            {
                "uid": 1000 + n,
                "user": f"user{n}",
                "running": 0,
                "waiting": 1,
                "gpus_held": 0,
                "vram_held_bytes": 0,
                "usage_vram_seconds": 0.0,
            }
            for n in range(users)
        ],
        "fair_share": {
            "half_life_seconds": 86400.0,
            "user_max_gpus": None,
            "user_max_vram_bytes": None,
        },
        "ledger_shared": False,
    }
    return {**report, **fields}


def test_commands_are_quoted_alike_in_status_log_and_history() -> None:
    shown = status.render(a_report([job_row()]), 100)
    assert QUOTED in shown
    event = {
        "time": time.time(),
        "kind": "submit",
        "job": "1a2b3c4d",
        "priority": 3,
        "command": COMMAND,
    }
    assert log.describe(event, {}).endswith(QUOTED)
    record = a_run(COMMAND, "/tmp", time.time())
    assert history.table([record], None)[1].endswith(QUOTED)


def test_the_users_section_is_shown_where_users_share_something() -> None:
    def shows_users(report: dict[str, Any]) -> bool:
        return "Users (fair share" in status.render(report)

    assert not shows_users(a_report([job_row()]))  # a private ledger, its one user
    assert shows_users(a_report([job_row()], users=2))
    assert shows_users(a_report([job_row()], ledger_shared=True))
    limits = {"half_life_seconds": None, "user_max_gpus": 2, "user_max_vram_bytes": None}
    assert shows_users(a_report([job_row()], fair_share=limits))


def test_the_watch_frame_is_clipped_to_the_window() -> None:
    lines = [f"row {n} " + "x" * 100 for n in range(30)]
    frame = status.fit_screen(lines, 80, 24)
    assert len(frame) == 24 and all(len(r) <= 80 for r in frame)
    assert frame[:23] == [r[:80] for r in lines[:23]]
    assert frame[-1] == "… 7 more rows hidden; a taller window shows them"
    assert status.fit_screen(lines[:5], 80, 24) == [r[:80] for r in lines[:5]]


def test_history_rows_fit_the_terminal_and_keep_everything_when_piped() -> None:
    gpu = GpuSnapshot(index=0, uuid="GPU-0", name="Sim", total_bytes=24 * GiB, used_bytes=0)
    paused = a_run(COMMAND, "/tmp", time.time(), gpus=[gpu], peak_by_gpu={"GPU-0": GiB})
    paused["pauses"], paused["paused_seconds"] = 1, 2.3
    paused["signal"] = 15
    records = [paused, a_run(["python3", "x.py", "--long", "y" * 80], "/tmp", time.time())]
    for width in (80, 100, 120):
        rows = history.table(records, width)
        assert all(len(r) <= width for r in rows), rows
    assert "SIGTERM, paused 1× (2.3s lost)" in history.table(records, 120)[1]
    piped = history.table(records, None)
    assert piped[2].endswith("y" * 80) and "(2.3s lost)" in piped[1]
    # A run without a measured peak says so the way the notes under the table explain.
    assert "peak -: not measured" in "\n".join(piped)


def test_config_rows_fit_the_terminal() -> None:
    rows = [
        ("safety", "0.9", "default"),
        (
            "never_wrap",
            "* --help, * -h, * --version, * -V, * -m pip, * -m pip *, * -m venv *",
            "default",
        ),
        (
            "ignore_processes",
            "Xorg,Xwayland,gnome-shell,kwin_x11,kwin_wayland,plasmashell",
            "default",
        ),
        ("sim", "/tmp/" + "s" * 90 + ".toml", "environment GPUWAIT_SIM"),
    ]
    for width in (60, 80, 120):
        lines = settings_table(rows, width)
        assert all(len(line) <= width for line in lines), lines
        text = " ".join(line.strip() for line in lines)
        assert "* -m pip *" in text  # a pattern is never split
    piped = settings_table(rows, None)
    assert piped[0] == "safety            0.9  (default)"
    assert piped[1].endswith("* -m venv *  (default)")


def test_config_rows_of_chinese_paths_fit_the_terminal() -> None:
    # A simulation file in a directory named in Chinese: cut by characters, its rows took
    # twice the terminal's width and wrapped.
    rows = [
        ("safety", "0.9", "default"),
        ("sim", "/home/用户/模拟/" + "训练数据集" * 10 + ".toml", "environment GPUWAIT_SIM"),
    ]
    for width in (60, 80):
        lines = settings_table(rows, width)
        assert all(on_screen(line) <= width for line in lines), lines
        # Cut where it must be, and whole once its pieces are put together again.
        assert rows[1][1] in "".join(line.strip() for line in lines[1:])


def test_config_shows_every_duration_one_way_and_as_it_was_set(
    isolated_dirs: Path, gpuwait_cmd: list[str]
) -> None:
    # A timeout of 23 hours read "82800s" beside an idle_after of "1h00m"; and a value the
    # short form would round ("1m30s" for 90.5 s) must still read as what was set.
    set_to = {
        "timeout": ("23h", "23h00m"),
        "gpu_error_timeout": ("5m", "5m00s"),
        "lock_timeout": ("90.5s", "90.5s"),
        "idle_after": ("90.5s", "90.5s"),
        "pause_min_runtime": ("2h", "2h00m"),
        "poll_interval": ("0.01s", "10ms"),
        "nvml_interval": ("1s", "1s"),
    }

    def config(values: dict[str, str], *options: str) -> str:
        env = {f"GPUWAIT_{name.upper()}": value for name, value in values.items()}
        done = subprocess.run(
            [*gpuwait_cmd, "config", *options],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, **env},
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    typed = {name: value for name, (value, _) in set_to.items()}
    rows = [line.split() for line in config(typed).splitlines() if line]
    shown = {row[0]: row[1] for row in rows if row[0] in set_to}
    assert shown == {name: value for name, (_, value) in set_to.items()}

    # Typed back in, each is the same setting again.
    def parsed(values: dict[str, str]) -> dict[str, object]:
        settings = json.loads(config(values, "--json"))["settings"]
        return {name: settings[name]["parsed"] for name in set_to}

    assert parsed(shown) == parsed(typed)


def train_py_run(tmp_path: Path, n: int, peak: int | None, **fields: Any) -> dict[str, Any]:
    """The `n`th of a few runs of `python3 train.py` in `tmp_path` on a 24 GiB GPU, a minute
    or two ago, with `peak` bytes at its peak (None: none measured)."""
    (tmp_path / "train.py").write_text("")
    gpu = GpuSnapshot(index=0, uuid="GPU-0", name="Sim", total_bytes=24 * GiB, used_bytes=0)
    return a_run(
        ["python3", "train.py"],
        str(tmp_path),
        time.time() - 100 + n,
        gpus=[gpu],
        peak_by_gpu={} if peak is None else {"GPU-0": peak},
        **fields,
    )


def estimate_after(
    tmp_path: Path,
    isolated_dirs: Path,
    gpuwait_cmd: list[str],
    runs: list[dict[str, Any]],
    command: tuple[str, ...] = ("python3", "train.py"),
) -> str:
    """What `gpuwait estimate -- COMMAND` shows in `tmp_path` after `runs`."""
    state = isolated_dirs / "state" / "gpuwait"
    state.mkdir(mode=0o700)
    for run in runs:
        append_record(state, run)
    return subprocess.run(
        [*gpuwait_cmd, "estimate", "--", *command],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=dict(os.environ),
    ).stdout


def test_estimate_says_which_runs_count(
    tmp_path: Path, isolated_dirs: Path, gpuwait_cmd: list[str]
) -> None:
    runs = [train_py_run(tmp_path, n, peak) for n, peak in enumerate([2 * GiB, 2 * GiB, None])]
    shown = estimate_after(tmp_path, isolated_dirs, gpuwait_cmd, runs)
    assert "command:  python3 train.py\n" in shown
    assert "estimated from 2 runs of this exact command" in shown
    assert "2 of the 3 runs of this exact command count: 1 has no measured peak" in shown


@pytest.mark.parametrize(
    ("peaks", "said"),
    [
        ([2], "          its one run's peak 2.0 GiB + 10% margin, rounded up\n"),
        (
            [2, 2],
            "          95th percentile of the peaks 2.0 GiB + 10% margin, rounded up; every "
            "peak 2.0 GiB\n",
        ),
        (
            [2, 3],
            "          95th percentile of the peaks 3.0 GiB + 10% margin, rounded up; peaks "
            "2.0 GiB to 3.0 GiB\n",
        ),
    ],
)
def test_estimate_after_a_first_run_says_its_peak_once(
    tmp_path: Path, isolated_dirs: Path, gpuwait_cmd: list[str], peaks: list[int], said: str
) -> None:
    # After one run it said "95th percentile of the peaks 2.0 GiB + 10% margin, rounded up;
    # peaks 2.0 GiB to 2.0 GiB": a percentile and a range of a single figure.
    runs = [train_py_run(tmp_path, n, peak * GiB) for n, peak in enumerate(peaks)]
    shown = estimate_after(tmp_path, isolated_dirs, gpuwait_cmd, runs)
    assert said in shown, shown


def test_a_size_from_one_approximate_run_says_it_of_that_run_alone(
    tmp_path: Path, isolated_dirs: Path, gpuwait_cmd: list[str]
) -> None:
    # Learned from one run whose peak was measured approximately, `gpuwait -v` said "estimated
    # from 1 run of this exact command, some measured approximately" and `estimate` "some peaks
    # are approximate": "some" of one.
    from gpuwait.history.learn import choose_request

    run = train_py_run(tmp_path, 0, 2 * GiB, peak_approximate=True)
    shown = estimate_after(tmp_path, isolated_dirs, gpuwait_cmd, [run])
    assert "          its peak is approximate (no per-process figures from NVML)\n" in shown
    choice = choose_request(
        None,
        None,
        isolated_dirs / "state" / "gpuwait",
        ["python3", "train.py"],
        str(tmp_path),
        key=None,
        margin=0.1,
        max_bytes=24 * GiB,
    )
    assert choice.note == "estimated from 1 run of this exact command, measured approximately"


def test_estimate_says_a_run_whose_end_nobody_saw_ended_unseen_not_failed(
    tmp_path: Path, isolated_dirs: Path, gpuwait_cmd: list[str]
) -> None:
    # A run whose gpuwait was killed (exit "? lost") and one that failed: it said "0 of the 2
    # runs of this exact command count: 2 failed", of a run that may well have succeeded.
    runs = [train_py_run(tmp_path, n, 2 * GiB, returncode=1) for n in range(2)]
    runs[0]["exit_status"], runs[0]["lost"] = None, True
    shown = estimate_after(tmp_path, isolated_dirs, gpuwait_cmd, runs)
    said = "0 of the 2 runs of this exact command count: 1 failed, 1 ended unseen"
    assert said in shown, shown


def test_estimate_of_a_command_run_a_hundred_times_this_hour_says_why_runs_do_not_count(
    tmp_path: Path, isolated_dirs: Path, gpuwait_cmd: list[str]
) -> None:
    # It said "60 older than 120 days" of runs of the last hour: the runs estimates look at
    # are the newest 40 of each command, and the older ones were taken for old.
    state = isolated_dirs / "state" / "gpuwait"
    state.mkdir(mode=0o700)
    now = time.time()
    runs = [
        a_run(["true", "x"], str(tmp_path), now - 200 + n, peak_by_gpu={"G": GiB})
        for n in range(100)
    ]
    state.joinpath("history.jsonl").write_bytes(b"".join(record.encode(r) for r in runs))
    state.joinpath("history.jsonl").chmod(0o600)
    shown = subprocess.run(
        [*gpuwait_cmd, "estimate", "--", "true", "x"], capture_output=True, text=True
    ).stdout
    assert "older than 120 days" not in shown, shown
    assert (
        "20 of the 100 runs of this exact command count: 60 before the newest 40, "
        "20 beyond the newest 20" in shown
    ), shown


def test_estimate_of_a_new_script_says_other_scripts_runs_of_python_do_not_count(
    tmp_path: Path, isolated_dirs: Path, gpuwait_cmd: list[str]
) -> None:
    # Seven good runs of other python scripts were said to be "beyond the newest 20", which
    # there were not 20 of: python's runs never size another script.
    now = time.time()
    runs = []
    for n in range(7):
        (tmp_path / f"s{n}.py").write_text("")
        runs.append(
            a_run(["python", f"s{n}.py"], str(tmp_path), now - 100 + n, peak_by_gpu={"G": GiB})
        )
    (tmp_path / "new.py").write_text("")
    shown = estimate_after(tmp_path, isolated_dirs, gpuwait_cmd, runs, ("python", "new.py"))
    assert "beyond the newest" not in shown, shown
    assert (
        "0 of the 7 runs of this program count: runs of python size only their own script"
    ) in shown, shown


def test_estimate_of_a_program_whose_runs_disagree_says_so(
    tmp_path: Path, isolated_dirs: Path, gpuwait_cmd: list[str]
) -> None:
    now = time.time()
    runs = [
        a_run(["mytool", f"--x={n}"], str(tmp_path), now - 100 + n, peak_by_gpu={"G": peak})
        for n, peak in enumerate([GiB, 4 * GiB, 8 * GiB])
    ]
    shown = estimate_after(tmp_path, isolated_dirs, gpuwait_cmd, runs, ("mytool", "--y"))
    assert "beyond the newest" not in shown, shown
    assert "0 of the 3 runs of this program count: 3 with peaks too far apart" in shown, shown


#: A wait line drawn and cleared on the terminal on fd 2, taken as the controlling terminal of
#: a session of its own, in its foreground: as a shell's command in the foreground has it.
DRAW_ON_OWN_TERMINAL = r"""
import fcntl, termios
from gpuwait.commands.output import WaitLine
from gpuwait.core.policy import WaitReason
fcntl.ioctl(2, termios.TIOCSCTTY, 0)
line = WaitLine(quiet=False, job="big")
note = "first in line, GPU0 held for it, expected in 3m05s"
line.update(WaitReason(needed="20.0 GiB", best_gpu_index=0, best_room=1 << 30, running=2,
                       ahead=1, note=note, source="estimated from 3 runs of this script"))
line.clear()
"""


def on_a_pty(
    argv: list[str], columns: int, term: str, enough: Callable[[str], bool] | None = None
) -> str:
    """What `argv` writes on a pty `columns` wide, in a session of its own, with TERM=`term`:
    all of it, or, once `enough` says so, what it wrote until then (it is then sent Ctrl-C's
    SIGINT)."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    leader, follower = pty.openpty()
    os.set_blocking(leader, False)
    try:
        fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
        child = subprocess.Popen(
            argv,
            stdin=follower,
            stdout=follower,
            stderr=follower,
            start_new_session=True,
            env={**os.environ, "TERM": term},
        )
        # The pty hands the bytes over as they pass its line discipline, not always at once:
        # read until the child has ended and nothing more comes, or a deadline.
        written = ""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if select.select([leader], [], [], 0.1)[0]:
                written += os.read(leader, 4096).decode()
                if enough is not None and enough(written):
                    child.send_signal(signal.SIGINT)
                    enough = None
            elif child.poll() is not None:
                break
        assert child.wait(timeout=30) == 0, written
    finally:
        os.close(leader)
        os.close(follower)
    return written


def draw_on_a_pty(columns: int, term: str) -> str:
    """What DRAW_ON_OWN_TERMINAL writes on a pty, its own controlling terminal."""
    return on_a_pty([sys.executable, "-c", DRAW_ON_OWN_TERMINAL], columns, term)


@pytest.mark.parametrize("columns", [80, 120])
def test_the_wait_line_fits_the_stream_it_writes_to(columns: int) -> None:
    """On its terminal (a pty here), the line fits its width, named, without wrapping."""
    written = draw_on_a_pty(columns, "xterm-256color")
    assert written.count("\r\033[K") == 2, written
    drawn, cleared = written.rsplit("\r\033[K", 1)[0], written.rsplit("\r\033[K", 1)[1]
    text = drawn.removeprefix("\r\033[K")
    assert text.startswith("gpuwait[big]: waiting for 20.0 GiB") and len(text) < columns
    assert cleared == ""


def test_the_wait_line_fits_a_pane_narrower_than_its_name() -> None:
    # A tmux pane 12 columns wide: the line kept its whole `gpuwait[big]: ` (14), wrapped, and
    # each redraw, going back on its last row only, left one more copy above.
    written = draw_on_a_pty(12, "xterm-256color")
    text = written.split("\r\033[K")[1]
    assert text == "gpuwait[bi…", repr(written)


def test_a_dumb_terminal_gets_whole_lines_and_no_escape_sequences() -> None:
    """TERM=dumb (Emacs's shell and compilation buffers) moves no cursor: an escape sequence
    shows there as `^[[K`, and a line rewritten after `\\r` piles up on one row. The wait line
    is written whole, once, and ends with a newline."""
    written = draw_on_a_pty(80, "dumb")
    assert "\033" not in written and "\r" not in written.replace("\r\n", "\n"), repr(written)
    assert written.startswith("gpuwait[big]: waiting for 20.0 GiB"), repr(written)
    assert written.endswith("\r\n") and written.count("\n") == 1, repr(written)


def test_status_watch_on_a_dumb_terminal_prints_report_after_report(sim_file: Any) -> None:
    """`status --watch` takes no screen of its own where the terminal cannot give one (TERM=dumb):
    it prints each report in turn, as into a pipe."""
    sim_file(gpus=1)
    written = on_a_pty(
        [sys.executable, "-m", "gpuwait", "status", "--watch", "0.1"],
        80,
        "dumb",
        enough=lambda text: text.count("GPUs (sim") >= 2,
    )
    assert written.count("GPUs (sim") >= 2, repr(written)
    assert "\033" not in written, repr(written)


def test_status_lists_the_queue_in_the_order_its_wait_lines_count() -> None:
    # Under the lookahead order (the default) a job waiting for a dependency is placed after
    # every job the plan can place: status listed it first, by submission, saying "1 ahead of
    # you", and the job behind it "0 ahead of you".
    import re

    from gpuwait.core.lookahead import DEFAULT
    from gpuwait.core.policy import FairShare
    from gpuwait.core.snapshot import MachineSnapshot
    from gpuwait.queue.entries import RUNNING, WAITING, Job, LedgerData
    from gpuwait.queue.report import View, report_from

    gpu = GpuSnapshot(0, "GPU-0", "Test GPU", 24 * GiB, 0)

    def job(job_id: str, order: int, **fields: Any) -> Job:
        return Job(
            id=job_id,
            pid=os.getpid(),
            start_time=0,
            uid=os.getuid(),
            command=["python", f"{job_id}.py"],
            cwd="/",
            order=order,
            **fields,
        )

    running = job("a", 0, state=RUNNING, request={"bytes": 20 * GiB}, gpu_uuids=["GPU-0"])
    running.reserved_bytes = 20 * GiB
    running.started_at = time.time()
    blocked = job("blocked", 1, state=WAITING, request={"bytes": GiB}, after=["a"])
    big = job("big", 2, state=WAITING, request={"bytes": 10 * GiB})
    data = LedgerData(jobs=[running, blocked, big])
    view = View(safety=0.9, fair=FairShare(order=DEFAULT))
    report = report_from(MachineSnapshot("sim", (gpu,)), data, time.time(), view)
    waiting = [j for j in report["jobs"] if j["state"] == WAITING]
    assert [j["position"] for j in waiting] == [1, 2]
    for shown in waiting:
        ahead = re.search(r"([0-9]+) ahead of you", shown["waiting_reason"])
        assert ahead is not None, shown["waiting_reason"]
        assert int(ahead.group(1)) == shown["position"] - 1, (shown["id"], shown["waiting_reason"])


def test_status_says_a_waiting_job_stepped_aside_and_that_it_resumes_from_its_checkpoint() -> None:
    # A --pausable job that checkpointed and stepped aside for an urgent one waits again: its
    # user sees that it did, how often, and where it queues, not a job that never ran.
    from gpuwait.core.snapshot import MachineSnapshot
    from gpuwait.queue.entries import RUNNING, WAITING, Job, LedgerData
    from gpuwait.queue.report import View, report_from

    gpu = GpuSnapshot(0, "GPU-0", "Test GPU", 24 * GiB, 0)

    def job(job_id: str, **fields: Any) -> Job:
        return Job(
            id=job_id,
            pid=os.getpid(),
            start_time=0,
            uid=os.getuid(),
            command=["python", "train.py"],
            cwd="/",
            request={"bytes": 16 * GiB},
            **fields,
        )

    urgent = job("urgent", state=RUNNING, priority=5, gpu_uuids=["GPU-0"], reserved_bytes=16 * GiB)
    urgent.started_at = time.time()
    resumed = job("resumed", state=WAITING, priority=1, boost=5, pauses=2, pausable=True)
    data = LedgerData(jobs=[urgent, resumed])
    report = report_from(MachineSnapshot("sim", (gpu,)), data, time.time(), View(safety=0.9))
    (shown,) = [j for j in report["jobs"] if j["id"] == "resumed"]
    assert shown["pauses"] == 2 and shown["queued_priority"] == 5
    text = status.render(report, 100)
    assert "stepped aside 2× (checkpointed); resumes from its checkpoint, queued at p5" in text


#: A command whose arguments are Chinese: each character takes two columns of a terminal.
WIDE_COMMAND = ["python3", "train.py", "--data", "训练数据集" * 12]


def on_screen(text: str) -> int:
    """The columns `text` takes on a terminal (what wcwidth says of each character)."""
    import unicodedata

    return sum(2 if unicodedata.east_asian_width(c) in ("W", "F") else 1 for c in text)


def test_a_command_in_chinese_or_emoji_fits_the_width_as_any_other() -> None:
    # Cut by characters, a line of 80 characters with 40 Chinese ones took 120 columns: every
    # such row wrapped onto a second, and the watch screen, counting rows, scrolled its title off.
    report = a_report(
        [job_row(command=WIDE_COMMAND), job_row(id="5e6f7a8b", command=["run", "🚀" * 60])]
    )
    for width in (80, 100):
        lines = status.render(report, width).splitlines()
        assert all(on_screen(line) <= width for line in lines), lines
        assert any("--data '训" in line for line in lines)
    # Another user's job named so keeps the columns after it in line.
    named = a_report([job_row(name="训练" * 8), job_row(id="5e6f7a8b", name="plain")])
    rows = status.render(named, 80).splitlines()[-2:]
    assert [on_screen(row.split(" p3 ")[0]) for row in rows] == [26, 26], rows
    frame = status.fit_screen(["训练数据集" * 30, "x" * 100], 80, 24)
    assert [on_screen(line) for line in frame] == [80, 80]
    record = a_run(WIDE_COMMAND, "/tmp", time.time())
    rows = history.table([record], 80)
    assert all(on_screen(row) <= 80 for row in rows), rows
    assert history.table([record], None)[1].endswith("训练数据集" * 12 + "'")


def test_a_line_separator_in_a_command_makes_no_row_of_its_own_on_the_watch_screen() -> None:
    # U+2028 and U+2029 end a line for str.splitlines(): a colleague's command holding one cut
    # the watch screen's row there, and the rest of it stood on a row of its own, a forged job.
    forged = "1\u2028   2 deadbeef you    p5  whole   -  your job was cancelled\u2029!"
    report = a_report([job_row(command=["sleep", forged])])
    lines = status.render(report, 130).splitlines()
    assert [line for line in lines if "1a2b3c4d" in line or "cancelled" in line] == [
        "   1 1a2b3c4d -            p3  1.0G             -  "
        "sleep '1?   2 deadbeef you    p5  whole   -  your job was cancelled?!'"
    ]


def test_the_wait_line_into_a_pipe_shows_a_colleagues_escape_sequences_as_text() -> None:
    # `gpuwait --after their-job ... 2>&1 | tee run.log`: the line names the job waited for, by
    # the name its owner gave it in the shared ledger; written to a pipe, it went out raw, and
    # tee put the escape sequence on the terminal (here one that sets the clipboard, OSC 52).
    stream = io.StringIO()
    line = WaitLine(quiet=False, job="train", stream=stream)
    line.update(
        REASON._replace(blocked="waiting for job 1a2b3c4d (\033]52;c;cm0gLXJm\a) to finish")
    )
    assert stream.getvalue() == (
        "gpuwait[train]: waiting for job 1a2b3c4d (?]52;c;cm0gLXJm?) to finish "
        "(2 running, 1 ahead of you)\n"
    )


def test_a_command_kept_as_its_hash_shows_its_program_safely_when_piped() -> None:
    # history_commands = hash keeps the program's name and the line's hash: a program named
    # with an escape sequence (a script someone else named) went out raw into `| less -R`.
    program = "/shared/\033]52;c;cm0gLXJm\a.py"
    record = a_run([program, "--fast"], "/tmp", time.time(), history_commands="hash")
    for width in (None, 100):
        row = history.table([record], width)[1]
        assert "\033" not in row and "\a" not in row, row
        assert "?]52;c;cm0gLXJm?.py [" in row, row


def test_the_run_time_under_history_counts_only_runs_that_estimates_count() -> None:
    # Two runs of an hour, and one stopped with Ctrl-C after 5 s that exited 0 (a trainer that
    # saves and leaves): the note said "median 1h00m" of 3 runs shown, with the stopped one.
    runs = [a_run(["python3", "t.py"], "/tmp", time.time(), run_seconds=s) for s in (3600, 3600)]
    stopped = a_run(["python3", "t.py"], "/tmp", time.time(), run_seconds=5, stopped_by=2)
    notes = "\n".join(history.table([*runs, stopped], None))
    assert "run time of the 2 successful runs shown" in notes, notes


def test_an_unmeasured_peak_blames_no_driver_where_the_run_allocated_nothing() -> None:
    # A run whose process the simulation, like NVML on a host, never listed (it allocated
    # nothing: refused by its cap at once) while a neighbour grew: the note said "NVML gave no
    # per-process figures", which it had, for every other process.
    gpu = GpuSnapshot(index=0, uuid="GPU-0", name="Sim", total_bytes=24 * GiB, used_bytes=0)
    unmeasured = a_run(COMMAND, "/tmp", time.time(), gpus=[gpu], samples=2, returncode=1)
    notes = history.table([unmeasured], None)[-1]
    assert notes.startswith("peak -: not measured: others used or freed memory"), notes
    assert "NVML listed none of its processes with a figure" in notes, notes


def test_the_peak_of_a_run_whose_gpuwait_was_killed_is_not_said_to_have_ended_early() -> None:
    # A run of 3 s whose gpuwait was killed (exit "? lost"), recorded when its entry was reaped
    # with no peak published: the note said "the run ended before the first reading".
    gpu = GpuSnapshot(index=0, uuid="GPU-0", name="Sim", total_bytes=24 * GiB, used_bytes=0)
    lost = a_run(COMMAND, "/tmp", time.time(), gpus=[gpu], samples=0, run_seconds=3.2)
    lost["exit_status"], lost["lost"] = None, True
    rows = history.table([lost], None)
    assert "? lost" in rows[1], rows
    assert rows[-1] == "peak -: not measured: its gpuwait was killed before it kept a reading", rows


def test_a_piped_wait_line_counting_down_to_its_start_writes_no_line_of_its_own() -> None:
    # `gpuwait ... 2> run.log`, first in line with its GPU held for it: the expected start
    # counted down from 1h00m to 0.5 s and the log took a new line each time the figure
    # changed its form (minutes, seconds, milliseconds), 4 lines for one situation.
    stream = io.StringIO()
    line = WaitLine(quiet=False, job="train", stream=stream)
    for due in ("1h00m", "59m59s", "3m05s", "59.0s", "500ms"):
        line.update(REASON._replace(note=f"first in line, GPU0 held for it, expected in {due}"))
    assert stream.getvalue() == (
        "gpuwait[train]: waiting for 20.0 GiB (estimated from 3 runs of this script): best GPU0 "
        "has 1.6 GiB; first in line, GPU0 held for it, expected in 1h00m "
        "(2 running, 1 ahead of you)\n"
    )
    # What is said changes (the start is overdue now): a line.
    line.update(REASON._replace(note="first in line, GPU0 held for it, expected overdue"))
    assert stream.getvalue().count("\n") == 2


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (
            "first in line, GPU0 held for it, expected in 3m05s",
            "first in line, GPU1 held for it, expected in 3m04s",
        ),
        (
            "only 1 of 3 candidates under 30% utilization, 3 wanted",
            "only 2 of 3 candidates under 30% utilization, 3 wanted",
        ),
        (
            "GPU0 held for job 2098ff16, whose start cannot be estimated",
            "GPU0 held for job 3098ff17, whose start cannot be estimated",
        ),
    ],
    ids=["held GPU", "count", "job"],
)
def test_a_piped_wait_line_writes_a_line_where_its_note_names_another_gpu_or_count(
    before: str, after: str
) -> None:
    # `gpuwait ... 2> run.log`: the GPU held for the job changed from GPU0 to GPU1, the cards
    # quiet enough from 1 of 3 to 2, the job held for another, and the log said nothing: every
    # figure of the note was taken for one that moves with each reading, as its expected start
    # does, where only a duration is.
    stream = io.StringIO()
    line = WaitLine(quiet=False, job="train", stream=stream)
    line.update(REASON._replace(note=before))
    line.update(REASON._replace(note=after))
    written = stream.getvalue().splitlines()
    assert len(written) == 2 and after in written[1], written


def test_a_command_in_fullwidth_letters_fits_the_width_as_any_other() -> None:
    # Fullwidth forms (`ｔｒａｉｎ．ｐｙ`, as a Japanese input method types letters) take two
    # columns each, as Chinese does: counted as one, a row of them ran past the terminal's edge.
    report = a_report([job_row(command=["python3", "ｔｒａｉｎ．ｐｙ" * 10])])
    for width in (80, 100):
        lines = status.render(report, width).splitlines()
        assert all(on_screen(line) <= width for line in lines), lines
        assert any("ｔｒａｉｎ" in line for line in lines)


@pytest.mark.parametrize(
    "changed",
    [
        {"needed": "24.0 GiB"},
        {"best_gpu_index": 1},
        {"running": 3},
        {"blocked": "waiting for job 1a2b3c4d (prep) to finish"},
        {"limit": "your per-user limit of 1 GPUs is reached"},
        {"pause": "asked job 5e6f7a8b (train) to step aside"},
        {"gpu_error": "NVML_ERROR_UNKNOWN: the driver said no"},
        {"ledger_error": "out of file descriptors"},
    ],
    ids=lambda changed: next(iter(changed)),
)
def test_a_wait_line_off_a_terminal_says_each_change_of_the_situation(
    changed: dict[str, Any],
) -> None:
    # In a log (a file, a pipe), a line is written where the situation changes: what the job
    # waits for, the best card, how many run, a dependency, a limit, a request to step aside,
    # the GPUs or the ledger failing to be read. Each changed alone is a new line.
    stream = io.StringIO()
    line = WaitLine(quiet=False, job="train", stream=stream)
    line.update(REASON)
    line.update(REASON._replace(**changed))
    line.clear()
    assert stream.getvalue().splitlines() == [
        "gpuwait[train]: " + REASON.describe(),
        "gpuwait[train]: " + REASON._replace(**changed).describe(),
    ]


def test_status_marks_the_gpus_this_shell_places_no_job_on(sim_file: Any) -> None:
    # In a Slurm allocation (or any shell with CUDA_VISIBLE_DEVICES set), status listed every
    # GPU of the node, other allocations' among them, with no word of which this shell can use.
    sim_file(gpus=4)

    def status(*args: str, visible: str | None) -> str:
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        env["COLUMNS"] = "80"
        done = subprocess.run(
            [sys.executable, "-m", "gpuwait", "status", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    text = status(visible="2,3")
    assert max(len(line) for line in text.splitlines()) <= 80, text
    gpu_table = text.split("\n\n", 1)[0]
    assert "GPU 0, 1 not visible here (CUDA_VISIBLE_DEVICES=2,3)" in " ".join(
        line.strip() for line in gpu_table.splitlines()
    ), text
    shown = json.loads(status("--json", visible="2,3"))
    assert [g["visible_here"] for g in shown["gpus"]] == [False, False, True, True]
    # Where nothing hides a GPU, nothing is said.
    text = status(visible=None)
    assert "not visible here" not in text, text
    shown = json.loads(status("--json", visible=None))
    assert [g["visible_here"] for g in shown["gpus"]] == [True] * 4
    # A value that hides every GPU (CUDA's way to run on the CPU) marks them all.
    shown = json.loads(status("--json", visible=""))
    assert [g["visible_here"] for g in shown["gpus"]] == [False] * 4


def test_status_in_a_slurm_job_given_no_gpu_marks_every_gpu_not_visible_here(
    sim_file: Any, tmp_path: Path
) -> None:
    # A Slurm job (or step) given no GPU where slurm.conf hands GPUs out as GRES has no
    # CUDA_VISIBLE_DEVICES: a launch there is refused (3), but status marked every GPU usable.
    sim_file(gpus=2)
    conf = tmp_path / "slurm.conf"
    conf.write_text("GresTypes=gpu\n")
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update(SLURM_JOB_ID="7", SLURMD_NODENAME="n1", SLURM_CONF=str(conf), COLUMNS="400")

    def status(*args: str, **more: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "gpuwait", "status", *args],
            env={**env, **more},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    text = " ".join(line.strip() for line in status().split("\n\n", 1)[0].splitlines())
    assert (
        f"GPU 0, 1 not visible here (Slurm gave this job no GPU; {conf} hands this node's GPUs "
        "out as GRES): gpuwait places no job started from this shell on them"
    ) in text, text
    shown = json.loads(status("--json"))
    assert [g["visible_here"] for g in shown["gpus"]] == [False, False]
    assert (shown["visible_from"], shown["slurm_gave_no_gpu"]) == (None, str(conf))
    # A step run with --gres=none in a job that has GPUs: the same.
    text = " ".join(status(SLURM_JOB_GPUS="0").split("\n\n", 1)[0].split())
    assert "not visible here (Slurm gave this step none of its job's GPUs;" in text, text
    # Where Slurm gave the job GPUs, or does not hand them out, nothing is hidden.
    shown = json.loads(status("--json", CUDA_VISIBLE_DEVICES="1", SLURM_STEP_GPUS="1"))
    assert [g["visible_here"] for g in shown["gpus"]] == [False, True]
    assert shown["slurm_gave_no_gpu"] is None
    conf.write_text("GresTypes=mps\n")
    shown = json.loads(status("--json"))
    assert [g["visible_here"] for g in shown["gpus"]] == [True, True]
    assert shown["slurm_gave_no_gpu"] is None
