"""A torchrun-style gloo script with no Reprise import, for the tests and the bench of hangs without heartbeats.

Every step: a little compute, an all_reduce, a sleep. Faults and pauses are steered by files in --control, so a test
can start them when it wants: while `block-<rank>` exists, that rank waits for it in a Python loop (blocked outside the
collective, its peers wait for it in all_reduce); a `pause` file (its text: seconds) has rank 0 evaluate that long
(busy, its stack moving) while the others wait in a barrier. Each rank touches `running-<rank>` after its first step.
--eval-every/--eval-s and --slow-every make the same pauses and slow steps on a schedule (the bench's long run).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist


def evaluate(seconds: float) -> float:
    """Busy work for `seconds`: what an evaluation pass on one rank looks like from outside."""
    total, until = 0.0, time.monotonic() + seconds
    weights = torch.randn(64, 64)
    while time.monotonic() < until:
        batch = torch.randn(32, 64)
        total += float(torch.tanh(batch @ weights).sum())
    return total


def wait_while(path: Path) -> None:
    """Blocked in Python: the file's presence holds this rank here (from when, it writes beside it: `<name>.since`)."""
    if path.exists():
        path.with_name(f"{path.name}.since").write_text(f"{time.time():.3f}")
    while path.exists():
        time.sleep(0.05)


def step(n: int, args: argparse.Namespace, rank: int, control: Path) -> None:
    """One training step, with the pauses and faults the control files or the schedule ask for."""
    pause = torch.zeros(1)
    if rank == 0 and (control / "pause").exists():  # rank 0 decides, the all_reduce tells every rank
        pause[0] = float((control / "pause").read_text() or 1)
        (control / "pause").unlink()
    if args.eval_every and n % args.eval_every == args.eval_every - 1:
        pause[0] = args.eval_s if rank == 0 else 0.0
    grad = torch.randn(256) + n
    dist.all_reduce(grad)
    dist.all_reduce(pause)
    slow = args.slow_every and n % args.slow_every == args.slow_every - 1
    time.sleep(args.step_s * (4 if slow else 1))
    wait_while(control / f"block-{rank}")
    if pause[0] > 0:
        if rank == 0:
            evaluate(float(pause[0]))
        dist.barrier()


def main() -> None:
    """Join the group the environment describes and train."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--step-s", type=float, default=0.1)
    parser.add_argument("--control", default="", help="directory of the control files")
    parser.add_argument("--eval-every", type=int, default=0)
    parser.add_argument("--eval-s", type=float, default=30.0)
    parser.add_argument("--slow-every", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    control = Path(args.control or os.getcwd())
    for n in range(args.steps):
        step(n, args, rank, control)
        if n == 0:
            (control / f"running-{rank}").touch()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
