"""The incidents the notifier has seen, the delivery outbox, dead letters, and each destination's pacing state.

The baseline: exactly the tables the notifier created with create_all before it had migrations, so a database made
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


def upgrade() -> None:
    """Create every table of the notifier."""
    op.create_table(
        "notifier_dead_letter",
        sa.Column("destination", sa.String(length=64), nullable=False),
        sa.Column("event_id", sa.String(length=128), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("reason", sa.String(length=16), nullable=False),
        sa.Column("status", sa.Integer(), nullable=True),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.Column("dead_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("notifier_dead_letter", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_notifier_dead_letter_destination"), ["destination"], unique=False)

    op.create_table(
        "notifier_delivery",
        sa.Column("event_id", sa.String(length=128), nullable=False),
        sa.Column("destination", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("incident_id", sa.String(length=128), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("occurred_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_attempt_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("sent_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_status", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=False),
        sa.Column("message_id", sa.String(length=32), nullable=True),
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("payload", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("notifier_delivery", schema=None) as batch_op:
        batch_op.create_index("ix_notifier_delivery_due", ["destination", "state", "created_at"], unique=False)
        batch_op.create_index(batch_op.f("ix_notifier_delivery_job_id"), ["job_id"], unique=False)

    op.create_table(
        "notifier_destination",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("next_send_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("wait_reason", sa.String(length=16), nullable=True),
        sa.Column("failures", sa.Integer(), nullable=False),
        sa.Column("last_status", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    op.create_table(
        "notifier_incident",
        sa.Column("id", sa.String(length=128), nullable=False),
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("category", sa.String(length=32), nullable=False),
        sa.Column("severity", sa.String(length=16), nullable=False),
        sa.Column("root_cause", sa.Text(), nullable=False),
        sa.Column("culprit_node_id", sa.String(length=64), nullable=True),
        sa.Column("culprit_gpu", sa.Integer(), nullable=True),
        sa.Column("culprit_rank", sa.Integer(), nullable=True),
        sa.Column("recommended_action", sa.String(length=32), nullable=False),
        sa.Column("symptom_count", sa.Integer(), nullable=False),
        sa.Column("first_symptom_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("notifier_incident", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_notifier_incident_job_id"), ["job_id"], unique=False)


def downgrade() -> None:
    """Drop every table of the notifier."""
    with op.batch_alter_table("notifier_incident", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_notifier_incident_job_id"))

    op.drop_table("notifier_incident")
    op.drop_table("notifier_destination")
    with op.batch_alter_table("notifier_delivery", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_notifier_delivery_job_id"))
        batch_op.drop_index("ix_notifier_delivery_due")

    op.drop_table("notifier_delivery")
    with op.batch_alter_table("notifier_dead_letter", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_notifier_dead_letter_destination"))

    op.drop_table("notifier_dead_letter")
