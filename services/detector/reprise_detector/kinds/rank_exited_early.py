"""rank.exited_early: a rank exited 0 and the rest of its job's launch did not all follow within the grace. Produced by
the watch's early-exit stage (early_exit.py, fed the clean exits by the pipeline); classified by the
`rank_exited_early` section; it counts for its job alone, its culprit carrying the launch."""

from __future__ import annotations

from typing import Any, Literal

from reprise_detector.kinds.base import Blame, Derived, Scope


class RankExitedEarly(Derived):
    """A rank exited 0 and the rest of its job's launch did not all follow within the grace: the job is a rank short."""

    section = "rank_exited_early"

    type: Literal["rank.exited_early"] = "rank.exited_early"
    job_id: str
    rank: int
    restart_epoch: int
    exited: int  # ranks of the launch that exited 0 within the grace
    world_size: int  # ranks placed
    grace_s: float

    def facts(self) -> dict[str, Any]:
        """The grace as written in the settings."""
        return {"grace_s": f"{self.grace_s:g}"}

    def detail(self) -> str:
        """Its launch and how many of the launch's ranks exited 0 within the grace."""
        return (
            f"exited 0 in epoch {self.restart_epoch}; {self.exited} of {self.world_size} ranks "
            f"exited 0 within {self.grace_s:g} s"
        )

    def scope(self) -> Scope:
        """Its job and rank."""
        return Scope(job_id=self.job_id, rank=self.rank)

    def blame(self) -> Blame:
        """The launch it left early."""
        return Blame(restart_epoch=self.restart_epoch)


KIND = RankExitedEarly
