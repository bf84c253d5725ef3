"""The compute backend of each job (`job.backend`: agents, slurm, ...), shown per job by the API.

Every job before it ran on Reprise's own agents, the only backend there was.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add job.backend, "agents" for the jobs already there."""
    with op.batch_alter_table("job") as batch:
        batch.add_column(sa.Column("backend", sa.String(200), nullable=False, server_default="agents"))


def downgrade() -> None:
    """Drop job.backend."""
    with op.batch_alter_table("job") as batch:
        batch.drop_column("backend")
