"""node.unreachable: a node silent past the limit while its jobs' ranks on other nodes go on advancing with it (alive,
its control plane cut off). Produced by the watch's liveness stage (nodes/liveness.py); classified by the
`node_unreachable` section (said once a silence, never a recovery); it counts for every job placed on the node."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from reprise_detector.kinds.base import Derived


class NodeUnreachable(Derived):
    """A node silent past `limit_s` while its jobs' ranks on other nodes go on advancing with it: alive, its control
    plane cut off (said once a silence; never a recovery)."""

    section = "node_unreachable"

    type: Literal["node.unreachable"] = "node.unreachable"
    silent_s: float
    limit_s: float
    how: str = Field(max_length=512)

    def facts(self) -> dict[str, Any]:
        """Its silence in tenths of a second."""
        return {"silent_s": f"{self.silent_s:.1f}"}

    def detail(self) -> str:
        """What showed it and the limit that applied."""
        return f"{self.how} (limit {self.limit_s:g} s)"


KIND = NodeUnreachable
