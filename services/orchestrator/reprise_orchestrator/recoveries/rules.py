"""Every rule of the recovery state machine, in one ordered policy.

A transition is a proposal to move a recovery from one step of one attempt to another. Each rule names the steps it
applies from and to, and answers ACCEPT, REJECT (refused), WAIT (ask again after a delay) or ABORT (end the recovery
instead, with an outcome), or has nothing to say about this proposal. `decide` asks the rules that apply in POLICY
order: the first answer that is not ACCEPT wins, and a transition that no rule accepts is refused and logged. The
recovery service persists a step only when `decide` accepts it (recoveries/service.py `move`). The facts the rules
weigh are read in recoveries/facts.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from reprise_common.events import IncidentChange, RecommendedAction
from reprise_common.logging import get_logger
from reprise_orchestrator.jobs.models import Job, JobState, RecoveryPolicy
from reprise_orchestrator.recoveries.facts import cordon_limit, restarts_in_window
from reprise_orchestrator.recoveries.records import Baseline
from reprise_orchestrator.recoveries.states import ATTEMPT_STEPS, TERMINAL_STEPS, Outcome, RecoveryStep

log = get_logger("reprise.orchestrator.rules")
MAX_REPLANS = 5  # re-plans of one attempt: an incident can deepen only so often, and each new culprit is left out


class Decision(StrEnum):
    """A rule's answer to a proposed transition."""

    ACCEPT = "accept"
    REJECT = "reject"
    WAIT = "wait"
    ABORT = "abort"


class Reason(StrEnum):
    """Why a rule answered as it did."""

    IN_ORDER = "in_order"  # the next step of the attempt
    NEW_ATTEMPT = "new_attempt"  # back to stopping_ranks with the next attempt number
    REPLAN = "replan"  # isolate and place again: the incident learned something
    ENDS = "ends"  # the end that the outcome maps to
    NO_RULE = "no_rule"  # no rule accepts this transition
    FINISHED = "finished"  # a finished recovery does not move
    SAME_ATTEMPT = "same_attempt"  # back to stopping_ranks without a new attempt
    SKIPPED_ATTEMPT = "skipped_attempt"  # an attempt number other than the next one
    NOTHING_LEARNED = "nothing_learned"  # a re-plan with nothing new to plan for
    REPLAN_LIMIT = "replan_limit"
    WRONG_END = "wrong_end"  # an end that the outcome does not map to
    NOT_VERIFIED = "not_verified"  # running without a verification
    BACKOFF = "backoff"  # a new attempt waits for its backoff
    ATTEMPTS = "attempts"  # the recovery's attempts are spent
    ADMISSION = "admission"  # the job's policy and history say no recovery may start
    CIRCUIT_BREAKER = "circuit_breaker"  # recoveries cordoned their share of the fleet in the window


@dataclass(frozen=True)
class Answer:
    """A decision with its reason; ABORT names the outcome to end with, WAIT how long to wait."""

    decision: Decision
    reason: Reason
    detail: str = ""
    outcome: Outcome | None = None
    delay_s: float = 0.0
    rule: str = ""


@dataclass(frozen=True)
class CordonFacts:
    """What the circuit breaker weighs before a recovery cordons a node."""

    node_id: str
    recent: int  # nodes recoveries cordoned within the policy's window
    known_nodes: int


@dataclass(frozen=True)
class Proposal:
    """A transition the flow asks for, with what the rules need to judge it."""

    from_step: RecoveryStep
    from_attempt: int
    to_step: RecoveryStep
    to_attempt: int
    job: Job
    incident: IncidentChange
    policy: RecoveryPolicy
    now: datetime
    baseline: Baseline
    outcome: Outcome | None = None  # for an end: why
    detail: str = ""
    learned: str = ""  # for a re-plan: what the incident learned
    replans: int = 0  # re-plans already made in this attempt
    attempt_ended_at: datetime | None = None  # for a new attempt: when the last one gave up
    cordon: CordonFacts | None = None  # leaving isolating: the node it wants to cordon


Check = Callable[[Proposal], Answer | None]


@dataclass(frozen=True)
class Rule:
    """One rule: the steps it applies from and to, and its check (None: nothing to say about this proposal)."""

    name: str
    from_steps: frozenset[RecoveryStep]
    to_steps: frozenset[RecoveryStep]
    check: Check

    def applies(self, proposal: Proposal) -> bool:
        """True when the proposal's steps are this rule's business."""
        return proposal.from_step in self.from_steps and proposal.to_step in self.to_steps


def _accept(reason: Reason, detail: str = "") -> Answer:
    return Answer(Decision.ACCEPT, reason, detail)


def _reject(reason: Reason, detail: str) -> Answer:
    return Answer(Decision.REJECT, reason, detail)


