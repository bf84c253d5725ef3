"""rank.straggling: a rank whose step time stayed above a factor of its job's median for several reports in a row.
Produced as reports are folded (node_reports.py, progress/stragglers.py); classified by the `rank_straggling` section
(a warning); it counts for its job alone."""

from __future__ import annotations

from typing import Any, Literal

from reprise_detector.kinds.base import Derived, Scope


class RankStraggling(Derived):
    """A rank whose step time stayed above a factor of its job's median for several reports in a row."""

    section = "rank_straggling"

    type: Literal["rank.straggling"] = "rank.straggling"
    job_id: str
    rank: int
    step_time_s: float
    median_s: float
    reports: int

    def facts(self) -> dict[str, Any]:
        """How many times the job's median its step time is."""
        return {"ratio": f"{self.step_time_s / self.median_s:.1f}" if self.median_s > 0 else "?"}

    def detail(self) -> str:
        """Its step time against the job's median."""
        return f"step time {self.step_time_s:.3f} s vs job median {self.median_s:.3f} s"

    def scope(self) -> Scope:
        """Its job and rank."""
        return Scope(job_id=self.job_id, rank=self.rank)


KIND = RankStraggling
