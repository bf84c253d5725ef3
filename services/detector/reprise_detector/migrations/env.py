"""Alembic environment: runs on the connection the detector hands over (reprise_detector.schema.upgrade)."""

from __future__ import annotations

from alembic import context
from sqlmodel import SQLModel

from reprise_detector.incidents import models  # noqa: F401 - registers the tables
from reprise_detector.nodes import models as node_models  # noqa: F401
from reprise_detector.schema import MIGRATIONS

MIGRATIONS.run(context, SQLModel.metadata)
