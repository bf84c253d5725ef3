"""The watch: node reports in (node_reports.ReportReader); node loss, hangs and stragglers out, as derived symptoms
through the same pipeline.

A tick checks the stages that turn silences and stalls into symptoms (liveness, peers' errors, early exits, hangs),
prunes the progress of ranks no longer placed, and sends what they found through the pipeline (a decision that needs
the database); the loop ticks every interval, and sooner when a suspect node's grace or a job's hang deadline ends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import replace

from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from reprise_common.bus import Bus, Outcome
from reprise_common.clock import Clock
from reprise_common.logging import get_logger
from reprise_detector.kinds.base import Producer
from reprise_detector.node_clocks import NodeClocks
from reprise_detector.node_reports import ReportReader
from reprise_detector.nodes.liveness import Liveness
from reprise_detector.nodes.models import HangPolicy
from reprise_detector.nodes.peers import PeerErrors
from reprise_detector.partition import Partition
from reprise_detector.pipeline import Detector
from reprise_detector.placements import PlacementMap
from reprise_detector.progress.book import ProgressBook
from reprise_detector.progress.hangs import HangWatch
from reprise_detector.progress.limits import HangLimits
from reprise_detector.progress.stragglers import StragglerWatch

log = get_logger("reprise.detector.watch")
# After the detector's own connection came back, nothing is judged until every node had time to report again (agents
# report every second): a rank's last step seen is from before the outage, which was no stall of its own.
REHEAR_S = 2.5
# The longest a hang check holds the event loop at once (reports wait meanwhile); what it did not get to is looked at
# after the reports waiting were handled, in the same tick.
HANG_SLICE_S = 0.01
# The shortest wait between two ticks: a deadline that a tick cannot settle (while the detector hears no node, a node
# overdue stays overdue) must not make the loop spin.
MIN_WAIT_S = 0.01
# A job's hang deadline brings a hang check forward from the interval's, but hang checks stay at least this far apart,
# and at least HANG_GAP_PER_COST times as long as the last check took: with thousands of jobs some deadline is always
# near, and a check (an override query and a pass over the jobs) must not take more than about 5 % of the time.
HANG_MIN_GAP_S = 0.05
HANG_GAP_PER_COST = 20.0


class Watcher(ReportReader):
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
        hang_check_interval_s: float,
        bus: Bus | None = None,
        peers: PeerErrors | None = None,
        clocks: NodeClocks | None = None,
        producers: Sequence[Producer] = (),
    ) -> None:
        super().__init__(
            placements=placements,
            partition=partition,
            liveness=liveness,
            book=book,
            stragglers=stragglers,
            clock=clock,
            clocks=clocks,
            producers=producers,
        )
        self.detector = detector
        self.hangs = hangs
        self.engine = engine
        self.hang_check_interval_s = hang_check_interval_s
        self.bus = bus  # the connection reports arrive on: while it is down, silence is the detector's own
        self._generation = bus.generation if bus is not None else 0
        self._disconnects = bus.disconnects if bus is not None else 0
        self._judge_from = float("-inf")  # monotonic: after a reconnect, hangs wait for the reports to come back
        self._pruned_at = -1  # the placement sequence the book was last pruned at
        self._hangs_checked_at = float("-inf")  # monotonic
        self._hang_gap_s = HANG_MIN_GAP_S  # the shortest time to the next hang check, from the last one's cost
        self._tick_lock = asyncio.Lock()
        self._woken = asyncio.Event()  # a node became suspect: its grace may end before the next tick
        self.peers = peers
        if peers is not None:
            peers.wake = self.wake  # a job's peers failed: look when its quietest node becomes overdue
        if hangs is not None:
            hangs.settle = self.settle  # a job is judged on its nodes' latest reports

    async def handle_reports(self, reports: dict[str, bytes]) -> None:
        """Batch handler for node reports (subject -> payload): liveness for every node, progress for owned jobs; what
        they show (a straggler) goes through the pipeline at once."""
        found = self.read_reports(reports)
        if found:
            self.pending.extend(found)
            await self.flush()

    # --- ticks ------------------------------------------------------------------------------------------------
    async def tick(self, *, nodes: bool = True) -> None:
        """Check for lost nodes (unless `nodes` is False: a tick for a hang deadline alone, which may come twenty times
        a second, does not pass over every node), and for hung jobs when a hang check is due (the interval passed, or a
        watched job reached its deadline); persist what was found (or keep it for the next tick).

        A hang check passes over every tracked rank (a tenth of a second with 20,000 nodes of 8 ranks, while reports
        wait), and hang limits are a minute or more: the hang's event time is when its limit was crossed, however
        late the check.
        """
        async with self._tick_lock:
            if self.placements.last_seq != self._pruned_at:  # reports add only placed ranks: only a placement prunes
                self._prune()
            if not self._hearing():
                self._hangs_checked_at, self.hangs.next_due = self.clock.monotonic(), None  # no deadline while deaf
                await self.flush()
                return
            if nodes:
                self.pending.extend(self.liveness.check())
            now = self.clock.monotonic()
            for producer in self.producers:  # peers' errors, early exits, the derived kinds' own (Detector.producers)
                self.pending.extend(producer.tick(now))
            if now >= self._hangs_due():
                self._hangs_checked_at = now
                began = time.perf_counter()
                overrides = await self.overrides() if self.book.jobs else {}
                found = self.hangs.check(overrides, budget_s=HANG_SLICE_S)
                while self.hangs.unfinished:  # a long pass is cut in slices: the reports waiting go in between
                    await asyncio.sleep(0)
                    found += self.hangs.check(overrides, budget_s=HANG_SLICE_S)
                self._hang_gap_s = max(HANG_MIN_GAP_S, HANG_GAP_PER_COST * (time.perf_counter() - began))
                self.pending.extend(found)
            await self.flush()

    def _hearing(self) -> bool:
        """False while the detector's own connection is down, and for REHEAR_S after it came back: no report could
        arrive, so no silence is a node's and no stall a rank's. Silences count from the reconnect (a NATS restart
        is no node loss)."""
        if self.bus is None:
            return True
        if not self.bus.connected:
            return False
        dropped = self.bus.disconnects != self._disconnects  # seen first when a reconnect has not bumped generation
        if dropped or self.bus.generation != self._generation:
            reconnected = dropped or self._generation > 0  # not the first connection: reports were missed meanwhile
            self._generation, self._disconnects = self.bus.generation, self.bus.disconnects
            if reconnected:
                now = self.clock.monotonic()
                self.liveness.heard_all(now)
                self._judge_from = now + REHEAR_S
        return self.clock.monotonic() >= self._judge_from

    def _prune(self) -> None:
        """Forget the jobs that ended and the ranks a relaunch moved or dropped (a shrink): they stop counting.

        Only the jobs whose placement changed since the last prune are looked at: reports add only placed ranks, so
        every other job's tracks are still placed (at 60,000 nodes a pass over every rank is 480,000 tracks).
        """
        self._pruned_at = self.placements.last_seq
        placed: dict[str, set[tuple[str, int]]] = {}  # node -> (job, rank) placed on it
        for job_id in self.placements.take_changed():
            job = self.book.jobs.get(job_id)
            if job is None:
                continue
            ended = not self.placements.is_placed(job_id)
            self.release(job, ended=ended)  # its nodes' tracks are looked up again
            if ended:
                self.book.forget(job_id)
                continue
            for rank, track in list(job.ranks.items()):
                here = placed.get(track.node_id)
                if here is None:
                    here = placed[track.node_id] = {(p.job_id, p.rank) for p in self.placements.on_node(track.node_id)}
                if (job_id, rank) not in here:
                    del job.ranks[rank]

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
                evaluating_s=row.evaluating_s or defaults.evaluating_s,
                loading_data_s=row.loading_data_s or defaults.loading_data_s,
                timeout_s=row.timeout_s or defaults.timeout_s,
            )
            for row in rows
        }

    def _hangs_due(self) -> float:
        """When the next hang check is due: the interval's, or a watched job's deadline if sooner (not too soon)."""
        interval_due = self._hangs_checked_at + self.hang_check_interval_s
        deadline = self.hangs.next_due
        if deadline is None:
            return interval_due
        return min(interval_due, max(deadline, self._hangs_checked_at + self._hang_gap_s))

    def _peers_due(self) -> float | None:
        return self.peers.next_due() if self.peers is not None else None

    def wake(self) -> None:
        """A node became suspect: tick when its grace ends rather than at the next interval."""
        self._woken.set()

    async def run(self, interval_s: float, stopping: asyncio.Event) -> None:
        """Tick every interval, and when a suspect node's grace ends, until stopped; a failing tick is logged and the
        next one tries again."""
        next_tick = self.clock.monotonic() + interval_s
        while not stopping.is_set():
            grace = self.liveness.next_due()  # the suspect nodes alone (a closed connection, undecided witnesses)
            dues = (next_tick, grace, self._peers_due(), self._hangs_due())
            until = min(d for d in dues if d is not None)
            woken = asyncio.ensure_future(self._woken.wait())
            stop = asyncio.ensure_future(stopping.wait())
            done, _ = await asyncio.wait(
                {woken, stop},
                timeout=max(MIN_WAIT_S, until - self.clock.monotonic()),
                return_when=asyncio.FIRST_COMPLETED,
            )
            woken.cancel()
            stop.cancel()
            if stopping.is_set():
                break
            if woken in done:  # a new suspicion: wait again, until the nearer of its grace and the next tick
                self._woken.clear()
                continue
            now = self.clock.monotonic()
            interval = now >= next_tick  # the interval's tick (else a grace or a deadline came first: it stays due)
            if interval:
                next_tick = now + interval_s
            try:
                await self.tick(nodes=interval or (grace is not None and now >= grace))
            except Exception:  # the watch must outlive a bad tick (a database hiccup, a bug in one stage)
                log.exception("watch tick failed")
