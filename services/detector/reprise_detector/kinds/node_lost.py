"""node.lost: a node that used to report is silent past the limit, or its connection closed and did not come back
within the grace. Produced by the watch's liveness stage (nodes/liveness.py) and peers' errors (nodes/peers.py);
classified by the `node_lost` section; it counts for every job placed on the node."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from reprise_detector.kinds.base import Derived


class NodeLost(Derived):
    """A node that used to report is silent for longer than the limit, or its agent's connection closed and did not
    come back within the grace (`limit_s` is the one that applied)."""

    section = "node_lost"

    type: Literal["node.lost"] = "node.lost"
    silent_s: float
    limit_s: float
    how: str = Field(max_length=512)  # what showed it, for the incident's reason

    def facts(self) -> dict[str, Any]:
        """Its silence in tenths of a second."""
        return {"silent_s": f"{self.silent_s:.1f}"}

    def detail(self) -> str:
        """What showed it and the limit that applied."""
        return f"{self.how} (limit {self.limit_s:g} s)"


KIND = NodeLost
