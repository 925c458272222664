"""Commands run through wrappers (sudo, env, nice, timeout ...) that would undo what gpuwait
gives a job, end to end through the simulation backend."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

#: A stand-in for each wrapper: notes that it ran, and runs nothing.
FAKE = '#!/bin/sh\necho "$0 $*" >> {ran}\n'


def fake_bin(tmp_path: Path, *names: str) -> tuple[dict[str, str], Path]:
    ran = tmp_path / "ran"
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir(exist_ok=True)
    for name in names:
        program = bin_dir / name
        program.write_text(FAKE.format(ran=ran))
        program.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    return env, ran


def stand_in(tmp_path: Path, name: str, text: str) -> Path:
    """Installs the program `text` as `name` in fake_bin's directory."""
    program = tmp_path / "fakebin" / name
    program.write_text(text)
    program.chmod(0o755)
    return program


#: gpuwait's options for a job that can step aside.
PAUSABLE = ("--pausable", "--vram", "4G")

#: gpuwait's options for a job on GPU 1 alone, whose UUID reserved_uuid gives.
ON_GPU_1 = ("--vram", "4G", "--devices", "1")


def gpuwait(
    gpuwait_cmd: list[str],
    command: list[str],
    env: dict[str, str] | None = None,
    *,
    opts: Sequence[str] = ("--vram", "4G"),
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*gpuwait_cmd, *opts, "--", *command],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


def hint(refused: subprocess.CompletedProcess[str]) -> str:
    """What a refusal's hint gives after `gpuwait ... -- `, to the end of what it said."""
    return refused.stderr.split("gpuwait ... -- ", 1)[1]


def runs(
    gpuwait_cmd: list[str],
    line: str,
    env: dict[str, str] | None = None,
    *,
    opts: Sequence[str] = ("--vram", "4G"),
    cwd: Path | None = None,
) -> None:
    """Runs `line`, as a hint gives it, under gpuwait and `opts`: it ends with 0."""
    again = gpuwait(gpuwait_cmd, shlex.split(line), env, opts=opts, cwd=cwd)
    assert again.returncode == 0, again.stderr


#: The start of the refusal of a container engine's option that gives the container GPUs.
ENGINE_OPTION = "gpuwait: error: docker run gives the container the GPUs its own option names "


def ends(done: subprocess.CompletedProcess[str], ran: Path, status: int, refusal: str) -> None:
    """`done` ended with `status`: 0 having run its command, else refused, saying `refusal`
    first, and having run nothing."""
    assert done.returncode == status, done.stderr
    assert ran.exists() == (status == 0)
    if status:
        assert done.stderr.startswith(refusal), done.stderr


def with_nvidia_visible_devices(env: dict[str, str], value: str | None) -> dict[str, str]:
    """`env` with NVIDIA_VISIBLE_DEVICES set to `value`, or without it where that is None."""
    env = {name: was for name, was in env.items() if name != "NVIDIA_VISIBLE_DEVICES"}
    return env if value is None else {**env, "NVIDIA_VISIBLE_DEVICES": value}


def refused(done: subprocess.CompletedProcess[str], ran: Path, *said: str) -> None:
    """`done` was refused (2), saying each of `said`, and ran nothing."""
    assert done.returncode == 2, done.stderr
    for words in said:
        assert words in done.stderr, done.stderr
    assert not ran.exists()


def sim_uuids(sim: Path) -> list[str]:
    from gpuwait.gpu.sim import SimBackend

    return [g.uuid for g in SimBackend(str(sim)).snapshot().gpus]


def reserved_uuid(sim: Path) -> str:
    """The UUID of GPU 1, where a job run with ON_GPU_1 is."""
    return sim_uuids(sim)[1]


def ran_on_the_gpu_reserved(done: subprocess.CompletedProcess[str], seen: Path, sim: Path) -> None:
    """`done`, run with ON_GPU_1, ended with 0, its command writing to `seen` the
    CUDA_VISIBLE_DEVICES it got: the UUID of the GPU reserved."""
    assert done.returncode == 0, done.stderr
    assert seen.read_text().strip() == reserved_uuid(sim)


def seen_bare(
    line: Sequence[str], cwd: Path, base: dict[str, str] | None = None, **also: str
) -> str:
    """What `line`, run bare where gpuwait's GPU is set (CUDA_VISIBLE_DEVICES=GPU-own, and
    `also`), wrote to `seen`: what its command would have seen under gpuwait, whatever the
    shell said of it. The file is removed, for the line's next run."""
    own = {**(os.environ if base is None else base), "CUDA_VISIBLE_DEVICES": "GPU-own", **also}
    subprocess.run(list(line), env=own, cwd=cwd, timeout=60, capture_output=True)
    seen = cwd / "seen"
    text = seen.read_text().strip()
    seen.unlink()
    return text


@pytest.mark.parametrize(
    ("command", "kept"),
    [
        (
            ["sudo", "-u", "alice", "python", "x.py"],
            "sudo --preserve-env=CUDA_VISIBLE_DEVICES,CUDA_DEVICE_ORDER -u alice python x.py",
        ),
        (
            ["sudo", "python", "x.py"],
            "sudo --preserve-env=CUDA_VISIBLE_DEVICES,CUDA_DEVICE_ORDER python x.py",
        ),
        (
            ["nice", "-n", "5", "sudo", "-nu", "alice", "python"],
            "nice -n 5 sudo --preserve-env=CUDA_VISIBLE_DEVICES,CUDA_DEVICE_ORDER -nu alice python",
        ),
        (
            ["su", "-l", "alice", "-c", "python x.py"],
            "su -w CUDA_VISIBLE_DEVICES,CUDA_DEVICE_ORDER -l alice -c 'python x.py'",
        ),
        (
            ["runuser", "-", "alice", "-c", "python x.py"],
            "runuser -w CUDA_VISIBLE_DEVICES,CUDA_DEVICE_ORDER - alice -c 'python x.py'",
        ),
        (
            ["su", "alice", "-l", "-c", "python x.py"],
            "su -w CUDA_VISIBLE_DEVICES,CUDA_DEVICE_ORDER alice -l -c 'python x.py'",
        ),
        (["doas", "-u", "alice", "python", "x.py"], "doas ... gpuwait --vram SIZE -- COMMAND"),
        (["pkexec", "python", "x.py"], "pkexec ... gpuwait --vram SIZE -- COMMAND"),
        (
            ["env", "-i", "python", "x.py"],
            "keep CUDA_VISIBLE_DEVICES: gpuwait ... -- sh -c 'exec env -i "
            '"CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES" "CUDA_DEVICE_ORDER=$CUDA_DEVICE_ORDER" '
            "python x.py'",
        ),
        (["setpriv", "--reset-env", "python", "x.py"], "setpriv ... gpuwait --vram SIZE"),
        (["sg", "-", "video", "-c", "python x.py"], "sg ... gpuwait --vram SIZE"),
        (
            ["flock", "/tmp/l", "sudo", "python", "x.py"],
            "flock /tmp/l sudo --preserve-env=CUDA_VISIBLE_DEVICES,CUDA_DEVICE_ORDER python x.py",
        ),
        (["bash", "-c", "sudo python x.py && echo ok"], "sudo ... gpuwait --vram SIZE"),
        (["bash", "-c", 'doas "$PY" x.py'], "doas ... gpuwait --vram SIZE"),
        (["sh", "-c", 'setpriv --reset-env "$@"'], "setpriv ... gpuwait --vram SIZE"),
        (["bash", "-c", "exec sudo -u alice python x.py"], "sudo ... gpuwait --vram SIZE"),
        (["bash", "-c", "exec -c python x.py"], "leave out exec's -c"),
        (["sh", "-c", "PYTHONPATH=. sudo python x.py"], "sudo ... gpuwait --vram SIZE"),
        (["bash", "-c", "command sudo -u alice python x.py"], "sudo ... gpuwait --vram SIZE"),
    ],
)
def test_a_wrapper_that_drops_the_gpus_given_is_refused_with_what_to_type(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, command: list[str], kept: str
) -> None:
    # sudo's env_reset (on by default) drops CUDA_VISIBLE_DEVICES: `gpuwait -- sudo -u alice
    # python x.py` ran a job that saw every GPU and could allocate on one gpuwait had given
    # someone else. Refused before waiting, with the line that keeps the variables.
    env, ran = fake_bin(
        tmp_path, "sudo", "su", "runuser", "doas", "pkexec", "env", "nice", "setpriv", "sg"
    )
    env, _ = fake_bin(tmp_path, "flock", "bash", "sh")
    done = gpuwait(gpuwait_cmd, command, env)
    refused(
        done, ran, f"{_wrapper(command)} starts its command without the CUDA_VISIBLE_DEVICES", kept
    )
    assert "Traceback" not in done.stderr


def _wrapper(command: list[str]) -> str:
    """The wrapper of `command` that drops the variables (of a shell's code, its first)."""
    if command[0] in ("nice", "flock"):
        return "sudo"
    if command[0] in ("bash", "sh"):
        words = [w for w in command[2].split() if "=" not in w]
        return words[1] if words[0] in ("exec", "command") and words[1] != "-c" else words[0]
    return command[0]


@pytest.mark.parametrize(
    "command",
    [
        ["systemd-run", "--uid", "alice", "--wait", "python", "x.py"],
        ["systemd-run", "--user", "-E", "CUDA_VISIBLE_DEVICES", "python", "x.py"],
    ],
)
def test_systemd_run_is_refused_as_it_starts_the_command_in_a_unit_of_its_own(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, command: list[str]
) -> None:
    # The command runs in a unit systemd starts, no child of gpuwait's and without its
    # environment: it would see every GPU, and its job end as soon as systemd-run returns.
    env, ran = fake_bin(tmp_path, "systemd-run")
    done = gpuwait(gpuwait_cmd, command, env)
    refused(
        done,
        ran,
        "systemd-run starts its command in a unit of systemd's",
        "systemd-run ... gpuwait --vram SIZE -- COMMAND",
    )


@pytest.mark.parametrize(
    "command",
    [
        ["sudo", "-u", "alice", "python", "x.py"],
        ["env", "CUDA_VISIBLE_DEVICES=0", "python", "x.py"],
        ["srun", "-n1", "python", "x.py"],
        ["docker", "run", "--gpus", "all", "img", "python", "x.py"],
        ["apptainer", "exec", "--env", "CUDA_VISIBLE_DEVICES=0", "img.sif", "python", "x.py"],
        ["deepspeed", "--num_gpus", "2", "train.py"],
    ],
)
def test_a_refused_line_says_where_its_reason_is_written_up(
    sim: Path, gpuwait_cmd: list[str], command: list[str]
) -> None:
    # The refusal gave the line to type but never where such lines, and why, are written up.
    done = gpuwait(gpuwait_cmd, command)
    error, hint, *more = done.stderr.splitlines()
    assert (done.returncode, more) == (2, []), done.stderr
    section = "Command lines refused before waiting"
    assert error.startswith("gpuwait: error: "), done.stderr
    assert error.endswith(f"(see docs/usage.md, '{section}')"), done.stderr
    # The hint is still the line to type, and nothing after it.
    assert hint.startswith("gpuwait: hint: ") and "docs/" not in hint, done.stderr
    usage = Path(__file__).parents[2] / "docs" / "usage.md"
    assert f"### {section}\n" in usage.read_text(), "the section it names is gone"


@pytest.mark.parametrize(
    "command",
    [
        ["flock", "/tmp/l", "srun", "python", "x.py"],
        ["bash", "-lc", "srun python x.py > out.log"],
        ["sh", "-c", "srun -n2 python x.py"],
        ["sg", "video", "-c", "srun python x.py"],
        ["sh", "-c", "exec srun python x.py"],
        ["bash", "-c", "OMP_NUM_THREADS=4 srun python x.py"],
        ["bash", "-c", "command srun python x.py"],
        # A shell's -o among other options takes the next word, as CI writes it.
        ["bash", "-eo", "pipefail", "-c", "srun python x.py"],
        ["bash", "-euxo", "pipefail", "-c", "srun python x.py"],
        # zsh's -o takes its value glued on as well.
        ["zsh", "-opipefail", "-c", "srun python x.py"],
        # zsh's -O is a letter of its own (CORRECT_ALL) and takes no value; --emulate takes one.
        ["zsh", "-O", "-c", "srun python x.py"],
        ["zsh", "-Oc", "srun python x.py"],
        ["zsh", "--emulate", "sh", "-c", "srun python x.py"],
        # The code of flock -c, sg -c (and su -c) is a shell's, read as bash -c's is.
        ["flock", "/tmp/l", "-c", "srun python x.py && echo done"],
        ["sg", "video", "-c", "OMP_NUM_THREADS=4 srun python x.py"],
        # `gpuwait -- srun ...` is refused (its tasks get Slurm's CUDA_VISIBLE_DEVICES, not the
        # GPU gpuwait reserved); `env srun`, `time srun`, `nice srun`, `timeout 60 srun` ran.
        *(
            [*wrappers, "srun", "-n1", "python", "train.py"]
            for wrappers in (
                ["env"],
                ["env", "-u", "HOME", "OMP_NUM_THREADS=4"],
                ["env", "--", "OMP_NUM_THREADS=4"],
                ["time"],
                ["time", "-o", "t.txt"],
                ["nice"],
                ["nice", "-n", "5"],
                ["timeout", "60"],
                ["timeout", "-k", "5", "60"],
                ["nohup", "stdbuf", "-oL"],
                ["taskset", "-c", "0-3"],
                ["sudo", "-E", "-u", "alice"],
            )
        ),
        # Run as another user.
        ["su", "alice", "-c", "srun -n1 python train.py"],
        ["runuser", "-u", "alice", "--", "srun", "-n1", "python", "train.py"],
        ["sudo", "-k", "--preserve-env", "srun", "-n1", "python", "train.py"],
    ],
)
def test_srun_behind_a_wrapper_or_a_shells_first_word_is_refused(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, command: list[str]
) -> None:
    env, ran = fake_bin(
        tmp_path,
        *("flock", "bash", "sh", "sg", "srun", "env", "time", "nice", "timeout", "nohup"),
        *("stdbuf", "taskset", "sudo", "su", "runuser"),
    )
    done = gpuwait(gpuwait_cmd, command, env)
    refused(done, ran, "srun starts its tasks with Slurm's own CUDA_VISIBLE_DEVICES")


@pytest.mark.parametrize(
    "command",
    [
        ["sudo", "--preserve-env=CUDA_VISIBLE_DEVICES,CUDA_DEVICE_ORDER", "-u", "alice", "true"],
        ["sudo", "-Eu", "alice", "true"],
        ["sudo", "--preserve-env", "true"],
        ["su", "alice", "-c", "true"],
        ["su", "-l", "-w", "CUDA_VISIBLE_DEVICES", "alice", "-c", "true"],
        ["runuser", "-u", "alice", "--", "true"],
        ["env", "FOO=1", "true"],
        ["nice", "-n", "5", "true"],
        ["setpriv", "--reuid", "alice", "true"],
        ["systemd-run", "--scope", "true"],
        ["flock", "/tmp/l", "true"],
        ["bash", "-c", "true && true"],
        # Its options are not read past the expansion: they may well keep the variables.
        ["bash", "-c", "sudo --preserve-env=$KEEP true"],
        # sudo runs no command there: it asks for the password, or lists what one may run.
        ["bash", "-c", "sudo -v && true"],
        ["sh", "-c", "sudo -l; true"],
        ["bash", "-c", "sudo -k; true"],
        ["bash", "-c", "sudo -k\ntrue"],
        ["sh", "-c", "sudo -V && true"],
        ["bash", "-c", "doas -L; true"],
        ["bash", "-c", "exec -a trainer true"],
        # command -v looks the program up, and runs nothing.
        ["bash", "-c", "command -v sudo && true"],
        ["bash", "-c", "FOO=1 true"],
        # A gpuwait of its own, which gives its command GPUs of its own.
        ["env", "-u", "CUDA_VISIBLE_DEVICES", "gpuwait", "--vram", "1G", "--", "true"],
        ["sudo", "-u", "alice", sys.executable, "-m", "gpuwait", "--vram", "1G", "--", "true"],
        ["sudo", "-u", "alice", sys.executable, "-I", "-m", "gpuwait", "--", "true"],
        ["env", "-i", "python3", "-X", "utf8", "-m", "gpuwait", "--vram", "1G", "--", "true"],
        ["env", "-i", "python3", "-Im", "gpuwait", "--vram", "1G", "--", "true"],
        ["sudo", "-u", "alice", sys.executable, "-X", "dev", "-Im", "gpuwait", "--", "true"],
    ],
)
def test_a_wrapper_that_keeps_the_gpus_given_runs(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, command: list[str]
) -> None:
    env, ran = fake_bin(
        tmp_path,
        *("sudo", "su", "runuser", "env", "nice", "setpriv", "systemd-run", "flock", "bash", "sh"),
    )
    done = gpuwait(gpuwait_cmd, command, env)
    assert done.returncode == 0, done.stderr
    assert ran.exists()


