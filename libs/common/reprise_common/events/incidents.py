"""The detector's verdicts: incidents with their category, severity, culprit and recommended action, and quarantines."""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Literal

from pydantic import AwareDatetime, Field

from reprise_common.events.base import Event, Wire


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


class IncidentChangeKind(StrEnum):
    """What happened to an incident."""

    OPENED = "opened"
    UPDATED = "updated"
    RESOLVED = "resolved"


class IncidentChange(Event):
    """An incident was opened, updated or resolved."""

    type: Literal["incident.change"] = "incident.change"
    change: IncidentChangeKind
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
