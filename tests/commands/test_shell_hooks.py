"""The shell hooks of `gpuwait shell-init`, in real bash, zsh and fish, against simulated GPUs."""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import venv
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO
from helpers.shellbin import env_with_bin, make_bin

from gpuwait.core.policy import PICK_STRATEGIES
from gpuwait.core.wrap import decide

SHELLS = ["bash", "zsh", "fish"]

PROBE = """\
import json, os, sys
print(json.dumps({
    "argv": sys.argv[1:],
    "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "job": os.environ.get("GPUWAIT_JOB_ID"),
}))
"""

#: Arguments a shell must hand over untouched: spaces, quotes, globs, empty ones, and more.
TRICKY_ARGS = [
    "a b",
    "",
    "*",
    "?",
    "\"double\" 'single'",
    "$HOME",
    "`echo no`",
    "back\\slash",
    "two\nlines",
    "--vram",
    "-c",
    "--",
    "ünï",
    "   ",
]


def need(shell: str) -> str:
    path = shutil.which(shell)
    if path is None:
        pytest.skip(f"{shell} is not installed (.ci/run installs it with apt-get)")
    return path


def init_line(shell: str, *options: str) -> str:
    """The line a user puts in their rc file, as the shell's own code."""
    opts = " ".join(options)
    if shell == "fish":
        return f"gpuwait shell-init fish {opts} | source"
    return f'eval "$(gpuwait shell-init {shell} {opts})"'


def run_shell(
    shell: str, script: str, args: list[str], env: dict[str, str], **kw: Any
) -> subprocess.CompletedProcess[str]:
    """Run `script` non-interactively with `args` as its positional parameters ($@ / $argv)."""
    need(shell)
    if shell == "fish":
        argv = ["fish", "--no-config", "-c", script, *args]
    elif shell == "zsh":
        argv = ["zsh", "-f", "-c", script, "zsh", *args]
    else:
        argv = ["bash", "--norc", "--noprofile", "-c", script, "bash", *args]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, **kw)


def all_args(shell: str) -> str:
    return "$argv" if shell == "fish" else '"$@"'


def status_var(shell: str) -> str:
    return "$status" if shell == "fish" else "$?"


@pytest.fixture
def hook_env(tmp_path: Path, sim_file: Any) -> dict[str, str]:
    """Two simulated 24 GiB GPUs, gpuwait and python on PATH, wrapped jobs asking for 1 GiB."""
    sim_file(gpus=2)
    env = env_with_bin(make_bin(tmp_path / "bin"))
    env["GPUWAIT_DEFAULT_VRAM"] = "1G"
    (tmp_path / "probe.py").write_text(PROBE)
    return env


def sim_uuids() -> list[str]:
    from gpuwait.gpu.sim import SimBackend

    return [g.uuid for g in SimBackend(os.environ["GPUWAIT_SIM"]).snapshot().gpus]


def probe_lines(output: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in output.splitlines() if line.startswith("{")]


def full_gpus(hook_env: dict[str, str], sim_file: Any) -> dict[str, str]:
    """hook_env on GPUs that stay full, a wrapped command giving up its wait after a fifth of
    a second: one that waited ends 124, where a program's own failure comes at once."""
    sim_file(gpus=2, base_used="23GiB")
    return {**hook_env, "GPUWAIT_TIMEOUT": "0.2s"}


def stand_ins(tmp_path: Path, text: str, *names: str) -> None:
    """Programs named `names` on hook_env's PATH, each `text` with {name} its name."""
    for name in names:
        path = tmp_path / "bin" / name
        path.write_text(text.format(name=name))
        path.chmod(0o755)


def statuses(
    shell: str, lines: list[str], env: dict[str, str], cwd: Path
) -> tuple[list[str], subprocess.CompletedProcess[str]]:
    """Runs `lines` in `shell`, its hook on, each followed by `echo "status=(STATUS)"`: the
    exit statuses echoed, in order, and the run."""
    status = status_var(shell)
    script = init_line(shell, "--always") + "\n"
    script += "".join(f'{line}\necho "status=({status})"\n' for line in lines)
    done = run_shell(shell, script, [], env, cwd=cwd)
    return re.findall(r"status=\((\d+)\)", done.stdout), done