@pytest.mark.skipif(shutil.which("sudo") is None or os.geteuid() != 0, reason="needs sudo, as root")
def test_the_line_the_refusal_gives_keeps_the_gpus_under_the_real_sudo(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    script = "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES'))"
    done = gpuwait(gpuwait_cmd, ["sudo", "-u", "root", sys.executable, "-c", script])
    assert done.returncode == 2, done.stderr
    keep = "--preserve-env=CUDA_VISIBLE_DEVICES,CUDA_DEVICE_ORDER"
    assert keep in done.stderr
    done = gpuwait(gpuwait_cmd, ["sudo", keep, "-u", "root", sys.executable, "-c", script])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith("GPU-"), done.stdout


_SRUN = (
    "srun starts its tasks with Slurm's own CUDA_VISIBLE_DEVICES",
    "run gpuwait inside the step instead: srun ... gpuwait --vram SIZE -- COMMAND",
)
_SUDO = (
    "sudo starts its command without the CUDA_VISIBLE_DEVICES gpuwait sets",
    "run gpuwait under it instead: sudo ... gpuwait --vram SIZE -- COMMAND",
)


@pytest.mark.parametrize(
    ("command", "refused"),
    [
        # bash's builtin, and zsh's precommand modifiers: the command after them runs.
        (["bash", "-c", "builtin exec srun python x.py"], _SRUN),
        (["zsh", "-c", "builtin exec sudo -u alice python x.py"], _SUDO),
        (["zsh", "-c", "noglob srun python x.py"], _SRUN),
        (["zsh", "-c", "nocorrect sudo -u alice python x.py"], _SUDO),
        (["zsh", "-c", "--", "- srun python x.py"], _SRUN),
        (["zsh", "-c", "nocorrect - sudo python x.py"], _SUDO),
        (["zsh", "-c", "command sudo python x.py"], _SUDO),
        (["bash", "-c", "builtin echo ok; true"], None),
        # A line's end ends a shell's first command, as ; does.
        (["bash", "-c", "sudo -k\ntrue"], None),
        (["sh", "-c", "\nsrun python x.py\necho done"], _SRUN),
        # sg GROUP CMD runs CMD with /bin/sh, given -c before it or not.
        (["sg", "video", "srun python x.py"], _SRUN),
        (["sg", "video", "sudo -u alice python x.py"], _SUDO),
        (["sg", "video", "true"], None),
        # sudo -h alone is its help; with a host it lists what may run there, and given a
        # command says 'a remote host may only be specified when listing privileges' (exit 1):
        # neither runs a command.
        (["sudo", "-h"], None),
        (["bash", "-c", "sudo -h && true"], None),
        (["sudo", "-h", "-u", "alice", "python", "x.py"], None),
        (["sudo", "-h", "gpuhost", "python", "x.py"], None),
        (["sudo", "--host=gpuhost", "-u", "alice", "python", "x.py"], None),
        (["sudo", "-h", "gpuhost", "srun", "python", "x.py"], None),
    ],
)
def test_what_a_shell_runs_past_its_builtins_and_modifiers_is_judged(
    sim: Path,
    gpuwait_cmd: list[str],
    tmp_path: Path,
    command: list[str],
    refused: tuple[str, str] | None,
) -> None:
    env, ran = fake_bin(tmp_path, "bash", "zsh", "sh", "sg", "sudo", "srun")
    done = gpuwait(gpuwait_cmd, command, env)
    if refused is None:
        assert done.returncode == 0, done.stderr
        assert ran.exists()
        return
    assert done.returncode == 2, done.stderr
    assert refused[0] in done.stderr and refused[1] in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert not ran.exists()


@pytest.mark.parametrize(
    ("command", "hint"),
    [
        (
            ["sudo", "--preserve-env=CUDA_VISIBLE_DEVICES", "-u", "alice", "true"],
            "keep them: gpuwait ... -- "
            "sudo --preserve-env=CUDA_VISIBLE_DEVICES,CUDA_DEVICE_ORDER -u alice true\n",
        ),
        (
            ["su", "-l", "-w", "CUDA_VISIBLE_DEVICES", "alice", "-c", "true"],
            "keep them: gpuwait ... -- su -l -w CUDA_VISIBLE_DEVICES,CUDA_DEVICE_ORDER alice -c true\n",
        ),
        (
            ["runuser", "-l", "--whitelist-environment=HOME,CUDA_VISIBLE_DEVICES", "alice"],
            "keep them: gpuwait ... -- "
            "runuser -l --whitelist-environment=HOME,CUDA_VISIBLE_DEVICES,CUDA_DEVICE_ORDER alice\n",
        ),
        (
            ["env", "-u", "CUDA_DEVICE_ORDER", "true"],
            "keep CUDA_DEVICE_ORDER: gpuwait ... -- env true",
        ),
    ],
)
def test_a_wrapper_that_drops_the_order_of_gpu_indices_is_refused(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, command: list[str], hint: str
) -> None:
    # With visible_devices = index, CUDA_VISIBLE_DEVICES names NVML's (PCI-ordered) index,
    # which CUDA reads in its own fastest-first order unless CUDA_DEVICE_ORDER=PCI_BUS_ID
    # comes with it: a wrapper keeping the one and not the other puts the job, on a machine of
    # two kinds of GPU, on a card gpuwait did not give it. With UUIDs the same line runs.
    # The hint extends the list given: it added a second list naming both variables before it
    # ('sudo --preserve-env=CUDA_VISIBLE_DEVICES,CUDA_DEVICE_ORDER
    # --preserve-env=CUDA_VISIBLE_DEVICES -u alice true').
    env, ran = fake_bin(tmp_path, "sudo", "su", "runuser", "env")
    done = gpuwait(gpuwait_cmd, command, {**env, "GPUWAIT_VISIBLE_DEVICES": "index"})
    refused(done, ran, f"{command[0]} starts its command without the CUDA_DEVICE_ORDER", hint)
    assert "Traceback" not in done.stderr
    done = gpuwait(gpuwait_cmd, command, env)
    assert done.returncode == 0, done.stderr
    assert ran.exists()


@pytest.mark.parametrize(
    ("command", "given"),
    [
        (["docker", "run", "--gpus", "all", "img", "python", "x.py"], "--gpus all"),
        (["docker", "run", "--rm", "-it", "--gpus=2", "img", "python", "x.py"], "--gpus=2"),
        (["docker", "run", "--gpus", "device=1", "img"], "--gpus device=1"),
        (["docker", "--context", "lab", "container", "run", "--gpus", "all", "img"], "--gpus all"),
        (
            ["docker", "run", "--runtime=nvidia", "-e", "NVIDIA_VISIBLE_DEVICES=all", "img"],
            "--runtime=nvidia",
        ),
        (["podman", "run", "--device", "nvidia.com/gpu=all", "img"], "--device nvidia.com/gpu=all"),
        (["nerdctl", "run", "--gpus", "all", "img", "python", "x.py"], "--gpus all"),
        (
            ["docker", "run", "--device", "/dev/nvidia0", "img", "python", "x.py"],
            "--device /dev/nvidia0",
        ),
        (["nice", "docker", "run", "-v", "/d:/d", "--gpus", "all", "img"], "--gpus all"),
        (["sudo", "-u", "alice", "docker", "run", "--gpus", "all", "img"], "--gpus all"),
        (["sh", "-c", "docker run --gpus all img && echo done"], "--gpus all"),
        # The shell's code stops being plain at `$TAG`, just after `-e`: the GPUs before it
        # are the container's all the same.
        (["sh", "-c", 'docker run --gpus all -e "$TAG" img'], "--gpus all"),
    ],
)
def test_a_container_given_gpus_of_its_own_is_refused_with_what_to_type(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, command: list[str], given: str
) -> None:
    # Docker and podman pass no CUDA_VISIBLE_DEVICES into the container: `gpuwait --vram 8G --
    # docker run --gpus all IMAGE python x.py` ran the container on every GPU, those gpuwait
    # had given other jobs too. Refused before waiting, with the line that gives it the
    # reserved GPU alone.
    env, ran = fake_bin(tmp_path, "docker", "podman", "nerdctl", "nice", "sudo", "sh")
    done = gpuwait(gpuwait_cmd, command, env)
    assert done.returncode == 2, done.stderr
    assert f"({given})" in done.stderr
    assert "GPUWAIT_GPU_UUIDS" in done.stderr
    if command[0] == "nice":
        assert (
            "gpuwait ... -- sh -c 'exec nice docker run -v /d:/d --gpus "
            '"\\"device=$GPUWAIT_GPU_UUIDS\\"" img\'' in done.stderr
        )
    assert "Traceback" not in done.stderr
    assert not ran.exists()


@pytest.mark.parametrize(
    "command",
    [
        ["docker", "run", "--gpus", "all", "img", "python", "x.py"],
        ["srun", "python", "x.py"],
        ["sudo", "-u", "alice", "python", "x.py"],
    ],
)
def test_a_refused_line_is_refused_where_its_program_is_not_installed(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, command: list[str]
) -> None:
    # On a machine without docker, `gpuwait --vram 4G -- docker run --gpus all img ...` said
    # "docker: command not found" (127), and the refusal only came once docker was installed:
    # the line is wrong either way, and the refusal says how to write it.
    empty = tmp_path / "empty"
    empty.mkdir()
    done = gpuwait(gpuwait_cmd, command, {**os.environ, "PATH": str(empty)})
    assert done.returncode == 2, done.stderr
    assert "command not found" not in done.stderr
    assert "hint:" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "command",
    [
        ["docker", "ps"],
        ["docker", "run", "--rm", "img", "python", "x.py", "--gpus", "2"],
        ["docker", "run", "-e", "NVIDIA_VISIBLE_DEVICES=void", "--runtime", "nvidia", "img"],
        ["docker", "run", "--name", "--gpus", "img"],
        ["podman", "build", "--device", "nvidia.com/gpu=all", "."],
        ["sh", "-c", 'docker run --gpus "device=$GPUWAIT_GPU_UUIDS" img'],
        ["apptainer", "exec", "--nv", "--env", "OMP_NUM_THREADS=4", "img.sif", "python"],
        ["apptainer", "exec", "--nv", "img.sif", "prog", "--env", "CUDA_VISIBLE_DEVICES=0"],
        ["singularity", "exec", "-B", "--env", "img.sif", "python"],
    ],
)
def test_a_container_engine_giving_no_gpus_of_its_own_runs(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, command: list[str]
) -> None:
    env, ran = fake_bin(tmp_path, "docker", "podman", "sh", "apptainer", "singularity")
    done = gpuwait(gpuwait_cmd, command, env)
    assert done.returncode == 0, done.stderr
    assert ran.exists()


