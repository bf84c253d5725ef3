"""Job records and their API shapes."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, AwareDatetime, StringConstraints, model_validator
from sqlalchemy import JSON, Column, Index, String
from sqlmodel import Field, SQLModel
from sqlmodel.main import SQLModelConfig

from reprise_common.clock import utcnow
from reprise_common.db import TypedJSON, UTCDateTime
from reprise_common.events import NumericWatch, RankAssignment
from reprise_common.labels import MAX_LABELS, MAX_NAME, MAX_PREFIX, MAX_VALUE, Labels
from reprise_common.settings import IdStr
from reprise_orchestrator.compute.kubernetes.models import KubernetesSpec
from reprise_orchestrator.compute.slurm.models import sbatch_option, slurm_name
from reprise_orchestrator.jobs.checkpoints import CheckpointSpec
from reprise_orchestrator.jobs.containers import ContainerRequest


class JobState(StrEnum):
    """Where a job is in its life."""

    PENDING = "pending"
    RUNNING = "running"
    RECOVERING = "recovering"
    HELD = "held"  # a recovery stopped and asks for a human (circuit breaker, or the detector said so)
    COMPLETED = "completed"  # every rank of the current launch exited 0
    FAILED = "failed"
    CANCELLED = "cancelled"


ACTIVE_STATES = frozenset({JobState.RUNNING, JobState.RECOVERING})


# Bounds of what a job launches with: each rank gets the command and env as its argv and environment, which Linux
# limits to 128 KiB per string (MAX_ARG_STRLEN) and about 2 MiB in all (with the agent's own variables).
MAX_ENV_VARS = 256
MAX_ENV_VALUE = 32_768
MAX_COMMAND_ARGS = 1_024
MAX_ARG_BYTES = 131_071
MAX_LAUNCH_BYTES = 262_144  # command and env together
EnvName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=256)]
EnvValue = Annotated[str, StringConstraints(max_length=MAX_ENV_VALUE)]
Argument = Annotated[str, StringConstraints(max_length=MAX_ARG_BYTES)]
ExitCode = Annotated[int, Field(ge=-255, le=255)]
# Unknown fields are refused (a typo in a policy must not silently fall back to a default).
STRICT = SQLModelConfig(extra="forbid")


class NumericPolicy(NumericWatch):
    """Which training metrics are watched for NaN, infinities and spikes, and how a numeric fault is recovered: roll
    back to the newest validated checkpoint before the fault's step, skipping the data of `skip_steps` steps."""

    model_config = {"extra": "forbid", "frozen": True}

    skip_steps: int = Field(
        default=0, ge=0, le=100_000, description="steps whose data the ranks skip, ending at the fault's step"
    )

    def watch(self) -> NumericWatch:
        """What the agents need of it: the metrics and the spike threshold."""
        return NumericWatch.model_validate(self.model_dump(exclude={"skip_steps"}))


class VerifyBy(StrEnum):
    """What a recovery's verifying step takes as proof that the new epoch trains."""

    AUTO = "auto"  # steps once any rank of the job reported one through the SDK, else settle
    STEPS = "steps"  # every rank reports a step at or past the restored checkpoint's (the SDK)
    SETTLE = "settle"  # every rank stays alive and working for verify_settle_s (no SDK needed)


