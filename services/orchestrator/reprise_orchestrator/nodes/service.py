"""Data access for cordons; keyword-only functions."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlmodel import Session, col, func, select

from reprise_orchestrator.nodes.models import NodeCordon

RECOVERY_PREFIX = "recovery:"


def cordon(session: Session, *, node_id: str, reason: str, by: str, now: datetime, job_id: str | None = None) -> bool:
    """Cordon a node; False when it already was (the first reason stays)."""
    row = session.get(NodeCordon, node_id)
    if row is not None and row.cordoned:
        return False
    row = row or NodeCordon(node_id=node_id, cordoned_at=now)
    row.cordoned, row.reason, row.by, row.job_id = True, reason, by, job_id
    row.cordoned_at, row.uncordoned_at = now, None
    session.add(row)
    session.commit()
    return True


def uncordon(session: Session, *, node_id: str, now: datetime) -> bool:
    """Uncordon a node; False when it was not cordoned."""
    row = session.get(NodeCordon, node_id)
    if row is None or not row.cordoned:
        return False
    row.cordoned, row.uncordoned_at = False, now
    session.add(row)
    session.commit()
    return True


def get_all(session: Session) -> Sequence[NodeCordon]:
    """Every cordon record."""
    return session.exec(select(NodeCordon)).all()


def cordoned_ids(session: Session) -> set[str]:
    """The nodes cordoned now."""
    return set(session.exec(select(NodeCordon.node_id).where(col(NodeCordon.cordoned))).all())


def count_recovery_cordons(session: Session, *, since: datetime, other_than: str = "") -> int:
    """How many nodes recoveries (other than the one cordoning as `other_than`) cordoned since `since`: the circuit
    breaker's count, which a recovery resumed after its own cordon must not count against itself."""
    query = select(func.count()).where(
        col(NodeCordon.by).startswith(RECOVERY_PREFIX),
        col(NodeCordon.cordoned_at) >= since,
        NodeCordon.by != other_than,
    )
    return int(session.exec(query).one())
