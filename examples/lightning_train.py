"""A PyTorch Lightning job under Reprise: a small regression model on synthetic data, on CPU, with Reprise's callback
as its one added line, Reprise's restore point as ``ckpt_path`` and the ranks the agent launched as Lightning's.

Runs alone, under ``torchrun`` or under Reprise (the agent sets the rank environment and the checkpoint)::

    torchrun --nproc-per-node 2 examples/lightning_train.py --steps 40 --checkpoint-dir /tmp/lightning-run
"""

from __future__ import annotations

import argparse
import hashlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import reprise_sdk
from reprise_sdk.integrations.lightning import RepriseCallback, resume_checkpoint, trainer_args

FEATURES, HIDDEN = 16, 64


class Regressor(pl.LightningModule):
    """An MLP fitting a fixed random linear teacher: the loss falls steadily, so progress is visible."""

    def __init__(self, lr: float, step_sleep: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, 1))
        self.lr, self.step_sleep = lr, step_sleep

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Mean squared error; sleeps --step-sleep afterwards so a demo can inject a fault while it runs."""
        features, target = batch
        loss = F.mse_loss(self.net(features), target)
        if self.step_sleep:
            time.sleep(self.step_sleep)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        """Validation loss, logged across ranks."""
        features, target = batch
        self.log("val_loss", F.mse_loss(self.net(features), target), sync_dist=True)

    def configure_optimizers(self) -> Any:
        """Adam at a fixed rate: nothing to tune in an example."""
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def dataset(size: int, seed: int) -> TensorDataset:
    """Features and the teacher's targets, the same for every rank and every run with this seed."""
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(size, FEATURES, generator=generator)
    teacher = torch.randn(FEATURES, 1, generator=generator)
    return TensorDataset(features, features @ teacher)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (examples/README.md)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps in the whole run")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="a checkpoint every K steps")
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("lightning-run"), help="where step-N/ go")
    parser.add_argument("--eval-every", type=int, default=0, help="a validation every K steps (0: never)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds slept after each step")
    parser.add_argument("--in-place", action="store_true", help="under reprise_sdk.run: survivors restart in place")
    return parser.parse_args(argv)


def train(options: argparse.Namespace) -> None:
    """Fit from Reprise's restore point (or from scratch) to the last step; rank 0 prints the parameters' digest."""
    pl.seed_everything(options.seed, verbose=False)
    evaluating = options.eval_every > 0
    trainer = pl.Trainer(
        max_steps=options.steps,
        accelerator="cpu",
        strategy="ddp" if reprise_sdk.resume().world_size > 1 else "auto",
        callbacks=[RepriseCallback(options.checkpoint_dir, every_n_train_steps=options.checkpoint_every)],
        val_check_interval=options.eval_every if evaluating else None,
        limit_val_batches=2 if evaluating else 0,
        num_sanity_val_steps=0,
        enable_checkpointing=False,  # RepriseCallback saves the checkpoints Reprise restores
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        **trainer_args(),  # the ranks the agent launched: Lightning starts none of its own
    )
    data = DataLoader(dataset(2048, options.seed), batch_size=16, shuffle=True)
    validation = DataLoader(dataset(64, options.seed + 1), batch_size=32)
    start = resume_checkpoint()  # Reprise's restore point, checked against the registry's digests; None: fresh
    if start is not None:
        print(f"resuming from {start}", flush=True)
    model = Regressor(options.lr, options.step_sleep)
    trainer.fit(model, data, validation if evaluating else None, ckpt_path=start)
    if trainer.is_global_zero:
        digest = hashlib.sha256()
        for tensor in model.state_dict().values():
            digest.update(tensor.detach().contiguous().numpy().tobytes())
        print(f"trained to step {trainer.global_step}", flush=True)
        print(f"params-sha256 {digest.hexdigest()}", flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    """Train; with --in-place, under reprise_sdk.run so that a surviving rank keeps its process."""
    options = parse_args(argv)
    if options.in_place:
        reprise_sdk.run(lambda _info: train(options))
    else:
        train(options)


if __name__ == "__main__":
    main()
