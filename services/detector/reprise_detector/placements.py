"""Where each job's ranks run, kept in memory from the PLACEMENTS stream (the last placement per job)."""

from __future__ import annotations

import asyncio
from datetime import datetime

import msgspec

from reprise_common.bus import Delivery, Outcome
from reprise_common.errors import MalformedEventError
from reprise_common.events import Event, JobPlacement
from reprise_common.logging import get_logger

log = get_logger("reprise.detector.placements")


class PlacedRank(msgspec.Struct, frozen=True, gc=False):
    """One rank of one job on a node (not scanned by the garbage collector: a large fleet has hundreds of thousands)."""

    job_id: str
    rank: int
    gpu: int | None


class PlacementMap:
    """node_id -> the ranks placed on it; a newer epoch replaces a job's placement, an inactive one removes it."""

    def __init__(self) -> None:
        self._by_node: dict[str, list[PlacedRank]] = {}
        self._epochs: dict[str, int] = {}
        self.hang_timeouts: dict[str, float] = {}  # job -> the fixed hang limit its placement carries
        self.relaunched_at: dict[str, datetime] = {}  # job -> when its current epoch was placed (after a recovery)
        # job -> its labels; kept after the job stops (a late resolve still routes by them), as the stream keeps
        # the last placement of every job and a restart would load them all again anyway
        self.labels: dict[str, dict[str, str]] = {}
        self.last_seq = 0
        self.version = 0  # changes whenever a node's ranks change: what callers derived from the map is stale
        self._nodes_of: dict[str, set[str]] = {}  # job -> the nodes it has ranks on
        self._changed: set[str] = set()  # jobs whose placement changed since take_changed() (the watch prunes them)
        self._advanced = asyncio.Event()

    def apply(self, placement: JobPlacement) -> bool:
        """Apply a placement; False when it is older than the one already known for the job."""
        job_id = placement.job_id
        if placement.restart_epoch < self._epochs.get(job_id, -1):
            return False
        if placement.restart_epoch > self._epochs.get(job_id, 0):
            self.relaunched_at[job_id] = placement.time
        self._epochs[job_id] = placement.restart_epoch
        self.labels[job_id] = dict(placement.labels)
        if placement.active and placement.hang_timeout_s is not None:
            self.hang_timeouts[job_id] = placement.hang_timeout_s
        else:
            self.hang_timeouts.pop(job_id, None)
        self.version += 1
        self._changed.add(job_id)
        for node_id in self._nodes_of.pop(job_id, ()):
            kept = [placed for placed in self._by_node[node_id] if placed.job_id != job_id]
            if kept:
                self._by_node[node_id] = kept
            else:
                del self._by_node[node_id]
        if placement.active:
            nodes = self._nodes_of[job_id] = set()
            for assignment in placement.ranks:
                placed = PlacedRank(job_id=job_id, rank=assignment.rank, gpu=assignment.gpu)
                self._by_node.setdefault(assignment.node_id, []).append(placed)
                nodes.add(assignment.node_id)
        return True

    def take_changed(self) -> set[str]:
        """The jobs whose placement changed (placed, relaunched, shrunk, ended) since the last call."""
        changed, self._changed = self._changed, set()
        return changed

    def labels_of(self, job_id: str) -> dict[str, str]:
        """The job's labels from its latest placement; none for a job never placed."""
        return dict(self.labels.get(job_id, {}))

    def on_node(self, node_id: str) -> list[PlacedRank]:
        """The ranks placed on a node, every job."""
        return list(self._by_node.get(node_id, ()))

    def epoch_of(self, job_id: str) -> int | None:
        """The restart epoch of the job's active placement; None when the job is not placed (or no longer runs)."""
        return self._epochs.get(job_id) if self.is_placed(job_id) else None

    def ranks_of(self, job_id: str) -> set[int]:
        """The ranks the job's active placement has."""
        return {
            p.rank for node_id in self._nodes_of.get(job_id, ()) for p in self._by_node[node_id] if p.job_id == job_id
        }

    def nodes_of(self, job_id: str) -> set[str]:
        """The nodes the job's active placement has ranks on."""
        return set(self._nodes_of.get(job_id, ()))

    def is_placed(self, job_id: str) -> bool:
        """True when the job has an active placement with at least one rank."""
        return bool(self._nodes_of.get(job_id))

    def has_rank(self, *, job_id: str, node_id: str, rank: int) -> bool:
        """True when the job's current placement puts this rank on this node."""
        return any(p.job_id == job_id and p.rank == rank for p in self._by_node.get(node_id, ()))

    def jobs_on(self, node_id: str) -> list[str]:
        """The distinct jobs with a rank on a node, in placement order."""
        return list(dict.fromkeys(placed.job_id for placed in self._by_node.get(node_id, ())))

    def rank_on_gpu(self, *, job_id: str, node_id: str, gpu: int | None) -> int | None:
        """The job's rank that runs on this GPU of this node, if the placement says so."""
        if gpu is None:
            return None
        ranks = [p.rank for p in self._by_node.get(node_id, ()) if p.job_id == job_id and p.gpu == gpu]
        return ranks[0] if len(ranks) == 1 else None

    def gpu_of(self, *, job_id: str, node_id: str, rank: int) -> int | None:
        """The GPU a rank of a job runs on, if the placement says so."""
        return next((p.gpu for p in self._by_node.get(node_id, ()) if p.job_id == job_id and p.rank == rank), None)

    async def handle(self, event: Event, delivery: Delivery) -> Outcome:
        """Consumer handler for the PLACEMENTS stream."""
        if not isinstance(event, JobPlacement):
            raise MalformedEventError(f"a {event.model_dump().get('type')} event on the placements stream")
        if not self.apply(event):
            log.info("ignored a stale placement", extra={"job_id": event.job_id, "epoch": event.restart_epoch})
        self.last_seq = max(self.last_seq, delivery.stream_seq)
        self._advanced.set()
        return Outcome.ACK

    async def wait_for_seq(self, seq: int, *, timeout: float) -> bool:
        """Wait until the placement at stream sequence seq (or a later one) has been applied."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.last_seq < seq:
            self._advanced.clear()
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._advanced.wait(), timeout=remaining)
            except TimeoutError:
                return self.last_seq >= seq
        return True
