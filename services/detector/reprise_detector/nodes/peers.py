"""Peers' errors as early evidence of node loss.

When a node dies, the ranks of its jobs on other nodes fail in their next collective within milliseconds (gloo's
"connection reset by peer", an NCCL transport error), seconds before the node's silence reaches the limit. Such an
error alone names no node (a crash of the peer's process reads the same), and a node's silence alone is not a loss
until the limit; together they are: a node of the job's placement that has also missed its reports for longer than
PEER_SILENCE_FACTOR of its own report intervals is lost at once.

A rank of the job that failed on its own (a crash: a root-cause-grade exit) explains its peers' errors: while one is
recent, the job's peer errors are no evidence, so a node whose report is merely late on a loaded host is not excluded
for a crash elsewhere.

The intake (`PeerErrors.note`) takes a job, the node and rank that saw the error, the error's text and its time, so
that any event carrying a rank's error can feed it: a `rank.exited`'s log tail, and a `rank.parked`'s `why` (a rank
that survived its peer's failure to restart in place does not exit, so its error arrives that way).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

from reprise_common.clock import Clock
from reprise_common.events import RankExited, RankParked
from reprise_common.logging import get_logger
from reprise_detector.classify import RuleBook
from reprise_detector.kinds.base import Classification, Derived, Observation, Quiet
from reprise_detector.kinds.node_lost import NodeLost
from reprise_detector.nodes.liveness import Liveness
from reprise_detector.placements import PlacementMap

log = get_logger("reprise.detector.peers")
PEER_SILENCE_FACTOR = 1.5  # report intervals a node must have missed for its peers' errors to make it lost
LINE_CHARS = 200  # of the error line quoted in the root cause


@dataclass(frozen=True)
class PeerError:
    """One rank's error that names a failed peer: where it was seen, the line that says so, and until when (the
    detector's monotonic clock) it counts."""

    node_id: str
    rank: int
    line: str
    until: float

    def evidence(self) -> str:
        """What it says, for the lost node's root cause."""
        return f"its peers' collectives failed (rank {self.rank} on {self.node_id}: {self.line[:LINE_CHARS]})"


class PeerErrors(Quiet):
    """Stage: note() keeps the peer errors of each job for a while; check() returns a NodeLost for each node of such
    a job's placement that has been silent longer than `factor` of its report intervals meanwhile.

    A piece of evidence counts for `keep_s` after it arrived (the node-loss limit: past it, silence alone decides);
    `wake` is called on a job's first, so that the watch loop looks when the job's quietest node becomes overdue
    (next_due) rather than at its next tick.
    """

    def __init__(
        self,
        *,
        clock: Clock,
        placements: PlacementMap,
        liveness: Liveness,
        rules: RuleBook,
        keep_s: float,
        factor: float = PEER_SILENCE_FACTOR,
    ) -> None:
        self.clock = clock
        self.placements = placements
        self.liveness = liveness
        self.rules = rules
        self.keep_s = keep_s
        self.factor = factor
        self.jobs: dict[str, PeerError] = {}  # job -> its first peer error still counting
        self.crashed_until: dict[str, float] = {}  # job -> until when a rank's own failure explains its peers' errors
        self.wake: Callable[[], None] = lambda: None  # the watch loop's, once it runs

    def note(self, *, job_id: str, node_id: str, rank: int, text: str, time: datetime) -> bool:
        """Take one rank's error as evidence for its job; True when its text names a failed peer (a rule's
        `peer_failure` pattern) and it is recent enough to count."""
        line = self.rules.peer_failure(text)
        if line is None or (self.clock.now() - time).total_seconds() > self.keep_s:
            return False
        now = self.clock.monotonic()
        if self.crashed_until.get(job_id, -1.0) >= now:
            return False
        known = self.jobs.get(job_id)
        if known is None or known.until < now:
            self.jobs[job_id] = PeerError(node_id=node_id, rank=rank, line=line.strip(), until=now + self.keep_s)
            log.info("a peer failure seen", extra={"job_id": job_id, "node_id": node_id, "rank": rank})
            self.wake()
        return True

    def crashed(self, *, job_id: str) -> None:
        """A rank of the job failed on its own: for `keep_s` its peers' errors are explained by that, not evidence."""
        self.crashed_until[job_id] = self.clock.monotonic() + self.keep_s
        self.jobs.pop(job_id, None)

    def on_symptom(self, observation: Observation, classification: Classification) -> None:
        """A rank of the job's current launch that failed or parked because of a peer (a secondary exit, a survivor
        of a restart in place) is evidence against the job's silent nodes; one whose exit is a cause of its own (a
        crash) explains its peers'."""
        event = observation.event
        if not isinstance(event, RankExited | RankParked):
            return
        if isinstance(event, RankExited) and event.scheduler_ended:
            return  # its peers' step ended with it: their errors are the scheduler's doing, no node's
        job_id = observation.job_id
        if job_id is None or event.restart_epoch not in (None, self.placements.epoch_of(job_id)):
            return  # a replaced launch's rank, stopped by the recovery that replaced it
        if classification.root_cause_grade:
            self.crashed(job_id=job_id)
            return
        text = "\n".join(event.log_tail) if isinstance(event, RankExited) else event.why
        self.note(job_id=job_id, node_id=observation.node_id, rank=event.rank, text=text, time=observation.time)

    def tick(self, now: float) -> Sequence[Derived]:
        """The silent nodes that their peers' errors show lost."""
        return self.check()

    def check(self) -> list[NodeLost]:
        """The silent nodes of the jobs with peer errors that just passed the factor (each loss once)."""
        now = self.clock.monotonic()
        lost: list[NodeLost] = []
        for job_id, until in list(self.crashed_until.items()):
            if until < now:
                del self.crashed_until[job_id]
        for job_id, error in list(self.jobs.items()):
            if error.until < now or job_id in self.crashed_until:
                del self.jobs[job_id]
                continue
            for node_id in sorted(self.placements.nodes_of(job_id) - {error.node_id}):
                found = self.liveness.lost_on_evidence(node_id, factor=self.factor, evidence=error.evidence())
                if found is not None:
                    log.warning("node lost on its peers' errors", extra={"node_id": node_id, "job_id": job_id})
                    lost.append(found)
        return lost

    def next_due(self) -> float | None:
        """The monotonic time the first node of a job with peer errors becomes overdue; None when there is none."""
        due = [
            at
            for job_id, error in self.jobs.items()
            for node_id in self.placements.nodes_of(job_id) - {error.node_id}
            if (at := self.liveness.overdue_at(node_id, self.factor)) is not None
        ]
        return min(due) if due else None
