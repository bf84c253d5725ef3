"""rank.parked: a rank running under reprise_sdk.run left its training function and waits, alive, for the next epoch
(a restart in place). Sent by the agent (RankParked); no rules.yaml section: it is evidence only, fixed here (see
`parked`); its `why` feeds the peers' errors (nodes/peers.py). It counts for its job alone."""

from __future__ import annotations

from pydantic import BaseModel

from reprise_common.events import Category, RankParked, RecommendedAction, Severity
from reprise_detector.kinds.base import Classification, Scope
from reprise_detector.kinds.wire import Wire


class RankParkedKind(Wire[RankParked, None]):
    """A parked rank: a survivor, never a cause nor a symptom."""

    event = RankParked

    def merge(self, builtin: BaseModel, operator: BaseModel) -> None:
        """No rules of its own."""

    def classify(self, event: RankParked, rules: None) -> Classification:
        """Evidence only, whatever an operator's rules say."""
        return parked(event)

    def scope(self, event: RankParked) -> Scope:
        """Its job and rank."""
        return Scope(job_id=event.job_id, rank=event.rank)

    def detail(self, event: RankParked) -> str:
        """What it caught."""
        return event.why


def parked(event: RankParked) -> Classification:
    """A rank parked for a restart in place survived a fault: never a cause nor a symptom, whatever an operator's rules
    say, so fixed here rather than in rules.yaml; its `why` is evidence of a lost peer (nodes/peers.py) and nothing
    more."""
    reason = f"rank {event.rank} parked for a restart in place: {event.why or 'no reason given'}"
    return Classification(
        Category.APPLICATION, Severity.INFO, RecommendedAction.NONE, False, reason, evidence_only=True
    )


KIND = RankParkedKind()
