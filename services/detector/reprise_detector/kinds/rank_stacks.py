"""rank.stacks: the Python stacks of one rank, captured by its agent before a hang's recovery stopped it. Sent by the
agent (RankStacks); classified by the `rank_stacks` section of rules.yaml (evidence for the hang's incident, never a
cause of its own: the culprit they name is stacks.py's); it counts for its job alone.

How a rank's stacks read (`waits_in`, `top_frame`, `summary`) is here; stacks.py names the culprit from them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from reprise_common.events import RankStacks, ThreadStack
from reprise_detector.kinds.base import Scope
from reprise_detector.kinds.wire import Template

COLLECTIVES_PATH = "torch/distributed/"  # a frame of this package in a rank's main thread: it waits in a collective


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


def waits_in(threads: Sequence[ThreadStack]) -> str | None:
    """The torch.distributed function the main thread (the first) is in, innermost first; None when it is not."""
    if not threads:
        return None
    for frame in threads[0].frames:
        if COLLECTIVES_PATH in frame.file.replace("\\", "/"):
            return frame.function
    return None


def top_frame(threads: Sequence[ThreadStack]) -> str:
    """Where the main thread is: its innermost frame, "function (file:line)"; "" without frames."""
    if not threads or not threads[0].frames:
        return ""
    frame = threads[0].frames[0]
    where = frame.file.rsplit("/", 1)[-1]
    return f"{frame.function} ({where}:{frame.line})" if frame.line is not None else f"{frame.function} ({where})"


def summary(event: RankStacks) -> str:
    """One line for a rank's stacks: where its main thread is, or why nothing was captured."""
    if event.error:
        return f"not captured: {event.error}"
    collective = waits_in(event.threads)
    state = f"process state {event.proc_state}; " if event.proc_state else ""
    inside = f"waits in {collective}" if collective else "not in a collective"
    return f"{state}{inside}; at {top_frame(event.threads) or 'no frame'} ({len(event.threads)} threads)"


KIND = RankStacksKind()
