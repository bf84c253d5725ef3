"""What the dashboard reads of a hang's stacks in the detector's incident detail, parsed at the edge.

A detector from before stack captures sends neither `stacks` nor `stacks_verdict`: both read as empty.
"""

from __future__ import annotations

from typing import Any

from pydantic import AwareDatetime, Field

from reprise_dashboard.jobs.models import Record

PROCESS_STATES = {  # the kernel's one-letter process states (proc(5)), as a person reads them
    "R": "running",
    "S": "sleeping",
    "D": "waiting on I/O",
    "T": "stopped",
    "t": "stopped by a tracer",
    "Z": "zombie",
    "X": "dead",
    "I": "idle",
}


class FrameRecord(Record):
    """One Python frame of a captured stack."""

    function: str
    file: str = ""
    line: int | None = None

    @property
    def where(self) -> str:
        """The frame for a person: `load_batch (train.py:12)`."""
        place = self.file if self.line is None else f"{self.file}:{self.line}"
        return f"{self.function} ({place})" if place else self.function


class ThreadRecord(Record):
    """One thread of a rank, innermost frame first."""

    thread_id: int
    name: str = ""
    active: bool = False
    frames: list[FrameRecord] = Field(default_factory=list)


class RankStacksRecord(Record):
    """The stacks of one rank as the detector stored them, or why the agent could not capture them."""

    id: str
    node_id: str
    rank: int
    restart_epoch: int | None = None
    pid: int | None = None
    proc_state: str = ""
    waits_in: str | None = None
    error: str = ""
    capture_ms: float = 0.0
    captured_at: AwareDatetime | None = None
    threads: list[ThreadRecord] = Field(default_factory=list)  # the main thread first

    @property
    def state_text(self) -> str:
        """The process state with its meaning, e.g. `T (stopped)`; "" when the agent could not read it."""
        meaning = PROCESS_STATES.get(self.proc_state)
        return f"{self.proc_state} ({meaning})" if meaning else self.proc_state

    @property
    def main_thread(self) -> ThreadRecord | None:
        """The thread the rank's training loop runs in, when one was captured."""
        return self.threads[0] if self.threads else None

    @property
    def other_threads(self) -> list[ThreadRecord]:
        """Every thread but the main one (data loaders, NCCL watchdogs, ...)."""
        return self.threads[1:]


def stacks_of(detail: Any) -> list[RankStacksRecord]:
    """The incident's stacks in rank order; none for an incident without them (or from an older detector)."""
    rows = (detail.get("stacks") or []) if isinstance(detail, dict) else []
    return sorted((RankStacksRecord.model_validate(row) for row in rows), key=lambda s: (s.rank, s.node_id))
