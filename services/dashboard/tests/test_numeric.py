"""A numeric fault's incident page says which metric tripped, how, at which step, and what the restore rolls back
before; other incidents say nothing of it. The detector is served over real HTTP in its own shape."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

# `IncidentPage` (tests/conftest.py) is passed in as a fixture; conftest is not importable here.
IncidentPage = Callable[[dict[str, Any]], Awaitable[str]]
HOSTILE = "<img src=x onerror=alert(1)>"


def _incident(**fields: Any) -> dict[str, Any]:
    return {
        "id": "inc-n1", "job_id": "job-1", "state": "open", "category": "numeric", "severity": "critical",
        "root_cause": "numeric fault on rank 1 (node-2): loss became NaN at step 57 (last fine at step 56)",
        "culprit_node_id": "node-2", "culprit_gpu": 0, "culprit_rank": 1, "culprit_exit_code": None,
        "culprit_restart_epoch": 0, "culprit_fault_step": 57, "recommended_action": "restart_job",
        "symptom_count": 2, "first_symptom_at": "2026-01-01T12:00:00Z", "opened_at": "2026-01-01T12:00:01Z",
        "updated_at": "2026-01-01T12:00:01Z", "resolved_at": None, "root_cause_at": "2026-01-01T12:00:00Z",
        "acknowledged_at": None, **fields,
    }  # fmt: skip


def _symptom(kind: str, detail: str, rank: int) -> dict[str, Any]:
    return {
        "id": f"s-{rank}", "event_id": f"e-{rank}", "incident_id": "inc-n1", "node_id": f"node-{rank + 1}",
        "job_id": "job-1", "kind": kind, "gpu": 0, "rank": rank, "detail": detail, "time": "2026-01-01T12:00:00Z",
        "received_at": "2026-01-01T12:00:00Z", "category": "numeric", "severity": "critical",
        "recommended_action": "restart_job", "root_cause_grade": True, "reason": detail, "decision": "open",
    }  # fmt: skip


async def test_a_numeric_incident_shows_the_metric_that_tripped_and_the_step_it_rolls_back_before(
    incident_page: IncidentPage,
) -> None:
    symptoms = [  # the culprit's (rank 1) is not the first listed
        _symptom("rank.numeric", "loss became NaN at step 58 (last fine at step 57)", 0),
        _symptom("rank.numeric", f"loss became NaN at step 57 (last fine at step 56) {HOSTILE}", 1),
    ]
    page = await incident_page(_incident(symptoms=symptoms))
    assert '<dd id="numeric-fault">loss became NaN at step 57 (last fine at step 56) &lt;img' in page
    assert HOSTILE not in page  # what a script named its metric is escaped
    assert "<dt>Rolled back before</dt><dd>step 57 (the restore takes an older checkpoint)</dd>" in page


async def test_other_incidents_say_nothing_of_numeric_faults(
    incident_page: IncidentPage,
) -> None:
    for detail in (_incident(category="gpu_hardware", culprit_fault_step=None, symptoms=[]), _incident(symptoms=[])):
        page = await incident_page({**detail, "root_cause": "XID 79"})
        shown = "Rolled back before" in page
        assert shown is (detail["culprit_fault_step"] is not None)
    older = _incident(category="application", symptoms=[])  # a detector from before numeric faults: no such field
    del older["culprit_fault_step"]
    assert "Rolled back before" not in await incident_page(older)
