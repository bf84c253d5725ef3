"""Incidents as the detector publishes them, for tests: a rank exit by default, any field overridable."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from reprise_common.clock import utcnow
from reprise_common.events import Category, Culprit, IncidentChange, RecommendedAction, Severity


def incident(**overrides: Any) -> IncidentChange:
    """An opened incident blaming rank 3 on node-2 of job-1 for exiting; overrides replace any field."""
    fields: dict[str, Any] = {
        "source": "detector",
        "change": "opened",
        "incident_id": "inc-1",
        "job_id": "job-1",
        "category": Category.APPLICATION,
        "severity": Severity.CRITICAL,
        "root_cause": "rank 3 exited with exit code 1",
        "culprit": Culprit(node_id="node-2", rank=3, exit_code=1),
        "recommended_action": RecommendedAction.RESTART_JOB,
        "first_symptom_at": utcnow(),
    }
    return IncidentChange(**(fields | overrides))


def gpu_fault(*, node_id: str, rank: int, at: datetime | None = None, **overrides: Any) -> IncidentChange:
    """An opened XID 79 incident on GPU 0 of `node_id`, whose recommended action excludes the node."""
    return incident(
        category=Category.GPU_HARDWARE,
        root_cause="XID 79 on GPU 0: GPU has fallen off the bus",
        culprit=Culprit(node_id=node_id, gpu=0, rank=rank),
        recommended_action=RecommendedAction.RESTART_EXCLUDE_NODE,
        first_symptom_at=at or utcnow(),
        **overrides,
    )
