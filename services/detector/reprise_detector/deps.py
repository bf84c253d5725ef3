"""The routes' FastAPI dependencies: the running detector as every route reads it (a database session is the shared
library's, reprise_common.db.SessionDep).

A route reads the detector through the RuntimeView protocol, never through runtime.Runtime: the runtime wires every
stage, and the routes' own packages (incidents, nodes) sit below it.
"""

from __future__ import annotations

from typing import Annotated, Protocol

from fastapi import Depends, Request
from sqlalchemy.engine import Engine

from reprise_common.bus import Bus
from reprise_common.clock import Clock
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
