"""The steps a recovery moves through, and the reasons it ends."""

from __future__ import annotations

from enum import StrEnum


class RecoveryStep(StrEnum):
    """The steps of a recovery, in order; a recovery ends in RUNNING or FAILED (or HELD, waiting for a human)."""

    DETECTED = "detected"
    LOCKED = "locked"
    STOPPING_RANKS = "stopping_ranks"
    ISOLATING = "isolating"
    PLACING = "placing"
    RESTORING = "restoring"
    LAUNCHING = "launching"
    VERIFYING = "verifying"
    RUNNING = "running"
    FAILED = "failed"
    HELD = "held"


TERMINAL_STEPS = frozenset({RecoveryStep.RUNNING, RecoveryStep.FAILED, RecoveryStep.HELD})
# One attempt of a recovery: these steps in this order; a new attempt starts again at stopping_ranks.
ATTEMPT_STEPS = (
    RecoveryStep.STOPPING_RANKS,
    RecoveryStep.ISOLATING,
    RecoveryStep.PLACING,
    RecoveryStep.RESTORING,
    RecoveryStep.LAUNCHING,
    RecoveryStep.VERIFYING,
)


class Outcome(StrEnum):
    """Why a recovery ended as it did."""

    RECOVERED = "recovered"
    BUDGET_SPENT = "restart_budget_spent"
    NON_RETRYABLE = "non_retryable_exit_code"
    SAME_ERROR = "same_error_repeated"
    NO_PROGRESS = "no_checkpoint_progress"
    CIRCUIT_BREAKER = "circuit_breaker_open"
    HUMAN_ASKED = "detector_asked_for_a_human"
    NO_CAPACITY = "no_capacity"
    ATTEMPTS_SPENT = "attempts_spent"
    REGISTRY_UNAVAILABLE = "registry_unavailable"
    CANCELLED = "cancelled"
    TRANSITION_REFUSED = "transition_refused"
