"""A numeric fault's step on its incident (`incident.culprit_fault_step`), from the culprit rank's `rank.numeric`.

The orchestrator reads it on the incident's `culprit.fault_step` and restores a checkpoint older than it. Incidents
stored before have none.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add incident.culprit_fault_step."""
    with op.batch_alter_table("incident") as batch:
        batch.add_column(sa.Column("culprit_fault_step", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    """Drop it."""
    with op.batch_alter_table("incident") as batch:
        batch.drop_column("culprit_fault_step")
