"""A stand-in rank: prints its rank and a step counter until stopped. Used by the walking-skeleton demo and tests.

It heartbeats through the training SDK like a real training script, so recoveries can verify it is progressing.
"""

from __future__ import annotations

import os
import time

import reprise_sdk


def main() -> None:
    """Tick forever at the interval in TICK_S (default 0.2 s)."""
    rank = os.environ.get("RANK", "?")
    interval = float(os.environ.get("TICK_S", "0.2"))
    print(f"rank {rank} of {os.environ.get('WORLD_SIZE')} epoch {os.environ.get('REPRISE_RESTART_EPOCH')}", flush=True)
    step = 0
    while True:
        step += 1
        print(f"rank {rank} step {step}", flush=True)
        reprise_sdk.heartbeat(step)
        time.sleep(interval)


if __name__ == "__main__":
    main()
