"""Every table the notifier owns (names prefixed notifier_), and their migrations (run at every start)."""

from __future__ import annotations

from pathlib import Path

from reprise_common.migrations import Migrations

# Its own version table, so that the notifier can share a database with other services' migrations.
MIGRATIONS = Migrations(
    directory=Path(__file__).resolve().parent / "migrations",
    tables=frozenset({"notifier_incident", "notifier_delivery", "notifier_dead_letter", "notifier_destination"}),
    version_table="alembic_version_notifier",
)
upgrade = MIGRATIONS.upgrade  # at every start, instead of create_all
downgrade = MIGRATIONS.downgrade
