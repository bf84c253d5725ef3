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
from reprise_common.db import REQUEST_SESSIONS
from reprise_orchestrator.compute.backend import ComputeBackend
from reprise_orchestrator.inventory import Inventory
from reprise_orchestrator.locks import JobLocks
from reprise_orchestrator.registry_client import Registry
from reprise_orchestrator.settings import OrchestratorSettings


@dataclass
class Deps:
    """The orchestrator's collaborators: the seams (locks, compute backend, registry, clock) are protocols."""

    settings: OrchestratorSettings
    engine: Engine
    bus: Bus
    locks: JobLocks
    compute: ComputeBackend
    inventory: Inventory  # what the nodes' agents report: ranks' progress, GPUs, addresses
    registry: Registry
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
# The session closes when the handler returns, before the answer is sent (sending waits for the event loop, which must
# never wait for a connection a finished handler still holds), and at most REQUEST_SESSIONS handlers hold one at once.
SessionDep = Annotated[Session, Depends(get_session, scope="function", max_concurrency=REQUEST_SESSIONS)]
