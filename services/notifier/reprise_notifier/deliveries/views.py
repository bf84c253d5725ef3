"""Delivery routes: the outbox by state, the dead letters, and each destination's backlog (by name, never URL)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from reprise_common.db import SQL_INT_MAX, SessionDep
from reprise_notifier.deliveries import service
from reprise_notifier.deliveries.models import (
    DeadLetterPublic,
    DeadLettersPublic,
    DeliveriesPublic,
    DeliveryPublic,
    DeliveryState,
    DestinationPublic,
    DestinationsPublic,
)
from reprise_notifier.deps import RoutingDep

deliveries_router = APIRouter(prefix="/v1/deliveries", tags=["deliveries"])
dead_letters_router = APIRouter(prefix="/v1/dead-letters", tags=["deliveries"])
destinations_router = APIRouter(prefix="/v1/destinations", tags=["deliveries"])


@deliveries_router.get("", summary="List deliveries, newest first")
def list_deliveries(
    session: SessionDep,
    *,
    state: DeliveryState | None = None,
    destination: str | None = None,
    job_id: str | None = None,
    offset: Annotated[int, Query(ge=0, le=SQL_INT_MAX)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> DeliveriesPublic:
    """Deliveries matching every given filter."""
    rows, count = service.get_all(
        session, state=state, destination=destination, job_id=job_id, offset=offset, limit=limit
    )
    return DeliveriesPublic(data=[DeliveryPublic.model_validate(d) for d in rows], count=count)


@dead_letters_router.get("", summary="List dead letters, newest first")
def list_dead_letters(
    session: SessionDep,
    *,
    destination: str | None = None,
    offset: Annotated[int, Query(ge=0, le=SQL_INT_MAX)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> DeadLettersPublic:
    """Alerts given up on, with the reason and the status that refused them."""
    rows, count = service.get_dead_letters(session, destination=destination, offset=offset, limit=limit)
    return DeadLettersPublic(data=[DeadLetterPublic.model_validate(d) for d in rows], count=count)


@destinations_router.get("", summary="Every destination with its backlog")
def list_destinations(routing: RoutingDep, session: SessionDep) -> DestinationsPublic:
    """Each configured destination by name and kind, its pending alerts and when it may next be sent to."""
    pending = service.count_pending(session)
    states = service.get_states(session)
    data = []
    for name, destination in sorted(routing.destinations.items()):
        state = states.get(name)
        data.append(
            DestinationPublic(
                name=name,
                kind=destination.kind.value,
                pending=pending.get(name, 0),
                next_send_at=state.next_send_at if state else None,
                wait_reason=state.wait_reason if state else None,
                failures=state.failures if state else 0,
                last_status=state.last_status if state else None,
                last_error=state.last_error if state else "",
            )
        )
    return DestinationsPublic(data=data, count=len(data))
