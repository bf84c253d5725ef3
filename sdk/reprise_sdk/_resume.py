"""Where this rank stands in its job, read from the environment the agent (or torchrun) set."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_MASTER_PORT = 29500  # torch.distributed's default


@dataclass(frozen=True, slots=True)
class ResumeInfo:
    """This rank's identity, its job's rendezvous, and the checkpoint to resume from (None: start fresh)."""

    job_id: str
    node_id: str
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    restart_epoch: int
    checkpoint: str | None
    master_addr: str
    master_port: int
    skip_steps: tuple[int, int] | None = None  # first and last step whose data to skip (a numeric fault's), or None

    def skips(self, step: int) -> bool:
        """True when the data of training step `step` is to be skipped (it led to a NaN or a loss spike)."""
        return self.skip_steps is not None and self.skip_steps[0] <= step <= self.skip_steps[1]


def resume() -> ResumeInfo:
    """Read this rank's ResumeInfo; outside Reprise: rank 0 of 1, no job, no checkpoint (torchrun's vars are used)."""
    return resume_from(os.environ)


def resume_from(env: Mapping[str, str]) -> ResumeInfo:
    """ResumeInfo from an explicit environment; raises ValueError naming a variable that is not an integer."""
    world_size = _integer(env, "WORLD_SIZE", 1)
    return ResumeInfo(
        job_id=env.get("REPRISE_JOB_ID", ""),
        node_id=env.get("REPRISE_NODE_ID", ""),
        rank=_integer(env, "RANK", 0),
        local_rank=_integer(env, "LOCAL_RANK", 0),
        world_size=world_size,
        local_world_size=_integer(env, "LOCAL_WORLD_SIZE", world_size),
        restart_epoch=_integer(env, "REPRISE_RESTART_EPOCH", 0),
        checkpoint=env.get("REPRISE_RESUME_CHECKPOINT") or None,
        master_addr=env.get("MASTER_ADDR") or "127.0.0.1",
        master_port=_integer(env, "MASTER_PORT", DEFAULT_MASTER_PORT),
        skip_steps=_span(env, "REPRISE_SKIP_STEPS"),
    )


def _span(env: Mapping[str, str], name: str) -> tuple[int, int] | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    first, sep, last = raw.partition("-")
    try:
        span = (int(first), int(last)) if sep else (int(first), int(first))
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not a step span (FIRST-LAST)") from None
    if span[0] < 0 or span[1] < span[0]:
        raise ValueError(f"environment variable {name}={raw!r} is not a step span (FIRST-LAST)")
    return span


def _integer(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None
