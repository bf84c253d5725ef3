"""A second compute backend for the tests: a scheduler of its own, with nothing but the protocol and a setting.

It stands where a cluster scheduler cannot run here: it owns its node list (three workers and a spare), records what
it was asked (launches, stops, cordons), answers every command itself, and reports each launched rank's progress as
the node agents a scheduler would start would (node reports on NATS, so the orchestrator verifies the recovery as it
verifies any). Its watch emits one failure signal, as a scheduler reports a node it set down.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence, Set
from dataclasses import dataclass, field

from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.events import (
    CommandResult,
    ComputeSignal,
    ComputeSignalKind,
    ContainerSupport,
    GpuStatus,
    LaunchReply,
    NodeReport,
    RankStatus,
    StopReply,
)
from reprise_orchestrator.compute.backend import (
    Answers,
    InPlace,
    LaunchRequest,
    NodeAnswer,
    NodePool,
    ReplyT,
    SignalSink,
)
from reprise_orchestrator.compute.choose import BackendContext

WORKERS = ("d-1", "d-2", "d-3")
SPARES = ("d-spare",)
DOWN_NODE = "d-3"  # the node its watch reports as set down by the scheduler


@dataclass
class Calls:
    """What the backend was asked, in order."""

    launches: list[tuple[int, list[str]]] = field(default_factory=list)  # (restart epoch, nodes)
    stops: list[list[str]] = field(default_factory=list)
    stacks_for: list[str | None] = field(default_factory=list)  # what each stop asked to capture stacks for
    cordons: list[tuple[str, str]] = field(default_factory=list)  # (node, reason)
    uncordons: list[str] = field(default_factory=list)
    dropped_standbys: list[str] = field(default_factory=list)  # jobs whose spares' standbys were let go


CALLS = Calls()  # one backend per test process: the test reads what the app's backend was asked


class SchedulerDouble:
    """The protocol, implemented against an in-memory cluster."""

    name = "double"

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.ranks: dict[str, list[RankStatus]] = {node: [] for node in (*WORKERS, *SPARES)}
        self._reporter: asyncio.Task[None] | None = None

    def pool(self, *, exclude: Set[str] = frozenset(), job_id: str | None = None) -> NodePool:
        """Its own nodes, less the excluded ones."""
        return NodePool(
            workers=[n for n in WORKERS if n not in exclude], spares=[n for n in SPARES if n not in exclude]
        )

    def known_nodes(self) -> int:
        """Every node it owns."""
        return len(WORKERS) + len(SPARES)

    async def launch(self, request: LaunchRequest, *, operation_id: str, fence: int) -> Answers[LaunchReply]:
        """Start the ranks (as reported progress) and answer for each node."""
        self._report_forever()
        epoch = request.args.restart_epoch
        CALLS.launches.append((epoch, request.nodes()))
        for node in request.nodes():
            self.ranks[node] = [
                RankStatus(job_id=request.job_id, rank=r.rank, restart_epoch=epoch, step=1, phase="training")
                for r in request.args.ranks
                if r.node_id == node
            ]
        await self._report()
        return self._done(request.nodes(), f"{operation_id}:launch", LaunchReply)

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
        """Forget the job's ranks on these nodes."""
        CALLS.stops.append(list(node_ids))
        CALLS.stacks_for.append(stacks_for)
        for node in node_ids:
            self.ranks[node] = [r for r in self.ranks.get(node, []) if r.job_id != job_id]
        return self._done(node_ids, f"{operation_id}:stop", StopReply)

    async def drop_standbys(self, job_id: str, *, operation_id: str, fence: int) -> None:
        """Record it."""
        CALLS.dropped_standbys.append(job_id)

    async def cordon(self, node_id: str, *, reason: str) -> None:
        """Record it (a scheduler would drain the node with the reason)."""
        CALLS.cordons.append((node_id, reason))

    async def uncordon(self, node_id: str) -> None:
        """Record it."""
        CALLS.uncordons.append(node_id)

    async def watch(self, emit: SignalSink) -> None:
        """Report one node set down by the scheduler."""
        await emit(
            ComputeSignal(source="double", backend=self.name, kind=ComputeSignalKind.NODE_DOWN, node_id=DOWN_NODE)
        )

    async def close(self) -> None:
        """Stop reporting."""
        if self._reporter is not None:
            self._reporter.cancel()

    def _done(self, node_ids: Sequence[str], command_id: str, reply_type: type[ReplyT]) -> Answers[ReplyT]:
        return Answers(
            tuple(
                NodeAnswer(
                    node_id=node,
                    reply=reply_type(command_id=f"{command_id}:{node}", node_id=node, result=CommandResult.DONE),
                )
                for node in node_ids
            )
        )

    def _report_forever(self) -> None:
        if self._reporter is None:
            self._reporter = asyncio.create_task(self._reports())

    async def _reports(self) -> None:
        while True:
            await self._report()
            await asyncio.sleep(0.3)

    async def _report(self) -> None:
        for node, ranks in self.ranks.items():
            stepped = [r.model_copy(update={"step": (r.step or 0) + 1}) for r in ranks]
            self.ranks[node] = stepped
            report = NodeReport(
                source=node,
                node_id=node,
                address="127.0.0.1",
                interval_s=0.3,
                gpu_backend="double",
                gpus=[GpuStatus(index=0)],
                ranks=stepped,
                spare=node in SPARES,
                containers=ContainerSupport(),  # any image, nothing mounted
            )
            await self.bus.publish_snapshot(subjects.node_report(node), report)


def create(context: BackendContext) -> SchedulerDouble:
    """The factory REPRISE_COMPUTE_BACKEND names (`backend_double:create`)."""
    return SchedulerDouble(context.bus)
