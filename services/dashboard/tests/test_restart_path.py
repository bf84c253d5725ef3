"""A recovery's summary on the job page says which path its restart took (in place or cold) and why, escaped."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from reprise_dashboard.jobs.models import RecoveryRecord
from reprise_dashboard.jobs.views import recovery_view
from reprise_dashboard.render import TEMPLATES

NOW = datetime(2026, 1, 1, 12, 0, 10, tzinfo=UTC)


def _recovery(stop: dict[str, Any]) -> RecoveryRecord:
    return RecoveryRecord.model_validate(
        {
            "id": "rec-1", "job_id": "job-1", "step": "running", "outcome": "recovered",
            "started_at": "2026-01-01T12:00:00Z", "finished_at": "2026-01-01T12:00:02Z",
            "steps": [
                {"step": "stopping_ranks", "started_at": "2026-01-01T12:00:00Z", "data": stop},
                {"step": "launching", "started_at": "2026-01-01T12:00:01Z", "data": {"in_place": 3}},
            ],
        }
    )  # fmt: skip


def _summary(record: RecoveryRecord) -> str:
    macros = TEMPLATES.env.get_template("_macros.html").module
    return str(macros.recovery_summary(recovery_view(record, now=NOW)))  # type: ignore[attr-defined]


def test_the_summary_says_in_place_with_the_ranks_kept_and_why() -> None:
    why = "restart_mode auto: ranks that can restart in place are parked; <b>3 parked</b>"
    page = _summary(_recovery({"restart_mode": "in_place", "parked": 3, "why": why}))
    assert 'data-restart-mode="in_place"' in page
    assert "Restart: in place (3 rank(s) kept their processes)" in page
    assert "&lt;b&gt;3 parked&lt;/b&gt;" in page and "<b>" not in page


def test_a_cold_restart_says_so_and_an_older_record_says_nothing() -> None:
    page = _summary(_recovery({"restart_mode": "cold", "parked": 0, "why": "the job's policy says restart_mode: cold"}))
    assert "Restart: cold — the job&#39;s policy says restart_mode: cold" in page
    assert "Restart:" not in _summary(_recovery({"answers": {}}))  # an orchestrator from before the choice


def _verified(resumed: dict[str, Any]) -> RecoveryRecord:
    record = _recovery({"restart_mode": "in_place", "parked": 3, "why": "auto"}).model_dump(mode="json")
    record["steps"] += [
        {"step": "restoring", "started_at": "2026-01-01T12:00:01Z", "data": {"checkpoint": {"step": 40}}},
        {"step": "verifying", "started_at": "2026-01-01T12:00:01Z", "data": {"resumed": resumed}},
    ]
    return RecoveryRecord.model_validate(record)


def test_the_summary_says_where_the_ranks_resumed_from() -> None:
    peer = _summary(_verified({"via": "peer", "step": 47, "why": "state of step 47 from rank 0"}))
    assert "Resumed at step 47 from the surviving ranks' state, 0 steps redone" in peer
    assert "(the checkpoint was at step 40)" in peer
    fallback = _summary(_verified({"via": "checkpoint", "step": None, "why": "the survivors disagree <5, 6>"}))
    assert "Resumed from the checkpoint at step 40 — the survivors disagree &lt;5, 6&gt;" in fallback
    assert "Resumed" not in _summary(_recovery({"restart_mode": "cold", "parked": 0, "why": "cold"}))
