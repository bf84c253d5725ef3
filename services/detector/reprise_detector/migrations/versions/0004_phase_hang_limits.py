"""A job's own hang limits for its evaluation and data-loading phases (`hangpolicy.evaluating_s`, `loading_data_s`).

Policies stored before keep the detector's defaults for both.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add the two columns."""
    with op.batch_alter_table("hangpolicy") as batch:
        batch.add_column(sa.Column("evaluating_s", sa.Float(), nullable=True))
        batch.add_column(sa.Column("loading_data_s", sa.Float(), nullable=True))


def downgrade() -> None:
    """Drop them."""
    with op.batch_alter_table("hangpolicy") as batch:
        batch.drop_column("loading_data_s")
        batch.drop_column("evaluating_s")
