"""What a command line runs through its wrappers, as their manuals parse them."""

from __future__ import annotations

import pytest

from gpuwait.core.wrappers import Step, container_gpus, drops_gpus, runs_gpuwait, steps


@pytest.mark.parametrize(
    ("argv", "programs"),
    [
        (["timeout", "-s", "KILL", "-k", "5", "60", "srun", "-n1"], ["timeout", "srun"]),
        (["timeout", "--signal=KILL", "1h", "srun"], ["timeout", "srun"]),
        # A value of the wrapper's own options is no program: `env -u srun` unsets a variable.
        (["env", "-u", "srun", "A=1", "python", "x.py"], ["env", "python"]),
        (["nice", "-n", "5", "python", "srun.py"], ["nice", "python"]),
        (["nice", "-5", "ionice", "-c2", "-n7", "srun"], ["nice", "ionice", "srun"]),
        (["stdbuf", "-oL", "-e", "0", "time", "-o", "t", "srun"], ["stdbuf", "time", "srun"]),
        (
            ["taskset", "-c", "0-3", "numactl", "--membind", "0", "srun"],
            ["taskset", "numactl", "srun"],
        ),
        (
            ["chrt", "-f", "10", "setsid", "-w", "nohup", "srun"],
            ["chrt", "setsid", "nohup", "srun"],
        ),
        (["sudo", "-Eu", "alice", "--", "srun"], ["sudo", "srun"]),
        (["su", "alice", "-l", "-c", "srun python x.py"], ["su", "srun"]),
        (["runuser", "-u", "alice", "srun", "-l"], ["runuser", "srun"]),
        (["flock", "-w", "5", "/tmp/l", "srun", "-n1"], ["flock", "srun"]),
        (["flock", "-n", "/tmp/l", "-c", "sudo -E python x.py"], ["flock", "sudo", "python"]),
        (["setpriv", "--reuid", "1000", "--init-groups", "srun"], ["setpriv", "srun"]),
        (["sg", "video", "-c", "srun python x.py"], ["sg", "srun"]),
        (["bash", "-lc", "srun python x.py && echo done"], ["bash", "srun"]),
        (["sh", "-e", "-c", "sudo -u alice python x.py; date"], ["sh", "sudo", "python"]),
        # Only the first command's plain words: no shell is parsed past a quote or a $.
        (["sh", "-c", 'echo "a;b"; srun'], ["sh", "echo"]),
        # A line ends a command as `;` does; blank lines before the first are none.
        (["bash", "-c", "sudo -k\nsrun python x.py"], ["bash", "sudo"]),
        (["bash", "-c", "env\npython x.py"], ["bash", "env"]),
        (["bash", "-c", "\n\n  srun python x.py\n  echo done\n"], ["bash", "srun"]),
        (["bash", "-c", "OMP_NUM_THREADS=4\nsrun python x.py"], ["bash", "srun"]),
        (["bash", "-c", "OMP_NUM_THREADS=4; srun python x.py"], ["bash", "srun"]),
        (["bash", "-c", "$X srun"], ["bash"]),
        (["bash", "x.sh", "-c", "srun"], ["bash"]),
        (
            ["bash", "-eo", "pipefail", "-c", "sudo -u alice python x.py"],
            ["bash", "sudo", "python"],
        ),
        (["bash", "-ceo", "pipefail", "srun python x.py"], ["bash", "srun"]),
        (["bash", "-eo", "pipefail", "x.sh", "-c", "srun"], ["bash"]),
        # zsh takes -o's value glued on too: the rest of the word, c's and o's in it included.
        (["zsh", "-opipefail", "-c", "srun python x.py"], ["zsh", "srun"]),
        (["zsh", "-eonoclobber", "-c", "sudo -u alice python"], ["zsh", "sudo", "python"]),
        (["zsh", "-onoclobber", "x.sh", "srun"], ["zsh"]),
        # zsh's -O is CORRECT_ALL, a letter taking no value; its --emulate takes the next word.
        (["zsh", "-O", "-c", "srun python x.py"], ["zsh", "srun"]),
        (["zsh", "-Oc", "srun python x.py"], ["zsh", "srun"]),
        (["zsh", "+O", "x.sh", "-c", "srun"], ["zsh"]),
        (["zsh", "--emulate", "sh", "-c", "srun python x.py"], ["zsh", "srun"]),
        (["bash", "-O", "extglob", "-c", "srun python x.py"], ["bash", "srun"]),
        # bash's -o takes the next word, whatever follows it in the cluster (`-oe pipefail`).
        (["bash", "-oe", "pipefail", "-c", "srun python x.py"], ["bash", "srun"]),
        (["runuser", "-l", "-u", "alice", "srun"], ["runuser", "srun"]),
        (["su", "alice", "-c", "srun python x.py"], ["su", "srun"]),
        (["su", "-", "alice", "-c", "srun python x.py"], ["su", "srun"]),
        (["su", "alice", "--command=env A=1 srun python"], ["su", "env", "srun"]),
        (["env", "A=1", "B=2", "srun"], ["env", "srun"]),
        # env sets the NAME=VALUE words after its `--` too; sudo runs the first as a command.
        (["env", "--", "A=1", "srun"], ["env", "srun"]),
        (["sudo", "--", "A=1", "srun"], ["sudo", "A=1"]),
        # A value glued on ends the cluster: -uSLURM_JOB_ID is no -S.
        (["env", "-uSLURM_JOB_ID", "srun"], ["env", "srun"]),
        # No command that is sure to run: the walk stops at the wrapper.
        (["flock", "9"], ["flock"]),
        (["taskset", "-p", "1234"], ["taskset"]),
        (["su", "-c", "cd /x && srun python", "alice"], ["su", "cd"]),
        # The code of su -c, flock -c and sg -c is a shell's, read as that of bash -c is.
        (["su", "alice", "-c", "srun python x.py && echo done"], ["su", "srun"]),
        (["flock", "/tmp/l", "-c", "OMP_NUM_THREADS=4 srun python"], ["flock", "srun"]),
        (
            ["sg", "video", "-c", "exec sudo -u bob python x.py; echo"],
            ["sg", "exec", "sudo", "python"],
        ),
        (["su", "alice", "-c", 'python "my script.py"'], ["su", "python"]),
        (["timeout", "60"], ["timeout"]),
        (["sudo", "-u"], ["sudo"]),
        (["sudo", "--user"], ["sudo"]),
        # sudo -l lists what may run, and runs nothing.
        (["sudo", "-l", "srun"], ["sudo"]),
        (["sudo", "--list", "srun"], ["sudo"]),
    ],
)
def test_the_commands_a_line_runs_through_its_wrappers(
    argv: list[str], programs: list[str]
) -> None:
    assert [step.program for step in steps(argv)] == programs


