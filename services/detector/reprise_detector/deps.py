"""The routes' FastAPI dependencies: the running detector as every route reads it, and a database session.

A route reads the detector through the RuntimeView protocol, never through runtime.Runtime: the runtime wires every
stage, and the routes' own packages (incidents, nodes) sit below it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Protocol

from fastapi import Depends, Request
from sqlalchemy.engine import Engine
from sqlmodel import Session

from reprise_common.bus import Bus
from reprise_common.clock import Clock
from reprise_common.db import REQUEST_SESSIONS, session_scope
from reprise_detector.placements import PlacementMap


class RuntimeView(Protocol):
    """What any route reads of the running detector (runtime.Runtime)."""

    @property
    def engine(self) -> Engine: ...

    @property
    def bus(self) -> Bus: ...

    @property
    def clock(self) -> Clock: ...

    @property
    def placements(self) -> PlacementMap: ...


def get_runtime(request: Request) -> RuntimeView:
    """The running detector, for a route."""
    runtime: RuntimeView = request.app.state.runtime
    return runtime


RuntimeDep = Annotated[RuntimeView, Depends(get_runtime)]


def get_session(runtime: RuntimeDep) -> Iterator[Session]:
    """A database session for one request."""
    with session_scope(runtime.engine) as session:
        yield session


# The session closes when the handler returns, before the answer is sent (sending waits for the event loop, which must
# never wait for a connection a finished handler still holds), and at most REQUEST_SESSIONS handlers hold one at once.
SessionDep = Annotated[Session, Depends(get_session, scope="function", max_concurrency=REQUEST_SESSIONS)]
