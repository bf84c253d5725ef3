"""Node reputation: fault history per node across jobs, and the rules that recommend a quarantine ("lemon nodes")."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.db import session_scope
from reprise_common.events import Category, GpuXid, NodeQuarantineRecommended, QuarantineReason
from reprise_common.logging import get_logger
from reprise_detector.classify import Classification
from reprise_detector.kinds.base import Observation
from reprise_detector.nodes.models import NodeFault, NodeFaultBase, Quarantine

log = get_logger("reprise.detector.reputation")
HARDWARE = (Category.GPU_HARDWARE, Category.INTERCONNECT)
SOURCE = "detector"


@dataclass(frozen=True)
class ReputationRules:
    """When a node's history recommends a quarantine: `xid_count` of `xid`, hardware faults in `jobs` jobs, or
    `numeric_count` numeric faults first seen on the node, in the window."""

    xid: int = 48
    xid_count: int = 2
    jobs: int = 3
    numeric_count: int = 3
    window_s: float = 86400.0


@dataclass(frozen=True)
class Judgement:
    """A rule that fired, and the faults that made it fire."""

    reason: QuarantineReason
    faults: tuple[NodeFaultBase, ...]
    detail: str


def counts_toward_reputation(classification: Classification) -> bool:
    """Root-cause-grade hardware faults (GPU or interconnect) build a node's record wherever they are seen; numeric
    faults only on the node where an incident's root cause saw them first (`leads_reputation`)."""
    return classification.root_cause_grade and classification.category in HARDWARE


def leads_reputation(classification: Classification) -> bool:
    """A numeric fault counts for the node of the rank that led its incident: a NaN spreads to every rank of the
    job within a step, so the other ranks' nodes are not to blame."""
    return classification.root_cause_grade and classification.category is Category.NUMERIC


def judge(faults: Sequence[NodeFaultBase], rules: ReputationRules, *, now: datetime) -> list[Judgement]:
    """The rules a node's faults break within the window before `now`, oldest evidence first."""
    recent = sorted((f for f in faults if now - f.time <= timedelta(seconds=rules.window_s)), key=lambda f: f.time)
    found: list[Judgement] = []
    xid_events = {f.event_id: f for f in recent if f.xid == rules.xid}
    if len(xid_events) >= rules.xid_count:
        detail = f"XID {rules.xid} {len(xid_events)} times within {rules.window_s:g} s"
        found.append(Judgement(QuarantineReason.REPEATED_XID, tuple(xid_events.values()), detail))
    numeric = {f.event_id: f for f in recent if f.category == Category.NUMERIC}
    if len(numeric) >= rules.numeric_count:
        detail = (
            f"numeric faults (NaN, infinity, spike) first seen here {len(numeric)} times within {rules.window_s:g} s"
        )
        found.append(Judgement(QuarantineReason.REPEATED_NUMERIC, tuple(numeric.values()), detail))
    jobs = {f.job_key: f for f in recent if f.job_key and f.category in HARDWARE}
    if len(jobs) >= rules.jobs:
        detail = f"hardware faults in {len(jobs)} different jobs within {rules.window_s:g} s: {sorted(jobs)}"
        found.append(Judgement(QuarantineReason.FAULTS_ACROSS_JOBS, tuple(jobs.values()), detail))
    return found


def record(session: Session, *, observation: Observation, classification: Classification, job_ids: list[str]) -> None:
    """Add a hardware fault to the node's history, once per affected job (or once with no job)."""
    xid = observation.event.xid if isinstance(observation.event, GpuXid) else None
    for job_key in job_ids or [""]:
        session.add(
            NodeFault(
                node_id=observation.node_id,
                event_id=observation.event_id,
                job_key=job_key,
                kind=observation.kind,
                xid=xid,
                gpu=observation.gpu,
                category=classification.category,
                reason=classification.reason,
                time=observation.time,
            )
        )


def faults_of(session: Session, *, node_id: str, since: datetime | None = None) -> list[NodeFault]:
    """A node's faults, oldest first (only those at or after `since` when given)."""
    query = select(NodeFault).where(NodeFault.node_id == node_id)
    if since is not None:
        query = query.where(col(NodeFault.time) >= since)
    return list(session.exec(query.order_by(col(NodeFault.time))).all())


def recommendations_of(session: Session, *, node_id: str) -> list[Quarantine]:
    """A node's quarantine recommendations, newest first."""
    query = select(Quarantine).where(Quarantine.node_id == node_id).order_by(col(Quarantine.recommended_at).desc())
    return list(session.exec(query).all())


def recommend(session: Session, *, node_id: str, rules: ReputationRules, now: datetime) -> list[Quarantine]:
    """Record a recommendation for each rule the node's history breaks that has none within the window yet."""
    session.flush()
    latest = max((f.time for f in faults_of(session, node_id=node_id)), default=None)
    if latest is None:
        return []
    faults = faults_of(session, node_id=node_id, since=latest - timedelta(seconds=rules.window_s))
    made: list[Quarantine] = []
    for judgement in judge(faults, rules, now=latest):
        since = now - timedelta(seconds=rules.window_s)
        already = session.exec(
            select(Quarantine).where(
                Quarantine.node_id == node_id,
                Quarantine.reason == judgement.reason.value,
                col(Quarantine.recommended_at) >= since,
            )
        ).first()
        if already is not None:
            continue
        first = judgement.faults[0]
        key = hashlib.sha256(f"{node_id}|{judgement.reason.value}|{first.event_id}".encode()).hexdigest()[:32]
        quarantine = Quarantine(
            id=f"quarantine:{key}",
            node_id=node_id,
            reason=judgement.reason,
            detail=judgement.detail,
            fault_count=len({f.event_id for f in judgement.faults}),
            job_ids=",".join(sorted({f.job_key for f in judgement.faults if f.job_key})),
            first_fault_at=first.time,
            last_fault_at=judgement.faults[-1].time,
            recommended_at=now,
        )
        session.add(quarantine)
        made.append(quarantine)
        log.warning("node quarantine recommended", extra={"node_id": node_id, "reason": judgement.reason.value})
    return made


def announcement(quarantine: Quarantine, *, window_s: float) -> NodeQuarantineRecommended:
    """The event announcing a recommendation; its id is the row's, so a repeated publish is deduplicated."""
    return NodeQuarantineRecommended(
        event_id=quarantine.id,
        time=quarantine.recommended_at,
        source=SOURCE,
        node_id=quarantine.node_id,
        reason=quarantine.reason,
        detail=quarantine.detail,
        fault_count=quarantine.fault_count,
        job_ids=[j for j in quarantine.job_ids.split(",") if j],
        window_s=window_s,
        first_fault_at=quarantine.first_fault_at,
        last_fault_at=quarantine.last_fault_at,
    )


async def publish_pending(engine: Engine, bus: Bus, *, window_s: float) -> int:
    """Announce every recommendation not yet announced (after a crash too); raises BusError to retry later."""

    def pending() -> list[NodeQuarantineRecommended]:
        with session_scope(engine) as session:
            rows = session.exec(select(Quarantine).where(col(Quarantine.published).is_(False))).all()
            return [announcement(row, window_s=window_s) for row in rows]

    def mark(ids: list[str]) -> None:
        with session_scope(engine) as session:
            for row in session.exec(select(Quarantine).where(col(Quarantine.id).in_(ids))).all():
                row.published = True

    events = await asyncio.to_thread(pending)
    for event in events:
        await bus.publish(subjects.node_quarantine(event.node_id), event, msg_id=event.event_id)
    if events:
        await asyncio.to_thread(mark, [e.event_id for e in events])
    return len(events)
