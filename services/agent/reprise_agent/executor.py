"""What the node's commands do: ping, launch a job's ranks here, capture their stacks (a hang's evidence), stop them
(parked where a restart in place follows), keep a containerized job's standbys (a spare). Fencing and idempotency around
them are the CommandBook's (commands.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from reprise_agent import foreign_restore, node_events
from reprise_agent.commands import CommandBook
from reprise_agent.depchecks.checker import DependencyChecker
from reprise_agent.foreign_checkpoints import ForeignCheckpoints
from reprise_agent.launch.container_policy import LaunchRefusedError
from reprise_agent.launch.spare_standbys import standby_env, standby_launch
from reprise_agent.numeric import NumericWatcher
from reprise_agent.outbox import Outbox
from reprise_agent.progress.book import ProgressBook
from reprise_agent.ranks import RankSupervisor
from reprise_agent.stacks import capture
from reprise_common import subjects
from reprise_common.clock import utcnow
from reprise_common.errors import MalformedEventError
from reprise_common.events import (
    AgentReply,
    CaptureStacksCommand,
    CaptureStacksData,
    CaptureStacksReply,
    CommandResult,
    LaunchCommand,
    LaunchData,
    LaunchReply,
    PingCommand,
    PingData,
    PingReply,
    PrepareStandbysCommand,
    PrepareStandbysData,
    PrepareStandbysReply,
    RankStopped,
    StandbyOrder,
    StopCommand,
    StopData,
    StopReply,
    Wire,
    parse_command,
)
from reprise_common.logging import get_logger

log = get_logger("reprise.agent")
CAPTURES_REMEMBERED = 256  # incidents whose stacks this agent captured (a repeated stop does not capture again)


class CommandExecutor:
    """Carries out the commands the book lets through, on this node's ranks."""

    def __init__(
        self,
        *,
        node_id: str,
        spare: bool,
        book: CommandBook,
        supervisor: RankSupervisor,
        progress: ProgressBook,
        numeric: NumericWatcher,
        foreign: ForeignCheckpoints,
        depchecks: DependencyChecker,
        outbox: Outbox,
        py_spy: Path | None,
    ) -> None:
        self.node_id = node_id
        self.spare = spare
        self.book = book
        self.supervisor = supervisor
        self.progress = progress
        self.numeric = numeric
        self.foreign = foreign
        self.depchecks = depchecks
        self.outbox = outbox
        self.py_spy = py_spy
        self.stopping_jobs: set[str] = set()  # jobs whose stop (or park) this agent is carrying out now
        self._captured: dict[str, None] = {}  # incident ids, oldest first

    async def on_command(self, data: bytes) -> Wire:
        """Parse a command and run it through the book (at most once, fenced)."""
        try:
            command = parse_command(data)
        except MalformedEventError as exc:
            return AgentReply(
                command_id="", node_id=self.node_id, result=CommandResult.FAILED, detail=f"bad command: {exc}"
            )
        return await self.book.run(command, self._execute)

    async def _execute(
        self, command: PingCommand | LaunchCommand | StopCommand | PrepareStandbysCommand | CaptureStacksCommand
    ) -> AgentReply:
        done = {"command_id": command.command_id, "node_id": self.node_id, "result": CommandResult.DONE}
        if isinstance(command, PingCommand):
            return PingReply(**done, data=PingData(ranks=len(self.supervisor.ranks()), spare=self.spare))
        if isinstance(command, CaptureStacksCommand):
            return CaptureStacksReply(**done, data=await self._capture_stacks(command))
        if isinstance(command, StopCommand):
            return StopReply(**done, data=await self._stop(command))
        if isinstance(command, PrepareStandbysCommand):
            return PrepareStandbysReply(**done, data=self._prepare_standbys(command))
        try:
            return LaunchReply(**done, data=await self._launch(command))
        except foreign_restore.RestoreRefusedError as exc:  # no rank starts on it: the recovery falls back
            return LaunchReply(
                command_id=command.command_id,
                node_id=self.node_id,
                result=CommandResult.FAILED,
                detail=str(exc),
                data=LaunchData(restore_refused=exc.problem),
            )

    async def _launch(self, command: LaunchCommand) -> LaunchData:
        """Start the job's ranks here; a script's own restored checkpoint is re-hashed first and handed to it
        (RestoreRefusedError when it differs)."""
        spec = ready = command.args
        if foreign_restore.restores_own_checkpoint(spec):
            ready = await asyncio.to_thread(foreign_restore.prepared, spec)
        pids, in_place = await self.supervisor.launch(command.job_id, ready)
        self.foreign.launched(command.job_id, spec)
        for assignment in spec.ranks:  # startup begins now; a no-op for a rank that already reported
            self.progress.begin(command.job_id, assignment.rank, restart_epoch=spec.restart_epoch)
        return LaunchData(pids=pids, in_place=in_place)

    def _prepare_standbys(self, command: PrepareStandbysCommand) -> PrepareStandbysData:
        """Keep (or drop) standby containers of a job whose ranks may move here; refused as a launch of it would be
        (no Docker daemon, this node's rules, its image missing)."""
        containers, args = self.supervisor.containers, command.args
        if containers is None:
            raise LaunchRefusedError("container: this node runs no containers (its agent has no REPRISE_DOCKER_URL)")
        if args.order is StandbyOrder.DROP:
            containers.drop_standbys(command.job_id)
            return PrepareStandbysData(standbys=0)
        launch = standby_launch(args, node_id=self.node_id)
        env = standby_env(
            command.job_id, launch, node_id=self.node_id, sdk_socket=self.supervisor.sdk_socket,
            inbox_dir=self.supervisor.inbox_dir,
        )  # fmt: skip
        return PrepareStandbysData(standbys=containers.prepare_standbys(launch, env, hold_s=args.hold_s))

    async def _stop(self, command: StopCommand) -> StopData:
        """Stop the job's ranks here; for a restart in place, the culprits first, then park whoever can. Ranks that
        park meanwhile were parked by the recovery: their peer errors are no evidence of a lost node, so no
        rank.parked is published for them."""
        job_id, args = command.job_id, command.args
        self.stopping_jobs.add(job_id)
        try:
            self.depchecks.clear_rendezvous(job_id)
            kept: set[int] = set()
            stopped = []
            if args.park_within_s is not None:  # a restart in place: who can, parks; the rest is stopped
                # The culprits go first: a frozen rank holds its peers in their collective until it is gone.
                kill = set(args.kill_ranks)
                others = {r.rank for r in self.supervisor.ranks() if r.job_id == job_id} - kill
                stopped = await self.supervisor.stop(job_id, grace_s=args.grace_s, keep=others)
                parked = await self.supervisor.park(job_id, within_s=args.park_within_s, kill=kill)
                kept = {r.rank for r in parked}
            stopped += await self.supervisor.stop(job_id, grace_s=args.grace_s, keep=kept)
        finally:
            self.stopping_jobs.discard(job_id)
        self.progress.forget(job_id)
        self.numeric.forget(job_id)
        outcomes = {r.rank: RankStopped(rank=r.rank, exit_code=r.exit_code, signal=r.exit_signal) for r in stopped}
        return StopData(stopped=list(outcomes.values()), parked=sorted(kept), ended_at=utcnow())

    async def _capture_stacks(self, command: CaptureStacksCommand) -> CaptureStacksData:
        """Publish the Python stacks of the job's live ranks here, once per incident, within the order's bound; the
        ranks keep running (a stop follows once every node has captured)."""
        job_id, order = command.job_id, command.args
        if order.incident_id in self._captured:
            return CaptureStacksData(captured=[], failed=[])
        self._captured[order.incident_id] = None
        while len(self._captured) > CAPTURES_REMEMBERED:
            del self._captured[next(iter(self._captured))]
        ranks = [r for r in self.supervisor.ranks() if r.job_id == job_id and r.alive]
        found = await capture([r.handle for r in ranks], py_spy=self.py_spy, within_s=order.within_s)
        for rank in ranks:
            event = node_events.rank_stacks(
                self.node_id, rank, incident_id=order.incident_id, found=found[rank.handle.pid]
            )
            self.outbox.put(subjects.node_event(self.node_id, event.type), event)
        failed = sorted(r.rank for r in ranks if found[r.handle.pid].error)
        log.info(
            "rank stacks captured",
            extra={"job_id": job_id, "incident_id": order.incident_id, "ranks": len(ranks), "failed": failed},
        )
        return CaptureStacksData(captured=sorted(r.rank for r in ranks), failed=failed)
