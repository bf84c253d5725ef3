"""The recovery policy's rules as pure functions: whether a recovery may start, and whether a node may be cordoned.

Each rule returns a verdict with a reason enum, never a bare bool, so the recovery record says why it stopped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta

from reprise_common.events import Category, IncidentChange, RecommendedAction
from reprise_orchestrator.jobs.models import Job, RecoveryPolicy
from reprise_orchestrator.recoveries.models import Outcome


@dataclass(frozen=True)
class Verdict:
    """None as outcome: go on; otherwise the recovery ends with this outcome and detail."""

    outcome: Outcome | None = None
    detail: str = ""

    @property
    def proceed(self) -> bool:
        """True when nothing stops the recovery."""
        return self.outcome is None


GO = Verdict()


def error_signature(incident: IncidentChange) -> str:
    """What makes two incidents "the same error": category, root cause, culprit rank and exit code."""
    culprit = incident.culprit
    return f"{incident.category.value}|{incident.root_cause}|rank={culprit.rank}|exit={culprit.exit_code}"


def same_error_streak(job: Job, incident: IncidentChange) -> int:
    """How many recoveries in a row (this one included) answer the same error."""
    return job.same_error_streak + 1 if error_signature(incident) == job.last_error else 1


def restarts_in_window(job: Job, *, now: datetime, window_s: float) -> int:
    """Restarts of the job within the policy's window."""
    since = now - timedelta(seconds=window_s)
    return sum(datetime.fromisoformat(at) >= since for at in job.restart_times)


def admit(job: Job, incident: IncidentChange, policy: RecoveryPolicy, *, now: datetime) -> Verdict:
    """Whether a recovery for `incident` may start, by the job's policy and history (first failing rule wins)."""
    exit_code = incident.culprit.exit_code
    if incident.recommended_action is RecommendedAction.ALERT_HUMAN:
        return Verdict(Outcome.HUMAN_ASKED, f"the detector asks for a human: {incident.root_cause}")
    if exit_code is not None and exit_code in policy.non_retryable_exit_codes:
        return Verdict(
            Outcome.NON_RETRYABLE, f"rank {incident.culprit.rank} exited with non-retryable code {exit_code}"
        )
    used = restarts_in_window(job, now=now, window_s=policy.restart_window_s)
    if used >= policy.max_restarts:
        return Verdict(Outcome.BUDGET_SPENT, f"restart budget spent: {used} restarts in {policy.restart_window_s:g} s")
    streak = same_error_streak(job, incident)
    if streak > policy.max_same_error:
        return Verdict(Outcome.SAME_ERROR, f"the same error {streak} times in a row: {incident.root_cause}")
    if job.no_progress_streak >= policy.max_recoveries_without_progress:
        return Verdict(
            Outcome.NO_PROGRESS,
            f"{job.no_progress_streak} recoveries in a row restored no newer checkpoint",
        )
    return GO


def should_cordon(incident: IncidentChange) -> bool:
    """Cordon the culprit node for faults of the node's hardware; a lost node is only left out (it may come back)."""
    return (
        incident.culprit.node_id is not None
        and incident.category is not Category.NODE
        and incident.recommended_action in (RecommendedAction.RESTART_EXCLUDE_NODE, RecommendedAction.RESET_GPU)
    )


def should_exclude(incident: IncidentChange) -> bool:
    """Leave the culprit node out of the new placement (cordoned or lost)."""
    return incident.culprit.node_id is not None and (
        incident.recommended_action in (RecommendedAction.RESTART_EXCLUDE_NODE, RecommendedAction.RESET_GPU)
    )


def cordon_allowed(*, recent: int, known_nodes: int, share: float) -> Verdict:
    """The circuit breaker: recoveries may cordon at most max(1, share * nodes) nodes per window."""
    limit = max(1, math.floor(share * known_nodes))
    if recent >= limit:
        return Verdict(
            Outcome.CIRCUIT_BREAKER,
            f"circuit breaker open: recoveries already cordoned {recent} of {known_nodes} nodes in the window "
            f"(limit {limit}); a human must decide",
        )
    return GO
