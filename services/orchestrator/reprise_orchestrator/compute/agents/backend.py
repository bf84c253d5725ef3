"""The built-in compute backend: Reprise's own agents, one per node, commanded over NATS request/reply.

Each command carries an id (`<operation>:<action>:<node>`, so a resend is executed once) and the job's fence (an
agent refuses one lower than the highest it saw for the job). A node where nothing listens answers at once that no
one will reply: its agent is gone. The usable nodes are the ones whose reports are fresh and whose GPUs are usable.
A containerized job's launch also tells the pool's spares to keep standby containers of its image ready, so that a
rank moved to one (XID 79, node loss) starts warm there too, and its end tells them to drop them (docs/containers.md).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Mapping, Sequence, Set

from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.clock import utcnow
from reprise_common.errors import BusError
from reprise_common.events import (
    AgentCommand,
    CaptureStacksCommand,
    CaptureStacksReply,
    LaunchCommand,
    LaunchReply,
    PrepareStandbysArgs,
    PrepareStandbysCommand,
    PrepareStandbysReply,
    RankAssignment,
    StackCapture,
    StandbyOrder,
    StopArgs,
    StopCommand,
    StopReply,
)
from reprise_common.logging import get_logger
from reprise_orchestrator.compute.backend import (
    Answers,
    InPlace,
    LaunchRequest,
    NodeAnswer,
    NodePool,
    ReplyT,
    SignalSink,
)
from reprise_orchestrator.inventory import Inventory

log = get_logger("reprise.orchestrator.compute")

# A containerized launch's spares are told to keep its standby containers once its ranks train, or this long after it
# (a job whose ranks report no step); the reports are looked at every PREPARE_LOOK_S at most.
PREPARE_WAIT_S = 60.0
PREPARE_LOOK_S = 0.05


class AgentsBackend:
    """Runs ranks through the platform's own agents."""

    name = "agents"

    def __init__(
        self,
        *,
        bus: Bus,
        inventory: Inventory,
        command_timeout_s: float,
        stop_grace_s: float,
        stack_capture_s: float = 2.0,
        in_place_limit_s: float = 5.0,
        standby_spares: int = 2,
        prepare_wait_s: float = PREPARE_WAIT_S,
    ) -> None:
        self.bus = bus
        self.inventory = inventory
        self.command_timeout_s = command_timeout_s
        self.stop_grace_s = stop_grace_s
        self.stack_capture_s = stack_capture_s
        self.in_place_limit_s = in_place_limit_s
        self.standby_spares = standby_spares
        self.prepare_wait_s = prepare_wait_s
        self._preparing: set[asyncio.Task[None]] = set()  # spares told to keep a job's standby containers
        self._cordoned: set[str] = set()  # nodes this replica cordoned

    def pool(self, *, exclude: Set[str] = frozenset(), job_id: str | None = None) -> NodePool:
        """Nodes with fresh reports and usable GPUs, workers and spares apart (any job may use any of them), but
        those this replica cordoned: a placement leaves every cordoned node out anyway, and the spares told to keep
        a job's standby containers must be left out too (a GPU that fell off the bus may report healthy again)."""
        exclude = exclude | self._cordoned
        return NodePool(
            workers=self.inventory.placeable(exclude=exclude),
            spares=self.inventory.placeable(spares=True, exclude=exclude),
        )

    def known_nodes(self) -> int:
        """Every node that has reported."""
        return self.inventory.known()

    async def launch(self, request: LaunchRequest, *, operation_id: str, fence: int) -> Answers[LaunchReply]:
        """One launch per node, carrying that node's ranks and the job-wide rendezvous."""
        by_node: dict[str, list[RankAssignment]] = {}
        for rank in request.args.ranks:  # one pass: thousands of nodes times their ranks must not block the loop
            by_node.setdefault(rank.node_id, []).append(rank)
        issued_at = utcnow()
        commands = {
            node_id: LaunchCommand(
                command_id=f"{operation_id}:launch:{node_id}",
                job_id=request.job_id,
                fence=fence,
                issued_at=issued_at,
                args=request.args.model_copy(update={"ranks": ranks}),
            )
            for node_id, ranks in by_node.items()
        }
        answers = await self._command(commands, LaunchReply, timeout_s=self.command_timeout_s)
        if request.args.container is not None and self.standby_spares > 0 and answers.all_done:
            task = asyncio.create_task(
                self._prepare_spares(
                    request, self.standby_spares, exclude=set(by_node), operation_id=operation_id, fence=fence
                ),
                name=f"standbys:{request.job_id}",
            )
            self._preparing.add(task)
            task.add_done_callback(self._preparing.discard)
        return answers

    async def _prepare_spares(
        self, request: LaunchRequest, count: int, *, exclude: Set[str], operation_id: str, fence: int
    ) -> None:
        """Tell the spares a containerized job's ranks would move to first (`count` of them, in the order
        placement takes them) to keep standby containers of it, in the background: the launch does not wait. Every
        spare keeping every job's standbys would hold jobs times spares containers of ~300 MB each.

        They are told once the launch's ranks train (every one reported a step), or `prepare_wait_s` after the launch
        (a job whose ranks report none): making a standby container costs the daemon and the host CPU, which a
        launch's ranks, starting or recovering, need more (where nodes share a host, as in the bench,
        the spare's work competes with them for the same cores). The spares are chosen then, among the nodes still
        placeable (not one whose agent a command just found gone, as a recovery's stop finds a lost node's)."""
        await self._until_training(request)
        args = request.args
        assert args.container is not None
        checkpoints = args.checkpoints.directory if args.checkpoints is not None else None
        spares = [
            node_id
            for node_id in self.pool().spares
            if node_id not in exclude and self.inventory.container_refusal(node_id, args.container, checkpoints) is None
        ][:count]
        if not spares:
            return
        most = max(Counter(rank.node_id for rank in args.ranks).values(), default=1)
        order = PrepareStandbysArgs(
            container=args.container, command=args.command, env=args.env, cwd=args.cwd, checkpoints=args.checkpoints,
            ranks_per_node=most,
        )  # fmt: skip
        commands = {
            node_id: PrepareStandbysCommand(
                command_id=f"{operation_id}:prepare-standbys:{node_id}", job_id=request.job_id, fence=fence, args=order
            )
            for node_id in spares
        }
        await self._send_spares(request.job_id, commands)

    async def _until_training(self, request: LaunchRequest) -> None:
        """Until every rank of the launch reported a step (in its restart epoch), at most `prepare_wait_s`."""
        wanted = {rank.rank for rank in request.args.ranks}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.prepare_wait_s
        while (left := deadline - loop.time()) > 0:
            seen = self.inventory.ranks_of(request.job_id, restart_epoch=request.args.restart_epoch)
            if all(rank in seen and seen[rank].step is not None for rank in wanted):
                return
            await self.inventory.next_reports(min(left, 1.0))
            await asyncio.sleep(min(PREPARE_LOOK_S, max(deadline - loop.time(), 0)))

    async def drop_standbys(self, job_id: str, *, operation_id: str, fence: int) -> None:
        """Tell the pool's spares to drop the job's standby containers (in the background); a spare missed (gone, or
        not a spare now) drops them when their `hold_s` runs out."""
        order = PrepareStandbysArgs(order=StandbyOrder.DROP)
        commands = {
            node_id: PrepareStandbysCommand(
                command_id=f"{operation_id}:drop-standbys:{node_id}", job_id=job_id, fence=fence, args=order
            )
            for node_id in self.pool().spares
        }
        if commands:
            task = asyncio.create_task(self._send_spares(job_id, commands), name=f"standbys:{job_id}")
            self._preparing.add(task)
            task.add_done_callback(self._preparing.discard)

    async def _send_spares(self, job_id: str, commands: Mapping[str, PrepareStandbysCommand]) -> None:
        """Send the spares their standby orders; a spare that keeps none, or did not take a drop, is logged."""
        answers = await self._command(commands, PrepareStandbysReply, timeout_s=self.command_timeout_s)
        for answer in answers.items:
            kept = answer.reply.data.standbys if answer.reply is not None and answer.ok else None
            if commands[answer.node_id].args.order is StandbyOrder.DROP:
                if kept is None:
                    log.info("a spare did not drop the job's standbys", extra=_why(job_id, answer))
            elif not kept:
                log.info("a spare keeps no standbys", extra=_why(job_id, answer))

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
        """A stop with the grace period to each node (parking first, for a restart in place); the wait covers all of
        it. With `stacks_for`, every node captures its ranks' stacks first, and the stop goes to none before all have
        answered (or the capture's bound has passed): one node's stopped rank would end its peers' collective on the
        others before their stacks were read."""
        if stacks_for is not None:
            await self._capture_stacks(job_id, node_ids, operation_id=operation_id, fence=fence, incident_id=stacks_for)
        issued_at = utcnow()
        cold = StopArgs(grace_s=self.stop_grace_s)
        parking = cold
        if in_place is not None:
            parking = cold.model_copy(
                update={"park_within_s": self.in_place_limit_s, "kill_ranks": sorted(in_place.kill_ranks)}
            )
        timeout_s = self.command_timeout_s + self.stop_grace_s
        timeout_s += self.in_place_limit_s if in_place is not None else 0.0
        commands = {
            node_id: StopCommand(
                command_id=f"{operation_id}:stop:{node_id}",
                job_id=job_id,
                fence=fence,
                issued_at=issued_at,
                args=cold if in_place is None or node_id in in_place.cold_nodes else parking,
            )
            for node_id in dict.fromkeys(node_ids)
        }
        answers = await self._command(commands, StopReply, timeout_s=timeout_s)
        for answer in answers.items:  # what the nodes' reports from before the stop still show alive has ended
            if answer.ok and answer.reply is not None and (ended := answer.reply.data.ended_at) is not None:
                self.inventory.stopped(answer.node_id, job_id, ended=ended, parked=set(answer.reply.data.parked))
        return answers

    async def _capture_stacks(
        self, job_id: str, node_ids: Sequence[str], *, operation_id: str, fence: int, incident_id: str
    ) -> None:
        """Every node's ranks' stacks for the incident, read while all of them still run (evidence only: a node
        that does not answer is left to the stop that follows)."""
        order = StackCapture(incident_id=incident_id, within_s=self.stack_capture_s)
        commands = {
            node_id: CaptureStacksCommand(
                command_id=f"{operation_id}:stacks:{node_id}", job_id=job_id, fence=fence, args=order
            )
            for node_id in dict.fromkeys(node_ids)
        }
        answers = await self._command(
            commands, CaptureStacksReply, timeout_s=self.command_timeout_s + self.stack_capture_s
        )
        for answer in answers.items:
            if not answer.ok:
                extra = {**_why(job_id, answer), "incident_id": incident_id}
                log.info("a node did not capture its ranks' stacks", extra=extra)

    async def _command(
        self, commands: Mapping[str, AgentCommand], reply_type: type[ReplyT], *, timeout_s: float
    ) -> Answers[ReplyT]:
        """command_nodes, and a node where no agent listens is not offered again until it reports again."""
        answers = await command_nodes(self.bus, commands, reply_type, timeout_s=timeout_s)
        for node_id in answers.gone():
            self.inventory.agent_gone(node_id)
        return answers

    async def cordon(self, node_id: str, *, reason: str) -> None:
        """Nothing to tell the agent: it takes ranks only from launches, and placement leaves cordoned nodes out; the
        pool leaves it out too."""
        self._cordoned.add(node_id)
        log.info("node cordoned", extra={"node_id": node_id, "reason": reason})

    async def uncordon(self, node_id: str) -> None:
        """Nothing to tell the agent (see cordon)."""
        self._cordoned.discard(node_id)
        log.info("node uncordoned", extra={"node_id": node_id})

    async def watch(self, emit: SignalSink) -> None:
        """No signals of its own: the agents publish their nodes' events to the detector themselves."""
        return

    async def close(self) -> None:
        """The bus belongs to the orchestrator; the spares' preparations still being sent are cancelled."""
        for task in list(self._preparing):
            task.cancel()
        await asyncio.gather(*self._preparing, return_exceptions=True)


def _why(job_id: str, answer: NodeAnswer[CaptureStacksReply] | NodeAnswer[PrepareStandbysReply]) -> dict[str, str]:
    detail = answer.reply.detail if answer.reply is not None else str(answer.error)
    return {"job_id": job_id, "node_id": answer.node_id, "why": detail}


async def command_nodes(
    bus: Bus, commands: Mapping[str, AgentCommand], reply_type: type[ReplyT], *, timeout_s: float
) -> Answers[ReplyT]:
    """Send each node its command at once; every node's answer read as `reply_type` (the command's), or the bus
    error saying why none came."""
    subject_of = {node_id: subjects.node_command(node_id) for node_id in commands}
    replies = await bus.request_many(
        {subject_of[node_id]: command for node_id, command in commands.items()}, reply_type, timeout=timeout_s
    )
    found: list[NodeAnswer[ReplyT]] = []
    for node_id, subject in subject_of.items():
        reply = replies[subject]
        if isinstance(reply, BusError):
            found.append(NodeAnswer(node_id=node_id, reply=None, error=reply))
        else:
            found.append(NodeAnswer(node_id=node_id, reply=reply))
    return Answers(tuple(found))
