"""Node inventory: what each agent last reported, kept live from the report subjects.

Thousands of nodes report every second. The inventory follows them on a NATS connection of its own, so that a burst
of reports can never make nats-server drop the connection that carries the recovery's commands. A report only
matters until the next one: arriving reports are kept raw (the newest per node wins) and parsed when the inventory
is next asked something, and then only for the fields it uses. The ranks are indexed by job and restart epoch, so
following a job's ranks costs the ranks of that job, not a scan of every node.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Set
from dataclasses import dataclass
from datetime import datetime

from pydantic import BaseModel

from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.clock import Clock
from reprise_common.errors import MalformedEventError
from reprise_common.events import ContainerSpec, ContainerSupport, GpuHealth, NodeReport
from reprise_common.logging import get_logger
from reprise_common.report_view import ContainersSeen, RankSeen, ReportSeen, read_report

log = get_logger("reprise.orchestrator.nodes")
RankKey = tuple[str, int | None]  # (job id, restart epoch)


@dataclass(slots=True)
class NodeInfo:
    """What the inventory keeps of a node's latest report, and when it arrived.

    A few values rather than the parsed report: thousands of nodes' GPU records kept alive would make every full
    garbage collection, which pauses the event loop, scan them.
    """

    seen_mono: float
    time: datetime
    address: str
    spare: bool
    gpus: int
    healthy_gpus: int  # GPUs reported OK
    gpus_usable: bool  # every GPU is OK or DEGRADED: the node can take ranks
    ranks: tuple[RankSeen, ...]
    containers: ContainersSeen | None  # what containerized jobs may use there; None: it runs none
    stopping: bool  # its agent's last word before a graceful stop: nothing listens there soon

    @classmethod
    def of(cls, report: ReportSeen, seen_mono: float, ranks: tuple[RankSeen, ...]) -> NodeInfo:
        """The values kept of one report, with `ranks` for the ones it lists (less those a stop ended since)."""
        health = [g.health for g in report.gpus]
        return cls(
            seen_mono=seen_mono,
            time=report.time,
            address=report.address,
            spare=report.spare,
            gpus=len(health),
            healthy_gpus=health.count(GpuHealth.OK),
            gpus_usable=all(h in (GpuHealth.OK, GpuHealth.DEGRADED) for h in health),
            ranks=ranks,
            containers=report.containers,
            stopping=report.stopping,
        )


class NodePublic(BaseModel):
    """A node as the API shows it."""

    node_id: str
    spare: bool
    healthy_gpus: int
    gpus: int
    ranks: int
    last_report_at: datetime
    stale: bool
    cordoned: bool = False
    cordon_reason: str = ""


@functools.lru_cache(maxsize=64)
def _support(seen: ContainersSeen) -> ContainerSupport:
    """A node's container rules as the shared model (nodes of one fleet report the same few: parsed once each)."""
    images = None if seen.images is None else list(seen.images)
    return ContainerSupport(mount_roots=list(seen.mount_roots), images=images)


