"""Nodes: the per-GPU health grid, cordons (orchestrator), liveness and reputation (detector), recent faults."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from reprise_dashboard.render import page
from reprise_dashboard.runtime import RuntimeDep
from reprise_dashboard.upstreams import Fetched, Service

router = APIRouter(tags=["pages"])
RECENT_FAULTS = 50


@dataclass
class NodeRow:
    """One node as both services see it."""

    node_id: str
    inventory: dict[str, Any] | None = None  # the orchestrator's: spare, ranks, freshness, cordon
    health: dict[str, Any] | None = None  # the detector's: liveness, GPUs, faults, quarantine
    recommendations: list[dict[str, Any]] = field(default_factory=list)


def merge_nodes(inventory: Fetched[Any], health: Fetched[Any]) -> list[NodeRow]:
    """One row per node either service knows, by id."""
    rows: dict[str, NodeRow] = {}
    for entry in inventory.data or []:
        rows.setdefault(entry["node_id"], NodeRow(entry["node_id"])).inventory = entry
    for entry in (health.data or {}).get("data", []):
        rows.setdefault(entry["node_id"], NodeRow(entry["node_id"])).health = entry
    return [rows[key] for key in sorted(rows)]


def recent_faults(details: list[Fetched[Any]], *, limit: int = RECENT_FAULTS) -> list[dict[str, Any]]:
    """Every node's faults in the reputation window, newest first."""
    faults = [fault for answer in details if answer.ok and answer.data for fault in answer.data.get("faults", [])]
    faults.sort(key=lambda f: str(f.get("time") or ""), reverse=True)  # one service's ISO times sort as text
    return faults[:limit]


@router.get("/nodes", response_class=HTMLResponse, summary="Nodes: GPU health, cordons, reputation, recent faults")
async def nodes_page(request: Request, runtime: RuntimeDep) -> HTMLResponse:
    """Each node's GPUs by health, its cordon, liveness and fault reputation, and the fleet's recent faults."""
    up = runtime.upstreams
    inventory, health = await asyncio.gather(
        up.get(Service.ORCHESTRATOR, "/v1/nodes"), up.get(Service.DETECTOR, "/v1/node-health")
    )
    rows = merge_nodes(inventory, health)
    faulty = [r for r in rows if r.health and (r.health.get("fault_count") or r.health.get("quarantine_recommended"))]
    details = list(await asyncio.gather(*(up.get(Service.DETECTOR, f"/v1/node-health/{r.node_id}") for r in faulty)))
    for row, detail in zip(faulty, details, strict=True):
        row.recommendations = list((detail.data or {}).get("recommendations", [])) if detail.ok else []
    context = {
        "section": "nodes",
        "inventory": inventory,
        "health": health,
        "rows": rows,
        "faults": recent_faults(details),
    }
    return page(request, "nodes.html", context)
