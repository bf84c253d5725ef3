"""A recovery's steps as rows of their own, what a running recovery learned of its incident, and the nodes a recovery
reserved.

`recovery_step` holds one row per step (numbered by `seq`; `recovery.seq` is the newest): a step begins with an
insert and ends with an update of its row, where every step used to rewrite the whole list in `recovery.steps`,
which is copied over and dropped. `recovery.learned` holds the newest version of a recovery's incident (an `updated`
change that knows more than the plan did). `job.reserved_nodes` holds the nodes a running recovery placed its job on
before its launch; other placements keep off them. `job.master_addr` holds the rendezvous host of its launch, so a new
rendezvous port is chosen among the jobs whose master shares that host without reading every job's placement (a job
launched before counts on every host until its next launch).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value  # JSON is text on SQLite, parsed on PostgreSQL


def upgrade() -> None:
    """Create recovery_step with every stored step, add recovery.seq, recovery.learned and job.reserved_nodes.

    The stored steps are read first and recovery is altered before recovery_step exists: on SQLite, altering a table
    copies it and drops the old one, which would delete (cascade) the step rows of every recovery.
    """
    bind = op.get_bind()
    rows, newest = [], {}
    for recovery_id, stored in bind.execute(sa.text("SELECT id, steps FROM recovery")).all():
        entries = _json(stored) or []
        newest[recovery_id] = max(len(entries) - 1, 0)
        for seq, entry in enumerate(entries):
            rows.append(
                {
                    "recovery_id": recovery_id,
                    "seq": seq,
                    "step": entry["step"],
                    "attempt": entry.get("attempt", 1),
                    "started_at": _parse(entry["started_at"]),
                    "ended_at": _parse(entry.get("ended_at")),
                    "then": entry.get("then", "next"),
                    "outcome": entry.get("outcome"),
                    "data": entry.get("data") or {},
                }
            )
    with op.batch_alter_table("recovery") as batch:
        batch.add_column(sa.Column("seq", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("learned", sa.JSON(), nullable=True))
        batch.drop_column("steps")
    for recovery_id, seq in newest.items():
        bind.execute(sa.text("UPDATE recovery SET seq = :seq WHERE id = :id"), {"seq": seq, "id": recovery_id})
    steps = op.create_table(
        "recovery_step",
        sa.Column("recovery_id", sa.String(), sa.ForeignKey("recovery.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("seq", sa.Integer(), primary_key=True),
        sa.Column("step", sa.String(length=32), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("then", sa.String(length=16), nullable=False),
        sa.Column("outcome", sa.String(length=64), nullable=True),
        sa.Column("data", sa.JSON(), nullable=False),
    )
    if rows:
        op.bulk_insert(steps, rows)
    with op.batch_alter_table("job") as batch:
        batch.add_column(sa.Column("reserved_nodes", sa.JSON(), nullable=False, server_default="[]"))
        batch.add_column(sa.Column("master_addr", sa.String(length=255), nullable=False, server_default=""))


def downgrade() -> None:
    """Put every recovery's steps back into recovery.steps, then drop what upgrade added."""
    bind = op.get_bind()
    by_recovery: dict[str, list[dict[str, Any]]] = {}
    query = 'SELECT recovery_id, step, attempt, started_at, ended_at, "then", outcome, data FROM recovery_step'
    for recovery_id, step, attempt, started, ended, then, outcome, data in bind.execute(
        sa.text(query + " ORDER BY recovery_id, seq")
    ).all():
        entry = {"step": step, "attempt": attempt, "started_at": _iso(started), "ended_at": _iso(ended),
                 "then": then, "outcome": outcome, "data": _json(data)}  # fmt: skip
        by_recovery.setdefault(recovery_id, []).append(entry)
    op.drop_table("recovery_step")
    with op.batch_alter_table("job") as batch:
        batch.drop_column("master_addr")
        batch.drop_column("reserved_nodes")
    with op.batch_alter_table("recovery") as batch:
        batch.add_column(sa.Column("steps", sa.JSON(), nullable=False, server_default="[]"))
        batch.drop_column("learned")
        batch.drop_column("seq")
    for recovery_id, entries in by_recovery.items():
        stored = {"steps": json.dumps(entries), "id": recovery_id}
        bind.execute(sa.text("UPDATE recovery SET steps = :steps WHERE id = :id"), stored)


def _parse(value: Any) -> datetime | None:
    """A stored time as UTC-aware (ISO text in the old JSON, text or a datetime from the new table)."""
    if value is None:
        return None
    stamp = datetime.fromisoformat(value) if isinstance(value, str) else value
    return stamp.replace(tzinfo=UTC) if stamp.tzinfo is None else stamp.astimezone(UTC)


def _iso(value: Any) -> str | None:
    stamp = _parse(value)
    return stamp.isoformat() if stamp is not None else None