class Inventory:
    """Live view of the nodes; a node is placeable while its reports are fresh and it is not cordoned."""

    def __init__(self, *, clock: Clock, stale_s: float) -> None:
        self.clock = clock
        self.stale_s = stale_s
        self._nodes: dict[str, NodeInfo] = {}
        self._unread: dict[str, tuple[bytes, float]] = {}  # node → its newest report not parsed yet, and its arrival
        self._ranks: dict[RankKey, dict[str, list[RankSeen]]] = {}  # (job, epoch) → node → its ranks there
        self._gone: dict[str, float] = {}  # node → when no agent answered there, or it was called lost (monotonic)
        self._stops: dict[str, dict[str, tuple[datetime, frozenset[int]]]] = {}  # node → job → a stop's end, parked
        self._bus: Bus | None = None
        self._arrival = asyncio.Event()  # set (and replaced) whenever reports arrive

    async def start(self, bus: Bus) -> None:
        """Connect `bus` (the inventory's own) and follow every node's reports (only the latest of each counts)."""

        async def on_reports(batch: dict[str, bytes]) -> None:
            arrived = self.clock.monotonic()
            for subject, data in batch.items():
                try:
                    node_id = subjects.node_from_agent_subject(subject)
                except ValueError as exc:
                    log.warning("ignoring a report on a bad subject", extra={"subject": subject, "error": str(exc)})
                    continue
                self._unread[node_id] = (data, arrived)
            self._arrived()

        await bus.connect()
        self._bus = bus
        await bus.follow(subjects.AGENT_REPORTS, handler=on_reports).open()

    async def stop(self) -> None:
        """Stop following reports."""
        if self._bus is not None:
            await self._bus.close()

    def observe(self, node_id: str, report: NodeReport) -> None:
        """Record a report under the node id the subject names."""
        self._unread.pop(node_id, None)
        self._store(node_id, read_report(report.to_bytes()), self.clock.monotonic())
        self._arrived()

    def _arrived(self) -> None:
        arrival, self._arrival = self._arrival, asyncio.Event()
        arrival.set()

    async def next_reports(self, timeout_s: float) -> bool:
        """Wait until the next reports arrive, at most `timeout_s`; True when they did.

        Whoever waits for a job's ranks (a recovery's verifying step) looks again as soon as a report lands, not on
        a timer: agents report at once when a rank of a new launch first heartbeats.
        """
        arrival = self._arrival
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(arrival.wait(), timeout_s)
        return arrival.is_set()

    def _absorb(self) -> None:
        """Parse the newest unread report of each node."""
        if not self._unread:
            return
        unread, self._unread = self._unread, {}
        for node_id, (data, seen_mono) in unread.items():
            try:
                report = read_report(data)
            except MalformedEventError as exc:
                log.warning("ignoring a bad report", extra={"node_id": node_id, "error": str(exc)[:200]})
                continue
            self._store(node_id, report, seen_mono)

    def _store(self, node_id: str, report: ReportSeen, seen_mono: float) -> None:
        self._unindex(node_id)
        info = NodeInfo.of(report, seen_mono, self._after_stops(node_id, report.time, report.ranks))
        self._nodes[node_id] = info
        if node_id in self._gone and seen_mono > self._gone[node_id]:
            del self._gone[node_id]  # its agent is back
        self._index(node_id, info)

    def _unindex(self, node_id: str) -> None:
        previous = self._nodes.get(node_id)
        if previous is not None:
            for key in {(r.job_id, r.restart_epoch) for r in previous.ranks}:
                by_node = self._ranks[key]
                del by_node[node_id]
                if not by_node:
                    del self._ranks[key]

    def _index(self, node_id: str, info: NodeInfo) -> None:
        for rank in info.ranks:
            self._ranks.setdefault((rank.job_id, rank.restart_epoch), {}).setdefault(node_id, []).append(rank)

    def _after_stops(self, node_id: str, built: datetime, ranks: tuple[RankSeen, ...]) -> tuple[RankSeen, ...]:
        """A node's ranks as its report built at `built` lists them, less those a later stop ended. A stop that
        ended before the report was built is forgotten: the node's reports show what it left from then on."""
        stops = self._stops.get(node_id)
        if stops is None:
            return ranks
        for job_id in [job_id for job_id, (ended, _) in stops.items() if built >= ended]:
            del stops[job_id]
        if not stops:
            del self._stops[node_id]
            return ranks
        return tuple(r for r in ranks if r.job_id not in stops or r.rank in stops[r.job_id][1])

    def stopped(self, node_id: str, job_id: str, *, ended: datetime, parked: Set[int]) -> None:
        """The node's agent answered a stop of the job: its ranks there had ended at `ended` (the agent's clock, as
        its reports'), all but `parked`. Until a report built after then arrives, the node's reports show them
        stopped: the last one may have been built before the stop, or may come in after the answer (reports travel
        on the inventory's connection, answers on another), and its ranks alive would make them strays."""
        self._absorb()
        self._stops.setdefault(node_id, {})[job_id] = (ended, frozenset(parked))
        info = self._nodes.get(node_id)
        if info is not None:
            self._unindex(node_id)
            info.ranks = self._after_stops(node_id, info.time, info.ranks)
            self._index(node_id, info)

    def _fresh(self, info: NodeInfo, now: float) -> bool:
        return now - info.seen_mono <= self.stale_s

    def agent_gone(self, node_id: str) -> None:
        """No agent listens on the node (a command had no responder, or a recovery's incident called the node lost):
        it is not placeable, and its ranks are not counted alive, until it reports again, rather than until its last
        report goes stale (a node lost a second ago was offered as the next spare, and told to keep a job's standby
        containers). A report still unread keeps its arrival time, earlier than this mark, so it does not clear it."""
        self._gone[node_id] = self.clock.monotonic()

    def fresh(self, node_id: str) -> bool:
        """True when the node reported recently."""
        self._absorb()
        info = self._nodes.get(node_id)
        return info is not None and self._fresh(info, self.clock.monotonic())

    def placeable(self, *, spares: bool = False, exclude: Set[str] = frozenset()) -> list[str]:
        """Fresh nodes with every GPU healthy, workers (or spares), not excluded, sorted by id. A node whose agent said
        it is stopping is not one until an agent there reports again (under a scheduler, the next job's agent may start
        there within the last report's freshness, and a launch sent before it listens would find nobody)."""
        self._absorb()
        now = self.clock.monotonic()
        return sorted(
            node_id
            for node_id, info in self._nodes.items()
            if info.gpus_usable
            and info.spare == spares
            and node_id not in exclude
            and node_id not in self._gone
            and not info.stopping
            and self._fresh(info, now)
        )

    def known(self) -> int:
        """How many nodes have ever reported (the circuit breaker's denominator)."""
        self._absorb()
        return len(self._nodes)

    def ranks_of(self, job_id: str, *, restart_epoch: int) -> dict[int, RankSeen]:
        """The job's ranks of one launch as fresh reports show them, by rank.

        Filtering by epoch matters: a node the job left still reports the ranks it stopped, under the same numbers.
        """
        self._absorb()
        now = self.clock.monotonic()
        return {
            rank.rank: rank
            for node_id, ranks in self._ranks.get((job_id, restart_epoch), {}).items()
            if self._fresh(self._nodes[node_id], now)
            for rank in ranks
        }

    def live_launches(self) -> dict[RankKey, set[str]]:
        """Each launch (job, restart epoch) that fresh reports show alive ranks of, and the nodes they run on (not a
        node whose agent is gone: its ranks show again when it reports again)."""
        self._absorb()
        now = self.clock.monotonic()
        return {
            key: alive
            for key, by_node in self._ranks.items()
            if (
                alive := {
                    node_id
                    for node_id, ranks in by_node.items()
                    if node_id not in self._gone
                    and self._fresh(self._nodes[node_id], now)
                    and any(rank.alive for rank in ranks)
                }
            )
        }

    def address(self, node_id: str) -> str:
        """Where other nodes reach this one, as it reports it (its id when it reported none)."""
        self._absorb()
        info = self._nodes.get(node_id)
        return info.address if info is not None and info.address else node_id

    def container_refusal(
        self, node_id: str, container: ContainerSpec, checkpoints_dir: str | None
    ) -> tuple[tuple[str | int, ...], str] | None:
        """Why the node's agent would refuse a job's container, as its last report says what it allows (the node
        applies the same rule at launch, its symlinks resolved): the field and the reason; None when it runs it, or
        when it never reported (a backend whose nodes run no agent of ours: only the launch can tell)."""
        self._absorb()
        info = self._nodes.get(node_id)
        if info is None:
            return None
        if info.containers is None:
            return ("container",), f"node {node_id} runs no containers (its agent has no REPRISE_DOCKER_URL)"
        refused = _support(info.containers).refusal(container, checkpoints_dir)
        return None if refused is None else (refused[0], f"node {node_id}: {refused[1]}")

    def gpu_count(self, node_id: str) -> int:
        """How many GPUs a node reported."""
        self._absorb()
        info = self._nodes.get(node_id)
        return 0 if info is None else info.gpus

    def public(self, cordons: dict[str, str]) -> list[NodePublic]:
        """Every known node, with its cordon reason when `cordons` (node → reason) names it."""
        self._absorb()
        now = self.clock.monotonic()
        return [
            NodePublic(
                node_id=node_id,
                spare=info.spare,
                healthy_gpus=info.healthy_gpus,
                gpus=info.gpus,
                ranks=len(info.ranks),
                last_report_at=info.time,
                stale=not self._fresh(info, now),
                cordoned=node_id in cordons,
                cordon_reason=cordons.get(node_id, ""),
            )
            for node_id, info in sorted(self._nodes.items())
        ]
