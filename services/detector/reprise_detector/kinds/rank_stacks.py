"""rank.stacks: the Python stacks of one rank, captured by its agent before a hang's recovery stopped it. Sent by the
agent (RankStacks); classified by the `rank_stacks` section of rules.yaml (evidence for the hang's incident, never a
cause of its own: the culprit they name is stacks.py's); it counts for its job alone.

A rank's stacks in one line (`summary`; how they read is reprise_common.thread_stacks); stacks.py names the
culprit from them.
"""

from __future__ import annotations

from typing import Any

from reprise_common.events import RankStacks
from reprise_common.thread_stacks import top_frame, waits_in
from reprise_detector.kinds.base import Scope
from reprise_detector.kinds.wire import Template


class RankStacksKind(Template[RankStacks]):
    """A rank's stacks, worded by their summary."""

    event = RankStacks
    section = "rank_stacks"

    def facts(self, event: RankStacks) -> dict[str, Any]:
        """Their summary."""
        return {"summary": summary(event)}

    def scope(self, event: RankStacks) -> Scope:
        """Its job and rank."""
        return Scope(job_id=event.job_id, rank=event.rank)

    def detail(self, event: RankStacks) -> str:
        """Their summary."""
        return summary(event)


def summary(event: RankStacks) -> str:
    """One line for a rank's stacks: where its main thread is, or why nothing was captured."""
    if event.error:
        return f"not captured: {event.error}"
    collective = waits_in(event.threads)
    state = f"process state {event.proc_state}; " if event.proc_state else ""
    inside = f"waits in {collective}" if collective else "not in a collective"
    return f"{state}{inside}; at {top_frame(event.threads) or 'no frame'} ({len(event.threads)} threads)"


KIND = RankStacksKind()
