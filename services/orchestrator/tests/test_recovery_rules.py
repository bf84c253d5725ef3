"""The recovery state machine's rules and the re-placement rules, table-tested (pure functions, no servers)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from reprise_common.events import Category, Culprit, IncidentChange, RecommendedAction
from reprise_orchestrator.compute.backend import NodePool
from reprise_orchestrator.jobs.models import Job, JobCreate, JobState, RecoveryPolicy
from reprise_orchestrator.jobs.placement import PlacementDecision, replacements, replan
from reprise_orchestrator.recoveries import facts, rules
from reprise_orchestrator.recoveries.records import Baseline
from reprise_orchestrator.recoveries.rules import CordonFacts, Decision, Proposal, Reason
from reprise_orchestrator.recoveries.states import Outcome, RecoveryStep

from . import incidents

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
S = RecoveryStep


def incident(**overrides: Any) -> IncidentChange:
    return incidents.incident(**({"first_symptom_at": NOW} | overrides))


def job(**overrides: Any) -> Job:
    spec = JobCreate(name="j", node_count=2, command=["true"])
    return Job(id="job-1", name="j", spec=spec.model_dump(mode="json"), **overrides)


def proposal(
    from_step: RecoveryStep, to_step: RecoveryStep, *, attempt: int = 1, to_attempt: int | None = None, **facts: Any
) -> Proposal:
    fields: dict[str, Any] = {
        "job": job(),
        "incident": incident(),
        "policy": RecoveryPolicy(),
        "now": NOW,
        "baseline": Baseline(),
    } | facts
    target = attempt if to_attempt is None else to_attempt
    return Proposal(from_step=from_step, from_attempt=attempt, to_step=to_step, to_attempt=target, **fields)


@pytest.mark.parametrize(
    ("move", "facts", "expected"),
    [
        ((S.LOCKED, 1, S.STOPPING_RANKS, 1), {}, (Decision.ACCEPT, Reason.IN_ORDER)),
        ((S.STOPPING_RANKS, 1, S.ISOLATING, 1), {}, (Decision.ACCEPT, Reason.IN_ORDER)),
        ((S.LAUNCHING, 2, S.VERIFYING, 2), {}, (Decision.ACCEPT, Reason.IN_ORDER)),
        (
            (S.VERIFYING, 1, S.STOPPING_RANKS, 1),
            {},
            (Decision.REJECT, Reason.SAME_ATTEMPT),
        ),  # a retry needs a new attempt
        ((S.VERIFYING, 1, S.STOPPING_RANKS, 2), {}, (Decision.ACCEPT, Reason.NEW_ATTEMPT)),
        ((S.VERIFYING, 1, S.STOPPING_RANKS, 3), {}, (Decision.REJECT, Reason.SKIPPED_ATTEMPT)),
        ((S.LAUNCHING, 3, S.STOPPING_RANKS, 4), {}, (Decision.ABORT, Reason.ATTEMPTS)),  # 3 attempts by default
        ((S.STOPPING_RANKS, 1, S.LAUNCHING, 1), {}, (Decision.REJECT, Reason.NO_RULE)),  # skips steps
        ((S.PLACING, 1, S.STOPPING_RANKS, 1), {}, (Decision.REJECT, Reason.SAME_ATTEMPT)),
        ((S.LOCKED, 1, S.ISOLATING, 1), {}, (Decision.REJECT, Reason.NO_RULE)),
        ((S.RUNNING, 1, S.STOPPING_RANKS, 2), {}, (Decision.REJECT, Reason.FINISHED)),  # a finished recovery stays so
        ((S.FAILED, 1, S.RUNNING, 1), {"outcome": Outcome.RECOVERED}, (Decision.REJECT, Reason.FINISHED)),
        ((S.VERIFYING, 1, S.RUNNING, 1), {"outcome": Outcome.RECOVERED}, (Decision.ACCEPT, Reason.ENDS)),
        ((S.LAUNCHING, 1, S.RUNNING, 1), {"outcome": Outcome.RECOVERED}, (Decision.REJECT, Reason.NOT_VERIFIED)),
        ((S.VERIFYING, 1, S.RUNNING, 1), {}, (Decision.REJECT, Reason.WRONG_END)),  # an end names its outcome
        ((S.PLACING, 1, S.FAILED, 1), {"outcome": Outcome.NO_CAPACITY}, (Decision.ACCEPT, Reason.ENDS)),
        ((S.PLACING, 1, S.HELD, 1), {"outcome": Outcome.NO_CAPACITY}, (Decision.REJECT, Reason.WRONG_END)),
        ((S.ISOLATING, 1, S.HELD, 1), {"outcome": Outcome.CIRCUIT_BREAKER}, (Decision.ACCEPT, Reason.ENDS)),
        ((S.LAUNCHING, 2, S.FAILED, 2), {"outcome": Outcome.CANCELLED}, (Decision.ACCEPT, Reason.ENDS)),
        ((S.PLACING, 1, S.ISOLATING, 1), {"learned": "now gpu_hardware"}, (Decision.ACCEPT, Reason.REPLAN)),
        ((S.PLACING, 1, S.ISOLATING, 1), {}, (Decision.REJECT, Reason.NOTHING_LEARNED)),
        ((S.RESTORING, 1, S.ISOLATING, 1), {"learned": "x", "replans": 5}, (Decision.REJECT, Reason.REPLAN_LIMIT)),
        (
            (S.VERIFYING, 1, S.ISOLATING, 1),
            {"learned": "x"},
            (Decision.REJECT, Reason.NO_RULE),
        ),  # launched: new attempt
    ],
)
def test_transitions(
    move: tuple[RecoveryStep, int, RecoveryStep, int], facts: dict[str, Any], expected: tuple[Decision, Reason]
) -> None:
    from_step, attempt, to_step, to_attempt = move
    answer = rules.decide(proposal(from_step, to_step, attempt=attempt, to_attempt=to_attempt, **facts))
    assert (answer.decision, answer.reason) == expected, answer
    assert answer.rule or expected[1] is Reason.NO_RULE  # every answer says which rule gave it


def test_an_illegal_transition_is_refused_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    answer = rules.decide(proposal(S.VERIFYING, S.STOPPING_RANKS), recovery_id="rec-1")
    assert answer.decision is Decision.REJECT
    refused = [r for r in caplog.records if r.getMessage() == "transition refused"]
    assert refused and refused[0].__dict__["recovery_id"] == "rec-1" and "needs a new attempt" in answer.detail


@pytest.mark.parametrize(
    ("job_fields", "policy_fields", "baseline", "incident_fields", "outcome"),
    [
        ({}, {}, {}, {}, None),
        ({}, {"non_retryable_exit_codes": [1]}, {}, {}, Outcome.NON_RETRYABLE),
        ({}, {"non_retryable_exit_codes": [2]}, {}, {}, None),
        ({"restart_times": [NOW] * 2}, {"max_restarts": 2}, {}, {}, Outcome.BUDGET_SPENT),
        (  # restarts older than the window do not count
            {"restart_times": [NOW - timedelta(hours=2)] * 2},
            {"max_restarts": 2, "restart_window_s": 3600},
            {},
            {},
            None,
        ),
        ({}, {"max_same_error": 3}, {"same_error_streak": 4}, {}, Outcome.SAME_ERROR),
        ({}, {"max_same_error": 3}, {"same_error_streak": 3}, {}, None),
        ({}, {"max_recoveries_without_progress": 3}, {"no_progress_streak": 3}, {}, Outcome.NO_PROGRESS),
        ({}, {"max_recoveries_without_progress": 3}, {"no_progress_streak": 2}, {}, None),
        ({}, {}, {}, {"recommended_action": RecommendedAction.ALERT_HUMAN}, Outcome.HUMAN_ASKED),
    ],
    ids=[
        "fresh",
        "non-retryable",
        "other-code",
        "budget-spent",
        "budget-window",
        "same-error",
        "same-error-below",
        "no-progress",
        "no-progress-below",
        "human",
    ],
)
def test_admission(
    job_fields: dict[str, Any],
    policy_fields: dict[str, Any],
    baseline: dict[str, Any],
    incident_fields: dict[str, Any],
    outcome: Outcome | None,
) -> None:
    answer = rules.decide(
        proposal(
            S.LOCKED,
            S.STOPPING_RANKS,
            job=job(**job_fields),
            policy=RecoveryPolicy(**policy_fields),
            baseline=Baseline(**baseline),
            incident=incident(**incident_fields),
        )
    )
    assert answer.outcome is outcome, answer
    assert answer.decision is (Decision.ACCEPT if outcome is None else Decision.ABORT)


def test_same_error_streak_counts_the_same_signature_only() -> None:
    fault = incident()
    assert facts.same_error_streak(job(last_error=facts.error_signature(fault), same_error_streak=2), fault) == 3
    assert facts.same_error_streak(job(last_error="something else", same_error_streak=9), fault) == 1


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
    cordon = CordonFacts(node_id="node-2", recent=recent, known_nodes=known)
    answer = rules.decide(
        proposal(S.ISOLATING, S.PLACING, cordon=cordon, policy=RecoveryPolicy(max_cordon_share=share))
    )
    assert (answer.decision is Decision.ACCEPT) is allowed
    if not allowed:
        assert answer.outcome is Outcome.CIRCUIT_BREAKER and "human" in answer.detail
        assert rules.end_step(answer.outcome) is S.HELD


def test_a_new_attempt_waits_for_its_backoff_then_goes() -> None:
    policy = RecoveryPolicy(backoff_initial_s=2, backoff_factor=2)
    ended = NOW - timedelta(seconds=1)
    early = rules.decide(proposal(S.VERIFYING, S.STOPPING_RANKS, to_attempt=2, attempt_ended_at=ended, policy=policy))
    assert early.decision is Decision.WAIT and early.delay_s == pytest.approx(1.0)
    later = proposal(S.VERIFYING, S.STOPPING_RANKS, to_attempt=2, attempt_ended_at=ended, policy=policy)
    later = Proposal(**(later.__dict__ | {"now": NOW + timedelta(seconds=1.5)}))
    assert rules.decide(later).decision is Decision.ACCEPT


@pytest.mark.parametrize(
    ("outcome", "end", "state"),
    [
        (Outcome.RECOVERED, S.RUNNING, JobState.RUNNING),
        (Outcome.CIRCUIT_BREAKER, S.HELD, JobState.HELD),
        (Outcome.HUMAN_ASKED, S.HELD, JobState.HELD),
        (Outcome.NO_CAPACITY, S.FAILED, JobState.FAILED),
        (Outcome.CANCELLED, S.FAILED, JobState.FAILED),
    ],
)
def test_each_outcome_maps_to_one_end_and_job_state(outcome: Outcome, end: RecoveryStep, state: JobState) -> None:
    assert rules.end_step(outcome) is end and rules.END_STATE[end] is state


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
    assert facts.should_cordon(fault) is cordon
    assert facts.should_exclude(fault) is exclude


XID = {"category": Category.GPU_HARDWARE, "recommended_action": RecommendedAction.RESTART_EXCLUDE_NODE}


@pytest.mark.parametrize(
    ("planned", "latest", "learned"),
    [
        ({}, {}, False),
        ({}, {"symptom_count": 9}, False),  # more symptoms of the same cause
        ({}, XID | {"culprit": Culprit(node_id="node-1", gpu=0)}, True),  # a hardware fault on another node
        ({}, XID, True),  # the same node, but now a node to cordon
        (XID, XID, False),  # the plan already leaves it out
        (XID, XID | {"culprit": Culprit(node_id="node-3", gpu=1)}, True),  # another culprit node
        (XID, {"category": Category.APPLICATION}, False),  # shallower
        ({}, {"category": Category.DEPENDENCY}, True),  # deeper, no node to leave out
    ],
)
def test_what_an_updated_incident_teaches_a_plan(
    planned: dict[str, Any], latest: dict[str, Any], learned: bool
) -> None:
    assert bool(facts.learned(incident(**planned), incident(**latest))) is learned


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
    rules_ = RecoveryPolicy(backoff_initial_s=1, backoff_factor=2, backoff_max_s=5)
    assert [rules_.backoff_s(n) for n in range(6)] == [0, 1, 2, 4, 5, 5]


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


def test_idle_workers_take_the_places_of_lost_nodes_once_the_spares_are_used() -> None:
    pool = NodePool(workers=["a", "c", "idle-1", "idle-2"], spares=["spare-1"])  # "b" was lost; no busy node here
    candidates = replacements(pool, ["a", "b", "c"])
    assert candidates == ["spare-1", "idle-1", "idle-2"]  # spares first
    plan = replan(["a", "b", "c"], usable=pool.usable(), spares=candidates, policy=RecoveryPolicy())
    assert (plan.decision, plan.nodes, plan.replaced) == (
        PlacementDecision.SPARES,
        ["a", "spare-1", "c"],
        {"b": "spare-1"},
    )
    no_spares = NodePool(workers=["a", "c", "idle-1"], spares=[])
    plan = replan(
        ["a", "b", "c"],
        usable=no_spares.usable(),
        spares=replacements(no_spares, ["a", "b", "c"]),
        policy=RecoveryPolicy(),
    )
    assert (plan.decision, plan.nodes) == (PlacementDecision.SPARES, ["a", "idle-1", "c"])  # was WAIT, then no_capacity
