"""Outbox, dead-letter and destination-state data access: small verbs with keyword-only arguments."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import func
from sqlmodel import Session, col, select

from reprise_common.db import page_newest_first
from reprise_notifier.deliveries.models import (
    DeadLetter,
    DeadLetterReason,
    Delivery,
    DeliveryState,
    DestinationState,
)

_CHUNK = 500


def enqueue(session: Session, *, deliveries: list[Delivery]) -> list[Delivery]:
    """Add the deliveries whose ids are new; returns those (a redelivered event's are already there)."""
    wanted = {d.id: d for d in deliveries}
    known: set[str] = set()
    ids = list(wanted)
    for start in range(0, len(ids), _CHUNK):
        chunk = ids[start : start + _CHUNK]
        known.update(session.exec(select(Delivery.id).where(col(Delivery.id).in_(chunk))).all())
    added = [d for key, d in wanted.items() if key not in known]
    session.add_all(added)
    return added


def get_due(session: Session, *, destination: str, limit: int) -> list[Delivery]:
    """A destination's pending deliveries, oldest first."""
    query = (
        select(Delivery)
        .where(Delivery.destination == destination, Delivery.state == DeliveryState.PENDING.value)
        .order_by(col(Delivery.created_at), col(Delivery.occurred_at), col(Delivery.id))
        .limit(limit)
    )
    return list(session.exec(query).all())


def get_expired(session: Session, *, destination: str, created_before: datetime) -> list[Delivery]:
    """A destination's pending deliveries created before a time (too old to keep trying)."""
    query = select(Delivery).where(
        Delivery.destination == destination,
        Delivery.state == DeliveryState.PENDING.value,
        col(Delivery.created_at) < created_before,
    )
    return list(session.exec(query).all())


def get_state(session: Session, *, name: str) -> DestinationState:
    """A destination's pacing state, created (free to send) the first time it is asked for."""
    state = session.get(DestinationState, name)
    if state is None:
        state = DestinationState(name=name)
        session.add(state)
    return state


def mark_sent(deliveries: list[Delivery], *, now: datetime, status: int | None, message_id: str) -> None:
    """Record that the destination accepted these deliveries."""
    for delivery in deliveries:
        delivery.state = DeliveryState.SENT
        delivery.attempts += 1
        delivery.sent_at = now
        delivery.last_attempt_at = now
        delivery.last_status = status
        delivery.last_error = ""
        delivery.message_id = message_id


def mark_failed(deliveries: list[Delivery], *, now: datetime, status: int | None, error: str) -> None:
    """Record a failed attempt; the deliveries stay pending."""
    for delivery in deliveries:
        delivery.attempts += 1
        delivery.last_attempt_at = now
        delivery.last_status = status
        delivery.last_error = error


def dead_letter(
    session: Session,
    *,
    deliveries: list[Delivery],
    reason: DeadLetterReason,
    status: int | None,
    detail: str,
    now: datetime,
) -> None:
    """Give up on deliveries: mark them dead and keep a dead letter for each with the reason."""
    for delivery in deliveries:
        delivery.state = DeliveryState.DEAD
        delivery.last_status = status
        delivery.last_error = detail
        if session.get(DeadLetter, delivery.id) is None:
            session.add(
                DeadLetter(
                    id=delivery.id,
                    destination=delivery.destination,
                    event_id=delivery.event_id,
                    kind=delivery.kind,
                    job_id=delivery.job_id,
                    reason=reason,
                    status=status,
                    detail=detail,
                    dead_at=now,
                )
            )


def get_all(
    session: Session,
    *,
    state: DeliveryState | None = None,
    destination: str | None = None,
    job_id: str | None = None,
    offset: int = 0,
    limit: int = 100,
) -> tuple[list[Delivery], int]:
    """Deliveries matching every given filter, newest first, and how many match in all."""
    query = select(Delivery)
    if state is not None:
        query = query.where(Delivery.state == state.value)
    if destination is not None:
        query = query.where(Delivery.destination == destination)
    if job_id is not None:
        query = query.where(Delivery.job_id == job_id)
    return page_newest_first(
        session, query, newest=Delivery.created_at, tiebreak=Delivery.id, offset=offset, limit=limit
    )


def get_dead_letters(
    session: Session, *, destination: str | None = None, offset: int = 0, limit: int = 100
) -> tuple[list[DeadLetter], int]:
    """Dead letters, newest first, and how many match in all."""
    query = select(DeadLetter)
    if destination is not None:
        query = query.where(DeadLetter.destination == destination)
    return page_newest_first(
        session, query, newest=DeadLetter.dead_at, tiebreak=DeadLetter.id, offset=offset, limit=limit
    )


def count_pending(session: Session) -> dict[str, int]:
    """Pending deliveries per destination."""
    query = (
        select(Delivery.destination, func.count())
        .where(Delivery.state == DeliveryState.PENDING.value)
        .group_by(col(Delivery.destination))
    )
    return {name: int(count) for name, count in session.exec(query).all()}


def get_states(session: Session) -> dict[str, DestinationState]:
    """Every destination's pacing state, by name."""
    return {state.name: state for state in session.exec(select(DestinationState)).all()}