def test_nvidia_docker_is_refused_for_the_runtime_it_adds(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # `gpuwait --vram 4G -- nvidia-docker run IMG python x.py` ran the container on every GPU:
    # nvidia-docker adds the NVIDIA runtime, which gives a CUDA image every GPU, those given
    # to other jobs too.
    env, ran = fake_bin(tmp_path, "docker", "nvidia-docker")
    done = gpuwait(gpuwait_cmd, ["nvidia-docker", "run", "--rm", "img", "python", "x.py"], env)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("gpuwait: error: nvidia-docker run gives the container ")
    assert (
        "gpuwait ... -- sh -c 'exec docker run --gpus "
        '"\\"device=$GPUWAIT_GPU_UUIDS\\"" --rm img python x.py\'' in done.stderr
    )
    assert not ran.exists()


@pytest.mark.parametrize(
    "line",
    [
        ["sh", "-c", 'exec nvidia-docker run "$@"', "nvidia-docker", "img", "python", "x.py"],
        ["nvidia-docker", "run"],
    ],
)
def test_nvidia_docker_with_no_word_after_run_is_refused_without_a_traceback(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, line: list[str]
) -> None:
    # `gpuwait --vram 4G -- sh -c 'exec nvidia-docker run "$@"' nvidia-docker img python x.py`,
    # a wrapper script's way, ended in a traceback, exit 1: with no word read after `run`, the
    # runtime nvidia-docker adds was placed past the end of its words, and the word there
    # looked up. It is refused as `nvidia-docker run img` is, exit 2, without a traceback.
    env, ran = fake_bin(tmp_path, "docker", "nvidia-docker")
    done = gpuwait(gpuwait_cmd, line, env)
    refused(done, ran, "gpuwait: error: nvidia-docker run gives the container the GPUs of the")
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(("value", "status"), [("all", 2), (None, 0), ("none", 0)])
def test_a_container_passed_the_callers_nvidia_visible_devices_is_refused_where_it_names_gpus(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, value: str | None, status: int
) -> None:
    # Inside a CUDA image (NVIDIA_VISIBLE_DEVICES=all), `gpuwait --vram 4G -- docker run -e
    # NVIDIA_VISIBLE_DEVICES img` ran the container, which the NVIDIA runtime gives every GPU:
    # without a value, -e passes the caller's on, and only -e NVIDIA_VISIBLE_DEVICES=all was
    # refused.
    env, ran = fake_bin(tmp_path, "docker")
    env = with_nvidia_visible_devices(env, value)
    done = gpuwait(gpuwait_cmd, ["docker", "run", "-e", "NVIDIA_VISIBLE_DEVICES", "img"], env)
    ends(done, ran, status, f"{ENGINE_OPTION}(-e NVIDIA_VISIBLE_DEVICES)")


def test_nvidia_docker_under_nv_gpu_is_refused_for_the_gpus_nv_gpu_names(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # NV_GPU=1 gpuwait --vram 4G -- nvidia-docker run IMG ...: nvidia-docker gives the
    # container GPU 1 (NVIDIA_VISIBLE_DEVICES=$NV_GPU), not every GPU, which the refusal said;
    # it did not say that NV_GPU names no GPU of the job's.
    env, ran = fake_bin(tmp_path, "docker", "nvidia-docker")
    done = gpuwait(gpuwait_cmd, ["nvidia-docker", "run", "img"], {**env, "NV_GPU": "1"})
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(
        "gpuwait: error: nvidia-docker run gives the container the GPUs NV_GPU names "
        "(NV_GPU=1), not the one gpuwait reserves: "
    ), done.stderr
    assert "exec docker run --gpus" in done.stderr
    assert not ran.exists()


@pytest.mark.parametrize(
    "command",
    [
        ["sudo", "docker", "run", "--gpus", "all", "img", "python", "x.py"],
        ["sudo", "-u", "alice", "docker", "run", "--gpus", "all", "img"],
        ["doas", "podman", "run", "--device", "nvidia.com/gpu=all", "img"],
        ["sudo", "nerdctl", "run", "--gpus", "all", "img"],
        ["nvidia-docker", "run", "--rm", "img", "python", "x.py"],
        ["sudo", "nvidia-docker", "run", "img"],
        ["env", "-i", "docker", "run", "--runtime=nvidia", "img"],
    ],
)
def test_the_line_a_container_refusal_gives_runs(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, command: list[str]
) -> None:
    # Run as root (sudo docker, where the user is not in the docker group), the line the
    # refusal gave was refused in turn for the wrapper that keeps no CUDA_VISIBLE_DEVICES,
    # which the engine does not pass into the container anyway.
    env, ran = fake_bin(
        tmp_path, "docker", "podman", "nerdctl", "nvidia-docker", "sudo", "doas", "env", "sh"
    )
    done = gpuwait(gpuwait_cmd, command, env)
    assert done.returncode == 2, done.stderr
    runs(gpuwait_cmd, hint(done).rsplit(" (", 1)[0], env)
    assert ran.exists()


@pytest.mark.parametrize(
    "command",
    [
        ["sudo", "-u", "alice", "sh", "-c", "docker pull img && python x.py"],
        ["env", "-i", "bash", "-c", "docker ps; python x.py"],
        ["sudo", "su", "-c", "podman pull img; python x.py"],
    ],
)
def test_a_wrapper_before_a_shell_that_runs_more_than_an_engine_is_refused(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, command: list[str]
) -> None:
    # The engine only opens the shell's code: the python run after it, under the wrapper
    # that drops CUDA_VISIBLE_DEVICES, would see every GPU.
    env, ran = fake_bin(tmp_path, "docker", "podman", "sudo", "su", "env", "sh", "bash")
    done = gpuwait(gpuwait_cmd, command, env)
    refused(done, ran, "starts its command without the CUDA_VISIBLE_DEVICES")
    assert "Traceback" not in done.stderr


#: A stand-in for `apptainer exec [OPTIONS] IMAGE CMD...` (singularity's too) that sets the
#: container's environment as Apptainer does: its APPTAINERENV_ variables, prefix taken off,
#: over the caller's; then what its --env-file files and --env options set, over those (its
#: launcher turns them into APPTAINERENV_ variables before reading the environment, --env
#: winning over a file). The command's CUDA_VISIBLE_DEVICES is written to the file SEEN names.
APPTAINER_ENV = """#!/usr/bin/env python3
import os, sys
prefix = os.path.basename(sys.argv[0]).upper() + "ENV_"
env = dict(os.environ)
env.update({k[len(prefix):]: v for k, v in os.environ.items() if k.startswith(prefix)})
words, files, given = sys.argv[2:], [], {}
while words[0].startswith("-"):
    name, glue, value = words.pop(0).partition("=")
    if name in ("--env", "--env-file") and not glue:
        value = words.pop(0)
    if name == "--env":
        # NAME=A,B is one variable (pflag's StringToString); A=1,B=2 two.
        pairs = [value] if value.count("=") == 1 else value.split(",")
        given.update(pair.split("=", 1) for pair in pairs)
    elif name == "--env-file":
        files += [line.split("=", 1) for line in open(value).read().split()]
env.update({**dict(files), **given})
with open(os.environ["SEEN"], "w") as seen:
    seen.write(env.get("CUDA_VISIBLE_DEVICES", ""))
"""


@pytest.mark.parametrize(
    ("options", "given"),
    [
        (["--env", "CUDA_VISIBLE_DEVICES=0"], "--env CUDA_VISIBLE_DEVICES=0"),
        (["--env=OMP_NUM_THREADS=4,CUDA_VISIBLE_DEVICES=0"], "CUDA_VISIBLE_DEVICES=0"),
        (["--env-file", "{dir}/job.env"], "--env-file {dir}/job.env"),
        # After an option whose value is a word of its own (--no-mount's list of mounts).
        (["--no-mount", "tmp", "--env", "CUDA_VISIBLE_DEVICES=0"], "--env CUDA_VISIBLE_DEVICES=0"),
        # After short options run together, the last taking the next word (-e, then -B /data).
        (["-eB", "/data", "--env", "CUDA_VISIBLE_DEVICES=0"], "--env CUDA_VISIBLE_DEVICES=0"),
    ],
)
def test_an_apptainer_option_naming_the_containers_gpus_is_refused_with_what_to_type(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, options: list[str], given: str
) -> None:
    # Apptainer's --env and --env-file set the container's variables over its APPTAINERENV_
    # ones: `gpuwait --vram 4G -- apptainer exec --nv --env CUDA_VISIBLE_DEVICES=0 img.sif
    # python x.py` ran on GPU 0, whichever GPU gpuwait had reserved, beside the jobs there.
    (tmp_path / "job.env").write_text("OMP_NUM_THREADS=4\nCUDA_VISIBLE_DEVICES=0\n")
    options = [word.format(dir=tmp_path) for word in options]
    env, _ = fake_bin(tmp_path)
    for engine in ("apptainer", "singularity"):
        stand_in(tmp_path, engine, APPTAINER_ENV)
    seen = tmp_path / "seen"
    env = {**env, "SEEN": str(seen)}
    command = ["apptainer", "exec", "--nv", *options, "img.sif", "python", "x.py"]
    done = gpuwait(gpuwait_cmd, command, env, opts=ON_GPU_1)
    assert done.returncode == 2, (done.stderr, seen.exists() and seen.read_text())
    assert given.format(dir=tmp_path) in done.stderr
    assert "Traceback" not in done.stderr
    assert not seen.exists()
    # The line the refusal gives runs the container on the reserved GPU.
    runs(gpuwait_cmd, hint(done).splitlines()[0].rsplit(" (", 1)[0], env, opts=ON_GPU_1)
    assert seen.read_text() == reserved_uuid(sim)


def test_an_apptainer_option_setting_the_order_of_gpu_indices_is_refused_under_index(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # With visible_devices = index, the container's CUDA reads the index gpuwait gives in the
    # order CUDA_DEVICE_ORDER says: --env CUDA_DEVICE_ORDER=FASTEST_FIRST could name a GPU
    # given to another job. The refusal names that variable, not CUDA_VISIBLE_DEVICES.
    env, ran = fake_bin(tmp_path, "apptainer")
    command = ["apptainer", "exec", "--env", "CUDA_DEVICE_ORDER=FASTEST_FIRST", "i.sif", "x"]
    done = gpuwait(gpuwait_cmd, command, {**env, "GPUWAIT_VISIBLE_DEVICES": "index"})
    refused(
        done,
        ran,
        "container's CUDA_DEVICE_ORDER with its own option",
        "gpuwait ... -- apptainer exec i.sif x",
    )
    assert gpuwait(gpuwait_cmd, command, env).returncode == 0


@pytest.mark.parametrize(
    ("options", "given", "kept"),
    [
        (["--containall"], "--containall", "--contain --cleanenv --ipc"),
        (["-C"], "-C", "--contain --cleanenv --ipc"),
        (["--pid", "--cleanenv"], "--pid", "--cleanenv"),
        (["--cwd", "/w", "-C"], "-C", "--cwd /w --contain --cleanenv --ipc"),
        # Given a value, as Go's flags take one: the hint gave no line for them.
        (["--containall=true"], "--containall", "--contain --cleanenv --ipc"),
        (["--pid=1", "--cleanenv"], "--pid", "--cleanenv"),
        # --compat is --containall with --no-init, --no-umask, --no-eval and --writable-tmpfs.
        (
            ["--compat"],
            "--compat",
            "--contain --cleanenv --ipc --no-init --no-umask --no-eval --writable-tmpfs",
        ),
    ],
)
def test_a_pausable_job_in_an_apptainer_pid_namespace_is_refused_with_what_to_type(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, options: list[str], given: str, kept: str
) -> None:
    # In the PID namespace of `apptainer exec --containall` (or --pid), the program cannot see
    # the gpuwait above it, and gpuwait.checkpoint takes its job for ended: it catches no
    # checkpoint signal, which Apptainer's starter passes on all the same, and the job died of
    # it once a waiter asked it to step aside.
    env, ran = fake_bin(tmp_path, "apptainer")
    command = ["apptainer", "exec", "--nv", *options, "img.sif", "python", "x.py"]
    done = gpuwait(gpuwait_cmd, command, env, opts=PAUSABLE)
    refused(
        done, ran, f"({given})", f"gpuwait ... -- apptainer exec --nv {kept} img.sif python x.py"
    )
    assert "Traceback" not in done.stderr
    # A job that is not pausable runs there as before.
    assert gpuwait(gpuwait_cmd, command, env).returncode == 0


#: A stand-in for `apptainer exec --nvccli [--contain|--containall] IMAGE CMD...`: with
#: --contain (-c, --containall, -C), nvidia-container-cli binds in only the GPUs the caller's
#: NVIDIA_VISIBLE_DEVICES names (indices or UUIDs, `all`), none where it is unset (Apptainer's
#: GPU page, "GPU Selection"); without, every GPU. The container's CUDA numbers those it has
#: in PCI order and takes the one its CUDA_VISIBLE_DEVICES (APPTAINERENV_) names, by UUID or
#: by its own index; its UUID is written to the file SEEN names, or the command fails as CUDA
#: does with no such device. GPUS: the machine's GPU UUIDs, in PCI order.
NVCCLI = """#!/usr/bin/env python3
import os, sys
gpus = os.environ["GPUS"].split(",")
contained = any(w in ("-c", "--contain", "-C", "--containall") for w in sys.argv)
named = os.environ.get("NVIDIA_VISIBLE_DEVICES", "")
if not contained or named == "all":
    bound = gpus
else:
    wanted = [w for w in named.split(",") if w not in ("", "none", "void")]
    bound = [g for i, g in enumerate(gpus) if str(i) in wanted or g in wanted]
asked = os.environ["APPTAINERENV_CUDA_VISIBLE_DEVICES"].split(",")[0]
found = [g for g in bound if g == asked] or [
    g for i, g in enumerate(bound) if asked.isdigit() and i == int(asked)
]
if not found:
    sys.exit("RuntimeError: No CUDA GPUs are available")
with open(os.environ["SEEN"], "w") as seen:
    seen.write(found[0])
"""


@pytest.mark.parametrize("contain", ["--containall", "-c"])
def test_apptainer_nvccli_in_a_contained_container_without_nvidia_visible_devices_is_refused(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, contain: str
) -> None:
    # `apptainer exec --nvccli --containall` binds in the GPUs NVIDIA_VISIBLE_DEVICES names,
    # and none where it is unset: the job waited its turn, then failed, 'No CUDA GPUs are
    # available' (exit 1). Refused before waiting, with the line that binds in the reserved
    # GPU, which the container's CUDA then takes.
    env, _ = fake_bin(tmp_path)
    stand_in(tmp_path, "apptainer", NVCCLI)
    seen = tmp_path / "seen"
    env = {**env, "SEEN": str(seen), "GPUS": ",".join(sim_uuids(sim))}
    env.pop("NVIDIA_VISIBLE_DEVICES", None)
    command = ["apptainer", "exec", "--nvccli", contain, "img.sif", "python", "x.py"]
    done = gpuwait(gpuwait_cmd, command, env, opts=ON_GPU_1)
    assert done.returncode == 2, done.stderr
    assert "NVIDIA_VISIBLE_DEVICES" in done.stderr
    assert "Traceback" not in done.stderr
    assert not seen.exists()
    runs(gpuwait_cmd, hint(done).splitlines()[0], env, opts=ON_GPU_1)
    assert seen.read_text() == reserved_uuid(sim)
    # Where NVIDIA_VISIBLE_DEVICES=all binds in every GPU, it runs, on the reserved one.
    seen.unlink()
    done = gpuwait(gpuwait_cmd, command, {**env, "NVIDIA_VISIBLE_DEVICES": "all"}, opts=ON_GPU_1)
    assert done.returncode == 0, done.stderr
    assert seen.read_text() == reserved_uuid(sim)


#: A stand-in for sudo's env_reset: the command gets PATH and what --preserve-env=LIST names
#: (everything with -E or a bare --preserve-env); -u USER is read and left alone. SEEN, where
#: APPTAINER_ENV writes, is the test's and always kept.
SUDO_ENV = """#!/usr/bin/env python3
import os, sys
words, keep = sys.argv[1:], None
while words[0].startswith("-"):
    word = words.pop(0)
    if word == "-u":
        words.pop(0)
    elif word in ("-E", "--preserve-env"):
        keep = "all"
    elif word.startswith("--preserve-env="):
        keep = word.partition("=")[2].split(",")
env = dict(os.environ) if keep == "all" else {"PATH": os.environ["PATH"], "SEEN": os.environ["SEEN"]}
for name in keep if isinstance(keep, list) else ():
    if name in os.environ:
        env[name] = os.environ[name]
os.execvpe(words[0], words, env)
"""

#: APPTAINER_ENV's container, given --cleanenv (-e, --containall, -C): the caller's
#: environment left out, its APPTAINERENV_ variables alone passed in.
APPTAINER_CLEANENV = APPTAINER_ENV.replace(
    "env = dict(os.environ)\n",
    "clean = {'--cleanenv', '-e', '--containall', '-C'} & set(sys.argv)\n"
    "env = {} if clean else dict(os.environ)\n",
)


def test_a_wrapper_keeping_only_the_gpu_variables_before_a_clean_apptainer_is_refused(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # `apptainer exec --cleanenv` takes the container's CUDA_VISIBLE_DEVICES from the
    # APPTAINERENV_ copy gpuwait sets, which `sudo --preserve-env=CUDA_VISIBLE_DEVICES,...`
    # (the line sudo's refusal gave) dropped: the container saw every GPU, those given to other
    # jobs too. The refusal's line keeps the copy, and runs on the reserved GPU.
    env, _ = fake_bin(tmp_path)
    for name, text in (("sudo", SUDO_ENV), ("apptainer", APPTAINER_CLEANENV)):
        stand_in(tmp_path, name, text)
    seen = tmp_path / "seen"
    env = {**env, "SEEN": str(seen)}

    def run(command: list[str]) -> subprocess.CompletedProcess[str]:
        return gpuwait(gpuwait_cmd, command, env, opts=ON_GPU_1)

    apptainer = ["apptainer", "exec", "--nv", "--cleanenv", "img.sif", "python", "x.py"]
    kept = "--preserve-env=CUDA_VISIBLE_DEVICES,CUDA_DEVICE_ORDER"
    done = run(["sudo", kept, *apptainer])
    assert done.returncode == 2, (done.stderr, seen.exists() and seen.read_text())
    assert "sudo starts its command without the APPTAINERENV_CUDA_VISIBLE_DEVICES" in done.stderr
    assert "Traceback" not in done.stderr
    assert not seen.exists()
    # The line the refusal of plain sudo gives runs the container on the reserved GPU.
    done = run(["sudo", *apptainer])
    assert done.returncode == 2, done.stderr
    runs(gpuwait_cmd, hint(done).splitlines()[0], env, opts=ON_GPU_1)
    assert seen.read_text() == reserved_uuid(sim)
    # Without --cleanenv the container takes the caller's CUDA_VISIBLE_DEVICES, which sudo kept.
    seen.unlink()
    plain = [word for word in apptainer if word != "--cleanenv"]
    assert run(["sudo", kept, *plain]).returncode == 0
    assert seen.read_text() == reserved_uuid(sim)


#: A stand-in for `apptainer exec --env-file FILE ...` that writes what it reads of FILE to the
#: file SEEN names.
APPTAINER_ENV_FILE = """#!/bin/sh
while [ $# -gt 0 ]; do
    [ "$1" = --env-file ] && cat "$2" > "$SEEN"
    shift
done
"""


def test_an_apptainer_env_file_that_is_a_pipe_reaches_the_container_whole(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # `--env-file <(...)` names a pipe: gpuwait read it through for CUDA_VISIBLE_DEVICES before
    # Apptainer did, and the container got none of the variables it set.
    env, _ = fake_bin(tmp_path)
    stand_in(tmp_path, "apptainer", APPTAINER_ENV_FILE)
    seen = tmp_path / "seen"
    line = shlex.join([*gpuwait_cmd, "--vram", "4G", "--", "apptainer", "exec", "--env-file"])
    done = subprocess.run(
        ["bash", "-c", f"{line} <(echo OMP_NUM_THREADS=4) img.sif python x.py"],
        env={**env, "SEEN": str(seen)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert seen.read_text() == "OMP_NUM_THREADS=4\n"


@pytest.mark.parametrize(
    ("command", "setter", "word"),
    [
        (["env", "CUDA_VISIBLE_DEVICES=0", "true"], "env", "CUDA_VISIBLE_DEVICES=0"),
        (
            ["env", "-C", "/", "--", "CUDA_VISIBLE_DEVICES=1", "true"],
            "env",
            "CUDA_VISIBLE_DEVICES=1",
        ),
        (
            [
                "env",
                "APPTAINERENV_CUDA_VISIBLE_DEVICES=0",
                "apptainer",
                "exec",
                "--nv",
                "i",
                "true",
            ],
            "env",
            "APPTAINERENV_CUDA_VISIBLE_DEVICES=0",
        ),
        (
            ["nice", "-n", "5", "timeout", "1h", "env", "CUDA_VISIBLE_DEVICES=0", "true"],
            "env",
            "CUDA_VISIBLE_DEVICES=0",
        ),
        (
            ["setsid", "nohup", "env", "CUDA_VISIBLE_DEVICES=0", "true"],
            "env",
            "CUDA_VISIBLE_DEVICES=0",
        ),
        (["sudo", "-E", "CUDA_VISIBLE_DEVICES=0", "true"], "sudo", "CUDA_VISIBLE_DEVICES=0"),
        (["sudo", "-u", "bob", "CUDA_VISIBLE_DEVICES=0", "true"], "sudo", "CUDA_VISIBLE_DEVICES=0"),
        (["sh", "-c", "CUDA_VISIBLE_DEVICES=0 true"], "sh", "CUDA_VISIBLE_DEVICES=0"),
        (["bash", "-c", "export CUDA_VISIBLE_DEVICES=0\ntrue"], "bash", "CUDA_VISIBLE_DEVICES=0"),
    ],
)
def test_a_wrapper_that_sets_the_gpus_itself_is_refused_with_what_to_type(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, command: list[str], setter: str, word: str
) -> None:
    # `gpuwait --vram 4G -- env CUDA_VISIBLE_DEVICES=0 python x.py` ran the command on GPU 0
    # while gpuwait had reserved GPU 1 for it, and GPU 0 for nobody or another job, which
    # then ran out of memory; so did `sh -c 'CUDA_VISIBLE_DEVICES=0 ...'`, `sudo -E
    # CUDA_VISIBLE_DEVICES=0 ...` and an APPTAINERENV_ copy, which the container takes over
    # the caller's. Refused before waiting, the hint the line without it, which runs.
    env, ran = fake_bin(tmp_path, "env", "nice", "timeout", "setsid", "nohup", "sudo", "apptainer")
    env, _ = fake_bin(tmp_path, "sh", "bash")
    done = gpuwait(gpuwait_cmd, command, env)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(
        f"gpuwait: error: {setter} sets {shlex.quote(word)} for its command, over the "
        "CUDA_VISIBLE_DEVICES gpuwait sets: it would run on GPUs gpuwait did not give it"
    ), done.stderr
    assert "Traceback" not in done.stderr
    assert not ran.exists()
    if setter in ("sh", "bash"):
        assert "set CUDA_VISIBLE_DEVICES nowhere in the command" in done.stderr
        return
    line = hint(done).split(";", 1)[0].strip()
    assert word not in shlex.split(line)
    runs(gpuwait_cmd, line, env)
    assert ran.exists()


@pytest.mark.parametrize(
    "command",
    [
        ["env", "PYTHONPATH=.", "sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES" > seen'],
        ["env", "-u", "PYTHONPATH", "sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES" > seen'],
        ["timeout", "1h", "sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES" > seen'],
        ["env", "CUDA_DEVICE_ORDER=PCI_BUS_ID", "sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES" > seen'],
        # Expanded by the job's shell: the GPU gpuwait gives.
        [
            "sh",
            "-c",
            'CUDA_VISIBLE_DEVICES="$GPUWAIT_GPU_UUIDS" sh -c \'echo "$CUDA_VISIBLE_DEVICES"\' > seen',
        ],
    ],
)
def test_a_wrapper_that_leaves_the_gpus_given_alone_runs_on_them(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, command: list[str]
) -> None:
    done = gpuwait(gpuwait_cmd, command, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "seen").read_text().strip().startswith("GPU-")


def test_the_one_gpu_gpuwait_was_given_passed_on_as_it_is_runs(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # `CUDA_VISIBLE_DEVICES=1 gpuwait --vram 4G -- env CUDA_VISIBLE_DEVICES=1 ...` (the
    # caller's shell expanding "$CUDA_VISIBLE_DEVICES"): gpuwait picks from GPU 1 alone, so
    # the command runs where gpuwait reserved. Several GPUs, or none, are refused: gpuwait
    # gives the job one of them.
    command = ["env", "CUDA_VISIBLE_DEVICES=1", "sh", "-c", "echo $GPUWAIT_GPU_INDICES > seen"]
    run = {**os.environ, "CUDA_VISIBLE_DEVICES": "1"}
    done = gpuwait(gpuwait_cmd, command, run, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "seen").read_text().strip() == "1"
    command[1] = "CUDA_VISIBLE_DEVICES=0,1"
    run["CUDA_VISIBLE_DEVICES"] = "0,1"
    done = gpuwait(gpuwait_cmd, command, run, cwd=tmp_path)
    assert done.returncode == 2, done.stderr


def test_a_wrapper_that_sets_the_order_of_gpu_indices_is_refused_under_index(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # With visible_devices = index, `env CUDA_DEVICE_ORDER=FASTEST_FIRST` has CUDA read the
    # index gpuwait gives in its own order, which may name another job's card; PCI_BUS_ID,
    # which gpuwait sets itself, and the same line with UUIDs run.
    env, ran = fake_bin(tmp_path, "env")
    index = {**env, "GPUWAIT_VISIBLE_DEVICES": "index"}
    done = gpuwait(gpuwait_cmd, ["env", "CUDA_DEVICE_ORDER=FASTEST_FIRST", "true"], index)
    refused(
        done,
        ran,
        "env sets CUDA_DEVICE_ORDER=FASTEST_FIRST for its command",
        "gpuwait ... -- env true",
    )
    done = gpuwait(gpuwait_cmd, ["env", "CUDA_DEVICE_ORDER=PCI_BUS_ID", "true"], index)
    assert done.returncode == 0, done.stderr
    done = gpuwait(gpuwait_cmd, ["env", "CUDA_DEVICE_ORDER=FASTEST_FIRST", "true"], env)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    "code",
    [
        'export CUDA_DEVICE_ORDER="PCI_BUS_ID"',
        "CUDA_DEVICE_ORDER='PCI_BUS_ID'",
        'declare -x CUDA_DEVICE_ORDER="PCI_BUS_ID"',
    ],
)
def test_a_shell_that_sets_the_order_gpuwait_sets_in_quotes_runs_under_index(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, code: str
) -> None:
    # With visible_devices = index, `sh -c 'export CUDA_DEVICE_ORDER="PCI_BUS_ID"; python
    # x.py'`, the order gpuwait sets itself, quoted as scripts do, was refused, exit 2, "sh
    # sets 'CUDA_DEVICE_ORDER="PCI_BUS_ID"' for its command", where the same word unquoted runs.
    index = {**os.environ, "GPUWAIT_VISIBLE_DEVICES": "index"}
    line = f'{code}; echo "$CUDA_DEVICE_ORDER $CUDA_VISIBLE_DEVICES" > seen'
    done = gpuwait(gpuwait_cmd, ["bash", "-c", line], index, opts=ON_GPU_1, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "seen").read_text().split() == ["PCI_BUS_ID", "1"]
    # Another order is refused as before.
    other = line.replace("PCI_BUS_ID", "FASTEST_FIRST", 1)
    done = gpuwait(gpuwait_cmd, ["bash", "-c", other], index, opts=ON_GPU_1, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "CUDA_DEVICE_ORDER" in done.stderr


@pytest.mark.parametrize(
    ("command", "caller", "status"),
    [
        (["sudo", "-E", "docker", "run", "-e", "NVIDIA_VISIBLE_DEVICES", "img"], "all", 2),
        (["nice", "docker", "run", "-e", "NVIDIA_VISIBLE_DEVICES", "img"], "all", 2),
        (["sh", "-c", "exec docker run -e NVIDIA_VISIBLE_DEVICES img"], "all", 2),
        (
            [
                "env",
                "NVIDIA_VISIBLE_DEVICES=0",
                "docker",
                "run",
                "-e",
                "NVIDIA_VISIBLE_DEVICES",
                "i",
            ],
            None,
            2,
        ),
        (
            ["sh", "-c", "NVIDIA_VISIBLE_DEVICES=all docker run -e NVIDIA_VISIBLE_DEVICES i"],
            None,
            2,
        ),
        # Not passed on: sudo's env_reset, env -u, or set to no GPU.
        (["sudo", "docker", "run", "-e", "NVIDIA_VISIBLE_DEVICES", "img"], "all", 0),
        (
            [
                "env",
                "-u",
                "NVIDIA_VISIBLE_DEVICES",
                "docker",
                "run",
                "-e",
                "NVIDIA_VISIBLE_DEVICES",
                "i",
            ],
            "all",
            0,
        ),
        (
            [
                "env",
                "NVIDIA_VISIBLE_DEVICES=none",
                "docker",
                "run",
                "-e",
                "NVIDIA_VISIBLE_DEVICES",
                "i",
            ],
            "all",
            0,
        ),
    ],
)
def test_a_wrapper_passes_the_engine_the_nvidia_visible_devices_it_reads(
    sim: Path,
    gpuwait_cmd: list[str],
    tmp_path: Path,
    command: list[str],
    caller: str | None,
    status: int,
) -> None:
    # `-e NVIDIA_VISIBLE_DEVICES` with no value passes on the engine's own, which was read
    # only where the engine was the command itself: inside a CUDA image (all), `gpuwait --vram
    # 4G -- sudo -E docker run -e NVIDIA_VISIBLE_DEVICES img` ran a container given every GPU,
    # and so did `env NVIDIA_VISIBLE_DEVICES=0 docker run ...` one on GPU 0.
    env, ran = fake_bin(tmp_path, "docker", "sudo", "nice", "env", "sh")
    done = gpuwait(gpuwait_cmd, command, with_nvidia_visible_devices(env, caller))
    ends(done, ran, status, f"{ENGINE_OPTION}(-e NVIDIA_VISIBLE_DEVICES)")


def test_nvidia_docker_under_a_wrapper_is_refused_for_the_gpus_nv_gpu_names(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # NV_GPU was read only where nvidia-docker was the command itself: under `sudo -E` or
    # set by `env NV_GPU=1`, the refusal said every GPU, not the one NV_GPU names.
    env, ran = fake_bin(tmp_path, "docker", "nvidia-docker", "sudo", "env")
    for command, given in (
        (["sudo", "-E", "nvidia-docker", "run", "img"], {"NV_GPU": "1"}),
        (["env", "NV_GPU=1", "nvidia-docker", "run", "img"], {}),
    ):
        done = gpuwait(gpuwait_cmd, command, {**env, **given})
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith(
            "gpuwait: error: nvidia-docker run gives the container the GPUs NV_GPU names "
            "(NV_GPU=1), not the one gpuwait reserves: "
        ), done.stderr
    assert not ran.exists()


@pytest.mark.parametrize(
    ("lines", "options", "status"),
    [
        ("# GPUs\nNVIDIA_VISIBLE_DEVICES=all\nHF_HOME=/data\n", [], 2),
        ("NVIDIA_VISIBLE_DEVICES=0\n", ["--runtime=nvidia"], 2),
        # A name alone passes on the engine's own.
        ("NVIDIA_VISIBLE_DEVICES\n", [], 2),
        ("NVIDIA_VISIBLE_DEVICES=none\n", ["--runtime=nvidia"], 0),
        ("NVIDIA_VISIBLE_DEVICES=all\n", ["-e", "NVIDIA_VISIBLE_DEVICES=void"], 0),
        ("HF_HOME=/data\n", [], 0),
    ],
)
def test_a_docker_env_file_naming_gpus_is_read_as_its_e_options_are(
    sim: Path,
    gpuwait_cmd: list[str],
    tmp_path: Path,
    lines: str,
    options: list[str],
    status: int,
) -> None:
    # `docker run --env-file gpu.env img` with NVIDIA_VISIBLE_DEVICES=all in the file ran a
    # container the NVIDIA runtime gives every GPU, where `-e NVIDIA_VISIBLE_DEVICES=all` was
    # refused; and `--runtime=nvidia` was refused where the file gave no GPU. The file is now
    # read as Apptainer's --env-file is, an -e winning over it as docker has it, and the
    # hint's line, the file kept, runs.
    env, ran = fake_bin(tmp_path, "docker", "sh")
    env["NVIDIA_VISIBLE_DEVICES"] = "all"
    (tmp_path / "gpu.env").write_text(lines)
    command = ["docker", "run", "--env-file", str(tmp_path / "gpu.env"), *options, "img", "true"]
    done = gpuwait(gpuwait_cmd, command, env)
    ends(done, ran, status, f"{ENGINE_OPTION}(--env-file {tmp_path / 'gpu.env'}")
    if status:
        line = hint(done).rsplit(" (", 1)[0]
        assert "--env-file" in line
        runs(gpuwait_cmd, line, env)
        assert ran.exists()


@pytest.mark.parametrize(
    ("code", "given"),
    [
        ('exec docker run --rm --gpus all -v "$PWD:/w" img python x.py', "--gpus all"),
        ('docker run --env-file "$HOME/gpu.env" img python x.py', "--gpus 2"),
    ],
)
def test_the_refusal_of_docker_in_a_shell_gives_no_line_cut_short(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, code: str, given: str
) -> None:
    # `sh -c 'exec docker run --gpus all -v "$PWD:/w" img python x.py'` was told to type
    # `sh -c 'exec docker run --gpus "\"device=$GPUWAIT_GPU_UUIDS\"" -v'`: the words read up to
    # the first expansion, the mount, the image and the command gone, a line docker refuses.
    env, ran = fake_bin(tmp_path, "docker")
    code = code.replace("--env-file", f"--gpus 2 -e HOME={tmp_path} --env-file")
    done = gpuwait(gpuwait_cmd, ["sh", "-c", code], env)
    refused(done, ran, f"({given})")
    said = done.stderr.split("hint: ", 1)[1]
    assert "sh -c" not in said, said
    assert f'--gpus "\\"device=$GPUWAIT_GPU_UUIDS\\"" in place of {given}' in said, said


@pytest.mark.parametrize(
    "option",
    [
        '-e "NVIDIA_VISIBLE_DEVICES=$GPUWAIT_GPU_UUIDS"',
        "--env NVIDIA_VISIBLE_DEVICES=$GPUWAIT_GPU_UUIDS",
        '--env-file "$HOME/gpu.env"',
    ],
)
def test_docker_with_the_nvidia_runtime_in_a_shell_given_an_env_read_no_further_runs(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, option: str
) -> None:
    # `sh -c 'exec docker run --runtime=nvidia -e "NVIDIA_VISIBLE_DEVICES=$GPUWAIT_GPU_UUIDS"
    # img python x.py'`, the NVIDIA runtime given the GPUs gpuwait reserved, was refused, exit
    # 2, "docker run gives the container the GPUs its own option names (--runtime=nvidia)":
    # the code is read up to the expansion, and the -e whose value was not read taken to set
    # nothing, where the same option before --runtime=nvidia ran. What it sets is not known
    # here: the line runs either way round.
    env, ran = fake_bin(tmp_path, "docker")
    for code in (
        f"exec docker run --runtime=nvidia {option} img python x.py",
        f"exec docker run {option} --runtime=nvidia img python x.py",
    ):
        done = gpuwait(gpuwait_cmd, ["sh", "-c", code], env)
        assert done.returncode == 0, done.stderr
    assert ran.exists()
    # --gpus all gives every GPU whatever the variable says: refused as before.
    code = f"exec docker run --gpus all {option} img python x.py"
    assert gpuwait(gpuwait_cmd, ["sh", "-c", code], env).returncode == 2


def test_the_refusal_of_docker_in_a_shell_names_every_option_that_gives_gpus(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # `sh -c 'exec docker run --runtime=nvidia -e NVIDIA_VISIBLE_DEVICES=all -v "$PWD:/w" img
    # python x.py'` was told to put --gpus "\"device=$GPUWAIT_GPU_UUIDS\"" in place of
    # --runtime=nvidia alone: the line so changed, still naming every GPU, was refused again.
    env, ran = fake_bin(tmp_path, "docker")
    options = "--runtime=nvidia -e NVIDIA_VISIBLE_DEVICES=all"
    code = f'exec docker run {options} -v "$PWD:/w" img python x.py'
    done = gpuwait(gpuwait_cmd, ["sh", "-c", code], env)
    refused(done, ran, "(--runtime=nvidia)")
    said = done.stderr.split("hint: ", 1)[1]
    names = '--gpus "\\"device=$GPUWAIT_GPU_UUIDS\\""'
    assert (
        f"{names} in place of --runtime=nvidia, and leave out -e NVIDIA_VISIBLE_DEVICES=all" in said
    )
    # The code as the hint says, which runs.
    fixed = code.replace(options, names)
    assert gpuwait(gpuwait_cmd, ["sh", "-c", fixed], env).returncode == 0
    assert ran.exists()


def test_the_refusal_of_nvidia_docker_in_a_shell_names_docker_in_its_place(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # `sh -c 'exec nvidia-docker run -v "$PWD:/w" img python x.py'` was told to put --gpus
    # "\"device=$GPUWAIT_GPU_UUIDS\"" in its code alone: nvidia-docker so given still adds the
    # NVIDIA runtime, and the code so changed was refused again.
    env, ran = fake_bin(tmp_path, "docker", "nvidia-docker")
    code = 'exec nvidia-docker run -v "$PWD:/w" img python x.py'
    done = gpuwait(gpuwait_cmd, ["sh", "-c", code], env)
    refused(done, ran, "nvidia-docker run gives the container the GPUs of the NVIDIA runtime")
    said = done.stderr.split("hint: ", 1)[1]
    names = '--gpus "\\"device=$GPUWAIT_GPU_UUIDS\\""'
    assert f"in its code, {names}, and docker in place of nvidia-docker" in said, said
    # The code as the hint says, which runs.
    fixed = code.replace("nvidia-docker run", f"docker run {names}")
    assert gpuwait(gpuwait_cmd, ["sh", "-c", fixed], env).returncode == 0
    assert ran.exists()


@pytest.mark.parametrize("option", ["--gpus all", "--runtime=nvidia"])
def test_the_refusal_of_nvidia_docker_in_a_shell_names_its_own_option_that_gives_gpus(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, option: str
) -> None:
    # `sh -c 'exec nvidia-docker run --gpus all -v "$PWD:/w" img python x.py'` was told to put
    # --gpus "\"device=$GPUWAIT_GPU_UUIDS\"" in its code, and docker in place of nvidia-docker,
    # but not to leave out its --gpus all, first among its options where the runtime
    # nvidia-docker adds is placed: the code so changed was refused again.
    env, ran = fake_bin(tmp_path, "docker", "nvidia-docker")
    code = f'exec nvidia-docker run {option} -v "$PWD:/w" img python x.py'
    done = gpuwait(gpuwait_cmd, ["sh", "-c", code], env)
    refused(done, ran, "nvidia-docker run gives the container the GPUs of the NVIDIA runtime")
    said = done.stderr.split("hint: ", 1)[1]
    assert f", and leave out {option}, and docker in place of nvidia-docker" in said, said
    # The code as the hint says, which runs.
    names = '--gpus "\\"device=$GPUWAIT_GPU_UUIDS\\""'
    fixed = code.replace(f"nvidia-docker run {option}", f"docker run {names}")
    assert gpuwait(gpuwait_cmd, ["sh", "-c", fixed], env).returncode == 0
    assert ran.exists()


@pytest.mark.parametrize(
    ("opts", "option", "said"),
    [
        (("--vram", "4G"), "--env CUDA_VISIBLE_DEVICES=0", "in its code, leave out --env"),
        (PAUSABLE, "--containall", "in its code, --contain --cleanenv --ipc in place of"),
        (PAUSABLE, "--fusemount host:f", "in its code, leave out --fusemount host:f"),
    ],
)
def test_the_refusal_of_apptainer_in_a_shell_gives_no_line_cut_short(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, opts: list[str], option: str, said: str
) -> None:
    # `sh -c 'exec apptainer exec --nv --env CUDA_VISIBLE_DEVICES=0 -B "$PWD" img.sif python
    # x.py'` was told to type `apptainer exec --nv -B`, and a --pausable one under
    # --containall `apptainer exec --nv --contain --cleanenv --ipc -B`: the words read up to
    # the first expansion, the bind's value, the image and the command gone.
    env, ran = fake_bin(tmp_path, "apptainer")
    code = f'exec apptainer exec --nv {option} -B "$PWD" img.sif python x.py'
    done = gpuwait(gpuwait_cmd, ["sh", "-c", code], env, opts=opts)
    refused(done, ran, said)
    assert "-B\n" not in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("command", "said"),
    [
        (["env", "-S", "CUDA_VISIBLE_DEVICES=0 true"], "env sets CUDA_VISIBLE_DEVICES=0"),
        (["env", "--split-string=-i true"], "env starts its command without"),
        (["env", "-S", "srun true", "x"], "srun starts its tasks"),
        (["nice", "env", "-S", "sudo -u alice true"], "sudo starts its command without"),
    ],
)
def test_what_env_s_splits_out_is_judged_as_words_of_the_line(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, command: list[str], said: str
) -> None:
    # `env -S 'CUDA_VISIBLE_DEVICES=0 python x.py'` (a script's `#!/usr/bin/env -S ...` line
    # run by hand) was taken for an env running nothing: the command ran on GPU 0, whichever
    # gpuwait reserved, and `env -S 'srun ...'` where srun is refused.
    env, ran = fake_bin(tmp_path, "env", "nice", "srun", "sudo")
    done = gpuwait(gpuwait_cmd, command, env)
    refused(done, ran, said)
    assert "Traceback" not in done.stderr
    done = gpuwait(gpuwait_cmd, ["env", "-S", "PYTHONPATH=. true"], env)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("command", "said"),
    [
        (["xargs", "env", "CUDA_VISIBLE_DEVICES=0", "true"], "env sets CUDA_VISIBLE_DEVICES=0"),
        (["xargs", "-0", "-n", "1", "-P", "4", "sudo", "-u", "alice", "true"], "sudo starts"),
        (["xargs", "-a", "list", "-I{}", "srun", "true", "{}"], "srun starts its tasks"),
        (["xargs", "--max-args=1", "env", "-i", "true"], "env starts its command without"),
    ],
)
def test_what_xargs_runs_is_judged(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, command: list[str], said: str
) -> None:
    # xargs was no wrapper here: `gpuwait --vram 4G -- xargs env CUDA_VISIBLE_DEVICES=0
    # python x.py < files` ran each on GPU 0, whichever gpuwait reserved, and `xargs sudo -u
    # alice ...` on every GPU.
    env, ran = fake_bin(tmp_path, "xargs", "env", "sudo", "srun")
    done = gpuwait(gpuwait_cmd, command, env)
    refused(done, ran, said)
    done = gpuwait(gpuwait_cmd, ["xargs", "-n", "1", "env", "PYTHONPATH=.", "true"], env)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    "options",
    [
        ["-i"],
        ["-u", "CUDA_VISIBLE_DEVICES"],
        ["--unset=CUDA_VISIBLE_DEVICES", "-u", "HOME"],
        ["-uCUDA_VISIBLE_DEVICES", "-i", "LANG=C"],
        ["--ignore-environment", "--unset", "CUDA_VISIBLE_DEVICES"],
    ],
)
def test_the_line_an_env_refusal_gives_runs_on_the_gpu_reserved(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, options: list[str]
) -> None:
    # `gpuwait -- env -i python x.py` was refused with "unset only what it must not see", no
    # line to type. It now gives one: without the -u, or, for -i, in a shell that hands the
    # command the variables gpuwait sets.
    command = ["env", *options, "sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES" > seen']
    done = gpuwait(gpuwait_cmd, command, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "env starts its command without the CUDA_VISIBLE_DEVICES" in done.stderr
    runs(gpuwait_cmd, hint(done).strip(), cwd=tmp_path)
    assert (tmp_path / "seen").read_text().strip().startswith("GPU-")


@pytest.mark.parametrize(
    "options",
    ["-w .", "--wd .", "-w.", "--wd=.", "-r", "--map-user 0", "-U --setgroups deny", "-rS 0 -G 0"],
)
def test_unshare_is_looked_through_to_the_command_it_runs(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, options: str
) -> None:
    # unshare runs its command in namespaces of its own, with the environment it was given:
    # `sh -c 'env A=1 unshare -r env -i python x.py'` ran, the env -i in it showing python
    # every GPU, as `env -i python x.py` alone is refused.
    inner = 'echo "${CUDA_VISIBLE_DEVICES-every GPU}" > seen'
    line = ["sh", "-c", f"env A=1 unshare {options} env -i sh -c {shlex.quote(inner)}"]
    if "w" in options:  # no namespace: nothing the machine may refuse this user
        assert seen_bare(line, tmp_path) == "every GPU"
    done = gpuwait(gpuwait_cmd, line, opts=ON_GPU_1, cwd=tmp_path)
    refused(done, tmp_path / "seen", "env starts its command without the CUDA_VISIBLE_DEVICES")
    if "w" in options:
        # Its option's value taken for no command: unshare's own command runs as before.
        command = ["unshare", *options.split(), "sh", "-c", inner]
        done = gpuwait(gpuwait_cmd, command, opts=ON_GPU_1, cwd=tmp_path)
        ran_on_the_gpu_reserved(done, tmp_path / "seen", sim)


@pytest.mark.parametrize(
    "options", [["-E", "CUDA_VISIBLE_DEVICES=0"], ["--setenv=CUDA_VISIBLE_DEVICES=0"]]
)
def test_systemd_run_scope_setting_the_gpus_itself_is_refused(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, options: list[str]
) -> None:
    # `systemd-run --scope` runs its command as it was given, with what --setenv sets: `-E
    # CUDA_VISIBLE_DEVICES=0` ran it on GPU 0, whichever gpuwait reserved.
    env, ran = fake_bin(tmp_path, "systemd-run")
    done = gpuwait(gpuwait_cmd, ["systemd-run", "--scope", *options, "true"], env)
    refused(
        done,
        ran,
        "systemd-run sets CUDA_VISIBLE_DEVICES=0 for its command",
        "gpuwait ... -- systemd-run --scope true;",
    )
    done = gpuwait(gpuwait_cmd, ["systemd-run", "--scope", "-E", "HF_HOME=/d", "true"], env)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    "wrapped",
    [
        ["sudo", "-E", "apptainer", "exec", "--nvccli", "--containall", "img.sif", "python"],
        ["nice", "-n", "5", "apptainer", "exec", "--nvccli", "-c", "img.sif", "python"],
        ["sh", "-c", "exec apptainer exec --nvccli --containall img.sif python"],
    ],
)
def test_apptainer_nvccli_under_a_wrapper_without_nvidia_visible_devices_is_refused(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, wrapped: list[str]
) -> None:
    # Read only where apptainer was the command itself: `gpuwait --vram 4G -- sudo -E
    # apptainer exec --nvccli --containall img.sif python x.py` waited its turn, then found no
    # GPU in the container. Refused before waiting, the hint's line binding in the reserved
    # GPU, which runs; where a wrapper sets it to GPUs, it runs.
    env, _ = fake_bin(tmp_path)
    for name, text in (("apptainer", NVCCLI), ("sudo", '#!/bin/sh\nshift\nexec "$@"\n')):
        stand_in(tmp_path, name, text)
    seen = tmp_path / "seen"
    env = {**env, "SEEN": str(seen), "GPUS": ",".join(sim_uuids(sim))}
    env.pop("NVIDIA_VISIBLE_DEVICES", None)
    done = gpuwait(gpuwait_cmd, wrapped, env, opts=ON_GPU_1)
    assert done.returncode == 2, done.stderr
    assert "NVIDIA_VISIBLE_DEVICES" in done.stderr
    assert not seen.exists()
    runs(gpuwait_cmd, hint(done).splitlines()[0], env, opts=ON_GPU_1)
    assert seen.read_text() == reserved_uuid(sim)
    done = gpuwait(gpuwait_cmd, ["env", "NVIDIA_VISIBLE_DEVICES=all", *wrapped], env, opts=ON_GPU_1)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("command", "environ", "given"),
    [
        ([], {"APPTAINER_CONTAINALL": "1"}, "APPTAINER_CONTAINALL=1"),
        ([], {"SINGULARITY_PID": "true"}, "SINGULARITY_PID=true"),
        ([], {"APPTAINER_UNSHARE_PID": "t"}, "APPTAINER_UNSHARE_PID=t"),
        ([], {"APPTAINER_FUSESPEC": "container:sshfs h:/ /m"}, "APPTAINER_FUSESPEC="),
        (["env", "APPTAINER_COMPAT=True"], {}, "APPTAINER_COMPAT=True"),
        (["--fusemount", "container:sshfs h:/ /m"], {}, "(--fusemount)"),
    ],
)
def test_a_pausable_job_given_an_apptainer_pid_namespace_by_its_environment_is_refused(
    sim: Path,
    gpuwait_cmd: list[str],
    tmp_path: Path,
    command: list[str],
    environ: dict[str, str],
    given: str,
) -> None:
    # Apptainer reads its options from APPTAINER_ (SINGULARITY_) variables too, and
    # --fusemount implies --pid: `APPTAINER_CONTAINALL=1 gpuwait --pausable -- apptainer exec
    # img.sif python x.py` ran in a PID namespace, where the program died of the checkpoint
    # signal when asked to step aside.
    env, ran = fake_bin(tmp_path, "apptainer")
    wrapper = [] if command[:1] == ["--fusemount"] else command
    options = command if command[:1] == ["--fusemount"] else []
    line = [*wrapper, "apptainer", "exec", "--nv", *options, "img.sif", "python", "x.py"]
    done = gpuwait(gpuwait_cmd, line, {**env, **environ}, opts=PAUSABLE)
    assert done.returncode == 2, done.stderr
    assert "PID namespace" in done.stderr and given in done.stderr
    assert "Traceback" not in done.stderr
    assert not ran.exists()
    # Where the variable is off (Go's ParseBool reads false), the job runs.
    off = {name: "false" for name in environ if name != "APPTAINER_FUSESPEC"}
    if off or (not environ and command[:1] == ["env"]):
        cleared = [w.replace("=True", "=0") for w in line]
        done = gpuwait(gpuwait_cmd, cleared, {**env, **off}, opts=PAUSABLE)
        assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    "variables",
    [
        {"APPTAINER_CONTAINALL": "1"},
        # A site that exports both forms, for Apptainer and for older Singularity lines: the
        # line given unset one, and was refused in turn for the other.
        {"APPTAINER_CONTAINALL": "1", "SINGULARITY_CONTAINALL": "1"},
        {"APPTAINER_CONTAINALL": "1", "APPTAINER_PID": "1", "SINGULARITY_UNSHARE_PID": "t"},
    ],
)
def test_the_line_a_refusal_of_an_apptainer_containall_variable_gives_runs(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, variables: dict[str, str]
) -> None:
    env, ran = fake_bin(tmp_path, "apptainer")
    env = {**env, **variables}
    line = ["apptainer", "exec", "img.sif", "python", "x.py"]
    done = gpuwait(gpuwait_cmd, line, env, opts=PAUSABLE)
    assert done.returncode == 2, done.stderr
    hint = done.stderr.split("leave out the PID namespace: ", 1)[1].splitlines()[0]
    unset = " ".join(f"-u {name}" for name in variables)
    assert hint.startswith(f"env {unset} APPTAINER_CONTAIN=1 "), hint
    before, _, after = hint.partition(" ... -- ")
    again = subprocess.run(
        [*shlex.split(before)[:-1], *gpuwait_cmd, *PAUSABLE, "--", *shlex.split(after)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 0, again.stderr
    assert ran.exists()


def test_apptainer_nvccli_and_contain_set_by_the_environment_are_read_as_the_options(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # APPTAINER_NVCCLI=1 APPTAINER_CONTAIN=1 is `apptainer exec --nvccli --contain`, which
    # binds in no GPU without NVIDIA_VISIBLE_DEVICES: the job waited its turn, then failed.
    env, ran = fake_bin(tmp_path, "apptainer")
    env.pop("NVIDIA_VISIBLE_DEVICES", None)
    line = ["apptainer", "exec", "img.sif", "python", "x.py"]
    env = {**env, "APPTAINER_NVCCLI": "1", "SINGULARITY_CONTAIN": "1"}
    done = gpuwait(gpuwait_cmd, line, env)
    refused(done, ran, "NVIDIA_VISIBLE_DEVICES")
    assert gpuwait(gpuwait_cmd, line, {**env, "NVIDIA_VISIBLE_DEVICES": "all"}).returncode == 0


def test_an_apptainer_env_file_named_by_the_environment_is_read_as_the_option(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # APPTAINER_ENV_FILE is --env-file's: a file setting CUDA_VISIBLE_DEVICES=0 ran the
    # container on GPU 0, whichever GPU gpuwait had reserved.
    (tmp_path / "job.env").write_text("OMP_NUM_THREADS=4\nCUDA_VISIBLE_DEVICES=0\n")
    env, _ = fake_bin(tmp_path)
    reads_the_file = APPTAINER_ENV.replace(
        "words, files, given = sys.argv[2:], [], {}\n",
        "words, files, given = sys.argv[2:], [], {}\n"
        "if os.environ.get('APPTAINER_ENV_FILE') and '--env-file' not in sys.argv:\n"
        "    files = [l.split('=', 1) for l in open(os.environ['APPTAINER_ENV_FILE']).read().split()]\n",
    )
    stand_in(tmp_path, "apptainer", reads_the_file)
    seen = tmp_path / "seen"
    env = {**env, "SEEN": str(seen), "APPTAINER_ENV_FILE": str(tmp_path / "job.env")}
    line = ["apptainer", "exec", "--nv", "img.sif", "python", "x.py"]
    done = gpuwait(gpuwait_cmd, line, env, opts=ON_GPU_1)
    assert done.returncode == 2, (done.stderr, seen.exists() and seen.read_text())
    assert f"APPTAINER_ENV_FILE={tmp_path}/job.env" in done.stderr
    assert "Traceback" not in done.stderr
    assert not seen.exists()
    runs(gpuwait_cmd, hint(done).splitlines()[0], env, opts=ON_GPU_1)
    assert seen.read_text() == reserved_uuid(sim)


def test_a_wrapper_dropping_the_copy_before_an_apptainer_cleaned_by_its_environment_is_refused(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # APPTAINER_CLEANENV=1 is --cleanenv: the container's CUDA_VISIBLE_DEVICES is the
    # APPTAINERENV_ copy alone, which `env -u` dropped; the container saw every GPU.
    env, ran = fake_bin(tmp_path, "apptainer")
    line = ["env", "-u", "APPTAINERENV_CUDA_VISIBLE_DEVICES", "apptainer", "exec", "i.sif", "x"]
    done = gpuwait(gpuwait_cmd, line, {**env, "APPTAINER_CLEANENV": "1"})
    refused(done, ran, "without the APPTAINERENV_CUDA_VISIBLE_DEVICES")
    assert gpuwait(gpuwait_cmd, line, env).returncode == 0


@pytest.mark.parametrize(
    ("program", "options"), [("APPTAINER_ENV", []), ("APPTAINER_CLEANENV", ["--cleanenv"])]
)
def test_a_wrapper_dropping_cuda_visible_devices_before_apptainer_keeps_the_reserved_gpu(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, program: str, options: list[str]
) -> None:
    # The container takes the APPTAINERENV_ copy over the caller's variable: `env -u
    # CUDA_VISIBLE_DEVICES apptainer exec --nv ...` ran on the reserved GPU, yet was refused.
    env, _ = fake_bin(tmp_path)
    stand_in(tmp_path, "apptainer", globals()[program])
    seen = tmp_path / "seen"
    env = {**env, "SEEN": str(seen)}
    apptainer = ["apptainer", "exec", "--nv", *options, "img.sif", "python", "x.py"]

    def run(command: list[str]) -> subprocess.CompletedProcess[str]:
        return gpuwait(gpuwait_cmd, command, env, opts=ON_GPU_1)

    done = run(["env", "-u", "CUDA_VISIBLE_DEVICES", *apptainer])
    assert done.returncode == 0, done.stderr
    assert seen.read_text() == reserved_uuid(sim)
    # Dropping the copy as well leaves the container every GPU: refused.
    seen.unlink()
    both = ["-u", "CUDA_VISIBLE_DEVICES", "-u", "APPTAINERENV_CUDA_VISIBLE_DEVICES"]
    done = run(["env", *both, *apptainer])
    assert done.returncode == 2, done.stderr
    assert not seen.exists()


@pytest.mark.parametrize(
    "options",
    [["-i"], ["-i", "LANG=C"], ["-u", "CUDA_VISIBLE_DEVICES"], ["--ignore-environment"]],
)
def test_the_line_refused_for_setting_the_gpu_after_env_i_runs_on_the_gpu_reserved(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, options: list[str]
) -> None:
    # `env -i CUDA_VISIBLE_DEVICES=0 python x.py` was refused with the line without the
    # assignment, `env -i python x.py`, which is refused in turn: env -i drops the variable.
    command = [
        "env",
        *options,
        "CUDA_VISIBLE_DEVICES=0",
        "sh",
        "-c",
        'echo "$CUDA_VISIBLE_DEVICES" > seen',
    ]
    done = gpuwait(gpuwait_cmd, command, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "env sets CUDA_VISIBLE_DEVICES=0 for its command" in done.stderr
    runs(gpuwait_cmd, hint(done).split("; to have it pick", 1)[0].strip(), cwd=tmp_path)
    assert (tmp_path / "seen").read_text().strip().startswith("GPU-")


@pytest.mark.parametrize(
    "command",
    [
        ["env", "CUDA_VISIBLE_DEVICES=", "sh", "-c", "echo ran > seen"],
        ["env", "CUDA_VISIBLE_DEVICES=-1", "sh", "-c", "echo ran > seen"],
        ["sh", "-c", "CUDA_VISIBLE_DEVICES= true && echo ran > seen"],
        ["env", "CUDA_VISIBLE_DEVICES=none", "sh", "-c", "echo ran > seen"],
        ["sh", "-c", "CUDA_VISIBLE_DEVICES=NoDevFiles true && echo ran > seen"],
    ],
)
def test_a_wrapper_that_hides_every_gpu_from_its_command_runs(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, command: list[str]
) -> None:
    # An empty CUDA_VISIBLE_DEVICES (or -1) hides every GPU, as a CPU step of a pipeline is
    # run: it runs on no GPU of another job's, but was refused for "it would run on GPUs
    # gpuwait did not give it".
    done = gpuwait(gpuwait_cmd, command, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "seen").read_text() == "ran\n"


@pytest.mark.parametrize(
    ("options", "value", "given"),
    [
        (["-i"], "", None),
        (["-i", "HOME=/"], "-1", None),
        (["-u", "CUDA_VISIBLE_DEVICES"], "", None),
        (["-i"], "GPU 1", "GPU 1"),
        (["--ignore-environment"], "GPU 1", "GPU 1"),
        (["-u", "CUDA_VISIBLE_DEVICES"], "GPU 1", "GPU 1"),
        (["-i", "CUDA_DEVICE_ORDER=PCI_BUS_ID"], "1", "1"),
    ],
)
def test_env_that_drops_the_gpu_and_sets_it_again_to_one_that_runs_runs(
    sim: Path,
    gpuwait_cmd: list[str],
    tmp_path: Path,
    options: list[str],
    value: str,
    given: str | None,
) -> None:
    # env clears its environment (-i) or unsets (-u) before it makes its assignments:
    # `env -i CUDA_VISIBLE_DEVICES= python prep.py` runs on no GPU, and `env -i
    # CUDA_VISIBLE_DEVICES="$CUDA_VISIBLE_DEVICES" ...` on the one GPU gpuwait may reserve,
    # as they do without -i; both were refused, "env starts its command without the
    # CUDA_VISIBLE_DEVICES gpuwait sets: it would see every GPU".
    env = dict(os.environ)
    value = value.replace("GPU 1", reserved_uuid(sim))
    if given is not None:
        env["CUDA_VISIBLE_DEVICES"] = given.replace("GPU 1", reserved_uuid(sim))
    command = ["env", *options, f"CUDA_VISIBLE_DEVICES={value}", "sh", "-c"]
    done = gpuwait(
        gpuwait_cmd, [*command, 'echo "[$CUDA_VISIBLE_DEVICES]" > seen'], env, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "seen").read_text() == f"[{value}]\n"


def test_env_i_setting_the_gpu_again_without_its_order_is_refused_under_index(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # With visible_devices = index the order is needed too: env -i drops it, and sets only
    # the GPU again.
    env = {**os.environ, "GPUWAIT_VISIBLE_DEVICES": "index", "CUDA_VISIBLE_DEVICES": "1"}
    command = ["env", "-i", "CUDA_VISIBLE_DEVICES=1", "sh", "-c", "echo ran > seen"]
    done = gpuwait(gpuwait_cmd, command, env, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "without the CUDA_DEVICE_ORDER gpuwait sets" in done.stderr
    assert not (tmp_path / "seen").exists()


@pytest.mark.parametrize(
    "command",
    [
        ["env", "-i", "CUDA_VISIBLE_DEVICES="],
        ["env", "-i", "PATH=/usr/bin:/bin", "CUDA_VISIBLE_DEVICES=-1"],
        ["env", "-u", "CUDA_DEVICE_ORDER", "CUDA_VISIBLE_DEVICES="],
        ["env", "-iu", "CUDA_DEVICE_ORDER", "CUDA_VISIBLE_DEVICES=none"],
    ],
)
def test_a_wrapper_that_hides_every_gpu_without_the_order_runs_under_index(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, command: list[str]
) -> None:
    # With visible_devices = index, a line that hides every GPU from its command was refused
    # for the CUDA_DEVICE_ORDER its wrapper drops, "it would number the GPUs fastest-first",
    # where its command sees no GPU to number, as it runs with the order kept.
    env = {**os.environ, "GPUWAIT_VISIBLE_DEVICES": "index"}
    line = [*command, "sh", "-c", 'echo "[$CUDA_VISIBLE_DEVICES]" > seen']
    done = gpuwait(gpuwait_cmd, line, env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    value = command[-1].partition("=")[2]
    assert (tmp_path / "seen").read_text() == f"[{value}]\n"


@pytest.mark.parametrize(
    "wrapper",
    [
        ["env", "-u", "CUDA_DEVICE_ORDER", "CUDA_VISIBLE_DEVICES=1"],
        ["env", "-i", "CUDA_VISIBLE_DEVICES=1"],
        ["sudo", "--preserve-env=CUDA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES=1"],
    ],
)
def test_a_wrapper_that_passes_on_gpuwaits_index_without_its_order_is_refused(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, wrapper: list[str]
) -> None:
    # gpuwait held to GPU 1 (CUDA_VISIBLE_DEVICES=1, an NVML index) gives its command
    # CUDA_DEVICE_ORDER=PCI_BUS_ID, under which CUDA's 1 is NVML's. A wrapper that passes the 1
    # on but drops the order leaves CUDA numbering the cards fastest-first, its 1 another card,
    # perhaps another job's: these ran.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "1"}
    done = gpuwait(gpuwait_cmd, [*wrapper, "sh", "-c", "echo ran > seen"], env, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "without the CUDA_DEVICE_ORDER gpuwait sets" in done.stderr
    assert "the index CUDA_VISIBLE_DEVICES names" in done.stderr
    assert not (tmp_path / "seen").exists()
    if wrapper[0] == "env":
        # The line keeps the line's own index and adds the order alone: it set the variable
        # a second time, "CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES" after the 1.
        assert hint(done).count("CUDA_VISIBLE_DEVICES=") == 1, hint(done)
        runs(gpuwait_cmd, hint(done), env, cwd=tmp_path)
        assert (tmp_path / "seen").read_text() == "ran\n"


@pytest.mark.parametrize(
    "command",
    [
        ["env", "CUDA_VISIBLE_DEVICES=7", "sh", "-c", "echo ran > seen"],
        ["sh", "-c", "CUDA_VISIBLE_DEVICES=$G true && echo ran > seen"],
        ["sh", "-c", "CUDA_VISIBLE_DEVICES=${G}x true && echo ran > seen"],
    ],
)
def test_a_wrapper_that_names_a_gpu_or_an_expansion_is_refused(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, command: list[str]
) -> None:
    # Only a value CUDA reads as no GPU at all runs: an index, even one of no GPU here, or a
    # shell's expansion may name another job's GPU.
    done = gpuwait(gpuwait_cmd, command, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert not (tmp_path / "seen").exists()


@pytest.mark.parametrize(
    "options",
    [
        ["-i"],
        ["-u", "APPTAINERENV_CUDA_VISIBLE_DEVICES"],
        ["-i", "-u", "HOME"],
        ["-i", "APPTAINERENV_CUDA_VISIBLE_DEVICES=0"],
    ],
)
def test_the_line_an_env_refusal_gives_before_a_clean_apptainer_runs_on_the_gpu_reserved(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, options: list[str]
) -> None:
    # The line the refusal of `env -i apptainer exec --nv --cleanenv ...` gave set
    # CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER again, but not the APPTAINERENV_ copy that
    # alone reaches such a container: it saw every GPU, those given to other jobs too.
    env, _ = fake_bin(tmp_path)
    apptainer = stand_in(tmp_path, "apptainer", APPTAINER_CLEANENV)
    seen = tmp_path / "seen"
    env = {**env, "SEEN": str(seen)}
    command = ["env", *options, f"SEEN={seen}", str(apptainer), "exec", "--nv", "--cleanenv"]
    done = gpuwait(gpuwait_cmd, [*command, "img.sif", "python", "x.py"], env, opts=ON_GPU_1)
    assert done.returncode == 2, done.stderr
    assert not seen.exists()
    runs(gpuwait_cmd, hint(done).splitlines()[0], env, opts=ON_GPU_1)
    assert seen.read_text() == reserved_uuid(sim)


def test_the_lines_refusals_give_for_env_i_before_sudo_end_on_the_gpu_reserved(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # `env -i sudo python x.py` was refused for env -i first, the line it gave setting the
    # variables again in sh -c for a sudo that dropped them: typed as told, it ran on every
    # GPU, gpuwait reading no further into the quoted shell code. sudo's refusal now comes
    # first, and env's line is given for the sudo that keeps them.
    env, _ = fake_bin(tmp_path)
    stand_in(tmp_path, "sudo", SUDO_ENV)
    seen = tmp_path / "seen"
    line = [
        *("env", "-i", f"PATH={env['PATH']}", f"SEEN={seen}", "sudo", "sh", "-c"),
        'echo "$CUDA_VISIBLE_DEVICES" > "$SEEN"',
    ]
    for _ in range(3):
        done = gpuwait(gpuwait_cmd, line, env, opts=ON_GPU_1)
        if done.returncode != 2:
            break
        assert not seen.exists(), done.stderr
        line = shlex.split(hint(done).splitlines()[0])
    assert done.returncode == 0, done.stderr
    assert seen.read_text().strip() == reserved_uuid(sim)


@pytest.mark.parametrize(
    "code",
    [
        'CUDA_VISIBLE_DEVICES=$SLOT echo "$CUDA_VISIBLE_DEVICES" > seen',
        'export CUDA_VISIBLE_DEVICES="$SLOT"; echo "$CUDA_VISIBLE_DEVICES" > seen',
    ],
)
def test_a_shell_that_sets_the_gpus_from_an_expansion_is_refused(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, code: str
) -> None:
    # `xargs -P 4 --process-slot-var=SLOT sh -c 'CUDA_VISIBLE_DEVICES=$SLOT python x.py'`,
    # the way to spread a list over the GPUs, ran each on the GPU its slot names, whichever
    # gpuwait reserved: a value with an expansion ended what was read of the shell's code.
    done = gpuwait(gpuwait_cmd, ["env", "SLOT=0", "sh", "-c", code], cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "sh sets 'CUDA_VISIBLE_DEVICES=" in done.stderr, done.stderr
    assert not (tmp_path / "seen").exists()
    # gpuwait's own, passed on, runs on the GPU reserved.
    for own in ("$CUDA_VISIBLE_DEVICES", '"${CUDA_VISIBLE_DEVICES}"'):
        line = f"CUDA_VISIBLE_DEVICES={own} sh -c 'echo \"$CUDA_VISIBLE_DEVICES\" > seen'"
        done = gpuwait(gpuwait_cmd, ["sh", "-c", line], cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert (tmp_path / "seen").read_text().startswith("GPU-")


@pytest.mark.parametrize(
    "code",
    [
        "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} sh -c 'echo \"$CUDA_VISIBLE_DEVICES\" > seen'",
        'export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES-0}"; echo "$CUDA_VISIBLE_DEVICES" > seen',
        "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:=0} sh -c 'echo \"$CUDA_VISIBLE_DEVICES\" > seen'",
        # Its own or none: the shell stops, saying so, where it has none.
        "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:?unset} sh -c 'echo \"$CUDA_VISIBLE_DEVICES\" > seen'",
        'export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES?}"; echo "$CUDA_VISIBLE_DEVICES" > seen',
        # A message of more than one word.
        "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:?no GPU} sh -c 'echo \"$CUDA_VISIBLE_DEVICES\" > seen'",
        'export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:?no GPU given}"; echo "$CUDA_VISIBLE_DEVICES" > seen',
    ],
)
def test_a_shell_that_defaults_the_gpus_to_its_own_runs_on_the_gpu_reserved(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, code: str
) -> None:
    # `CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} python x.py`, a script's way to run on
    # GPU 0 unless told otherwise, keeps the GPU gpuwait sets: it was refused as a GPU of its
    # own, exit 2, "set CUDA_VISIBLE_DEVICES nowhere in the command".
    done = gpuwait(gpuwait_cmd, ["sh", "-c", code], opts=ON_GPU_1, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "seen").read_text().strip() == reserved_uuid(sim)
    # A default that is no longer gpuwait's alone is still refused: `${SLOT:-0}`, `:+`.
    for other in ("${SLOT:-$CUDA_VISIBLE_DEVICES}", "${CUDA_VISIBLE_DEVICES:+0}"):
        line = f"CUDA_VISIBLE_DEVICES={other} python x.py"
        done = gpuwait(gpuwait_cmd, ["sh", "-c", line], cwd=tmp_path)
        assert done.returncode == 2, done.stderr


#: A shell's code that writes the CUDA_VISIBLE_DEVICES its command gets to `seen`.
_SEEN = "sh -c 'echo \"$CUDA_VISIBLE_DEVICES\" > seen'"


@pytest.mark.parametrize(
    ("shell", "code"),
    [
        ("bash", f"CUDA_VISIBLE_DEVICES=${{CUDA_VISIBLE_DEVICES%%,*}} {_SEEN}"),
        ("bash", f"CUDA_VISIBLE_DEVICES=${{CUDA_VISIBLE_DEVICES%,*}} {_SEEN}"),
        ("zsh", f'export CUDA_VISIBLE_DEVICES="${{CUDA_VISIBLE_DEVICES##*,}}"; {_SEEN}'),
        ("sh", f"CUDA_VISIBLE_DEVICES=${{CUDA_VISIBLE_DEVICES#*,}} {_SEEN}"),
        ("fish", f"set -x CUDA_VISIBLE_DEVICES $CUDA_VISIBLE_DEVICES[1]; {_SEEN}"),
        ("fish", f"set -gx CUDA_VISIBLE_DEVICES $CUDA_VISIBLE_DEVICES[-1]; {_SEEN}"),
        # Through a wrapper of fish's code: env's words are fish's, `[1]` its whole value.
        ("fish", f"env CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES[1] {_SEEN}"),
        ("fish", f'nice env CUDA_VISIBLE_DEVICES="$CUDA_VISIBLE_DEVICES[-1]" {_SEEN}'),
    ],
)
def test_a_shell_that_keeps_some_of_the_gpus_given_runs_on_them(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, shell: str, code: str
) -> None:
    # `bash -c 'CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES%%,*} python x.py'`, the first of
    # the GPUs given, fish's `$CUDA_VISIBLE_DEVICES[1]` (the whole value: fish splits no such
    # variable) were refused, exit 2, "sets ... over the CUDA_VISIBLE_DEVICES gpuwait sets",
    # where each runs on GPUs gpuwait gave it.
    line = [shell, "-c", code]
    two = ("--vram", "4G", "--gpus", "2")
    done = gpuwait(gpuwait_cmd, line, opts=two, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    seen = (tmp_path / "seen").read_text().strip()
    assert seen and set(seen.split(",")) <= set(sim_uuids(sim)), seen
    # What the real shell makes of it, gpuwait's two GPUs set: some of them.
    bare = seen_bare(line, tmp_path, CUDA_VISIBLE_DEVICES="GPU-a,GPU-b")
    assert bare and set(bare.split(",")) <= {"GPU-a", "GPU-b"}, bare


@pytest.mark.parametrize(
    "code",
    [
        f"CUDA_VISIBLE_DEVICES=${{CUDA_VISIBLE_DEVICES/GPU-*/0}} {_SEEN}",
        f"CUDA_VISIBLE_DEVICES=${{CUDA_VISIBLE_DEVICES%%-*}}0 {_SEEN}",
        f"CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES[1] {_SEEN}",
    ],
)
def test_a_shell_that_makes_other_gpus_of_the_ones_given_is_refused(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, code: str
) -> None:
    done = gpuwait(gpuwait_cmd, ["bash", "-c", code], cwd=tmp_path)
    refused(done, tmp_path / "seen", "over the CUDA_VISIBLE_DEVICES gpuwait sets")


def test_a_shells_env_setting_a_quoted_value_with_spaces_is_read_whole(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # `sh -c 'env NOTE="a CUDA_VISIBLE_DEVICES=0" python x.py'`, a value that only holds the
    # text, was refused, exit 2, "env sets 'CUDA_VISIBLE_DEVICES=0"' ...", its words taken
    # apart at the space; and `env NOTE="a b" CUDA_VISIBLE_DEVICES=0 python x.py` ran on GPU 0,
    # whichever gpuwait reserved, what followed the quote left unread.
    line = ["sh", "-c", f'env NOTE="a CUDA_VISIBLE_DEVICES=0" {_SEEN}']
    done = gpuwait(gpuwait_cmd, line, opts=ON_GPU_1, cwd=tmp_path)
    ran_on_the_gpu_reserved(done, tmp_path / "seen", sim)
    (tmp_path / "seen").unlink()
    line = ["sh", "-c", f'env NOTE="a b" CUDA_VISIBLE_DEVICES=0 {_SEEN}']
    done = gpuwait(gpuwait_cmd, line, cwd=tmp_path)
    refused(done, tmp_path / "seen", "env sets CUDA_VISIBLE_DEVICES=0 for its command")
    assert seen_bare(line, tmp_path) == "0"


@pytest.mark.parametrize(
    ("before", "code"),
    [
        (["env", "CUDA_VISIBLE_DEVICES="], "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}"),
        (["env", "GPUWAIT_GPU_UUIDS="], "CUDA_VISIBLE_DEVICES=${GPUWAIT_GPU_UUIDS:-0}"),
        ([], "export CUDA_VISIBLE_DEVICES=; CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:=0}"),
    ],
)
def test_a_shell_default_of_the_gpus_filled_after_they_were_emptied_is_refused(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, before: list[str], code: str
) -> None:
    # `env CUDA_VISIBLE_DEVICES= sh -c 'CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
    # python x.py'` ran python on GPU 0, whichever GPU gpuwait had reserved: the empty value
    # hides every GPU and runs, and the default was taken for gpuwait's value passed on,
    # though the empty value is what the shell gets, and its default fills it.
    line = [*before, "sh", "-c", f"{code} sh -c 'echo \"$CUDA_VISIBLE_DEVICES\" > seen'"]
    done = gpuwait(gpuwait_cmd, line, cwd=tmp_path)
    refused(done, tmp_path / "seen", "for its command, over the CUDA_VISIBLE_DEVICES gpuwait sets")
    # The same, run bare where gpuwait's GPU is set: GPU 0.
    assert seen_bare(line, tmp_path, GPUWAIT_GPU_UUIDS="GPU-own") == "0"
    # A default that only an unset variable takes (`-`, not `:-`) is not used: the line runs,
    # on no GPU.
    if "-0" in code:
        line[-1] = line[-1].replace(":-0", "-0")
        done = gpuwait(gpuwait_cmd, line, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert (tmp_path / "seen").read_text().strip() == ""


@pytest.mark.parametrize(
    ("line", "pick"),
    [
        (["env", "CUDA_VISIBLE_DEVICES=1", "python", "x.py"], True),
        (["xargs", "-I", "{}", "sh", "-c", "CUDA_VISIBLE_DEVICES={} python x.py"], False),
        (["xargs", "-I%", "env", "CUDA_VISIBLE_DEVICES=%", "python", "x.py"], False),
    ],
)
def test_the_refusal_of_a_gpu_set_by_xargs_offers_no_gpus_to_pick_from(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, line: list[str], pick: bool
) -> None:
    # `xargs -I {} sh -c 'CUDA_VISIBLE_DEVICES={} python x.py'` was told "to have it pick
    # from those GPUs: 'CUDA_VISIBLE_DEVICES={}' gpuwait ... -- COMMAND": no GPUs, xargs's
    # placeholder, which gpuwait then refuses in turn.
    done = gpuwait(gpuwait_cmd, line, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert ("to have it pick from those GPUs: CUDA_VISIBLE_DEVICES=1 " in done.stderr) == pick
    assert ("pick from those GPUs" in done.stderr) == pick, done.stderr


def test_a_shell_that_unsets_the_gpus_before_its_command_is_refused(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # `sh -c 'unset CUDA_VISIBLE_DEVICES; python x.py'` ran python on every GPU, those given
    # to other jobs too, where `env -u CUDA_VISIBLE_DEVICES python x.py` is refused: the
    # shell's first command was taken to be `unset`, and nothing after it was looked at.
    code = 'unset CUDA_VISIBLE_DEVICES; echo "${CUDA_VISIBLE_DEVICES-every GPU}" > seen'
    done = gpuwait(gpuwait_cmd, ["sh", "-c", code], cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "unsets CUDA_VISIBLE_DEVICES" in done.stderr, done.stderr
    assert not (tmp_path / "seen").exists()
    # Another variable unset is no concern of gpuwait's: the line runs on the GPU reserved.
    code = 'unset OMP_NUM_THREADS; echo "${CUDA_VISIBLE_DEVICES-every GPU}" > seen'
    done = gpuwait(gpuwait_cmd, ["sh", "-c", code], opts=ON_GPU_1, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "seen").read_text().strip() == reserved_uuid(sim)


@pytest.mark.parametrize("shell", ["sh", "bash", "zsh"])
@pytest.mark.parametrize(
    ("code", "said"),
    [
        ("unset tmp; CUDA_VISIBLE_DEVICES=0", "sets CUDA_VISIBLE_DEVICES=0 for its command"),
        ("unset -v tmp i; export CUDA_VISIBLE_DEVICES=1;", "sets CUDA_VISIBLE_DEVICES=1 for"),
        ("unset tmp; unset CUDA_VISIBLE_DEVICES;", "unsets CUDA_VISIBLE_DEVICES"),
        ("unset tmp CUDA_VISIBLE_DEVICES;", "unsets CUDA_VISIBLE_DEVICES"),
        ("unset tmp; OMP_NUM_THREADS=4", ""),
    ],
)
def test_a_shell_that_unsets_a_local_first_is_judged_by_what_follows(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, shell: str, code: str, said: str
) -> None:
    # `sh -c 'unset tmp; CUDA_VISIBLE_DEVICES=0 python x.py'` ran python on GPU 0, whichever
    # GPU gpuwait had reserved: the `unset` of a local of the code's own was taken for the
    # shell's first command, and nothing after it was read.
    if shutil.which(shell) is None:
        pytest.skip(f"{shell} is not installed")
    line = f"{code} sh -c 'echo \"${{CUDA_VISIBLE_DEVICES-every GPU}}\" > seen'"
    done = gpuwait(gpuwait_cmd, [shell, "-c", line], opts=ON_GPU_1, cwd=tmp_path)
    if said:
        assert done.returncode == 2, done.stderr
        assert said in done.stderr, done.stderr
        assert not (tmp_path / "seen").exists()
    else:
        assert done.returncode == 0, done.stderr
        assert (tmp_path / "seen").read_text().strip() == reserved_uuid(sim)


@pytest.mark.parametrize(
    ("code", "said"),
    [
        ("export -n CUDA_VISIBLE_DEVICES", "takes CUDA_VISIBLE_DEVICES out of its environment"),
        ("declare +x CUDA_VISIBLE_DEVICES", "takes CUDA_VISIBLE_DEVICES out of its environment"),
        ("declare -x CUDA_VISIBLE_DEVICES=0", "bash sets CUDA_VISIBLE_DEVICES=0 for its command"),
        ("typeset -gx CUDA_VISIBLE_DEVICES=1", "bash sets CUDA_VISIBLE_DEVICES=1 for its"),
        ("readonly CUDA_VISIBLE_DEVICES=0", "bash sets CUDA_VISIBLE_DEVICES=0 for its command"),
        # An attribute (-i, -l, -u, -t) keeps it exported too; `typeset -i n=0;` runs no
        # command, and what follows it is looked at.
        ("declare -i CUDA_VISIBLE_DEVICES=0", "bash sets CUDA_VISIBLE_DEVICES=0 for its command"),
        ("typeset -i n=0; CUDA_VISIBLE_DEVICES=1", "bash sets CUDA_VISIBLE_DEVICES=1 for its"),
        # export's `--`, after which its words are names all the same.
        ("export -- CUDA_VISIBLE_DEVICES=0", "bash sets CUDA_VISIBLE_DEVICES=0 for its command"),
        # An array, which bash does not export, exported or not (-x).
        ("declare -a CUDA_VISIBLE_DEVICES=0", "takes CUDA_VISIBLE_DEVICES out of its environment"),
        ("declare -xa CUDA_VISIBLE_DEVICES=0", "takes CUDA_VISIBLE_DEVICES out of its"),
        ("typeset -A CUDA_VISIBLE_DEVICES", "takes CUDA_VISIBLE_DEVICES out of its environment"),
        ("readonly -a CUDA_VISIBLE_DEVICES=0", "takes CUDA_VISIBLE_DEVICES out of its"),
    ],
)
def test_a_shell_that_unexports_or_declares_the_gpus_before_its_command_is_refused(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, code: str, said: str
) -> None:
    # `bash -c 'export -n CUDA_VISIBLE_DEVICES; python x.py'` ran python on every GPU, and
    # `bash -c 'declare -x CUDA_VISIBLE_DEVICES=0; python x.py'` on GPU 0, whichever GPU
    # gpuwait had reserved, where `unset` and `export CUDA_VISIBLE_DEVICES=0` are refused:
    # the shell's first command was taken to be the builtin, and nothing after it was looked at.
    line = f'{code}; echo "${{CUDA_VISIBLE_DEVICES-every GPU}}" > seen; env > env'
    done = gpuwait(gpuwait_cmd, ["bash", "-c", line], cwd=tmp_path)
    refused(done, tmp_path / "seen", said)
    # The same, run bare where gpuwait's GPU is set: what python would have seen.
    seen_bare(["bash", "-c", line], tmp_path)
    assert "CUDA_VISIBLE_DEVICES=GPU-own" not in (tmp_path / "env").read_text()
    # Another variable is no concern of gpuwait's: the line runs on the GPU reserved.
    other = line.replace("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", 1)
    done = gpuwait(gpuwait_cmd, ["bash", "-c", other], opts=ON_GPU_1, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "seen").read_text().strip() == reserved_uuid(sim)


@pytest.mark.parametrize(
    ("command", "status"),
    [
        (["accelerate", "launch", "--gpu_ids", "1", "-m", "pkg.train"], 2),
        (["deepspeed", "--num_gpus", "2", "--module", "pkg.train", "--lr", "0.1"], 2),
        (["deepspeed", "--module", "--include", "localhost:1", "pkg.train"], 2),
        (["deepspeed", "--no_python", "--num_gpus=2", "bash", "run.sh"], 2),
        (["accelerate", "launch", "--no-python", "--gpu_ids", "0", "./run.sh"], 2),
        # A launcher's option's value before the module's name is no module's name.
        (["deepspeed", "-m", "--master_port", "29500", "--num_gpus", "2", "pkg.train"], 2),
        (["deepspeed", "--no_python", "-H", "hosts", "-i", "localhost:1", "bash", "run.sh"], 2),
        (["accelerate", "launch", "-m", "--main_process_port", "1", "--gpu_ids=1", "pkg.t"], 2),
        (["accelerate", "launch", "--module", "--num-processes", "2", "--gpu_ids", "1", "p"], 2),
        # The module's or the program's own options: the line runs.
        (["accelerate", "launch", "-m", "pkg.train", "--gpu_ids", "0"], 0),
        (["deepspeed", "--module", "pkg.train", "--num_gpus", "2"], 0),
        (["deepspeed", "--no_python", "bash", "run.sh", "-i", "localhost:1"], 0),
        (["deepspeed", "-m", "--master_port", "29500", "pkg.train", "--num_gpus", "2"], 0),
        (["deepspeed", "-m", "pkg.train", "--num_gpus", "2", "--config", "cfg/a.py"], 0),
    ],
)
def test_a_launcher_running_a_module_is_refused_where_it_chooses_its_own_gpus(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, command: list[str], status: int
) -> None:
    # `accelerate launch --gpu_ids 1 -m pkg.train` runs its workers on GPU 1, whichever GPU
    # gpuwait reserved, as `--gpu_ids 1 train.py` does: its options end at the module's name
    # (or, with --no_python, the program's), not at a script's .py.
    env, ran = fake_bin(tmp_path, "accelerate", "deepspeed")
    done = gpuwait(gpuwait_cmd, command, env)
    ends(done, ran, status, "gpuwait: error: ")
    if status:
        assert "runs its workers on GPUs it chooses itself" in done.stderr


@pytest.mark.parametrize(
    ("command", "status"),
    [
        (["apptainer", "exec", "--nv", "img.sif", "deepspeed", "--num_gpus", "2", "x.py"], 2),
        (["singularity", "exec", "-B", "/d", "i.sif", "deepspeed", "-i", "localhost:1", "x.py"], 2),
        (["apptainer", "exec", "--nv", "i.sif", "accelerate", "launch", "--gpu_ids=1", "x.py"], 2),
        (["apptainer", "exec", "--nv", "img.sif", "sh", "-c", "deepspeed --num_gpus=2 x.py"], 2),
        # The script's own options: the line runs; so does a container given only the GPUs
        # NVIDIA_VISIBLE_DEVICES names, whose launcher has no other GPU to choose.
        (["apptainer", "exec", "--nv", "img.sif", "deepspeed", "x.py", "--num_gpus", "2"], 0),
        (["apptainer", "exec", "--nvccli", "-C", "i.sif", "deepspeed", "--num_gpus", "2"], 0),
    ],
)
def test_a_launcher_in_an_apptainer_container_is_refused_where_it_chooses_its_own_gpus(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, command: list[str], status: int
) -> None:
    # `apptainer exec --nv img.sif deepspeed --num_gpus 2 x.py`, the usual way to run
    # DeepSpeed on a cluster, ran its workers on GPUs 0 and 1 whichever GPUs gpuwait reserved:
    # --nv gives the container every GPU, and what ran in it was not looked at.
    env, ran = fake_bin(tmp_path, "apptainer", "singularity")
    env = with_nvidia_visible_devices(env, "GPU-1")
    done = gpuwait(gpuwait_cmd, command, env)
    ends(done, ran, status, "gpuwait: error: ")
    if status:
        assert "runs its workers on GPUs it chooses itself" in done.stderr
    if command[4:6] == ["deepspeed", "--num_gpus"]:
        line = "gpuwait --gpus 2 ... -- apptainer exec --nv img.sif deepspeed x.py"
        assert line in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("inner", "said", "line"),
    [
        (
            ["env", "CUDA_VISIBLE_DEVICES=0", "python", "x.py"],
            "env sets CUDA_VISIBLE_DEVICES=0 for its command",
            "-- apptainer exec --nv img.sif env python x.py;",
        ),
        (
            ["env", "-u", "CUDA_VISIBLE_DEVICES", "python", "x.py"],
            "env starts its command without the CUDA_VISIBLE_DEVICES gpuwait sets",
            "-- apptainer exec --nv img.sif env python x.py\n",
        ),
        (
            ["sh", "-c", "CUDA_VISIBLE_DEVICES=1 python x.py"],
            "sh sets CUDA_VISIBLE_DEVICES=1 for its command",
            "",
        ),
    ],
)
def test_a_command_in_an_apptainer_container_is_refused_where_it_sets_its_own_gpus(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, inner: list[str], said: str, line: str
) -> None:
    # `apptainer exec --nv img.sif env CUDA_VISIBLE_DEVICES=0 python x.py` ran python on GPU
    # 0, whichever GPU gpuwait had reserved, where the same line bare is refused: --nv gives
    # the container every GPU, and the command in it was looked at for a launcher alone.
    env, ran = fake_bin(tmp_path, "apptainer")
    done = gpuwait(gpuwait_cmd, ["apptainer", "exec", "--nv", "img.sif", *inner], env)
    refused(done, ran, said, line)
    # Its own GPU, passed on, runs.
    own = 'CUDA_VISIBLE_DEVICES="$CUDA_VISIBLE_DEVICES" python x.py'
    kept = ["apptainer", "exec", "--nv", "img.sif", "sh", "-c", own]
    assert gpuwait(gpuwait_cmd, kept, env).returncode == 0
    assert ran.exists()


@pytest.mark.parametrize(
    "line",
    [
        ["sh", "-c", 'exec apptainer "$@"', "apptainer", "exec", "--nv", "img.sif", "python"],
        ["apptainer"],
        ["singularity", "--debug"],
    ],
)
def test_apptainer_given_no_action_runs(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, line: list[str]
) -> None:
    # `gpuwait --vram 4G -- sh -c 'exec apptainer "$@"' apptainer exec --nv img.sif python`,
    # a wrapper script's way, and `apptainer` alone (which prints its help) ended in a
    # traceback, exit 1: no action among the words read, and the word before where its options
    # would begin was looked up all the same.
    env, ran = fake_bin(tmp_path, "apptainer", "singularity")
    done = gpuwait(gpuwait_cmd, line, env)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert ran.exists()


def test_the_line_the_refusal_of_env_i_in_an_apptainer_container_gives_runs(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # `apptainer exec --nv img.sif env -i PATH=/usr/bin python x.py` is refused, its hint a
    # shell's code that sets gpuwait's variables again in env's: that line was refused in
    # turn, "env starts its command without the CUDA_VISIBLE_DEVICES gpuwait sets", the code
    # read up to its first expansion taken for all of env's words in the container.
    env, ran = fake_bin(tmp_path, "apptainer")
    line = ["apptainer", "exec", "--nv", "img.sif", "env", "-i", "PATH=/usr/bin", "python", "x.py"]
    done = gpuwait(gpuwait_cmd, line, env)
    refused(done, ran, "env starts its command without the CUDA_VISIBLE_DEVICES gpuwait sets")
    said = hint(done)
    assert said.startswith("sh -c 'exec apptainer exec --nv img.sif env -i PATH=/usr/bin "), said
    # The line as the hint gives it runs, the container's command given the GPU reserved.
    runs(gpuwait_cmd, said, env, opts=ON_GPU_1)
    assert f"CUDA_VISIBLE_DEVICES={reserved_uuid(sim)} " in ran.read_text()


@pytest.mark.parametrize(
    "code",
    [
        'deepspeed --num_gpus 2 "$PWD/x.py"',
        "exec accelerate launch --gpu_ids=1 $SCRIPT --lr 0.1",
        'apptainer exec --nv img.sif deepspeed --include localhost:1 "$PWD/x.py"',
        'exec apptainer exec --nv img.sif env A=1 deepspeed --num_gpus 2 "$PWD/x.py"',
    ],
)
def test_a_launcher_in_a_shell_whose_script_is_an_expansion_is_refused(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, code: str
) -> None:
    # `sh -c 'deepspeed --num_gpus 2 "$PWD/x.py"'` ran its workers on GPUs 0 and 1, whichever
    # GPUs gpuwait had reserved, where `sh -c 'deepspeed --num_gpus 2 x.py'` is refused: the
    # shell's code is read up to the expansion, and a launcher whose script was not among the
    # words read was not looked at, though every option before it is the launcher's own.
    env, ran = fake_bin(tmp_path, "deepspeed", "accelerate", "apptainer")
    done = gpuwait(gpuwait_cmd, ["sh", "-c", code], {**env, "SCRIPT": "x.py"})
    refused(done, ran, "runs its workers on GPUs it chooses itself")
    # An option of the script's own, after it, runs.
    done = gpuwait(gpuwait_cmd, ["sh", "-c", 'deepspeed "$PWD/x.py" --num_gpus 2'], env)
    assert done.returncode == 0, done.stderr


def test_a_default_of_a_variable_a_clean_apptainer_container_lacks_is_refused(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # `apptainer exec --nv --cleanenv img.sif sh -c 'CUDA_VISIBLE_DEVICES=${GPUWAIT_GPU_UUIDS:-0}
    # python x.py'` would run python on GPU 0, whichever GPU gpuwait reserved: --cleanenv
    # passes the container gpuwait's CUDA_VISIBLE_DEVICES (its APPTAINERENV_ copy), not
    # GPUWAIT_GPU_UUIDS, whose default then fills it.
    env, ran = fake_bin(tmp_path, "apptainer")
    code = "CUDA_VISIBLE_DEVICES=${GPUWAIT_GPU_UUIDS:-0} python x.py"
    line = ["apptainer", "exec", "--nv", "--cleanenv", "img.sif", "sh", "-c", code]
    done = gpuwait(gpuwait_cmd, line, env)
    refused(done, ran, "sh sets 'CUDA_VISIBLE_DEVICES=${GPUWAIT_GPU_UUIDS:-0}' for its command")
    # Without --cleanenv the container gets it, and the default is not used: the line runs.
    line.remove("--cleanenv")
    assert gpuwait(gpuwait_cmd, line, env).returncode == 0
    assert ran.exists()


#: A stand-in for `apptainer exec [OPTIONS] IMAGE COMMAND...`: runs COMMAND, with the
#: environment it was given.
APPTAINER_RUNS = '#!/bin/sh\nshift\nwhile [ "${1#-}" != "$1" ]; do shift; done\nshift\nexec "$@"\n'


@pytest.mark.parametrize(
    "before", [["env", "GPUWAIT_GPU_UUIDS="], ["env", "-u", "GPUWAIT_GPU_UUIDS"]]
)
def test_a_default_in_an_apptainer_container_of_a_variable_a_wrapper_emptied_is_refused(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, before: list[str]
) -> None:
    # `env GPUWAIT_GPU_UUIDS= apptainer exec --nv img.sif sh -c
    # 'CUDA_VISIBLE_DEVICES=${GPUWAIT_GPU_UUIDS:-0} python x.py'` ran python on GPU 0,
    # whichever GPU gpuwait had reserved, where the same line without the container is
    # refused: the command in the container was judged as though it got gpuwait's variables
    # whatever the wrappers before Apptainer had done to them.
    env, _ = fake_bin(tmp_path)
    stand_in(tmp_path, "apptainer", APPTAINER_RUNS)
    code = (
        "CUDA_VISIBLE_DEVICES=${GPUWAIT_GPU_UUIDS:-0} sh -c 'echo \"$CUDA_VISIBLE_DEVICES\" > seen'"
    )
    line = [*before, "apptainer", "exec", "--nv", "img.sif", "sh", "-c", code]
    done = gpuwait(gpuwait_cmd, line, env, cwd=tmp_path)
    said = "sh sets 'CUDA_VISIBLE_DEVICES=${GPUWAIT_GPU_UUIDS:-0}' for its command"
    refused(done, tmp_path / "seen", said)
    # The same, run bare where gpuwait's GPU is set: GPU 0.
    assert seen_bare(line, tmp_path, env, GPUWAIT_GPU_UUIDS="GPU-own") == "0"
    # Without the wrapper, the container gets gpuwait's: the line runs on the GPU reserved.
    done = gpuwait(gpuwait_cmd, line[len(before) :], env, opts=ON_GPU_1, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "seen").read_text().strip() == reserved_uuid(sim)


def test_a_launcher_in_an_nvccli_container_given_every_gpu_is_refused(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # With visible_devices = index, the refusal of `apptainer exec --nvccli -C` without
    # NVIDIA_VISIBLE_DEVICES gives the line with NVIDIA_VISIBLE_DEVICES=all: there the
    # container has every GPU, and `deepspeed --num_gpus 2` in it ran its workers on GPUs 0
    # and 1, whichever GPUs gpuwait reserved.
    env, ran = fake_bin(tmp_path, "apptainer")
    env = {**with_nvidia_visible_devices(env, None), "GPUWAIT_VISIBLE_DEVICES": "index"}
    command = ["apptainer", "exec", "--nvccli", "-C", "i.sif", "deepspeed", "--num_gpus", "2"]
    first = gpuwait(gpuwait_cmd, [*command, "x.py"], env)
    refused(first, ran, "NVIDIA_VISIBLE_DEVICES=all gpuwait ... -- ")
    done = gpuwait(gpuwait_cmd, [*command, "x.py"], with_nvidia_visible_devices(env, "all"))
    refused(done, ran, "runs its workers on GPUs it chooses itself")
    assert "-- apptainer exec --nvccli -C i.sif deepspeed x.py\n" in done.stderr


@pytest.mark.parametrize(
    ("command", "kept"),
    [
        (
            ["python", "-m", "accelerate.commands.launch", "--gpu_ids", "1", "x.py"],
            "python -m accelerate.commands.launch x.py",
        ),
        (
            ["python3", "-u", "-m", "deepspeed.launcher.runner", "--num_gpus=2", "x.py"],
            "python3 -u -m deepspeed.launcher.runner x.py",
        ),
        (
            [
                "python",
                "-m",
                "accelerate.commands.accelerate_cli",
                "launch",
                "--gpu-ids",
                "0",
                "x.py",
            ],
            "python -m accelerate.commands.accelerate_cli launch x.py",
        ),
    ],
)
def test_a_launcher_run_by_its_module_is_refused_where_it_chooses_its_own_gpus(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, command: list[str], kept: str
) -> None:
    # `python -m accelerate.commands.launch --gpu_ids 1 x.py`, accelerate's documented other
    # way to launch, ran its workers on GPU 1 whichever GPU gpuwait reserved, where `accelerate
    # launch --gpu_ids 1 x.py` is refused.
    env, ran = fake_bin(tmp_path, "python", "python3")
    done = gpuwait(gpuwait_cmd, command, env)
    refused(done, ran, "runs its workers on GPUs it chooses itself", f"-- {kept}\n")


@pytest.mark.parametrize("option", [["--num_accelerators", "2"], ["--num_accelerators=2"]])
def test_deepspeeds_other_name_for_num_gpus_is_refused(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, option: list[str]
) -> None:
    # `deepspeed --num_accelerators 2 train.py`, deepspeed's other name for --num_gpus, ran
    # its workers on GPUs 0 and 1 whichever GPUs gpuwait reserved.
    env, ran = fake_bin(tmp_path, "deepspeed")
    done = gpuwait(gpuwait_cmd, ["deepspeed", *option, "train.py"], env)
    hint = "GPUWAIT_VISIBLE_DEVICES=index gpuwait --gpus 2 ... -- deepspeed train.py\n"
    refused(done, ran, "deepspeed --num_accelerators runs its workers on GPUs", hint)


@pytest.mark.parametrize(
    ("options", "variables"),
    [
        (["--containall=false"], {"APPTAINER_CONTAINALL": "1"}),
        (["--pid=false"], {"APPTAINER_PID": "true"}),
        (["--contain", "--compat=0", "--cleanenv=f"], {}),
    ],
)
def test_a_pausable_job_whose_apptainer_pid_namespace_is_turned_off_runs(
    sim: Path,
    gpuwait_cmd: list[str],
    tmp_path: Path,
    options: list[str],
    variables: dict[str, str],
) -> None:
    # `apptainer exec --containall=false`, the way to turn off for one line the
    # APPTAINER_CONTAINALL=1 a shell exports for every container, runs in no PID namespace of
    # its own (the command line wins over the variable): the --pausable job was refused all
    # the same, "(--containall)", with a hint that gave no line.
    env, ran = fake_bin(tmp_path, "apptainer")
    command = ["apptainer", "exec", "--nv", *options, "img.sif", "python", "x.py"]
    done = gpuwait(gpuwait_cmd, command, {**env, **variables}, opts=PAUSABLE)
    assert done.returncode == 0, done.stderr
    assert ran.exists()


@pytest.mark.parametrize(
    "line",
    [
        ["env", "GPUWAIT_GPU_UUIDS=0", "sh", "-c", "CUDA_VISIBLE_DEVICES=$GPUWAIT_GPU_UUIDS"],
        ["bash", "-c", "GPUWAIT_GPU_UUIDS=0; CUDA_VISIBLE_DEVICES=$GPUWAIT_GPU_UUIDS"],
        ["bash", "-c", 'export GPUWAIT_GPU_UUIDS=0; CUDA_VISIBLE_DEVICES="$GPUWAIT_GPU_UUIDS"'],
        ["sh", "-c", "GPUWAIT_GPU_INDICES=0 CUDA_VISIBLE_DEVICES=${GPUWAIT_GPU_INDICES:-1}"],
    ],
)
def test_a_shell_passing_on_a_gpu_variable_set_before_it_is_refused(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, line: list[str]
) -> None:
    # `env GPUWAIT_GPU_UUIDS=0 sh -c 'CUDA_VISIBLE_DEVICES=$GPUWAIT_GPU_UUIDS python x.py'`
    # ran python on GPU 0, whichever GPU gpuwait had reserved: a variable of gpuwait's passed
    # on by the shell was taken for gpuwait's value, though a wrapper or the code had set it.
    line = [*line[:-1], f"{line[-1]} sh -c 'echo \"$CUDA_VISIBLE_DEVICES\" > seen'"]
    done = gpuwait(gpuwait_cmd, line, cwd=tmp_path)
    refused(done, tmp_path / "seen", "for its command, over the CUDA_VISIBLE_DEVICES gpuwait sets")
    # The same, run bare where gpuwait's GPU is set: GPU 0.
    gpuwaits = {"GPUWAIT_GPU_UUIDS": "GPU-own", "GPUWAIT_GPU_INDICES": "1"}
    assert seen_bare(line, tmp_path, **gpuwaits) == "0"


@pytest.mark.parametrize(
    "line",
    [
        # What gpuwait sets, set again before it is passed on.
        ["env", "CUDA_DEVICE_ORDER=PCI_BUS_ID", "sh", "-c", "CUDA_DEVICE_ORDER=$CUDA_DEVICE_ORDER"],
        # Emptied before: no GPU at all, nobody else's.
        ["env", "GPUWAIT_GPU_UUIDS=", "sh", "-c", "CUDA_VISIBLE_DEVICES=$GPUWAIT_GPU_UUIDS"],
        ["bash", "-c", "CUDA_DEVICE_ORDER=PCI_BUS_ID; export CUDA_DEVICE_ORDER=$CUDA_DEVICE_ORDER"],
        # Another variable set before is no concern of gpuwait's.
        ["env", "SLOT=0", "sh", "-c", "CUDA_VISIBLE_DEVICES=$GPUWAIT_GPU_UUIDS"],
    ],
)
def test_a_shell_passing_on_what_gpuwait_allows_runs(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, line: list[str]
) -> None:
    line = [*line[:-1], f"{line[-1]} true"]
    done = gpuwait(gpuwait_cmd, line, {**os.environ, "GPUWAIT_VISIBLE_DEVICES": "index"})
    assert done.returncode == 0, done.stderr


def test_zsh_keeping_the_gpus_exported_after_export_n_runs_on_the_gpu_reserved(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # `zsh -c 'export -n CUDA_VISIBLE_DEVICES; python x.py'` was refused, exit 2, as bash's
    # is: zsh has no `export -n`, says "bad option: -n", carries on and keeps the variable
    # exported, and python gets the GPU gpuwait reserved.
    code = (
        "export -n CUDA_VISIBLE_DEVICES; sh -c 'echo \"${CUDA_VISIBLE_DEVICES-every GPU}\"' > seen"
    )
    done = gpuwait(gpuwait_cmd, ["zsh", "-c", code], opts=ON_GPU_1, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "seen").read_text().strip() == reserved_uuid(sim)
    # zsh's `typeset +x` takes it out of the environment, as bash's does: refused.
    (tmp_path / "seen").unlink()
    code = code.replace("export -n", "typeset +x")
    done = gpuwait(gpuwait_cmd, ["zsh", "-c", code], cwd=tmp_path)
    refused(done, tmp_path / "seen", "takes CUDA_VISIBLE_DEVICES out of its environment")
    assert seen_bare(["zsh", "-c", code], tmp_path) == "every GPU"


@pytest.mark.parametrize(("shell", "status"), [("zsh", 2), ("bash", 0)])
def test_export_a_of_the_gpus_is_refused_where_the_shell_makes_an_array_of_them(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, shell: str, status: int
) -> None:
    # zsh's `export -a CUDA_VISIBLE_DEVICES` makes an array of it, which no shell exports:
    # python would see every GPU. bash has no `export -a`, and keeps the variable as it was.
    code = (
        "export -a CUDA_VISIBLE_DEVICES; sh -c 'echo \"${CUDA_VISIBLE_DEVICES-every GPU}\"' > seen"
    )
    done = gpuwait(gpuwait_cmd, [shell, "-c", code], opts=ON_GPU_1, cwd=tmp_path)
    assert done.returncode == status, done.stderr
    if status:
        assert "takes CUDA_VISIBLE_DEVICES out of its environment" in done.stderr
        assert seen_bare([shell, "-c", code], tmp_path) == "every GPU"
    else:
        assert (tmp_path / "seen").read_text().strip() == reserved_uuid(sim)


@pytest.mark.parametrize(
    ("shell", "builtin", "kept"),
    [
        ("zsh", "local CUDA_VISIBLE_DEVICES=0", False),
        ("zsh", "local -x CUDA_VISIBLE_DEVICES=0", False),
        ("zsh", "integer CUDA_VISIBLE_DEVICES=0", False),
        ("zsh", "float CUDA_VISIBLE_DEVICES=0", False),
        ("zsh", "local -a CUDA_VISIBLE_DEVICES", False),
        ("zsh", "local +x CUDA_VISIBLE_DEVICES", False),
        ("zsh", "local CUDA_VISIBLE_DEVICES", True),
        ("zsh", "local x=1", True),
        ("bash", "local CUDA_VISIBLE_DEVICES=0", True),
        # Made a number, no value given: zsh reads gpuwait's UUID as arithmetic (GPU-own: 0).
        ("zsh", "integer CUDA_VISIBLE_DEVICES", False),
        ("zsh", "float CUDA_VISIBLE_DEVICES", False),
        ("zsh", "typeset -i CUDA_VISIBLE_DEVICES", False),
        ("zsh", "local -xF CUDA_VISIBLE_DEVICES", False),
        ("zsh", "typeset +i CUDA_VISIBLE_DEVICES", True),
        ("zsh", "integer n", True),
        ("bash", "declare -i CUDA_VISIBLE_DEVICES", True),
        # Made a number of gpuwait's own value, passed on: read as arithmetic all the same,
        # by bash too (GPU-own: 0; a UUID with a word such as 02d7 in it, an error).
        ("zsh", 'integer CUDA_VISIBLE_DEVICES="$CUDA_VISIBLE_DEVICES"', False),
        ("zsh", "typeset -i CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES", False),
        ("zsh", "local -F CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES}", False),
        ("bash", 'declare -i CUDA_VISIBLE_DEVICES="$CUDA_VISIBLE_DEVICES"', False),
        ("bash", 'declare -xi CUDA_VISIBLE_DEVICES="$CUDA_VISIBLE_DEVICES"', False),
        ("bash", 'declare -x CUDA_VISIBLE_DEVICES="$CUDA_VISIBLE_DEVICES"', True),
        ("bash", 'export -i CUDA_VISIBLE_DEVICES="$CUDA_VISIBLE_DEVICES"', True),
        ("zsh", 'export -i CUDA_VISIBLE_DEVICES="$CUDA_VISIBLE_DEVICES"', False),
        ("zsh", 'typeset -x CUDA_VISIBLE_DEVICES="$CUDA_VISIBLE_DEVICES"', True),
        # zsh's -Z, -L, -R, -E and -F take a width, glued on or the next word, or none,
        # before a value in quotes: set all the same.
        ("zsh", 'local -Z 3 CUDA_VISIBLE_DEVICES="0"', False),
        ("zsh", 'local -Z3 CUDA_VISIBLE_DEVICES="0"', False),
        ("zsh", 'typeset -F CUDA_VISIBLE_DEVICES="1"', False),
        ("zsh", 'typeset -Z CUDA_VISIBLE_DEVICES="1"', False),
        ("zsh", 'typeset -L 4 CUDA_VISIBLE_DEVICES="1"', False),
        ("zsh", 'typeset -E 2 CUDA_VISIBLE_DEVICES="1"', False),
        ("zsh", 'local -Z 3 x=0 CUDA_VISIBLE_DEVICES="1"', False),
        ("zsh", "local -Z 3 CUDA_VISIBLE_DEVICES=0", False),
        ("zsh", "local -F 3 CUDA_VISIBLE_DEVICES", False),
        ("zsh", "typeset -R 3 CUDA_VISIBLE_DEVICES", True),
        ("zsh", 'local -F t="$(date +%s)"', True),
        ("zsh", 'local -Z 3 n="$RANDOM"', True),
        # zsh's export takes them too (not -x, nor -g: "bad option", nothing set).
        ("zsh", "export -Z 3 CUDA_VISIBLE_DEVICES=0", False),
        ("zsh", 'export -r CUDA_VISIBLE_DEVICES="0"', False),
        ("zsh", "export -xZ CUDA_VISIBLE_DEVICES=0", True),
        ("zsh", "export -g CUDA_VISIBLE_DEVICES=0", True),
        # After another variable whose value is an expansion: made a number all the same.
        ("zsh", 'integer n="$1" CUDA_VISIBLE_DEVICES', False),
        ("zsh", "local -F t=$1 CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES", False),
        ("bash", 'declare -i n="$1" CUDA_VISIBLE_DEVICES="$CUDA_VISIBLE_DEVICES"', False),
        ("bash", 'declare -i n="$1" CUDA_VISIBLE_DEVICES', True),
        ("zsh", 'integer n="$1" m', True),
    ],
)
def test_zshs_local_integer_and_float_are_read_as_typeset(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, shell: str, builtin: str, kept: bool
) -> None:
    # zsh's local, integer and float are typeset, outside a function too: `zsh -c 'local
    # CUDA_VISIBLE_DEVICES=0; python x.py'` ran python on GPU 0, whichever GPU gpuwait had
    # reserved, and `local -a CUDA_VISIBLE_DEVICES` on every GPU, where `typeset ...` is
    # refused. bash's local outside a function says so and does nothing. What the shell itself
    # does with the line, asked first, decides.
    code = f"{builtin}; sh -c 'echo \"${{CUDA_VISIBLE_DEVICES-every GPU}}\"' > seen"
    assert (seen_bare([shell, "-c", code], tmp_path) == "GPU-own") is kept
    done = gpuwait(gpuwait_cmd, [shell, "-c", code], opts=ON_GPU_1, cwd=tmp_path)
    if kept:
        ran_on_the_gpu_reserved(done, tmp_path / "seen", sim)
    else:
        refused(done, tmp_path / "seen")


def test_a_number_made_in_the_code_flock_hands_to_the_users_shell_is_refused_in_words(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # flock -c runs its code with the user's shell ($SHELL), which the line does not name:
    # the refusal said "(declare -i ...):  reads the GPU UUID gpuwait sets as arithmetic",
    # the shell's name left blank.
    code = 'declare -i CUDA_VISIBLE_DEVICES="$CUDA_VISIBLE_DEVICES"; '
    code += "sh -c 'echo \"${CUDA_VISIBLE_DEVICES-every GPU}\"' > seen"
    line = ["flock", str(tmp_path / "lock"), "-c", code]
    assert seen_bare(line, tmp_path, SHELL="/bin/bash") == "0"
    done = gpuwait(gpuwait_cmd, line, {**os.environ, "SHELL": "/bin/bash"}, opts=ON_GPU_1)
    refused(done, tmp_path / "seen", "the shell reads the GPU UUID gpuwait sets as arithmetic")


@pytest.mark.parametrize(
    "options", ["-nx", "-xn", "-n -x", "-nz", "-n -v", "-n", "-na", "-n -p", "-n --", "-n +x"]
)
def test_bash_export_n_is_refused_only_where_bash_takes_the_gpus_out(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, options: str
) -> None:
    # `bash -c 'export -nx CUDA_VISIBLE_DEVICES; python x.py'` was refused, exit 2, though
    # bash's export has no -x: it says "invalid option", does nothing, and python gets the
    # GPU gpuwait reserved. What bash itself does with the line decides.
    code = f"export {options} CUDA_VISIBLE_DEVICES; "
    code += "sh -c 'echo \"${CUDA_VISIBLE_DEVICES-every GPU}\"' > seen"
    dropped = seen_bare(["bash", "-c", code], tmp_path) == "every GPU"
    done = gpuwait(gpuwait_cmd, ["bash", "-c", code], opts=ON_GPU_1, cwd=tmp_path)
    if dropped:
        refused(done, tmp_path / "seen", "takes CUDA_VISIBLE_DEVICES out of its environment")
    else:
        ran_on_the_gpu_reserved(done, tmp_path / "seen", sim)


@pytest.mark.skipif(shutil.which("fish") is None, reason="needs fish")
@pytest.mark.parametrize(
    "code",
    [
        "env CUDA_VISIBLE_DEVICES=0 sh -c 'echo $CUDA_VISIBLE_DEVICES' > seen",
        "CUDA_VISIBLE_DEVICES=0 sh -c 'echo $CUDA_VISIBLE_DEVICES' > seen",
        "export CUDA_VISIBLE_DEVICES=0; sh -c 'echo $CUDA_VISIBLE_DEVICES' > seen",
    ],
)
def test_fish_code_setting_the_gpus_is_refused(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, code: str
) -> None:
    # `fish -c 'env CUDA_VISIBLE_DEVICES=0 python x.py'` ran python on GPU 0, whichever GPU
    # gpuwait had reserved, where the same code in sh or bash is refused: fish's code was not
    # read at all.
    done = gpuwait(gpuwait_cmd, ["fish", "-c", code], cwd=tmp_path)
    refused(done, tmp_path / "seen", "sets CUDA_VISIBLE_DEVICES=0 for its command")
    assert seen_bare(["fish", "-c", code], tmp_path) == "0"


@pytest.mark.skipif(shutil.which("fish") is None, reason="needs fish")
@pytest.mark.parametrize(
    "first",
    [
        # fish has none of these: it says "Unknown command" (its export: an error), carries
        # on and keeps the variable exported.
        "unset CUDA_VISIBLE_DEVICES",
        "declare +x CUDA_VISIBLE_DEVICES",
        "declare -a CUDA_VISIBLE_DEVICES=0",
        "readonly CUDA_VISIBLE_DEVICES=0",
        "export -n CUDA_VISIBLE_DEVICES",
    ],
)
def test_fish_code_keeping_the_gpus_runs_on_the_gpu_reserved(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, first: str
) -> None:
    code = f"{first}; sh -c 'echo $CUDA_VISIBLE_DEVICES' > seen"
    done = gpuwait(gpuwait_cmd, ["fish", "-c", code], opts=ON_GPU_1, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "seen").read_text().strip() == reserved_uuid(sim)


@pytest.mark.skipif(shutil.which("fish") is None, reason="needs fish")
@pytest.mark.parametrize(
    ("first", "seen"),
    [
        ("set -gx CUDA_VISIBLE_DEVICES 0", "0"),
        ("set CUDA_VISIBLE_DEVICES 0", "0"),
        ("set -e CUDA_VISIBLE_DEVICES", ""),
        ("set --unexport CUDA_VISIBLE_DEVICES", ""),
        ("set -l CUDA_VISIBLE_DEVICES", ""),
        ("set -a CUDA_VISIBLE_DEVICES 1", "GPU-own 1"),
        # An element of the list: the whole of it, where gpuwait gives one GPU.
        ("set -x CUDA_VISIBLE_DEVICES[1] 0", "0"),
        ("set CUDA_VISIBLE_DEVICES[1] 0", "0"),
        # After a local of the code's own, as fish code starts.
        ("set -l i 0; set -gx CUDA_VISIBLE_DEVICES 0", "0"),
        ("set -e tmp; set -gx CUDA_VISIBLE_DEVICES 0", "0"),
    ],
)
def test_fish_set_changing_the_gpus_is_refused(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, first: str, seen: str
) -> None:
    # `fish -c 'set -gx CUDA_VISIBLE_DEVICES 0; python x.py'` ran python on GPU 0, and `set
    # -e CUDA_VISIBLE_DEVICES` (or a local of that name) on every GPU, those given to other
    # jobs too: fish's `set` was not read.
    code = f"{first}; sh -c 'echo $CUDA_VISIBLE_DEVICES' > seen"
    done = gpuwait(gpuwait_cmd, ["fish", "-c", code], cwd=tmp_path)
    said = "for its command, over" if seen else "takes CUDA_VISIBLE_DEVICES out of its environment"
    refused(done, tmp_path / "seen", said)
    assert seen_bare(["fish", "-c", code], tmp_path) == seen


@pytest.mark.skipif(shutil.which("fish") is None, reason="needs fish")
@pytest.mark.parametrize(
    "first",
    [
        "set -gx OMP_NUM_THREADS 4",
        "set -e OMP_NUM_THREADS",
        "set -q CUDA_VISIBLE_DEVICES",
        "set -gx CUDA_VISIBLE_DEVICES $CUDA_VISIBLE_DEVICES",
        "set -a CUDA_VISIBLE_DEVICES",
        "set -l i 0; set -gx OMP_NUM_THREADS 4",
    ],
)
def test_fish_set_keeping_the_gpus_runs_on_the_gpu_reserved(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, first: str
) -> None:
    code = f"{first}; sh -c 'echo $CUDA_VISIBLE_DEVICES' > seen"
    done = gpuwait(gpuwait_cmd, ["fish", "-c", code], opts=ON_GPU_1, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "seen").read_text().strip() == reserved_uuid(sim)


@pytest.mark.parametrize(
    ("code", "dropped"),
    [
        ('env -i HOME="$HOME" sh ./show.sh', True),
        ('exec env -i PATH="$PATH" HOME="$HOME" sh ./show.sh', True),
        ('env - LANG="$LANG" sh ./show.sh', True),
        ('env -i CUDA_VISIBLE_DEVICES="$CUDA_VISIBLE_DEVICES" sh ./show.sh', False),
        ('env -u TMPDIR HOME="$HOME" sh ./show.sh', False),
    ],
)
def test_env_clearing_its_environment_before_a_value_from_an_expansion_is_read_as_env(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, code: str, dropped: bool
) -> None:
    # In a shell's code, env's assignment from an expansion (`HOME="$HOME"`) ended what was
    # read of the line: `sh -c 'env -i HOME="$HOME" python x.py'` ran, python seeing every
    # GPU, those given to other jobs too, where `env -i HOME=/root python x.py` is refused.
    # env's options end before such a word, whatever it expands to.
    (tmp_path / "show.sh").write_text('echo "${CUDA_VISIBLE_DEVICES-every GPU}" > seen\n')
    done = gpuwait(gpuwait_cmd, ["sh", "-c", code], opts=ON_GPU_1, cwd=tmp_path)
    if dropped:
        refused(done, tmp_path / "seen", "without the CUDA_VISIBLE_DEVICES gpuwait sets")
    else:
        ran_on_the_gpu_reserved(done, tmp_path / "seen", sim)


@pytest.mark.parametrize(
    "code",
    [
        'env -iu TMPDIR HOME="$HOME" sh ./show.sh',
        'env -iC . HOME="$HOME" sh ./show.sh',
    ],
)
def test_env_clearing_its_environment_with_options_in_one_word_is_read_as_env(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, code: str
) -> None:
    # `sh -c 'env -iu TMPDIR HOME="$HOME" python x.py'` ran, python seeing every GPU: -iu,
    # its TMPDIR then taken for env's command, left env's assignment from an expansion unread.
    (tmp_path / "show.sh").write_text('echo "[${CUDA_VISIBLE_DEVICES-every GPU}]" > seen\n')
    done = gpuwait(gpuwait_cmd, ["sh", "-c", code], opts=ON_GPU_1, cwd=tmp_path)
    refused(done, tmp_path / "seen", "without the CUDA_VISIBLE_DEVICES gpuwait sets")


@pytest.mark.parametrize(
    ("shell", "line"),
    [
        # Made a number of gpuwait's own value, passed on, by zsh's float and typeset -E.
        ("zsh", 'float CUDA_VISIBLE_DEVICES="$CUDA_VISIBLE_DEVICES"'),
        ("zsh", 'typeset -E CUDA_VISIBLE_DEVICES="$CUDA_VISIBLE_DEVICES"'),
        ("bash", 'typeset -i CUDA_VISIBLE_DEVICES="$CUDA_VISIBLE_DEVICES"'),
        # dash has no typeset (nor declare, local outside a function): the line goes on.
        ("dash", 'typeset -i CUDA_VISIBLE_DEVICES="$CUDA_VISIBLE_DEVICES"'),
        ("dash", 'declare -a CUDA_VISIBLE_DEVICES="$CUDA_VISIBLE_DEVICES"'),
        # sh, whichever shell it is here: dash (Debian, Ubuntu) runs the line on, bash refuses.
        ("sh", 'typeset -i CUDA_VISIBLE_DEVICES="$CUDA_VISIBLE_DEVICES"'),
        # bash's -F lists functions and sets nothing: no number made.
        ("bash", 'declare -F CUDA_VISIBLE_DEVICES="$CUDA_VISIBLE_DEVICES"'),
        # +i takes the attribute away: the value passed on is the text it was.
        ("zsh", 'typeset +i CUDA_VISIBLE_DEVICES="$CUDA_VISIBLE_DEVICES"'),
        # env's quoted assignment read whole, env named by its path or run by another env.
        ("bash", '/usr/bin/env NOTE="a b" CUDA_VISIBLE_DEVICES=0'),
        ("bash", 'env env NOTE="a b" CUDA_VISIBLE_DEVICES=0'),
        ("bash", 'env NOTE="a b" CUDA_VISIBLE_DEVICES="$CUDA_VISIBLE_DEVICES"'),
    ],
)
def test_a_shells_numbers_and_envs_run_where_the_shell_gives_gpuwaits_gpu(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, shell: str, line: str
) -> None:
    # What the shell itself gives its command, asked first, decides: gpuwait's own GPU, and
    # the line runs on it; another value, and the line is refused before waiting.
    code = f"{line} sh -c 'echo \"${{CUDA_VISIBLE_DEVICES-every GPU}}\"' > seen"
    if line.split()[0] in ("float", "typeset", "declare"):
        code = code.replace(" sh -c", "; sh -c", 1)
    kept = seen_bare([shell, "-c", code], tmp_path) == "GPU-own"
    done = gpuwait(gpuwait_cmd, [shell, "-c", code], opts=ON_GPU_1, cwd=tmp_path)
    if kept:
        ran_on_the_gpu_reserved(done, tmp_path / "seen", sim)
    else:
        refused(done, tmp_path / "seen")


def test_a_typeset_of_sh_is_refused_where_the_sh_on_path_is_bash(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # `sh -c 'typeset -i CUDA_VISIBLE_DEVICES="$CUDA_VISIBLE_DEVICES"; ...'` with bash as the
    # sh on PATH: bash reads the GPU UUID as arithmetic, as the line run bare shows; refused.
    env, _ = fake_bin(tmp_path)
    bash = shutil.which("bash")
    assert bash is not None
    (tmp_path / "fakebin" / "sh").symlink_to(bash)
    code = 'typeset -i CUDA_VISIBLE_DEVICES="$CUDA_VISIBLE_DEVICES"; ' + _SEEN
    assert seen_bare(["sh", "-c", code], tmp_path, env) != "GPU-own"
    done = gpuwait(gpuwait_cmd, ["sh", "-c", code], env, opts=ON_GPU_1, cwd=tmp_path)
    refused(done, tmp_path / "seen", "makes CUDA_VISIBLE_DEVICES a number")


@pytest.mark.parametrize("cut", ["%%,*", "#*,", "##*,"])
def test_a_shell_cutting_a_list_it_set_itself_is_judged_by_what_the_cut_keeps(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path, cut: str
) -> None:
    # `CUDA_VISIBLE_DEVICES=-1,0` hides every GPU (CUDA stops at -1); cut at its commas, the
    # first entry (`%%,*`), -1, still does, and the line runs on no GPU, but the rest or the
    # last (`#*,`, `##*,`), 0, is GPU 0, whichever GPU gpuwait reserved: refused.
    code = f"CUDA_VISIBLE_DEVICES=-1,0; CUDA_VISIBLE_DEVICES=${{CUDA_VISIBLE_DEVICES{cut}}} {_SEEN}"
    bare = seen_bare(["bash", "-c", code], tmp_path)
    assert bare == ("-1" if cut == "%%,*" else "0"), bare
    done = gpuwait(gpuwait_cmd, ["bash", "-c", code], opts=ON_GPU_1, cwd=tmp_path)
    if bare == "-1":
        assert done.returncode == 0, done.stderr
        assert (tmp_path / "seen").read_text().strip() == "-1"
    else:
        refused(done, tmp_path / "seen", "over the CUDA_VISIBLE_DEVICES gpuwait sets")


def test_a_name_in_a_comment_after_a_number_declared_is_no_name_declared(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # zsh's `integer n="$1" # CUDA_VISIBLE_DEVICES` declares n alone, the rest a comment:
    # the line runs on the GPU gpuwait reserved, as zsh asked first says.
    shell = "zsh"
    code = 'integer n="$1" # CUDA_VISIBLE_DEVICES\n'
    code += "sh -c 'echo \"${CUDA_VISIBLE_DEVICES-every GPU}\"' > seen"
    assert seen_bare([shell, "-c", code], tmp_path) == "GPU-own"
    done = gpuwait(gpuwait_cmd, [shell, "-c", code], opts=ON_GPU_1, cwd=tmp_path)
    ran_on_the_gpu_reserved(done, tmp_path / "seen", sim)


@pytest.mark.skipif(shutil.which("dash") is None, reason="needs dash")
def test_dashs_readonly_setting_the_gpus_before_its_command_is_refused(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # dash has export and readonly of the builtins that declare: `dash -c 'readonly
    # CUDA_VISIBLE_DEVICES=0; python x.py'` runs python on GPU 0, whichever GPU gpuwait
    # reserved, as the line run bare shows; it is refused, as bash's is.
    line = 'readonly CUDA_VISIBLE_DEVICES=0; echo "${CUDA_VISIBLE_DEVICES-every GPU}" > seen'
    done = gpuwait(gpuwait_cmd, ["dash", "-c", line], cwd=tmp_path)
    refused(done, tmp_path / "seen", "dash sets CUDA_VISIBLE_DEVICES=0 for its command")
    assert seen_bare(["dash", "-c", line], tmp_path) == "0"


#: A stand-in for `apptainer exec [OPTIONS] IMAGE CMD...` whose image's sh is bash (as a
#: Rocky or CentOS image's is): the command is run, `sh` being the image's own.
APPTAINER_BASH_IMAGE = """#!/bin/sh
shift
while [ "${1#-}" != "$1" ]; do shift; done
shift
if [ "$1" = sh ]; then shift; exec bash "$@"; fi
exec "$@"
"""


def test_the_sh_in_a_container_is_read_as_bash_whatever_the_hosts_sh(
    sim: Path, gpuwait_cmd: list[str], tmp_path: Path
) -> None:
    # `apptainer exec img.sif sh -c 'declare -x CUDA_VISIBLE_DEVICES=0; ...'` runs the image's
    # sh, which may be bash where the host's is dash: its python on GPU 0, not the one gpuwait
    # reserved. The image's shell cannot be told from here: the line is read as bash's, and
    # refused before waiting, as bash -c's is.
    env, _ = fake_bin(tmp_path)
    stand_in(tmp_path, "apptainer", APPTAINER_BASH_IMAGE)
    code = "declare -x CUDA_VISIBLE_DEVICES=0; " + _SEEN
    line = ["apptainer", "exec", "--nv", "img.sif", "sh", "-c", code]
    assert seen_bare(line, tmp_path, env) == "0"
    done = gpuwait(gpuwait_cmd, line, env, opts=ON_GPU_1, cwd=tmp_path)
    refused(done, tmp_path / "seen")
