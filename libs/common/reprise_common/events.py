"""Every message type Reprise sends, as a versioned schema.

Each event carries an id (also used as the JetStream ``Nats-Msg-Id`` for dedup), a schema version, a UTC-aware
timestamp and its source. Readers ignore unknown fields so a newer writer does not break an older reader; a
schema version newer than the reader knows is rejected (dead-lettered) rather than misread.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Mapping
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    TypeAdapter,
    ValidationError,
    field_validator,
)

from reprise_common.checkpoint_names import PATTERN_MAX, CheckpointLayout
from reprise_common.clock import utcnow
from reprise_common.errors import MalformedEventError

SCHEMA_VERSION = 1


_IDS_PER_DRAW = 256
# A random UUID (RFC 9562, version 4) as an integer: version 4 in bits 76-79, variant 0b10 in bits 62-63, the rest
# random.
_UUID_V4 = (4 << 76) | (0x8000 << 48)
_UUID_RANDOM = ((1 << 128) - 1) & ~((0xF << 76) | (0xC000 << 48))
_ids: deque[str] = deque()  # random ids drawn ahead; popleft and extend are atomic, so threads may share it
os.register_at_fork(after_in_child=_ids.clear)  # a forked child must not hand out its parent's next ids


def new_id() -> str:
    """A fresh, collision-free id for events, commands and records: a random (version 4) UUID in hex.

    The randomness is read 256 ids at a time: one system call per id made a storm's database thread give up the
    interpreter lock thousands of times, and wait for it each time behind a busy event loop.
    """
    while True:
        try:
            return _ids.popleft()
        except IndexError:
            raw = os.urandom(16 * _IDS_PER_DRAW)
            _ids.extend(
                f"{int.from_bytes(raw[n : n + 16]) & _UUID_RANDOM | _UUID_V4:032x}" for n in range(0, len(raw), 16)
            )


class Wire(BaseModel):
    """Base of every wire model: tolerant of unknown fields, immutable once built."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class Event(Wire):
    """Envelope fields every event carries."""

    SUPPORTED_VERSION: ClassVar[int] = SCHEMA_VERSION

    event_id: str = Field(default_factory=new_id, min_length=1, max_length=128)
    schema_version: int = SCHEMA_VERSION
    time: AwareDatetime = Field(default_factory=utcnow)
    source: str = Field(min_length=1, max_length=128)

    @field_validator("schema_version")
    @classmethod
    def _known_version(cls, value: int) -> int:
        if value < 1 or value > cls.SUPPORTED_VERSION:
            raise ValueError(f"schema_version {value} not supported (this reader knows 1..{cls.SUPPORTED_VERSION})")
        return value

    def to_bytes(self) -> bytes:
        """Serialise to compact JSON."""
        return self.model_dump_json().encode()


# --- GPU and node health ------------------------------------------------------------------------------------
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
    # A rank without the SDK reports no steps: its agent samples its main thread's stack now and then (stack_sampler).
    where: str = Field(
        default="", max_length=WHERE_MAX, description="its main thread's innermost frame at the last stack sample"
    )
    waits_in: str = Field(default="", max_length=64, description="the torch.distributed call `where` is in; '' none")
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
    connection: str = Field(
        default="",
        max_length=192,
        description="the agent's NATS connection the report was sent on (server id/client id, as the server's "
        "advisories name it): a closed connection with the node's identity that is not this one is no evidence",
    )


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


class FileDigest(Wire):
    """One checkpoint file's size and digest, computed by the writer while or right after writing it."""

    path: str = Field(min_length=1, max_length=4096)
    size_bytes: int = Field(ge=0)
    digest: str = Field(pattern=r"^[0-9a-f]{16,128}$")
    algorithm: Literal["blake3", "sha256"] = "blake3"


class CheckpointSaved(Event):
    """A rank finished writing its part of a checkpoint: reported through the SDK, or found by its agent (a checkpoint
    the script saves itself, CheckpointWatch)."""

    type: Literal["checkpoint.saved"] = "checkpoint.saved"
    node_id: str
    job_id: str
    rank: int = Field(ge=0)
    step: int = Field(ge=0)
    path: str
    files: list[str] = Field(default_factory=list)
    restart_epoch: int = Field(default=0, ge=0)
    world_size: int | None = Field(default=None, ge=1, description="ranks that write this checkpoint, if known")
    file_digests: list[FileDigest] = Field(
        default_factory=list, description="size and digest of each file, computed where the bytes are"
    )
    marker: str | None = Field(
        default=None,
        min_length=1,
        max_length=255,
        description="the file whose presence commits it, relative to `path`; None: by layout (COMMITTED, .metadata)",
    )


