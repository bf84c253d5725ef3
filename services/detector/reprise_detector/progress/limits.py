"""The limits a rank's stall is judged against: the phases with a limit of their own, a job's fixed timeout, and the
learned limit and its floor (the defaults, and a job's own values)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

STARTUP, CHECKPOINTING = "startup", "checkpointing"
# The SDK's phase names (reprise_sdk.phase) that have limits of their own; any other phase is timed as training.
EVALUATING = frozenset({"eval", "evaluation", "evaluating", "validation"})
LOADING_DATA = frozenset({"data_loading", "loading_data", "dataloading"})


class LimitReason(StrEnum):
    """Which limit applies to a rank's stall."""

    STARTUP = "startup"  # still starting: its own, long limit
    CHECKPOINTING = "checkpointing"  # saving a checkpoint: its own limit
    EVALUATING = "evaluating"  # an evaluation pass: its own limit
    LOADING_DATA = "loading_data"  # (re)building a data loader or reading a shard: its own limit
    LEARNED = "learned"  # k x the job's rolling p99 step time
    FLOOR = "floor"  # the learned limit would be shorter than the floor (or nothing is learned yet)
    OVERRIDE = "override"  # the job's own fixed timeout
    STEPLESS = "stepless"  # no steps (no SDK): its ranks' stacks stood still in a collective (stack_hangs)


@dataclass(frozen=True)
class HangLimits:
    """Defaults, and a job's own values where it set them."""

    floor_s: float = 15.0
    k: float = 3.0
    startup_s: float = 900.0
    checkpointing_s: float = 1800.0
    evaluating_s: float = 1800.0
    loading_data_s: float = 900.0
    timeout_s: float | None = None

    @property
    def least(self) -> float:
        """The shortest limit any rank can have under these limits (a learned limit is never below the floor)."""
        own = min(self.startup_s, self.checkpointing_s, self.evaluating_s, self.loading_data_s)
        return min(own, self.floor_s, self.timeout_s if self.timeout_s is not None else math.inf)

    def of_phase(self, reason: LimitReason) -> float:
        """The limit of a phase that has its own (PHASE_LIMITS)."""
        value: float = getattr(self, PHASE_FIELDS[reason])
        return value


PHASE_FIELDS: Mapping[LimitReason, str] = {  # the HangLimits field of each phase with a limit of its own
    LimitReason.STARTUP: "startup_s",
    LimitReason.CHECKPOINTING: "checkpointing_s",
    LimitReason.EVALUATING: "evaluating_s",
    LimitReason.LOADING_DATA: "loading_data_s",
}


PHASE_LIMITS: Mapping[str, LimitReason] = {
    STARTUP: LimitReason.STARTUP,
    CHECKPOINTING: LimitReason.CHECKPOINTING,
    "restoring": LimitReason.CHECKPOINTING,  # reading a checkpoint back (examples/ddp_train.py): checkpoint I/O too
    **dict.fromkeys(EVALUATING, LimitReason.EVALUATING),
    **dict.fromkeys(LOADING_DATA, LimitReason.LOADING_DATA),
}
