"""PyTorch Lightning under gpuwait's pausing protocol.

    gpuwait --pausable --checkpoint-signal USR1 --vram 8G -- python train_lightning.py --ckpt-dir ckpts

Lightning's own requeue convention (its SLURM plugin) is: SIGUSR1 means "save and requeue".
Outside Slurm that plugin is off, so a small callback does the same for gpuwait: when gpuwait's
checkpoint signal has arrived, it saves `last.ckpt` at the end of the current batch and exits with
the resume status; the next run passes `ckpt_path="last"` and Lightning restores model,
optimizer, epoch and step. A pause in the middle of an epoch resumes at the same step, but
Lightning does not replay that epoch's batches in the same order (its data loader keeps no
position): use a resumable sampler where the exact order matters. Needs `pip install lightning`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TextIO

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from gpuwait import checkpoint


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
        )

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class StepAsideForGpuwait(L.Callback):
    """Save and exit with the resume status once gpuwait asks for a checkpoint."""

    def __init__(self, ckpt_dir: str, log: TextIO | None) -> None:
        self.ckpt_dir = ckpt_dir
        self.progress = log

    def note(self, event: str, step: int) -> None:
        if self.progress:
            print(f"run {checkpoint.resume_count()} {event} at step {step}", file=self.progress)
            self.progress.flush()

    def on_train_start(self, trainer: L.Trainer, *args: object) -> None:
        # After a resume, global_step is already the restored one.
        self.note("starts", trainer.global_step)

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if checkpoint.requested():
            trainer.save_checkpoint(os.path.join(self.ckpt_dir, "last.ckpt"))
            self.note("paused", trainer.global_step)
            checkpoint.exit_for_resume()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt-dir", default="ckpts")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--log", help="append 'run <resume count> starts|paused at step <n>' here")
    args = parser.parse_args()
    log = open(args.log, "a") if args.log else None  # noqa: SIM115 - kept open for the whole run
    os.makedirs(args.ckpt_dir, exist_ok=True)
    # A model this small gains nothing from more threads, and on a small machine torch's
    # default (one per core) makes the run fight every other process for the cores.
    torch.set_num_threads(1)
    checkpoint.install()
    data = TensorDataset(torch.randn(4096, 16), torch.randn(4096, 1))
    trainer = L.Trainer(
        max_epochs=args.epochs,
        callbacks=[StepAsideForGpuwait(args.ckpt_dir, log)],
        default_root_dir=args.ckpt_dir,
        enable_progress_bar=False,
        logger=False,
    )
    last = os.path.join(args.ckpt_dir, "last.ckpt")
    trainer.fit(
        Regressor(),
        DataLoader(data, batch_size=64),
        ckpt_path=last if os.path.exists(last) else None,
    )
    trainer.save_checkpoint(last)
    if log:
        print(f"run {checkpoint.resume_count()} finished at step {trainer.global_step}", file=log)
    print(f"finished at epoch {trainer.current_epoch}, step {trainer.global_step}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