class RecoveryPolicy(SQLModel):
    """How a job may be recovered; every field has a default a user can override per job."""

    model_config = STRICT

    max_restarts: int = Field(default=10, ge=0, le=1000, description="restarts allowed within restart_window_s")
    restart_window_s: float = Field(default=86_400.0, gt=0, description="the window the restart budget counts in")
    backoff_initial_s: float = Field(
        default=2.0, ge=0, le=3600, description="wait before a retry that follows no progress"
    )
    backoff_max_s: float = Field(default=60.0, ge=0, le=3600)
    backoff_factor: float = Field(default=2.0, ge=1, le=10)
    elastic_min_nodes: int | None = Field(
        default=None, ge=1, le=4096, description="shrink down to this many nodes; None: never shrink"
    )
    elastic_max_nodes: int | None = Field(default=None, ge=1, le=4096, description="never run on more nodes than this")
    use_spares: bool = Field(default=True, description="replace a lost or cordoned node with a spare first")
    hang_timeout_s: float | None = Field(default=None, gt=0, le=86_400, description="override the learned hang limit")
    numeric: NumericPolicy | None = Field(
        default_factory=NumericPolicy, description="metrics watched for numeric faults (the loss); None: none"
    )
    non_retryable_exit_codes: list[ExitCode] = Field(
        default_factory=list, max_length=256, description="a rank exiting so fails the job"
    )
    max_same_error: int = Field(
        default=3, ge=1, le=100, description="the same root cause this many times in a row fails the job"
    )
    max_recoveries_without_progress: int = Field(
        default=3, ge=1, le=100, description="recoveries in a row restoring no newer checkpoint before giving up"
    )
    max_cordon_share: float = Field(
        default=0.25,
        gt=0,
        le=1,
        description="circuit breaker: most nodes recoveries may cordon in the window (at least 1)",
    )
    cordon_window_s: float = Field(default=3600.0, gt=0)
    placement_timeout_s: float = Field(default=120.0, gt=0, le=86_400, description="how long to wait for capacity")
    verify_timeout_s: float = Field(
        default=300.0, gt=0, le=86_400, description="every rank must pass the checkpoint's step in this time"
    )
    verify_by: VerifyBy = Field(
        default=VerifyBy.AUTO,
        description="auto: steps for a job seen using the SDK, else settle (docs/orchestrator.md)",
    )
    verify_settle_s: float = Field(
        default=10.0,
        ge=1,
        le=3600,
        description="settle: every rank must stay alive and working this long (at most verify_timeout_s / 2)",
    )
    verify_cpu_share: float = Field(
        default=0.02,
        ge=0,
        le=1,
        description="settle: least share of a CPU each rank uses in the settle time's 2nd half",
    )
    max_attempts: int = Field(default=3, ge=1, le=20, description="attempts of one recovery (launch or verify failing)")
    recovery_time_objective_s: float = Field(default=120.0, gt=0, description="what drills measure recoveries against")
    restart_mode: Literal["auto", "cold"] = Field(
        default="auto",
        description="auto: ranks that can (reprise_sdk.run) restart in place, only the failed ones are replaced;"
        " cold: every rank is stopped and started afresh",
    )

    @model_validator(mode="after")
    def _elastic_bounds(self) -> RecoveryPolicy:
        if (
            self.elastic_min_nodes is not None
            and self.elastic_max_nodes is not None
            and self.elastic_min_nodes > self.elastic_max_nodes
        ):
            raise ValueError("elastic_min_nodes is larger than elastic_max_nodes")
        return self

    def settle_s(self) -> float:
        """The settle time verifying waits: verify_settle_s, at most half of verify_timeout_s (a longer one could never
        pass; stored specs from before the field existed keep validating)."""
        return min(self.verify_settle_s, self.verify_timeout_s / 2)

    def backoff_s(self, streak: int) -> float:
        """The wait before the `streak`-th retry in a row (0: none)."""
        if streak <= 0:
            return 0.0
        return float(min(self.backoff_max_s, self.backoff_initial_s * self.backoff_factor ** (streak - 1)))


class JobBase(SQLModel):
    """Fields a user provides."""

    name: str = Field(min_length=1, max_length=200)
    ranks_per_node: int = Field(default=1, ge=1, le=64)
    working_dir: str | None = Field(default=None, max_length=4096)
    checkpoint_dir: str | None = Field(default=None, max_length=4096)


SlurmNameStr = Annotated[str, AfterValidator(slurm_name)]
SbatchOption = Annotated[str, AfterValidator(sbatch_option)]


class SlurmSpec(SQLModel):
    """Where and how the job's Slurm allocation runs (the slurm backend only): its spares, partition, account, time
    limit and further sbatch options; the allocation is the job's nodes plus `spares`."""

    model_config = STRICT

    spares: int = Field(default=1, ge=0, le=64, description="nodes allocated beyond the job's, as its spares")
    partition: SlurmNameStr | None = Field(default=None, description="sbatch --partition; none: the cluster's default")
    account: SlurmNameStr | None = Field(default=None, description="sbatch --account; none: the user's default")
    time_limit_min: int | None = Field(default=None, ge=1, le=525_600, description="sbatch --time, in minutes")
    extra_args: list[SbatchOption] = Field(
        default_factory=list, max_length=32, description="further sbatch options, each one --name[=value] token"
    )
    output: str | None = Field(
        default=None, min_length=1, max_length=4096, description="the batch output file (%j: Slurm's job id)"
    )


