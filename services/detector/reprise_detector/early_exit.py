"""Early clean exits: a rank that exits 0 while the rest of its job trains on leaves the job a rank short.

A job finishes when every rank of its launch exits 0, close together. One clean exit is therefore only noted; if the
job's other ranks have not all exited 0 within the grace (and the job was neither relaunched nor stopped meanwhile),
the first clean exit becomes a derived symptom, `rank.exited_early`, that opens an incident.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from reprise_common.clock import Clock
from reprise_common.events import RankExited
from reprise_detector.kinds.base import Classification, Derived, Observation, Quiet
from reprise_detector.kinds.rank_exited_early import RankExitedEarly
from reprise_detector.placements import PlacementMap


@dataclass
class _CleanExits:
    """The clean exits of one job's launch, and when the first was noted (monotonic)."""

    epoch: int
    first_noted: float
    ranks: dict[int, tuple[str, datetime]] = field(default_factory=dict)  # rank -> (node, exit time)


class EarlyExits(Quiet):
    """Producer: notes clean rank exits per job; check() names the jobs whose other ranks did not follow within the
    grace."""

    def __init__(self, *, clock: Clock, placements: PlacementMap, grace_s: float) -> None:
        self.clock = clock
        self.placements = placements
        self.grace_s = grace_s
        self._jobs: dict[str, _CleanExits] = {}
        self._reported: set[tuple[str, int]] = set()  # (job, epoch) already found short

    def note(self, *, job_id: str, rank: int, node_id: str, time: datetime) -> None:
        """A rank of a placed job exited with code 0."""
        epoch = self.placements.epoch_of(job_id)
        if epoch is None or (job_id, epoch) in self._reported:
            return
        exits = self._jobs.get(job_id)
        if exits is None or exits.epoch != epoch:
            exits = self._jobs[job_id] = _CleanExits(epoch=epoch, first_noted=self.clock.monotonic())
        exits.ranks.setdefault(rank, (node_id, time))

    def on_symptom(self, observation: Observation, classification: Classification) -> None:
        """A rank of an owned job that exited 0 is noted."""
        event = observation.event
        if isinstance(event, RankExited) and event.exit_code == 0 and observation.job_id is not None:
            self.note(job_id=observation.job_id, rank=event.rank, node_id=observation.node_id, time=observation.time)

    def tick(self, now: float) -> Sequence[Derived]:
        """The early exits whose grace has passed."""
        return self.check()

    def check(self) -> list[RankExitedEarly]:
        """The jobs whose grace has passed with some ranks not exited cleanly: one symptom each, at most once."""
        found: list[RankExitedEarly] = []
        now = self.clock.monotonic()
        for job_id, exits in list(self._jobs.items()):
            if self.placements.epoch_of(job_id) != exits.epoch:  # stopped or relaunched: nothing is missing
                del self._jobs[job_id]
                continue
            if now - exits.first_noted < self.grace_s:
                continue
            del self._jobs[job_id]
            placed = self.placements.ranks_of(job_id)
            if placed <= exits.ranks.keys():
                continue  # every rank exited 0: the job finished
            rank, (node_id, time) = min(exits.ranks.items(), key=lambda item: item[1][1])
            self._reported.add((job_id, exits.epoch))
            found.append(
                RankExitedEarly(
                    event_id=f"early-exit:{job_id}:{exits.epoch}:{rank}",
                    time=time,
                    node_id=node_id,
                    job_id=job_id,
                    rank=rank,
                    restart_epoch=exits.epoch,
                    exited=len(exits.ranks),
                    world_size=len(placed),
                    grace_s=self.grace_s,
                )
            )
        return found
