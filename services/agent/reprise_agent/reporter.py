"""The node's report: every GPU, rank and standby in one compact message, published every interval and at once when
a rank of a launch takes its first step (the recovery that launched it waits for exactly this)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import nats.errors

from reprise_agent.gpu.base import GpuBackend
from reprise_agent.launch.standby import StandbyPool
from reprise_agent.progress.book import ProgressBook
from reprise_agent.ranks import RankProcess, RankSupervisor
from reprise_agent.settings import AgentSettings
from reprise_agent.stack_sampler import StackSampler
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.errors import BusError
from reprise_common.events import NodeReport, RankStatus, StandbyStatus
from reprise_common.logging import get_logger

log = get_logger("reprise.agent")
# After a rank's first heartbeat, how long its node's report waits for its peers' (and so at most 20 extra reports a s)
EARLY_REPORT_GATHER_S = 0.05


class NodeReporter:
    """Builds and publishes the node's reports; `lost()` says when the node must publish nothing more."""

    def __init__(
        self,
        settings: AgentSettings,
        bus: Bus,
        *,
        gpus: GpuBackend,
        supervisor: RankSupervisor,
        progress: ProgressBook,
        stack_sampler: StackSampler,
        standbys: StandbyPool,
        lost: Callable[[], bool],
        container_standbys: Callable[[], list[StandbyStatus]] = list,
    ) -> None:
        self.settings, self.bus, self.gpus = settings, bus, gpus
        self.supervisor, self.progress = supervisor, progress
        self.stack_sampler, self.standbys = stack_sampler, standbys
        self.lost = lost
        self.container_standbys = container_standbys  # the containerized jobs' standbys, listed beside the processes'
        containers = supervisor.containers
        self.container_support = containers.support() if containers is not None else None  # settings: fixed
        self.stopping = False  # the agent is stopping: its last report says so
        self.skipped = 0  # reports not sent: not connected
        self.early = 0  # reports sent ahead of the interval because a rank of a launch began training
        self._soon = asyncio.Event()

    async def report(self) -> NodeReport:
        """The node's compact report: every GPU and every rank (GPU reads are driver calls: off the loop)."""
        gpus = await asyncio.to_thread(self.gpus.statuses) if self.gpus.name == "nvml" else self.gpus.statuses()
        return NodeReport(
            source=self.settings.node_id,
            node_id=self.settings.node_id,
            address=self.settings.advertise_addr,
            interval_s=self.settings.report_interval_s,
            gpu_backend=self.gpus.name,
            gpu_error=self.gpus.error,
            gpus=gpus,
            ranks=[self._rank_status(rank) for rank in self.supervisor.ranks()],
            standbys=self.standbys.statuses() + self.container_standbys(),
            containers=self.container_support,
            spare=self.settings.spare,
            stopping=self.stopping,
            connection=self.bus.connection,
        )

    def _rank_status(self, rank: RankProcess) -> RankStatus:
        """A rank as the report shows it: the process as supervised, its progress as its SDK reported it."""
        fields = self.progress.status_fields(rank.job_id, rank.rank) | self.stack_sampler.fields(rank)
        return rank.status().model_copy(update=fields)

    def stepless(self, rank: RankProcess) -> bool:
        """A rank that has reported no step and no phase of its own (no SDK, or not yet): its stack is sampled."""
        fields = self.progress.status_fields(rank.job_id, rank.rank)
        return fields["step"] is None and fields["phase"] == "startup"

    def soon(self, _job_id: str = "", _rank: int = 0) -> None:
        """A rank of a launch took its first step: report now rather than at the interval."""
        self._soon.set()

    async def run(self) -> None:
        """Publish a report every interval (sooner when asked) until the node is lost."""
        while not self.lost():
            try:  # core NATS, fire and forget: a lost report is replaced by the next one
                await self.bus.publish_snapshot(subjects.node_report(self.settings.node_id), await self.report())
            except BusError:  # not connected: skipped, as a stale snapshot is worth nothing later
                self.skipped += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._soon.wait(), self.settings.report_interval_s)
                # The ranks of one launch start together: a moment's wait lets them ride in one report.
                await asyncio.sleep(EARLY_REPORT_GATHER_S)
                self.early += 1
            self._soon.clear()

    async def say_stopping(self) -> None:
        """A last report that says the agent is stopping, sent on the connection before it closes: the server
        delivers it ahead of its advisory of the closed connection, so the detector does not call the node lost."""
        self.stopping = True
        if self.lost():
            return
        try:
            await self.bus.publish_snapshot(subjects.node_report(self.settings.node_id), await self.report())
            await self.bus.nc.flush(timeout=1)
        except (BusError, nats.errors.Error, TimeoutError):
            log.warning("the stopping report was not sent: the node may be called lost")
