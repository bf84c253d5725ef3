"""Launching a job's ranks with a fresh rendezvous: publish the placement, then a fenced launch to every node."""

from __future__ import annotations

from dataclasses import dataclass

from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.events import CommandAction, JobPlacement, RankAssignment
from reprise_orchestrator.agents import NodeAnswer, command_nodes
from reprise_orchestrator.jobs.models import JobCreate
from reprise_orchestrator.nodes.inventory import Inventory
from reprise_orchestrator.registry_client import RestorePoint


@dataclass(frozen=True)
class Rendezvous:
    """One restart epoch's rendezvous."""

    restart_epoch: int
    master_addr: str
    master_port: int


def master_port_for(base: int, epoch: int) -> int:
    """A new port every epoch, so a half-dead earlier group can never join the new one."""
    return base + epoch % 1000


def rendezvous_for(ranks: list[RankAssignment], *, epoch: int, inventory: Inventory, port_base: int) -> Rendezvous:
    """Rank 0's node hosts the rendezvous, on a port of this epoch."""
    master = next(r for r in ranks if r.rank == 0)
    return Rendezvous(epoch, inventory.address(master.node_id), master_port_for(port_base, epoch))


async def launch(
    bus: Bus,
    *,
    operation_id: str,
    job_id: str,
    fence: int,
    spec: JobCreate,
    ranks: list[RankAssignment],
    rendezvous: Rendezvous,
    restore: RestorePoint | None,
    timeout_s: float,
) -> list[NodeAnswer]:
    """Publish the placement for the detector, then launch every node's ranks; returns each node's answer."""
    placement = JobPlacement(
        source="orchestrator",
        job_id=job_id,
        restart_epoch=rendezvous.restart_epoch,
        world_size=len(ranks),
        ranks=ranks,
        hang_timeout_s=spec.policy.hang_timeout_s,
    )
    await bus.publish(subjects.placement(job_id), placement, msg_id=f"{operation_id}:placement")
    by_node: dict[str, list[dict[str, object]]] = {}
    for r in ranks:  # one pass: thousands of nodes times their ranks must not block the loop
        by_node.setdefault(r.node_id, []).append(r.model_dump(mode="json"))
    args_by_node = {
        node_id: {
            "restart_epoch": rendezvous.restart_epoch,
            "world_size": len(ranks),
            "master_addr": rendezvous.master_addr,
            "master_port": rendezvous.master_port,
            "command": spec.command,
            "env": spec.env,
            "cwd": spec.working_dir,
            "resume_checkpoint": restore.path if restore else None,
            "ranks": by_node[node_id],
        }
        for node_id in placement.nodes()
    }
    return await command_nodes(
        bus,
        operation_id=operation_id,
        job_id=job_id,
        fence=fence,
        action=CommandAction.LAUNCH,
        args_by_node=args_by_node,
        timeout_s=timeout_s,
    )
