"""A checkpoint's cost to training: a synchronous save against a background save of the same state, side by side.

Run from the repository root: ``make bench-checkpoint`` (or ``.venv/bin/python -m bench.bench_checkpoint``). The
state is a model-like dict of float32 tensors of ``--gib`` GiB (default 1.0) saved with ``reprise_sdk.torch``'s
per-rank ``save_checkpoint`` into a fresh directory on the local disk, as a one-rank job commits it. Synchronous and
background saves alternate, ``--rounds`` of each (default 7). The blocking time is how long the call held the
training thread: the whole save for the synchronous one; the wait for the previous save plus the host copy for the
background one, whose end-to-end time (until committed and reported) is recorded beside it. The first background
save also allocates its host buffers (later ones reuse them): its blocking time is reported on its own too. While a
background save writes, the training thread runs matrix products; their rate against the rate of the same products
with no save running says what the writer thread takes from training on this machine. Prints the figures and saves
bench/results/checkpoint.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import write_result
from reprise_sdk.torch import background_stats, save_checkpoint

TENSOR_MIB = 16


def make_state(gib: float) -> dict[str, Any]:
    """Tensors of TENSOR_MIB MiB each adding up to `gib` GiB, plus the small values a training state has."""
    count = max(1, round(gib * 1024 / TENSOR_MIB))
    numel = TENSOR_MIB * 1024 * 1024 // 4
    model = {f"layer{i}.weight": torch.randn(numel) for i in range(count)}
    return {"model": model, "step": 0, "lr": 3e-4}


def products_per_s(seconds: float, until: Any = None) -> float:
    """Matrix products per second on this thread, for `seconds` or until `until()` is true."""
    a = torch.randn(256, 256)
    done, began = 0, time.perf_counter()
    while (time.perf_counter() - began) < seconds if until is None else not until():
        a = torch.tanh(a @ a)
        done += 1
    return done / max(time.perf_counter() - began, 1e-9)


def run(gib: float, rounds: int, root: Path) -> dict[str, Any]:
    state = make_state(gib)
    nbytes = sum(t.nelement() * t.element_size() for t in state["model"].values())
    sync_s, blocking_s, end_to_end_s, busy_rate, quiet_rate = [], [], [], [], []
    os.environ["WORLD_SIZE"] = "1"
    for step in range(rounds):
        began = time.perf_counter()
        save_checkpoint(root / f"sync-{step}", step, state, rank=0)
        sync_s.append(time.perf_counter() - began)
        shutil.rmtree(root / f"sync-{step}")

        began = time.perf_counter()
        pending = save_checkpoint(root / f"bg-{step}", step, state, rank=0, background=True)
        blocking_s.append(time.perf_counter() - began)
        busy_rate.append(products_per_s(0, until=pending.done))
        pending.wait()
        end_to_end_s.append(time.perf_counter() - began)
        quiet_rate.append(products_per_s(end_to_end_s[-1] - blocking_s[-1]))
        shutil.rmtree(root / f"bg-{step}")
    sync, blocking = statistics.median(sync_s), statistics.median(blocking_s)
    return {
        "state_bytes": nbytes,
        "rounds": rounds,
        "sync_save_median_s": round(sync, 3),
        "background_blocking_median_s": round(blocking, 3),
        "blocking_ratio": round(blocking / sync, 4),
        "first_background_blocking_s": round(blocking_s[0], 3),
        "later_background_blocking_median_s": round(statistics.median(blocking_s[1:]), 3) if rounds > 1 else None,
        "background_end_to_end_median_s": round(statistics.median(end_to_end_s), 3),
        "training_rate_while_writing_ratio": round(statistics.median(busy_rate) / statistics.median(quiet_rate), 3),
        "host_copy_peak_bytes": background_stats().peak_bytes,
        "sync_save_s": [round(x, 3) for x in sync_s],
        "background_blocking_s": [round(x, 3) for x in blocking_s],
    }


def main() -> None:
    """Measure, print, save."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--gib", type=float, default=1.0, help="size of the saved state")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rp-bench-ckpt-", dir=os.environ.get("REPRISE_BENCH_DIR")))
    try:
        figures = run(args.gib, args.rounds, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for key, value in figures.items():
        print(f"{key:>36}: {value}")
    print(f"saved {write_result('checkpoint', figures)}")


if __name__ == "__main__":
    main()
