"""The node agent: GPU health, rank supervision, node reports, discrete events and fenced commands."""

from __future__ import annotations

import asyncio
import contextlib
import os
from signal import SIGKILL, SIGSTOP
from typing import Any

import nats.errors
from pydantic import ValidationError

from reprise_agent import foreign_restore
from reprise_agent.commands import CommandBook
from reprise_agent.depchecks import CheckResult, DependencyChecker, rendezvous_job
from reprise_agent.foreign_checkpoints import ForeignCheckpoints
from reprise_agent.gpu.base import GpuBackend, SignalKind
from reprise_agent.gpu.factory import open_backend
from reprise_agent.gpu.sim import SimulatedGpus
from reprise_agent.numeric import NumericWatcher
from reprise_agent.outbox import Outbox
from reprise_agent.progress import ProgressBook, SdkMessage, SdkServer, default_inbox_dir, default_socket_path
from reprise_agent.ranks import LostRank, RankProcess, RankSupervisor
from reprise_agent.settings import AgentSettings
from reprise_agent.stack_sampler import ProcessActivity, StackSampler
from reprise_agent.stacks import capture, find_py_spy
from reprise_agent.standby import StandbyPool
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.clock import SystemClock
from reprise_common.errors import BusError, MalformedEventError
from reprise_common.events import (
    PARKED_WHY_MAX,
    PROCESS_FAULTS,
    RESTORE_REFUSED,
    AgentLifecycle,
    CheckpointSaved,
    CommandReply,
    CommandResult,
    DependencyFailed,
    FaultKind,
    FileDigest,
    GpuLost,
    GpuXid,
    InjectFault,
    InjectReply,
    LaunchCommand,
    NodeReport,
    PingCommand,
    RankExited,
    RankParked,
    RankStacks,
    RankStatus,
    StackCapture,
    StopCommand,
    Wire,
    parse_command,
)
from reprise_common.logging import get_logger

log = get_logger("reprise.agent")
# After a rank's first heartbeat, how long its node's report waits for its peers' (and so at most 20 extra reports a s)
EARLY_REPORT_GATHER_S = 0.05
STEP_END_WAIT_S = 0.5  # in a scheduler's step, how long a rank's outside SIGTERM waits for the agent's own
CAPTURES_REMEMBERED = 256  # incidents whose stacks this agent captured (a repeated stop does not capture again)


