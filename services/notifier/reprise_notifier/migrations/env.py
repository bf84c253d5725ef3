"""Alembic environment: runs on the connection the notifier hands over (reprise_notifier.schema.upgrade)."""

from __future__ import annotations

from alembic import context
from sqlmodel import SQLModel

from reprise_notifier.alerts import models  # noqa: F401 - registers the tables
from reprise_notifier.deliveries import models as delivery_models  # noqa: F401
from reprise_notifier.schema import MIGRATIONS

MIGRATIONS.run(context, SQLModel.metadata)
