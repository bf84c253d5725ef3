"""Data access for drills."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlmodel import Session, col, select

from reprise_common.errors import NotFoundError
from reprise_orchestrator.drills.models import Drill


def create(session: Session, *, drill: Drill) -> Drill:
    """Record a drill as it starts."""
    session.add(drill)
    session.commit()
    session.refresh(drill)
    return drill


def get(session: Session, *, drill_id: str) -> Drill:
    """One drill, or NotFoundError."""
    drill = session.get(Drill, drill_id)
    if drill is None:
        raise NotFoundError(f"drill {drill_id} not found")
    return drill


def get_all_by_job(session: Session, *, job_id: str, limit: int = 100) -> Sequence[Drill]:
    """A job's drills, newest first."""
    query = select(Drill).where(Drill.job_id == job_id).order_by(col(Drill.injected_at).desc()).limit(limit)
    return session.exec(query).all()


def update(session: Session, *, drill_id: str, **values: Any) -> Drill:
    """Record what a drill measured."""
    drill = get(session, drill_id=drill_id)
    for key, value in values.items():
        setattr(drill, key, value)
    session.add(drill)
    session.commit()
    session.refresh(drill)
    return drill
