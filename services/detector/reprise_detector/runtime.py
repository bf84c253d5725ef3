"""What one running detector holds, shared by the lifespan, the consumers and the routes (which read it through the
protocols of deps.py)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import nats.js.errors
from nats.js.api import DeliverPolicy
from sqlalchemy.engine import Engine

from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.clock import Clock
from reprise_common.consumer import Consumer
from reprise_common.follow import Follower
from reprise_common.logging import get_logger
from reprise_common.service import Background
from reprise_detector.incidents.mitigation import RecoveryOutcomes
from reprise_detector.nodes.connections import Connections
from reprise_detector.nodes.liveness import Liveness
from reprise_detector.nodes.reputation import ReputationRules
from reprise_detector.partition import Partition
from reprise_detector.pipeline import Detector
from reprise_detector.placements import PlacementMap
from reprise_detector.settings import DetectorSettings
from reprise_detector.watch import Watcher

log = get_logger("reprise.detector.runtime")

PLACEMENTS_DURABLE = "detector-placements"
EVENTS_DURABLE = "detector-events"
RECOVERIES_DURABLE = "detector-recoveries"
COMPUTE_DURABLE = "detector-compute"  # the compute backend's failure signals (Slurm's node down, preemption)
RETIRED_REPORTS_DURABLE = "detector-reports"  # reports were stored in AGENT until they moved to core NATS
PLACEMENTS_CATCH_UP_S = 10.0
# A detector that dies with a batch of agent events in hand leaves it to a restarted or another one after this ack
# wait; while it works on a batch it tells the server so every EVENTS_PROGRESS_S, so a slow batch is not redelivered.
EVENTS_ACK_WAIT_S = 5.0
EVENTS_PROGRESS_S = 1.5


@dataclass
class Runtime:
    """The detector's engine, bus, clock, placement map and pipeline."""

    settings: DetectorSettings
    engine: Engine
    bus: Bus
    clock: Clock
    placements: PlacementMap
    detector: Detector
    background: Background
    partition: Partition
    watcher: Watcher
    consumers: list[Consumer] = field(default_factory=list)
    reports: Follower | None = None
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def liveness(self) -> Liveness:
        """Every node's liveness, as the watch keeps it."""
        return self.watcher.liveness

    @property
    def reputation_rules(self) -> ReputationRules:
        """When a node's faults make it a quarantine candidate."""
        return self.detector.reputation_rules

    def durable(self, base: str) -> str:
        """This replica's durable consumer name for a purpose."""
        return self.partition.durable(base)

    async def start_consumers(self) -> None:
        """Load every job's last placement, then consume agent events and reports, then start the watch loop."""
        await self._load_placements()
        with contextlib.suppress(nats.js.errors.NotFoundError):  # an older release's; it would only hold state
            await self.bus.js.delete_consumer(subjects.AGENT_STREAM, self.durable(RETIRED_REPORTS_DURABLE))
        self.consumers = self._event_consumers()
        for consumer in self.consumers:
            await consumer.open()
        await self._follow_reports()
        self.tasks.append(
            asyncio.create_task(self.watcher.run(self.settings.watch_interval_s, self.stopping), name="watch")
        )

    async def _load_placements(self) -> None:
        """Consume every job's last placement, and wait (a while) until those published so far are applied."""
        # The placement map lives in memory: replay the last placement of every job on each start, which a durable
        # consumer only does when it is created, so drop the one a previous run left behind.
        placements_durable = self.durable(PLACEMENTS_DURABLE)
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await self.bus.js.delete_consumer(subjects.PLACEMENTS_STREAM, placements_durable)
        info = await self.bus.js.stream_info(subjects.PLACEMENTS_STREAM)
        self.bus.consumer(
            stream=subjects.PLACEMENTS_STREAM,
            durable=placements_durable,
            filter_subject=subjects.PLACEMENTS_ALL,
            handler=self.placements.handle,
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
        ).start()
        if info.state.messages and not await self.placements.wait_for_seq(
            info.state.last_seq, timeout=PLACEMENTS_CATCH_UP_S
        ):
            log.warning("placements not fully loaded before consuming events", extra={"seq": self.placements.last_seq})

    def _event_consumers(self) -> list[Consumer]:
        """The consumers of agent events, compute signals and recovery outcomes (not opened yet)."""
        return [
            self.bus.batch_consumer(
                stream=subjects.AGENT_STREAM,
                durable=self.durable(EVENTS_DURABLE),
                filter_subject=subjects.AGENT_EVENTS,
                handler=self.detector.handle_batch,
                batch=self.settings.event_batch,
                prefetch=True,  # the next batch arrives while this one is in the database
                ack_wait_s=EVENTS_ACK_WAIT_S,
                progress_every_s=EVENTS_PROGRESS_S,
            ),
            # Created from the newest signal on: a detector's first start does not replay a week of old ones as new
            # faults; afterwards the durable resumes where it stopped, like the events'.
            self.bus.batch_consumer(
                stream=subjects.COMPUTE_STREAM,
                durable=self.durable(COMPUTE_DURABLE),
                filter_subject=subjects.COMPUTE_SIGNALS_ALL,
                handler=self.detector.handle_batch,
                ack_wait_s=EVENTS_ACK_WAIT_S,
                progress_every_s=EVENTS_PROGRESS_S,
                deliver_policy=DeliverPolicy.NEW,
            ),
            self.bus.consumer(
                stream=subjects.RECOVERIES_STREAM,
                durable=self.durable(RECOVERIES_DURABLE),
                filter_subject=subjects.RECOVERIES_ALL,
                handler=RecoveryOutcomes(engine=self.engine, clock=self.clock, partition=self.partition).handle,
            ),
        ]

    async def _follow_reports(self) -> None:
        """Follow node reports, and agents' closed connections when the node keys are known."""
        # Reports are snapshots on core NATS: every replica receives every one (liveness of all nodes); the watcher
        # parses only the reports of nodes that run its jobs.
        self.reports = self.bus.follow(
            subjects.AGENT_REPORTS,
            handler=self.watcher.handle_reports,
            batch=self.settings.report_batch,
            linger_s=self.settings.report_linger_s,
        )
        await self.reports.open()
        # A report that waits unread is no silence of its node: silences and stalls are judged as of the reading.
        self.watcher.liveness.lag = self.watcher.hangs.lag = self.reports.lag_s
        if self.settings.node_keys_file is not None:  # agents' closed connections, at once (nodes/connections.py)
            connections = Connections(
                liveness=self.watcher.liveness,
                keys_file=self.settings.node_keys_file,
                clock=self.clock,
                wake=self.watcher.wake,
            )
            for subject in subjects.CLIENT_EVENTS:
                await self.bus.nc.subscribe(subject, cb=connections.on_message)

    async def stop(self) -> None:
        """Stop the watch loop, the report subscription and the batch consumers (each finishes what it holds)."""
        self.stopping.set()
        if self.reports is not None:
            await self.reports.stop()
        await asyncio.gather(*(c.stop() for c in self.consumers))
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def wait_started(self, timeout: float) -> None:
        """Wait until NATS is connected and the consumers run; TimeoutError otherwise."""
        await asyncio.wait_for(self.background.started.wait(), timeout=timeout)
