"""Incidents and their symptoms, node faults, quarantine recommendations, per-job hang policies.

The baseline: exactly the tables the detector created with create_all before it had migrations, so a database made
then is stamped at this revision and upgraded from it.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_INDEXED = {
    "incident": ("category", "culprit_node_id", "job_id", "state"),
    "nodefault": ("node_id", "time"),
    "quarantine": ("node_id",),
    "symptom": ("incident_id", "job_id", "node_id"),
}


def _time(name: str, *, nullable: bool = False) -> sa.Column[object]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def _id(length: int = 32) -> sa.Column[str]:
    return sa.Column("id", sa.String(length), primary_key=True)


def upgrade() -> None:
    """Create every table of the detector."""
    op.create_table(
        "hangpolicy",
        sa.Column("job_id", sa.String(64), primary_key=True),
        sa.Column("timeout_s", sa.Float(), nullable=True),
        sa.Column("floor_s", sa.Float(), nullable=True),
        sa.Column("k", sa.Float(), nullable=True),
        sa.Column("startup_s", sa.Float(), nullable=True),
        sa.Column("checkpointing_s", sa.Float(), nullable=True),
        _time("updated_at"),
    )
    op.create_table(
        "incident",
        _id(),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("category", sa.String(32), nullable=False),
        sa.Column("severity", sa.String(16), nullable=False),
        sa.Column("root_cause", sa.Text(), nullable=False),
        sa.Column("culprit_node_id", sa.String(64), nullable=True),
        sa.Column("culprit_gpu", sa.Integer(), nullable=True),
        sa.Column("culprit_rank", sa.Integer(), nullable=True),
        sa.Column("culprit_exit_code", sa.Integer(), nullable=True),
        sa.Column("recommended_action", sa.String(32), nullable=False),
        sa.Column("symptom_count", sa.Integer(), nullable=False),
        _time("first_symptom_at"),
        _time("opened_at"),
        _time("updated_at"),
        _time("resolved_at", nullable=True),
        _time("root_cause_at", nullable=True),
        _time("acknowledged_at", nullable=True),
    )
    op.create_table(
        "nodefault",
        _id(),
        sa.Column("node_id", sa.String(64), nullable=False),
        sa.Column("event_id", sa.String(128), nullable=False),
        sa.Column("job_key", sa.String(64), nullable=False),
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("xid", sa.Integer(), nullable=True),
        sa.Column("gpu", sa.Integer(), nullable=True),
        sa.Column("category", sa.String(32), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        _time("time"),
        sa.UniqueConstraint("event_id", "job_key", name="uq_nodefault_event_job"),
    )
    op.create_table(
        "quarantine",
        _id(128),
        sa.Column("node_id", sa.String(64), nullable=False),
        sa.Column("reason", sa.String(32), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.Column("fault_count", sa.Integer(), nullable=False),
        sa.Column("job_ids", sa.Text(), nullable=False),
        _time("first_fault_at"),
        _time("last_fault_at"),
        _time("recommended_at"),
        sa.Column("published", sa.Boolean(), nullable=False),
    )
    op.create_table(
        "symptom",
        _id(),
        sa.Column("event_id", sa.String(128), nullable=False),
        sa.Column("incident_id", sa.String(), sa.ForeignKey("incident.id"), nullable=True),
        sa.Column("node_id", sa.String(64), nullable=False),
        sa.Column("job_id", sa.String(64), nullable=True),
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("gpu", sa.Integer(), nullable=True),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("detail", sa.Text(), nullable=False),
        _time("time"),
        _time("received_at"),
        sa.Column("category", sa.String(32), nullable=False),
        sa.Column("severity", sa.String(16), nullable=False),
        sa.Column("recommended_action", sa.String(32), nullable=False),
        sa.Column("root_cause_grade", sa.Boolean(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("decision", sa.String(16), nullable=True),
        sa.Column("change", sa.String(16), nullable=True),
        sa.Column("change_seq", sa.Integer(), nullable=True),
        sa.UniqueConstraint("event_id", "job_id", name="uq_symptom_event_job"),
    )
    for table, columns in _INDEXED.items():
        for column in columns:
            op.create_index(f"ix_{table}_{column}", table, [column])
    # NULLs are distinct in a unique constraint: a symptom that affects no placed job needs its own index.
    unplaced = sa.text("job_id IS NULL")
    op.create_index(
        "uq_symptom_event_unplaced",
        "symptom",
        ["event_id"],
        unique=True,
        sqlite_where=unplaced,
        postgresql_where=unplaced,
    )


def downgrade() -> None:
    """Drop every table of the detector (their indexes go with them)."""
    for table in ("symptom", "quarantine", "nodefault", "incident", "hangpolicy"):
        op.drop_table(table)