class DependencyFailed(Event):
    """A dependency check (storage, disk, rendezvous master, HTTP endpoint) failed on a node."""

    type: Literal["dependency.failed"] = "dependency.failed"
    node_id: str
    dependency: str
    detail: str = ""
    job_id: str | None = Field(default=None, description="the job the dependency belongs to (its rendezvous master)")


class AgentLifecycle(Event):
    """An agent started or is stopping."""

    type: Literal["agent.lifecycle"] = "agent.lifecycle"
    node_id: str
    state: Literal["starting", "stopping"]
    gpu_count: int = 0


# --- incidents ----------------------------------------------------------------------------------------------
class Category(StrEnum):
    """Where the root cause of an incident lies."""

    GPU_HARDWARE = "gpu_hardware"
    INTERCONNECT = "interconnect"
    NODE = "node"
    APPLICATION = "application"
    HANG = "hang"  # a job's step progress stopped past its limit (no rank died)
    PROCESS_KILLED = "process_killed"  # a rank ended by SIGKILL from outside (not by the OOM killer)
    EARLY_EXIT = "early_exit"  # a rank exited 0 while the rest of its job went on: the job runs a rank short
    NUMERIC = "numeric"  # a watched training metric (the loss) went NaN, infinite or spiked: roll back before it
    DEPENDENCY = "dependency"
    UNKNOWN = "unknown"


# How fundamental a cause is (a deeper cause arriving later becomes the incident's root cause): hardware faults outrank
# node loss, which outranks dependency failures, which outrank rank crashes and hangs. Within one tier the earliest
# symptom is the root cause. Secondary symptoms (root_cause_grade false) never lead: they are evidence.
CAUSE_DEPTH: Mapping[str, int] = {
    Category.UNKNOWN: 1,
    Category.APPLICATION: 1,
    Category.HANG: 1,
    Category.PROCESS_KILLED: 1,
    Category.EARLY_EXIT: 1,
    Category.NUMERIC: 1,
    Category.DEPENDENCY: 2,
    Category.NODE: 3,
    Category.INTERCONNECT: 4,
    Category.GPU_HARDWARE: 4,
}


class Severity(StrEnum):
    """How bad an incident is for the job."""

    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"


class RecommendedAction(StrEnum):
    """What the detector recommends the orchestrator do."""

    NONE = "none"
    RESTART_JOB = "restart_job"
    RESTART_EXCLUDE_NODE = "restart_exclude_node"
    RESET_GPU = "reset_gpu"
    ALERT_HUMAN = "alert_human"


class Culprit(Wire):
    """Who the root cause points at."""

    node_id: str | None = None
    gpu: int | None = None
    rank: int | None = None
    exit_code: int | None = Field(default=None, description="the culprit rank's exit code when it exited")
    restart_epoch: int | None = Field(
        default=None, ge=0, description="the launch the culprit rank belonged to, when the symptom says it"
    )
    fault_step: int | None = Field(
        default=None, ge=0, description="a numeric fault's step: a recovery restores a checkpoint older than it"
    )


class IncidentChange(Event):
    """An incident was opened, updated or resolved."""

    type: Literal["incident.change"] = "incident.change"
    change: Literal["opened", "updated", "resolved"]
    incident_id: str
    job_id: str
    category: Category
    severity: Severity
    root_cause: str
    culprit: Culprit
    recommended_action: RecommendedAction
    symptom_count: int = Field(default=1, ge=0)
    first_symptom_at: AwareDatetime
    labels: dict[str, str] = Field(
        default_factory=dict, description="the job's labels, as the detector learned them from its placement"
    )


# --- orchestrator -------------------------------------------------------------------------------------------
class RankAssignment(Wire):
    """Which node and GPU a rank runs on."""

    rank: int = Field(ge=0)
    node_id: str
    gpu: int | None = None
    local_rank: int = Field(ge=0)


class JobPlacement(Event):
    """The placement of a job's ranks for one restart epoch."""

    type: Literal["job.placement"] = "job.placement"
    job_id: str
    restart_epoch: int = Field(ge=0)
    world_size: int = Field(ge=0)
    ranks: list[RankAssignment] = Field(default_factory=list)
    active: bool = True
    hang_timeout_s: float | None = Field(default=None, gt=0, description="the job's fixed hang limit, if it set one")
    labels: dict[str, str] = Field(default_factory=dict, description="the job's labels, from its spec")

    def nodes(self) -> list[str]:
        """The distinct nodes of the placement, in rank order."""
        return list(dict.fromkeys(r.node_id for r in self.ranks))


