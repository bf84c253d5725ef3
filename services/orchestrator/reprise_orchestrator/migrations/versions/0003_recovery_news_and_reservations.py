"""What a running recovery learned of its incident, and the nodes a recovery reserved, as columns.

`recovery.learned` holds the newest version of a recovery's incident (an `updated` change that knows more than the
plan did), written by whichever replica consumed it and read by the recovery's owner. `job.reserved_nodes` holds the
nodes a running recovery placed its job on before its launch; other placements keep off them. They were read from
the recoveries' step data before.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add recovery.learned and job.reserved_nodes (an empty list for stored jobs)."""
    with op.batch_alter_table("recovery") as batch:
        batch.add_column(sa.Column("learned", sa.JSON(), nullable=True))
    with op.batch_alter_table("job") as batch:
        batch.add_column(sa.Column("reserved_nodes", sa.JSON(), nullable=False, server_default="[]"))


def downgrade() -> None:
    """Drop both columns."""
    with op.batch_alter_table("job") as batch:
        batch.drop_column("reserved_nodes")
    with op.batch_alter_table("recovery") as batch:
        batch.drop_column("learned")
