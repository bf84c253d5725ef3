"""Every table the detector owns, and their migrations (run at every start)."""

from __future__ import annotations

from pathlib import Path

from reprise_common.migrations import Migrations

# Its own version table, so that the detector can share a database with another service's migrations.
MIGRATIONS = Migrations(
    directory=Path(__file__).resolve().parent / "migrations",
    tables=frozenset({"incident", "symptom", "nodefault", "quarantine", "hangpolicy", "rank_stack"}),
    version_table="alembic_version_detector",
)
upgrade = MIGRATIONS.upgrade  # at every start, instead of create_all
downgrade = MIGRATIONS.downgrade
