"""What an alert says, and the incidents the notifier remembers so a recovery alert can name its root cause."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field
from sqlalchemy import String, Text
from sqlmodel import Field as SQLField
from sqlmodel import SQLModel

from reprise_common.db import UTCDateTime
from reprise_common.events import Category, Culprit, RecommendedAction, Severity


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

INCIDENT_KINDS: dict[str, AlertKind] = {
    "opened": AlertKind.OPENED,
    "updated": AlertKind.UPDATED,
    "resolved": AlertKind.RESOLVED,
}
RECOVERY_KINDS: dict[str, AlertKind] = {
    "started": AlertKind.RECOVERY_STARTED,
    "step": AlertKind.RECOVERY_STEP,
    "succeeded": AlertKind.RECOVERED,
    "failed": AlertKind.FAILED,
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
    step: str = ""
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
    recommended_action: RecommendedAction = SQLField(sa_type=String(32))
    symptom_count: int = 0
    first_symptom_at: datetime = SQLField(sa_type=UTCDateTime)
    updated_at: datetime = SQLField(sa_type=UTCDateTime, description="time of the newest event applied")

    def culprit(self) -> Culprit:
        """The culprit as the events carry it."""
        return Culprit(node_id=self.culprit_node_id, gpu=self.culprit_gpu, rank=self.culprit_rank)
