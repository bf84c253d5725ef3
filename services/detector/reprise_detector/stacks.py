"""The stacks of a hung job's ranks, and the culprit they name.

When a hang's recovery stops the job, each agent first captures the Python stacks of the job's ranks on its node
(`rank.stacks`, one event per rank). A collective hang shows as every rank but one waiting in the same
torch.distributed call (all_reduce, barrier, ...): the one elsewhere is the culprit — stuck in its data loader, in a
lock, in a loop. A rank whose process the kernel holds (stopped, or in uninterruptible sleep) is the culprit
whatever its stack says, as for the hang itself (progress.stalls.HELD_STATES). How one rank's stacks read (where its
main thread waits, its top frame) is the shared library's (reprise_common.thread_stacks), as the agent's sampler
reads it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from reprise_common.thread_stacks import top_frame, waits_in
from reprise_detector.progress.stalls import HELD_STATES

__all__ = ["StackView", "Verdict", "culprit", "top_frame", "waits_in"]


@dataclass(frozen=True)
class StackView:
    """What the culprit rule reads of one rank's stacks."""

    rank: int
    node_id: str
    proc_state: str
    waits_in: str | None
    top: str
    error: str


@dataclass(frozen=True)
class Verdict:
    """The rank the stacks blame, and why."""

    rank: int
    node_id: str
    reason: str

    def line(self) -> str:
        """The verdict as the incident shows it."""
        return f"rank {self.rank} on {self.node_id}: {self.reason}"


def culprit(views: Sequence[StackView]) -> Verdict | None:
    """The rank the stacks name, or None: a held process first; else the one rank (the lowest, when several)
    outside the collective that the most ranks wait in, when at least one rank waits in it."""
    held = sorted((v for v in views if v.proc_state in HELD_STATES), key=lambda v: v.rank)
    if held:
        first = held[0]
        at = f"; its stack is at {first.top}" if first.top else ""
        return Verdict(first.rank, first.node_id, f"{HELD_STATES[first.proc_state]}{at}")
    read = [v for v in views if not v.error and v.top]
    waiting = Counter(v.waits_in for v in read if v.waits_in is not None)
    if not waiting:
        return None
    collective, _ = waiting.most_common(1)[0]
    outside = sorted((v for v in read if v.waits_in != collective), key=lambda v: v.rank)
    if not outside:
        return None
    first = outside[0]
    peers = sorted(v.rank for v in read if v.waits_in == collective)
    return Verdict(
        first.rank, first.node_id, f"its stack is at {first.top}, not in {collective}, where ranks {peers} wait"
    )
