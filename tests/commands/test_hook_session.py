"""A working session with the bash hook on: tiny and large scripts, new and learned, in the
foreground and in the background, on two simulated 24 GiB GPUs. No job may die of out-of-memory
because of gpuwait: not the new large script after many tiny ones (it must not be sized by
them), not a known script run with other arguments, not the jobs started together.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from helpers.shellbin import env_with_bin, make_bin

#: name -> (VRAM it allocates, seconds it holds it)
SCRIPTS = {
    "prep.py": ("0", "0"),
    "plot.py": ("200M", "0"),
    "check.py": ("0", "0"),
    "train_big.py": ("8G", "0.6s"),
    "huge.py": ("20G", "0.6s"),
    "mid.py": ("5G", "0.4s"),
}

SCRIPT = """\
import os, sys
from gpuwait.gpu.simjob import main
report = os.path.join({reports!r}, "{name}-%d.json" % os.getpid())
sys.exit(main(["--vram", {vram!r}, "--ramp", "0.3s", "--hold", {hold!r}, "--report", report]))
"""

SESSION = """\
set -u
eval "$(gpuwait shell-init bash --always)"
failed=0
check() {{ "$@" || {{ echo "FAILED $?: $*"; failed=1; }}; }}
for round in 1 2 3; do
    check python3 prep.py; check python3 plot.py; check python3 check.py
done
# New scripts, never seen: each gets a whole GPU, whatever the tiny ones taught.
python3 huge.py & a=$!
python3 train_big.py & b=$!
python3 prep.py & c=$!
for p in $a $b $c; do wait $p || {{ echo "FAILED $p"; failed=1; }}; done
# Learned now; one of them with other arguments (sized by the script's largest peak).
pids=""
for cmd in "huge.py" "train_big.py" "train_big.py --epochs 2" "mid.py" "plot.py" "train_big.py"; do
    python3 $cmd & pids="$pids $!"
done
for p in $pids; do wait $p || {{ echo "FAILED $p"; failed=1; }}; done
check python3 mid.py
exit $failed
"""


@pytest.mark.usefixtures("sim")
def test_a_session_with_the_bash_hook_has_no_oom(tmp_path: Path) -> None:
    reports = tmp_path / "reports"
    reports.mkdir()
    for name, (vram, hold) in SCRIPTS.items():
        text = SCRIPT.format(reports=str(reports), name=name, vram=vram, hold=hold)
        (tmp_path / name).write_text(text)
    env = env_with_bin(make_bin(tmp_path / "bin"))
    env.pop("GPUWAIT_DEFAULT_VRAM", None)  # the default: a whole GPU
    # Sampled every 0.1 s, a peak held for 0.4 s is seen and learned, as a longer one is at 1 s.
    env["GPUWAIT_SAMPLE_INTERVAL"] = "0.1s"
    done = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", SESSION.format()],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    ran: list[dict[str, Any]] = [json.loads(p.read_text()) for p in reports.glob("*.json")]
    oom = [r for r in ran if r.get("oom")]
    assert not oom, oom
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(ran) == 9 + 3 + 6 + 1
