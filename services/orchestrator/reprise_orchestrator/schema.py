"""Every table the orchestrator owns, and their migrations (run at every start)."""

from __future__ import annotations

from pathlib import Path

from reprise_common.migrations import Migrations

# Its own version table, so that the orchestrator can share a database with other services' migrations.
MIGRATIONS = Migrations(
    directory=Path(__file__).resolve().parent / "migrations",
    tables=frozenset({"job", "job_label", "recovery", "recovery_step", "drill", "nodecordon", "apikey", "auditrecord"}),
    version_table="alembic_version_orchestrator",
)
upgrade = MIGRATIONS.upgrade  # at every start, instead of create_all
downgrade = MIGRATIONS.downgrade
