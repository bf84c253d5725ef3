"""Node reports in; node loss, hangs and stragglers out, as derived symptoms through the same pipeline.

Reports change only in-memory state (cheap, so one process keeps up with tens of thousands a second); a decision
that needs the database (a derived symptom) goes through the pipeline. A replica parses a report only when the
node runs a job it owns; every replica still notes every node's liveness from the subject alone.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import replace

from pydantic import ValidationError
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from reprise_common import subjects
from reprise_common.bus import Outcome
from reprise_common.clock import Clock
from reprise_common.consumer import ACK, Item, Verdict
from reprise_common.events import NodeReport
from reprise_common.logging import get_logger
from reprise_detector.derived import DerivedSymptom
from reprise_detector.nodes.liveness import Liveness
from reprise_detector.nodes.models import HangPolicy
from reprise_detector.partition import Partition
from reprise_detector.pipeline import Detector
from reprise_detector.placements import PlacementMap
from reprise_detector.progress import HangLimits, HangWatch, ProgressBook, StragglerVerdict, StragglerWatch

log = get_logger("reprise.detector.watch")
LAG_SAMPLES = 100_000


class Watcher:
    """Feeds liveness and progress from reports; tick() turns silences and stalls into symptoms."""

    def __init__(
        self,
        *,
        detector: Detector,
        placements: PlacementMap,
        partition: Partition,
        liveness: Liveness,
        book: ProgressBook,
        hangs: HangWatch,
        stragglers: StragglerWatch,
        engine: Engine,
        clock: Clock,
    ) -> None:
        self.detector = detector
        self.placements = placements
        self.partition = partition
        self.liveness = liveness
        self.book = book
        self.hangs = hangs
        self.stragglers = stragglers
        self.engine = engine
        self.clock = clock
        self.pending: list[DerivedSymptom] = []
        self.reports_seen = 0
        self.reports_parsed = 0
        self.lag_s: deque[float] = deque(maxlen=LAG_SAMPLES)  # report time -> decided, for the benchmark
        self._tick_lock = asyncio.Lock()

    # --- reports ----------------------------------------------------------------------------------------------
    async def handle_reports(self, items: list[Item]) -> list[Verdict]:
        """Batch handler for node reports: liveness for every node, progress for the jobs this replica owns."""
        verdicts: list[Verdict] = []
        found: list[DerivedSymptom] = []
        for item in items:
            try:
                node_id = subjects.node_from_agent_subject(item.delivery.subject)
            except ValueError as exc:
                verdicts.append(Verdict(Outcome.REJECT, f"unusable: {exc}"))
                continue
            verdicts.append(ACK)
            self.reports_seen += 1
            owned = [j for j in self.placements.jobs_on(node_id) if self.partition.owns_job(j)]
            report_id = f"s{item.delivery.stream_seq}"
            if not owned and not self.partition.owns_node(node_id):
                self.liveness.saw(node_id, report_id)
                continue
            try:
                report = NodeReport.model_validate_json(item.data)
            except ValidationError as exc:
                verdicts[-1] = Verdict(Outcome.REJECT, f"malformed: {exc.errors()[0]['msg']}")
                continue
            self.reports_parsed += 1
            self.liveness.saw(node_id, report_id, report.gpus)
            found.extend(self._progress(node_id, report, set(owned)))
            self.lag_s.append((self.clock.now() - report.time).total_seconds())
        if found:
            self.pending.extend(found)
            await self.flush()
        return verdicts

    def _progress(self, node_id: str, report: NodeReport, owned: set[str]) -> list[DerivedSymptom]:
        found: list[DerivedSymptom] = []
        placed = {(r.job_id, r.rank) for r in self.placements.on_node(node_id)}
        for status in report.ranks:
            if status.job_id not in owned or (status.job_id, status.rank) not in placed:
                continue  # a rank of an earlier placement that this node still lists: not the job's progress now
            self.book.update(node_id, status)
            if self.stragglers.judge(status.job_id, status.rank) is StragglerVerdict.STRAGGLER:
                found.append(self.stragglers.finding(status.job_id, status.rank))
        return found

    # --- ticks ------------------------------------------------------------------------------------------------
    async def tick(self) -> None:
        """Check for lost nodes and hung jobs, and persist what was found (or keep it for the next tick)."""
        async with self._tick_lock:
            for job_id in set(self.book.jobs) - self.placements.active_jobs():
                self.book.forget(job_id)
            for job_id, job in self.book.jobs.items():  # ranks a relaunch moved or dropped (a shrink) stop counting
                for rank, track in list(job.ranks.items()):
                    if not any(p.job_id == job_id and p.rank == rank for p in self.placements.on_node(track.node_id)):
                        del job.ranks[rank]
            overrides = await self.overrides() if self.book.jobs else {}
            self.pending.extend(self.liveness.check())
            self.pending.extend(self.hangs.check(overrides))
            await self.flush()

    async def flush(self) -> None:
        """Send pending derived symptoms through the pipeline; keep them when it cannot commit yet."""
        batch, self.pending = self.pending, []
        if batch and await self.detector.process_derived(batch) is not Outcome.ACK:
            self.pending = batch + self.pending

    async def overrides(self) -> dict[str, HangLimits]:
        """Each job's own hang limits (set over REST, kept in SQL so every replica and restart sees them)."""
        return await asyncio.to_thread(self._overrides)

    def _overrides(self) -> dict[str, HangLimits]:
        defaults = self.hangs.defaults
        with Session(self.engine) as session:
            rows = session.exec(select(HangPolicy)).all()
        from_placements = {
            job_id: replace(defaults, timeout_s=timeout) for job_id, timeout in self.placements.hang_timeouts.items()
        }
        return from_placements | {
            row.job_id: HangLimits(
                floor_s=row.floor_s or defaults.floor_s,
                k=row.k or defaults.k,
                startup_s=row.startup_s or defaults.startup_s,
                checkpointing_s=row.checkpointing_s or defaults.checkpointing_s,
                timeout_s=row.timeout_s or defaults.timeout_s,
            )
            for row in rows
        }

    async def run(self, interval_s: float, stopping: asyncio.Event) -> None:
        """Tick every interval until stopped; a failing tick is logged and the next one tries again."""
        while not stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), timeout=interval_s)
            if stopping.is_set():
                break
            try:
                await self.tick()
            except Exception:  # the watch must outlive a bad tick (a database hiccup, a bug in one stage)
                log.exception("watch tick failed")