class Agent:
    """Everything one node's agent does, wired to one bus connection."""

    def __init__(self, settings: AgentSettings, bus: Bus) -> None:
        self.settings = settings
        self.node_id = settings.node_id
        self.bus = bus
        self.gpus: GpuBackend = open_backend(settings.gpu_backend, count=settings.gpu_count, node_id=self.node_id)
        self.progress = ProgressBook(SystemClock())
        self.progress.on_checkpoint_saved(self._on_checkpoint_saved)
        self.progress.on_first_heartbeat(self._on_job_training)
        self.progress.on_rank_training(self._on_rank_training)
        self.progress.on_metrics(self._on_metrics)
        self.numeric = NumericWatcher()
        sdk_path = settings.sdk_socket.absolute() if settings.sdk_socket else default_socket_path(settings.state_dir)
        self.sdk = SdkServer(sdk_path, self.progress)
        self.standbys = StandbyPool(
            python=str(settings.standby_python),
            size=settings.standbys,
            preload=settings.standby_preload,
            refill_delay_s=settings.standby_refill_delay_s,
        )
        self.supervisor = RankSupervisor(
            standbys=self.standbys,
            sdk_socket=self.sdk.path,
            inbox_dir=default_inbox_dir(settings.state_dir),
            node_id=self.node_id,
            state_dir=settings.state_dir,
            on_exit=self._on_rank_exit,
            on_parked=self._on_rank_parked,
            tail_lines=settings.log_tail_lines,
        )
        self.progress.on_restart_message(self.supervisor.on_sdk_message)
        self.foreign = ForeignCheckpoints(self.node_id, emit=self._emit_checkpoint, alive=self._job_alive)
        self.py_spy = find_py_spy(settings.py_spy)
        activity = self.gpus if isinstance(self.gpus, ProcessActivity) else None
        self.stack_sampler = StackSampler(py_spy=self.py_spy, interval_s=settings.stack_sample_s, activity=activity)
        self._captured: dict[str, None] = {}  # incident ids, oldest first
        self.book = CommandBook(node_id=self.node_id, state_file=settings.state_dir / "fences.json")
        self.node_lost = False  # set by an injected node loss: from then on the agent publishes nothing
        self.stopping = False  # set by stop(): the last report says so, and then the connection closes
        # Run as a task of a scheduler's job step (Slurm's srun sets SLURM_STEP_ID): a SIGTERM to this agent is then the
        # scheduler ending the step, its ranks with it (a preemption, a time limit, a cancel), not a fault of theirs.
        self.scheduler_step = os.environ.get("SLURM_STEP_ID") is not None
        self.step_ending = asyncio.Event()  # set when the scheduler ends this agent's step (terminating())
        self._stopping_jobs: set[str] = set()  # jobs whose stop (or park) this agent is carrying out now
        self.outbox = Outbox(bus, capacity=settings.outbox_capacity)
        self.depchecks = DependencyChecker(
            settings.dependency_checks,
            clock=SystemClock(),
            repeat_s=settings.dependency_repeat_s,
            rendezvous_grace_s=settings.rendezvous_grace_s,
        )
        self.reports_skipped = 0
        self.early_reports = 0  # reports sent ahead of the interval because a rank of a launch began training
        self._report_soon = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._subscriptions: list[Any] = []

    # --- lifecycle --------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Serve commands and injections, start the loops, announce ourselves."""
        await self.sdk.start()  # before any command can launch a rank that reports to it
        self._subscriptions.append(await self.bus.serve(subjects.node_command(self.node_id), self._on_command))
        self._subscriptions.append(await self.bus.serve(subjects.node_inject(self.node_id), self._on_inject))
        self._tasks = [
            asyncio.create_task(self.outbox.run(), name="outbox"),
            asyncio.create_task(self._report_loop(), name="reports"),
            asyncio.create_task(self._gpu_loop(), name="gpu-signals"),
            asyncio.create_task(self._dependency_loop(), name="dependency-checks"),
            asyncio.create_task(self.stack_sampler.run(self.supervisor.ranks, self._stepless), name="stack-samples"),
        ]
        self.standbys.start()
        self._emit_lifecycle("starting")
        for lost in self.supervisor.orphans():
            self._report_lost(lost)

    async def stop(self) -> None:
        """Stop taking commands, stop the ranks, say goodbye, flush what is queued."""
        for sub in self._subscriptions:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        await self.supervisor.stop_all(grace_s=self.settings.stop_grace_s)
        await self.foreign.close()
        await self.standbys.close()
        self.sdk.close()
        await self._say_stopping()
        self._emit_lifecycle("stopping")
        await self.outbox.flush(timeout_s=2.0)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.gpus.close()

    def terminating(self) -> None:
        """This agent got SIGTERM (in the loop, from the signal handler the app chains before uvicorn's). In a
        scheduler's step it is the scheduler ending the step: the ranks' exits are said to be the scheduler's doing,
        and the stopping report goes out at once, before the clean stop (the scheduler kills what is left soon)."""
        if not self.scheduler_step or self.step_ending.is_set():
            return
        self.step_ending.set()
        log.warning("the scheduler ends this agent's step: its ranks end with it")
        self._tasks.append(asyncio.create_task(self._say_stopping(), name="stopping-report"))

    async def _say_stopping(self) -> None:
        """A last report that says the agent is stopping, sent on the connection before it closes: the server
        delivers it ahead of its advisory of the closed connection, so the detector does not call the node lost."""
        self.stopping = True
        if self.node_lost:
            return
        try:
            await self.bus.publish_snapshot(subjects.node_report(self.node_id), await self.report())
            await self.bus.nc.flush(timeout=1)
        except (BusError, nats.errors.Error, TimeoutError):
            log.warning("the stopping report was not sent: the node may be called lost")

    def _emit_lifecycle(self, state: str) -> None:
        event = AgentLifecycle(
            source=self.node_id, node_id=self.node_id, state=state, gpu_count=self.settings.gpu_count
        )
        self.outbox.put(subjects.node_event(self.node_id, "agent.lifecycle"), event)

    # --- reporting --------------------------------------------------------------------------------------------
    async def report(self) -> NodeReport:
        """The node's compact report: every GPU and every rank (GPU reads are driver calls: off the loop)."""
        gpus = await asyncio.to_thread(self.gpus.statuses) if self.gpus.name == "nvml" else self.gpus.statuses()
        return NodeReport(
            source=self.node_id,
            node_id=self.node_id,
            address=self.settings.advertise_addr,
            interval_s=self.settings.report_interval_s,
            gpu_backend=self.gpus.name,
            gpu_error=self.gpus.error,
            gpus=gpus,
            ranks=[self._rank_status(rank) for rank in self.supervisor.ranks()],
            standbys=self.standbys.statuses(),
            spare=self.settings.spare,
            stopping=self.stopping,
            connection=self.bus.connection,
        )

    def _rank_status(self, rank: RankProcess) -> RankStatus:
        """A rank as the report shows it: the process as supervised, its progress as its SDK reported it."""
        fields = self.progress.status_fields(rank.job_id, rank.rank) | self.stack_sampler.fields(rank)
        return rank.status().model_copy(update=fields)

    def _stepless(self, rank: RankProcess) -> bool:
        """A rank that has reported no step and no phase of its own (no SDK, or not yet): its stack is sampled."""
        fields = self.progress.status_fields(rank.job_id, rank.rank)
        return fields["step"] is None and fields["phase"] == "startup"

    def _on_checkpoint_saved(self, message: SdkMessage) -> None:
        spec = self.supervisor.launches.get(message.job_id)
        try:
            digests = [
                FileDigest(path=name, size_bytes=size, digest=digest, algorithm="sha256")
                for name, size, digest in message.sha256
            ]
        except ValidationError as exc:  # a bad digest from a script: report the files, let the registry hash them
            log.warning("ignoring invalid checkpoint digests", extra={"job_id": message.job_id, "error": str(exc)})
            digests = []
        event = CheckpointSaved(
            source=self.node_id,
            node_id=self.node_id,
            job_id=message.job_id,
            rank=message.rank,
            step=message.step or 0,
            path=message.path,
            files=list(message.files),
            restart_epoch=self.progress.restart_epoch(message.job_id, message.rank) or 0,
            world_size=spec.world_size if spec else None,
            file_digests=digests,
        )
        self._emit_checkpoint(event)

    def _emit_checkpoint(self, event: CheckpointSaved) -> None:
        """Queue a checkpoint report, from the SDK or from the watcher of a script's own checkpoints."""
        self.outbox.put(subjects.node_event(self.node_id, "checkpoint.saved"), event)

    def _job_alive(self, job_id: str) -> bool:
        """A rank of the job runs on this node."""
        return any(r.alive for r in self.supervisor.ranks() if r.job_id == job_id)

    def _on_metrics(self, message: SdkMessage) -> None:
        """Watch the job's metrics in a heartbeat of its current launch; a NaN, infinity or spike is published."""
        spec = self.supervisor.launches.get(message.job_id)
        if spec is None or spec.numeric is None or message.restart_epoch != spec.restart_epoch:
            return
        assert message.step is not None
        trip = self.numeric.observe(
            spec.numeric,
            job_id=message.job_id,
            rank=message.rank,
            restart_epoch=message.restart_epoch,
            step=message.step,
            metrics=message.metrics,
        )
        if trip is None:
            return
        event = trip.event(
            node_id=self.node_id, job_id=message.job_id, rank=message.rank, restart_epoch=message.restart_epoch
        )
        self.outbox.put(subjects.node_event(self.node_id, event.type), event)
        log.warning("numeric fault", extra={"job_id": message.job_id, "rank": message.rank, "what": trip.kind.value})

    def _on_job_training(self, job_id: str) -> None:
        # The first heartbeat proves the job is past its rendezvous; from now on its master must stay reachable.
        spec = self.supervisor.launches.get(job_id)
        if spec is not None:
            self.depchecks.set_rendezvous(job_id, spec.master_addr, spec.master_port)

    def _on_rank_training(self, _job_id: str, _rank: int) -> None:
        # A rank of a launch took its first step: the recovery that launched it is waiting for exactly this.
        self._report_soon.set()

    async def _report_loop(self) -> None:
        while not self.node_lost:
            try:  # core NATS, fire and forget: a lost report is replaced by the next one
                await self.bus.publish_snapshot(subjects.node_report(self.node_id), await self.report())
            except BusError:  # not connected: skipped, as a stale snapshot is worth nothing later
                self.reports_skipped += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._report_soon.wait(), self.settings.report_interval_s)
                # The ranks of one launch start together: a moment's wait lets them ride in one report.
                await asyncio.sleep(EARLY_REPORT_GATHER_S)
                self.early_reports += 1
            self._report_soon.clear()

    async def _gpu_loop(self) -> None:
        while True:
            self.flush_gpu_signals()
            await asyncio.sleep(self.settings.gpu_poll_interval_s)

    def flush_gpu_signals(self) -> None:
        """Publish every GPU signal seen since the last call, at once."""
        for signal in self.gpus.drain_signals():
            if signal.kind is SignalKind.XID and signal.xid is not None:
                xid = GpuXid(
                    source=self.node_id,
                    node_id=self.node_id,
                    gpu=signal.gpu,
                    xid=signal.xid,
                    message=signal.message,
                )
                self.outbox.put(subjects.node_event(self.node_id, "gpu.xid"), xid)
            elif signal.kind is SignalKind.LOST:
                lost = GpuLost(source=self.node_id, node_id=self.node_id, gpu=signal.gpu, reason=signal.message)
                self.outbox.put(subjects.node_event(self.node_id, "gpu.lost"), lost)

    async def _dependency_loop(self) -> None:
        while True:
            static, rendezvous = await asyncio.gather(self.depchecks.poll(), self.depchecks.poll_rendezvous())
            for result in [*static, *rendezvous]:
                self._on_dependency(result)
            await asyncio.sleep(self.settings.dependency_interval_s)

    def _on_dependency(self, result: CheckResult) -> None:
        if result.ok:
            log.info("dependency recovered", extra={"dependency": result.name, "detail": result.detail})
            return
        log.warning("dependency failed", extra={"dependency": result.name, "detail": result.detail})
        event = DependencyFailed(
            source=self.node_id,
            node_id=self.node_id,
            dependency=result.name,
            detail=result.detail,
            job_id=rendezvous_job(result.name),
        )
        self.outbox.put(subjects.node_event(self.node_id, "dependency.failed"), event)

    async def _on_rank_exit(self, rank: RankProcess) -> None:
        if self.node_lost:  # a lost node says nothing more: its ranks' deaths are for the detector to infer
            return
        if self.scheduler_step and rank.exit_signal == "SIGTERM" and not rank.signalled:
            # The scheduler signals the step's processes together: this agent's own SIGTERM may be a moment behind.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.step_ending.wait(), STEP_END_WAIT_S)
        if not any(r.alive for r in self.supervisor.ranks() if r.job_id == rank.job_id):
            self.depchecks.clear_rendezvous(rank.job_id)  # nothing here needs the job's master any more
        event = RankExited(
            source=self.node_id,
            node_id=self.node_id,
            job_id=rank.job_id,
            rank=rank.rank,
            exit_code=rank.exit_code,
            signal=rank.exit_signal,
            oom_killed=rank.oom_killed,
            log_tail=list(rank.tail),
            restart_epoch=rank.restart_epoch,
            scheduler_ended=self.step_ending.is_set(),
        )
        self.outbox.put(subjects.node_event(self.node_id, "rank.exited"), event)

    def _on_rank_parked(self, rank: RankProcess) -> None:
        """A rank parked for a restart in place: no fault, but what it caught (a peer's failure) is the detector's
        early evidence that a silent node of the job is lost, as a peer's exit was before ranks could park."""
        if self.node_lost or rank.job_id in self._stopping_jobs:  # parked by a recovery's stop: no evidence
            return
        event = RankParked(
            source=self.node_id,
            node_id=self.node_id,
            job_id=rank.job_id,
            rank=rank.rank,
            restart_epoch=rank.restart_epoch,
            why=rank.parked_why[:PARKED_WHY_MAX],
        )
        self.outbox.put(subjects.node_event(self.node_id, event.type), event)

    def _report_lost(self, lost: LostRank) -> None:
        """A rank the previous process of this agent ran died with it: say so, as for any rank killed."""
        log.warning(
            "a rank was lost with the agent's previous process", extra={"job_id": lost.job_id, "rank": lost.rank}
        )
        event = RankExited(
            source=self.node_id,
            node_id=self.node_id,
            job_id=lost.job_id,
            rank=lost.rank,
            signal="SIGKILL",
            log_tail=[*lost.tail(self.supervisor.tail_lines - 1), "(lost with the agent's previous process)"],
            restart_epoch=lost.restart_epoch,
        )
        self.outbox.put(subjects.node_event(self.node_id, "rank.exited"), event)

    # --- commands and injection -------------------------------------------------------------------------------
    async def _on_command(self, data: bytes) -> Wire:
        try:
            command = parse_command(data)
        except MalformedEventError as exc:
            return CommandReply(
                command_id="", node_id=self.node_id, result=CommandResult.FAILED, detail=f"bad command: {exc}"
            )
        return await self.book.run(command, self._execute)

    async def _execute(self, command: PingCommand | LaunchCommand | StopCommand) -> CommandReply:
        data: dict[str, Any]
        if isinstance(command, PingCommand):
            data = {"ranks": len(self.supervisor.ranks()), "spare": self.settings.spare}
        elif isinstance(command, LaunchCommand):
            try:
                data = await self._launch(command)
            except foreign_restore.RestoreRefusedError as exc:  # no rank starts on it: the recovery falls back
                return CommandReply(
                    command_id=command.command_id,
                    node_id=self.node_id,
                    result=CommandResult.FAILED,
                    detail=str(exc),
                    data={RESTORE_REFUSED: exc.problem},
                )
        else:
            data = await self._stop(command)
        return CommandReply(command_id=command.command_id, node_id=self.node_id, result=CommandResult.DONE, data=data)

    async def _launch(self, command: LaunchCommand) -> dict[str, Any]:
        """Start the job's ranks here; a script's own restored checkpoint is re-hashed first and handed to it
        (RestoreRefusedError when it differs)."""
        spec = ready = command.args
        if foreign_restore.restores_own_checkpoint(spec):
            ready = await asyncio.to_thread(foreign_restore.prepared, spec)
        pids, in_place = await self.supervisor.launch(command.job_id, ready)
        self.foreign.launched(command.job_id, spec)
        for assignment in spec.ranks:  # startup begins now; a no-op for a rank that already reported
            self.progress.begin(command.job_id, assignment.rank, restart_epoch=spec.restart_epoch)
        return {"pids": pids, "in_place": in_place}

    async def _stop(self, command: StopCommand) -> dict[str, Any]:
        """Stop the job's ranks here (a hang's stacks first); for a restart in place, the culprits first, then park
        whoever can. Ranks that park meanwhile were parked by the recovery: their peer errors are no evidence of a
        lost node, so no rank.parked is published for them."""
        job_id, args = command.job_id, command.args
        self._stopping_jobs.add(job_id)
        try:
            if args.capture_stacks is not None:
                await self._capture_stacks(job_id, args.capture_stacks)
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
            self._stopping_jobs.discard(job_id)
        self.progress.forget(job_id)
        self.numeric.forget(job_id)
        outcomes = {r.rank: {"rank": r.rank, "exit_code": r.exit_code, "signal": r.exit_signal} for r in stopped}
        return {"stopped": list(outcomes.values()), "parked": sorted(kept)}

    async def _capture_stacks(self, job_id: str, order: StackCapture) -> None:
        """Publish the Python stacks of the job's live ranks here, once per incident, within the order's bound."""
        if order.incident_id in self._captured:
            return
        self._captured[order.incident_id] = None
        while len(self._captured) > CAPTURES_REMEMBERED:
            del self._captured[next(iter(self._captured))]
        ranks = [r for r in self.supervisor.ranks() if r.job_id == job_id and r.alive]
        found = await capture([r.proc.pid for r in ranks], py_spy=self.py_spy, within_s=order.within_s)
        for rank in ranks:
            one = found[rank.proc.pid]
            event = RankStacks(
                source=self.node_id,
                node_id=self.node_id,
                job_id=job_id,
                rank=rank.rank,
                restart_epoch=rank.restart_epoch,
                incident_id=order.incident_id,
                pid=one.pid,
                proc_state=one.proc_state,
                threads=one.threads,
                capture_ms=one.took_ms,
                error=one.error,
            )
            self.outbox.put(subjects.node_event(self.node_id, event.type), event)
        failed = [r.rank for r in ranks if found[r.proc.pid].error]
        log.info(
            "rank stacks captured",
            extra={"job_id": job_id, "incident_id": order.incident_id, "ranks": len(ranks), "failed": failed},
        )

    async def _on_inject(self, data: bytes) -> Wire:
        try:
            fault = InjectFault.model_validate_json(data)
        except ValidationError as exc:
            return InjectReply(accepted=False, detail=f"bad fault: {exc.errors()[0]['msg']}")
        if not isinstance(self.gpus, SimulatedGpus):
            return InjectReply(
                accepted=False, detail=f"fault injection needs the sim backend (this node: {self.gpus.name})"
            )
        if fault.kind in PROCESS_FAULTS:
            return self._inject_process_fault(fault)
        result = self.gpus.inject(fault)
        self.flush_gpu_signals()  # the driver reports the error before the process dies of it
        detail = result.detail
        if result.fatal:
            victim = self.supervisor.rank_on_gpu(fault.gpu)
            if victim is not None:
                self.supervisor.kill(victim)
                detail += f"; killed rank {victim.rank} of job {victim.job_id}"
        log.warning("fault injected", extra={"fault": fault.model_dump(mode="json"), "detail": detail})
        return InjectReply(accepted=result.accepted, detail=detail)

    def _inject_process_fault(self, fault: InjectFault) -> InjectReply:
        """Kill or freeze a rank, or lose the whole node (its ranks, then this agent, with no goodbye)."""
        alive = sorted(
            (r for r in self.supervisor.ranks() if r.alive and fault.job_id in (None, r.job_id)),
            key=lambda r: r.rank,
        )
        if fault.kind is FaultKind.NODE_LOSS:
            self.node_lost = True
            for rank in alive:
                self.supervisor.kill(rank)
            log.warning("fault injected: node loss", extra={"ranks": [r.rank for r in alive]})
            asyncio.get_running_loop().call_later(0.2, os.kill, os.getpid(), SIGKILL)  # after the reply
            return InjectReply(
                accepted=True, detail=f"node {self.node_id} lost: killed {len(alive)} ranks and its agent"
            )
        victim = next((r for r in alive if fault.rank in (None, r.rank)), None)
        if victim is None:
            return InjectReply(accepted=False, detail=f"no live rank {fault.rank} on {self.node_id}")
        sig = SIGKILL if fault.kind is FaultKind.RANK_KILL else SIGSTOP
        self.supervisor.kill(victim, sig)
        detail = f"{'killed' if sig is SIGKILL else 'froze (SIGSTOP)'} rank {victim.rank} of job {victim.job_id}"
        log.warning("fault injected", extra={"fault": fault.model_dump(mode="json"), "detail": detail})
        return InjectReply(accepted=True, detail=detail)
