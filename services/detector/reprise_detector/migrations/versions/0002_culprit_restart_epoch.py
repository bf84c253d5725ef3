"""The launch an incident's culprit rank belonged to (`incident.culprit_restart_epoch`), from its `rank.exited`.

The orchestrator reads it on the incident's `culprit.restart_epoch`: an incident about a rank of an epoch a recovery
already replaced belongs to that recovery, however late it was noticed. Incidents stored before have none.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add incident.culprit_restart_epoch."""
    with op.batch_alter_table("incident") as batch:
        batch.add_column(sa.Column("culprit_restart_epoch", sa.Integer(), nullable=True))


def downgrade() -> None:
    """Drop it."""
    with op.batch_alter_table("incident") as batch:
        batch.drop_column("culprit_restart_epoch")
