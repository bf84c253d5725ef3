"""In place or cold: which ranks of a job keep their processes across a recovery, and why.

In place (policy `restart_mode: auto`, the default): ranks whose script runs under `reprise_sdk.run` park instead of
being stopped, and the next launch hands them the new epoch; only the culprit rank and every rank on a node the job
leaves (a cordoned or lost node) are stopped and replaced, from the agents' warm standbys where there are some. Cold
(`restart_mode: cold`, a retry of a failed attempt, or a script that does not opt in): every rank is stopped and
started afresh. The choice and its reason are recorded in the stop's step data (records.Stopped).
"""

from __future__ import annotations

from dataclasses import dataclass

from reprise_common.events import Category, IncidentChange, StopReply
from reprise_orchestrator.compute.backend import Answers, InPlace, parked_ranks
from reprise_orchestrator.jobs.models import RecoveryPolicy
from reprise_orchestrator.recoveries import facts

IN_PLACE, COLD = "in_place", "cold"


@dataclass(frozen=True)
class RestartPlan:
    """What the stop asks of the backend (None: stop everything) and why."""

    in_place: InPlace | None
    why: str


def plan(incident: IncidentChange, policy: RecoveryPolicy, *, attempt: int) -> RestartPlan:
    """In place when the policy allows it on a recovery's first attempt; the culprit and a node the job leaves cold."""
    if policy.restart_mode == COLD:
        return RestartPlan(None, "the job's policy says restart_mode: cold")
    if attempt > 1:
        return RestartPlan(None, f"attempt {attempt}: a retry after a failed attempt restarts every rank cold")
    culprit = incident.culprit
    # A numeric fault's first rank is a healthy process that saw bad data; any other culprit rank may be broken.
    kill = frozenset() if incident.category is Category.NUMERIC or culprit.rank is None else frozenset({culprit.rank})
    leaving = culprit.node_id if culprit.node_id is not None and facts.should_exclude(incident) else None
    cold_nodes = frozenset({leaving}) if leaving else frozenset()
    parts = ["restart_mode auto: ranks that can restart in place are parked"]
    if kill:
        parts.append(f"the culprit rank {culprit.rank} is replaced")
    if leaving:
        parts.append(f"the ranks on {leaving}, which the job leaves, are replaced")
    return RestartPlan(InPlace(kill_ranks=kill, cold_nodes=cold_nodes), "; ".join(parts))


def outcome(chosen: RestartPlan, answers: Answers[StopReply]) -> tuple[str, list[int], str]:
    """The path the stop took (in place when any rank parked), the parked ranks, and why."""
    parked = parked_ranks(answers)
    if chosen.in_place is None:
        return COLD, parked, chosen.why
    if not parked:
        return COLD, parked, "no rank could restart in place (the script does not run under reprise_sdk.run)"
    return IN_PLACE, parked, f"{chosen.why}; {len(parked)} parked"
