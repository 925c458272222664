"""Command keys: which runs count as "the same command"."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuwait.core.cmdkey import command_key, explicit_key

CWD = "/home/me/proj"


def levels(*argv: str, cwd: str = CWD) -> dict[str, str]:
    return dict(command_key(list(argv), cwd).levels)


@pytest.mark.parametrize(
    "other",
    [
        ["python", "./train.py", "--epochs", "3"],
        ["python3", "train.py", "--epochs", "3"],
        ["/usr/bin/python3.11", "train.py", "--epochs", "3"],
        ["python", "-u", "train.py", "--epochs", "3"],
        ["python", "-W", "ignore", "-X", "dev", "sub/../train.py", "--epochs", "3"],
        ["python", f"{CWD}/train.py", "--epochs", "3"],
        ["python", "--check-hash-based-pycs", "never", "train.py", "--epochs", "3"],
        ["python", "-Xfrozen_modules=off", "-Wdefault", "train.py", "--epochs", "3"],
    ],
)
def test_spellings_of_the_same_command_match(other: list[str]) -> None:
    assert (
        command_key(other, CWD).hashes()
        == command_key(["python", "train.py", "--epochs", "3"], CWD).hashes()
    )


def test_levels_of_a_python_script() -> None:
    assert levels("python", "train.py", "--epochs", "3") == {
        "command": f"python {CWD}/train.py --epochs 3",
        "script": f"python {CWD}/train.py",
        "program": "python",
    }


def test_same_script_name_in_another_directory_is_another_script() -> None:
    here = command_key(["python", "train.py"], CWD).hashes()
    there = command_key(["python", "train.py"], "/home/me/other").hashes()
    assert here["script"] != there["script"]
    assert here["program"] == there["program"]


def test_other_arguments_share_the_script_level_only() -> None:
    a = command_key(["python", "train.py", "--bs", "8"], CWD).hashes()
    b = command_key(["python", "train.py", "--bs", "64"], CWD).hashes()
    assert a["command"] != b["command"] and a["script"] == b["script"]


def test_a_command_without_arguments_keeps_both_levels_apart() -> None:
    # The script level also holds runs with arguments; the command level holds only these.
    key = command_key(["python", "train.py"], CWD)
    hashes = key.hashes()
    assert key.text("command") == key.text("script")
    assert hashes["command"] != hashes["script"]


def test_modules_depend_on_the_directory() -> None:
    assert levels("python", "-m", "pkg.train", "--lr", "0.1")["script"] == (
        f"python -m pkg.train (in {CWD})"
    )
    assert levels("python", "-mpkg.train")["script"] == f"python -m pkg.train (in {CWD})"


def test_launcher_modules_and_programs_find_their_script() -> None:
    assert levels("python", "-m", "torch.distributed.run", "--nproc_per_node", "2", "t.py")[
        "script"
    ] == (f"python -m torch.distributed.run (in {CWD}) {CWD}/t.py")
    found = levels("torchrun", "--nproc_per_node=4", "./t.py", "--bs", "8")
    assert found["script"] == f"torchrun {CWD}/t.py"
    assert found["command"] == f"torchrun --nproc_per_node=4 {CWD}/t.py --bs 8"
    assert levels("accelerate", "launch", "--config_file=x.yaml", "--script=run.py")["script"] == (
        f"accelerate {CWD}/run.py"
    )


def test_shell_scripts_and_inline_code() -> None:
    assert levels("bash", "-e", "-o", "pipefail", "job.sh", "x")["script"] == f"bash {CWD}/job.sh"
    inline = levels("sh", "-c", "python train.py")
    assert inline["script"].startswith("sh -c <") and "train.py" not in inline["script"]
    assert levels("python", "-c", "a")["script"] != levels("python", "-c", "b")["script"]


def test_a_shells_long_options_and_double_dash_leave_its_script_as_it_is() -> None:
    script = levels("bash", "job.sh", "x")
    for spelling in (["--", "job.sh", "x"], ["--norc", "--noprofile", "job.sh", "x"]):
        assert levels("bash", *spelling) == script, spelling
    assert script["command"] == f"bash {CWD}/job.sh x"
    code = levels("bash", "-c", "python train.py")
    assert levels("bash", "--norc", "-c", "python train.py") == code


def test_the_arguments_after_a_shells_inline_code_tell_its_runs_apart() -> None:
    small = levels("bash", "-c", 'python train.py "$1"', "sh", "8")
    assert small["command"] != levels("bash", "-c", 'python train.py "$1"', "sh", "64")["command"]
    assert small["command"].endswith(f" sh 8 (in {CWD})"), small


def test_the_arguments_after_inline_python_tell_its_runs_apart() -> None:
    # `python -c CODE --bs 8` and `--bs 64` are two commands, whether the code is glued on.
    small = levels("python", "-c", "import train", "--bs", "8")
    assert small == levels("python", "-cimport train", "--bs", "8")
    assert small["command"] != levels("python", "-c", "import train", "--bs", "64")["command"]
    assert small["command"].endswith(f" --bs 8 (in {CWD})"), small


def test_an_option_missing_its_code_or_module_still_has_a_key() -> None:
    # Python itself says what is missing; gpuwait must not fail on the line first.
    for option in ("-c", "-m", "-uc"):
        assert levels("python", option)["program"] == "python"
    for option in ("-c", "-lc"):
        assert levels("bash", option)["program"] == "bash"


@pytest.mark.parametrize("options", [["-lc"], ["-ec"], ["-eo", "pipefail", "-c"], ["-c"]])
def test_inline_code_after_clustered_options_counts_with_its_directory(
    options: list[str],
) -> None:
    # `bash -lc '...'`, as CI and containers write it: the same code run in two projects reads
    # each one's config, and one project's runs must not size the other's.
    code = "/opt/tools/train.sh configs/big.yaml"
    here = levels("bash", *options, code, cwd="/projA")
    assert here["script"] == levels("bash", "-c", code, cwd="/projA")["script"]
    assert here["script"].startswith("bash -c <") and here["script"].endswith("(in /projA)")
    assert here["script"] != levels("bash", *options, code, cwd="/projB")["script"]


def test_programs_named_by_a_path_are_resolved() -> None:
    assert levels("./bin/run", "a")["program"] == f"{CWD}/bin/run"
    assert levels("nvidia-smi")["program"] == "nvidia-smi"
    assert "script" not in levels("./bin/run", "a")


@pytest.mark.parametrize("home", ["/home/a", "/home/b"])
def test_a_literal_tilde_is_the_file_the_program_opens(
    monkeypatch: pytest.MonkeyPatch, home: str
) -> None:
    # No shell expanded it (quoted, or after `--script=`): Python opens ./~/train.py, and the
    # key names that file, whoever's HOME it is computed under; nothing is looked up.
    monkeypatch.setenv("HOME", home)
    assert levels("python", "~/train.py")["script"] == f"python '{CWD}/~/train.py'"
    assert levels("torchrun", "--script=~/x.py")["script"] == f"torchrun '{CWD}/~/x.py'"


def test_paths_with_spaces_stay_one_argument() -> None:
    assert levels("python", "my script.py", "a b")["command"] == (
        f"python '{CWD}/my script.py' 'a b'"
    )


def test_explicit_key_has_one_level() -> None:
    key = explicit_key("llama-7b-finetune")
    assert key.levels == (("key", "llama-7b-finetune"),)
    assert key.hashes()["key"] != command_key(["llama-7b-finetune"], CWD).hashes()["command"]


@given(st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=8))
def test_any_command_line_has_a_key_with_a_program(argv: list[str]) -> None:
    key = command_key(argv, CWD)
    names = [name for name, _ in key.levels]
    assert names[0] == "command" and names[-1] == "program"
    assert len(set(key.hashes().values())) == len(names)


@pytest.mark.parametrize(
    "argv",
    [
        ["python", "/shared/tools/run.py", "job.cfg"],
        ["python", "/shared/tools/run.py", "--config", "configs/big.yaml"],
        ["mytool", "--config=../exp.toml"],
    ],
)
def test_a_line_naming_a_relative_file_is_a_command_of_its_directory(argv: list[str]) -> None:
    # One shared script (or installed tool) reading each project's own config: project B's
    # run must not be sized by project A's runs as "this exact command".
    a = command_key(argv, "/home/me/projA").hashes()
    b = command_key(argv, "/home/me/projB").hashes()
    assert a["command"] != b["command"]


@pytest.mark.parametrize(
    "argv",
    [
        ["make", "train"],
        ["npm", "run", "train"],
        ["uv", "run", "train"],
        ["bash", "-c", "python train.py"],
        ["python", "-c", "from train import main; main()"],
    ],
)
def test_a_line_whose_code_its_directory_holds_is_a_command_of_its_directory(
    argv: list[str],
) -> None:
    # `make train` runs what each project's Makefile says, inline code names files relative
    # to where it runs: project B's 9 GiB run must not be sized by project A's 1 GiB runs
    # (at any level an estimate may come from; the program's never counts for these).
    a = command_key(argv, "/home/me/projA").hashes()
    b = command_key(argv, "/home/me/projB").hashes()
    assert a.keys() == b.keys()
    assert all(a[level] != b[level] for level in a if level != "program")


@pytest.mark.parametrize(
    "argv",
    [
        ["python", "/shared/tools/train.py", "--lr", "0.001", "--epochs", "3"],
        ["python", "/shared/tools/train.py", "--out", "s3://bucket/run", "--model", "/data/m.pt"],
    ],
)
def test_a_line_naming_no_relative_file_is_the_same_command_anywhere(argv: list[str]) -> None:
    a = command_key(argv, "/home/me/projA").hashes()
    assert a == command_key(argv, "/home/me/projB").hashes()


@pytest.mark.parametrize(
    ("argv", "typed"),
    [
        (["python"], True),
        (["python3", "-q"], True),
        (["python", "-"], True),
        (["bash", "-l"], True),
        (["ipython"], True),
        (["jupyter", "lab"], True),
        (["python", "train.py"], False),
        (["python", "-m", "torch.distributed.run", "--nproc_per_node", "2"], False),
        (["python", "-c", "import train"], False),
        (["bash", "job.sh"], False),
        (["make", "train"], False),
    ],
)
def test_code_typed_at_a_prompt_or_piped_in_is_told_apart(argv: list[str], typed: bool) -> None:
    assert command_key(argv, CWD).typed_in is typed


@pytest.mark.parametrize(
    ("argv", "hashes"),
    [
        (
            ["python", "train.py", "--epochs", "3"],
            {
                "command": "60fd3af9fea2359933a4",
                "script": "2619c4b7d27af3dfa129",
                "program": "b980f298278b6f293ed5",
            },
        ),
        (
            ["bash", "-lc", "python train.py"],
            {
                "command": "9400b33da894685c3603",
                "script": "491524ad18ab05711b92",
                "program": "fce3d7ea09302a6a9297",
            },
        ),
        (
            ["python", "-c", "import torch"],
            {
                "command": "54782c939ae4e65bc962",
                "script": "8570b10daf4c3394d408",
                "program": "b980f298278b6f293ed5",
            },
        ),
    ],
)
def test_keys_stay_those_the_history_already_holds(argv: list[str], hashes: dict[str, str]) -> None:
    # The history on disk is matched by these hashes: a release that computed others would
    # forget every run learned before it (inline code's hash is part of its key too).
    assert command_key(argv, CWD).hashes() == hashes


@pytest.mark.parametrize(
    ("argv", "command", "script", "typed"),
    [
        (
            ["python", "train.py", "--epochs", "3"],
            "60fd3af9fea2359933a4",
            "2619c4b7d27af3dfa129",
            False,
        ),
        (["python3", "-u", "train.py"], "07543732b294a737b414", "2619c4b7d27af3dfa129", False),
        (
            ["python3", "-uB", "train.py", "-x"],
            "d4687b1e4ce52363e20c",
            "2619c4b7d27af3dfa129",
            False,
        ),
        (
            ["python", "-W", "ignore", "-X", "dev", "train.py"],
            "07543732b294a737b414",
            "2619c4b7d27af3dfa129",
            False,
        ),
        (
            ["python", "-Wignore", "-Xdev", "train.py"],
            "07543732b294a737b414",
            "2619c4b7d27af3dfa129",
            False,
        ),
        (
            ["python", "--check-hash-based-pycs", "never", "train.py"],
            "07543732b294a737b414",
            "2619c4b7d27af3dfa129",
            False,
        ),
        (["python", "--version"], "19192639263a4f0f5af4", None, True),
        (
            ["python", "-m", "torch.distributed.run", "--nproc-per-node", "2", "train.py"],
            "7ddeb5639a2f1d359190",
            "2c617d1b4e4873742b11",
            False,
        ),
        (
            ["python3", "-Im", "pkg.train", "--lr", "0.1"],
            "0fe520c028db6e15a6c1",
            "613380a5c59949fcaaef",
            False,
        ),
        (["python3", "-mpkg.train"], "93991d8652d9393faef7", "613380a5c59949fcaaef", False),
        (
            ["python", "-m", "gpuwait", "--vram", "1G", "--", "python", "x.py"],
            "2fcaad3dedc28c341227",
            "e80764cb2e4b8405903a",
            False,
        ),
        (
            ["python", "-c", "import torch; print(1)", "a"],
            "40d254ffaf19a238092c",
            "2de991a0ed63b1589394",
            False,
        ),
        (["python", "-uc", "print(1)"], "280350eecbbf9c89fedb", "c9900a56129c81f155e1", False),
        (["python", "-cprint(1)"], "280350eecbbf9c89fedb", "c9900a56129c81f155e1", False),
        (["python", "-c"], "2faeea1aa196f9fc1100", "313d7d97e1316bf11c13", False),
        (["python", "-m"], "476a7ddc6e0c5065d47f", "50c8f9dc64de3ded5d98", False),
        (["python", "-"], "16cc40fc78af7b4474ea", "89f97355e1ee7e5e4bbf", True),
        (["python", "-", "arg"], "940cac997cd76ee7a7db", "89f97355e1ee7e5e4bbf", True),
        (["python", "-u", "-", "arg"], "940cac997cd76ee7a7db", "89f97355e1ee7e5e4bbf", True),
        (["python"], "19192639263a4f0f5af4", None, True),
        (["python", "-u"], "19192639263a4f0f5af4", None, True),
        (["python", "-X"], "19192639263a4f0f5af4", None, True),
        (["python", "--", "train.py"], "07543732b294a737b414", "2619c4b7d27af3dfa129", False),
        (
            ["pypy3", "-O", "bench.py", "job.cfg"],
            "e2b0b3b469a4f048774b",
            "da48d6946ea3bc5ed744",
            False,
        ),
        (
            ["python3.11t", "-E", "-s", "../x/run.py"],
            "3676acb2ae27bc3aae7d",
            "6fc38e4608002b77dad5",
            False,
        ),
        (["bash", "-c", "python x.py"], "72f550ed7fe289dbc6c7", "f431e592056f8efa5134", False),
        (
            ["torchrun", "--nproc-per-node", "2", "train.py"],
            "1603a6c3a65cfbd74a60",
            "a7e50ed9083fdaabcf5c",
            False,
        ),
    ],
)
def test_where_a_python_line_runs_its_code_keeps_the_keys_learned_so_far(
    argv: list[str], command: str, script: str | None, typed: bool
) -> None:
    # Each way of naming the script, the module, the code or none past the interpreter's
    # options, as the history already holds it: a key that changed would lose what was learned.
    key = command_key(argv, CWD)
    assert (key.hashes()["command"], key.hashes().get("script"), key.typed_in) == (
        command,
        script,
        typed,
    )