@pytest.mark.parametrize(
    ("argv", "drops"),
    [
        (["sudo", "python"], True),
        (["sudo", "-nu", "alice", "python"], True),
        (["sudo", "--preserve-env=HOME", "python"], True),
        (["sudo", "--preserve-env=HOME,CUDA_VISIBLE_DEVICES", "python"], False),
        (["sudo", "-E", "python"], False),
        (["sudo", "-nE", "python"], False),
        (["sudo", "--preserve-env", "python"], False),
        (["doas", "python"], True),
        (["pkexec", "python"], True),
        (["su", "alice", "-c", "python"], False),
        (["su", "-", "alice", "-c", "python"], True),
        (["su", "--login", "-w", "CUDA_VISIBLE_DEVICES", "alice", "-c", "python"], False),
        (["runuser", "-u", "alice", "python"], False),
        (["env", "-i", "python"], True),
        (["env", "-", "python"], True),
        (["env", "--unset=CUDA_VISIBLE_DEVICES", "python"], True),
        (["env", "-u", "HOME", "python"], False),
        (["nice", "python"], False),
        (["setpriv", "--reset-env", "python"], True),
        (["setpriv", "--reuid", "alice", "python"], False),
        (["systemd-run", "--uid", "alice", "python"], True),
        (["systemd-run", "--user", "-E", "CUDA_VISIBLE_DEVICES", "python"], True),
        (["systemd-run", "--scope", "python"], False),
        (["sg", "video", "-c", "python x.py"], False),
        (["sg", "-", "video", "-c", "python x.py"], True),
        (["flock", "/tmp/l", "python"], False),
        (["sudo", "-v"], False),  # it runs no command: it asks for the password
        (["sudo", "-l", "python", "x.py"], False),  # it says whether one may run it
        (["sudo", "-K"], False),
        (["sudo", "-k"], False),  # it forgets the password, and runs nothing
        (["sudo", "-k", "python", "x.py"], True),  # it forgets it, then runs python
        (["sudo", "-V"], False),  # its version
        (["sudo", "--help"], False),
        (["doas", "-L"], False),  # it forgets the password, and runs nothing
        (["doas", "-C", "/etc/doas.conf", "python"], False),  # it checks the rules only
        (["doas", "-n", "python"], True),
        (["pkexec", "--version"], False),
        (["numactl", "-i", "all", "python"], False),
    ],
)
def test_which_wrappers_start_their_command_without_its_gpus(argv: list[str], drops: bool) -> None:
    assert drops_gpus(steps(argv)[0]) is drops


