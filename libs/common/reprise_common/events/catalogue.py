"""Every event type by its ``type`` name: the discriminated union, the list of types, and the one parser."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, TypeAdapter, ValidationError

from reprise_common.events.base import DeadLetter, Event, malformed
from reprise_common.events.checkpoints import CheckpointChange, CheckpointSaved
from reprise_common.events.incidents import IncidentChange, NodeQuarantineRecommended
from reprise_common.events.jobs import ComputeSignal, JobPlacement, RecoveryChange
from reprise_common.events.reports import AgentLifecycle, NodeReport
from reprise_common.events.symptoms import (
    DependencyFailed,
    GpuLost,
    GpuXid,
    RankExited,
    RankNumeric,
    RankParked,
    RankStacks,
)

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