def _abort(reason: Reason, outcome: Outcome, detail: str) -> Answer:
    return Answer(Decision.ABORT, reason, detail, outcome=outcome)


# --- the shape of the state machine ---------------------------------------------------------------------------
def _finished(p: Proposal) -> Answer:
    return _reject(Reason.FINISHED, f"the recovery ended ({p.from_step.value}): it does not move to {p.to_step.value}")


def _in_order(p: Proposal) -> Answer | None:
    order = (RecoveryStep.LOCKED, *ATTEMPT_STEPS)
    successor = order[order.index(p.from_step) + 1] if p.from_step in order[:-1] else None
    if p.to_step is successor and p.to_attempt == p.from_attempt:
        return _accept(Reason.IN_ORDER)
    return None


def _new_attempt(p: Proposal) -> Answer:
    if p.to_attempt == p.from_attempt + 1:
        return _accept(Reason.NEW_ATTEMPT, p.detail)
    if p.to_attempt == p.from_attempt:
        return _reject(Reason.SAME_ATTEMPT, f"{p.from_step.value} → stopping_ranks needs a new attempt")
    return _reject(Reason.SKIPPED_ATTEMPT, f"attempt {p.from_attempt} may be followed only by {p.from_attempt + 1}")


def _attempt_budget(p: Proposal) -> Answer | None:
    if p.to_attempt > p.policy.max_attempts:
        return _abort(Reason.ATTEMPTS, Outcome.ATTEMPTS_SPENT, f"{p.from_attempt} attempts: {p.detail}")
    return None


def _backoff(p: Proposal) -> Answer | None:
    if p.to_attempt <= p.from_attempt or p.attempt_ended_at is None:
        return None
    ready = p.attempt_ended_at + timedelta(seconds=p.policy.backoff_s(p.to_attempt - 1))
    if p.now < ready:
        wait = (ready - p.now).total_seconds()
        return Answer(Decision.WAIT, Reason.BACKOFF, f"attempt {p.to_attempt} in {wait:.1f} s", delay_s=wait)
    return None


def _replan(p: Proposal) -> Answer:
    if p.to_attempt != p.from_attempt:
        return _reject(Reason.SKIPPED_ATTEMPT, "a re-plan stays within its attempt")
    if not p.learned:
        return _reject(Reason.NOTHING_LEARNED, "the incident learned nothing the plan does not know")
    if p.replans >= MAX_REPLANS:
        return _reject(Reason.REPLAN_LIMIT, f"already re-planned {p.replans} times in attempt {p.from_attempt}")
    return _accept(Reason.REPLAN, p.learned)


def _ends(p: Proposal) -> Answer:
    if p.outcome is None or END_STEP.get(p.outcome, RecoveryStep.FAILED) is not p.to_step:
        return _reject(Reason.WRONG_END, f"outcome {p.outcome} does not end in {p.to_step.value}")
    if p.outcome is Outcome.RECOVERED and p.from_step is not RecoveryStep.VERIFYING:
        return _reject(Reason.NOT_VERIFIED, "a recovery is recovered only once verifying passed")
    return _accept(Reason.ENDS, p.detail)


# --- admission: may a recovery start at all? -------------------------------------------------------------------
def _human_asked(p: Proposal) -> Answer | None:
    if p.incident.recommended_action is RecommendedAction.ALERT_HUMAN:
        return _abort(Reason.ADMISSION, Outcome.HUMAN_ASKED, f"the detector asks for a human: {p.incident.root_cause}")
    return None


def _non_retryable(p: Proposal) -> Answer | None:
    code = p.incident.culprit.exit_code
    if code is not None and code in p.policy.non_retryable_exit_codes:
        detail = f"rank {p.incident.culprit.rank} exited with non-retryable code {code}"
        return _abort(Reason.ADMISSION, Outcome.NON_RETRYABLE, detail)
    return None


def _restart_budget(p: Proposal) -> Answer | None:
    used = restarts_in_window(p.job, now=p.now, window_s=p.policy.restart_window_s)
    if used >= p.policy.max_restarts:
        detail = f"restart budget spent: {used} restarts in {p.policy.restart_window_s:g} s"
        return _abort(Reason.ADMISSION, Outcome.BUDGET_SPENT, detail)
    return None


def _same_error(p: Proposal) -> Answer | None:
    streak = p.baseline.same_error_streak
    if streak > p.policy.max_same_error:
        detail = f"the same error {streak} times in a row: {p.incident.root_cause}"
        return _abort(Reason.ADMISSION, Outcome.SAME_ERROR, detail)
    return None


def _no_progress(p: Proposal) -> Answer | None:
    streak = p.baseline.no_progress_streak
    if streak >= p.policy.max_recoveries_without_progress:
        detail = f"{streak} recoveries in a row restored no newer checkpoint"
        return _abort(Reason.ADMISSION, Outcome.NO_PROGRESS, detail)
    return None


