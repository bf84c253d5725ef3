"""The compute backend: what a scheduler owns, behind one small protocol.

The recovery flow decides *what* happens to a job (which nodes, which checkpoint, which epoch); a backend does it on
the cluster: it launches a job's ranks with a rendezvous and a fence, stops them, cordons and uncordons nodes, says
which nodes are usable (workers and spares), and reports its own failure signals. Reprise's own agents are the first
backend (compute/agents/); a scheduler such as Slurm is another implementation of the same protocol, chosen by the
orchestrator's `REPRISE_COMPUTE_BACKEND` setting (compute/choose.py).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence, Set
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from pydantic import BaseModel, Field

from reprise_common.errors import BusError, NoRespondersError
from reprise_common.events import (
    AgentReply,
    CommandResult,
    ComputeSignal,
    ComputeSignalKind,
    LaunchArgs,
    LaunchReply,
    StopReply,
)

ReplyT = TypeVar("ReplyT", bound=AgentReply)


@dataclass(frozen=True)
class NodeAnswer(Generic[ReplyT]):
    """One node's answer to a command: its typed reply, or the bus error that says why there was none."""

    node_id: str
    reply: ReplyT | None
    error: BusError | None = None

    @property
    def ok(self) -> bool:
        """True when the node executed the command."""
        return self.reply is not None and self.reply.result is CommandResult.DONE

    @property
    def gone(self) -> bool:
        """True when nothing listens for the node's commands: its agent is not running."""
        return isinstance(self.error, NoRespondersError)

    @property
    def stale(self) -> bool:
        """True when the node refused our fence as stale: someone newer owns the job."""
        return self.reply is not None and self.reply.result is CommandResult.REJECTED_STALE_FENCE

    def outcome(self) -> NodeOutcome:
        """What a recovery records of this answer."""
        if self.reply is None:
            return NodeOutcome(node=self.node_id, result="no_answer", error=str(self.error or ""))
        return NodeOutcome(
            node=self.node_id, result=self.reply.result.value, duplicate=self.reply.duplicate, error=self.reply.detail
        )


class NodeOutcome(BaseModel):
    """One node's answer, as recorded."""

    node: str
    result: str = Field(description="done, rejected_stale_fence, failed, or no_answer")
    duplicate: bool = False
    error: str = Field(default="", description="why: the bus error of no answer, or the agent's detail of a failure")


class CommandRecord(BaseModel):
    """What a step records of a command to many nodes: counts by result, and each node that did not execute it.

    Counts rather than one entry per node: a job of thousands of nodes would make every record that large.
    """

    nodes: int = 0
    results: dict[str, int] = Field(default_factory=dict)
    duplicates: int = 0
    not_done: list[NodeOutcome] = Field(default_factory=list)

    def why_not_done(self, *, shown: int = 3, error_chars: int = 200) -> str:
        """The nodes that did not execute the command, and why, in a line bounded whatever the job's size."""
        named = [
            f"{o.node}: {o.result}" + (f" ({o.error[:error_chars]})" if o.error else "") for o in self.not_done[:shown]
        ]
        more = len(self.not_done) - shown
        return "; ".join(named) + (f"; and {more} more" if more > 0 else "")


@dataclass(frozen=True)
class Answers(Generic[ReplyT]):
    """Every node's answer to one command sent to many nodes."""

    items: tuple[NodeAnswer[ReplyT], ...] = ()

    @property
    def stale(self) -> bool:
        """True when any node refused our fence: the caller no longer owns the job."""
        return any(a.stale for a in self.items)

    @property
    def all_done(self) -> bool:
        """True when every node executed the command."""
        return all(a.ok for a in self.items)

    def gone(self) -> list[str]:
        """The nodes where nothing listens, sorted."""
        return sorted(a.node_id for a in self.items if a.gone)

    def record(self) -> CommandRecord:
        """The compact record of these answers."""
        return CommandRecord(
            nodes=len(self.items),
            results=dict(Counter(a.reply.result.value if a.reply else "no_answer" for a in self.items)),
            duplicates=sum(a.reply is not None and a.reply.duplicate for a in self.items),
            not_done=[a.outcome() for a in self.items if not a.ok],
        )


