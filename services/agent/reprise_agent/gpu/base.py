"""The interface every GPU backend implements."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from reprise_common.events import GpuStatus

# XIDs after which the job on that GPU cannot continue (REFERENCE.md: the immediate action is a reset or a reboot).
FATAL_XIDS = frozenset({46, 48, 61, 62, 64, 74, 79, 95, 109, 119, 120, 140, *range(144, 151)})


class SignalKind(StrEnum):
    """Discrete GPU happenings that are published at once, not in the next report."""

    XID = "xid"
    LOST = "lost"


@dataclass(frozen=True)
class GpuSignal:
    """One discrete GPU happening."""

    kind: SignalKind
    gpu: int
    xid: int | None = None
    message: str = ""


class GpuBackend(Protocol):
    """Reads GPU health; never raises for an unreadable GPU (it reports it as unknown or lost instead)."""

    name: str
    error: str  # why the GPUs cannot be read at all ("" when they can)

    def statuses(self) -> list[GpuStatus]:
        """One status per GPU, in index order."""
        ...

    def drain_signals(self) -> list[GpuSignal]:
        """Signals seen since the last call."""
        ...

    def close(self) -> None:
        """Release the backend."""
        ...
