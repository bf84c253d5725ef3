"""job.hung: a job's step progress stopped for longer than its limit. Produced by the watch's hang check
(progress/hangs.py); classified by the `job_hung` section; it counts for its job alone, blaming one rank."""

from __future__ import annotations

from typing import Any, Literal

from reprise_detector.kinds.base import Derived, Scope


class JobHung(Derived):
    """A job's step progress stopped for longer than its limit; node_id and rank name the rank to blame."""

    section = "job_hung"

    type: Literal["job.hung"] = "job.hung"
    job_id: str
    rank: int
    stalled_ranks: list[int]
    lagging_ranks: list[int]
    culprit_reason: str = "stopped first"
    step: int | None
    phase: str
    stalled_s: float
    limit_s: float
    limit_reason: str

    def facts(self) -> dict[str, Any]:
        """Its stall and limit in tenths of a second."""
        return {"stalled_s": f"{self.stalled_s:.1f}", "limit_s": f"{self.limit_s:.1f}"}

    def detail(self) -> str:
        """The stall, its limit, the ranks stopped together and lagging, and the rank blamed."""
        return (
            f"no step progress for {self.stalled_s:.1f} s "
            f"(limit {self.limit_s:.1f} s, {self.limit_reason}); "
            f"stopped together: ranks {self.stalled_ranks}; lagging: ranks {self.lagging_ranks}; "
            f"blamed: rank {self.rank} ({self.culprit_reason})"
        )

    def scope(self) -> Scope:
        """Its job and the rank blamed."""
        return Scope(job_id=self.job_id, rank=self.rank)


KIND = JobHung
