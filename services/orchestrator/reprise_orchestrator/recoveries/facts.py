"""The facts the recovery rules and steps weigh, read from a job and its incident: whether it is the same error again,
the restarts in the policy's window, whether to leave out or cordon the culprit node, what to restore and skip, and
what a later incident learned that the plan did not know."""

from __future__ import annotations

import math
from datetime import datetime, timedelta

from reprise_common.events import CAUSE_DEPTH, Category, IncidentChange, RecommendedAction, StepSpan
from reprise_orchestrator.jobs.models import Job, RecoveryPolicy


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
    return sum(at >= since for at in job.restart_times)


def should_exclude(incident: IncidentChange) -> bool:
    """Leave the culprit node out of the new placement (cordoned or lost)."""
    return incident.culprit.node_id is not None and (
        incident.recommended_action in (RecommendedAction.RESTART_EXCLUDE_NODE, RecommendedAction.RESET_GPU)
    )


def node_gone(incident: IncidentChange) -> str | None:
    """The node a node fault says is gone (lost, down, failed): no stop is waited for there, where nothing answers
    until a cut link heals or the server gives up the connection (20 s); its ranks, if it comes back, are stopped
    then (jobs/strays.py). None for any other fault."""
    gone = incident.category is Category.NODE and incident.recommended_action is RecommendedAction.RESTART_EXCLUDE_NODE
    return incident.culprit.node_id if gone else None


def scheduler_took_the_nodes(incident: IncidentChange) -> bool:
    """The compute scheduler ended the whole job's step (a preemption, a time limit: a dependency incident that names
    no node): its agents went with it and the job's next allocation brings new ones, so a node whose agent is gone is
    no node to leave out; the placement waits for that allocation."""
    return incident.category is Category.DEPENDENCY and incident.culprit.node_id is None


def should_cordon(incident: IncidentChange) -> bool:
    """Cordon the culprit node for faults of the node's hardware; a lost node is only left out (it may come back)."""
    return should_exclude(incident) and incident.category is not Category.NODE


def stacks_wanted(incident: IncidentChange, *, attempt: int) -> str | None:
    """The incident to capture the ranks' stacks for before the stop: a hang's, on the recovery's first stop only
    (later attempts stop ranks of a new epoch, which the hang did not see)."""
    return incident.incident_id if incident.category is Category.HANG and attempt == 1 else None


def restore_before(incident: IncidentChange) -> int | None:
    """A numeric fault's step: the restore must pick a checkpoint older than it (None: the newest will do)."""
    return incident.culprit.fault_step if incident.category is Category.NUMERIC else None


def skipped_steps(incident: IncidentChange, policy: RecoveryPolicy) -> StepSpan | None:
    """The steps whose data the relaunched ranks skip: the policy's count, ending at a numeric fault's step."""
    fault_step = restore_before(incident)
    if fault_step is None or policy.numeric is None or policy.numeric.skip_steps == 0:
        return None
    return StepSpan(first=max(0, fault_step - policy.numeric.skip_steps + 1), last=fault_step)


def cordon_limit(known_nodes: int, share: float) -> int:
    """How many nodes recoveries may cordon per window: the policy's share of the fleet, at least one."""
    return max(1, math.floor(share * known_nodes))


def learned(planned: IncidentChange, latest: IncidentChange) -> str:
    """What `latest` knows that the plan for `planned` did not: a deeper root cause, or a culprit node to leave out
    ("" when nothing); the plan must change when it is not empty."""
    deeper = CAUSE_DEPTH.get(latest.category, 0) > CAUSE_DEPTH.get(planned.category, 0)
    node = latest.culprit.node_id
    excluded = should_exclude(planned) and planned.culprit.node_id == node
    new_culprit = should_exclude(latest) and node is not None and not excluded
    if deeper or new_culprit:
        where = f" on {node}" if node else ""
        return f"the incident is now {latest.category.value}{where}: {latest.root_cause}"
    return ""
