"""Whether this process runs in a Slurm job that Slurm gave no GPU.

Slurm hands a node's GPUs out as GRES: a job given some gets `CUDA_VISIBLE_DEVICES` naming
them, and a job given none gets no `CUDA_VISIBLE_DEVICES` at all (checked on a real Slurm,
`tests/contrib/test_slurm.py`). To such a job every GPU of the node looks free, those Slurm
gave other jobs included, and a command gpuwait put there would take memory those jobs were
promised: they would die of out-of-memory, or it would. So where slurm.conf says GPUs are
GRES (`GresTypes` names `gpu`), a command in a job without GPUs is refused.

Only the batch script and the steps run on the job's node under Slurm (`slurmstepd` sets
`SLURMD_NODENAME`); an `salloc` shell has `SLURM_JOB_ID` but runs wherever it was started,
with no word of its GPUs, so it is left alone. Where slurm.conf cannot be read or does not
say, nothing is refused: gpuwait cannot tell, and GPUs not handed out by Slurm are gpuwait's
to share.

A step that Slurm gave none of its job's GPUs (`srun --gres=none` or `--gpus=0` in a job that
has some) has no `CUDA_VISIBLE_DEVICES` either, but keeps the job's `SLURM_JOB_GPUS`, as does
a job whose `CUDA_VISIBLE_DEVICES` was unset: the GPUs a process may use are told by
`CUDA_VISIBLE_DEVICES` and `SLURM_STEP_GPUS` alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

#: Where slurm.conf is when SLURM_CONF does not say: the default, Debian's older one, and the
#: copies slurmd keeps in configless mode.
CONF_PATHS = (
    "/etc/slurm/slurm.conf",
    "/etc/slurm-llnl/slurm.conf",
    "/run/slurm/conf/slurm.conf",
    "/var/spool/slurmd/conf-cache/slurm.conf",
)
#: The variables by which Slurm names the GPUs of this batch script or step (not
#: SLURM_JOB_GPUS: a step given none of its job's GPUs has it too).
GPU_VARIABLES = ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS")


def job_without_gpus(env: Mapping[str, str]) -> str | None:
    """The slurm.conf that hands this node's GPUs out as GRES, where `env` is that of a Slurm
    job's batch script or step that Slurm gave no GPU; else None."""
    if "SLURM_JOB_ID" not in env or "SLURMD_NODENAME" not in env:
        return None
    if any(name in env for name in GPU_VARIABLES):
        return None
    paths = [env["SLURM_CONF"]] if env.get("SLURM_CONF") else list(CONF_PATHS)
    for path in paths:
        try:
            text = Path(path).read_text(errors="replace")
        except OSError:
            continue
        return path if gpus_are_gres(text) else None
    return None


def gpus_are_gres(conf: str) -> bool:
    """Whether slurm.conf's text says GPUs are GRES (`GresTypes=gpu,...`; keys of any case)."""
    for line in conf.splitlines():
        key, sep, value = line.split("#", 1)[0].partition("=")
        if sep and key.strip().lower() == "grestypes":
            return "gpu" in {t.strip().lower() for t in value.split(",")}
    return False
