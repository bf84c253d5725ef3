"""What an agent reports of its node: the periodic node report (GPUs, ranks, standbys) and its own start and stop."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import Field

from reprise_common.events.base import Event, Wire
from reprise_common.events.containers import ContainerSupport


class GpuHealth(StrEnum):
    """What the agent knows of one GPU."""

    OK = "ok"
    DEGRADED = "degraded"
    FAILED = "failed"
    LOST = "lost"
    UNKNOWN = "unknown"


class GpuStatus(Wire):
    """One GPU's readings in a node report."""

    index: int = Field(ge=0)
    uuid: str = ""
    health: GpuHealth = GpuHealth.OK
    temperature_c: float | None = None
    power_w: float | None = None
    utilization_pct: float | None = None
    memory_used_mib: float | None = None
    memory_total_mib: float | None = None
    ecc_sbe: int | None = None
    ecc_dbe: int | None = None
    retired_pages_pending: bool | None = None
    retired_pages: int | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failed: bool | None = None
    pcie_replay_count: int | None = None
    nvlink_errors: int | None = Field(default=None, description="sum of NVLink CRC, replay and recovery counters")
    throttle_reasons: list[str] = Field(default_factory=list)
    last_xid: int | None = None
    error: str = Field(default="", description="why a reading is missing (e.g. NVML unavailable)")


WHERE_MAX = 160  # RankStatus.where: "function (file:line)", cut to this
WAITS_IN_MAX = 64  # RankStatus.waits_in: a torch.distributed function's name, cut to this


class RankStatus(Wire):
    """One rank's progress in a node report."""

    job_id: str
    rank: int = Field(ge=0)
    restart_epoch: int | None = Field(default=None, description="the launch this process belongs to")
    pid: int | None = None
    gpu: int | None = None
    step: int | None = None
    heartbeat_age_s: float | None = None
    phase: str = "startup"
    phase_age_s: float | None = None
    step_time_p50_s: float | None = None
    step_time_p99_s: float | None = None
    step_time_last_s: float | None = None
    alive: bool = True
    exit_code: int | None = Field(default=None, description="how the process ended, once it has (negative: signal)")
    proc_state: str = Field(
        default="", max_length=1, description="scheduler state of a live rank: R, S, D, T (stopped), ...; '' unknown"
    )
    proc_state_age_s: float | None = Field(
        default=None, ge=0, description="seconds since the agent first saw the live rank in this state (in a row)"
    )
    cpu_s: float | None = Field(default=None, ge=0, description="CPU seconds the live rank used so far")
    io_bytes: int | None = Field(
        default=None, ge=0, description="bytes the live rank read and wrote through system calls so far (sockets too)"
    )
    resumed_via: str = Field(
        default="", max_length=16, description="where the rank's state came from at its start: peer, checkpoint; ''"
    )
    resumed_step: int | None = Field(default=None, ge=0, description="the step a peer's state was at (via peer)")
    resumed_why: str = Field(default="", max_length=512, description="why that path (the SDK's words)")
    # A rank without the SDK reports no steps: its agent samples its main thread's stack now and then (stack_sampler).
    where: str = Field(
        default="", max_length=WHERE_MAX, description="its main thread's innermost frame at the last stack sample"
    )
    waits_in: str = Field(
        default="", max_length=WAITS_IN_MAX, description="the torch.distributed call `where` is in; '' none"
    )
    still_s: float | None = Field(
        default=None, ge=0, description="seconds its main thread has stood idle at the same stack, in every sample"
    )


class StandbyStatus(Wire):
    """A warm standby interpreter waiting on a node for a rank to run."""

    pid: int = Field(ge=0)
    ready: bool = Field(description="it imported its modules and waits (false: still importing)")
    rss_bytes: int | None = Field(default=None, ge=0, description="its resident memory now")
    failed_imports: list[str] = Field(default_factory=list, max_length=8, description="modules it could not import")


class NodeReport(Event):
    """One compact report per node per interval: all GPUs, all ranks."""

    type: Literal["node.report"] = "node.report"
    node_id: str
    address: str = Field(default="", description="where other nodes reach this node; the rendezvous master of rank 0")
    interval_s: float = Field(gt=0)
    gpu_backend: str
    gpu_error: str = Field(default="", description="why no GPU can be read on this node (e.g. NVML unavailable)")
    gpus: list[GpuStatus] = Field(default_factory=list)
    ranks: list[RankStatus] = Field(default_factory=list)
    spare: bool = False
    cordoned: bool = False
    stopping: bool = Field(
        default=False, description="the agent is stopping (a graceful restart): its connection closes next, expected"
    )
    standbys: list[StandbyStatus] = Field(default_factory=list, description="warm standby interpreters waiting here")
    containers: ContainerSupport | None = Field(
        default=None, description="what containerized jobs may use here; None: the node runs no containers"
    )
    connection: str = Field(
        default="",
        max_length=192,
        description="the agent's NATS connection the report was sent on (server id/client id, as the server's "
        "advisories name it): a closed connection with the node's identity that is not this one is no evidence",
    )


class AgentLifecycle(Event):
    """An agent started or is stopping."""

    type: Literal["agent.lifecycle"] = "agent.lifecycle"
    node_id: str
    state: Literal["starting", "stopping"]
    gpu_count: int = 0
