"""gpu.lost: a GPU an agent can no longer read (fallen off the bus, NVML says it is lost). Sent by the agent
(GpuLost); classified by the `gpu_lost` section of rules.yaml; it counts for every job placed on the node, the rank on
that GPU blamed."""

from __future__ import annotations

from typing import Any

from reprise_common.events import GpuLost
from reprise_detector.kinds.base import Scope
from reprise_detector.kinds.wire import Template


class GpuLostKind(Template[GpuLost]):
    """A lost GPU, worded by the agent's reason."""

    event = GpuLost
    section = "gpu_lost"

    def facts(self, event: GpuLost) -> dict[str, Any]:
        """The agent's reason, or that it gave none."""
        return {"reason": event.reason or "no reason given"}

    def scope(self, event: GpuLost) -> Scope:
        """Its GPU: every job placed on the node, the rank on it blamed."""
        return Scope(gpu=event.gpu)

    def detail(self, event: GpuLost) -> str:
        """The agent's reason."""
        return event.reason


KIND = GpuLostKind()
