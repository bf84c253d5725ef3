"""rank.numeric: a watched training metric of one rank (the loss, or what the job's policy names) went NaN, infinite
or spiked. Sent by the agent (RankNumeric, from the SDK's numeric watch); classified by the `rank_numeric` section of
rules.yaml; it counts for its job alone, its culprit carrying the launch and the fault's step (a recovery restores a
checkpoint older than it)."""

from __future__ import annotations

from typing import Any

from reprise_common.events import NumericKind, RankNumeric
from reprise_detector.kinds.base import Blame, Scope
from reprise_detector.kinds.wire import Template


class RankNumericKind(Template[RankNumeric]):
    """A numeric fault, worded by its summary."""

    event = RankNumeric
    section = "rank_numeric"

    def facts(self, event: RankNumeric) -> dict[str, Any]:
        """Its summary."""
        return {"summary": summary(event)}

    def scope(self, event: RankNumeric) -> Scope:
        """Its job and rank."""
        return Scope(job_id=event.job_id, rank=event.rank)

    def detail(self, event: RankNumeric) -> str:
        """Its summary."""
        return summary(event)

    def blame(self, event: RankNumeric) -> Blame:
        """Its launch and the fault's step."""
        return Blame(restart_epoch=event.restart_epoch, fault_step=event.step)


def summary(event: RankNumeric) -> str:
    """What a numeric fault was, in a few words: "loss became NaN at step 57 (last fine at 56)"."""
    match event.kind:
        case NumericKind.NAN:
            what = "became NaN"
        case NumericKind.INF:
            what = "became infinite"
        case NumericKind.SPIKE:
            what = f"spiked to {event.value:.4g} (robust z {event.z:g} against a recent median of {event.median:.4g})"
    last = f" (last fine at step {event.last_good_step})" if event.last_good_step is not None else ""
    return f"{event.metric} {what} at step {event.step}{last}"


KIND = RankNumericKind()
