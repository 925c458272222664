"""Screens as a person sees them: the real commands in a tmux terminal of 80x24 and 120x40.

What a user would notice is checked on the screen tmux shows (and on what scrolled off it):
no row past the width, no cut-off copies of a redrawn line, no line left behind once a wait is
over, several waiters in one terminal each on lines of their own, and `status --watch`
redrawn in place.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import REPO
from helpers import docs
from helpers.fixtures_sim import (
    Run,
    SimFileFactory,
    sim_file_text,
    start_sim_job,
    wrapped_sim_job,
    write_atomically,
)
from helpers.history import a_run
from helpers.shellbin import CONSOLE_SCRIPT, env_with_bin, make_bin
from helpers.tmux import Terminal
from helpers.waiting import asleep_supervising, asleep_waiting, wait_for

from gpuwait.core.snapshot import GpuSnapshot
from gpuwait.history.store import append_record

SIZES = [(80, 24), (120, 40)]
GiB = 2**30


@pytest.fixture
def shell(terminal: Callable[..., Terminal], tmp_path: Path) -> Callable[[int, int], Terminal]:
    """shell(width, height) -> a terminal whose shell has this checkout's `gpuwait` first on
    PATH and the test's settings (GPUWAIT_SIM ...) as they are when it is opened, with GPU
    readings often enough that a waiter sees a change within a fraction of a second."""
    bin_dir = make_bin(tmp_path / "bin")

    def open_shell(width: int, height: int) -> Terminal:
        env = env_with_bin(bin_dir)
        env["GPUWAIT_NVML_INTERVAL"] = "0.1s"
        return terminal(width, height, env)

    return open_shell


def gpuwait_rows(rows: list[str]) -> list[str]:
    return [r for r in rows if "gpuwait[" in r]


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_the_wait_line_is_redrawn_in_place_and_cleared(
    shell: Callable[[int, int], Terminal],
    sim_file: SimFileFactory,
    width: int,
    height: int,
) -> None:
    # One 24 GiB card, 10 GiB of it used outside gpuwait: 20 GiB does not fit until it is freed.
    sim = sim_file(gpus=1, memory="24GiB", base_used="10GiB")
    term = shell(width, height)
    term.type("gpuwait --name big --vram 20G -- echo the-job-ran")
    term.wait_for(lambda rows: any("11.6 GiB" in r for r in gpuwait_rows(rows)), what="the wait")
    # Every change of the room redraws the line: none may leave a copy (or part of one) behind.
    for used in ("9GiB", "8GiB", "7GiB", "6GiB"):
        write_atomically(sim, sim_file_text(1, "24GiB", base_used=used))
        free = f"{21.6 - float(used[:-3]):.1f} GiB"
        rows = term.wait_for(
            lambda rows, free=free: any(free in r for r in gpuwait_rows(rows)),  # type: ignore[misc]
            what=f"the line saying {free}",
        )
        assert len(gpuwait_rows(rows)) == 1, rows
        shown = gpuwait_rows(rows)[0]
        assert shown.startswith("gpuwait[big]: waiting for 20.0 GiB: best GPU0 has"), rows
        assert len(shown) < width
        # The row below is empty: the line did not wrap onto it.
        assert rows[rows.index(shown) + 1 :] == [""] * (len(rows) - rows.index(shown) - 1)
    write_atomically(sim, sim_file_text(1, "24GiB", base_used=0))
    rows = term.wait_for(lambda rows: "the-job-ran" in rows, what="the job's output")
    # The terminal is left clean: the command's output where the wait line was, nothing else.
    assert not gpuwait_rows(term.everything()), term.everything()
    assert rows[1] == "the-job-ran", rows


def test_a_waiter_stopped_with_ctrl_z_says_again_why_it_waits_once_fg_continues_it(
    shell: Callable[[int, int], Terminal], sim_file: SimFileFactory
) -> None:
    """Ctrl-Z leaves the wait line above the shell's `Stopped` and its prompt; `fg` puts the
    waiter back in front, and the screen below `fg` has to say again what it waits for, not
    stay blank (the room never changes here: nothing else would say it again)."""
    sim_file(gpus=1, memory="24GiB", base_used="10GiB")
    term = shell(80, 24)
    term.type("gpuwait --name big --vram 20G -- echo the-job-ran")
    term.wait_for(lambda rows: len(gpuwait_rows(rows)) == 1, what="the wait line")
    term.key("C-z")
    term.wait_for(lambda rows: any("Stopped" in r for r in rows), what="the shell's Stopped")
    term.wait_idle()
    term.type("fg")

    def below_fg(rows: list[str]) -> list[str]:
        # Nothing yet where the shell has not echoed `fg` (a slow, busy machine).
        return rows[max((i for i, r in enumerate(rows) if r == "$ fg"), default=len(rows)) :]

    rows = term.wait_for(
        lambda rows: any(
            r.startswith("gpuwait[big]: waiting for 20.0 GiB") for r in below_fg(rows)
        ),
        what="the wait line again below fg",
    )
    assert len(gpuwait_rows(below_fg(rows))) == 1, rows
    assert all(len(r) < 80 for r in below_fg(rows)), rows
    term.key("C-c")
    term.wait_idle()
    # Stopped again and ended by the shell (`kill %1`: TERM, then CONT): it ends without a word.
    term.type("clear; gpuwait --name big --vram 20G -- echo the-job-ran")
    term.wait_for(lambda rows: len(gpuwait_rows(rows)) == 1, what="the wait line")
    term.key("C-z")
    term.wait_for(lambda rows: any("Stopped" in r for r in rows), what="the shell's Stopped")
    term.type("kill %1")

    def told_ended() -> list[str] | None:
        # The shell tells of the job's end at the first prompt after it.
        rows = term.wait_idle()
        return rows if any("Terminated" in r for r in rows) else None

    rows = wait_for(told_ended, timeout=20, interval=0.2, message="the shell's Terminated")
    assert len(gpuwait_rows(rows)) == 1, rows
    term.type("gpuwait status")
    term.wait_for(lambda rows: any(r.startswith("Queue (0)") for r in rows), what="status")


def test_the_wait_line_at_80_columns_says_why_no_gpu_is_usable(
    shell: Callable[[int, int], Terminal], sim_file: SimFileFactory
) -> None:
    # Every card kept 90 % busy, a --max-util 30 job: the line said "waiting for 1.0 GiB: no
    # usable GPU right now (0 ahead)" at 80 columns, the reason (too busy) dropped to fit, and
    # nothing on the screen said what to change.
    sim_file(gpus=2, utilization=90)
    term = shell(80, 24)
    term.type("gpuwait --name util --max-util 30 --vram 1G -- echo the-job-ran")
    rows = term.wait_for(
        lambda rows: any("busier than 30%" in r for r in gpuwait_rows(rows)),
        what="the reason no GPU is usable",
    )
    (shown,) = gpuwait_rows(rows)
    assert shown.startswith("gpuwait[util]: waiting for 1.0 GiB: every candidate is busier"), rows
    assert len(shown) < 80, shown
    term.key("C-c")


@pytest.mark.parametrize(
    ("directory", "wider", "counts"),
    [
        # Four Chinese characters, two columns each: 8 columns, not 4. The window is as wide
        # as the fullest wording in characters, which it is not in columns.
        ("训练数据", 2, "(0 running, 0 ahead)"),
        # Eight e's, each with a combining acute accent (no column of its own): 8 columns, not
        # 16. The window is as wide as the fullest wording in columns.
        ("e\u0301" * 8, -6, "(0 running, 0 ahead of you)"),
    ],
    ids=["wide", "combining"],
)
def test_the_wait_line_with_a_path_in_other_scripts_fits_the_columns_it_takes(
    shell: Callable[[int, int], Terminal],
    sim_file: SimFileFactory,
    tmp_path: Path,
    directory: str,
    wider: int,
    counts: str,
) -> None:
    # The wait line was fitted to the terminal counting each character as one column: with the
    # GPU readings failing on a file in a directory named in Chinese (two columns each), the
    # fullest wording was taken as fitting, and was then cut short at its end with '…' where
    # a shorter one fits; in one named with combining accents (none), a wording that fits was
    # taken as too wide, "ahead" shown for "ahead of you".
    (tmp_path / directory).mkdir()
    sim = sim_file(
        gpus=1, memory="24GiB", base_used="10GiB", file=tmp_path / directory / "sim.toml"
    )
    failing = (
        "gpuwait[12345678]: waiting for 20.0 GiB: GPU readings failing, retrying (simulation "
        f"file {sim}: not found) (0 running, 0 ahead of you)"
    )
    term = shell(len(failing) + wider, 24)
    term.type("gpuwait --vram 20G -- echo the-job-ran")
    term.wait_for(lambda rows: any("11.6 GiB" in r for r in gpuwait_rows(rows)), what="the wait")
    sim.unlink()
    rows = term.wait_for(
        lambda rows: any("failing" in r for r in gpuwait_rows(rows)), what="the readings failing"
    )
    (shown,) = gpuwait_rows(rows)
    assert shown.endswith(f"{sim}: not found) {counts}"), shown
    # The row below is empty: the line did not wrap onto it.
    assert rows[rows.index(shown) + 1] == "", rows
    term.key("C-c")


@pytest.mark.parametrize("gpus", [1, 2])
def test_the_verbose_start_lines_fit_80_columns(
    shell: Callable[[int, int], Terminal], sim_file: SimFileFactory, gpus: int
) -> None:
    # `gpuwait -v` said "job ID starts on GPU0 (GPU-<its UUID>) after 94ms, 4.0 GiB reserved",
    # 108 columns, one more GPU's name and UUID 48 more: an 80-column terminal broke it onto a
    # second row in the middle of a UUID.
    from gpuwait.gpu.sim import SimBackend

    sim = sim_file(gpus=2)
    uuids = [g.uuid for g in SimBackend(str(sim)).snapshot().gpus]
    term = shell(80, 24)
    term.type(f"gpuwait -v --vram 4G --gpus {gpus} -- echo the-job-ran")
    term.wait_for(lambda rows: "the-job-ran" in rows, what="the job's output")
    said = [line for line in term.everything(joined=True) if line.startswith("gpuwait: ")]
    assert any(" starts on GPU0" in line for line in said), said
    for uuid in uuids[:gpus]:
        assert any(uuid in line for line in said), said
    assert all(len(line) < 80 for line in said), said


@pytest.mark.parametrize(
    ("earlier", "note"),
    [
        (0, "no earlier runs of this command: default_vram"),
        (3, "estimated from 3 runs of this exact command"),
    ],
)
def test_the_verbose_start_line_of_a_job_sized_without_vram_fits_80_columns(
    shell: Callable[[int, int], Terminal], sim_file: SimFileFactory, earlier: int, note: str
) -> None:
    # A job sized by its earlier runs or by default_vram had where its size came from put after
    # it in parentheses: "... starts on GPU0 after 16ms, 5.5 GiB reserved (estimated from 3
    # runs of this exact command)", 111 columns, broken onto a second row mid-word.
    sim_file(gpus=1)
    term = shell(80, 24)
    job = "gpuwait sim job --vram 5G --hold 0.2s"
    if earlier:
        term.type(f"for i in {' '.join('x' * earlier)}; do gpuwait -q --vram 8G -- {job}; done")
    term.type(f"gpuwait -v -- {job} && echo the-job-ran")
    term.wait_for(lambda rows: "the-job-ran" in rows, what="the job's end")
    said = [line for line in term.everything(joined=True) if line.startswith("gpuwait: ")]
    assert any(" starts on GPU0" in line for line in said), said
    assert any(line.endswith(note) for line in said), said
    assert all(len(line) < 80 for line in said), said


def test_a_first_whole_gpu_wait_at_80_columns_says_why_and_what_to_give(
    shell: Callable[[int, int], Terminal], sim_file: SimFileFactory
) -> None:
    # No earlier runs of the command, no --vram: default_vram asks for a whole GPU, and every
    # card holds 3 GiB of someone else's. At 80 columns the line said "waiting for a whole GPU:
    # best GPU0 has 18.6 GiB (0 ahead)": neither why a whole GPU nor how to ask for less.
    sim_file(gpus=2, base_used="3GiB")
    term = shell(80, 24)
    term.type("gpuwait -- echo the-job-ran")
    rows = term.wait_for(
        lambda rows: any("waiting for a whole GPU" in r for r in gpuwait_rows(rows)),
        what="the wait line",
    )
    (shown,) = gpuwait_rows(rows)
    assert "default_vram" in shown and "--vram" in shown, rows
    assert len(shown) < 80, shown
    term.key("C-c")


WAIT_ROW = re.compile(r"^(\$ )?gpuwait\[[abc]\]: waiting for 20\.0 GiB")


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_background_waiters_write_whole_lines_of_their_own(
    shell: Callable[[int, int], Terminal],
    sim_file: SimFileFactory,
    procs: Callable[..., subprocess.Popen[str]],
    gpuwait_cmd: list[str],
    width: int,
    height: int,
) -> None:
    sim_file(gpus=1, memory="24GiB")
    holder = procs(
        wrapped_sim_job(gpuwait_cmd, ["--vram", "20G"], "--vram", "20G", "--hold", "60s")
    )
    wait_for(lambda: asleep_supervising(holder.pid), message="the card is taken")
    term = shell(width, height)
    term.type("w() { gpuwait --name $1 --vram 20G -- echo ran-$1; }")
    term.type("w a & sleep 0.3; w b & sleep 0.3; w c &")
    term.wait_for(
        lambda rows: all(any(f"gpuwait[{n}]" in r for r in rows) for n in "abc"),
        what="a line from each waiter",
    )
    term.type("gpuwait status")
    rows = term.wait_for(lambda rows: any(r.startswith("Queue (3)") for r in rows), what="status")
    for row in gpuwait_rows(term.everything()):
        # A line of its own, said once: not run into another waiter's or into status's output.
        assert WAIT_ROW.match(row) and row.count("gpuwait[") == 1 and "GPUs" not in row, rows
    assert any(r.startswith("GPUs (sim") for r in rows), rows
    holder.terminate()
    term.wait_for(
        lambda rows: all(any(r.endswith(f"ran-{n}") for r in rows) for n in "abc"),
        what="every waiter's command ran",
    )
    assert all(len(line) <= width for line in term.everything(joined=True)), term.everything()


def test_a_waiter_without_the_terminal_as_its_own_leaves_the_prompt_and_the_typing_alone(
    shell: Callable[[int, int], Terminal], sim_file: SimFileFactory
) -> None:
    """`setsid gpuwait ... &`: its stderr is the terminal, which is not its controlling one, so
    it cannot tell whether it has the screen to itself. It does not: the shell's prompt and what
    the user types there share it, and a line redrawn in place (or cleared) would wipe them."""
    sim = sim_file(gpus=1, memory="24GiB", base_used="10GiB")
    term = shell(80, 24)
    term.type("setsid gpuwait --name s --vram 20G -- echo ran-s &")
    term.wait_for(lambda rows: any("gpuwait[s]" in r for r in rows), what="the wait line")
    term.type("echo typed-at-the-prompt", enter=False)
    term.wait_for(lambda rows: any("typed-at-the-prompt" in r for r in rows), what="the typing")
    write_atomically(sim, sim_file_text(1, "24GiB", base_used=0))
    # As any background job's output, the command's comes after what was typed.
    rows = term.wait_for(lambda rows: any("ran-s" in r for r in rows), what="the command's output")
    assert any("typed-at-the-prompt" in r for r in rows), rows
    assert "$ " + "gpuwait[s]: waiting for 20.0 GiB" in " ".join(rows), rows  # the prompt kept


def test_status_watch_redraws_in_place_within_the_window(
    shell: Callable[[int, int], Terminal],
    sim_file: SimFileFactory,
    procs: Callable[..., subprocess.Popen[str]],
    gpuwait_cmd: list[str],
) -> None:
    sim_file(gpus=1, memory="24GiB")
    holder = procs(
        wrapped_sim_job(gpuwait_cmd, ["--vram", "20G"], "--vram", "20G", "--hold", "60s")
    )
    wait_for(lambda: asleep_supervising(holder.pid), message="the card is taken")
    waiters = [
        procs([*gpuwait_cmd, "--name", f"q{n}", "--vram", "20G", "--", "true"]) for n in range(8)
    ]
    wait_for(lambda: all(asleep_waiting(w.pid) for w in waiters), timeout=30, message="8 waiters")
    term = shell(80, 24)
    term.type("clear; gpuwait status --watch 0.2")
    rows = term.wait_for(lambda rows: any(r.startswith("Queue (8)") for r in rows), what="a frame")
    assert term.alternate_screen()
    # The most important rows first: the GPUs at the top, then what runs, and a note of the rest.
    assert rows[0].startswith("gpuwait status, every 200ms") and rows[2].startswith("GPUs (sim")
    assert rows.index("Running (1)") < rows.index("Queue (8)")
    assert re.fullmatch(r"… \d+ more rows hidden; a taller window shows them", rows[-1]), rows
    assert len(rows) == 24 and all(len(r) <= 80 for r in rows)
    time.sleep(0.6)  # three more frames, at 0.2 s each, drawn over the first
    term.key("C-c")
    rows = term.wait_for(lambda rows: rows[-1] == "$ " or "$" in rows, what="the prompt again")
    assert not term.alternate_screen()
    # Nothing of the frames is left in the shell's screen or its scrollback.
    assert not [r for r in term.everything() if "GPUs (" in r or "Queue (" in r]


def test_status_watch_says_why_the_gpus_cannot_be_read(
    shell: Callable[[int, int], Terminal],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    gpuwait_cmd: list[str],
) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text("[[gpu]]\nmemory = \n")
    monkeypatch.setenv("GPUWAIT_SIM", str(broken))
    plain = subprocess.run([*gpuwait_cmd, "status"], capture_output=True, text=True)
    said = next(line for line in plain.stderr.splitlines() if "error" in line)
    term = shell(80, 24)
    term.type("gpuwait status --watch 0.2")
    rows = term.wait_for(lambda rows: any(r.startswith("GPUs (") for r in rows), what="a frame")
    # As plain `status` says it (cut at the width), not only "GPUs (unavailable ...".
    assert said[:80] in rows, (said, rows)
    term.key("C-c")


LONG_COMMAND = ["python3", "-c", "import time; time.sleep(3)", "--output", "/data/runs/" + "x" * 60]


def write_history(state: Path) -> None:
    """Runs as `history` shows them: one paused, one unmeasured, one approximate, one long."""
    now = time.time()
    gpu = GpuSnapshot(index=0, uuid="GPU-0", name="Sim", total_bytes=24 * GiB, used_bytes=0)
    runs = [
        a_run(LONG_COMMAND, "/tmp", now - 300, gpus=[gpu], peak_by_gpu={"GPU-0": 3 * GiB}),
        a_run(["python3", "train.py"], "/tmp", now - 200, gpus=[gpu], peak_by_gpu={"GPU-0": 0}),
        a_run(["python3", "train.py"], "/tmp", now - 100, gpus=[gpu], peak_approximate=True),
        a_run(["python3", "train.py"], "/tmp", now - 50, gpus=[gpu], run_seconds=3725.0),
    ]
    runs[1]["peak_bytes"] = None
    runs[2]["peak_bytes"], runs[2]["peak_approximate"] = 0, True
    runs[3]["pauses"], runs[3]["paused_seconds"] = 1, 2.3
    directory = state / "gpuwait"
    directory.mkdir(mode=0o700, exist_ok=True)
    for run in runs:
        append_record(directory, run)


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_history_and_config_fit_the_terminal(
    shell: Callable[[int, int], Terminal],
    sim_file: SimFileFactory,
    isolated_dirs: Path,
    width: int,
    height: int,
) -> None:
    sim_file(gpus=1)
    write_history(isolated_dirs / "state")
    term = shell(width, height)
    term.type("clear; gpuwait history")
    rows = term.wait_for(lambda rows: any("paused 1×" in r for r in rows), what="the history")
    term.wait_idle()
    term.type("gpuwait config")
    term.wait_for(lambda rows: any(r.startswith("ledger dir:") for r in rows), what="the config")
    # No row wrapped: every line, joined back from the rows it took, fits the width (but for a
    # path, which is never cut and has a line of its own: the test's own are long).
    lines = term.everything(joined=True)
    wide = [x for x in lines if len(x) > width and not re.fullmatch(r"  /\S+", x)]
    assert not wide, wide
    # The wider terminal shows more: the year, the time a pause cost, more of the command.
    if width >= 120:
        assert any(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d ", r) for r in rows), rows
        assert any("paused 1× (2.3s lost)" in r for r in rows), rows
    sources = [line for line in lines if line.endswith("(default)")]
    # Sources line up in one column, not pushed out past the longest value: only the few long
    # values (lists, paths) have theirs further out.
    column, lined_up = Counter(line.rindex("(default)") for line in sources).most_common(1)[0]
    assert lined_up >= len(sources) - 4 and column < 50, sources


def test_history_and_config_keep_whole_values_when_piped(
    gpuwait_cmd: list[str], sim_file: SimFileFactory, isolated_dirs: Path
) -> None:
    sim_file(gpus=1)
    write_history(isolated_dirs / "state")
    shown = subprocess.run([*gpuwait_cmd, "history"], capture_output=True, text=True).stdout
    assert shlex.join(LONG_COMMAND) in shown
    assert "paused 1× (2.3s lost)" in shown
    config = subprocess.run([*gpuwait_cmd, "config"], capture_output=True, text=True).stdout
    never_wrap = next(line for line in config.splitlines() if line.startswith("never_wrap"))
    assert never_wrap.endswith("* -m venv *  (default)")
    safety = next(line for line in config.splitlines() if line.startswith("safety"))
    assert len(safety) < 50, safety  # not padded out to the longest value


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_estimate_fits_the_terminal(
    shell: Callable[[int, int], Terminal],
    sim_file: SimFileFactory,
    isolated_dirs: Path,
    tmp_path: Path,
    width: int,
    height: int,
) -> None:
    # At 80 columns its explanation ran past the edge, the terminal cutting "peaks 5" from
    # ".0 GiB" on the next row.
    sim_file(gpus=1)
    (tmp_path / "train.py").write_text("")
    now = time.time()
    gpu = GpuSnapshot(index=0, uuid="GPU-0", name="Sim", total_bytes=24 * GiB, used_bytes=0)
    directory = isolated_dirs / "state" / "gpuwait"
    directory.mkdir(mode=0o700, exist_ok=True)
    for n, peak in enumerate([5, 6, 7]):
        run = a_run(
            ["python3", "train.py"],
            str(tmp_path),
            now - 100 + n,
            gpus=[gpu],
            peak_by_gpu={"GPU-0": peak * GiB},
            run_seconds=3725.0 + 600 * n,
        )
        append_record(directory, run)
    term = shell(width, height)
    term.type("clear; gpuwait estimate -- python3 train.py")
    term.wait_for(lambda rows: any(r.startswith("load:") for r in rows), what="the estimate")
    lines = term.everything(joined=True)
    wide = [x for x in lines if len(x) > width]
    assert not wide, wide
    shown = " ".join(" ".join(lines).split())
    assert "95th percentile of the peaks 7.0 GiB + 10% margin, rounded up; peaks" in shown


def make_j3_waiting(
    shell: Callable[[int, int], Terminal],
    sim_file: SimFileFactory,
    procs: Callable[..., subprocess.Popen[str]],
    gpuwait_cmd: list[str],
    tmp_path: Path,
) -> tuple[Terminal, subprocess.Popen[str], list[str]]:
    """`make -j3` typed at an 80 x 24 terminal, its three recipes each a gpuwait of 20 GiB on
    the one 24 GiB card that a job holds (the holder, until it is ended): the terminal, the
    holder, and the screen once each waiter has said its line."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    sim_file(gpus=1, memory="24GiB")
    holder = procs(
        wrapped_sim_job(gpuwait_cmd, ["--vram", "20G"], "--vram", "20G", "--hold", "60s")
    )
    wait_for(lambda: asleep_supervising(holder.pid), message="the card is taken")
    (tmp_path / "Makefile").write_text(
        "all: a b c\na b c:\n\t@gpuwait --name $@ --vram 20G -- echo ran-$@\n"
    )
    term = shell(80, 24)
    term.type("make -j3")
    rows = term.wait_for(
        lambda rows: all(any(f"gpuwait[{n}]" in r for r in rows) for n in "abc"),
        what="a line from each waiter",
    )
    return term, holder, rows


