"""A plain torchrun-style DDP script, with no Reprise import: what most teams already have.

It follows the shape of the public PyTorch DDP tutorial (multi-node training with torchrun and snapshots): the launcher
sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; the script joins a gloo process group; rank 0 saves a
snapshot (model, optimizer, epochs run) every few epochs, and every rank resumes from it when it exists. Reprise's
agents set the same variables, so it runs under Reprise unchanged (docs/sdk.md, "Without the SDK").

Deterministic: the data, the initial weights and each epoch's shuffle come from --seed, and a snapshot holds all the
state the next epoch needs, so a run that is killed and resumed ends with the same parameters as one that never was
(at the same world size). --step-sleep slows each step without changing a number.

    torchrun --nproc-per-node 2 examples/plain_ddp.py --epochs 20 --save-every 2 --snapshot-path /tmp/snapshot.pt
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

FEATURES = 20


def ddp_setup() -> None:
    """Join the process group the launcher describes in the environment (env://)."""
    dist.init_process_group(backend="gloo")


class Trainer:
    """Trains a DDP-wrapped model, saving a snapshot every `save_every` epochs and resuming from one."""

    def __init__(self, model: nn.Module, data: DataLoader[Any], optimizer: torch.optim.Optimizer, args: Any) -> None:
        self.rank = int(os.environ["RANK"])
        self.data = data
        self.optimizer = optimizer
        self.save_every = args.save_every
        self.step_sleep = args.step_sleep
        self.snapshot_path = Path(args.snapshot_path)
        self.epochs_run = 0
        if self.snapshot_path.exists():
            self._load_snapshot(model)
        self.model = DDP(model)

    def _load_snapshot(self, model: nn.Module) -> None:
        snapshot = torch.load(self.snapshot_path, weights_only=True)
        model.load_state_dict(snapshot["MODEL_STATE"])
        self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"rank {self.rank}: resuming from {self.snapshot_path} at epoch {self.epochs_run}", flush=True)

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {
            "MODEL_STATE": self.model.module.state_dict(),
            "OPTIMIZER_STATE": self.optimizer.state_dict(),
            "EPOCHS_RUN": epoch + 1,  # the next epoch to run: a resume never trains a saved epoch twice
        }
        self.snapshot_path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.snapshot_path.with_name(self.snapshot_path.name + ".partial")
        torch.save(snapshot, partial)
        os.replace(partial, self.snapshot_path)  # a kill mid-save leaves the previous snapshot whole
        print(f"epoch {epoch}: snapshot saved at {self.snapshot_path}", flush=True)

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> float:
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch: int) -> float:
        sampler = self.data.sampler
        assert isinstance(sampler, DistributedSampler)
        sampler.set_epoch(epoch)  # each epoch's shuffle, the same on every rank and in every run
        loss = 0.0
        for source, targets in self.data:
            loss = self._run_batch(source, targets)
            if self.step_sleep:
                time.sleep(self.step_sleep)
        return loss

    def train(self, max_epochs: int) -> None:
        """Train from the epoch the snapshot reached (0 without one) to `max_epochs`."""
        for epoch in range(self.epochs_run, max_epochs):
            loss = self._run_epoch(epoch)
            if self.rank == 0:
                print(f"epoch {epoch}: loss {loss:.6f}", flush=True)
                if self.save_every and epoch % self.save_every == 0:
                    self._save_snapshot(epoch)


def load_train_objs(args: Any) -> tuple[Dataset[Any], nn.Module, torch.optim.Optimizer]:
    """A synthetic regression set, a small MLP and SGD with momentum, all drawn from the seed."""
    generator = torch.Generator().manual_seed(args.seed)
    inputs = torch.randn(args.dataset_size, FEATURES, generator=generator)
    teacher = torch.randn(FEATURES, 1, generator=generator)
    targets = torch.tanh(inputs @ teacher) + 0.1 * torch.randn(args.dataset_size, 1, generator=generator)
    torch.manual_seed(args.seed)  # the initial weights
    model = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    return TensorDataset(inputs, targets), model, optimizer


def prepare_dataloader(dataset: Dataset[Any], batch_size: int, seed: int) -> DataLoader[Any]:
    """Each rank reads its own shard of the data, shuffled per epoch by the seed."""
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, sampler=DistributedSampler(dataset, seed=seed))


def digest(model: nn.Module) -> str:
    """SHA-256 of every parameter's bytes, in the module's order: equal digests, equal parameters."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def main(args: Any) -> None:
    """Set up, train, and have rank 0 write the final parameters."""
    ddp_setup()
    dataset, model, optimizer = load_train_objs(args)
    trainer = Trainer(model, prepare_dataloader(dataset, args.batch_size, args.seed), optimizer, args)
    trainer.train(args.epochs)
    if trainer.rank == 0:
        if args.output:
            Path(args.output).parent.mkdir(parents=True, exist_ok=True)
            torch.save(model.state_dict(), args.output)
        print(f"params-sha256 {digest(model)}", flush=True)
    dist.barrier()  # every rank done (rank 0's file written) before any tears the group down
    dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description="plain DDP training with its own snapshots (no Reprise import)")
    parser.add_argument("--epochs", type=int, default=20, help="epochs to train in all")
    parser.add_argument("--save-every", type=int, default=2, help="rank 0 saves a snapshot every K epochs; 0 never")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per step on each rank")
    parser.add_argument("--snapshot-path", default="snapshot.pt", help="where the snapshot is saved and resumed from")
    parser.add_argument("--dataset-size", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds slept after each step; changes nothing")
    parser.add_argument("--output", default="", help="rank 0 writes the final state_dict there")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
