"""Placement: ranks onto nodes."""

from __future__ import annotations

from reprise_common.errors import ConflictError
from reprise_common.events import RankAssignment
from reprise_orchestrator.jobs.models import JobCreate
from reprise_orchestrator.nodes.inventory import Inventory


def choose_nodes(spec: JobCreate, inventory: Inventory) -> list[str]:
    """The nodes a new job runs on: the ones it names (each must be placeable), or the first N placeable workers."""
    placeable = set(inventory.placeable()) | set(inventory.placeable(spares=True))
    if spec.nodes is not None:
        missing = [node for node in spec.nodes if node not in placeable]
        if missing:
            raise ConflictError(f"nodes not available (unknown, stale or unhealthy): {', '.join(missing)}")
        return list(spec.nodes)
    workers = inventory.placeable()
    assert spec.node_count is not None
    if len(workers) < spec.node_count:
        raise ConflictError(f"job needs {spec.node_count} nodes, {len(workers)} healthy worker nodes are available")
    return workers[: spec.node_count]


def assign_ranks(nodes: list[str], *, ranks_per_node: int, inventory: Inventory) -> list[RankAssignment]:
    """Ranks in node order; each local rank gets the GPU of the same index when the node has one."""
    assignments = []
    for node_index, node_id in enumerate(nodes):
        gpus = inventory.gpu_count(node_id)
        for local_rank in range(ranks_per_node):
            assignments.append(
                RankAssignment(
                    rank=node_index * ranks_per_node + local_rank,
                    node_id=node_id,
                    gpu=local_rank if local_rank < gpus else None,
                    local_rank=local_rank,
                )
            )
    return assignments
