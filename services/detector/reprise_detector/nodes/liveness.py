"""Node liveness: when each node last reported (the detector's clock), and which nodes went silent."""

from __future__ import annotations

from datetime import timedelta
from enum import StrEnum

import msgspec

from reprise_common.clock import Clock
from reprise_common.report_view import GpuSeen
from reprise_detector.derived import NodeLost


class NodeState(StrEnum):
    """What the detector believes of a node that has reported at least once."""

    ALIVE = "alive"
    LOST = "lost"


class NodeSeen(msgspec.Struct, gc=False):
    """The last report of one node, as received (not scanned by the garbage collector: see RankTrack)."""

    last_seen: float  # the detector's monotonic clock
    last_report_id: str
    state: NodeState = NodeState.ALIVE
    gpus: tuple[GpuSeen, ...] = ()


class Liveness:
    """Stage: fed by every node report; check() returns a NodeLost once per silence longer than the limit.

    A node is known once it has reported: a node that never reported is not reported lost (its agent may not run
    yet). A lost node that reports again is alive; if it falls silent again, the new NodeLost has a new id (the last
    report differs) and joins the job's incident within the window instead of opening another one.
    """

    def __init__(self, *, clock: Clock, lost_after_s: float) -> None:
        self.clock = clock
        self.lost_after_s = lost_after_s
        self.nodes: dict[str, NodeSeen] = {}

    def saw(self, node_id: str, report_id: str, gpus: tuple[GpuSeen, ...] | None = None) -> None:
        """Record a report from a node (identity from the subject)."""
        seen = self.nodes.get(node_id)
        now = self.clock.monotonic()
        if seen is None:
            self.nodes[node_id] = NodeSeen(now, report_id, gpus=gpus or ())
            return
        seen.last_seen, seen.last_report_id, seen.state = now, report_id, NodeState.ALIVE
        if gpus is not None:
            seen.gpus = gpus

    def check(self) -> list[NodeLost]:
        """Nodes that just crossed the limit (each silence is reported once)."""
        now, wall = self.clock.monotonic(), self.clock.now()
        lost: list[NodeLost] = []
        for node_id, seen in self.nodes.items():
            silent = now - seen.last_seen
            if seen.state is NodeState.ALIVE and silent > self.lost_after_s:
                seen.state = NodeState.LOST
                lost.append(
                    NodeLost(
                        event_id=f"node-lost:{node_id}:{seen.last_report_id}"[:128],
                        time=wall - timedelta(seconds=silent - self.lost_after_s),
                        node_id=node_id,
                        silent_s=silent,
                        limit_s=self.lost_after_s,
                    )
                )
        return lost

    def age(self, node_id: str) -> float | None:
        """Seconds since the node's last report; None if it never reported."""
        seen = self.nodes.get(node_id)
        return None if seen is None else self.clock.monotonic() - seen.last_seen
