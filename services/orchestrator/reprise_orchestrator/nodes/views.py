"""REST routes for the node inventory."""

from __future__ import annotations

from fastapi import APIRouter, Request

from reprise_orchestrator.nodes.inventory import Inventory, NodePublic

router = APIRouter(prefix="/v1/nodes", tags=["nodes"])


@router.get("", response_model=list[NodePublic])
async def list_nodes(request: Request) -> list[NodePublic]:
    """Every node that has reported, with its health and freshness."""
    inventory: Inventory = request.app.state.inventory
    return inventory.public()
