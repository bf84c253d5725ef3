"""Alembic environment: runs on the connection the orchestrator hands over (reprise_orchestrator.schema.upgrade)."""

from __future__ import annotations

from alembic import context
from sqlmodel import SQLModel

from reprise_orchestrator.auth import models as auth_models  # noqa: F401 - registers the tables
from reprise_orchestrator.drills import models as drill_models  # noqa: F401
from reprise_orchestrator.jobs import models as job_models  # noqa: F401
from reprise_orchestrator.nodes import models as node_models  # noqa: F401
from reprise_orchestrator.recoveries import models as recovery_models  # noqa: F401
from reprise_orchestrator.schema import MIGRATIONS

MIGRATIONS.run(context, SQLModel.metadata)