# --- isolation --------------------------------------------------------------------------------------------------
def _circuit_breaker(p: Proposal) -> Answer | None:
    if p.cordon is None:
        return None
    limit = cordon_limit(p.cordon.known_nodes, p.policy.max_cordon_share)
    if p.cordon.recent >= limit:
        detail = (
            f"circuit breaker open: recoveries already cordoned {p.cordon.recent} of {p.cordon.known_nodes} nodes in "
            f"the window (limit {limit}); a human must decide about {p.cordon.node_id}"
        )
        return _abort(Reason.CIRCUIT_BREAKER, Outcome.CIRCUIT_BREAKER, detail)
    return None


_ANY = frozenset(RecoveryStep)
_ACTIVE = _ANY - TERMINAL_STEPS - {RecoveryStep.DETECTED}
_ATTEMPT = frozenset(ATTEMPT_STEPS)
_START = frozenset({RecoveryStep.LOCKED})
_FIRST = frozenset({RecoveryStep.STOPPING_RANKS})

POLICY: tuple[Rule, ...] = (
    Rule("finished recoveries stay finished", TERMINAL_STEPS, _ANY, _finished),
    Rule("steps follow in order", _START | _ATTEMPT, _ATTEMPT, _in_order),
    Rule("a retry is a new attempt", _ATTEMPT, _FIRST, _new_attempt),
    Rule("attempt budget", _ATTEMPT, _FIRST, _attempt_budget),
    Rule("backoff between attempts", _ATTEMPT, _FIRST, _backoff),
    Rule(
        "re-plan what the incident learned",
        frozenset({RecoveryStep.ISOLATING, RecoveryStep.PLACING, RecoveryStep.RESTORING}),
        frozenset({RecoveryStep.ISOLATING}),
        _replan,
    ),
    Rule("admission: a human was asked for", _START, _FIRST, _human_asked),
    Rule("admission: non-retryable exit code", _START, _FIRST, _non_retryable),
    Rule("admission: restart budget", _START, _FIRST, _restart_budget),
    Rule("give up: the same error repeats", _START, _FIRST, _same_error),
    Rule("give up: no checkpoint progress", _START, _FIRST, _no_progress),
    Rule(
        "circuit breaker on cordons",
        frozenset({RecoveryStep.ISOLATING}),
        frozenset({RecoveryStep.PLACING}),
        _circuit_breaker,
    ),
    Rule("the outcome picks the end", _ACTIVE, TERMINAL_STEPS, _ends),
)

# The end each outcome leads to (anything not named fails the job), and the job's state at that end.
END_STEP: dict[Outcome, RecoveryStep] = {
    Outcome.RECOVERED: RecoveryStep.RUNNING,
    Outcome.CIRCUIT_BREAKER: RecoveryStep.HELD,
    Outcome.HUMAN_ASKED: RecoveryStep.HELD,
}
END_STATE: dict[RecoveryStep, JobState] = {
    RecoveryStep.RUNNING: JobState.RUNNING,
    RecoveryStep.FAILED: JobState.FAILED,
    RecoveryStep.HELD: JobState.HELD,
}


def end_step(outcome: Outcome) -> RecoveryStep:
    """The end an outcome leads to."""
    return END_STEP.get(outcome, RecoveryStep.FAILED)


def decide(proposal: Proposal, *, recovery_id: str = "") -> Answer:
    """The policy's answer: the first answer that is not ACCEPT from the rules that apply, else ACCEPT if one did."""
    accepted: Answer | None = None
    for rule in POLICY:
        if not rule.applies(proposal):
            continue
        answer = rule.check(proposal)
        if answer is None:
            continue
        answer = Answer(answer.decision, answer.reason, answer.detail, answer.outcome, answer.delay_s, rule.name)
        if answer.decision is not Decision.ACCEPT:
            if answer.decision is Decision.REJECT:
                _log_refused(proposal, answer, recovery_id)
            return answer
        accepted = accepted or answer
    if accepted is not None:
        return accepted
    refused = _reject(Reason.NO_RULE, f"no rule lets a recovery go {_move(proposal)}")
    _log_refused(proposal, refused, recovery_id)
    return refused


def _move(p: Proposal) -> str:
    return f"from {p.from_step.value} (attempt {p.from_attempt}) to {p.to_step.value} (attempt {p.to_attempt})"


def _log_refused(proposal: Proposal, answer: Answer, recovery_id: str) -> None:
    log.warning(
        "transition refused",
        extra={
            "recovery_id": recovery_id,
            "job_id": proposal.job.id,
            "move": _move(proposal),
            "rule": answer.rule,
            "reason": answer.reason.value,
            "detail": answer.detail,
        },
    )
