"""The node agent, wired to one bus connection: GPU health, rank supervision through the launcher it picks, node
reports (reporter.py) and discrete events. Its commands are carried out by executor.py, injected faults by faults.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path
from typing import Any

from reprise_agent import node_events
from reprise_agent.commands import CommandBook
from reprise_agent.depchecks.checker import CheckResult, DependencyChecker
from reprise_agent.depchecks.specs import with_docker
from reprise_agent.executor import CommandExecutor
from reprise_agent.faults import FaultInjector
from reprise_agent.foreign_checkpoints import ForeignCheckpoints
from reprise_agent.gpu.base import GpuBackend
from reprise_agent.gpu.factory import open_backend
from reprise_agent.launch.base import ImageLaunchers, Launcher
from reprise_agent.launch.container_group import FILE, grant
from reprise_agent.launch.container_policy import ContainerPolicy
from reprise_agent.launch.processes import ProcessLauncher
from reprise_agent.launch.standby import StandbyPool
from reprise_agent.numeric import NumericWatcher
from reprise_agent.outbox import Outbox
from reprise_agent.progress.book import ProgressBook
from reprise_agent.progress.messages import SdkMessage
from reprise_agent.progress.server import SdkServer, default_inbox_dir, default_socket_path
from reprise_agent.ranks import LostRank, RankProcess, RankSupervisor
from reprise_agent.reporter import NodeReporter
from reprise_agent.settings import AgentSettings
from reprise_agent.stack_sampler import ProcessActivity, StackSampler
from reprise_agent.stacks import find_py_spy
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.clock import SystemClock
from reprise_common.events import AgentLifecycle, CheckpointSaved
from reprise_common.logging import get_logger

log = get_logger("reprise.agent")
STEP_END_WAIT_S = 0.5  # in a scheduler's step, how long a rank's outside SIGTERM waits for the agent's own


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
        self.progress.on_metrics(self._on_metrics)
        self.numeric = NumericWatcher()
        sdk_path = settings.sdk_socket.absolute() if settings.sdk_socket else default_socket_path(settings.state_dir)
        self.sdk = SdkServer(sdk_path, self.progress)
        self.standbys = StandbyPool(
            python=str(settings.standby_python), size=settings.standbys, preload=settings.standby_preload,
            refill_delay_s=settings.standby_refill_delay_s,
        )  # fmt: skip
        self.launcher: Launcher = ProcessLauncher(standbys=self.standbys)  # ranks are child processes of the agent
        self.supervisor = self._supervisor(settings)
        self.progress.on_restart_message(self.supervisor.on_sdk_message)
        self.foreign = ForeignCheckpoints(self.node_id, emit=self._emit_checkpoint, alive=self._job_alive)
        py_spy = find_py_spy(settings.py_spy)
        activity = self.gpus if isinstance(self.gpus, ProcessActivity) else None
        self.stack_sampler = StackSampler(py_spy=py_spy, interval_s=settings.stack_sample_s, activity=activity)
        self.book = CommandBook(node_id=self.node_id, state_file=settings.state_dir / "fences.json")
        self.node_lost = False  # set by an injected node loss: from then on the agent publishes nothing
        # Run as a task of a scheduler's job step (Slurm's srun sets SLURM_STEP_ID): a SIGTERM to this agent is then the
        # scheduler ending the step, its ranks with it (a preemption, a time limit, a cancel), not a fault of theirs.
        self.scheduler_step = os.environ.get("SLURM_STEP_ID") is not None
        self.step_ending = asyncio.Event()  # set when the scheduler ends this agent's step (terminating())
        self.outbox = Outbox(bus, capacity=settings.outbox_capacity)
        self.depchecks = DependencyChecker(
            with_docker(settings.dependency_checks, settings.docker_url),  # a daemon down is a dependency fault
            clock=SystemClock(),
            repeat_s=settings.dependency_repeat_s,
            rendezvous_grace_s=settings.rendezvous_grace_s,
        )
        self.executor = self._executor(py_spy)
        self.faults = FaultInjector(
            node_id=self.node_id, gpus=self.gpus, supervisor=self.supervisor,
            flush_gpu_signals=self.flush_gpu_signals, lose_node=self._lose_node,
        )  # fmt: skip
        self.reporter = NodeReporter(
            settings, bus, gpus=self.gpus, supervisor=self.supervisor, progress=self.progress,
            stack_sampler=self.stack_sampler, standbys=self.standbys, lost=lambda: self.node_lost,
            container_standbys=self.supervisor.containers.standby_statuses if self.supervisor.containers else list,
        )  # fmt: skip
        self.progress.on_rank_training(self.reporter.soon)
        self._tasks: list[asyncio.Task[None]] = []
        self._subscriptions: list[Any] = []

    def _supervisor(self, settings: AgentSettings) -> RankSupervisor:
        """The supervisor of this node's ranks, started by the agent's launcher."""
        return RankSupervisor(
            launcher=self.launcher,
            sdk_socket=self.sdk.path,
            inbox_dir=default_inbox_dir(settings.state_dir),
            node_id=self.node_id,
            state_dir=settings.state_dir,
            on_exit=self._on_rank_exit,
            on_parked=self._on_rank_parked,
            tail_lines=settings.log_tail_lines,
            containers=self._containers(settings),
        )

    def _containers(self, settings: AgentSettings) -> ImageLaunchers | None:
        """This node's Docker daemon for the jobs whose ranks run in an image; None when the agent has none."""
        if settings.docker_url is None:
            return None
        from reprise_agent.launch.container_standby import ContainerStandbys  # noqa: PLC0415 - the SDK only where used
        from reprise_agent.launch.containers import ContainerEngine  # noqa: PLC0415 - the SDK only where it is used

        policy = ContainerPolicy(
            mount_roots=tuple(settings.container_mount_roots),
            images=frozenset(settings.container_images) if settings.container_images is not None else None,
        )
        inbox_dir = default_inbox_dir(settings.state_dir)
        size = settings.standbys if settings.container_standbys is None else settings.container_standbys
        standbys = ContainerStandbys(
            size=size, preload=settings.standby_preload, refill_delay_s=settings.standby_refill_delay_s
        )  # per containerized job
        return ContainerEngine(
            base_url=settings.docker_url,
            policy=policy,
            inbox_dir=inbox_dir,
            job_files_dir=settings.state_dir / "ranks",  # RankSupervisor.log_dir: where it writes resume-file listings
            sdk_socket=self.sdk.path,  # re-linked for the containers a restarted agent adopts
            standbys=standbys,
            gpus=self.gpus.name == "nvml",
            gid=settings.container_gid,
        )

    def _executor(self, py_spy: Path | None) -> CommandExecutor:
        """What carries out this node's commands, on its ranks and its books."""
        return CommandExecutor(
            node_id=self.node_id,
            spare=self.settings.spare,
            book=self.book,
            supervisor=self.supervisor,
            progress=self.progress,
            numeric=self.numeric,
            foreign=self.foreign,
            depchecks=self.depchecks,
            outbox=self.outbox,
            py_spy=py_spy,
        )

    # --- lifecycle --------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Serve commands and injections, start the loops, announce ourselves."""
        await self.sdk.start()  # before any command can launch a rank that reports to it
        if self.settings.docker_url is not None:  # a containerized rank of any user writes to it (its group's)
            grant(self.sdk.path, self.settings.container_gid, FILE)
        self._subscriptions.append(await self.bus.serve(subjects.node_command(self.node_id), self.executor.on_command))
        self._subscriptions.append(await self.bus.serve(subjects.node_inject(self.node_id), self.faults.on_inject))
        self._tasks = [
            asyncio.create_task(self.outbox.run(), name="outbox"),
            asyncio.create_task(self.reporter.run(), name="reports"),
            asyncio.create_task(self._gpu_loop(), name="gpu-signals"),
            asyncio.create_task(self._dependency_loop(), name="dependency-checks"),
            asyncio.create_task(
                self.stack_sampler.run(self.supervisor.ranks, self.reporter.stepless), name="stack-samples"
            ),
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
        if self.supervisor.containers is not None:
            self.supervisor.containers.close()  # its standby containers go with it
        await self.foreign.close()
        await self.standbys.close()
        self.sdk.close()
        await self.reporter.say_stopping()
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
        self._tasks.append(asyncio.create_task(self.reporter.say_stopping(), name="stopping-report"))

    def _lose_node(self) -> None:
        """An injected node loss: from now on this agent publishes nothing."""
        self.node_lost = True

    def _emit_lifecycle(self, state: str) -> None:
        event = AgentLifecycle(
            source=self.node_id, node_id=self.node_id, state=state, gpu_count=self.settings.gpu_count
        )
        self.outbox.put(subjects.node_event(self.node_id, "agent.lifecycle"), event)

    # --- what the ranks' SDK reports -------------------------------------------------------------------------
    def _on_checkpoint_saved(self, message: SdkMessage) -> None:
        spec = self.supervisor.launches.get(message.job_id)
        event = node_events.checkpoint_saved(
            self.node_id,
            message,
            restart_epoch=self.progress.restart_epoch(message.job_id, message.rank) or 0,
            world_size=spec.world_size if spec else None,
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

    async def _gpu_loop(self) -> None:
        while True:
            self.flush_gpu_signals()
            await asyncio.sleep(self.settings.gpu_poll_interval_s)

    def flush_gpu_signals(self) -> None:
        """Publish every GPU signal seen since the last call, at once."""
        for signal in self.gpus.drain_signals():
            event = node_events.gpu_event(self.node_id, signal)
            if event is not None:
                self.outbox.put(subjects.node_event(self.node_id, event.type), event)

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
        event = node_events.dependency_failed(self.node_id, result)
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
        event = node_events.rank_exited(self.node_id, rank, scheduler_ended=self.step_ending.is_set())
        self.outbox.put(subjects.node_event(self.node_id, "rank.exited"), event)

    def _on_rank_parked(self, rank: RankProcess) -> None:
        """A rank parked for a restart in place: no fault, but what it caught (a peer's failure) is the detector's
        early evidence that a silent node of the job is lost, as a peer's exit was before ranks could park."""
        if self.node_lost or rank.job_id in self.executor.stopping_jobs:  # parked by a recovery's stop: no evidence
            return
        event = node_events.rank_parked(self.node_id, rank)
        self.outbox.put(subjects.node_event(self.node_id, event.type), event)

    def _report_lost(self, lost: LostRank) -> None:
        """A rank the previous process of this agent ran died with it: say so, as for any rank killed."""
        log.warning(
            "a rank was lost with the agent's previous process", extra={"job_id": lost.job_id, "rank": lost.rank}
        )
        event = node_events.lost_rank_exited(self.node_id, lost, tail_lines=self.supervisor.tail_lines)
        self.outbox.put(subjects.node_event(self.node_id, "rank.exited"), event)
