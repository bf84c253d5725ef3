"""What a scheduler's backend hands to Reprise's agents: the ranks run under an agent on each node whatever placed the
node there (a Slurm allocation, a Kubernetes pod), so launching, stopping and counting nodes are the agents' own."""

from __future__ import annotations

from collections.abc import Sequence

from reprise_common.events import LaunchReply, StopReply
from reprise_orchestrator.compute.agents.backend import AgentsBackend
from reprise_orchestrator.compute.backend import Answers, InPlace, LaunchRequest


class AgentsDelegate:
    """Base of a backend whose ranks run under Reprise's agents: `self.agents` launches, stops and counts."""

    agents: AgentsBackend

    def known_nodes(self) -> int:
        """The nodes whose agents reported: the share a cordon takes is of the nodes Reprise runs on, not of the
        whole cluster."""
        return self.agents.known_nodes()

    async def launch(self, request: LaunchRequest, *, operation_id: str, fence: int) -> Answers[LaunchReply]:
        """The agents on the job's nodes launch the ranks."""
        return await self.agents.launch(request, operation_id=operation_id, fence=fence)

    async def stop(
        self,
        job_id: str,
        node_ids: Sequence[str],
        *,
        operation_id: str,
        fence: int,
        stacks_for: str | None = None,
        in_place: InPlace | None = None,
    ) -> Answers[StopReply]:
        """The agents on the job's nodes stop the ranks (or park them, for a restart in place)."""
        return await self.agents.stop(
            job_id, node_ids, operation_id=operation_id, fence=fence, stacks_for=stacks_for, in_place=in_place
        )

    async def drop_standbys(self, job_id: str, *, operation_id: str, fence: int) -> None:
        """The agents of the pool's spares drop the job's standby containers."""
        await self.agents.drop_standbys(job_id, operation_id=operation_id, fence=fence)