def explain(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """`gpuwait shell-hook --explain -- ARGV`."""
    return subprocess.run(
        ["gpuwait", "shell-hook", "--explain", "--", *argv],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.mark.parametrize("shell", SHELLS)
def test_wrapped_python_runs_on_a_gpu_with_its_arguments_intact(
    shell: str, hook_env: dict[str, str], tmp_path: Path
) -> None:
    script = (
        f"{init_line(shell, '--always')}\n"
        f"python probe.py {all_args(shell)}\n"
        f"command python probe.py {all_args(shell)}\n"
    )
    done = run_shell(shell, script, TRICKY_ARGS, hook_env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    wrapped, bare = probe_lines(done.stdout)
    assert wrapped["argv"] == TRICKY_ARGS
    assert wrapped["cuda"] in sim_uuids() and wrapped["job"]
    # `command python` is the escape hatch: the bare program, same arguments.
    assert bare == {"argv": TRICKY_ARGS, "cuda": None, "job": None}


@pytest.mark.parametrize("shell", SHELLS)
def test_globs_and_quoting_typed_in_the_shell_reach_the_program_as_bare(
    shell: str, hook_env: dict[str, str], tmp_path: Path
) -> None:
    for name in ("b.txt", "a.txt", "with space.txt"):
        (tmp_path / name).write_text("")
    line = "probe.py *.txt 'it''s' \"x y\" '' a\\ b"
    if shell == "fish":
        line = "probe.py *.txt 'it\\'s' \"x y\" '' a\\ b"
    script = f"{init_line(shell, '--always')}\npython {line}\ncommand python {line}\n"
    done = run_shell(shell, script, [], hook_env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    wrapped, bare = probe_lines(done.stdout)
    assert wrapped["argv"] == bare["argv"]
    assert wrapped["argv"][:3] == ["a.txt", "b.txt", "with space.txt"]
    assert wrapped["cuda"] in sim_uuids() and bare["cuda"] is None


@pytest.mark.parametrize("shell", SHELLS)
def test_exit_status_stdin_and_pipes_are_the_commands_own(
    shell: str, hook_env: dict[str, str], tmp_path: Path
) -> None:
    status = status_var(shell)
    script = f"""{init_line(shell, "--always")}
python -c 'import sys; sys.exit(7)'
echo "status=({status})"
python -c 'import os; os.kill(os.getpid(), 15)'
echo "signal=({status})"
printf 'one\\ntwo\\n' | python -c 'import sys; print(sys.stdin.read().upper(), end="")' | tr O 0
python3 -c 'import os; print("CUDA", os.environ["CUDA_VISIBLE_DEVICES"][:4])'
"""
    done = run_shell(shell, script, [], hook_env, cwd=tmp_path)
    assert "status=(7)" in done.stdout, done.stderr
    assert "signal=(143)" in done.stdout
    assert "\n0NE\nTW0\n" in done.stdout
    assert "CUDA GPU-" in done.stdout


def test_a_failing_wrapped_command_runs_the_shells_error_trap_once_for_its_line(
    hook_env: dict[str, str], tmp_path: Path
) -> None:
    # `set -E` (errtrace) and an ERR trap that names the failing line, as in many scripts and
    # some prompts: bash ran the trap in the hook's functions too, three times, at their lines.
    script = f"""{init_line("bash", "--always")}
set -E; trap 'echo "trap $? line $LINENO"' ERR
python -c 'import sys; sys.exit(3)'
echo "status=$?"
(set -e; python -c 'import sys; sys.exit(4)'; echo "not after set -e")
echo "subshell=$?"
"""
    done = run_shell("bash", script, [], hook_env, cwd=tmp_path)
    bare = run_shell("bash", script.replace("python -c", "command python -c"), [], hook_env)
    assert bare.stdout == "trap 3 line 3\nstatus=3\ntrap 4 line 5\ntrap 4 line 5\nsubshell=4\n"
    assert done.stdout == bare.stdout, done.stderr


@pytest.mark.parametrize("shell", SHELLS)
def test_disable_variable_runs_bare(shell: str, hook_env: dict[str, str], tmp_path: Path) -> None:
    script = f"{init_line(shell, '--always')}\npython probe.py x\n"
    done = run_shell(shell, script, [], {**hook_env, "GPUWAIT_DISABLE": "1"}, cwd=tmp_path)
    assert probe_lines(done.stdout) == [{"argv": ["x"], "cuda": None, "job": None}], done.stderr
    done = run_shell(shell, script, [], {**hook_env, "GPUWAIT_DISABLE": "0"}, cwd=tmp_path)
    assert probe_lines(done.stdout)[0]["cuda"] in sim_uuids(), done.stderr


@pytest.mark.parametrize("shell", SHELLS)
def test_exec_python_is_wrapped_where_the_shell_runs_the_function(
    shell: str, hook_env: dict[str, str], tmp_path: Path
) -> None:
    # bash's and fish's `exec` run the program named, past the function: bare. zsh's runs the
    # function, as it runs one for `noglob python`: the job waits and runs as `python` does.
    script = f"{init_line(shell, '--always')}\nexec python probe.py x\n"
    done = run_shell(shell, script, [], hook_env, cwd=tmp_path)
    [probe] = probe_lines(done.stdout)
    assert probe["argv"] == ["x"], done.stderr
    assert (probe["job"] is not None) == (shell == "zsh"), done.stderr


@pytest.mark.parametrize("shell", SHELLS)
def test_explain_says_what_the_hook_does_with_a_padded_disable_value(
    shell: str, hook_env: dict[str, str], tmp_path: Path
) -> None:
    # The hooks read " 0" as set (not empty, not 0) and run bare: --explain must say the same.
    script = f"{init_line(shell, '--always')}\npython probe.py x\n"
    env = {**hook_env, "GPUWAIT_DISABLE": " 0"}
    done = run_shell(shell, script, [], env, cwd=tmp_path)
    assert probe_lines(done.stdout) == [{"argv": ["x"], "cuda": None, "job": None}], done.stderr
    said = explain(["python", "probe.py"], env, tmp_path)
    assert said.returncode == 1, said.stdout + said.stderr
    assert "GPUWAIT_DISABLE" in said.stdout + said.stderr


@pytest.mark.parametrize("shell", SHELLS)
def test_non_interactive_shells_are_untouched_without_always(
    shell: str, hook_env: dict[str, str], tmp_path: Path
) -> None:
    script = f"{init_line(shell)}\npython probe.py x\n"
    done = run_shell(shell, script, [], hook_env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert probe_lines(done.stdout) == [{"argv": ["x"], "cuda": None, "job": None}]


@pytest.mark.parametrize("shell", SHELLS)
def test_a_mistyped_script_fails_at_once_without_waiting_for_a_gpu(
    shell: str, hook_env: dict[str, str], tmp_path: Path, sim_file: Any
) -> None:
    # `python trian.py` on busy GPUs waited for a GPU (hours, on a shared server) before python
    # said it could not open the file.
    # A fifth of a second tells a wait apart from python's own 2 as well as five, and the last
    # run, whose script is there, waits it out.
    env = full_gpus(hook_env, sim_file)
    lines = ["python trian.py --lr 0.1", "python -u ./nowhere/train.py"]
    _, done = statuses(shell, lines, env, tmp_path)
    assert done.stdout.count("status=(2)") == 2, done.stdout + done.stderr
    assert "can't open file" in done.stderr and "trian.py" in done.stderr
    assert "waiting" not in done.stderr, done.stderr
    bare = explain(["python", "trian.py"], env, tmp_path)
    assert bare.returncode == 1
    assert bare.stdout == f"bare: no script {tmp_path / 'trian.py'}: python says so at once\n"
    (tmp_path / "trian.py").write_text("")
    _, done = statuses(shell, lines, env, tmp_path)
    assert "status=(124)" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize("shell", SHELLS)
def test_a_command_typed_with_no_gpu_visible_runs_bare_on_the_cpu(
    shell: str, hook_env: dict[str, str], tmp_path: Path, sim_file: Any
) -> None:
    # `CUDA_VISIBLE_DEVICES= python prep.py` (or =-1), CUDA's way to run on the CPU, was
    # refused by the hook: "makes no GPU visible to this command", exit 3, nothing run.
    env = full_gpus(hook_env, sim_file)
    lines = ["CUDA_VISIBLE_DEVICES= python3 probe.py", "CUDA_VISIBLE_DEVICES=-1 python probe.py"]
    _, done = statuses(shell, lines, env, tmp_path)
    assert done.stdout.count("status=(0)") == 2, done.stdout + done.stderr
    ran = probe_lines(done.stdout)
    assert [(r["cuda"], r["job"]) for r in ran] == [("", None), ("-1", None)], done.stdout
    assert done.stderr == "", done.stderr
    bare = explain(["python", "probe.py"], {**env, "CUDA_VISIBLE_DEVICES": "-1"}, tmp_path)
    assert bare.returncode == 1
    assert bare.stdout == (
        "bare: CUDA_VISIBLE_DEVICES='-1' hides every GPU: the command runs on the CPU\n"
    )


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_a_word_cuda_reads_as_no_gpu_runs_bare_where_a_mistyped_index_is_refused(
    shell: str, hook_env: dict[str, str], tmp_path: Path, sim_file: Any
) -> None:
    # `CUDA_VISIBLE_DEVICES=none python prep.py` (or NoDevFiles, as some batch systems set),
    # where CUDA sees no GPU at all, was wrapped, and gpuwait ended 3 "makes no GPU visible":
    # the command never ran. A mistyped index (`=7` on two GPUs) is still refused.
    env = full_gpus(hook_env, sim_file)
    lines = [
        "CUDA_VISIBLE_DEVICES=none python probe.py",
        "CUDA_VISIBLE_DEVICES=NoDevFiles python3 probe.py",
        "CUDA_VISIBLE_DEVICES=7 python probe.py",
    ]
    codes, done = statuses(shell, lines, env, tmp_path)
    assert codes == ["0", "0", "3"], done.stdout + done.stderr
    ran = probe_lines(done.stdout)
    assert [(r["cuda"], r["job"]) for r in ran] == [("none", None), ("NoDevFiles", None)]
    assert "CUDA_VISIBLE_DEVICES='7' makes no GPU visible" in done.stderr, done.stderr
    bare = explain(["python", "probe.py"], {**env, "CUDA_VISIBLE_DEVICES": "none"}, tmp_path)
    assert bare.stdout == (
        "bare: CUDA_VISIBLE_DEVICES='none' hides every GPU: the command runs on the CPU\n"
    )


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_a_bad_setting_leaves_the_lines_the_hook_runs_bare_alone(
    shell: str, hook_env: dict[str, str], tmp_path: Path
) -> None:
    # With `export GPUWAIT_SIM=sim.toml` (a relative path, refused) or a malformed value in the
    # config file, every hooked line ended 2 with the setting's error, `python --version` and
    # `CUDA_VISIBLE_DEVICES= python prep.py`, which the hook runs bare, among them.
    bad_config = tmp_path / "bad.toml"
    bad_config.write_text('nvml_interval = "soon"\n')
    bare_lines = [
        "python --version",
        "CUDA_VISIBLE_DEVICES= python3 probe.py cpu",
        "GPUWAIT_DISABLE=1 python probe.py disabled",
    ]
    for setting, named in (
        ("GPUWAIT_SIM=sim.toml", "GPUWAIT_SIM"),
        (f"GPUWAIT_CONFIG={bad_config}", "nvml_interval"),
        # A home that nobody has: every hooked line ended in a traceback.
        ("GPUWAIT_CONFIG='~gpuwait-no-such-user/config.toml'", "home directory is not known"),
    ):
        lines = [f"export {setting}", *bare_lines, "python probe.py gpu"]
        codes, done = statuses(shell, lines, hook_env, tmp_path)
        assert codes == ["0", "0", "0", "0", "2"], setting + done.stdout + done.stderr
        assert "Python 3" in done.stdout + done.stderr
        ran = probe_lines(done.stdout)
        assert [(r["argv"], r["job"]) for r in ran] == [(["cpu"], None), (["disabled"], None)]
        # The line gpuwait would have run says what to fix, once, and runs nothing.
        assert done.stderr.count("gpuwait: error:") == 1, done.stderr
        assert named in done.stderr, done.stderr
    told = explain(["python", "--version"], {**hook_env, "GPUWAIT_SIM": "sim.toml"}, tmp_path)
    assert (told.returncode, told.stderr) == (1, ""), told.stderr
    assert told.stdout == "bare: the command line matches never_wrap '* --version'\n"


@pytest.mark.parametrize("shell", ["bash", "fish"])
def test_a_bad_setting_leaves_the_lines_the_users_own_rules_run_bare_alone(
    shell: str, hook_env: dict[str, str], tmp_path: Path
) -> None:
    # A config file with wrap_only_in = ["~/ml"] and never_wrap = ["* --dry-run*"], and a
    # malformed value of another setting (or one spelt wrong): `python probe.py` outside ml,
    # and `python probe.py --dry-run` in it, which those rules run bare, ended 2 with the
    # setting's error, the built-in rules standing in for the user's. They now run, as the
    # user's rules say; a line in ml still ends 2, naming what to fix.
    inside = tmp_path / "ml"
    inside.mkdir()
    (inside / "probe.py").write_text(PROBE)
    rules = f'wrap_only_in = ["{inside}"]\nnever_wrap = ["* --dry-run*"]\n'
    lines = [
        "python probe.py outside",
        "cd ml",
        "python probe.py --dry-run",
        "python probe.py inside",
    ]
    for bad, named in (
        ('nvml_interval = "soon"\n', "nvml_interval"),
        ('defualt_vram = "8G"\n', "defualt_vram"),
    ):
        config = tmp_path / "config.toml"
        config.write_text(rules + bad)
        env = {**hook_env, "GPUWAIT_CONFIG": str(config)}
        codes, done = statuses(shell, lines, env, tmp_path)
        assert codes == ["0", "0", "0", "2"], bad + done.stdout + done.stderr
        ran = probe_lines(done.stdout)
        assert [(r["argv"], r["job"]) for r in ran] == [
            (["outside"], None),
            (["--dry-run"], None),
        ], done.stdout + done.stderr
        assert done.stderr.count("gpuwait: error:") == 1, done.stderr
        assert named in done.stderr, done.stderr
    # A file that is no TOML tells no rule of the user's: a line is refused where the rules
    # that hold whichever settings do would wrap it, naming the file.
    config.write_text(rules + "nvml_interval = \n")
    codes, done = statuses(shell, lines[:1], env, tmp_path)
    assert codes == ["2"], done.stdout + done.stderr
    assert str(config) in done.stderr, done.stderr


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_a_shell_started_with_a_bad_setting_is_hooked_all_the_same(
    shell: str, hook_env: dict[str, str], tmp_path: Path
) -> None:
    # A shell whose rc file exports GPUWAIT_SIM=sim.toml (refused: a relative path) before
    # the hook's line said the error once as it started, and had no hook: `python train.py`
    # ran bare from then on, on GPUs other jobs held, with nothing more said.
    env = {**hook_env, "GPUWAIT_SIM": "sim.toml"}
    codes, done = statuses(shell, ["python --version", "python probe.py gpu"], env, tmp_path)
    assert codes == ["0", "2"], done.stdout + done.stderr
    assert probe_lines(done.stdout) == [], done.stdout
    said = done.stderr.splitlines()
    assert said[0].startswith("gpuwait: warning: environment GPUWAIT_SIM: "), done.stderr
    assert said[-1].startswith("gpuwait: error: environment GPUWAIT_SIM: "), done.stderr


@pytest.mark.parametrize("shell", SHELLS)
def test_accelerates_setup_commands_run_bare(
    shell: str, hook_env: dict[str, str], tmp_path: Path, sim_file: Any
) -> None:
    # `accelerate config` (its questions) and `accelerate env` (what to paste in a bug report)
    # waited for a whole free GPU, hours on a busy server, to use none.
    env = full_gpus(hook_env, sim_file)
    stand_ins(tmp_path, '#!/bin/sh\necho "{name} $1 ran"\n', "accelerate")
    lines = [
        "accelerate config",
        "accelerate env",
        "accelerate config default --mixed_precision fp16",
        "accelerate launch probe.py",
    ]
    _, done = statuses(shell, lines, env, tmp_path)
    assert done.stdout.count("status=(0)") == 3, done.stdout + done.stderr
    assert done.stdout.count("accelerate config ran") == 2, done.stdout
    assert "accelerate env ran" in done.stdout
    assert "status=(124)" in done.stdout  # launch still waits for its GPU


@pytest.mark.parametrize("shell", SHELLS)
def test_a_launchers_mistyped_script_fails_at_once_without_waiting_for_a_gpu(
    shell: str, hook_env: dict[str, str], tmp_path: Path, sim_file: Any
) -> None:
    # `torchrun --nproc_per_node 2 trian.py` waited for its GPU (hours, on a busy server)
    # before its workers said they could not open the file, where `python trian.py` fails at
    # once.
    env = full_gpus(hook_env, sim_file)
    stand_ins(
        tmp_path, '#!/bin/sh\necho "{name} ran"\nexit 1\n', "torchrun", "accelerate", "deepspeed"
    )
    lines = [
        "torchrun --nproc_per_node 2 trian.py --lr 0.1",
        "accelerate launch --num_processes 2 trian.py",
        "deepspeed --num_gpus 1 ./nowhere/train.py",
        "torchrun --nproc_per_node 2 probe.py",
        "accelerate launch probe.py",
    ]
    said, done = statuses(shell, lines, env, tmp_path)
    assert said == ["1", "1", "1", "124", "124"], done.stdout + done.stderr
    bare = explain(["torchrun", "trian.py"], env, tmp_path)
    assert bare.returncode == 1
    assert bare.stdout == f"bare: no script {tmp_path / 'trian.py'}: torchrun says so at once\n"


def test_a_script_reached_through_a_link_and_dotdot_is_wrapped(
    hook_env: dict[str, str], tmp_path: Path
) -> None:
    # `python runs/../probe.py`, runs a link to a folder elsewhere: python opens probe.py
    # beside the folder the link points to, as the kernel follows the link before the `..`.
    # The hook looked for it beside the link instead, found none there and ran the job bare,
    # on GPUs other jobs had reserved, saying "no script .../probe.py: python says so at once".
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "runs").mkdir(parents=True)
    (elsewhere / "probe.py").write_text(PROBE)
    (tmp_path / "runs").symlink_to(elsewhere / "runs")
    (tmp_path / "probe.py").unlink()
    for argv in (["python", "runs/../probe.py"], ["torchrun", "runs/../probe.py"]):
        said = explain(argv, hook_env, tmp_path)
        assert said.stdout == "wrap: no rule says otherwise\n", said.stdout + said.stderr
    (elsewhere / "probe.py").rename(tmp_path / "probe.py")
    said = explain(["python", "runs/../probe.py"], hook_env, tmp_path)
    assert said.stdout.startswith("bare: no script "), said.stdout + said.stderr


@pytest.mark.parametrize("shell", SHELLS)
def test_explain_reads_a_lines_assignments_as_the_shell_does(
    shell: str, hook_env: dict[str, str], tmp_path: Path
) -> None:
    # `shell-hook --explain -- GPUWAIT_DEFAULT_VRAM=8G python train.py`, the documented line
    # pasted after --, said "bare: GPUWAIT_DEFAULT_VRAM=8G is not in wrap_commands", where the
    # shell runs it wrapped; `GPUWAIT_DISABLE=1 python` was said bare for that same reason.
    lines = {
        "GPUWAIT_DEFAULT_VRAM=2G python3 probe.py": "wrap: no rule says otherwise",
        "time GPUWAIT_DEFAULT_VRAM=2G python3 probe.py": "wrap: no rule says otherwise",
        "GPUWAIT_DISABLE=1 python3 probe.py": "bare: GPUWAIT_DISABLE is set",
        "A=1 GPUWAIT_NEVER_WRAP='* probe.py' python3 probe.py": (
            "bare: the command line matches never_wrap '* probe.py'"
        ),
    }
    script = init_line(shell, "--always") + "\n"
    for line in lines:
        script += f"{line}\ngpuwait shell-hook --explain -- {line}\n"
    done = run_shell(shell, script, [], hook_env, cwd=tmp_path)
    ran = probe_lines(done.stdout)
    explained = [line for line in done.stdout.splitlines() if not line.startswith("{")]
    assert explained == list(lines.values()), done.stdout + done.stderr
    # And as the shell ran each: wrapped where the explanation says so.
    assert [r["job"] is not None for r in ran] == [True, True, False, False], done.stdout


@pytest.mark.parametrize("shell", SHELLS)
def test_a_launcher_modules_mistyped_script_fails_at_once_without_waiting_for_a_gpu(
    shell: str, hook_env: dict[str, str], tmp_path: Path, sim_file: Any
) -> None:
    # `python -m torch.distributed.run --nproc_per_node 2 trian.py`, torchrun by its module,
    # waited for its GPU before its workers could not open the file, as torchrun did.
    env = full_gpus(hook_env, sim_file)
    run = tmp_path / "torch" / "distributed" / "run.py"
    run.parent.mkdir(parents=True)
    for package in (run.parent, run.parent.parent):
        (package / "__init__.py").write_text("")
    run.write_text("import sys\nprint('run ran', sys.argv[1:])\nsys.exit(1)\n")
    lines = [
        "python3 -m torch.distributed.run --nproc_per_node 2 trian.py",
        "python3 -m torch.distributed.launch --use-env trian.py",
        "python3 -m torch.distributed.run --nproc_per_node 2 probe.py",
    ]
    said, done = statuses(shell, lines, env, tmp_path)
    assert said[0] == "1" and said[2] == "124", done.stdout + done.stderr
    assert said[1] != "124", done.stdout + done.stderr  # no such module here: python's own 1


@pytest.mark.parametrize("shell", SHELLS)
def test_a_wrapped_command_that_waits_says_how_to_run_it_without_a_gpu(
    shell: str, hook_env: dict[str, str], tmp_path: Path, sim_file: Any
) -> None:
    # A typed `python` (its prompt, `python -m pytest`) that waited for a GPU showed only the
    # wait line: nothing said that the hook was at work, nor how to go without it.
    env = full_gpus(hook_env, sim_file)  # said as the wait begins
    script = f"""{init_line(shell, "--always")}
python3 probe.py
gpuwait -- python probe.py
"""
    done = run_shell(shell, script, [], env, cwd=tmp_path)
    # It says for how much, and why that much: on a terminal 80 columns wide the wait line
    # below it has no room for the why (`waiting for a whole GPU: best GPU0 has 0 B (0 ahead)`),
    # and a new user's first `python train.py` waited for a whole GPU with nothing saying why.
    said = (
        "gpuwait: python3 waits for 1.0 GiB (no earlier runs of this command: default_vram;"
        " shell hook: `command python3` skips it)\n"
    )
    assert said in done.stderr, done.stderr
    assert done.stderr.count("shell hook") == 1, done.stderr


@pytest.mark.parametrize("shell", ["zsh", "fish"])
def test_a_hooked_first_wait_for_a_whole_gpu_says_how_the_line_asks_for_less(
    shell: str, hook_env: dict[str, str], tmp_path: Path, sim_file: Any, terminal: Any
) -> None:
    # A new script typed through the hook waits for the whole GPU default_vram asks for. Its
    # wait line said "--vram asks for less", an option the typed line has no place for:
    # `python train.py --vram 6G` gives it to the script, and the wait goes on for a whole GPU.
    need(shell)
    sim_file(gpus=2, base_used="3GiB")
    env = {**hook_env, "GPUWAIT_NVML_INTERVAL": "0.1s"}
    del env["GPUWAIT_DEFAULT_VRAM"]
    term = terminal(80, 24, env)
    term.type(f"{shell} {'--no-config' if shell == 'fish' else '-f'}")
    term.type(init_line(shell))
    term.type("python probe.py")
    rows = term.wait_for(
        lambda rows: any(r.startswith("gpuwait[") and "waiting for" in r for r in rows),
        what="the wait line",
    )
    (shown,) = [r for r in rows if r.startswith("gpuwait[")]
    assert "--vram" not in shown and "GPUWAIT_DEFAULT_VRAM" in shown, rows
    assert len(shown) < 80, shown
    term.key("C-c")
    # In full, where stderr is no terminal.
    done = run_shell(
        shell,
        f"{init_line(shell, '--always')}\npython probe.py",
        [],
        {**env, "GPUWAIT_TIMEOUT": "0.5s"},
        cwd=tmp_path,
    )
    assert "GPUWAIT_DEFAULT_VRAM=SIZE asks for less" in done.stderr, done.stderr
    assert "--vram" not in done.stderr, done.stderr


def test_status_says_of_a_hooked_wait_for_a_whole_gpu_what_its_wait_line_says(
    hook_env: dict[str, str], tmp_path: Path, sim_file: Any, procs: Any
) -> None:
    # The wait line of a line the hook runs names GPUWAIT_DEFAULT_VRAM, the option it has no
    # place for being the script's; `gpuwait status` said "--vram SIZE asks for less" of it.
    sim_file(gpus=2, base_used="3GiB")
    env = {k: v for k, v in hook_env.items() if k != "GPUWAIT_DEFAULT_VRAM"}
    script = f"{init_line('bash', '--always')}\npython probe.py"
    procs(["bash", "--norc", "--noprofile", "-c", script], env=env, cwd=tmp_path)

    def waiting_reason() -> str | None:
        done = subprocess.run(
            ["gpuwait", "status", "--json"], env=env, capture_output=True, text=True, timeout=30
        )
        jobs = json.loads(done.stdout)["jobs"] if done.returncode == 0 else []
        reasons = [j["waiting_reason"] for j in jobs if j["waiting_reason"]]
        return reasons[0] if reasons else None

    deadline = time.monotonic() + 30
    while (reason := waiting_reason()) is None:
        assert time.monotonic() < deadline, "the hooked line never waited"
        time.sleep(0.2)
    assert "GPUWAIT_DEFAULT_VRAM=SIZE asks for less" in reason, reason
    assert "--vram" not in reason, reason
    shown = subprocess.run(["gpuwait", "status"], env=env, capture_output=True, text=True)
    assert "GPUWAIT_DEFAULT_VRAM=SIZE asks for less" in shown.stdout, shown.stdout
    assert "--vram" not in shown.stdout, shown.stdout


@pytest.mark.parametrize("shell", SHELLS)
def test_no_gpuwait_inside_gpuwait(shell: str, hook_env: dict[str, str], tmp_path: Path) -> None:
    """A wrapped job that starts a shell with the hook, which runs python: one job, not two."""
    inner = f"{init_line(shell, '--always')}\npython probe.py inner\n"
    shell_argv = {
        "bash": ["bash", "--norc", "-c", inner],
        "zsh": ["zsh", "-f", "-c", inner],
        "fish": ["fish", "--no-config", "-c", inner],
    }[shell]
    (tmp_path / "outer.py").write_text(
        "import os, subprocess, sys\n"
        "print('outer', os.environ['GPUWAIT_JOB_ID'], flush=True)\n"
        f"sys.exit(subprocess.call({shell_argv!r}))\n"
    )
    need(shell)
    script = f"{init_line(shell, '--always')}\npython outer.py\n"
    done = run_shell(shell, script, [], hook_env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    outer_job = done.stdout.split()[1]
    (nested,) = probe_lines(done.stdout)
    assert nested["job"] == outer_job and nested["argv"] == ["inner"]
    history = Path(hook_env["XDG_STATE_HOME"]) / "gpuwait" / "history.jsonl"
    assert len(history.read_text().splitlines()) == 1


@pytest.mark.parametrize("shell", SHELLS)
def test_a_shell_that_outlived_its_job_wraps_again(
    shell: str, hook_env: dict[str, str], tmp_path: Path
) -> None:
    """A shell in a tmux server started inside a job keeps the job's variables after the job
    has ended: its python went on running bare, on the ended job's GPU, beside whoever gpuwait
    had put there since. While the job runs, it runs bare inside it as before."""
    need(shell)
    gone = subprocess.Popen(["true"])
    gone.wait()
    inherited = {
        "GPUWAIT_JOB_ID": "0a1b2c3d",
        "GPUWAIT_GPU_UUIDS": "GPU-of-the-ended-job",
        "CUDA_VISIBLE_DEVICES": "GPU-of-the-ended-job",
    }
    script = f"{init_line(shell, '--always')}\npython probe.py x\n"
    outcomes = []
    for job_pid in (gone.pid, os.getpid()):
        env = {**hook_env, **inherited, "GPUWAIT_JOB_PID": str(job_pid)}
        done = run_shell(shell, script, [], env, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        outcomes.extend(probe_lines(done.stdout))
    after, during = outcomes
    assert after["cuda"] in sim_uuids() and after["job"] not in (None, "0a1b2c3d")
    assert during == {"argv": ["x"], "cuda": "GPU-of-the-ended-job", "job": "0a1b2c3d"}


@pytest.mark.parametrize("shell", SHELLS)
def test_a_shell_that_outlived_its_job_wraps_again_once_its_pid_is_another_process(
    shell: str, hook_env: dict[str, str], tmp_path: Path
) -> None:
    """The pid of an ended job's gpuwait, given since to another process (a shared server's
    pids come round again, and a colleague can fork until one does): a shell that outlived
    the job took it for the job still running, and ran its python bare on the ended job's GPU,
    beside whoever gpuwait had put there since. Inside the job itself it runs bare as before."""
    need(shell)
    saved = tmp_path / "job.env"
    dump = f"{sys.executable} -c 'import json, os; print(json.dumps(dict(os.environ)))' > {saved}"
    inside = f"{init_line(shell, '--always')}\npython probe.py during\n{dump}\n"
    job = ["gpuwait", "--vram", "1G", "--", shell, "-c", inside]
    if shell == "bash":
        job[4:5] = ["bash", "--norc", "--noprofile"]
    done = subprocess.run(
        job, env=hook_env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    (during,) = probe_lines(done.stdout)
    assert during["argv"] == ["during"] and during["job"]
    kept: dict[str, str] = json.loads(saved.read_text())
    assert kept["GPUWAIT_JOB_ID"] == during["job"]
    # The job has ended; its gpuwait's pid now names another process of this user's.
    kept["GPUWAIT_JOB_PID"] = str(os.getpid())
    after = run_shell(
        shell, f"{init_line(shell, '--always')}\npython probe.py after\n", [], kept, cwd=tmp_path
    )
    assert after.returncode == 0, after.stderr
    (wrapped,) = probe_lines(after.stdout)
    assert wrapped["job"] not in (None, during["job"]), wrapped
    assert wrapped["cuda"] in sim_uuids()


@pytest.mark.parametrize("before", ["GPUWAIT_JOB_PID", "GPUWAIT_JOB_START"])
@pytest.mark.parametrize("shell", SHELLS)
def test_a_shell_in_a_job_an_older_gpuwait_runs_from_one_that_outlived_a_job_runs_bare(
    shell: str, before: str, hook_env: dict[str, str], tmp_path: Path
) -> None:
    """A tmux session opened inside a job that has ended keeps its variables; from it, an
    older gpuwait (a venv's own copy, from before it set `before`) runs a job, and passes the
    ended job's variable on beside those it sets. The job's shell, its hook newer, took the job
    for ended and wrapped its python again: a second job inside the first, on GPUs chosen
    anew, waiting for room its own job held where there was no more. It runs bare inside."""
    need(shell)
    gone = subprocess.Popen(["true"])
    gone.wait()
    given = [f"GPUWAIT_JOB_PID={gone.pid}", "GPUWAIT_JOB_START=1"]
    if before == "GPUWAIT_JOB_START":
        given = given[1:]  # that gpuwait names itself as the job's process
    inside = f"{init_line(shell, '--always')}\npython probe.py during\n"
    shell_argv = {
        "bash": ["bash", "--norc", "--noprofile", "-c", inside],
        "zsh": ["zsh", "-f", "-c", inside],
        "fish": ["fish", "--no-config", "-c", inside],
    }[shell]
    job = ["gpuwait", "--vram", "1G", "--", "env", *given, *shell_argv]
    done = subprocess.run(
        [*job[:1], "-q", *job[1:]],
        env=hook_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    (during,) = probe_lines(done.stdout)
    history = Path(hook_env["XDG_STATE_HOME"]) / "gpuwait" / "history.jsonl"
    ran = [json.loads(line)["command"][0] for line in history.read_text().splitlines()]
    assert ran == ["env"], during


@pytest.mark.parametrize("shell", SHELLS)
def test_a_module_in_the_directory_does_not_shadow_gpuwaits_own_under_an_empty_pythonpath_entry(
    shell: str, hook_env: dict[str, str], tmp_path: Path
) -> None:
    """`export PYTHONPATH=$PYTHONPATH:/opt/lib` in an rc file, with PYTHONPATH unset before it,
    leaves an empty entry first, which Python reads as the current directory. gpuwait's own
    `import signal` then took the directory's signal.py (a project's own, or one a colleague
    left in a shared directory), which ran inside gpuwait, and the wrapped python ended in a
    traceback where it ran bare. The program itself still finds the directory's modules."""
    need(shell)
    (tmp_path / "signal.py").write_text("print('the directory signal.py ran')\n")
    (tmp_path / "uses.py").write_text("import signal\n" + PROBE)
    env = {**hook_env, "PYTHONPATH": f":{tmp_path / 'lib'}"}
    script = f"{init_line(shell, '--always')}\npython uses.py here\n"
    done = run_shell(shell, script, [], env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    # Once, by the program's own import.
    assert done.stdout.count("the directory signal.py ran") == 1, done.stdout
    (probe,) = probe_lines(done.stdout)
    assert probe["argv"] == ["here"] and probe["cuda"] in sim_uuids(), done.stdout + done.stderr


@pytest.mark.parametrize("shell", SHELLS)
def test_wrap_rules_from_the_config_file(
    shell: str, hook_env: dict[str, str], tmp_path: Path, isolated_dirs: Path
) -> None:
    gpu_dir = tmp_path / "ml" / "project"
    gpu_dir.mkdir(parents=True)
    (gpu_dir / "probe.py").write_text(PROBE)
    config = isolated_dirs / "config" / "gpuwait" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text(
        f'wrap_only_in = ["{tmp_path}/ml"]\nnever_wrap = ["* --dry-run*"]\n'
        'wrap_commands = ["python"]\n'
    )
    script = (
        f"{init_line(shell, '--always')}\n"
        "python probe.py here\n"
        "cd ml/project\n"
        "python probe.py there\n"
        "python probe.py --dry-run\n"
        "python3 probe.py not-a-wrapped-command\n"
    )
    done = run_shell(shell, script, [], hook_env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    outside, inside, dry_run, python3 = probe_lines(done.stdout)
    assert outside["cuda"] is None
    assert inside["cuda"] in sim_uuids()
    assert dry_run["cuda"] is None
    assert python3["cuda"] is None


@pytest.mark.parametrize("shell", SHELLS)
def test_wrap_only_in_naming_where_a_symlinked_directory_leads_wraps_there(
    shell: str, hook_env: dict[str, str], tmp_path: Path
) -> None:
    # ml is a link to data/ml, and wrap_only_in names data/ml: a shell that went through the
    # link has ml as its $PWD, and the directory it is really in must match too.
    target = tmp_path / "data" / "ml"
    target.mkdir(parents=True)
    (target / "probe.py").write_text(PROBE)
    (tmp_path / "ml").symlink_to(target)
    script = (
        f"{init_line(shell, '--always')}\n"
        "cd ml\n"
        "python probe.py through-the-link\n"
        f"cd {tmp_path}\n"
        "python probe.py outside\n"
    )
    env = {**hook_env, "GPUWAIT_WRAP_ONLY_IN": str(target)}
    done = run_shell(shell, script, [], env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    inside, outside = probe_lines(done.stdout)
    assert inside["cuda"] in sim_uuids(), done.stderr
    assert outside["cuda"] is None


@pytest.mark.parametrize("shell", SHELLS)
def test_the_documented_rc_line_is_quiet_where_gpuwait_is_not_installed(
    shell: str, hook_env: dict[str, str], tmp_path: Path
) -> None:
    # A home shared with machines that lack gpuwait: the rc line said "gpuwait: command not
    # found" at the start of every shell there.
    page = (REPO / "docs" / "integrations.md").read_text()
    rc = {"bash": ".bashrc", "zsh": ".zshrc", "fish": "config.fish"}[shell]
    (line,) = re.findall(rf"echo '([^']*shell-init[^']*)' >> ~/\S*{re.escape(rc)}", page)
    bare = {**hook_env, "PATH": "/usr/bin:/bin"}
    assert shutil.which("gpuwait", path=bare["PATH"]) is None
    done = run_shell(shell, line, [], bare)
    assert done.stderr == "" and done.stdout == "", done
    if shell != "fish":  # fish defines its functions at the first prompt, which -c never shows
        shown = {"bash": "type -t python", "zsh": "whence -w python"}[shell]
        interactive = ["bash", "--norc", "-i"] if shell == "bash" else ["zsh", "-f", "-i"]
        done = subprocess.run(
            [*interactive, "-c", f"{line}\n{shown}"],
            env=hook_env,
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
        assert "function" in done.stdout, done


def test_explain_says_why(hook_env: dict[str, str], tmp_path: Path) -> None:
    def explain(*argv: str, **env: str) -> tuple[int, str]:
        done = subprocess.run(
            ["gpuwait", "shell-hook", "--explain", "--", *argv],
            env={**hook_env, **env},
            capture_output=True,
            text=True,
            timeout=30,
            cwd=tmp_path,
        )
        return done.returncode, done.stdout.strip()

    (tmp_path / "train.py").write_text("")
    assert explain("python", "train.py") == (0, "wrap: no rule says otherwise")
    assert explain("python", "-m", "pip", "install", "x") == (
        1,
        "bare: the command line matches never_wrap '* -m pip *'",
    )
    # A script read from stdin, or after an option's value, is no missing file: the line
    # waits for its GPU as any other script's.
    assert explain("python", "-") == (0, "wrap: no rule says otherwise")
    assert explain("python", "-W", "ignore", "train.py") == (0, "wrap: no rule says otherwise")
    # Asking Python for its build, or venv for its usage, needs no GPU either.
    for argv in (["python", "-VV"], ["python3", "-m", "venv"]):
        assert explain(*argv)[0] == 1, argv
    code, text = explain("python", "x.py", GPUWAIT_JOB_ID="abc")
    assert code == 1 and "inside gpuwait job abc" in text
    code, text = explain("python", "serve.py", GPUWAIT_NEVER_WRAP="* --dry-run, * serve.py")
    assert code == 1 and "'* serve.py'" in text
    code, text = explain("python", "x.py", GPUWAIT_WRAP_ONLY_IN=f"{tmp_path}/elsewhere")
    assert code == 1 and "not under wrap_only_in" in text
    # Typed so, these run no function of the hook's: "wrap: no rule says otherwise" was wrong.
    code, text = explain("pip", "install", "x")
    assert code == 1 and text.startswith("bare: pip is not in wrap_commands (python, python3, ")
    assert explain(f"{tmp_path}/python", "train.py")[0] == 1
    assert explain("command", "python", "train.py") == (
        1,
        "bare: `command` runs python past the hook",
    )
    assert explain("python", "train.py", GPUWAIT_WRAP_COMMANDS="python3")[0] == 1
    # The shells' `time` keyword runs the function: wrapped as the line after it is.
    assert explain("time", "-p", "python", "train.py") == (0, "wrap: no rule says otherwise")
    assert explain("time", "python", "trian.py")[0] == 1
    assert explain("noglob", "python", "train.py")[0] == 0  # zsh's modifier, as `time`
    code, text = explain("exec", "python", "train.py")
    assert code == 1 and text.startswith("bare: `exec` runs python past the hook in bash and fish")


@pytest.mark.parametrize(
    ("argv", "message", "status"),
    [
        ([], "no command given", 2),
        (["--bogus", "--", "python"], "unknown option '--bogus'", 2),
        (["--", "no-such-command-xyz"], "command not found", 127),
    ],
)
def test_shell_hook_bad_input(
    hook_env: dict[str, str], argv: list[str], message: str, status: int
) -> None:
    done = subprocess.run(
        ["gpuwait", "shell-hook", *argv],
        env={**hook_env, "GPUWAIT_DISABLE": "1"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == status and message in done.stderr
    assert "Traceback" not in done.stderr


def test_bad_wrap_commands_are_refused(hook_env: dict[str, str]) -> None:
    for value in ("python;rm", "command", "-x"):
        done = subprocess.run(
            ["gpuwait", "shell-init", "bash", "--wrap-commands", value],
            env=hook_env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 2 and "--wrap-commands" in done.stderr, done.stderr
        assert done.stdout == ""


#: The builtins the hooks' own functions call (bash, zsh and fish together). Wrapped, one made
#: the hook call itself without end: with `--wrap-commands python,local`, bash died of a
#: segmentation fault at the first `python` typed inside a job.
HOOKS_OWN = (
    "local", "read", "printf", "hash", "return", "shopt", "emulate", "zmodload", "set",
    "string", "count", "functions", "status",
)  # fmt: skip


def test_the_builtins_the_hooks_call_are_never_wrapped(hook_env: dict[str, str]) -> None:
    for name in HOOKS_OWN:
        done = subprocess.run(
            ["gpuwait", "shell-init", "bash", "--wrap-commands", f"python,{name}"],
            env=hook_env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 2, (name, done.stderr)
        assert f"'{name}' cannot be wrapped" in done.stderr and done.stdout == ""


def test_decide_rules(tmp_path: Path) -> None:
    home = {"HOME": "/home/u"}
    assert decide(["python", "t.py"], ["/x"], home, (), ()).wrap
    assert decide(["python", "t.py"], ["/home/u/ml/a/b"], home, ("~/ml",), ()).wrap
    assert decide(["python", "t.py"], ["/home/u/ml2"], home, ("~/ml/",), ()).wrap is False
    assert decide(["python", "t.py"], ["/data/p7/run"], home, ("/data/p*",), ()).wrap
    # The shell's logical $PWD (a symlink) counts as well as the physical directory.
    assert decide(["python"], ["/home/u/ml", "/mnt/disk/ml"], home, ("/mnt/disk/*",), ()).wrap
    assert decide(["python", "-V"], ["/x"], home, (), ("* -V",)).wrap is False
    assert decide(["python", "-V", "x"], ["/x"], home, (), ("* -V",)).wrap
    assert decide(["python"], ["/x"], {"GPUWAIT_DISABLE": "yes"}, (), ()).wrap is False
    assert decide(["python"], ["/x"], {"GPUWAIT_DISABLE": "0"}, (), ()).wrap


# Terminals ------------------------------------------------------------------------------------

TRAP = """\
import os, signal, sys, time
got = []
signal.signal(signal.SIGINT, lambda s, f: got.append(s))
open(sys.argv[1], "w").write("ready " + os.environ.get("CUDA_VISIBLE_DEVICES", "none"))
deadline = time.monotonic() + 20
while not got and time.monotonic() < deadline:
    time.sleep(0.01)
time.sleep(0.3)  # a second delivery would arrive in this time
sys.exit(40 + len(got))
"""

INTERACTIVE = {
    "bash": ["bash", "--norc", "--noprofile", "-i"],
    "zsh": ["zsh", "-f", "-i"],
    "fish": ["fish", "--no-config", "-i"],
}


def wait_for_file(path: Path, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        time.sleep(0.02)
    raise AssertionError(f"{path} was never written")


@pytest.mark.parametrize("shell", SHELLS)
def test_interactive_shell_wraps_and_ctrl_c_reaches_the_command_once(
    shell: str, hook_env: dict[str, str], tmp_path: Path
) -> None:
    pexpect = pytest.importorskip("pexpect")
    need(shell)
    (tmp_path / "trap.py").write_text(TRAP)
    flag = tmp_path / "flag"
    env = {**hook_env, "TERM": "dumb", "PS1": "$ "}
    child = pexpect.spawn(
        INTERACTIVE[shell][0], INTERACTIVE[shell][1:], env=env, cwd=str(tmp_path), timeout=30
    )
    try:
        status = status_var(shell)
        child.sendline(init_line(shell))  # interactive: no --always needed
        child.sendline(f"python trap.py {flag}; echo RESULT=[{status}]")
        assert wait_for_file(flag).startswith("ready GPU-")
        child.sendintr()
        child.expect(r"RESULT=\[(\d+)\]")
        assert child.match.group(1) == b"41"  # the handler ran once, and the status is its own
        child.sendline("exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)


def test_completion_scripts_parse(hook_env: dict[str, str]) -> None:
    for shell, check in (
        ("bash", ["bash", "-n"]),
        ("zsh", ["zsh", "-n"]),
        ("fish", ["fish", "-n"]),
    ):
        need(shell)
        for sub in (["completion", shell], ["shell-init", shell]):
            text = subprocess.run(
                ["gpuwait", *sub], env=hook_env, capture_output=True, text=True, timeout=30
            ).stdout
            assert "gpuwait" in text
            done = subprocess.run(check, input=text, capture_output=True, text=True, timeout=30)
            assert done.returncode == 0, (shell, sub, done.stderr)


def test_completion_follows_the_parsers() -> None:
    """Every option of the default command and every subcommand is in each script."""
    from gpuwait.commands import SUBCOMMANDS, completion, run

    flags = [f for a in run.build_parser().options for f in a.option_strings]
    assert "--vram" in flags and "--devices" in flags
    for shell in SHELLS:
        text = completion.script(shell)
        long_flags = [f for f in flags if f.startswith("--")]
        if shell == "fish":  # fish names long options without their dashes: `-l vram`
            assert all(f"-l {f[2:]} " in text for f in long_flags), shell
        else:
            assert all(f in text for f in long_flags), shell
        assert all(name in text for name in SUBCOMMANDS), shell


def test_completion_offers_every_option_a_subcommand_takes(hook_env: dict[str, str]) -> None:
    """Options in a group (`history`'s `-n N | --all`) are the parser's as much as any."""
    import importlib

    from gpuwait.commands import SUBCOMMANDS, completion, module_name

    for shell in SHELLS:
        text = completion.script(shell)
        for name in SUBCOMMANDS:
            parser = importlib.import_module(module_name(name)).build_parser()
            for flag in (f for a in parser._actions for f in a.option_strings):
                shown = f"-l {flag[2:]} " if shell == "fish" and flag[1] == "-" else flag
                if shell == "fish" and flag[1] != "-":
                    shown = f"-s {flag[1:]} "
                assert shown in text, (shell, name, flag)
    script = """
eval "$(gpuwait completion bash)"
complete_at() { COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); COMPREPLY=(); _gpuwait_complete; echo "${COMPREPLY[*]}"; }
complete_at gpuwait history --a
complete_at gpuwait history -n 5 --
"""
    lines = run_shell("bash", script, [], hook_env).stdout.splitlines()
    assert lines == ["--all", "--help --all --key --json"]


def test_completion_of_a_subcommand_of_a_subcommand(
    hook_env: dict[str, str], tmp_path: Path
) -> None:
    """`gpuwait sim init` and `sim job` have options of their own, and `sim init` a file."""
    here = tmp_path / "here"
    here.mkdir()
    (here / "gpus.toml").write_text("")
    bash = """
eval "$(gpuwait completion bash)"
complete_at() { COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); COMPREPLY=(); _gpuwait_complete; echo "${COMPREPLY[*]}"; }
complete_at gpuwait sim ''
complete_at gpuwait sim init --f
complete_at gpuwait sim init --gpus 4 --
complete_at gpuwait sim init ''
complete_at gpuwait sim job --ho
"""
    lines = run_shell("bash", bash, [], hook_env).stdout.splitlines()
    assert lines == ["init job", "--force", "--help --gpus --memory --force --shared", "", "--hold"]
    fish = """
gpuwait completion fish | source
for line in 'gpuwait sim ' 'gpuwait sim init --' 'gpuwait sim init ' 'gpuwait sim job --ho'
    echo "== $line"
    complete -C "$line"
end
"""
    done = run_shell("fish", fish, [], hook_env, cwd=here)
    blocks = {}
    for block in done.stdout.split("== ")[1:]:
        head, _, body = block.partition("\n")
        blocks[head] = [row.split("\t")[0] for row in body.splitlines()]
    assert blocks["gpuwait sim "] == ["init", "job"]
    assert blocks["gpuwait sim init --"] == ["--force", "--gpus", "--help", "--memory", "--shared"]
    assert blocks["gpuwait sim init "] == ["gpus.toml"]
    assert blocks["gpuwait sim job --ho"] == ["--hold"]


def test_bash_completion(hook_env: dict[str, str]) -> None:
    script = """
eval "$(gpuwait completion bash)"
complete_at() { COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); COMPREPLY=(); _gpuwait_complete; echo "${COMPREPLY[*]}"; }
complete_at gpuwait --p
complete_at gpuwait --pick ''
complete_at gpuwait --vram 6G stat
complete_at gpuwait status --j
complete_at gpuwait shell-init ''
complete_at gpuwait -- stat
complete_at gpuwait --enforce ''
"""
    done = run_shell("bash", script, [], hook_env)
    lines = done.stdout.splitlines()
    assert lines[6] == "off hint limit"
    assert lines[0] == "--pausable --pick --prefer --priority"
    # Every strategy of the policy, in its order.
    assert lines[1] == " ".join(PICK_STRATEGIES)
    assert lines[1].startswith("best-fit most-free round-robin")
    assert "status" in lines[2].split()
    assert lines[3] == "--json"
    assert lines[4] == "bash zsh fish"
    assert "status" not in lines[5].split()  # after --, only programs


def test_fish_completion(hook_env: dict[str, str]) -> None:
    script = """
gpuwait completion fish | source
complete -c probecmd -f -a 'alpha beta'
for line in 'gpuwait --p' 'gpuwait --pick ' 'gpuwait status --' 'gpuwait --vram 6G shell-init ' 'gpuwait --vram 6G pytho' 'gpuwait probecmd ' 'gpuwait --vram 6G -- probecmd ' 'gpuwait statu'
    echo "== $line"
    complete -C "$line"
end
"""
    done = run_shell("fish", script, [], hook_env)
    blocks = {}
    rows = {}
    for block in done.stdout.split("== ")[1:]:
        head, _, body = block.partition("\n")
        blocks[head] = [row.split("\t")[0] for row in body.splitlines()]
        rows[head] = body.splitlines()
    assert blocks["gpuwait --p"] == ["--pausable", "--pick", "--prefer", "--priority"]
    assert blocks["gpuwait --pick "] == sorted(PICK_STRATEGIES)
    assert {"best-fit", "most-free", "round-robin"} <= set(blocks["gpuwait --pick "])
    assert blocks["gpuwait status --"] == ["--help", "--json", "--watch"]
    assert blocks["gpuwait --vram 6G shell-init "] == ["bash", "fish", "zsh"]
    assert "python" in blocks["gpuwait --vram 6G pytho"]
    # After the command, that command's own completion, with or without `--` before it.
    assert blocks["gpuwait probecmd "] == ["alpha", "beta"]
    assert blocks["gpuwait --vram 6G -- probecmd "] == ["alpha", "beta"]
    # gpuwait's own `status`, described as such, not as fish's builtin of that name.
    assert any(row.startswith("status\tGPUs, running jobs") for row in rows["gpuwait statu"])


def test_zsh_completion_in_a_terminal(hook_env: dict[str, str], tmp_path: Path) -> None:
    pexpect = pytest.importorskip("pexpect")
    need("zsh")
    env = {**hook_env, "TERM": "dumb", "PS1": "$ "}
    child = pexpect.spawn("zsh", ["-f", "-i"], env=env, cwd=str(tmp_path), timeout=30)
    try:
        child.sendline('autoload -Uz compinit && compinit -u -D; eval "$(gpuwait completion zsh)"')
        child.sendline("echo READY")
        child.expect("READY\r\n")
        child.send("gpuwait --pi\t")
        child.expect("--pick")
        child.send("\x15")  # Ctrl-U: clear the line
        child.send("gpuwait --vram 6G shell-init z\t")
        child.expect(r"shell-init z\x07?sh ")
        # A subcommand of a subcommand, with options of its own.
        child.send("\x15gpuwait sim init --fo\t")
        child.expect(r"init --fo\x07?rce ")
        child.send("\x15gpuwait sim job --ho\t")
        child.expect(r"job --ho\x07?ld")
        # After `gpuwait --`, the command's own completion, as after gpuwait's options.
        child.send("\x15_probecmd() { compadd alphabet }; compdef _probecmd probecmd\r")
        child.send("\x15gpuwait -- probecmd al\t")
        child.expect(r"probecmd al\x07?phabet ")
        child.send("\x15exit\r")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)


def test_hook_runs_its_own_gpuwait_whatever_the_directory_and_pythonpath(
    hook_env: dict[str, str], tmp_path: Path
) -> None:
    """The hook names the interpreter and package gpuwait was loaded from, as a console script
    does: no PYTHONPATH needed later, and a project's own `signal.py` or `gpuwait/` in the
    current directory shadows nothing."""
    project = tmp_path / "project"
    (project / "gpuwait").mkdir(parents=True)
    for shadow in ("signal.py", "json.py", "gpuwait/__init__.py"):
        (project / shadow).write_text("raise SystemExit('shadowed module imported')\n")
    (project / "probe.py").write_text(
        "import os, sys\nprint(repr((sys.argv[1:], os.environ.get('CUDA_VISIBLE_DEVICES'))))\n"
    )
    env = {k: v for k, v in hook_env.items() if k != "PYTHONPATH"}
    script = f"{init_line('bash', '--always')}\npython probe.py x\n"
    done = run_shell("bash", script, [], env, cwd=project)
    assert done.returncode == 0, done.stderr
    argv, cuda = ast.literal_eval(done.stdout)
    assert argv == ["x"] and cuda in sim_uuids(), done.stderr


def test_zsh_hook_loads_silently_under_ksh_arrays(hook_env: dict[str, str]) -> None:
    """A .zshrc with `setopt ksh_arrays` (as under `emulate ksh`) still gets the hook without errors."""
    done = run_shell(
        "zsh", f"setopt ksh_arrays\n{init_line('zsh', '--always')}\ntype python", [], hook_env
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert "function" in done.stdout


@pytest.mark.parametrize("shell", SHELLS)
def test_a_pipeline_of_wrapped_commands_runs_as_bare(
    shell: str, hook_env: dict[str, str], tmp_path: Path, sim_file: Any
) -> None:
    # Each stage of a pipeline is wrapped on its own, and a command with no history asks for a
    # whole GPU: the second stage would wait for the first, which waits for it to read the
    # pipe. The one that would wait runs bare instead (one warning), as it would bare.
    sim_file(gpus=1)
    env = {**hook_env, "GPUWAIT_DEFAULT_VRAM": "exclusive"}
    script = (
        f"{init_line(shell, '--always')}\n"
        "python -c 'print(\"x\" * 200000)' | python -c 'import sys; print(len(sys.stdin.read()))'\n"
    )
    started = time.monotonic()
    done = run_shell(shell, script, [], env, cwd=tmp_path)
    assert time.monotonic() - started < 30
    assert done.returncode == 0, done.stderr
    assert done.stdout == "200001\n"
    # fish hands a function's output on only once it has ended: its stages never overlap.
    bare = 0 if shell == "fish" else 1
    assert done.stderr.count("the shell hook runs it bare") == bare, done.stderr


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_a_posix_sh_reading_the_hook_goes_on_untouched(
    shell: str, hook_env: dict[str, str], tmp_path: Path
) -> None:
    """The hook put in ~/.profile, which /bin/sh (dash) also reads (a graphical login's
    Xsession, `sh -l`): dash cannot parse bash's or zsh's syntax, and a syntax error ends a
    non-interactive sh there, the rest of the profile (and the login) with it. It goes on,
    wrapping nothing, and says nothing where nobody types."""
    sh = need("dash")
    need(shell)
    hook = tmp_path / "hook.sh"
    hook.write_text(
        subprocess.run(
            ["gpuwait", "shell-init", shell, "--always"],
            env=hook_env,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    )
    for script in (f'eval "$(cat {hook})"', f". {hook}"):
        done = subprocess.run(
            [sh, "-c", f"set -eu\n{script}\necho still-here\npython probe.py x"],
            env=hook_env,
            capture_output=True,
            text=True,
            timeout=30,
            cwd=tmp_path,
        )
        assert (done.returncode, done.stderr) == (0, ""), (script, done.stderr)
        assert done.stdout.startswith("still-here\n"), done.stdout
        assert probe_lines(done.stdout) == [{"argv": ["x"], "cuda": None, "job": None}]
    # Its own shell still gets the functions.
    done = run_shell(shell, f". {hook}\npython probe.py x", [], hook_env, cwd=tmp_path)
    assert probe_lines(done.stdout)[0]["cuda"] in sim_uuids(), done.stderr


def hook_from_copy(
    python: Path, site: Path, shell: str, env: dict[str, str], tmp_path: Path
) -> Path:
    """A file holding the hook that `python` prints with a copy of this gpuwait put in `site`,
    which the test may then change or remove."""
    shutil.copytree(REPO / "gpuwait", site / "gpuwait", ignore=shutil.ignore_patterns("*.pyc"))
    hook = tmp_path / "hook"
    hook.write_text(
        subprocess.run(
            [python, "-m", "gpuwait", "shell-init", shell, "--always"],
            env={**env, "PYTHONPATH": str(site)},
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
    )
    return hook


@pytest.mark.parametrize("shell", SHELLS)
def test_a_shell_whose_hooked_gpuwait_is_gone_runs_the_one_on_path_or_runs_bare(
    shell: str, hook_env: dict[str, str], tmp_path: Path
) -> None:
    """`pip uninstall gpuwait`, or its environment removed for a new one, under a shell that
    was hooked before: every wrapped command ended in a Python traceback (No module named
    'gpuwait') without running. It now goes through the gpuwait on PATH, which a new shell
    would hook, else runs bare with one line saying why."""
    need(shell)
    # An environment of its own, whose gpuwait is then uninstalled.
    old = tmp_path / "old-env"
    venv.create(old, with_pip=False)
    site = tmp_path / "old-site"
    hook = hook_from_copy(old / "bin" / "python", site, shell, hook_env, tmp_path)
    # Its console script, which the shell finds (and bash remembers) first on PATH.
    console = old / "bin" / "gpuwait"
    console.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {old}/bin/python -m gpuwait "$@"\n')
    console.chmod(0o755)
    python_only = make_bin(tmp_path / "python-only")
    (python_only / "gpuwait").unlink()
    path_set = "set -x PATH " if shell == "fish" else "export PATH="
    script = (
        f"source {hook}\n"
        f"{path_set}{old / 'bin'}:{hook_env['PATH']}\n"
        "gpuwait --version\n"
        f"command rm -r {site / 'gpuwait'} {console}\n"
        "python probe.py on-path\n"
        f"{path_set}{python_only}:/usr/bin:/bin\n"
        "python probe.py none; python -c 'raise SystemExit(7)'\n"
        f"echo status {status_var(shell)}\n"
    )
    # As in a user's shell: nothing but the hook names where gpuwait is.
    env = {k: v for k, v in hook_env.items() if k != "PYTHONPATH"}
    done = run_shell(shell, script, [], env, cwd=tmp_path)
    assert "Traceback" not in done.stderr, done.stderr
    through_path, bare = probe_lines(done.stdout)
    assert through_path["cuda"] in sim_uuids() and through_path["job"], done.stderr
    assert bare == {"argv": ["none"], "cuda": None, "job": None}
    assert done.stdout.endswith("status 7\n")
    said = [line for line in done.stderr.splitlines() if line.startswith("gpuwait: ")]
    assert len(said) == 2 and "runs python bare" in said[0], done.stderr


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_a_shell_hooked_before_a_downgrade_goes_on_wrapping(
    shell: str, hook_env: dict[str, str], tmp_path: Path
) -> None:
    """A hook printed by this gpuwait, in a terminal left open while an older gpuwait (whose
    `shell-hook` knows no option but --explain, nor the variable the hook sets) was installed
    in its place: a hook that told gpuwait more by an option would have every wrapped command
    refused, "unknown option", exit 2, never run."""
    site = tmp_path / "site"
    hook = hook_from_copy(Path(sys.executable), site, shell, hook_env, tmp_path)
    env = {**hook_env, "PYTHONPATH": str(site)}
    # This gpuwait keeps what the hook tells it to itself.
    leak = "python -c 'import os; print(os.environ.get(\"_GPUWAIT_SHELL_PID\"))'"
    done = run_shell(shell, f"source {hook}\n{leak}", [], env, cwd=tmp_path)
    assert (done.stdout, done.stderr) == ("None\n", "")
    # The older gpuwait, installed over the same files: its shell-hook knows nothing of the
    # variable (and takes --explain only, as this one does).
    parser = site / "gpuwait" / "commands" / "shell_hook.py"
    source = parser.read_text()
    assert "shell_pids = _hook_shell_pids()" in source
    parser.write_text(source.replace("shell_pids = _hook_shell_pids()", "shell_pids = (0, 0)"))
    script = f"source {hook}\npython probe.py x\necho status $?\n"
    done = run_shell(shell, script, [], env, cwd=tmp_path)
    assert (done.stdout.endswith("status 0\n"), done.stderr) == (True, "")
    assert probe_lines(done.stdout)[0]["cuda"] in sim_uuids()


#: Each shell's own machinery running python: a completion that lists what python prints (as
#: bash-completion's, zsh's and fish's `python -m <Tab>` list modules) and a prompt that runs
#: python (a theme showing the Python version).
SHELL_OWN = {
    "bash": [
        '_probe() { COMPREPLY=($(python -c \'print("alpha" + "bet")\')); }; complete -F _probe probecmd',
        'PROMPT_COMMAND=\'python -c "print(\\"prompt-\\" + \\"ran\\")"\'',
    ],
    "zsh": [
        "autoload -Uz compinit && compinit -u -D",
        '_probe() { compadd -- $(python -c \'print("alpha" + "bet")\') }; compdef _probe probecmd',
        'precmd() { python -c \'print("prompt-" + "ran")\' }',
    ],
    "fish": [
        "complete -c probecmd -f -a '(python -c \"print(\\'alpha\\' + \\'bet\\')\")'",
    ],
}


@pytest.mark.parametrize("shell", SHELLS)
def test_what_the_shell_runs_on_its_own_is_not_wrapped(
    shell: str, hook_env: dict[str, str], tmp_path: Path, sim_file: Any
) -> None:
    """Completion, the prompt and fish's first start run python themselves: wrapped, each asked
    for a GPU, the Tab key, the prompt or a new fish's first prompt waited with it (for ever,
    silently, while the GPUs were busy; `2>/dev/null` hid the wait line), and each of them went
    into the history as a job. Nobody typed them: they run bare."""
    pexpect = pytest.importorskip("pexpect")
    need(shell)
    sim_file(gpus=1, base_used="24GiB")  # every wrapped command would wait
    env = {**hook_env, "TERM": "dumb", "PS1": "$ ", "MANPATH": str(tmp_path / "no-man-pages")}
    env["VISUAL"] = env["EDITOR"] = "true"
    if shell == "fish":
        # A new account's fish, with the hook and a prompt that runs python in config.fish.
        config = Path(env["XDG_CONFIG_HOME"]) / "fish" / "config.fish"
        config.parent.mkdir(parents=True)
        config.write_text(
            f"{init_line('fish')}\n"
            "function fish_prompt; python -c 'print(\"prompt-\" + \"ran\")'; echo '$ '; end\n"
        )
        argv = ["fish", "-i"]
    else:
        argv = INTERACTIVE[shell]
    child = pexpect.spawn(argv[0], argv[1:], env=env, cwd=str(tmp_path), timeout=15)
    try:
        if shell == "fish":
            child.expect("prompt-ran")
        else:
            child.sendline(init_line(shell))
        for line in SHELL_OWN[shell]:
            child.sendline(line)
        child.expect("prompt-ran")
        child.sendline("echo READY")
        child.expect("READY\r\n")
        child.send("probecmd al\t")
        child.expect(r"al\x07?phabet")
        # What is typed is wrapped as ever: it waits for the GPU.
        child.send("\x15python probe.py typed\r")
        child.expect("waiting for 1.0 GiB")
        child.sendintr()
        if shell == "bash":
            # Also a line run from the editor (Ctrl-X Ctrl-E; the editor here keeps it as is).
            # bash cannot tell the prompt after it from it: none runs python here.
            child.sendline("PROMPT_COMMAND=")
            child.send("python probe.py edited\x18\x05")
            child.expect("waiting for 1.0 GiB")
            child.sendintr()
            child.expect_exact("$ ")  # bash drops what was typed ahead of it there
        child.sendline("exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    history = Path(hook_env["XDG_STATE_HOME"]) / "gpuwait" / "history.jsonl"
    ran = history.read_text() if history.exists() else ""
    assert "alpha" not in ran and "prompt-" not in ran, ran


HOLD = """\
import os, sys, time
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(30)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _until(condition: Any, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def no_gpu_env(hook_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """No GPU readings here (no GPUWAIT_SIM, no driver), and on_no_gpu = run: the hook's
    gpuwait runs its command bare."""
    env = {k: v for k, v in hook_env.items() if k != "GPUWAIT_SIM"}
    return env | {"GPUWAIT_ON_NO_GPU": "run", "LD_LIBRARY_PATH": str(tmp_path)}


def background_env(how: str, hook_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """The hook's environment for a background command run as `how` says: wrapped (running or
    waiting), bare for want of GPU readings (no_gpu), or bare by the rules (never_wrap)."""
    if how == "no_gpu":
        return no_gpu_env(hook_env, tmp_path)
    if how == "never_wrap":
        return hook_env | {"GPUWAIT_NEVER_WRAP": "python *"}
    return hook_env


@pytest.mark.parametrize("shell", ["bash", "zsh"])
@pytest.mark.parametrize("how", ["running", "waiting", "no_gpu", "never_wrap"])
def test_killing_a_background_wrapped_command_by_its_pid_ends_it(
    shell: str, how: str, hook_env: dict[str, str], tmp_path: Path, sim_file: Any
) -> None:
    """`python train.py & ... kill $!`: bash and zsh run a function in the background in a
    subshell of its own, and $! is that subshell's. Killed, it went alone: gpuwait and the
    command went on, the job the user had killed held its GPU to the end, and one still waiting
    for room started later all the same. Bare, the kill ends the command; now it does too, and
    so it does where gpuwait runs the command bare: for want of GPU readings, or as a rule
    (never_wrap, wrap_only_in) says, where the kill had left the command running."""
    need(shell)
    waiting = how == "waiting"
    env = background_env(how, hook_env, tmp_path)
    if waiting:
        sim_file(gpus=1, base_used="24GiB")
    (tmp_path / "hold.py").write_text(HOLD)
    ran = tmp_path / "ran"
    script = f"{init_line(shell, '--always')}\npython hold.py {ran} &\necho $!\nwait\n"
    argv = {"bash": ["bash", "--norc", "--noprofile"], "zsh": ["zsh", "-f"]}[shell]
    outer = subprocess.Popen(
        [*argv, "-c", script], env=env, cwd=tmp_path, stdout=subprocess.PIPE, text=True
    )
    started: list[int] = []
    try:
        assert outer.stdout is not None
        subshell = int(outer.stdout.readline())
        _until(lambda: _children(subshell), "the subshell never started gpuwait")
        started.extend(_children(subshell))
        if not waiting:
            started.append(int(wait_for_file(ran)))
        os.kill(subshell, 15)
        if waiting:
            sim_file(gpus=1)  # room at last: a job still waiting would start now
        _until(lambda: not any(_alive(p) for p in started), "the killed job went on", 5)
        assert outer.wait(timeout=10) == 0
        assert waiting is not ran.exists()
    finally:
        if ran.exists() and ran.read_text():
            started.append(int(ran.read_text()))
        for pid in [outer.pid, *started]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        outer.wait(timeout=10)


def test_a_hook_call_that_replaced_its_subshell_runs_its_command(
    hook_env: dict[str, str], tmp_path: Path
) -> None:
    """A shell may run the hook's call in place of the subshell it forked (an exec of the last
    command, as shells do for `( cmd )` and `sh -c cmd`): gpuwait then is the process the
    hook's pid names, its parent the main shell, which lives on, so nothing ends it early."""
    done = subprocess.run(
        ["bash", "-c", 'exec env _GPUWAIT_SHELL_PID="$PPID/$$" gpuwait shell-hook -- echo ran'],
        env=hook_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout) == (0, "ran\n"), done.stderr


@pytest.mark.parametrize("value", ["\u00b2/1", "1/\u0663", "\uff11/2"])
def test_shell_pids_in_digits_of_other_scripts_are_no_pids(
    hook_env: dict[str, str], tmp_path: Path, value: str
) -> None:
    """A hook variable whose pids are written in digits other than 0-9 (a superscript two, an
    Arabic-Indic three, a fullwidth one) names no shell: the command runs, without a
    traceback, as under no hook's pids."""
    done = subprocess.run(
        ["gpuwait", "shell-hook", "--", "echo", "ran"],
        env={**hook_env, "_GPUWAIT_SHELL_PID": value},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "ran\n", "")


def test_shell_pids_naming_a_process_that_is_not_its_parent_end_nothing(
    hook_env: dict[str, str], tmp_path: Path
) -> None:
    """A hook variable naming as the subshell a live process that is not gpuwait's parent
    (another process of the user's, pid 1) is no hook's: gpuwait took it for a subshell that
    had ended and ended itself with SIGTERM, the command never run (143, "Terminated").
    The command runs, and the process named is left alone."""
    other = subprocess.Popen(["sleep", "30"])
    try:
        for current in (other.pid, 1):
            done = subprocess.run(
                ["gpuwait", "shell-hook", "--", "echo", "ran"],
                env={**hook_env, "_GPUWAIT_SHELL_PID": f"{os.getpid()}/{current}"},
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert (done.returncode, done.stdout, done.stderr) == (0, "ran\n", ""), current
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_shell_pids_naming_a_subshell_ended_but_not_yet_reaped_end_the_line(
    hook_env: dict[str, str], tmp_path: Path
) -> None:
    """`kill $!` ended the subshell, which its shell has not reaped yet (a zombie, its pid
    still in /proc): taken for a live process other than the parent, the line ran on, where
    one whose pid is gone ends, as the hook's `kill $!` promises."""
    ended = subprocess.Popen(["true"])
    try:
        stat = Path(f"/proc/{ended.pid}/stat")
        deadline = time.monotonic() + 10
        while stat.read_text().rpartition(")")[2].split()[0] != "Z":
            assert time.monotonic() < deadline, "the child never ended"
            time.sleep(0.01)
        done = subprocess.run(
            ["gpuwait", "shell-hook", "--", "echo", "ran"],
            env={**hook_env, "_GPUWAIT_SHELL_PID": f"{os.getpid()}/{ended.pid}"},
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert (done.returncode, done.stdout) == (-signal.SIGTERM, ""), done.stderr
    finally:
        ended.wait()


SURVIVES_HUP = """\
import os, signal, sys, time
log = open(sys.argv[2], "a", buffering=1)
def note(signum, frame):
    log.write(signal.Signals(signum).name + "\\n")
    if signum == signal.SIGTERM:
        sys.exit(0)
for signum in (signal.SIGHUP, signal.SIGTERM, signal.SIGRTMIN):
    signal.signal(signum, note)
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(30)
"""


@pytest.mark.parametrize("shell", ["bash", "zsh"])
@pytest.mark.parametrize("how", ["running", "no_gpu", "never_wrap"])
def test_a_background_wrapped_command_that_outlives_its_jobs_hangup_is_not_ended(
    shell: str, how: str, hook_env: dict[str, str], tmp_path: Path
) -> None:
    """`python serve.py &`, whose program takes SIGHUP (to reload, or to outlive the
    terminal): a HUP sent to the whole job (`kill -HUP %1`, the terminal closed) reaches it, as
    bare, and ends the subshell that runs the hook's function. That subshell's end was taken
    for a `kill $!`, and the command was sent a TERM it would never have had bare. Where
    gpuwait ran it bare for want of GPU readings (on_no_gpu = run), the command, run in
    gpuwait's place, kept that TERM: it too was ended."""
    need(shell)
    (tmp_path / "serve.py").write_text(SURVIVES_HUP)
    ran, log = tmp_path / "ran", tmp_path / "log"
    script = f"{init_line(shell, '--always')}\npython serve.py {ran} {log} &\necho $!\nwait\n"
    argv = {"bash": ["bash", "--norc", "--noprofile"], "zsh": ["zsh", "-f"]}[shell]
    env = background_env(how, hook_env, tmp_path)
    with _background_job([*argv, "-c", script], env, tmp_path, ran) as job:
        os.killpg(job.outer.pid, signal.SIGHUP)
        _until(lambda: not _alive(job.subshell), "the subshell outlived the HUP")
        _until(lambda: "HUP" in _read(log), "the command never had the HUP")
        # Sent to gpuwait alone, passed on after anything it passed on before.
        os.kill(job.gpuwait, signal.SIGRTMIN)
        _until(lambda: "RTMIN" in _read(log) or "TERM" in _read(log), "nothing passed on")
        assert _read(log).split() == ["SIGHUP", "SIGRTMIN"]
        assert _alive(job.command)


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


@dataclass
class _BackgroundJob:
    outer: subprocess.Popen[str]
    #: The subshell the script's `&` made, which runs the hook's function.
    subshell: int
    #: gpuwait, the subshell's child.
    gpuwait: int
    #: The command, by the pid it wrote to its `ran` file.
    command: int


@contextlib.contextmanager
def _background_job(
    argv: list[str], env: dict[str, str], cwd: Path, ran: Path
) -> Iterator[_BackgroundJob]:
    """Runs `argv`, a shell script that puts a wrapped command in the background and echoes
    `$!`, in a process group of its own (the job's, as a job control shell gives it, which the
    terminal's Ctrl-C reaches as a whole), once gpuwait and its command are there; every
    process of it is killed after the block."""
    outer = subprocess.Popen(
        argv, env=env, cwd=cwd, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    started: list[int] = []
    try:
        assert outer.stdout is not None
        subshell = int(outer.stdout.readline())
        _until(lambda: _children(subshell), "the subshell never started gpuwait")
        started.extend(_children(subshell))
        command = int(wait_for_file(ran))
        started.append(command)
        yield _BackgroundJob(outer, subshell, started[0], command)
    finally:
        for pid in [*started, outer.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        outer.wait(timeout=10)


def test_a_background_wrapped_command_is_ended_by_its_pid_after_a_ctrl_c_it_ignored(
    hook_env: dict[str, str], tmp_path: Path
) -> None:
    """A zsh script that starts `python serve.py &` and kills it from its Ctrl-C trap (`trap
    'kill $pid' INT`): zsh has a job it puts in the background ignore Ctrl-C, as its command
    does bare, and the kill then ends it. The Ctrl-C, ignored, was still taken for a signal
    sent to the whole job just now, and the subshell's end for that signal's: the kill was
    dropped, and the command ran on, holding its GPU, after the script had ended."""
    shell = "zsh"
    need(shell)
    (tmp_path / "hold.py").write_text(HOLD)
    ran = tmp_path / "ran"
    script = (
        f"{init_line(shell, '--always')}\npython hold.py {ran} &\npid=$!\necho $pid\n"
        "trap 'kill $pid' INT\nwait\nwait\n"
    )
    with _background_job(["zsh", "-f", "-c", script], hook_env, tmp_path, ran) as job:
        os.killpg(job.outer.pid, signal.SIGINT)
        _until(lambda: not _alive(job.subshell), "the trap never killed the subshell")
        _until(lambda: not _alive(job.command), "the command ran on after its kill", 5)
        assert job.outer.wait(timeout=10) == 0


@pytest.mark.parametrize("shell", ["bash", "zsh"])
@pytest.mark.parametrize("how", ["no_gpu", "never_wrap"])
def test_a_background_command_run_bare_keeps_its_exit_status(
    shell: str, how: str, hook_env: dict[str, str], tmp_path: Path
) -> None:
    """`python job.py & wait $!` where gpuwait runs it bare (for want of GPU readings, or as
    a rule says): the status `wait` gives is the command's own, an exit status as a death by a
    signal."""
    script = (
        f"{init_line(shell, '--always')}\n"
        "python -c 'import sys; sys.exit(3)' &\nwait $!\necho $?\n"
        "python -c 'import os, signal; os.kill(os.getpid(), signal.SIGUSR1)' &\nwait $!\necho $?\n"
    )
    done = run_shell(shell, script, [], background_env(how, hook_env, tmp_path), cwd=tmp_path)
    assert done.stdout.split() == ["3", str(128 + signal.SIGUSR1)], done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("shell", SHELLS)
def test_a_launcher_told_to_choose_its_own_gpus_is_refused_before_waiting(
    shell: str, hook_env: dict[str, str], tmp_path: Path, sim_file: Any
) -> None:
    # `deepspeed --num_gpus 1 train.py` runs on the machine's GPU 0, `--include localhost:1`
    # on GPU 1, and `accelerate launch --gpu_ids 0` on GPU 0, whichever GPU gpuwait reserved:
    # typed with the hook on, each waited for its GPU, then ran in another job's room.
    env = full_gpus(hook_env, sim_file)
    stand_ins(tmp_path, '#!/bin/sh\necho "{name} ran"\n', "accelerate", "deepspeed")
    lines = [
        "deepspeed --num_gpus 1 probe.py",
        "deepspeed --include=localhost:1 probe.py --lr 0.1",
        "accelerate launch --gpu_ids 0 --num_processes 1 probe.py",
        # Left to the GPUs gpuwait gives: they wait, and would run there.
        "deepspeed probe.py --num_gpus 1",
        "accelerate launch --gpu_ids all probe.py",
        "accelerate launch probe.py --gpu_ids 0",
    ]
    said, done = statuses(shell, lines, env, tmp_path)
    assert said == ["2", "2", "2", "124", "124", "124"], done.stdout + done.stderr
    assert "ran" not in done.stdout
    assert (
        "gpuwait: error: deepspeed --num_gpus runs its workers on GPUs it chooses itself"
        in done.stderr
    ), done.stderr
    assert (
        "gpuwait: hint: leave it out, and ask gpuwait for the GPUs as numbers: "
        "GPUWAIT_VISIBLE_DEVICES=index gpuwait --gpus 1 ... -- deepspeed probe.py\n"
    ) in done.stderr
    assert "-- deepspeed probe.py --lr 0.1\n" in done.stderr
    assert "gpuwait ... -- accelerate launch --num_processes 1 probe.py\n" in done.stderr


def test_a_config_file_named_but_missing_is_told_though_the_site_rules_would_run_the_line_bare(
    hook_env: dict[str, str], tmp_path: Path, isolated_dirs: Path
) -> None:
    # The site's config wraps only in another directory, and GPUWAIT_CONFIG names a file with
    # a typo in its name: the user's own rules, which may wrap elsewhere, are not known, so a
    # line the site's rules alone would run bare is refused, saying what to fix, and not run
    # bare without a word of the file the user named.
    site = isolated_dirs / "site-config" / "gpuwait" / "config.toml"
    site.parent.mkdir(parents=True)
    site.write_text(f'wrap_only_in = ["{tmp_path / "elsewhere"}"]\n')
    env = {**hook_env, "GPUWAIT_CONFIG": str(tmp_path / "confg.toml")}
    told = explain(["python", "probe.py"], env, tmp_path)
    assert told.returncode == 2, told.stdout + told.stderr
    assert "does not exist" in told.stderr and "confg.toml" in told.stderr, told.stderr
    # Named rightly, the file says nothing of wrap_only_in and the site's rule holds.
    (tmp_path / "confg.toml").write_text("")
    told = explain(["python", "probe.py"], env, tmp_path)
    assert told.returncode == 1 and "wrap_only_in" in told.stdout, told.stdout + told.stderr


def test_a_bad_setting_still_leaves_the_env_and_site_wrap_rules_in_force(
    hook_env: dict[str, str], tmp_path: Path, isolated_dirs: Path
) -> None:
    # GPUWAIT_SIM=sim.toml (refused: a relative path) beside the wrap rules given otherwise
    # than in the user's config file: GPUWAIT_NEVER_WRAP, the site's wrap_only_in, and, where
    # the user's file is no TOML, the built-in never_wrap. A line any of them runs bare runs
    # bare; it is not refused for the setting it does not need.
    env = {**hook_env, "GPUWAIT_SIM": "sim.toml"}
    assert explain(["python", "probe.py"], env, tmp_path).returncode == 2
    told = explain(["python", "probe.py"], {**env, "GPUWAIT_NEVER_WRAP": "* probe.py"}, tmp_path)
    assert (told.returncode, told.stdout) == (
        1,
        "bare: the command line matches never_wrap '* probe.py'\n",
    ), told.stderr
    site = isolated_dirs / "site-config" / "gpuwait" / "config.toml"
    site.parent.mkdir(parents=True)
    site.write_text(f'wrap_only_in = ["{tmp_path / "elsewhere"}"]\n')
    told = explain(["python", "probe.py"], env, tmp_path)
    assert told.returncode == 1 and "wrap_only_in" in told.stdout, told.stdout + told.stderr
    site.unlink()
    config = tmp_path / "config.toml"
    config.write_text("nvml_interval = \n")
    no_toml = {**env, "GPUWAIT_CONFIG": str(config)}
    told = explain(["python", "--version"], no_toml, tmp_path)
    assert (told.returncode, told.stdout) == (
        1,
        "bare: the command line matches never_wrap '* --version'\n",
    ), told.stderr
    assert explain(["python", "probe.py"], no_toml, tmp_path).returncode == 2
