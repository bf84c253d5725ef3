"""PyTorch DDP training on CPU (gloo) that Reprise can stop, shrink or grow, and resume exactly.

Run it anywhere: under Reprise (the agent sets the rank environment and the checkpoint to resume from), under
``torchrun``, or alone (a world of one)::

    torchrun --nproc-per-node 4 examples/ddp_train.py --steps 200 --checkpoint-dir /tmp/ckpt --output /tmp/final.pt

The final parameters do not depend on the world size nor on where the run was interrupted and resumed: the global
batch is a fixed number of fixed-size micro-batches spread over the ranks, and every rank sums the micro-batch
gradients in micro-batch order (examples/README.md explains why a plain all-reduce would not do).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import random
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import reprise_sdk
from reprise_sdk.torch import COMMIT_MARKER, kept, load_checkpoint, replica, save_checkpoint

FEATURES, HIDDEN, CLASSES, DROPOUT = 32, 128, 10, 0.1  # 22k parameters: ~20 steps/s with 4 ranks on 2 CPU cores
COLLECTIVE_TIMEOUT = timedelta(minutes=5)  # a rank that died mid-step fails its peers in minutes, not gloo's 30
SEED_STRIDE = 1_000_003  # mixes (seed, step, micro-batch) into one seed; any large prime spreads them apart
SEED_LIMIT = 2**63  # torch generators take seeds below 2**64; the modulo keeps large --seed values legal


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """What determines the result: a checkpoint resumes only under the same values."""

    steps: int
    global_batch: int
    micro_batch: int
    seed: int
    lr: float
    dataset_size: int

    @property
    def micro_batches(self) -> int:
        """Micro-batches per optimizer step, whatever the world size."""
        return self.global_batch // self.micro_batch


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line; see examples/README.md."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps in the whole run")
    parser.add_argument("--checkpoint-every", type=int, default=20, help="save a checkpoint every K steps (0: never)")
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints"))
    parser.add_argument("--global-batch", type=int, default=64, help="samples per optimizer step, any world size")
    parser.add_argument("--micro-batch", type=int, default=8, help="samples per micro-batch; divides the global batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--dataset-size", type=int, default=4096, help="synthetic samples, reshuffled each epoch")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (fault demos)")
    parser.add_argument(
        "--eval-every", type=int, default=0, help="every K steps an evaluation phase of --eval-s seconds (0: never)"
    )
    parser.add_argument("--eval-s", type=float, default=0.0, help="how long each evaluation phase lasts (it sleeps)")
    parser.add_argument(
        "--slow-every", type=int, default=0, help="every K steps a slow step of 2 to --slow-max times the step sleep"
    )
    parser.add_argument("--slow-max", type=float, default=5.0, help="the slowest slow step, in step sleeps")
    parser.add_argument("--output", type=Path, help="rank 0 writes the final state_dict here (torch.save)")
    parser.add_argument(
        "--bad-data-step",
        type=int,
        default=0,
        help="the data of this step is corrupt (a NaN input): its loss, then the parameters, turn NaN (fault demos)",
    )
    parser.add_argument(
        "--resume-latest",
        action="store_true",
        help="without a checkpoint from Reprise, resume from the newest committed one under --checkpoint-dir",
    )
    parser.add_argument("--log-steps", action="store_true", help="rank 0 prints `step N t=<unix time>` every step")
    parser.add_argument(
        "--in-place",
        action="store_true",
        help="under Reprise, a rank that survives a peer's failure restarts in place (reprise_sdk.run), not cold",
    )
    args = parser.parse_args(argv)
    if args.steps < 1 or args.micro_batch < 1 or args.global_batch % args.micro_batch:
        parser.error("--steps and --micro-batch must be positive and --micro-batch must divide --global-batch")
    return args


class SyntheticData:
    """Samples generated from the seed, labelled by a fixed random teacher; each epoch has its own permutation."""

    def __init__(self, seed: int, size: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(size, FEATURES, generator=generator)
        teacher = torch.randn(FEATURES, CLASSES, generator=generator)
        self.labels = (self.inputs @ teacher + 0.5 * torch.randn(size, CLASSES, generator=generator)).argmax(1)
        self.seed, self.size = seed, size
        self._orders: dict[int, torch.Tensor] = {}

    def indices(self, first: int, count: int) -> torch.Tensor:
        """The sample indices at stream positions first .. first+count-1 (the stream runs epoch after epoch)."""
        positions = range(first, first + count)
        return torch.stack([self._order(p // self.size)[p % self.size] for p in positions])

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            generator = torch.Generator().manual_seed((self.seed * SEED_STRIDE + epoch) % SEED_LIMIT)
            # Keep the previous epoch's order too: a global batch may straddle two epochs.
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1}
            self._orders[epoch] = torch.randperm(self.size, generator=generator)
        return self._orders[epoch]


def build_model(seed: int) -> nn.Sequential:
    """The MLP, initialised from the seed (so every rank starts equal even before DDP's broadcast)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN), nn.GELU(), nn.Dropout(DROPOUT),
        nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Dropout(DROPOUT),
        nn.Linear(HIDDEN, CLASSES),
    )  # fmt: skip


