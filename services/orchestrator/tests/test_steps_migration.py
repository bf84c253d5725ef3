"""Migration 0003 moves each recovery's steps from the JSON list of revision 0002 into rows of `recovery_step`, read
back as the same typed records, and downgrade puts them back; on SQLite and PostgreSQL."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Engine
from sqlmodel import Session

from reprise_common.db import make_engine
from reprise_orchestrator import schema
from reprise_orchestrator.recoveries import service
from reprise_orchestrator.recoveries.records import Launched, Placed, Then, incident_of
from reprise_orchestrator.recoveries.states import RecoveryStep

from . import incidents

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def _at(seconds: float) -> str:
    return (T0 + timedelta(seconds=seconds)).isoformat()


INCIDENT = incidents.gpu_fault(node_id="n-2", rank=1, at=T0)
STORED = [  # as revision 0002 kept them: ISO times, data by key
    {"step": "detected", "attempt": 1, "started_at": _at(0), "ended_at": _at(0.1),
     "data": INCIDENT.model_dump(mode="json")},
    {"step": "locked", "attempt": 1, "started_at": _at(0.1), "ended_at": _at(0.2), "data": {"baseline": {}}},
    {"step": "placing", "attempt": 1, "started_at": _at(0.3), "ended_at": _at(0.4),
     "data": {"decision": "spares", "nodes": ["n-1", "s-1"], "replaced": {"n-2": "s-1"}}},
    {"step": "launching", "attempt": 1, "started_at": _at(0.5), "ended_at": None, "data": {}},
]  # fmt: skip


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    """The orchestrator's tables at revision 0002 with one job and one recovery of four steps, then upgraded."""
    found = make_engine(database_url)
    schema.upgrade(found, "0002")
    with found.begin() as connection:
        spec = {"name": "j", "node_count": 2, "command": ["true"]}
        connection.execute(
            text(
                "INSERT INTO job (id, name, ranks_per_node, state, spec, placement, restart_epoch, restarts, "
                "restart_times, no_progress_streak, last_error, same_error_streak, detail, master_port, max_fence, "
                "created_at, updated_at) VALUES ('job-1', 'j', 1, 'RECOVERING', :spec, '[]', 0, 0, '[]', 0, '', 0, "
                "'', 0, 1, :now, :now)"
            ),
            {"spec": json.dumps(spec), "now": T0},
        )
        connection.execute(
            text(
                "INSERT INTO recovery (id, job_id, incident_id, attached_incidents, fence, owner, step, steps, "
                "attempt, detail, started_at) VALUES ('rec-1', 'job-1', 'inc-1', '[]', 1, 'o', 'LAUNCHING', :steps, "
                "1, '', :now)"
            ),
            {"steps": json.dumps(STORED), "now": T0},
        )
    schema.upgrade(found)
    yield found
    found.dispose()


def test_stored_steps_become_rows_read_back_as_typed_records_and_go_back_on_downgrade(engine: Engine) -> None:
    with Session(engine) as session:
        records = service.records(session, recovery_id="rec-1")
    assert [r.step for r in records] == [RecoveryStep.DETECTED, RecoveryStep.LOCKED, RecoveryStep.PLACING,
                                         RecoveryStep.LAUNCHING]  # fmt: skip
    assert incident_of(records) == INCIDENT
    placed = records[2].data
    assert isinstance(placed, Placed) and placed.replaced == {"n-2": "s-1"}
    assert isinstance(records[3].data, Launched) and records[3].ended_at is None and records[3].then is Then.NEXT
    assert records[1].started_at == T0 + timedelta(seconds=0.1)

    schema.downgrade(engine, "0002")
    with engine.connect() as connection:
        stored = connection.execute(text("SELECT steps FROM recovery WHERE id = 'rec-1'")).scalar_one()
    steps = json.loads(stored) if isinstance(stored, str) else stored
    assert [s["step"] for s in steps] == [s["step"] for s in STORED]
    assert [datetime.fromisoformat(s["started_at"]) for s in steps] == [datetime.fromisoformat(s["started_at"])
                                                                       for s in STORED]  # fmt: skip
    assert steps[2]["data"]["replaced"] == {"n-2": "s-1"}
