"""Placement: ranks onto nodes, and re-placement after a fault (spares first, else shrink, else wait)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from reprise_common.errors import ConflictError, RepriseError
from reprise_common.events import RankAssignment
from reprise_orchestrator.compute.backend import NodePool
from reprise_orchestrator.inventory import Inventory
from reprise_orchestrator.jobs.models import JobCreate, RecoveryPolicy


class PlacementDecision(StrEnum):
    """How a recovery re-places a job."""

    SAME = "same"  # every node is still usable
    SPARES = "spares"  # every unusable node is replaced by a spare, in its place (rank numbers stay)
    SHRINK = "shrink"  # not enough spares: run on fewer nodes, within the policy's elastic minimum
    WAIT = "wait"  # neither: wait for capacity


@dataclass(frozen=True)
class Replan:
    """The nodes a job runs on after a recovery, and why."""

    decision: PlacementDecision
    nodes: list[str]
    replaced: dict[str, str] = field(default_factory=dict)  # unusable node → the spare that takes its place
    dropped: list[str] = field(default_factory=list)  # unusable nodes nobody replaces


def replan(current: list[str], *, usable: set[str], spares: list[str], policy: RecoveryPolicy) -> Replan:
    """Keep usable nodes in order; put free spares in the places of unusable ones; shrink or wait for the rest."""
    lost = [node for node in current if node not in usable]
    if not lost:
        return Replan(PlacementDecision.SAME, list(current))
    running = set(current)  # a set: thousands of spares must not each scan thousands of nodes
    free = [spare for spare in spares if spare not in running] if policy.use_spares else []
    replaced = dict(zip(lost, free, strict=False))
    nodes = [replaced.get(node, node) for node in current if node in usable or node in replaced]
    dropped = [node for node in lost if node not in replaced]
    if not dropped:
        return Replan(PlacementDecision.SPARES, nodes, replaced)
    if policy.elastic_min_nodes is not None and len(nodes) >= policy.elastic_min_nodes:
        return Replan(PlacementDecision.SHRINK, nodes, replaced, dropped)
    return Replan(PlacementDecision.WAIT, nodes, replaced, dropped)


def replacements(pool: NodePool, current: list[str]) -> list[str]:
    """The nodes that may take the places of a job's unusable ones, in order: its spares, then idle healthy workers
    (a running job waits for nobody, while a new job can wait for capacity). `pool` holds no busy or cordoned node."""
    running = set(current)
    return [*pool.spares, *(node for node in pool.workers if node not in running)]


class ContainerRefusedError(RepriseError):
    """No node the job could run on runs its container: `field` names what they refuse (a 422 at submission)."""

    def __init__(self, field: tuple[str | int, ...], why: str) -> None:
        super().__init__(why)
        self.field = field


def container_fit(spec: JobCreate, pool: NodePool, inventory: Inventory) -> NodePool:
    """The pool less the nodes whose agents would refuse the job's container, by what their reports say they allow
    (the whole pool for a job without one)."""
    if spec.container is None:
        return pool
    container, checkpoints = spec.container, spec.checkpoints.directory if spec.checkpoints else None

    def fits(node_id: str) -> bool:
        return inventory.container_refusal(node_id, container, checkpoints) is None

    return NodePool(workers=[n for n in pool.workers if fits(n)], spares=[n for n in pool.spares if fits(n)])


def refuse_unrunnable_container(spec: JobCreate, pool: NodePool, fit: NodePool, inventory: Inventory) -> None:
    """ContainerRefusedError when a usable node the job names refuses its container, or, when it names none, every
    usable node does (`fit`: container_fit of `pool`); no usable node at all is a matter of capacity, not of the
    spec."""
    if spec.container is None:
        return
    usable, fitting = pool.usable(), fit.usable()
    if spec.nodes is not None:
        refusing = [node for node in spec.nodes if node in usable and node not in fitting]
    else:
        refusing = sorted(usable) if not fitting else []
    if not refusing:
        return
    checkpoints = spec.checkpoints.directory if spec.checkpoints else None
    refused = inventory.container_refusal(refusing[0], spec.container, checkpoints)
    assert refused is not None
    field, why = refused
    raise ContainerRefusedError(field, why if spec.nodes is not None else f"{why}; no usable node runs this container")


def choose_nodes(spec: JobCreate, pool: NodePool) -> list[str]:
    """The nodes a new job runs on: the ones it names (each must be usable), or the first N usable workers.

    `pool` holds what the compute backend can place on now, without cordoned nodes and nodes other jobs hold.
    """
    if spec.nodes is not None:
        usable = pool.usable()
        missing = [node for node in spec.nodes if node not in usable]
        if missing:
            raise ConflictError(
                f"nodes not available (unknown, stale, unhealthy, cordoned or busy): {', '.join(missing)}"
            )
        return list(spec.nodes)
    workers = pool.workers
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
