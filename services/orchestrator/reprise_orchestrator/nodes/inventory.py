"""Node inventory: what each agent last reported, kept live from the report subjects."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import BaseModel

from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.clock import Clock
from reprise_common.events import GpuHealth, NodeReport, RankStatus
from reprise_common.logging import get_logger

log = get_logger("reprise.orchestrator.nodes")


@dataclass
class NodeInfo:
    """The latest report of one node and when it arrived."""

    report: NodeReport
    seen_mono: float


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


class Inventory:
    """Live view of the nodes; a node is placeable while its reports are fresh and it is not cordoned."""

    def __init__(self, *, clock: Clock, stale_s: float) -> None:
        self.clock = clock
        self.stale_s = stale_s
        self._nodes: dict[str, NodeInfo] = {}
        self._sub: Any = None

    async def start(self, bus: Bus) -> None:
        """Follow every node's reports (core NATS: a report is only worth its latest value)."""

        async def on_report(msg: Any) -> None:
            try:
                node_id = subjects.node_from_agent_subject(msg.subject)
                report = NodeReport.model_validate_json(msg.data)
            except ValueError as exc:
                log.warning("ignoring a bad report", extra={"subject": msg.subject, "error": str(exc)[:200]})
                return
            self.observe(node_id, report)

        self._sub = await bus.nc.subscribe(subjects.AGENT_REPORTS, cb=on_report)

    def observe(self, node_id: str, report: NodeReport) -> None:
        """Record a report under the node id the subject names."""
        self._nodes[node_id] = NodeInfo(report=report, seen_mono=self.clock.monotonic())

    def fresh(self, node_id: str) -> bool:
        """True when the node reported recently."""
        info = self._nodes.get(node_id)
        return info is not None and self.clock.monotonic() - info.seen_mono <= self.stale_s

    def placeable(self, *, spares: bool = False, exclude: frozenset[str] | set[str] = frozenset()) -> list[str]:
        """Fresh nodes with every GPU healthy, workers (or spares), not excluded, sorted by id."""
        return sorted(
            node_id
            for node_id, info in self._nodes.items()
            if node_id not in exclude
            and self.fresh(node_id)
            and info.report.spare == spares
            and all(g.health in (GpuHealth.OK, GpuHealth.DEGRADED) for g in info.report.gpus)
        )

    def known(self) -> int:
        """How many nodes have ever reported (the circuit breaker's denominator)."""
        return len(self._nodes)

    def ranks_of(self, job_id: str, *, restart_epoch: int) -> dict[int, RankStatus]:
        """The job's ranks of one launch as fresh reports show them, by rank.

        Filtering by epoch matters: a node the job left still reports the ranks it stopped, under the same numbers.
        """
        return {
            rank.rank: rank
            for node_id, info in self._nodes.items()
            if self.fresh(node_id)
            for rank in info.report.ranks
            if rank.job_id == job_id and rank.restart_epoch == restart_epoch
        }

    def address(self, node_id: str) -> str:
        """Where other nodes reach this one, as it reports it (its id when it reported none)."""
        info = self._nodes.get(node_id)
        return info.report.address if info is not None and info.report.address else node_id

    def gpu_count(self, node_id: str) -> int:
        """How many GPUs a node reported."""
        info = self._nodes.get(node_id)
        return 0 if info is None else len(info.report.gpus)

    def public(self, cordons: dict[str, str]) -> list[NodePublic]:
        """Every known node, with its cordon reason when `cordons` (node → reason) names it."""
        return [
            NodePublic(
                node_id=node_id,
                spare=info.report.spare,
                healthy_gpus=sum(g.health is GpuHealth.OK for g in info.report.gpus),
                gpus=len(info.report.gpus),
                ranks=len(info.report.ranks),
                last_report_at=info.report.time,
                stale=not self.fresh(node_id),
                cordoned=node_id in cordons,
                cordon_reason=cordons.get(node_id, ""),
            )
            for node_id, info in sorted(self._nodes.items())
        ]