class RecoveryChange(Event):
    """A recovery started, moved to a new step, succeeded or failed."""

    type: Literal["recovery.change"] = "recovery.change"
    change: Literal["started", "step", "succeeded", "failed"]
    recovery_id: str
    job_id: str
    incident_id: str | None = None
    step: str
    fence: int = Field(ge=0)
    detail: str = ""
    attempt: int = Field(default=1, ge=1, description="which attempt of the recovery the step belongs to")
    outcome: str = Field(default="", description="why it ended (succeeded/failed only): a reason code")
    step_started_at: AwareDatetime | None = Field(default=None, description="when the step began")
    labels: dict[str, str] = Field(default_factory=dict, description="the job's labels, from its spec")


class ComputeSignalKind(StrEnum):
    """A failure the compute backend (a cluster scheduler) saw on its own."""

    NODE_DOWN = "node_down"  # the scheduler set the node down
    NODE_NOT_RESPONDING = "node_not_responding"  # the scheduler lost contact with the node
    NODE_FAIL = "node_fail"  # the scheduler ended the job because one of its nodes failed
    PREEMPTED = "preempted"  # not a fault of the hardware: the job was preempted
    TIME_LIMIT = "time_limit"  # not a fault of the hardware: the job reached its time limit
    # the scheduler's controller does not answer: the job runs on, but nothing can be placed, drained or requeued
    CONTROLLER_UNAVAILABLE = "controller_unavailable"


class ComputeSignal(Event):
    """A failure signal of the compute backend, announced by the orchestrator that runs the backend."""

    type: Literal["compute.signal"] = "compute.signal"
    backend: str = Field(min_length=1, max_length=64)
    kind: ComputeSignalKind
    node_id: str | None = Field(default=None, max_length=256)
    job_id: str | None = Field(default=None, max_length=256)
    detail: str = Field(default="", max_length=2000)


# --- node reputation ----------------------------------------------------------------------------------------
class QuarantineReason(StrEnum):
    """Why the detector recommends taking a node out of service."""

    REPEATED_XID = "repeated_xid"  # the same fatal XID (e.g. 48) more than once within the window
    FAULTS_ACROSS_JOBS = "faults_across_jobs"  # hardware faults in several different jobs within the window
    REPEATED_NUMERIC = "repeated_numeric"  # numeric faults (NaN, spikes) first seen on this node, again and again


class NodeQuarantineRecommended(Event):
    """The detector recommends quarantining a node whose fault history says it is a lemon."""

    type: Literal["node.quarantine_recommended"] = "node.quarantine_recommended"
    node_id: str
    reason: QuarantineReason
    detail: str = ""
    fault_count: int = Field(default=0, ge=0)
    job_ids: list[str] = Field(default_factory=list)
    window_s: float = Field(default=86400.0, gt=0)
    first_fault_at: AwareDatetime | None = None
    last_fault_at: AwareDatetime | None = None


# --- checkpoint registry ------------------------------------------------------------------------------------
class CheckpointChange(Event):
    """A checkpoint was validated, found corrupt, or deleted by retention."""

    type: Literal["checkpoint.change"] = "checkpoint.change"
    change: Literal["validated", "corrupt", "deleted"]
    checkpoint_id: int = Field(ge=0)
    job_id: str
    step: int = Field(ge=0)
    path: str
    manifest_digest: str | None = None
    reason: str = ""


# --- dead letters -------------------------------------------------------------------------------------------
class DeadLetter(Event):
    """A message a consumer could not use, kept with the reason; nothing is dropped silently."""

    type: Literal["dead.letter"] = "dead.letter"
    original_subject: str
    reason: str
    payload: str = Field(description="the raw payload, decoded as UTF-8 with replacement, at most 64 KiB")
    delivered: int = 1


AnyEvent = Annotated[
    NodeReport
    | GpuXid
    | GpuLost
    | RankExited
    | RankParked
    | CheckpointSaved
    | RankStacks
    | RankNumeric
    | DependencyFailed
    | AgentLifecycle
    | IncidentChange
    | JobPlacement
    | RecoveryChange
    | ComputeSignal
    | DeadLetter
    | NodeQuarantineRecommended
    | CheckpointChange,
    Field(discriminator="type"),
]
_ANY_EVENT: TypeAdapter[Any] = TypeAdapter(AnyEvent)
EVENT_TYPES: tuple[type[Event], ...] = (
    NodeReport,
    GpuXid,
    GpuLost,
    RankExited,
    RankParked,
    CheckpointSaved,
    RankStacks,
    RankNumeric,
    DependencyFailed,
    AgentLifecycle,
    IncidentChange,
    JobPlacement,
    RecoveryChange,
    ComputeSignal,
    DeadLetter,
    NodeQuarantineRecommended,
    CheckpointChange,
)


