"""The stacks of hung ranks (`rank_stack`) and the verdict they give on an incident (`incident.stacks_verdict`).

Incidents stored before have no stacks and an empty verdict.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add incident.stacks_verdict and the rank_stack table."""
    with op.batch_alter_table("incident") as batch:
        batch.add_column(sa.Column("stacks_verdict", sa.Text(), nullable=False, server_default=""))
    op.create_table(
        "rank_stack",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("event_id", sa.String(128), nullable=False, unique=True),
        sa.Column("incident_id", sa.String(32), sa.ForeignKey("incident.id"), nullable=False),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("node_id", sa.String(64), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("restart_epoch", sa.Integer(), nullable=True),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("proc_state", sa.String(1), nullable=False),
        sa.Column("waits_in", sa.String(256), nullable=True),
        sa.Column("error", sa.Text(), nullable=False),
        sa.Column("capture_ms", sa.Float(), nullable=False),
        sa.Column("captured_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("threads", sa.JSON(), nullable=False),
    )
    op.create_index("ix_rank_stack_incident_id", "rank_stack", ["incident_id"])


def downgrade() -> None:
    """Drop them."""
    op.drop_table("rank_stack")
    with op.batch_alter_table("incident") as batch:
        batch.drop_column("stacks_verdict")