@pytest.mark.parametrize(
    ("code", "drops"),
    [
        ('sudo -u alice python "$x"', True),  # its command found before the expansion
        ("sudo --preserve-env=$KEEP python x.py", False),  # its options not known
        ("sudo $OPTIONS python x.py", False),
        # What is read of them already drops the variables: no later word brings them back.
        ('doas "$PY" x.py', True),
        ('pkexec "$PY" x.py', True),
        ('setpriv --reset-env "$PY" x.py', True),
        ('sg - video -c "$CODE"', True),
        ('env -i "$PY" x.py', False),  # CUDA_VISIBLE_DEVICES="$CUDA_VISIBLE_DEVICES" may follow
    ],
)
def test_a_wrapper_in_a_shells_code_is_judged_only_where_its_options_are_read(
    code: str, drops: bool
) -> None:
    assert any(drops_gpus(step) for step in steps(["bash", "-c", code])) is drops


@pytest.mark.parametrize(
    ("argv", "runs"),
    [
        (["python3", "-m", "gpuwait", "--vram", "1G"], True),
        (["python3", "-I", "-X", "utf8", "-m", "gpuwait", "--vram", "1G"], True),
        (["python3", "-c", "import os", "-m", "gpuwait"], False),  # arguments of its code
        (["python3", "-m", "gpuwaiter"], False),
        (["python3", "-Im", "gpuwait", "--vram", "1G"], True),
        (["python3", "-mgpuwait", "--vram", "1G"], True),
        (["python", "-X", "dev", "-m", "gpuwait"], True),
        (["python", "-Xdev", "-Wdefault", "-m", "gpuwait"], True),
        (["python3", "--check-hash-based-pycs", "never", "-m", "gpuwait"], True),
        (["python3.12", "-u", "-m", "gpuwait"], True),
        (["env", "A=1", "python", "-Im", "gpuwait", "--vram", "1G"], True),
        (["sudo", "-E", "python", "-X", "dev", "-m", "gpuwait"], True),
        (["python3", "-uc", "import os", "-m", "gpuwait"], False),
        (["python3", "-", "-m", "gpuwait"], False),  # arguments of the code piped in
        (["python3", "x.py", "-m", "gpuwait"], False),  # arguments of the script
    ],
)
def test_a_gpuwait_of_the_commands_own_is_told_past_the_interpreters_options(
    argv: list[str], runs: bool
) -> None:
    assert runs_gpuwait(steps(argv)[-1]) is runs


