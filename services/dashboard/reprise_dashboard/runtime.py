"""What one running dashboard holds, shared by the lifespan and the routes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from reprise_common.bus import Bus
from reprise_common.clock import Clock
from reprise_common.service import Background
from reprise_dashboard.live import LiveFeed
from reprise_dashboard.settings import DashboardSettings
from reprise_dashboard.upstreams import Upstreams


@dataclass
class Runtime:
    """The dashboard's settings, clock, service clients, NATS connection and live feed."""

    settings: DashboardSettings
    clock: Clock
    upstreams: Upstreams
    bus: Bus
    feed: LiveFeed
    background: Background


def get_runtime(request: Request) -> Runtime:
    """The running dashboard, for a route."""
    runtime: Runtime = request.app.state.runtime
    return runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]
