"""Job labels in a table of their own, indexed by key and value, filled from the labels in every stored spec.

Filtering jobs by label (`GET /v1/jobs?label=k=v`) read a JSON path of every job's spec; it is now an index lookup.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import json

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

MAX_KEY = 253 + 1 + 63  # a DNS-subdomain prefix, "/", a name (reprise_common.labels)
MAX_VALUE = 63


def upgrade() -> None:
    """Create job_label and copy every job's labels into it."""
    table = op.create_table(
        "job_label",
        sa.Column("job_id", sa.String(), sa.ForeignKey("job.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("key", sa.String(MAX_KEY), primary_key=True),
        sa.Column("value", sa.String(MAX_VALUE), nullable=False),
    )
    op.create_index("ix_job_label_key_value", "job_label", ["key", "value"])
    rows = []
    for job_id, spec in op.get_bind().execute(sa.text("SELECT id, spec FROM job")):
        stored = json.loads(spec) if isinstance(spec, str) else spec  # JSON is text on SQLite, parsed on PostgreSQL
        labels = (stored or {}).get("labels") or {}  # a spec from before labels has none
        rows += [{"job_id": job_id, "key": key, "value": value} for key, value in labels.items()]
    if rows:
        op.bulk_insert(table, rows)


def downgrade() -> None:
    """Drop job_label (the labels stay in the specs)."""
    op.drop_table("job_label")