class WarmupCosine:
    """LR factor: linear warm-up over the first tenth of the run, then cosine decay to a tenth of the peak."""

    def __init__(self, steps: int) -> None:
        self.steps, self.warmup = steps, max(1, steps // 10)

    def __call__(self, index: int) -> float:
        """Factor for the step after `index` scheduler steps."""
        if index < self.warmup:
            return (index + 1) / self.warmup
        progress = min(1.0, (index - self.warmup) / max(1, self.steps - self.warmup))
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))


def my_micro_batches(rank: int, world_size: int, total: int) -> range:
    """This rank's micro-batches: contiguous blocks of ceil(total / world) (the last ranks may get fewer or none)."""
    per_rank = -(-total // world_size)
    return range(min(rank * per_rank, total), min((rank + 1) * per_rank, total))


@dataclass
class Trainer:
    """The DDP-wrapped model, its optimizer and schedule, and the step the run has completed."""

    config: TrainConfig
    data: SyntheticData
    ddp: DistributedDataParallel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    step: int = 0
    skip: tuple[int, int] | None = None  # steps whose data is skipped (first, last), from reprise_sdk.resume()
    bad_data_step: int = 0  # a step whose data is corrupt (0: none)

    @property
    def params(self) -> list[nn.Parameter]:
        """The trained parameters, in the module's order (the order of the flat gradient rows)."""
        return list(self.ddp.module.parameters())

    def train_step(self) -> float | None:
        """One optimizer step over the global batch; returns its mean loss (the same on every rank), or None for a
        step whose data Reprise asked to skip (it led to a numeric fault): the schedule moves on, the model does not.
        `self.step` moves on last: a step cut short by a peer's failure leaves the state of the step before it."""
        step = self.step + 1
        if self.skip is not None and self.skip[0] <= step <= self.skip[1]:
            self.scheduler.step()
            self.step = step
            return None
        rows = self._micro_batch_gradients(step)
        total = self.config.micro_batches
        gathered = [torch.empty_like(rows) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, rows)
        ordered = torch.cat(gathered)[:total]  # rank blocks are contiguous: row i is micro-batch i
        mean = ordered[0].clone()
        for row in ordered[1:]:  # one canonical order of additions, whatever the world size
            mean.add_(row)
        mean.div_(total)
        offset = 0
        for param in self.params:
            param.grad = mean[offset : offset + param.numel()].view_as(param)
            offset += param.numel()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step = step
        return float(mean[-1])

    def _micro_batch_gradients(self, step: int) -> torch.Tensor:
        """This rank's micro-batches, one row each: the flat gradient then the loss (unused rows stay zero)."""
        config, params = self.config, self.params
        mine = my_micro_batches(dist.get_rank(), dist.get_world_size(), config.micro_batches)
        width = sum(p.numel() for p in params) + 1
        rows = torch.zeros(-(-config.micro_batches // dist.get_world_size()), width)
        with self.ddp.no_sync():  # DDP must not all-reduce: the reduction below fixes the order of the sums
            for row, micro in zip(rows, mine, strict=False):
                first = ((step - 1) * config.micro_batches + micro) * config.micro_batch
                index = self.data.indices(first, config.micro_batch)
                # Dropout draws from a stream keyed by (seed, step, micro-batch), not by which rank runs it; the
                # global RNG is left as it was, so its saved state does not depend on the world size either.
                inputs = self.data.inputs[index]
                if step == self.bad_data_step and micro == 0:
                    inputs = inputs * float("nan")  # a corrupt sample: what a NaN from bad data looks like
                with torch.random.fork_rng(devices=[]):
                    # the CPU generator alone: torch.manual_seed would also queue a seed for CUDA, at a cost per call
                    seed = ((config.seed * SEED_STRIDE + step) * SEED_STRIDE + micro) % SEED_LIMIT
                    torch.default_generator.manual_seed(seed)
                    loss = F.cross_entropy(self.ddp(inputs), self.data.labels[index])
                    loss.backward()
                torch.cat([_grad(p).reshape(-1) for p in params], out=row[:-1])
                row[-1] = loss.detach()
                self.optimizer.zero_grad(set_to_none=True)
        return rows

    def state(self) -> dict[str, Any]:
        """Everything a resumed run needs to continue as if never stopped."""
        return {
            "step": self.step,
            "config": asdict(self.config),
            "world_size": dist.get_world_size(),
            "model": self.ddp.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "data": {"next_sample": self.step * self.config.global_batch},
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        }


def _grad(param: nn.Parameter) -> torch.Tensor:
    if param.grad is None:  # every parameter takes part in every forward: a missing gradient is a bug
        raise RuntimeError("a parameter got no gradient")
    return param.grad


def build_trainer(config: TrainConfig, state: dict[str, Any] | None) -> Trainer:
    """A trainer from scratch, or from a checkpoint's state (loaded before DDP broadcasts rank 0's parameters)."""
    module = build_model(config.seed)
    optimizer = torch.optim.AdamW(module.parameters(), lr=config.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(config.steps))
    step = 0
    if state is not None:
        module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        step = state["step"]
    ddp = DistributedDataParallel(module)
    return Trainer(config, SyntheticData(config.seed, config.dataset_size), ddp, optimizer, scheduler, step)


def read_checkpoint(directory: str, config: TrainConfig) -> dict[str, Any]:
    """Rank 0's file of a committed checkpoint: the state is replicated, so any new world size can read it."""
    if not (Path(directory) / COMMIT_MARKER).exists():
        raise SystemExit(f"refusing to resume from {directory}: no {COMMIT_MARKER} marker (an interrupted save)")
    state = load_checkpoint(directory, rank=0)
    if state["config"] != asdict(config):
        raise SystemExit(f"checkpoint {directory} was written with {state['config']}, not {asdict(config)}")
    return state


def latest_committed(checkpoint_dir: Path) -> str | None:
    """The newest step-NNNNNNNN directory under checkpoint_dir that has its COMMITTED marker (None: none yet)."""
    committed = sorted(marker.parent for marker in checkpoint_dir.glob(f"step-*/{COMMIT_MARKER}"))
    return str(committed[-1]) if committed else None


def resume_point(args: argparse.Namespace, handed_over: str | None) -> str | None:
    """The checkpoint to start from: the one Reprise hands over, else (--resume-latest) the newest committed one."""
    if handed_over or not args.resume_latest:
        return handed_over
    # Rank 0 picks and tells the others: ranks that looked at the directory at different moments must still agree.
    picked = [latest_committed(args.checkpoint_dir) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(picked, src=0)
    return picked[0]


def save(trainer: Trainer, checkpoint_dir: Path) -> Path:
    """Write this rank's file of the checkpoint at the current step (a collective: every rank calls it)."""
    target = checkpoint_dir / f"step-{trainer.step:08d}"
    if dist.get_rank() == 0 and target.exists():
        shutil.rmtree(target)  # left by an earlier attempt, maybe by more ranks: its files must not mix with ours
    dist.barrier()
    save_checkpoint(target, trainer.step, trainer.state(), rank=dist.get_rank())
    return target


def parameters_sha256(module: nn.Module) -> str:
    """SHA-256 of every parameter's bytes, flattened in the module's order: equal digests, equal parameters."""
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def init_process_group(world_size: int) -> None:
    """Join the job's gloo group (env://: the variables Reprise or torchrun set); a world of one needs no rendezvous."""
    if world_size == 1:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=COLLECTIVE_TIMEOUT)
    else:
        dist.init_process_group("gloo", init_method="env://", timeout=COLLECTIVE_TIMEOUT)


def run(args: argparse.Namespace, info: reprise_sdk.ResumeInfo) -> str:
    """Train to --steps, checkpointing and heartbeating; returns the final parameters' digest."""
    config = TrainConfig(args.steps, args.global_batch, args.micro_batch, args.seed, args.lr, args.dataset_size)
    state, origin = starting_state(args, info, config)
    trainer = build_trainer(config, state)
    trainer.skip, trainer.bad_data_step = info.skip_steps, args.bad_data_step
    rank0 = dist.get_rank() == 0
    if rank0:
        print(f"world {dist.get_world_size()}: starting at step {trainer.step + 1} {origin}", flush=True)
    began, first = time.perf_counter(), trainer.step
    while trainer.step < config.steps:
        loss = trainer.train_step()
        if args.in_place:
            replica.hold(trainer.step, trainer.state)  # complete: a peer that joins after a fault may take it
        report_step(trainer, loss, rank0=rank0)
        if args.log_steps and rank0:
            print(f"step {trainer.step} t={time.time():.6f}", flush=True)  # wall clock: other processes compare it
        if args.checkpoint_every and trainer.step % args.checkpoint_every == 0:
            saved = save(trainer, args.checkpoint_dir)
            if rank0:
                shown = "skipped" if loss is None else f"{loss:.4f}"
                print(f"step {trainer.step} loss {shown}: checkpoint {saved}", flush=True)
        if args.step_sleep:
            time.sleep(args.step_sleep * slowdown(args, trainer.step))
        if args.eval_every and trainer.step % args.eval_every == 0:
            with reprise_sdk.phase("eval"):  # a long evaluation is not a hang
                time.sleep(args.eval_s)
    digest = parameters_sha256(trainer.ddp.module)
    if rank0:
        elapsed = time.perf_counter() - began
        print(f"{trainer.step - first} steps in {elapsed:.2f} s ({(trainer.step - first) / elapsed:.1f} steps/s)")
        if args.output:
            write_output(trainer.ddp.module, args.output)
        print(f"params-sha256 {digest}", flush=True)
    return digest


def starting_state(
    args: argparse.Namespace, info: reprise_sdk.ResumeInfo, config: TrainConfig
) -> tuple[dict[str, Any] | None, str]:
    """The state to start from and where it came from: a surviving peer's (--in-place, after a restart), else the
    checkpoint Reprise hands over (or --resume-latest's), else none."""
    if args.in_place:
        restored = replica.restore()  # a collective: the vote, then the transfer (reprise_sdk.torch's docs)
        if restored.state is not None and restored.state["config"] == asdict(config):
            return restored.state, f"from rank {restored.source_rank}'s memory (0 steps redone)"
        fallback = f" ({restored.reason})" if restored.reason and info.restart_epoch else ""
    else:
        fallback = ""
    checkpoint = resume_point(args, info.checkpoint)
    if not checkpoint:
        return None, "from scratch" + fallback
    from_memory = kept.restored
    with reprise_sdk.phase("restoring"):  # a slow read from shared storage is not a hang
        state = read_checkpoint(checkpoint, config)
    origin = f"from {checkpoint} (saved by {state['world_size']} ranks)"
    origin += ", read from memory" if kept.restored > from_memory else ""  # a rank restarted in place, its own copy
    return state, origin + fallback


def report_step(trainer: Trainer, loss: float | None, *, rank0: bool) -> None:
    """Heartbeat the step with its loss and learning rate (no loss for a step whose data was skipped)."""
    if loss is not None:
        reprise_sdk.heartbeat(trainer.step, loss=loss, lr=float(trainer.scheduler.get_last_lr()[0]))
        return
    reprise_sdk.heartbeat(trainer.step)
    if rank0:
        print(f"step {trainer.step}: data skipped (it led to a numeric fault)", flush=True)


def slowdown(args: argparse.Namespace, step: int) -> float:
    """How many step sleeps this step sleeps: 1, or on every --slow-every-th step 2 to --slow-max, drawn from the
    seed and the step (every rank alike; the sleeps change no number)."""
    if not args.slow_every or step % args.slow_every:
        return 1.0
    draw = random.Random(args.seed * 1_000_003 + step).random()  # noqa: S311 - a schedule, not a secret
    slowest = max(float(args.slow_max), 2.0)
    return 2.0 + draw * (slowest - 2.0)


def write_output(module: nn.Module, output: Path) -> None:
    """Rank 0's final state_dict, written whole or not at all."""
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(f".{output.name}.partial")
    torch.save(module.state_dict(), partial)
    partial.replace(output)


def train(args: argparse.Namespace, info: reprise_sdk.ResumeInfo) -> str:
    """Join the group, train, leave the group; returns the final parameters' digest."""
    init_process_group(info.world_size)
    digest = run(args, info)
    dist.barrier()  # rank 0 hosts the store: nobody tears down while a peer still talks to it
    dist.destroy_process_group()
    return digest


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: train once, or (--in-place) under reprise_sdk.run, which enters `train` again after a restart."""
    args = parse_args(argv)
    # One intra-op thread: ranks share the CPU cores, and a matmul's blocking (hence its rounding) must not vary
    # with how many threads a machine happens to give each rank.
    torch.set_num_threads(1)
    if args.in_place:
        reprise_sdk.run(lambda info: train(args, info))
    else:
        train(args, reprise_sdk.resume())
    return 0


if __name__ == "__main__":
    sys.exit(main())
