"""The slurm compute backend: Reprise's agents run the ranks inside Slurm's allocations, Slurm owns the nodes.

Launch and stop go to the agents (one per allocated node, started with `srun` inside the job's allocation), exactly
as on the built-in backend, so rank supervision, GPU health and every detection path stay the same; agents' node ids
are Slurm's node names. What Slurm owns goes to Slurm through the one adapter (cli.py): a cordon drains the node with
a reason that `sinfo -R` shows, an uncordon resumes it, nodes Slurm will not schedule on (drained by anyone, down, not
responding) are never offered, a cancel ends the job's allocation, and Slurm's own failure signals (signals.py) are
reported by the poller that `watch` runs.

`pool()` is synchronous (placement does not await), so it answers from the poller's last read of Slurm's nodes. A
read that failed, or one older than two poll intervals plus three command timeouts (the poller is not running), is not
trusted: `pool()` raises SlurmUnavailableError, as every call does when the controller does not answer in time.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping, Set
from pathlib import Path

from reprise_common.clock import Clock
from reprise_common.events import ComputeSignal
from reprise_common.logging import get_logger
from reprise_orchestrator.compute.agents.backend import AgentsBackend
from reprise_orchestrator.compute.agents.delegate import AgentsDelegate
from reprise_orchestrator.compute.allocation import Allocation, AllocationRequest, AllocationState
from reprise_orchestrator.compute.backend import NodePool, SignalSink
from reprise_orchestrator.compute.slurm.batch import AgentLaunch, batch_script
from reprise_orchestrator.compute.slurm.cli import SlurmCli, SlurmError, SlurmUnavailableError
from reprise_orchestrator.compute.slurm.models import SlurmJob, SlurmJobState, SlurmNode, SlurmSubmission
from reprise_orchestrator.compute.slurm.signals import (
    ENDED,
    SlurmView,
    allocation_name,
    controller_unavailable,
    platform_job,
    signals,
)

log = get_logger("reprise.orchestrator.compute.slurm")
ENDING = ENDED | {SlurmJobState.COMPLETING}  # a completing job is ending: nothing left to cancel
REASON_PREFIX = "reprise: "  # how our drains are told from an admin's, which we never overwrite or lift
_REASON_MAX = 255  # what Slurm's reason field (and the adapter) takes
_CONTROL = re.compile(r"[\x00-\x1f\x7f]+")


def drain_reason(reason: str) -> str:
    """The reason our drain carries in Slurm: prefixed, on one line, at most 255 characters."""
    text = " ".join(_CONTROL.sub(" ", reason).split()) or "cordoned"
    return f"{REASON_PREFIX}{text}"[:_REASON_MAX]


def drained_by_us(node: SlurmNode) -> bool:
    """True when the node is drained with one of our reasons."""
    return node.drained and node.reason.startswith(REASON_PREFIX)


class SlurmBackend(AgentsDelegate):
    """Ranks through the agents inside Slurm's allocations; cordons, usable nodes, cancels and signals through Slurm."""

    name = "slurm"

    def __init__(
        self,
        *,
        agents: AgentsBackend,
        cli: SlurmCli,
        clock: Clock,
        poll_interval_s: float,
        partition: str | None = None,
        launch: AgentLaunch | None = None,
    ) -> None:
        self.agents = agents
        self.cli = cli
        self.clock = clock
        self.poll_interval_s = poll_interval_s
        self.partition = partition
        self.agent_launch = launch  # how an allocation starts its agents; None: this replica submits none
        self.max_age_s = 2 * poll_interval_s + 3 * cli.timeout_s
        self._view: SlurmView | None = None
        self._read_at = 0.0  # monotonic, when the last good read began
        self._failure: str | None = None  # why the last read failed; None after a good one
        self._owed: dict[str, str | None] = {}  # node → a drain's reason, or None for a resume, Slurm did not take
        self._outage_told = False  # this outage of the controller was signalled (once per outage)

    def pool(self, *, exclude: Set[str] = frozenset(), job_id: str | None = None) -> NodePool:
        """The agents' usable nodes that Slurm would schedule on now; with `job_id`, only those of that job's running
        allocation (its workers and its own spares: another job's spare runs that job's agent, in its allocation).
        SlurmUnavailableError when Slurm's state is not known (the controller does not answer, or the poller has not
        read it lately)."""
        nodes = self._trusted_nodes()
        if job_id is not None:
            assert self._view is not None  # _trusted_nodes raised otherwise
            allocated = {
                node
                for job in self._view.jobs.values()
                if platform_job(job) == job_id and job.state is SlurmJobState.RUNNING
                for node in job.nodes
            }
            nodes = {name: node for name, node in nodes.items() if name in allocated}
        offered = self.agents.pool(exclude=exclude)
        return NodePool(
            workers=[name for name in offered.workers if name in nodes and nodes[name].schedulable],
            spares=[name for name in offered.spares if name in nodes and nodes[name].schedulable],
        )

    async def cordon(self, node_id: str, *, reason: str) -> None:
        """Drain the node in Slurm with our reason (shown by `sinfo -R`); a node an admin drained keeps the admin's.

        SlurmUnavailableError when the controller does not answer: the drain is then owed, and the poller applies it
        once the controller answers again.
        """
        await self._change(node_id, drain_reason(reason))

    async def uncordon(self, node_id: str) -> None:
        """Resume the node in Slurm when it is drained by us; an admin's drain, or a node Slurm set down, stays.

        SlurmUnavailableError when the controller does not answer: the resume is then owed, as a drain is.
        """
        await self._change(node_id, None)

    async def cancel(self, job_id: str) -> list[int]:
        """End the platform job's allocation in Slurm (scancel); the Slurm job ids cancelled, none when it has none."""
        name = allocation_name(job_id)
        jobs = await self.cli.jobs()
        found = [job for job in jobs if job.name == name and self._ours(job) and job.state not in ENDING]
        for job in found:
            await self.cli.cancel(job.job_id)
            log.info("Slurm allocation cancelled", extra={"job_id": job_id, "slurm_job_id": job.job_id})
        return [job.job_id for job in found]

    async def allocate(self, request: AllocationRequest) -> str:
        """Submit the job's allocation (sbatch, named `reprise-<job id>`, requeueable, kept when a node fails), whose
        batch script starts one agent per node with srun; Slurm's job id."""
        if self.agent_launch is None:
            raise SlurmError("this replica has no agent launch configured (REPRISE_SLURM_AGENT_*): it cannot submit")
        partition = request.partition or self.partition
        if self.partition is not None and partition != self.partition:
            raise SlurmError(
                f"this orchestrator runs its allocations in partition {self.partition!r}, not {partition!r}"
            )
        submission = SlurmSubmission(
            name=allocation_name(request.job_id),
            nodes=request.nodes,
            script=batch_script(request, self.agent_launch),
            partition=partition,
            account=request.account,
            time_limit_min=request.time_limit_min,
            # A lost node is Reprise's to handle (a spare or a shrink, within seconds): without --no-kill Slurm would
            # end the whole allocation, every surviving rank and agent with it, once it sets the node DOWN.
            keep_on_node_failure=True,
            output=Path(request.output) if request.output else None,
            extra_args=request.extra_args,
        )
        slurm_id = await self.cli.submit(submission)
        log.info("Slurm allocation submitted", extra={"job_id": request.job_id, "slurm_job_id": slurm_id})
        return str(slurm_id)

    async def allocations(self) -> dict[str, Allocation]:
        """Each platform job's newest allocation Slurm still knows (squeue), by platform job id."""
        found: dict[str, SlurmJob] = {}
        for job in await self.cli.jobs():
            job_id = platform_job(job)
            if job_id is not None and self._ours(job) and (job_id not in found or job.job_id > found[job_id].job_id):
                found[job_id] = job
        return {job_id: _allocation(job_id, job) for job_id, job in found.items()}

    async def requeue(self, job_id: str, *, exclude: Set[str] = frozenset()) -> list[str] | None:
        """Requeue the job's running allocation in Slurm (requeuehold, ExcNodeList, release) without its nodes in
        `exclude` or that Slurm will not schedule on (drained by anyone, down), and without the nodes an earlier
        requeue left out; the nodes left out, or None (nothing done) when it does not run or holds none of them.

        Its agents end with it; the new allocation starts new ones, after the cluster's cred_expire (10 s here).
        """
        name = allocation_name(job_id)
        running = [
            j for j in await self.cli.jobs() if j.name == name and self._ours(j) and j.state is SlurmJobState.RUNNING
        ]
        if not running:
            return None
        job = max(running, key=lambda j: j.job_id)
        nodes = {node.name: node for node in await self.cli.nodes()}
        bad = [node for node in job.nodes if node in exclude or (node in nodes and not nodes[node].schedulable)]
        if not bad:
            return None
        left_out = sorted({*bad, *job.excluded_nodes})
        await self.cli.requeue(job.job_id, exclude=left_out)
        log.warning(
            "Slurm allocation requeued", extra={"job_id": job_id, "slurm_job_id": job.job_id, "excluded": left_out}
        )
        return left_out

    async def watch(self, emit: SignalSink) -> None:
        """Poll Slurm every interval until cancelled, emitting each transition's signal once; a read that fails is
        logged when it starts and ends failing (the next good read reports what changed meanwhile), and a controller
        silent for longer than its state is trusted is signalled once per outage."""
        while True:
            try:
                found = await self.poll()
            except SlurmUnavailableError as exc:  # logged by poll; pool() refuses until a read succeeds
                found = self._outage(exc)
            except SlurmError:
                found = []  # logged by poll
            for signal in found:
                await emit(signal)
            await asyncio.sleep(self.poll_interval_s)

    async def poll(self) -> list[ComputeSignal]:
        """Read Slurm's nodes and jobs once, after applying any drain or resume still owed; the signals of what
        changed since the last good read (none on the first: it is the baseline)."""
        started = self.clock.monotonic()
        try:
            await self._settle_owed()
            nodes = await self.cli.nodes()
            jobs = await self.cli.jobs()
        except SlurmError as exc:
            if self._failure is None:
                log.warning("Slurm not read", extra={"error": str(exc)})
            self._failure = str(exc)
            raise
        if self._failure is not None:
            log.info("Slurm read again", extra={"after": self._failure})
        view = SlurmView(
            nodes={node.name: node for node in nodes},
            jobs={job.job_id: job for job in jobs if self._ours(job) and platform_job(job) is not None},
        )
        before, self._view, self._read_at, self._failure = self._view, view, started, None
        self._outage_told = False
        return [] if before is None else signals(before, view, backend=self.name)

    def _outage(self, exc: SlurmUnavailableError) -> list[ComputeSignal]:
        """Once the controller has not answered for longer than Slurm's state is trusted (pool() refuses from then
        on), one `controller_unavailable` signal for each of Reprise's jobs Slurm last showed not ended: they run on,
        but no recovery can place, drain or requeue until it answers. Once per outage."""
        if self._outage_told or self._view is None or self.clock.monotonic() - self._read_at <= self.max_age_s:
            return []
        self._outage_told = True
        live = [job for job in self._view.jobs.values() if job.state not in ENDING]  # an ended job needs nothing more
        jobs = sorted({job_id for job in live if (job_id := platform_job(job)) is not None})
        since = f"{self._read_at:.0f}"
        log.error("Slurm controller unavailable", extra={"jobs": jobs, "error": str(exc)})
        return [controller_unavailable(self.name, job_id, since=since, detail=str(exc)) for job_id in jobs]

    async def close(self) -> None:
        """The adapter holds nothing between calls; the agents' backend releases what it holds."""
        await self.agents.close()

    def _trusted_nodes(self) -> Mapping[str, SlurmNode]:
        if self._failure is not None:
            raise SlurmUnavailableError(f"Slurm's node states are not known: {self._failure}")
        if self._view is None:
            raise SlurmUnavailableError("Slurm's node states are not read yet (the Slurm backend's poller has not run)")
        age = self.clock.monotonic() - self._read_at
        if age > self.max_age_s:
            raise SlurmUnavailableError(
                f"Slurm's node states were last read {age:.0f} s ago (more than {self.max_age_s:g} s): not trusted"
            )
        return self._view.nodes

    def _ours(self, job: SlurmJob) -> bool:
        return self.partition is None or job.partition == self.partition

    async def _drain(self, node_id: str, wanted: str) -> None:
        node = await self.cli.node(node_id)
        if node.drained and not drained_by_us(node):
            log.info("node already drained by an admin: reason kept", extra={"node_id": node_id, "reason": node.reason})
            return
        await self.cli.drain(node_id, reason=wanted)
        log.info("node drained in Slurm", extra={"node_id": node_id, "reason": wanted})

    async def _resume(self, node_id: str) -> None:
        node = await self.cli.node(node_id)
        if not drained_by_us(node):
            log.info("node not drained by us: left as Slurm has it", extra={"node_id": node_id, "reason": node.reason})
            return
        await self.cli.resume(node_id)
        log.info("node resumed in Slurm", extra={"node_id": node_id})

    async def _change(self, node_id: str, wanted: str | None) -> None:
        """Drain (with `wanted` as the reason) or resume (None) the node; owed while the controller does not answer."""
        self._owed[node_id] = wanted
        await self._apply(node_id, wanted)

    async def _apply(self, node_id: str, wanted: str | None) -> None:
        try:
            await (self._drain(node_id, wanted) if wanted is not None else self._resume(node_id))
        except SlurmUnavailableError:
            raise
        except SlurmError:
            self._settled(node_id, wanted)  # refused (an unknown node): retrying cannot help
            raise
        self._settled(node_id, wanted)

    def _settled(self, node_id: str, wanted: str | None) -> None:
        if node_id in self._owed and self._owed[node_id] == wanted:  # a newer cordon or uncordon meanwhile stays owed
            del self._owed[node_id]

    async def _settle_owed(self) -> None:
        """Apply the drains and resumes the controller did not take; one that Slurm refuses is logged and dropped."""
        for node_id, wanted in list(self._owed.items()):
            if node_id not in self._owed or self._owed[node_id] != wanted:
                continue  # changed or done meanwhile
            try:
                await self._apply(node_id, wanted)
            except SlurmUnavailableError:
                raise
            except SlurmError as exc:
                log.warning("owed Slurm change refused: dropped", extra={"node_id": node_id, "error": str(exc)})


def _allocation(job_id: str, job: SlurmJob) -> Allocation:
    """A Slurm job as the platform's view of an allocation: running, ended, or waiting (queued, held, requeued, or
    completing: a job Slurm requeues, after a preemption, passes through COMPLETING on its way back to PENDING)."""
    if job.state is SlurmJobState.RUNNING:
        state = AllocationState.RUNNING
    elif job.state in ENDED:
        state = AllocationState.ENDED
    else:
        state = AllocationState.WAITING
    detail = f"Slurm job {job.job_id} {job.state.value}" + (f" ({job.reason})" if job.reason else "")
    nodes = job.nodes if state is AllocationState.RUNNING else ()
    return Allocation(
        job_id=job_id, scheduler_id=str(job.job_id), state=state, nodes=nodes, detail=detail, restarts=job.restart_count
    )
