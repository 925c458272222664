"""A plain PyTorch training loop that can be paused by gpuwait and resumes where it stopped.

    gpuwait --pausable --vram 8G -- python train_pytorch.py --steps 5000 --ckpt run/ckpt.pt

On gpuwait's checkpoint signal it saves model, optimizer, step and random state to --ckpt and
exits with the resume status; gpuwait re-runs it later and it continues from the saved step. It runs on the CPU
when no GPU is visible, so it can be tried anywhere; --step-time makes each step last as long as
a real model's would, so that a try on the CPU runs long enough to be paused.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from gpuwait import checkpoint


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--ckpt", default="checkpoint.pt", help="checkpoint file to resume from")
    parser.add_argument("--log", help="append 'run <resume count> step <n>' lines here")
    parser.add_argument(
        "--step-time", type=float, default=0.0, help="make each step last at least this long (s)"
    )
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    # A model this small gains nothing from more threads, and on a small machine torch's
    # default (one per core) makes the run fight every other process for the cores.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)
    ).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    if os.path.exists(args.ckpt):
        saved = torch.load(args.ckpt, map_location=device)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        step = saved["step"]
        # The random stream goes on where it stopped: a resumed run draws the batches an
        # unpaused one would have, not the first ones again.
        if "rng" in saved:
            torch.set_rng_state(saved["rng"])
        if device == "cuda" and "cuda_rng" in saved:
            torch.cuda.set_rng_state_all(saved["cuda_rng"])
    log = open(args.log, "a") if args.log else None  # noqa: SIM115 - kept open for the whole run
    if log:
        print(f"run {checkpoint.resume_count()} starts at step {step}", file=log, flush=True)

    checkpoint.install()
    while step < args.steps:
        started = time.monotonic()
        x = torch.randn(32, 64, device=device)
        loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        time.sleep(max(0.0, args.step_time - (time.monotonic() - started)))
        if checkpoint.requested():
            save(args.ckpt, model, optimizer, step)
            if log:
                print(
                    f"run {checkpoint.resume_count()} paused at step {step}", file=log, flush=True
                )
            checkpoint.exit_for_resume()
    save(args.ckpt, model, optimizer, step)
    if log:
        print(f"run {checkpoint.resume_count()} finished at step {step}", file=log, flush=True)
    return 0


def save(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    # Write next to the target and rename, so a kill mid-save never leaves a torn checkpoint.
    tmp = f"{path}.tmp"
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": step,
        "rng": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda_rng"] = torch.cuda.get_rng_state_all()
    torch.save(state, tmp)
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