def test_waiters_of_one_make_j_write_whole_lines_of_their_own(
    shell: Callable[[int, int], Terminal],
    sim_file: SimFileFactory,
    procs: Callable[..., subprocess.Popen[str]],
    gpuwait_cmd: list[str],
    tmp_path: Path,
) -> None:
    # `make -j` (or `xargs -P`, a script's loop of `&`) in the foreground: its waiters share the
    # terminal's foreground process group with each other and with the running recipes, so none
    # may redraw a line in place over another's.
    term, holder, rows = make_j3_waiting(shell, sim_file, procs, gpuwait_cmd, tmp_path)
    for row in gpuwait_rows(rows):
        assert WAIT_ROW.match(row) and row.count("gpuwait[") == 1, rows
    holder.terminate()
    term.wait_for(
        lambda rows: all(any(r == f"ran-{n}" for r in rows) for n in "abc"),
        what="every waiter's command ran, each on a line of its own",
    )


def test_waiters_of_one_make_j_stopped_with_ctrl_z_say_again_why_they_wait_once_fg_continues_them(
    shell: Callable[[int, int], Terminal],
    sim_file: SimFileFactory,
    procs: Callable[..., subprocess.Popen[str]],
    gpuwait_cmd: list[str],
    tmp_path: Path,
) -> None:
    # Ctrl-Z stops make and its waiters; below the shell's `Stopped`, its prompt and `fg`, the
    # screen stayed blank: each waiter had said its line once, and said it again only when
    # what it waits for changed (the room never changes here).
    term, holder, _ = make_j3_waiting(shell, sim_file, procs, gpuwait_cmd, tmp_path)
    term.key("C-z")
    term.wait_for(lambda rows: any("Stopped" in r for r in rows), what="the shell's Stopped")
    term.wait_idle()
    term.type("clear; fg")

    def below_fg(rows: list[str]) -> list[str]:
        # The screen cleared, `fg` says the job it continues on the first row.
        return rows if rows[:1] == ["make -j3"] else []

    rows = term.wait_for(
        lambda rows: all(any(f"gpuwait[{n}]" in r for r in below_fg(rows)) for n in "abc"),
        what="each waiter's line again below fg",
    )
    for row in gpuwait_rows(below_fg(rows)):
        assert WAIT_ROW.match(row) and row.count("gpuwait[") == 1, rows
    holder.terminate()
    term.wait_for(
        lambda rows: all(any(r == f"ran-{n}" for r in rows) for n in "abc"),
        what="every waiter's command ran, each on a line of its own",
    )


