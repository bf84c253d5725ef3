"""The whole culprit on the notifier's incident: its exit code, restart epoch and numeric fault step.

A recovery alert names the incident's culprit from this record; it kept only node, GPU and rank. Incidents stored
before have none of the three.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

COLUMNS = ("culprit_exit_code", "culprit_restart_epoch", "culprit_fault_step")


def upgrade() -> None:
    """Add notifier_incident.culprit_exit_code, culprit_restart_epoch and culprit_fault_step."""
    with op.batch_alter_table("notifier_incident") as batch:
        batch.add_column(sa.Column("culprit_exit_code", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("culprit_restart_epoch", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("culprit_fault_step", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    """Drop them."""
    with op.batch_alter_table("notifier_incident") as batch:
        for column in COLUMNS:
            batch.drop_column(column)
