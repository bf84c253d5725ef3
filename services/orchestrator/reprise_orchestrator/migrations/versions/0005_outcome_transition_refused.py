"""The recovery outcome `transition_refused` in PostgreSQL's `outcome` type.

Migration 0001 made the type with the outcomes there were then; a recovery that ended with this later one could not
be stored on PostgreSQL. SQLite stores the enum as a string and needs nothing.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-06
"""

from __future__ import annotations

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add the value to the type (PostgreSQL only)."""
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TYPE outcome ADD VALUE IF NOT EXISTS 'TRANSITION_REFUSED'")


def downgrade() -> None:
    """Nothing: PostgreSQL cannot drop a value from an enum type, and the older code never writes it."""
