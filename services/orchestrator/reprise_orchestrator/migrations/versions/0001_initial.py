"""Jobs, recoveries, drills, node cordons, API keys and the audit trail.

The baseline: exactly the tables the orchestrator created with create_all before it had migrations, so a database
made then is stamped at this revision and upgraded from it.

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


# PostgreSQL keeps each Enum column's type apart from its table: dropping the table leaves it behind.
ENUM_TYPES = ("jobstate", "drillfault", "drillstate", "recoverystep", "outcome")


def upgrade() -> None:
    """Create every table of the orchestrator."""
    op.create_table(
        "apikey",
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("hash", sa.String(length=64), nullable=False),
        sa.Column("scopes", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "auditrecord",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("key_id", sa.String(), nullable=True),
        sa.Column("actor", sa.String(), nullable=False),
        sa.Column("method", sa.String(), nullable=False),
        sa.Column("path", sa.String(), nullable=False),
        sa.Column("job_id", sa.String(), nullable=True),
        sa.Column("status", sa.Integer(), nullable=False),
        sa.Column("client", sa.String(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("auditrecord", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_auditrecord_actor"), ["actor"], unique=False)
        batch_op.create_index(batch_op.f("ix_auditrecord_at"), ["at"], unique=False)
        batch_op.create_index(batch_op.f("ix_auditrecord_job_id"), ["job_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_auditrecord_key_id"), ["key_id"], unique=False)

    op.create_table(
        "drill",
        sa.Column("job_id", sa.String(length=64), nullable=False),
        sa.Column("fault", sa.Enum("KILL_RANK", "XID79", "HANG", "NODE_LOSS", name="drillfault"), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("node_id", sa.String(), nullable=False),
        sa.Column("state", sa.Enum("RUNNING", "PASSED", "MISSED", "FAILED", name="drillstate"), nullable=False),
        sa.Column("objective_s", sa.Float(), nullable=False),
        sa.Column("recovery_id", sa.String(), nullable=True),
        sa.Column("detection_s", sa.Float(), nullable=True),
        sa.Column("recovery_s", sa.Float(), nullable=True),
        sa.Column("detail", sa.String(), nullable=False),
        sa.Column("injected_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("id", sa.String(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("drill", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_drill_job_id"), ["job_id"], unique=False)

    op.create_table(
        "job",
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("ranks_per_node", sa.Integer(), nullable=False),
        sa.Column("working_dir", sa.String(length=4096), nullable=True),
        sa.Column("checkpoint_dir", sa.String(length=4096), nullable=True),
        sa.Column("id", sa.String(), nullable=False),
        sa.Column(
            "state",
            sa.Enum("PENDING", "RUNNING", "RECOVERING", "HELD", "COMPLETED", "FAILED", "CANCELLED", name="jobstate"),
            nullable=False,
        ),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("placement", sa.JSON(), nullable=False),
        sa.Column("restart_epoch", sa.Integer(), nullable=False),
        sa.Column("restarts", sa.Integer(), nullable=False),
        sa.Column("restart_times", sa.JSON(), nullable=False),
        sa.Column("last_restore_step", sa.Integer(), nullable=True),
        sa.Column("no_progress_streak", sa.Integer(), nullable=False),
        sa.Column("last_error", sa.String(), nullable=False),
        sa.Column("same_error_streak", sa.Integer(), nullable=False),
        sa.Column("detail", sa.String(), nullable=False),
        sa.Column("master_port", sa.Integer(), nullable=False),
        sa.Column("max_fence", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("job", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_job_state"), ["state"], unique=False)

    op.create_table(
        "nodecordon",
        sa.Column("reason", sa.String(length=2000), nullable=False),
        sa.Column("node_id", sa.String(length=64), nullable=False),
        sa.Column("cordoned", sa.Boolean(), nullable=False),
        sa.Column("by", sa.String(length=200), nullable=False),
        sa.Column("job_id", sa.String(length=64), nullable=True),
        sa.Column("cordoned_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("uncordoned_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("node_id"),
    )
    with op.batch_alter_table("nodecordon", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_nodecordon_cordoned"), ["cordoned"], unique=False)
        batch_op.create_index(batch_op.f("ix_nodecordon_cordoned_at"), ["cordoned_at"], unique=False)

    op.create_table(
        "recovery",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("job_id", sa.String(), nullable=False),
        sa.Column("incident_id", sa.String(), nullable=True),
        sa.Column("attached_incidents", sa.JSON(), nullable=False),
        sa.Column("fence", sa.Integer(), nullable=False),
        sa.Column("owner", sa.String(), nullable=False),
        sa.Column(
            "step",
            sa.Enum(
                "DETECTED",
                "LOCKED",
                "STOPPING_RANKS",
                "ISOLATING",
                "PLACING",
                "RESTORING",
                "LAUNCHING",
                "VERIFYING",
                "RUNNING",
                "FAILED",
                "HELD",
                name="recoverystep",
            ),
            nullable=False,
        ),
        sa.Column("steps", sa.JSON(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column(
            "outcome",
            sa.Enum(
                "RECOVERED",
                "BUDGET_SPENT",
                "NON_RETRYABLE",
                "SAME_ERROR",
                "NO_PROGRESS",
                "CIRCUIT_BREAKER",
                "HUMAN_ASKED",
                "NO_CAPACITY",
                "ATTEMPTS_SPENT",
                "REGISTRY_UNAVAILABLE",
                "CANCELLED",
                name="outcome",
            ),
            nullable=True,
        ),
        sa.Column("detail", sa.String(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["job.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("recovery", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_recovery_fence"), ["fence"], unique=False)
        batch_op.create_index(batch_op.f("ix_recovery_job_id"), ["job_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_recovery_step"), ["step"], unique=False)


def downgrade() -> None:
    """Drop every table of the orchestrator, and the enum types PostgreSQL kept for them."""
    with op.batch_alter_table("recovery", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_recovery_step"))
        batch_op.drop_index(batch_op.f("ix_recovery_job_id"))
        batch_op.drop_index(batch_op.f("ix_recovery_fence"))

    op.drop_table("recovery")
    with op.batch_alter_table("nodecordon", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_nodecordon_cordoned_at"))
        batch_op.drop_index(batch_op.f("ix_nodecordon_cordoned"))

    op.drop_table("nodecordon")
    with op.batch_alter_table("job", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_job_state"))

    op.drop_table("job")
    with op.batch_alter_table("drill", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_drill_job_id"))

    op.drop_table("drill")
    with op.batch_alter_table("auditrecord", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_auditrecord_key_id"))
        batch_op.drop_index(batch_op.f("ix_auditrecord_job_id"))
        batch_op.drop_index(batch_op.f("ix_auditrecord_at"))
        batch_op.drop_index(batch_op.f("ix_auditrecord_actor"))

    op.drop_table("auditrecord")
    op.drop_table("apikey")
    for name in ENUM_TYPES:
        sa.Enum(name=name).drop(op.get_bind(), checkfirst=True)