def parse_event(data: bytes) -> Event:
    """Parse any event by its ``type`` field, or raise MalformedEventError with a one-line reason."""
    try:
        event: Event = _ANY_EVENT.validate_json(data)  # in one pass: no dict of the JSON first
    except ValidationError as exc:
        raise malformed(exc, "event") from exc
    return event


def malformed(exc: ValidationError, what: str) -> MalformedEventError:
    """A one-line MalformedEventError for the first problem pydantic found in a message."""
    first = exc.errors()[0]
    if first["type"] == "json_invalid":
        return MalformedEventError(f"not JSON: {first['msg']}")
    where = ".".join(str(p) for p in first["loc"]) or "(root)"
    return MalformedEventError(f"invalid {what} at {where}: {first['msg']}")


def event_timestamp(event: Event) -> datetime:
    """The event's own timestamp (always UTC-aware)."""
    return event.time


# --- commands (request/reply, not events) -------------------------------------------------------------------
class CommandAction(StrEnum):
    """What a command asks an agent to do."""

    PING = "ping"
    LAUNCH = "launch"
    STOP = "stop"


RESUME_FILES_MAX = 1024  # files a launch carries for the ranks to check; beyond it the registry checks them all


class ResumeFile(Wire):
    """One file of the checkpoint a launch resumes from, as the registry validated it: a rank checks what it loads."""

    path: str = Field(min_length=1, max_length=4096, description="relative to the checkpoint's directory")
    size_bytes: int = Field(ge=0)
    algorithm: Literal["sha256", "blake3"]
    digest: str = Field(pattern=r"^[0-9a-f]{16,128}$")


class StepSpan(Wire):
    """The training steps from `first` to `last`, both included."""

    first: int = Field(ge=0)
    last: int = Field(ge=0)

    @field_validator("last")
    @classmethod
    def _ordered(cls, last: int, info: Any) -> int:
        first = info.data.get("first")
        if first is not None and last < first:
            raise ValueError("last is before first")
        return last


class CheckpointWatch(Wire):
    """Where a script saves checkpoints of its own (without the SDK): agents find, hash and report the new complete
    ones, and a restore hands the one chosen to the script through its arguments or environment."""

    directory: str = Field(min_length=1, max_length=4096, description="absolute; the checkpoints are its entries")
    layout: CheckpointLayout
    pattern: str = Field(
        min_length=1, max_length=PATTERN_MAX, description="the entries' names: {step}, * and (per_rank) {rank}"
    )
    poll_s: float = Field(default=10.0, ge=0.2, le=600, description="how often an agent looks for new checkpoints")
    restore_args: list[Annotated[str, Field(min_length=1, max_length=1024)]] = Field(
        default_factory=list,
        max_length=16,
        description="appended to the command when a checkpoint is restored, {restore_path} and {restore_step} filled",
    )
    restore_env: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        max_length=256,
        description="an environment variable set to the restored checkpoint's path",
    )
    verify_before_launch: bool = Field(
        default=True,
        description="the agent re-hashes the restored files before it starts a rank (false: the script checks them)",
    )


class LaunchArgs(Wire):
    """What an agent needs to start its node's ranks of one restart epoch (one schema for both ends)."""

    restart_epoch: int = Field(ge=0)
    world_size: int = Field(ge=1, le=1_048_576)
    master_addr: str = Field(min_length=1, max_length=255, description="rank 0's node: the rendezvous host")
    master_port: int = Field(ge=1, le=65535)
    command: list[str] = Field(min_length=1, description="the training command, argv style")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment for every rank")
    cwd: str | None = Field(default=None, max_length=4096)
    resume_checkpoint: str | None = Field(
        default=None, max_length=4096, description="the validated checkpoint to resume from; None: from the start"
    )
    resume_files: list[ResumeFile] = Field(
        default_factory=list,
        max_length=RESUME_FILES_MAX,
        description="the checkpoint's files with the registry's digests; empty: the registry checked every digest",
    )
    ranks: list[RankAssignment] = Field(min_length=1, description="this node's ranks only")
    numeric: NumericWatch | None = Field(default=None, description="the job's metrics to watch; None: none")
    skip_steps: StepSpan | None = Field(
        default=None, description="steps whose data the ranks skip (the ones that led to a numeric fault)"
    )
    checkpoints: CheckpointWatch | None = Field(
        default=None, description="where the script saves checkpoints of its own; None: it reports them (the SDK)"
    )


