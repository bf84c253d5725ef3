"""Symptoms the detector derives itself from node reports and events (silence, stalled progress, slow ranks, a
rank that left early).

They are not wire events: they never leave the detector except as incidents. Each has a deterministic id built from
what it observed, so a replica that re-derives the same finding (after a restart, or a second tick) records it once.
"""

from __future__ import annotations

from typing import Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field


class Derived(BaseModel):
    """What every derived symptom carries: an idempotency id, when it was observed, and the node it points at."""

    model_config = ConfigDict(frozen=True)

    event_id: str = Field(min_length=1, max_length=128)
    time: AwareDatetime
    node_id: str


class NodeLost(Derived):
    """A node that used to report is silent for longer than the limit, or its agent's connection closed and did not
    come back within the grace (`limit_s` is the one that applied)."""

    type: Literal["node.lost"] = "node.lost"
    silent_s: float
    limit_s: float
    how: str = Field(max_length=512)  # what showed it, for the incident's reason


class NodeUnreachable(Derived):
    """A node silent past `limit_s` while its jobs' ranks on other nodes go on advancing with it: alive, its control
    plane cut off (said once a silence; never a recovery)."""

    type: Literal["node.unreachable"] = "node.unreachable"
    silent_s: float
    limit_s: float
    how: str = Field(max_length=512)


class JobHung(Derived):
    """A job's step progress stopped for longer than its limit; node_id and rank name the rank to blame."""

    type: Literal["job.hung"] = "job.hung"
    job_id: str
    rank: int
    stalled_ranks: list[int]
    lagging_ranks: list[int]
    culprit_reason: str = "stopped first"
    step: int | None
    phase: str
    stalled_s: float
    limit_s: float
    limit_reason: str


class RankStraggling(Derived):
    """A rank whose step time stayed above a factor of its job's median for several reports in a row."""

    type: Literal["rank.straggling"] = "rank.straggling"
    job_id: str
    rank: int
    step_time_s: float
    median_s: float
    reports: int


class RankExitedEarly(Derived):
    """A rank exited 0 and the rest of its job's launch did not all follow within the grace: the job is a rank short."""

    type: Literal["rank.exited_early"] = "rank.exited_early"
    job_id: str
    rank: int
    restart_epoch: int
    exited: int  # ranks of the launch that exited 0 within the grace
    world_size: int  # ranks placed
    grace_s: float


DerivedSymptom = NodeLost | NodeUnreachable | JobHung | RankStraggling | RankExitedEarly
