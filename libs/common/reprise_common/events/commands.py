"""Commands to one agent (request/reply, not events): ping, launch, stop, prepare standbys; the agent's replies are in
replies.py."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    AwareDatetime,
    ConfigDict,
    Field,
    NonNegativeInt,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from reprise_common.clock import utcnow
from reprise_common.events.base import Wire, malformed
from reprise_common.events.checkpoints import RESUME_FILES_MAX, CheckpointWatch, ResumeFile
from reprise_common.events.containers import ContainerSpec
from reprise_common.events.jobs import RankAssignment
from reprise_common.events.symptoms import NumericWatch


class CommandAction(StrEnum):
    """What a command asks an agent to do."""

    PING = "ping"
    LAUNCH = "launch"
    STOP = "stop"
    PREPARE_STANDBYS = "prepare_standbys"
    CAPTURE_STACKS = "capture_stacks"


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
    container: ContainerSpec | None = Field(
        default=None, description="run each rank in a container of this image (docs/containers.md); None: as processes"
    )


class StackCapture(Wire):
    """Capture the ranks' Python stacks for an incident (a hang's), within a bound."""

    incident_id: str = Field(min_length=1, max_length=128)
    within_s: float = Field(default=2.0, gt=0, le=10, description="the longest the capture may hold the stop")


class StopArgs(Wire):
    """How an agent stops a job's ranks on its node: SIGTERM, then SIGKILL after the grace period."""

    grace_s: float = Field(default=5.0, gt=0, le=3600)
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


class StandbyOrder(StrEnum):
    """What a spare's agent does with a containerized job's standbys."""

    KEEP = "keep"  # start them (or keep them) and hold them for `hold_s`
    DROP = "drop"  # remove them: the job ended, or will not move here


STANDBY_HOLD_MAX_S = 86_400.0


class PrepareStandbysArgs(Wire):
    """A containerized job a spare may take ranks of: what its agent's standby containers are made from, as a
    launch of the job would make its ranks' (docs/containers.md); a drop needs nothing but the job. Unknown fields are
    refused."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    order: StandbyOrder = StandbyOrder.KEEP
    container: ContainerSpec | None = None
    command: list[str] = Field(
        default_factory=list, max_length=4096, description="the job's training command, argv style"
    )
    env: dict[str, str] = Field(
        default_factory=dict, max_length=4096, description="the job's extra environment for every rank"
    )
    cwd: str | None = Field(default=None, max_length=4096)
    checkpoints: CheckpointWatch | None = None
    ranks_per_node: int = Field(
        default=1,
        ge=1,
        le=64,
        description="the most ranks of the job one node runs: a spare keeps no more standbys",
    )
    hold_s: float = Field(
        default=3600.0, gt=0, le=STANDBY_HOLD_MAX_S, description="how long they wait with no rank of the job here"
    )

    @model_validator(mode="after")
    def _keep_names_the_job(self) -> PrepareStandbysArgs:
        if self.order is StandbyOrder.KEEP and (self.container is None or not self.command):
            raise ValueError("container and command: required to keep standbys (only a drop goes without them)")
        return self


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


class PrepareStandbysCommand(AgentCommand):
    """Keep (or drop) standby containers of a containerized job on this node, a spare its ranks may move to."""

    action: Literal[CommandAction.PREPARE_STANDBYS] = CommandAction.PREPARE_STANDBYS
    args: PrepareStandbysArgs


class CaptureStacksCommand(AgentCommand):
    """Capture the Python stacks of the job's live ranks on this node, once per incident, and leave them running.
    Sent to every node of a hang before any of them is told to stop: a rank stopped on one node would end its peers'
    collective on the others, and their stacks would show that end instead of the hang."""

    action: Literal[CommandAction.CAPTURE_STACKS] = CommandAction.CAPTURE_STACKS
    args: StackCapture


Command = PingCommand | LaunchCommand | StopCommand | PrepareStandbysCommand | CaptureStacksCommand
AnyCommand = Annotated[Command, Field(discriminator="action")]
_ANY_COMMAND: TypeAdapter[Command] = TypeAdapter(AnyCommand)


def parse_command(data: bytes) -> Command:
    """Parse a command by its ``action``; raises MalformedEventError with a one-line reason."""
    try:
        return _ANY_COMMAND.validate_json(data)
    except ValidationError as exc:
        raise malformed(exc, "command") from exc