@pytest.mark.parametrize(
    ("argv", "given"),
    [
        (["docker", "run", "--gpus", "all", "img", "python"], ["--gpus all"]),
        (["docker", "run", "-it", "-eA=1", "--gpus=2", "img"], ["--gpus=2"]),
        (["docker", "-H", "unix:///s", "container", "run", "--gpus", "1", "i"], ["--gpus 1"]),
        (
            ["docker", "run", "--runtime", "nvidia", "-e", "NVIDIA_VISIBLE_DEVICES=all", "i"],
            ["--runtime nvidia", "-e NVIDIA_VISIBLE_DEVICES=all"],
        ),
        (["podman", "run", "--device", "nvidia.com/gpu=0", "img"], ["--device nvidia.com/gpu=0"]),
        # The runtime with no GPU named for it, or the image's own commands' options.
        (["docker", "run", "--runtime=nvidia", "-e", "NVIDIA_VISIBLE_DEVICES=none", "i"], []),
        (["docker", "run", "--rm", "img", "train.py", "--gpus", "2"], []),
        (["docker", "run", "--name", "--gpus", "img"], []),
        (["docker", "run", "--gpus"], []),  # its value not known
        (["docker", "ps"], []),
        (["podman", "build", "--device", "nvidia.com/gpu=all", "."], []),
        # containerd's nerdctl takes docker's --gpus.
        (["nerdctl", "run", "--gpus", "all", "img"], ["--gpus all"]),
        (["nerdctl", "-n", "k8s.io", "run", "--gpus=1", "img"], ["--gpus=1"]),
        (["nerdctl", "--namespace", "lab", "container", "run", "--gpus", "0", "i"], ["--gpus 0"]),
        # Options that take no value, before the GPUs: `--rm`, `-d`.
        (["docker", "run", "--rm", "--gpus", "all", "img"], ["--gpus all"]),
        (["docker", "run", "-d", "--gpus", "all", "img"], ["--gpus all"]),
        # The image after `--`: what follows it is its command's.
        (["docker", "run", "--", "img", "--gpus", "all"], []),
        # The last NVIDIA_VISIBLE_DEVICES is the one the runtime reads.
        (
            [
                *("docker", "run", "--runtime=nvidia", "-e", "NVIDIA_VISIBLE_DEVICES=0"),
                *("-e", "NVIDIA_VISIBLE_DEVICES=none", "i"),
            ],
            [],
        ),
        (["docker", "run", "--device", "/dev/fuse", "img"], []),
        # A GPU's device node gives the container that GPU, whatever CUDA_VISIBLE_DEVICES says.
        (
            ["docker", "run", "--device", "/dev/nvidia0", "--device", "/dev/nvidiactl", "img"],
            ["--device /dev/nvidia0"],
        ),
        (
            ["podman", "run", "--device=/dev/nvidia1:/dev/nvidia0:rwm", "i"],
            ["--device=/dev/nvidia1:/dev/nvidia0:rwm"],
        ),
        (["docker", "run", "--device", "/dev/nvidia-uvm", "--device", "/dev/nvidiactl", "i"], []),
        # nvidia-docker adds the NVIDIA runtime itself (the image's NVIDIA_VISIBLE_DEVICES,
        # every GPU for CUDA's): named where its options begin, as no word of the line.
        (["nvidia-docker", "run", "--rm", "img", "python"], [""]),
        (
            ["nvidia-docker", "run", "-e", "NVIDIA_VISIBLE_DEVICES=1", "i"],
            ["-e NVIDIA_VISIBLE_DEVICES=1"],
        ),
        (["nvidia-docker", "run", "-e", "NVIDIA_VISIBLE_DEVICES=none", "img"], []),
        (["nvidia-docker", "ps"], []),
    ],
)
def test_the_gpus_a_container_is_given_by_its_own_options(
    argv: list[str], given: list[str]
) -> None:
    spans = container_gpus(Step(argv=tuple(argv)))
    assert [" ".join(argv[begin:end]) for begin, end in spans] == given


@pytest.mark.parametrize(
    ("argv", "environ", "given"),
    [
        # `-e NVIDIA_VISIBLE_DEVICES` with no value passes the caller's on (all, set by a CUDA
        # image gpuwait runs in), which the NVIDIA runtime reads as the form with a value.
        (
            ["docker", "run", "-e", "NVIDIA_VISIBLE_DEVICES", "img"],
            {"NVIDIA_VISIBLE_DEVICES": "all"},
            ["-e NVIDIA_VISIBLE_DEVICES"],
        ),
        (
            ["docker", "run", "--env=NVIDIA_VISIBLE_DEVICES", "--runtime=nvidia", "img"],
            {"NVIDIA_VISIBLE_DEVICES": "1"},
            ["--env=NVIDIA_VISIBLE_DEVICES", "--runtime=nvidia"],
        ),
        # Unset, the container gets none of it; set to none, no GPU.
        (["docker", "run", "-e", "NVIDIA_VISIBLE_DEVICES", "img"], {}, []),
        (
            ["nvidia-docker", "run", "-e", "NVIDIA_VISIBLE_DEVICES", "img"],
            {"NVIDIA_VISIBLE_DEVICES": "none"},
            [],
        ),
    ],
)
def test_a_container_given_the_callers_nvidia_visible_devices_gets_its_gpus(
    argv: list[str], environ: dict[str, str], given: list[str]
) -> None:
    spans = container_gpus(Step(argv=tuple(argv)), environ)
    assert [" ".join(argv[begin:end]) for begin, end in spans] == given
