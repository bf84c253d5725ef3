"""Fault injection (drills, the demo): what an agent is asked to break, and what it did."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from reprise_common.events.base import Wire


class FaultKind(StrEnum):
    """Faults an agent can inject: GPU faults (simulated backend) and process faults (drills, the demo)."""

    XID = "xid"
    ECC_DBE = "ecc_dbe"
    THERMAL = "thermal"
    OFF_BUS = "off_bus"
    NVLINK = "nvlink"
    RANK_KILL = "rank_kill"  # SIGKILL one rank
    RANK_HANG = "rank_hang"  # SIGSTOP one rank: alive, silent, its peers blocked in the next collective
    NODE_LOSS = "node_loss"  # SIGKILL every rank on the node, then the agent itself: the node is gone


PROCESS_FAULTS = frozenset({FaultKind.RANK_KILL, FaultKind.RANK_HANG, FaultKind.NODE_LOSS})


class InjectFault(Wire):
    """Ask a node to fail in a given way: its simulated GPU `gpu`, or its rank `rank` (of `job_id`, if given)."""

    kind: FaultKind
    gpu: int = Field(default=0, ge=0)
    xid: int | None = None
    rank: int | None = Field(default=None, ge=0, description="the rank a rank fault hits (default: the node's first)")
    job_id: str | None = None


class InjectReply(Wire):
    """What the simulated backend did with an injected fault."""

    accepted: bool
    detail: str = ""
