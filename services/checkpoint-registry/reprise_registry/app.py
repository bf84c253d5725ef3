"""The registry's FastAPI application."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from sqlmodel import SQLModel

from reprise_common.db import db_check, make_engine
from reprise_common.service import add_error_handlers, add_ops_routes
from reprise_registry import views
from reprise_registry.settings import RegistrySettings


def create_app(settings: RegistrySettings) -> FastAPI:
    """Build the app; tables are created on start."""
    engine = make_engine(settings.database_url)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        SQLModel.metadata.create_all(engine)
        yield
        engine.dispose()

    app = FastAPI(title="Reprise checkpoint registry", version="0.1.0", lifespan=lifespan)
    app.state.engine = engine
    add_ops_routes(app, checks={"database": db_check(engine)})
    add_error_handlers(app)
    app.include_router(views.router)
    return app
