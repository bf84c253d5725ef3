"""Alembic environment: runs on the connection the registry hands over (reprise_registry.db.upgrade)."""

from __future__ import annotations

from alembic import context
from sqlmodel import SQLModel

from reprise_registry.checkpoints import announce, models  # noqa: F401 - registers the tables
from reprise_registry.db import MIGRATIONS
from reprise_registry.retention import models as retention_models  # noqa: F401

MIGRATIONS.run(context, SQLModel.metadata)
