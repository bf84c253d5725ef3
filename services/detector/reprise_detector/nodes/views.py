"""Node health and reputation routes, and per-job hang policies."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, Protocol

from fastapi import APIRouter, Depends, Request
from sqlmodel import Session, col, select

from reprise_common.db import SessionDep, session_scope
from reprise_common.errors import NotFoundError
from reprise_detector.deps import RuntimeDep, RuntimeView
from reprise_detector.nodes import reputation
from reprise_detector.nodes.liveness import Liveness
from reprise_detector.nodes.models import (
    GpuHealthPublic,
    HangPolicy,
    HangPolicyBase,
    HangPolicyPublic,
    NodeFault,
    NodeFaultPublic,
    NodeHealthPublic,
    NodesHealthPublic,
    QuarantinePublic,
)

router = APIRouter(prefix="/v1/node-health", tags=["nodes"])
jobs_router = APIRouter(prefix="/v1/jobs", tags=["hang policy"])


class NodesView(RuntimeView, Protocol):
    """What the node routes read of the running detector, beyond what any route reads (runtime.Runtime)."""

    @property
    def liveness(self) -> Liveness: ...

    @property
    def reputation_rules(self) -> reputation.ReputationRules: ...


def get_nodes_view(request: Request) -> NodesView:
    """The running detector, for a node route."""
    runtime: NodesView = request.app.state.runtime
    return runtime


NodesDep = Annotated[NodesView, Depends(get_nodes_view)]


def _health(runtime: NodesView, session: Session, node_id: str, *, detail: bool) -> NodeHealthPublic:
    seen = runtime.liveness.nodes.get(node_id)
    window = timedelta(seconds=runtime.reputation_rules.window_s)
    faults = reputation.faults_of(session, node_id=node_id, since=runtime.clock.now() - window)
    recommendations = reputation.recommendations_of(session, node_id=node_id)
    return NodeHealthPublic(
        node_id=node_id,
        state=seen.state.value if seen else "unknown",
        last_report_age_s=runtime.liveness.age(node_id),
        gpus=[GpuHealthPublic(index=g.index, health=g.health.value, last_xid=g.last_xid) for g in seen.gpus]
        if seen
        else [],
        fault_count=len({f.event_id for f in faults}),
        jobs_with_faults=sorted({f.job_key for f in faults if f.job_key}),
        quarantine_recommended=bool(recommendations),
        faults=[NodeFaultPublic.model_validate(f) for f in faults] if detail else [],
        recommendations=[QuarantinePublic.model_validate(r) for r in recommendations] if detail else [],
    )


@router.get("", summary="Every known node's liveness and reputation")
def list_node_health(runtime: NodesDep, session: SessionDep) -> NodesHealthPublic:
    """Nodes that reported to this replica or have faults on record, by id."""
    with_faults = set(session.exec(select(NodeFault.node_id).distinct()).all())
    nodes = sorted(set(runtime.liveness.nodes) | with_faults)
    data = [_health(runtime, session, node_id, detail=False) for node_id in nodes]
    return NodesHealthPublic(data=data, count=len(data))


@router.get("/{node_id}", summary="One node's liveness, fault history and quarantine recommendations")
def read_node_health(runtime: NodesDep, session: SessionDep, node_id: str) -> NodeHealthPublic:
    """A node's health; 404 when it never reported and has no faults on record."""
    known = node_id in runtime.liveness.nodes
    if not known and session.exec(select(NodeFault).where(col(NodeFault.node_id) == node_id)).first() is None:
        raise NotFoundError(f"no node {node_id}")
    return _health(runtime, session, node_id, detail=True)


@jobs_router.put("/{job_id}/hang-policy", summary="Set a job's own hang limits")
def put_hang_policy(runtime: RuntimeDep, job_id: str, policy: HangPolicyBase) -> HangPolicyPublic:
    """Replace the job's hang limits (null fields keep the detector's defaults); applies from the next check."""
    with session_scope(runtime.engine) as session:
        row = session.get(HangPolicy, job_id) or HangPolicy(job_id=job_id, updated_at=runtime.clock.now())
        for name, value in policy.model_dump().items():
            setattr(row, name, value)
        row.updated_at = runtime.clock.now()
        session.add(row)
        session.flush()
        return HangPolicyPublic.model_validate(row)


@jobs_router.get("/{job_id}/hang-policy", summary="A job's own hang limits")
def read_hang_policy(session: SessionDep, job_id: str) -> HangPolicyPublic:
    """The job's hang limits; 404 when it has none (the defaults apply)."""
    row = session.get(HangPolicy, job_id)
    if row is None:
        raise NotFoundError(f"no hang policy for job {job_id}")
    return HangPolicyPublic.model_validate(row)
