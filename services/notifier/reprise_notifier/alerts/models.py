"""What an alert says, and the incidents the notifier remembers so a recovery alert can name its root cause."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field
from sqlalchemy import BigInteger, String, Text
from sqlmodel import Field as SQLField
from sqlmodel import SQLModel

from reprise_common.db import UTCDateTime
from reprise_common.events import (
    Category,
    Culprit,
    IncidentChangeKind,
    RecommendedAction,
    RecoveryChangeKind,
    Severity,
    StepOrBlank,
)


class AlertKind(StrEnum):
    """The lifecycle point an alert announces; routes choose kinds, loud ones by default."""

    OPENED = "opened"  # incident opened
    UPDATED = "updated"  # incident updated (a new symptom, a deeper root cause): quiet
    RESOLVED = "resolved"  # incident resolved by hand: quiet
    RECOVERY_STARTED = "recovery_started"  # quiet
    RECOVERY_STEP = "recovery_step"  # quiet
    RECOVERED = "recovered"  # recovery succeeded: training runs again
    FAILED = "failed"  # recovery failed: a person must act


LOUD_KINDS: tuple[AlertKind, ...] = (AlertKind.OPENED, AlertKind.RECOVERED, AlertKind.FAILED)

INCIDENT_KINDS: dict[IncidentChangeKind, AlertKind] = {
    IncidentChangeKind.OPENED: AlertKind.OPENED,
    IncidentChangeKind.UPDATED: AlertKind.UPDATED,
    IncidentChangeKind.RESOLVED: AlertKind.RESOLVED,
}
RECOVERY_KINDS: dict[RecoveryChangeKind, AlertKind] = {
    RecoveryChangeKind.STARTED: AlertKind.RECOVERY_STARTED,
    RecoveryChangeKind.STEP: AlertKind.RECOVERY_STEP,
    RecoveryChangeKind.SUCCEEDED: AlertKind.RECOVERED,
    RecoveryChangeKind.FAILED: AlertKind.FAILED,
}


class Alert(BaseModel):
    """One alert, as stored in the outbox and rendered for each destination; newer fields are ignored on read."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    event_id: str
    kind: AlertKind
    job_id: str
    occurred_at: AwareDatetime
    incident_id: str | None = None
    recovery_id: str | None = None
    category: Category | None = None
    severity: Severity | None = None
    root_cause: str = ""
    culprit: Culprit = Field(default_factory=Culprit)
    recommended_action: RecommendedAction | None = None
    action_taken: str = ""
    step: StepOrBlank = Field(default=None, description="the recovery's step, for a recovery alert")
    symptom_count: int | None = None
    first_symptom_at: AwareDatetime | None = None
    time_to_recover_s: float | None = None
    labels: dict[str, str] = Field(default_factory=dict, description="the job's labels, as the event carried them")
    link: str = Field(default="", description="the incident on the dashboard, when REPRISE_DASHBOARD_URL is set")
    stacks_link: str = Field(default="", description="the hung ranks' stacks on the incident's page, for a hang")


Item = tuple[str, Alert]  # (delivery id, alert): what one send renders


class IncidentRecord(SQLModel, table=True):
    """The latest known state of an incident, from its IncidentChange events."""

    __tablename__ = "notifier_incident"

    id: str = SQLField(primary_key=True, max_length=128)
    job_id: str = SQLField(max_length=64, index=True)
    state: str = SQLField(max_length=16)
    category: Category = SQLField(sa_type=String(32))
    severity: Severity = SQLField(sa_type=String(16))
    root_cause: str = SQLField(sa_type=Text)
    culprit_node_id: str | None = SQLField(default=None, max_length=64)
    culprit_gpu: int | None = None
    culprit_rank: int | None = None
    culprit_exit_code: int | None = None
    culprit_restart_epoch: int | None = None
    culprit_fault_step: int | None = SQLField(default=None, sa_type=BigInteger)
    recommended_action: RecommendedAction = SQLField(sa_type=String(32))
    symptom_count: int = 0
    first_symptom_at: datetime = SQLField(sa_type=UTCDateTime)
    updated_at: datetime = SQLField(sa_type=UTCDateTime, description="time of the newest event applied")

    def culprit(self) -> Culprit:
        """The culprit as the events carry it."""
        return Culprit(
            node_id=self.culprit_node_id,
            gpu=self.culprit_gpu,
            rank=self.culprit_rank,
            exit_code=self.culprit_exit_code,
            restart_epoch=self.culprit_restart_epoch,
            fault_step=self.culprit_fault_step,
        )

    def remember_culprit(self, culprit: Culprit) -> None:
        """Keep every field of the incident's culprit."""
        self.culprit_node_id = culprit.node_id
        self.culprit_gpu = culprit.gpu
        self.culprit_rank = culprit.rank
        self.culprit_exit_code = culprit.exit_code
        self.culprit_restart_epoch = culprit.restart_epoch
        self.culprit_fault_step = culprit.fault_step
