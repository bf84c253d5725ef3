"""A suspect node's jobs asked whether they go on without it.

In a data-parallel job no rank completes a step while one of its peers is gone: each step ends in a collective that
needs every rank. So the job's ranks on other nodes advancing after a node fell silent show the node's ranks alive
(its management link is cut, its data link is not), and the same ranks stopping with it show it gone, seconds before
the report limit. They can tell only what they report: a job without the SDK reports no steps, and a job evaluating or
saving advances none; such a job is blind, and the node's silence decides as before.

A witness's step is dated by its heartbeat's age (progress/book.py), not by when its report arrived. A witness that
stepped just after its last report shows it only at its next, a report interval later: the window without a step that
counts as a stop is the setting's (one and a half report intervals by default) plus two of the job's median steps.
"""

from __future__ import annotations

from collections.abc import Callable

from reprise_detector.nodes.liveness import Witness
from reprise_detector.placements import PlacementMap
from reprise_detector.progress.book import JobTrack, ProgressBook

TRAINING = "training"  # the phase in which a job's ranks are expected to advance (in others they may pause)
# What a job says, strongest first: one job advancing proves the node alive; one stopping with it, gone.
_ORDER = (Witness.ADVANCING, Witness.STALLED, Witness.WAITING, Witness.BLIND)


class Witnesses:
    """Liveness's witness call: what the jobs placed on a node, through their ranks on other nodes, say of it."""

    def __init__(
        self,
        *,
        placements: PlacementMap,
        book: ProgressBook,
        window_s: float,
        step_factor: float = 2.0,
        settle: Callable[[JobTrack], None] = lambda _job: None,
    ) -> None:
        self.placements = placements
        self.book = book
        self.window_s = window_s  # time without a witness's step that counts as a stop, beyond its job's steps
        self.step_factor = step_factor  # the job's median steps added to the window
        self.settle = settle  # folds a job's reports waiting to be read (the watch's), before it is asked

    def __call__(self, node_id: str, since: float, now: float) -> Witness:
        """What the node's jobs say of it, suspect since `since` (monotonic times)."""
        said: set[Witness] = set()
        for job_id in {placed.job_id for placed in self.placements.on_node(node_id)}:
            if not self.placements.nodes_of(job_id) - {node_id}:
                continue  # the whole job is on the node: no one elsewhere to ask
            job = self.book.jobs.get(job_id)
            said.add(Witness.BLIND if job is None else self._job(job, node_id, since, now))
        return next((verdict for verdict in _ORDER if verdict in said), Witness.NONE)

    def _job(self, job: JobTrack, node_id: str, since: float, now: float) -> Witness:
        """One job's word: its ranks elsewhere that report steps, by when they last advanced. A stop says nothing
        while one of them is in another phase than training (evaluating, saving: a pause of the job's own)."""
        self.settle(job)
        witnesses = [
            track for track in job.ranks.values() if track.node_id != node_id and track.alive and track.step is not None
        ]
        if not witnesses:
            return Witness.BLIND
        window = self.window_s + self.step_factor * (job.median_s or 0.0)
        last = max(track.advanced_at for track in witnesses)
        if last >= now - window:
            return Witness.ADVANCING if last >= since else Witness.WAITING
        if any(track.phase != TRAINING for track in witnesses):
            return Witness.BLIND
        if last >= since - window:
            return Witness.STALLED  # advancing until about when the node fell silent, and no more since
        return Witness.BLIND  # stopped well before: the node's silence does not explain it (its own limit decides)
