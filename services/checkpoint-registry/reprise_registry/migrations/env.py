"""Alembic environment: runs on the connection the registry hands over (reprise_registry.db.upgrade)."""

from __future__ import annotations

from alembic import context
from sqlmodel import SQLModel

from reprise_registry.checkpoints import announce, models  # noqa: F401 - registers the tables
from reprise_registry.db import owned
from reprise_registry.retention import models as retention_models  # noqa: F401

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations through reprise_registry.db.upgrade(engine), which passes a connection")
context.configure(
    connection=connection,
    target_metadata=SQLModel.metadata,
    render_as_batch=connection.dialect.name == "sqlite",  # SQLite alters tables by copying them
    compare_type=True,
    include_object=owned,
)
with context.begin_transaction():
    context.run_migrations()
