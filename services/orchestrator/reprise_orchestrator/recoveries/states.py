"""The steps a recovery moves through, and the reasons it ends (the enums are the shared library's: the recovery
changes carry them to the notifier and the dashboard)."""

from __future__ import annotations

from reprise_common.events import RecoveryOutcome as Outcome
from reprise_common.events import RecoveryStep

__all__ = ["ATTEMPT_STEPS", "TERMINAL_STEPS", "Outcome", "RecoveryStep"]


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
