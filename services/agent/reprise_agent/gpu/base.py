"""The interface every GPU backend implements."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from reprise_common.events import GpuStatus


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

    def statuses(self) -> list[GpuStatus]:
        """One status per GPU, in index order."""
        ...

    def drain_signals(self) -> list[GpuSignal]:
        """Signals seen since the last call."""
        ...

    def close(self) -> None:
        """Release the backend."""
        ...
