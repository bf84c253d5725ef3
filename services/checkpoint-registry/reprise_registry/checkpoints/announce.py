"""The outbox of checkpoint changes: written in the same transaction as the change, published until confirmed."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime

from sqlalchemy import String, Text, update
from sqlalchemy.engine import Engine
from sqlmodel import Field, Session, SQLModel, col, select

from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.clock import utcnow
from reprise_common.db import UTCDateTime
from reprise_common.errors import BusError
from reprise_common.events import CheckpointChange
from reprise_common.logging import get_logger

log = get_logger("reprise.registry.announce")
BATCH = 100


class CheckpointEvent(SQLModel, table=True):
    """A checkpoint change waiting to be (or already) published."""

    __tablename__ = "checkpoint_events"

    id: int | None = Field(default=None, primary_key=True)
    checkpoint_id: int = Field(index=True)
    job_id: str = Field(sa_type=String(64))
    change: str = Field(sa_type=String(16))
    payload: str = Field(sa_type=Text)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    published_at: datetime | None = Field(default=None, sa_type=UTCDateTime, index=True)


def record(session: Session, event: CheckpointChange, *, checkpoint_id: int) -> None:
    """Queue a change for publishing; the caller commits it together with the change itself."""
    session.add(
        CheckpointEvent(
            checkpoint_id=checkpoint_id, job_id=event.job_id, change=event.change, payload=event.model_dump_json()
        )
    )


def _pending(engine: Engine) -> list[CheckpointEvent]:
    with Session(engine) as session:
        query = select(CheckpointEvent).where(col(CheckpointEvent.published_at).is_(None))
        return list(session.exec(query.order_by(col(CheckpointEvent.id)).limit(BATCH)).all())


def _mark_published(engine: Engine, ids: list[int]) -> None:
    with Session(engine) as session:
        session.execute(update(CheckpointEvent).where(col(CheckpointEvent.id).in_(ids)).values(published_at=utcnow()))
        session.commit()


async def publish_pending(engine: Engine, bus: Bus) -> int:
    """Publish queued changes in order (msg id = event id, so a retry is deduplicated); returns how many."""
    sent: list[int] = []
    for row in await asyncio.to_thread(_pending, engine):
        event = CheckpointChange.model_validate_json(row.payload)
        try:
            await bus.publish(subjects.checkpoint(row.job_id, row.change), event)
        except BusError as exc:
            log.warning("could not announce a checkpoint change; will retry", extra={"error": str(exc)})
            break
        assert row.id is not None
        sent.append(row.id)
    if sent:
        await asyncio.to_thread(_mark_published, engine, sent)
    return len(sent)


async def run_publisher(engine: Engine, bus: Bus, *, wake: asyncio.Event, interval_s: float) -> None:
    """Publish the outbox whenever woken, and every interval in any case (level-triggered)."""
    while True:
        if bus.connected:
            await publish_pending(engine, bus)
        wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), timeout=interval_s)
