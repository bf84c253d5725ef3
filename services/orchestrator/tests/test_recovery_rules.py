"""The recovery policy and re-placement rules, table-tested (pure functions, no servers)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from reprise_common.events import Category, Culprit, IncidentChange, RecommendedAction, Severity
from reprise_orchestrator.jobs.models import Job, JobCreate, RecoveryPolicy
from reprise_orchestrator.jobs.placement import PlacementDecision, replan
from reprise_orchestrator.recoveries import policy
from reprise_orchestrator.recoveries.models import Outcome

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


def incident(**overrides: Any) -> IncidentChange:
    fields: dict[str, Any] = {
        "source": "detector",
        "change": "opened",
        "incident_id": "inc-1",
        "job_id": "job-1",
        "category": Category.APPLICATION,
        "severity": Severity.CRITICAL,
        "root_cause": "rank 3 exited with exit code 1",
        "culprit": Culprit(node_id="node-2", rank=3, exit_code=1),
        "recommended_action": RecommendedAction.RESTART_JOB,
        "first_symptom_at": NOW,
    }
    return IncidentChange(**(fields | overrides))


def job(**overrides: Any) -> Job:
    spec = JobCreate(name="j", node_count=2, command=["true"])
    return Job(id="job-1", name="j", spec=spec.model_dump(mode="json"), **overrides)


@pytest.mark.parametrize(
    ("job_fields", "policy_fields", "incident_fields", "outcome"),
    [
        ({}, {}, {}, None),
        ({}, {"non_retryable_exit_codes": [1]}, {}, Outcome.NON_RETRYABLE),
        ({}, {"non_retryable_exit_codes": [2]}, {}, None),
        ({"restart_times": [NOW.isoformat()] * 2}, {"max_restarts": 2}, {}, Outcome.BUDGET_SPENT),
        (  # restarts older than the window do not count
            {"restart_times": [(NOW - timedelta(hours=2)).isoformat()] * 2},
            {"max_restarts": 2, "restart_window_s": 3600},
            {},
            None,
        ),
        (
            {"last_error": "application|rank 3 exited with exit code 1|rank=3|exit=1", "same_error_streak": 3},
            {"max_same_error": 3},
            {},
            Outcome.SAME_ERROR,
        ),
        (
            {"last_error": "application|rank 3 exited with exit code 1|rank=3|exit=1", "same_error_streak": 2},
            {"max_same_error": 3},
            {},
            None,
        ),
        ({"last_error": "something else", "same_error_streak": 9}, {"max_same_error": 3}, {}, None),
        ({"no_progress_streak": 3}, {"max_recoveries_without_progress": 3}, {}, Outcome.NO_PROGRESS),
        ({"no_progress_streak": 2}, {"max_recoveries_without_progress": 3}, {}, None),
        ({}, {}, {"recommended_action": RecommendedAction.ALERT_HUMAN}, Outcome.HUMAN_ASKED),
    ],
    ids=[
        "fresh",
        "non-retryable",
        "other-code",
        "budget-spent",
        "budget-window",
        "same-error",
        "same-error-below",
        "different-error",
        "no-progress",
        "no-progress-below",
        "human",
    ],
)
def test_admission(
    job_fields: dict[str, Any], policy_fields: dict[str, Any], incident_fields: dict[str, Any], outcome: Outcome | None
) -> None:
    verdict = policy.admit(job(**job_fields), incident(**incident_fields), RecoveryPolicy(**policy_fields), now=NOW)
    assert verdict.outcome is outcome, verdict
    assert verdict.proceed is (outcome is None)


@pytest.mark.parametrize(
    ("recent", "known", "share", "allowed"),
    [
        (0, 4, 0.25, True),
        (1, 4, 0.25, False),
        (0, 2, 0.25, True),
        (1, 2, 0.25, False),
        (1, 8, 0.25, True),
        (2, 8, 0.25, False),
    ],
)
def test_circuit_breaker_allows_at_least_one_and_at_most_the_share(
    recent: int, known: int, share: float, allowed: bool
) -> None:
    verdict = policy.cordon_allowed(recent=recent, known_nodes=known, share=share)
    assert verdict.proceed is allowed
    if not allowed:
        assert verdict.outcome is Outcome.CIRCUIT_BREAKER and "human" in verdict.detail


@pytest.mark.parametrize(
    ("action", "category", "cordon", "exclude"),
    [
        (RecommendedAction.RESTART_EXCLUDE_NODE, Category.GPU_HARDWARE, True, True),
        (RecommendedAction.RESET_GPU, Category.GPU_HARDWARE, True, True),
        (RecommendedAction.RESTART_EXCLUDE_NODE, Category.NODE, False, True),  # a lost node may come back
        (RecommendedAction.RESTART_JOB, Category.APPLICATION, False, False),
    ],
)
def test_isolation_cordons_hardware_culprits_and_leaves_lost_nodes_out(
    action: RecommendedAction, category: Category, cordon: bool, exclude: bool
) -> None:
    fault = incident(recommended_action=action, category=category)
    assert policy.should_cordon(fault) is cordon
    assert policy.should_exclude(fault) is exclude


@pytest.mark.parametrize(
    ("usable", "spares", "policy_fields", "decision", "nodes"),
    [
        ({"a", "b", "c"}, ["s1"], {}, PlacementDecision.SAME, ["a", "b", "c"]),
        ({"a", "c", "s1"}, ["s1"], {}, PlacementDecision.SPARES, ["a", "s1", "c"]),  # the spare takes b's place
        ({"a", "c"}, [], {"elastic_min_nodes": 2}, PlacementDecision.SHRINK, ["a", "c"]),
        ({"a", "c"}, [], {}, PlacementDecision.WAIT, ["a", "c"]),
        ({"a"}, [], {"elastic_min_nodes": 2}, PlacementDecision.WAIT, ["a"]),
        ({"a", "s1"}, ["s1"], {"elastic_min_nodes": 2}, PlacementDecision.SHRINK, ["a", "s1"]),  # spare, then shrink
        ({"a", "c", "s1"}, ["s1"], {"use_spares": False, "elastic_min_nodes": 1}, PlacementDecision.SHRINK, ["a", "c"]),
    ],
    ids=["same", "spare", "shrink", "wait", "below-min", "spare-then-shrink", "no-spares-by-policy"],
)
def test_replan(
    usable: set[str], spares: list[str], policy_fields: dict[str, Any], decision: PlacementDecision, nodes: list[str]
) -> None:
    plan = replan(["a", "b", "c"], usable=usable, spares=spares, policy=RecoveryPolicy(**policy_fields))
    assert (plan.decision, plan.nodes) == (decision, nodes)


def test_backoff_grows_and_is_capped() -> None:
    rules = RecoveryPolicy(backoff_initial_s=1, backoff_factor=2, backoff_max_s=5)
    assert [rules.backoff_s(n) for n in range(6)] == [0, 1, 2, 4, 5, 5]


@pytest.mark.parametrize(
    ("policy_fields", "message"),
    [
        ({"elastic_min_nodes": 3, "elastic_max_nodes": 2}, "elastic_min_nodes is larger"),
        ({"elastic_max_nodes": 1}, "elastic_max_nodes (1) is below"),
        ({"elastic_min_nodes": 3}, "elastic_min_nodes (3) is above"),
    ],
)
def test_elastic_bounds_are_checked_against_the_job(policy_fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        JobCreate(name="j", node_count=2, command=["true"], policy=RecoveryPolicy.model_validate(policy_fields))