def test_status_in_a_narrow_pane_fits_without_wrapping(
    shell: Callable[[int, int], Terminal],
    sim_file: SimFileFactory,
    procs: Callable[..., subprocess.Popen[str]],
    gpuwait_cmd: list[str],
) -> None:
    # A tmux pane split in two: 60 columns. Every line stays on its row, and what matters most
    # is still there: each GPU's free room and hold, each job's name, GPU, reservation, time
    # left or ETA, the start of its command, and why a job waits, whole.
    sim_file(gpus=1, memory="24GiB")
    holder = procs([*gpuwait_cmd, "--name", "trainer", "--vram", "20G", "--", "sleep", "60"])
    wait_for(lambda: asleep_supervising(holder.pid), message="the card is taken")
    waiter = procs([*gpuwait_cmd, "--name", "evaluate", "--vram", "20G", "--", "python3", "e.py"])
    wait_for(lambda: asleep_waiting(waiter.pid), timeout=30, message="the waiter")
    term = shell(60, 40)
    term.type("clear; gpuwait status")
    term.wait_for(lambda rows: any(r.startswith("Queue (1)") for r in rows), what="the report")
    term.wait_idle()
    lines = term.everything(joined=True)
    assert not [x for x in lines if len(x) > 60], lines
    gpu = next(x for x in lines if re.match(r" +0 ", x))
    assert "1.6G" in gpu and "held for" in gpu, lines
    running = next(x for x in lines if " trainer " in x)
    assert "20.0G" in running and "sleep 60" in running, lines
    queued = next(x for x in lines if " evaluate " in x)
    assert "20.0G" in queued and "python3 e.py" in queued, lines
    reason = " ".join(x.strip() for x in lines[lines.index(queued) + 1 :] if x.startswith("   "))
    assert "waiting for 20.0 GiB" in reason and "ahead of you)" in reason, lines


