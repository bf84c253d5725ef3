"""What the dashboard reads of the orchestrator's jobs and recoveries: the fields it computes with, parsed at the edge.

Readers ignore fields they do not know, so a newer orchestrator does not break the page.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from reprise_common.events import RecoveryOutcome, RecoveryStep

ENDED_STATES = frozenset({"failed", "cancelled"})  # a job in one of these trains no more: its wall time stops
FINISHED_STEPS = frozenset({RecoveryStep.RUNNING, RecoveryStep.FAILED, RecoveryStep.HELD})


class Record(BaseModel):
    """Base of the records read from a service."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class StepRecord(Record):
    """One step of a recovery with its start and end."""

    step: RecoveryStep
    attempt: int = 1
    started_at: AwareDatetime
    ended_at: AwareDatetime | None = None
    data: dict[str, Any] = Field(default_factory=dict)

    def seconds(self, now: datetime) -> float:
        """How long the step took, or has taken so far."""
        return max(0.0, ((self.ended_at or now) - self.started_at).total_seconds())


class RecoveryRecord(Record):
    """One recovery of a job as GET /v1/jobs/{id}/recoveries gives it."""

    id: str
    job_id: str
    incident_id: str | None = None
    attached_incidents: list[str] = Field(default_factory=list)
    fence: int = 0
    step: RecoveryStep
    steps: list[StepRecord] = Field(default_factory=list)
    attempt: int = 1
    outcome: RecoveryOutcome | None = None
    detail: str = ""
    started_at: AwareDatetime
    finished_at: AwareDatetime | None = None

    def restart_path(self) -> dict[str, Any] | None:
        """The latest stop's choice of path (restart_mode, parked, why), when the orchestrator recorded one."""
        stops = [s.data for s in self.steps if s.step is RecoveryStep.STOPPING_RANKS and "restart_mode" in s.data]
        return stops[-1] if stops else None

    def resumed(self) -> dict[str, Any] | None:
        """Where the ranks took their state from, as they told the verifying step (via, step, why), when they did."""
        found = [s.data["resumed"] for s in self.steps if s.step is RecoveryStep.VERIFYING and s.data.get("resumed")]
        return found[-1] if found else None

    def restored_step(self) -> int | None:
        """The checkpoint step the restoring step handed over (None: none recorded)."""
        restoring = [s.data for s in self.steps if s.step is RecoveryStep.RESTORING and s.data.get("checkpoint")]
        return int(restoring[-1]["checkpoint"]["step"]) if restoring else None

    @property
    def recovered(self) -> bool:
        """True when the recovery got training going again."""
        return self.step is RecoveryStep.RUNNING

    @property
    def finished(self) -> bool:
        """True once the recovery ended, whatever the outcome."""
        return self.finished_at is not None or self.step in FINISHED_STEPS

    def concerns(self, incident_id: str) -> bool:
        """True when this recovery was started by, or attached, the incident."""
        return self.incident_id == incident_id or incident_id in self.attached_incidents


class JobRecord(Record):
    """A job as GET /v1/jobs gives it."""

    id: str
    name: str
    state: str
    ranks_per_node: int = 1
    restart_epoch: int = 0
    restarts: int = 0
    detail: str = ""
    placement: list[dict[str, Any]] = Field(default_factory=list)
    labels: dict[str, str] = Field(default_factory=dict)
    spec: dict[str, Any] = Field(default_factory=dict)
    created_at: AwareDatetime
    updated_at: AwareDatetime

    @property
    def ended(self) -> bool:
        """True when the job trains no more (failed or cancelled)."""
        return self.state in ENDED_STATES

    @property
    def nodes(self) -> list[str]:
        """The nodes the job's ranks run on, in rank order."""
        return list(dict.fromkeys(str(r.get("node_id", "")) for r in self.placement))

    def ranks_by_node(self) -> dict[str, list[dict[str, Any]]]:
        """The placement grouped by node, ranks in order."""
        grouped: dict[str, list[dict[str, Any]]] = {}
        for rank in sorted(self.placement, key=lambda r: int(r.get("rank", 0))):
            grouped.setdefault(str(rank.get("node_id", "")), []).append(rank)
        return grouped