@dataclass(frozen=True)
class LaunchRequest:
    """Launch every rank of a job for one restart epoch: `args.ranks` holds all of them, the backend splits by node."""

    job_id: str
    args: LaunchArgs

    def nodes(self) -> list[str]:
        """The distinct nodes of the launch, in rank order."""
        return list(dict.fromkeys(r.node_id for r in self.args.ranks))


@dataclass(frozen=True)
class NodePool:
    """The nodes a backend can place ranks on now: workers and spares, each sorted by id."""

    workers: list[str] = field(default_factory=list)
    spares: list[str] = field(default_factory=list)

    def usable(self) -> set[str]:
        """Workers and spares together."""
        return {*self.workers, *self.spares}


@dataclass(frozen=True)
class InPlace:
    """A stop that keeps what can restart in place: ranks that can (reprise_sdk.run) park, except the culprits in
    `kill_ranks` and every rank on `cold_nodes` (nodes the job leaves); the backend bounds how long parking may take."""

    kill_ranks: frozenset[int] = frozenset()
    cold_nodes: frozenset[str] = frozenset()


def parked_ranks(answers: Answers[StopReply]) -> list[int]:
    """The ranks the nodes parked for a restart in place (their answers' `parked`), sorted."""
    found: list[int] = []
    for answer in answers.items:
        if answer.reply is not None and answer.ok:
            found.extend(answer.reply.data.parked)
    return sorted(found)


SignalSink = Callable[[ComputeSignal], Awaitable[None]]


class ComputeBackend(Protocol):
    """What the orchestrator needs from whatever runs the ranks (its agents, or a cluster scheduler)."""

    name: str

    def pool(self, *, exclude: Set[str] = frozenset(), job_id: str | None = None) -> NodePool:
        """Usable nodes now (healthy, reachable, not drained by the scheduler), minus `exclude`; with `job_id`, only
        those that job may run on (a scheduler that allocates nodes per job offers its allocation's alone)."""
        ...

    def known_nodes(self) -> int:
        """How many nodes the backend knows (the circuit breaker's denominator)."""
        ...

    async def launch(self, request: LaunchRequest, *, operation_id: str, fence: int) -> Answers[LaunchReply]:
        """Start the job's ranks of a new epoch on every node of the request, under `fence`; each node's answer.

        The same operation id repeated is executed once per node; a node that saw a higher fence refuses (stale).
        """
        ...

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
        """Stop the job's ranks on these nodes (graceful, then killed), under `fence`; silence counts as stopped.

        With `stacks_for` (an incident id: a hang), first capture the ranks' Python stacks as evidence for it (within
        the backend's bound; a capture that fails is reported and does not keep the ranks alive). With `in_place`,
        ranks that can restart in place are parked instead, each node's answer listing them (`parked`).
        """
        ...

    async def drop_standbys(self, job_id: str, *, operation_id: str, fence: int) -> None:
        """The containerized job runs nowhere now: what was kept ready for it on nodes it does not run on (the spares'
        standby containers) is let go, in the background (nothing waits for it)."""
        ...

    async def cordon(self, node_id: str, *, reason: str) -> None:
        """Give the node no new work in the backend too (the orchestrator keeps its own cordon record)."""
        ...

    async def uncordon(self, node_id: str) -> None:
        """Undo `cordon`."""
        ...

    async def watch(self, emit: SignalSink) -> None:
        """Report the backend's own failure signals (a node down, a job preempted) until cancelled."""
        ...

    async def close(self) -> None:
        """Release what the backend holds."""
        ...


def compute_signal(
    backend: str,
    kind: ComputeSignalKind,
    key: Sequence[str],
    *,
    node_id: str | None = None,
    job_id: str | None = None,
    detail: str,
    label: str | None = None,
) -> ComputeSignal:
    """A backend's signal, its event id a digest of what identifies the fault (`label`, by default the kind, and
    `key`): every replica that sees the same fault publishes it under one message id, so it counts once."""
    label = label or kind.value
    digest = hashlib.sha256("\0".join((backend, label, *key)).encode()).hexdigest()[:32]
    return ComputeSignal(
        event_id=f"{backend}-{label}-{digest}",
        source="orchestrator",
        backend=backend,
        kind=kind,
        node_id=node_id,
        job_id=job_id,
        detail=detail[:2000],
    )
