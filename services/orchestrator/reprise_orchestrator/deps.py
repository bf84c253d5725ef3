"""What the orchestrator's flows need, built once per process and passed explicitly."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.engine import Engine
from sqlmodel import Session

from reprise_common.bus import Bus
from reprise_common.clock import Clock
from reprise_orchestrator.locks import RedisJobLocks
from reprise_orchestrator.nodes.inventory import Inventory
from reprise_orchestrator.registry_client import RegistryClient
from reprise_orchestrator.settings import OrchestratorSettings


@dataclass
class Deps:
    """The orchestrator's collaborators."""

    settings: OrchestratorSettings
    engine: Engine
    bus: Bus
    locks: RedisJobLocks
    inventory: Inventory
    registry: RegistryClient
    clock: Clock


def get_deps(request: Request) -> Deps:
    """The app's collaborators (a FastAPI dependency)."""
    deps: Deps = request.app.state.deps
    return deps


def get_session(request: Request) -> Iterator[Session]:
    """A database session for one request (a FastAPI dependency)."""
    with Session(get_deps(request).engine) as session:
        yield session


DepsDep = Annotated[Deps, Depends(get_deps)]
SessionDep = Annotated[Session, Depends(get_session)]
