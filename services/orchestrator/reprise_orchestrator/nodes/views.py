"""REST routes for the node inventory and cordons."""

from __future__ import annotations

from fastapi import APIRouter

from reprise_common.settings import IdStr
from reprise_orchestrator.deps import DepsDep, SessionDep
from reprise_orchestrator.inventory import NodePublic
from reprise_orchestrator.nodes import flows, service
from reprise_orchestrator.nodes.models import CordonPublic, CordonRequest, NodeCordon

router = APIRouter(prefix="/v1/nodes", tags=["nodes"])


@router.get("", response_model=list[NodePublic])
def list_nodes(deps: DepsDep, session: SessionDep) -> list[NodePublic]:
    """Every node that has reported, with its health, freshness and cordon."""
    cordons = {row.node_id: row.reason for row in service.get_all(session) if row.cordoned}
    return deps.inventory.public(cordons)


@router.post("/{node_id}/cordon", response_model=CordonPublic)
async def cordon_node(node_id: IdStr, body: CordonRequest, deps: DepsDep, session: SessionDep) -> CordonPublic:
    """Give a node no new ranks (running ranks stay until their job's next recovery); idempotent."""
    await flows.cordon(deps, node_id=node_id, reason=body.reason or "cordoned by an operator", by="api")
    return _row(session, node_id)


@router.post("/{node_id}/uncordon", response_model=CordonPublic)
async def uncordon_node(node_id: IdStr, deps: DepsDep, session: SessionDep) -> CordonPublic:
    """Make a cordoned node placeable again; idempotent."""
    await flows.uncordon(deps, node_id=node_id)
    return _row(session, node_id)


def _row(session: SessionDep, node_id: str) -> CordonPublic:
    row = session.get(NodeCordon, node_id)
    if row is None:  # uncordoning a node that was never cordoned
        return CordonPublic(node_id=node_id, cordoned=False)
    return CordonPublic.model_validate(row, from_attributes=True)