class JobCreate(JobBase):
    """Body of POST /v1/jobs: either a node list or a node count."""

    model_config = STRICT

    nodes: list[IdStr] | None = Field(default=None, min_length=1, max_length=4096)
    node_count: int | None = Field(default=None, ge=1, le=4096)
    command: list[Argument] = Field(min_length=1, max_length=MAX_COMMAND_ARGS)
    env: dict[EnvName, EnvValue] = Field(default_factory=dict, max_length=MAX_ENV_VARS)
    labels: Labels = Field(
        default_factory=dict, max_length=MAX_LABELS, description="key/value pairs to route alerts and filter jobs by"
    )
    policy: RecoveryPolicy = Field(default_factory=RecoveryPolicy)
    slurm: SlurmSpec | None = Field(default=None, description="the job's Slurm allocation (the slurm backend only)")
    kubernetes: KubernetesSpec | None = Field(
        default=None, description="where the job's pods run (the kubernetes backend only; docs/kubernetes.md)"
    )
    checkpoints: CheckpointSpec | None = Field(
        default=None, description="where the script saves checkpoints of its own, without the SDK (docs/registry.md)"
    )
    container: ContainerRequest | None = Field(
        default=None, description="run the ranks in an image (docs/containers.md)"
    )

    @model_validator(mode="after")
    def _nodes_or_count(self) -> JobCreate:
        if (self.nodes is None) == (self.node_count is None):
            raise ValueError("give exactly one of nodes (a list of node ids) or node_count")
        if self.nodes is not None and len(set(self.nodes)) != len(self.nodes):
            raise ValueError("nodes lists a node twice")
        size = sum(len(arg.encode()) + 1 for arg in self.command)
        size += sum(len(name) + len(value.encode()) + 2 for name, value in self.env.items())
        if size > MAX_LAUNCH_BYTES:
            raise ValueError(f"command and env take {size} bytes; at most {MAX_LAUNCH_BYTES} (each rank's argv + env)")
        count = self.node_count if self.node_count is not None else len(self.nodes or [])
        bounds = self.policy
        if bounds.elastic_max_nodes is not None and count > bounds.elastic_max_nodes:
            raise ValueError(f"policy.elastic_max_nodes ({bounds.elastic_max_nodes}) is below the job's {count} nodes")
        if bounds.elastic_min_nodes is not None and count < bounds.elastic_min_nodes:
            raise ValueError(f"policy.elastic_min_nodes ({bounds.elastic_min_nodes}) is above the job's {count} nodes")
        return self

    def allocation_section(self, backend: str) -> SlurmSpec | KubernetesSpec | None:
        """The job's section for an allocating backend: each is named after its backend (`slurm`, `kubernetes`)."""
        return {"slurm": self.slurm, "kubernetes": self.kubernetes}.get(backend)


_SPEC_CACHE = "_job_spec"  # where a Job row keeps its validated spec (not a column, not a field)


class Job(JobBase, table=True):
    """A job row; its spec is stored as JSON, its placement and restart times as typed JSON."""

    id: str = Field(primary_key=True)
    state: JobState = Field(default=JobState.PENDING, index=True)
    spec: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))
    placement: list[RankAssignment] = Field(
        default_factory=list, sa_column=Column(TypedJSON(list[RankAssignment]), nullable=False)
    )
    reserved_nodes: list[str] = Field(
        default_factory=list,
        sa_column=Column(TypedJSON(list[str]), nullable=False, server_default="[]"),
        description="nodes a running recovery chose for the job and has not launched on yet",
    )
    restart_epoch: int = 0
    restarts: int = 0
    restart_times: list[AwareDatetime] = Field(
        default_factory=list, sa_column=Column(TypedJSON(list[AwareDatetime]), nullable=False)
    )
    last_restore_step: int | None = None
    no_progress_streak: int = 0
    last_error: str = ""
    same_error_streak: int = 0
    detail: str = Field(default="", description="why the job failed or is held")
    master_port: int = 0
    master_addr: str = Field(
        default="",
        sa_column=Column(String(255), nullable=False, server_default=""),
        description="the rendezvous host of the current launch",
    )
    max_fence: int = Field(default=0, description="highest fencing token that has written to this job")
    backend: str = Field(
        default="agents",
        sa_column=Column(String(200), nullable=False, server_default="agents"),
        description="the compute backend that runs the job (agents, slurm, or a plugged-in one's name)",
    )
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    updated_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)

    def job_spec(self) -> JobCreate:
        """The spec the job was submitted with, validated once per row instance (again only when `spec` is replaced)."""
        cached: tuple[dict[str, Any], JobCreate] | None = self.__dict__.get(_SPEC_CACHE)
        if cached is None or cached[0] is not self.spec:
            cached = (self.spec, JobCreate.model_validate(self.spec))
            self.__dict__[_SPEC_CACHE] = cached
        return cached[1]

    @property
    def labels(self) -> dict[str, str]:
        """The labels of the spec (checked when the job was submitted); none for a job from before labels."""
        return dict(self.job_spec().labels)

    def nodes(self) -> list[str]:
        """The distinct nodes of the job's placement, in rank order."""
        return list(dict.fromkeys(r.node_id for r in self.placement))


class JobLabel(SQLModel, table=True):
    """One label of a job, kept beside its spec so that filtering jobs by label is an index lookup."""

    __tablename__ = "job_label"
    __table_args__ = (Index("ix_job_label_key_value", "key", "value"),)

    job_id: str = Field(foreign_key="job.id", primary_key=True, ondelete="CASCADE")
    key: str = Field(primary_key=True, max_length=MAX_PREFIX + 1 + MAX_NAME)
    value: str = Field(max_length=MAX_VALUE)


class JobPublic(JobBase):
    """A job as the API shows it."""

    id: str
    state: JobState
    restart_epoch: int
    restarts: int
    detail: str
    placement: list[RankAssignment]
    labels: dict[str, str]
    spec: dict[str, Any]
    backend: str = Field(description="the compute backend that runs the job: agents, slurm, ...")
    created_at: datetime
    updated_at: datetime


class JobsPublic(SQLModel):
    """A page of jobs."""

    data: list[JobPublic]
    count: int
