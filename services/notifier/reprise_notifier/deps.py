"""What the routes are handed besides a database session (reprise_common.db.SessionDep): the routing."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from reprise_notifier.routing import Routing


def get_routing(request: Request) -> Routing:
    """The running notifier's destinations and routes (its app's `state.routing`), for a route."""
    routing: Routing = request.app.state.routing
    return routing


RoutingDep = Annotated[Routing, Depends(get_routing)]
