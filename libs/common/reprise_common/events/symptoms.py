"""Symptoms agents report as they happen: GPU errors, rank exits and parks, stacks, numeric faults, dependencies."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from reprise_common.events.base import Event, Wire


class GpuXid(Event):
    """An XID error reported by the driver for one GPU."""

    type: Literal["gpu.xid"] = "gpu.xid"
    node_id: str
    gpu: int = Field(ge=0)
    xid: int = Field(ge=0)
    message: str = ""


class GpuLost(Event):
    """A GPU can no longer be read (fallen off the bus, NVML says GPU is lost)."""

    type: Literal["gpu.lost"] = "gpu.lost"
    node_id: str
    gpu: int = Field(ge=0)
    reason: str = ""


class RankExited(Event):
    """A rank process ended, with how and the last lines it printed."""

    type: Literal["rank.exited"] = "rank.exited"
    node_id: str
    job_id: str
    rank: int = Field(ge=0)
    exit_code: int | None = None
    signal: str | None = None
    oom_killed: bool = False
    log_tail: list[str] = Field(default_factory=list)
    restart_epoch: int | None = Field(default=None, ge=0, description="the launch the process belonged to")
    scheduler_ended: bool = Field(
        default=False,
        description="the compute scheduler ended the node's step (Slurm: a preemption, a time limit, a cancel) and the"
        " rank with it: no fault of the rank or the node; the scheduler's own signal says why",
    )


PARKED_WHY_MAX = 2000  # characters of what a parked rank caught


class RankParked(Event):
    """A rank running under reprise_sdk.run left its training function and waits, alive, for the next epoch
    (restart in place): a survivor, no fault of its own; `why` is what it caught (a peer's failure, or the order)."""

    type: Literal["rank.parked"] = "rank.parked"
    node_id: str
    job_id: str
    rank: int = Field(ge=0)
    restart_epoch: int = Field(ge=0, description="the launch the process belongs to")
    why: str = Field(default="", max_length=PARKED_WHY_MAX, description="the error it caught, or the agent's order")


STACK_THREADS_MAX = 16  # threads of one rank a stack capture keeps (the main thread first)
STACK_FRAMES_MAX = 64  # frames of one thread it keeps (innermost first)


class StackFrame(Wire):
    """One Python frame of a captured stack."""

    function: str = Field(max_length=256)
    file: str = Field(max_length=1024)
    line: int | None = Field(default=None, ge=0)


class ThreadStack(Wire):
    """One thread of a rank, innermost frame first."""

    thread_id: int = Field(ge=0)
    name: str = Field(default="", max_length=256)
    active: bool = Field(default=False, description="running (not idle or waiting) when it was captured")
    frames: list[StackFrame] = Field(default_factory=list, max_length=STACK_FRAMES_MAX)


class RankStacks(Event):
    """The Python stacks of one rank, captured by its agent before the stop a recovery of a hang ordered."""

    type: Literal["rank.stacks"] = "rank.stacks"
    node_id: str
    job_id: str
    rank: int = Field(ge=0)
    restart_epoch: int | None = Field(default=None, ge=0, description="the launch the process belonged to")
    incident_id: str = Field(min_length=1, max_length=128, description="the incident the capture was ordered for")
    pid: int | None = Field(default=None, ge=0)
    proc_state: str = Field(default="", max_length=1, description="the process's kernel state (R, S, D, T, ...)")
    threads: list[ThreadStack] = Field(default_factory=list, max_length=STACK_THREADS_MAX)
    capture_ms: float = Field(default=0.0, ge=0)
    error: str = Field(default="", max_length=2000, description="why no stack was captured (no threads then)")


METRIC_NAME_MAX = 64  # characters of a metric's name
NUMERIC_METRICS_MAX = 16  # metrics one job may have watched


class NumericKind(StrEnum):
    """How a watched training metric went wrong."""

    NAN = "nan"
    INF = "inf"
    SPIKE = "spike"  # finite, but far above the metric's recent values (robust z-score past the job's threshold)


class NumericWatch(Wire):
    """Which metrics of a job's heartbeats its agents watch, and when a finite value counts as a spike."""

    metrics: list[Annotated[str, Field(min_length=1, max_length=METRIC_NAME_MAX)]] = Field(
        default_factory=lambda: ["loss"], max_length=NUMERIC_METRICS_MAX
    )
    spike_z: float | None = Field(
        default=None, gt=0, le=1_000, description="robust z-score (median, MAD) that makes a spike; None: no spikes"
    )
    window: int = Field(default=100, ge=5, le=10_000, description="recent values a spike is measured against")
    min_samples: int = Field(default=20, ge=3, le=10_000, description="values seen before spikes are judged")

    @field_validator("min_samples")
    @classmethod
    def _within_window(cls, min_samples: int, info: Any) -> int:
        window = info.data.get("window")
        if window is not None and min_samples > window:
            raise ValueError("min_samples is larger than window (spikes would never be judged)")
        return min_samples


class RankNumeric(Event):
    """A watched metric of one rank went non-finite or spiked: the step it was first seen at and what it was."""

    type: Literal["rank.numeric"] = "rank.numeric"
    node_id: str
    job_id: str
    rank: int = Field(ge=0)
    restart_epoch: int | None = Field(default=None, ge=0, description="the launch the process belongs to")
    metric: str = Field(min_length=1, max_length=METRIC_NAME_MAX)
    kind: NumericKind
    value: float | None = Field(default=None, description="the value that tripped (None: NaN or infinite)")
    step: int = Field(ge=0, description="the first step whose value tripped: the fault's step")
    last_good_step: int | None = Field(default=None, ge=0, description="the newest step reported fine before it")
    median: float | None = Field(default=None, description="the recent median a spike was measured against")
    z: float | None = Field(default=None, description="a spike's robust z-score")


class DependencyFailed(Event):
    """A dependency check (storage, disk, rendezvous master, HTTP endpoint) failed on a node."""

    type: Literal["dependency.failed"] = "dependency.failed"
    node_id: str
    dependency: str
    detail: str = ""
    job_id: str | None = Field(default=None, description="the job the dependency belongs to (its rendezvous master)")