def test_idle_in_a_narrow_pane_fits_without_wrapping(
    shell: Callable[[int, int], Terminal],
    sim_file: SimFileFactory,
    run_gpuwait: Run,
    sim_jobs: list[subprocess.Popen[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # `gpuwait idle` in a pane of 60 columns, as `status` there: it kept lines of 80 columns,
    # which the terminal wrapped, its heading and its table's rows broken in two.
    sim_file(gpus=1, utilization=[0])
    monkeypatch.setenv("GPUWAIT_IDLE_AFTER", "1ms")
    forgotten = start_sim_job("--vram", "3G", "--hold", "60s", env={"CUDA_VISIBLE_DEVICES": "0"})
    sim_jobs.append(forgotten)
    # Each reading adds to the evidence: the first finds it quiet, a later one names it.
    wait_for(lambda: f" {forgotten.pid} " in run_gpuwait("idle").stdout, timeout=30)
    term = shell(60, 24)
    term.type("clear; gpuwait idle")
    term.wait_for(lambda rows: any(f" {forgotten.pid} " in r for r in rows), what="the list")
    term.wait_idle()
    lines = term.everything(joined=True)
    assert not [x for x in lines if len(x) > 60], lines
    heading = " ".join(lines[lines.index(next(x for x in lines if "Idle VRAM" in x)) :][:2])
    assert "Idle VRAM holders (1; at least 1.0 GiB on a GPU" in heading, lines
    row = next(x for x in lines if f" {forgotten.pid} " in x)
    assert "3.0G" in row and "python" in row, lines


def test_the_retry_oom_example_typed_at_a_terminal_is_retried(
    terminal: Callable[..., Terminal], sim_file: SimFileFactory, tmp_path: Path
) -> None:
    """docs/learning.md's `--retry-oom` example, typed at a terminal as it is written: its
    simulated job dies at its own 2 GiB limit (the PyTorch cap, which gpuwait, a Python
    program, hands it) within half a second, and is queued again with 3 GiB, as the page
    says."""
    (line,) = [
        b.text.strip()
        for b in docs.blocks(REPO / "docs" / "learning.md")
        if b.language == docs.SHELL and "--retry-oom 1 " in b.text
    ]
    sim_file(gpus=1, memory="24GiB")
    # gpuwait as pip installs it: a Python program, whose commands the PyTorch cap can hold.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gpuwait").write_text(f"#!{sys.executable}\n{CONSOLE_SCRIPT}\n")
    (bin_dir / "gpuwait").chmod(0o755)
    term = terminal(80, 24, env_with_bin(bin_dir))
    term.type(line)
    term.wait_idle()
    said = " ".join(term.everything(joined=True))
    assert "only hinted" not in said, said
    assert "ran out at its own 2.0 GiB limit; retrying with 3.0 GiB (retry 1 of 1)" in said, said