class StackCapture(Wire):
    """Capture the ranks' Python stacks before stopping them, for an incident, within a bound."""

    incident_id: str = Field(min_length=1, max_length=128)
    within_s: float = Field(default=2.0, gt=0, le=10, description="the longest the capture may hold the stop")


class StopArgs(Wire):
    """How an agent stops a job's ranks on its node: SIGTERM, then SIGKILL after the grace period; first their
    stacks, when asked (once per incident)."""

    grace_s: float = Field(default=5.0, gt=0, le=3600)
    capture_stacks: StackCapture | None = None
    park_within_s: float | None = Field(
        default=None,
        gt=0,
        le=600,
        description="restart in place: ranks that can (reprise_sdk.run) are parked, not stopped; one not parked"
        " within this bound is stopped as usual. None: stop every rank (a cold restart)",
    )
    kill_ranks: list[NonNegativeInt] = Field(
        default_factory=list, max_length=1024, description="ranks stopped even when parking (the culprits)"
    )


class AgentCommand(Wire):
    """What every fenced, idempotent command to one agent carries; the action's own class adds its arguments."""

    command_id: str = Field(min_length=1, max_length=256)
    job_id: str = Field(min_length=1, max_length=256)
    fence: int = Field(ge=0)
    issued_at: AwareDatetime = Field(default_factory=utcnow)


class PingCommand(AgentCommand):
    """Are you there, and what do you run?"""

    action: Literal[CommandAction.PING] = CommandAction.PING


class LaunchCommand(AgentCommand):
    """Start the job's ranks of a new restart epoch on this node."""

    action: Literal[CommandAction.LAUNCH] = CommandAction.LAUNCH
    args: LaunchArgs


class StopCommand(AgentCommand):
    """Stop every rank of the job on this node."""

    action: Literal[CommandAction.STOP] = CommandAction.STOP
    args: StopArgs = Field(default_factory=StopArgs)


AnyCommand = Annotated[PingCommand | LaunchCommand | StopCommand, Field(discriminator="action")]
_ANY_COMMAND: TypeAdapter[PingCommand | LaunchCommand | StopCommand] = TypeAdapter(AnyCommand)


def parse_command(data: bytes) -> PingCommand | LaunchCommand | StopCommand:
    """Parse a command by its ``action``; raises MalformedEventError with a one-line reason."""
    try:
        return _ANY_COMMAND.validate_json(data)
    except ValidationError as exc:
        raise malformed(exc, "command") from exc


class CommandResult(StrEnum):
    """How an agent answered a command."""

    DONE = "done"
    REJECTED_STALE_FENCE = "rejected_stale_fence"
    FAILED = "failed"


# In a failed launch's reply data: why the agent refused the restored checkpoint (a file differs from the manifest).
RESTORE_REFUSED = "restore_refused"


class CommandReply(Wire):
    """The agent's answer to a command; a repeated command id gets the first answer again."""

    command_id: str
    node_id: str
    result: CommandResult
    detail: str = ""
    data: dict[str, Any] = Field(default_factory=dict)
    duplicate: bool = False


class FaultKind(StrEnum):
    """Faults an agent can inject: GPU faults (simulated backend) and process faults (drills, the demo)."""

    XID = "xid"
    ECC_DBE = "ecc_dbe"
    THERMAL = "thermal"
    OFF_BUS = "off_bus"
    NVLINK = "nvlink"
    RANK_KILL = "rank_kill"  # SIGKILL one rank
    RANK_HANG = "rank_hang"  # SIGSTOP one rank: alive, silent, its peers blocked in the next collective
    NODE_LOSS = "node_loss"  # SIGKILL every rank on the node, then the agent itself: the node is gone


PROCESS_FAULTS = frozenset({FaultKind.RANK_KILL, FaultKind.RANK_HANG, FaultKind.NODE_LOSS})


class InjectFault(Wire):
    """Ask a node to fail in a given way: its simulated GPU `gpu`, or its rank `rank` (of `job_id`, if given)."""

    kind: FaultKind
    gpu: int = Field(default=0, ge=0)
    xid: int | None = None
    rank: int | None = Field(default=None, ge=0, description="the rank a rank fault hits (default: the node's first)")
    job_id: str | None = None


class InjectReply(Wire):
    """What the simulated backend did with an injected fault."""

    accepted: bool
    detail: str = ""
