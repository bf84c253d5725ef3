"""Backends whose scheduler allocates a job's nodes (Slurm): the job runs where its allocation runs.

On the built-in backend a job is placed on nodes whose agents already report. A scheduler such as Slurm first grants
an allocation, and the agents start inside it: such a backend also implements `AllocatingBackend`, and the job flows
(jobs/allocations.py) submit an allocation for each new job, place the job on it once it runs, and keep the platform's
jobs and the scheduler's in step. A backend without it is placed on as before.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from reprise_common.errors import ConfigError

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class AllocationRequest(BaseModel):
    """One job's allocation: its workers plus its spares, and the scheduler's options from the job spec."""

    model_config = ConfigDict(frozen=True)

    job_id: str
    workers: int = Field(ge=1)
    spares: int = Field(ge=0)
    partition: str | None = None
    account: str | None = None
    time_limit_min: int | None = None
    extra_args: tuple[str, ...] = ()
    output: str | None = None
    section: BaseModel | None = None  # the job's section for this backend, as the backend's own model (its options)

    @property
    def nodes(self) -> int:
        """How many nodes the allocation holds."""
        return self.workers + self.spares


class AllocationState(StrEnum):
    """Where a job's allocation is, as the platform needs to know it."""

    WAITING = "waiting"  # submitted, not running (queued, held, or requeued and waiting to run again)
    RUNNING = "running"  # its nodes are granted: agents start (or run) on them
    ENDED = "ended"  # finished, cancelled, failed, preempted or out of time: it runs no more


class Allocation(BaseModel):
    """A job's allocation as the scheduler shows it now."""

    model_config = ConfigDict(frozen=True)

    job_id: str
    scheduler_id: str = Field(description="the scheduler's own id (Slurm's job id)")
    state: AllocationState
    nodes: tuple[str, ...] = Field((), description="the granted nodes in the scheduler's order (none while waiting)")
    detail: str = Field("", description="the scheduler's state and reason, for people")
    restarts: int = Field(0, description="how many times the scheduler requeued it")


@runtime_checkable
class AllocatingBackend(Protocol):
    """What a backend whose scheduler allocates nodes adds to ComputeBackend (compute/backend.py)."""

    name: str

    async def allocate(self, request: AllocationRequest) -> str:
        """Submit the job's allocation, with one agent per node started in it; the scheduler's id for it."""
        ...

    async def allocations(self) -> dict[str, Allocation]:
        """Every job's newest allocation the scheduler still knows, by platform job id."""
        ...

    async def requeue(self, job_id: str, *, exclude: Set[str] = frozenset()) -> list[str] | None:
        """Give the job a new allocation without `exclude` and the nodes the scheduler will not schedule on; the
        nodes left out, or None (nothing done) when its allocation does not run or holds none of them."""
        ...

    async def cancel(self, job_id: str) -> Sequence[int]:
        """End the job's allocation (nothing when it has none); the scheduler's ids of what was ended."""
        ...


@dataclass(frozen=True)
class AgentLaunch:
    """How an allocation starts its agents, whatever the scheduler (a Slurm batch script, a Kubernetes pod): the
    command, where NATS is, the directory of the nodes' NATS seeds, the HTTP port, and further agent settings."""

    command: str
    nats_url: str
    creds_dir: Path | None = None
    http_port: int = 8800
    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        bad = [name for name in self.env if not _ENV_NAME.fullmatch(name)]
        if bad:
            raise ConfigError(f"REPRISE_SLURM_AGENT_ENV: not environment variable names: {', '.join(bad)}")
        if not shlex.split(self.command):
            raise ConfigError("REPRISE_SLURM_AGENT_COMMAND is empty")

    def argv(self) -> list[str]:
        """The command as its words (shell quoting undone): what runs, never through a shell."""
        return shlex.split(self.command)

    def shared_env(self) -> dict[str, str]:
        """The settings every agent of an allocation gets alike (the per-node ones are the scheduler's to set)."""
        return {
            **self.env,
            "REPRISE_NATS_URL": self.nats_url,
            "REPRISE_LOG_FORMAT": self.env.get("REPRISE_LOG_FORMAT", "json"),
        }

    def seed_file(self, node: str) -> str | None:
        """Where the node's NATS seed is (`<creds_dir>/<node>.nk`), None when agents connect without one."""
        return str(self.creds_dir / f"{node}.nk") if self.creds_dir is not None else None
