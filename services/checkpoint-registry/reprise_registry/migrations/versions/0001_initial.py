"""Checkpoints, their files and rank reports, pins, job world sizes, and the outbox of checkpoint changes.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _time(name: str, *, nullable: bool) -> sa.Column[object]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def _owned_by_checkpoint() -> sa.Column[int]:
    return sa.Column("checkpoint_id", sa.Integer(), sa.ForeignKey("checkpoints.id", ondelete="CASCADE"), nullable=False)


def upgrade() -> None:
    """Create every table of the registry."""
    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("path", sa.String(4096), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("layout", sa.String(16), nullable=False),
        sa.Column("marker", sa.String(255), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=True),
        sa.Column("restart_epoch", sa.Integer(), nullable=False),
        sa.Column("manifest_digest", sa.String(128), nullable=True),
        sa.Column("size_bytes", sa.BigInteger(), nullable=True),
        sa.Column("file_count", sa.Integer(), nullable=True),
        sa.Column("reason", sa.String(1024), nullable=False),
        sa.Column("validated_seq", sa.Integer(), nullable=True),
        _time("created_at", nullable=False),
        _time("committed_at", nullable=True),
        _time("validated_at", nullable=True),
        _time("load_failed_at", nullable=True),
        sa.Column("load_failure", sa.String(1024), nullable=False),
        sa.UniqueConstraint("job_id", "step", name="uq_checkpoints_job_step"),
    )
    op.create_index("ix_checkpoints_job_state_step", "checkpoints", ["job_id", "state", "step"])
    op.create_table(
        "checkpoint_files",
        sa.Column("id", sa.Integer(), primary_key=True),
        _owned_by_checkpoint(),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("path", sa.String(4096), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("digest", sa.String(128), nullable=True),
        sa.Column("algorithm", sa.String(16), nullable=False),
        _time("reported_at", nullable=False),
        sa.UniqueConstraint("checkpoint_id", "path", name="uq_checkpoint_files_path"),
    )
    op.create_index("ix_checkpoint_files_checkpoint_id", "checkpoint_files", ["checkpoint_id"])
    op.create_table(
        "checkpoint_ranks",
        sa.Column("id", sa.Integer(), primary_key=True),
        _owned_by_checkpoint(),
        sa.Column("rank", sa.Integer(), nullable=False),
        _time("reported_at", nullable=False),
        sa.UniqueConstraint("checkpoint_id", "rank", name="uq_checkpoint_ranks_rank"),
    )
    op.create_index("ix_checkpoint_ranks_checkpoint_id", "checkpoint_ranks", ["checkpoint_id"])
    op.create_table(
        "checkpoint_pins",
        sa.Column("id", sa.Integer(), primary_key=True),
        _owned_by_checkpoint(),
        sa.Column("holder", sa.String(256), nullable=False),
        _time("created_at", nullable=False),
        _time("expires_at", nullable=True),
        sa.UniqueConstraint("checkpoint_id", "holder", name="uq_checkpoint_pins_holder"),
    )
    op.create_index("ix_checkpoint_pins_checkpoint_id", "checkpoint_pins", ["checkpoint_id"])
    op.create_table(
        "job_world_sizes",
        sa.Column("job_id", sa.String(64), primary_key=True),
        sa.Column("restart_epoch", sa.Integer(), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=False),
    )
    op.create_table(
        "checkpoint_events",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("checkpoint_id", sa.Integer(), nullable=False),  # no foreign key: the event outlives its row
        sa.Column("job_id", sa.String(64), nullable=False),
        sa.Column("change", sa.String(16), nullable=False),
        sa.Column("payload", sa.Text(), nullable=False),
        _time("created_at", nullable=False),
        _time("published_at", nullable=True),
    )
    op.create_index("ix_checkpoint_events_checkpoint_id", "checkpoint_events", ["checkpoint_id"])
    op.create_index("ix_checkpoint_events_published_at", "checkpoint_events", ["published_at"])


def downgrade() -> None:
    """Drop every table of the registry."""
    for table in ("checkpoint_events", "job_world_sizes", "checkpoint_pins", "checkpoint_ranks", "checkpoint_files"):
        op.drop_table(table)
    op.drop_index("ix_checkpoints_job_state_step", table_name="checkpoints")
    op.drop_table("checkpoints")
