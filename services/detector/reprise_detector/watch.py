"""Node reports in; node loss, hangs and stragglers out, as derived symptoms through the same pipeline.

Reports arrive on core NATS in batches (the latest per node) and change only in-memory state (about 20 µs of CPU a
report in the bench, transport included); a decision that needs the database (a derived symptom) goes through the
pipeline. A replica parses a report only when the node runs a job it owns; every replica still notes every node's
liveness from the subject alone. A malformed report is counted and ignored (logged once a minute per node): the next
one comes an interval later.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
import zlib
from dataclasses import replace
from datetime import datetime
from typing import Annotated

import msgspec
from prometheus_client import Counter
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from reprise_common import subjects
from reprise_common.bus import Bus, Outcome
from reprise_common.clock import Clock
from reprise_common.errors import MalformedEventError
from reprise_common.logging import get_logger
from reprise_common.report_view import EMPTY_ARRAY, RankSeen, ReportSeen
from reprise_detector.derived import DerivedSymptom
from reprise_detector.node_clocks import NodeClocks
from reprise_detector.nodes.liveness import Liveness
from reprise_detector.nodes.models import HangPolicy
from reprise_detector.nodes.peers import PeerErrors
from reprise_detector.partition import Partition
from reprise_detector.pipeline import Detector
from reprise_detector.placements import PlacementMap
from reprise_detector.progress import (
    HangLimits,
    HangWatch,
    JobTrack,
    NodeRanks,
    ProgressBook,
    RankTrack,
    StragglerVerdict,
    StragglerWatch,
    fold,
)

STRAGGLER = StragglerVerdict.STRAGGLER  # bound once: an enum member looked up per rank costs about 0.2 µs

log = get_logger("reprise.detector.watch")
# A report's id is the CRC of its first bytes: an agent's report begins with its event id and time (the envelope is
# serialised first), so consecutive reports differ there, and the whole ~2 KB report would cost 1 µs to checksum.
REPORT_ID_BYTES = 256
MALFORMED_LOG_EVERY_S = 60.0
# A node's reports are folded into its ranks' tracks at most this long apart (its latest report then; those between
# are passed over; the first fold after its tracks were looked up comes sooner, at a random moment), and whenever a
# close look at their job is due (HangWatch.settle): a hang is judged on every node's latest report. Folding every
# report (decoding its ranks and updating each one's track) cost about half of the detector's processor time in the
# ingest bench. What waits: a new phase or a stopped process is seen up to this much later (times are still read from
# the report's arrival and the ages it carries), and a slow streak is counted in the reports between two looks
# (StragglerWatch.judge). At 4 s the folds were still a fifth of the detector's processor time in the ingest bench.
FOLD_EVERY_S = 8.0
# A node with a rank in a slow streak is folded again this soon, so that a straggler is not reported later than with
# folds 4 s apart plus the wait for the first slow look: 4-12 s after its first slow report (its streak counts the
# reports since the last look, and reaches REPRISE_STRAGGLER_REPORTS, 5, at the look after the first slow one).
FOLD_SLOW_S = 4.0
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
MALFORMED_REPORTS = Counter(
    "reprise_detector_reports_malformed_total", "Node reports ignored because their subject or payload is unusable"
)


class WatchedReport(ReportSeen, frozen=True, gc=False):
    """A node report as the watch reads it: the shared view with its ranks and GPUs still undecoded (ranks are decoded
    when they are folded, FOLD_EVERY_S, GPUs when they differ from the node's last: Liveness.saw; so most reports cost
    the decoding of the rest alone), and how often the node reports (NodeReport.interval_s), which its peers' errors are
    weighed against (nodes/peers.py)."""

    gpus: msgspec.Raw = msgspec.field(default_factory=lambda: EMPTY_ARRAY)  # type: ignore[assignment]  # undecoded here
    ranks: msgspec.Raw = msgspec.field(default_factory=lambda: EMPTY_ARRAY)  # type: ignore[assignment]  # undecoded here
    interval_s: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    connection: Annotated[str, msgspec.Meta(max_length=192)] = ""


_REPORT_DECODER = msgspec.json.Decoder(WatchedReport)
_RANKS_DECODER = msgspec.json.Decoder(tuple[RankSeen, ...])


def read_watched_report(data: bytes) -> WatchedReport:
    """Decode a node report's payload, its ranks left undecoded; MalformedEventError (naming the field) when it is not
    one."""
    try:
        return _REPORT_DECODER.decode(data)
    except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
        raise MalformedEventError(str(exc)) from exc


def read_ranks(raw: msgspec.Raw) -> tuple[RankSeen, ...]:
    """Decode a report's ranks (WatchedReport.ranks); MalformedEventError (naming the field) when they are not."""
    try:
        return _RANKS_DECODER.decode(raw)
    except msgspec.DecodeError as exc:
        raise MalformedEventError(f"{exc} (in `ranks`)") from exc


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
        hang_check_interval_s: float,
        bus: Bus | None = None,
        peers: PeerErrors | None = None,
        clocks: NodeClocks | None = None,
    ) -> None:
        self.detector = detector
        self.clocks = clocks or NodeClocks()  # each node's clock offset, from its reports' send times
        self.placements = placements
        self.partition = partition
        self.liveness = liveness
        self.book = book
        self.hangs = hangs
        self.stragglers = stragglers
        self.engine = engine
        self.clock = clock
        self.hang_check_interval_s = hang_check_interval_s
        self.bus = bus  # the connection reports arrive on: while it is down, silence is the detector's own
        self._generation = bus.generation if bus is not None else 0
        self._disconnects = bus.disconnects if bus is not None else 0
        self._judge_from = float("-inf")  # monotonic: after a reconnect, hangs wait for the reports to come back
        self.pending: list[DerivedSymptom] = []
        self.reports_seen = 0
        self.reports_parsed = 0
        self.reports_malformed = 0
        # Set by a benchmark to a list: each batch's decision time with its reports' times is appended (nothing is kept
        # otherwise, so that measuring report time -> decision costs the hot path nothing when no one measures it).
        self.decided: list[tuple[datetime, list[datetime]]] | None = None
        self._malformed_logged: dict[str, float] = {}  # node (or subject) -> when its last bad report was logged
        self._pruned_at = -1  # the placement sequence the book was last pruned at
        self._hangs_checked_at = float("-inf")  # monotonic
        self._hang_gap_s = HANG_MIN_GAP_S  # the shortest time to the next hang check, from the last one's cost
        self._tick_lock = asyncio.Lock()
        self._here: dict[str, dict[str, frozenset[int]]] = {}  # node -> job -> its ranks placed there (owned jobs)
        self._here_version = -1  # the placement map's version _here was derived from
        self._tracks: dict[str, NodeRanks] = {}  # node -> the tracks its reports go to, and its latest not yet folded
        self._node_of: dict[str, str] = {}  # report subject -> its node (as many as liveness keeps nodes)
        self._woken = asyncio.Event()  # a node became suspect: its grace may end before the next tick
        self.peers = peers
        if peers is not None:
            peers.wake = self.wake  # a job's peers failed: look when its quietest node becomes overdue
        if hangs is not None:
            hangs.settle = self.settle  # a job is judged on its nodes' latest reports

    # --- reports ----------------------------------------------------------------------------------------------
    async def handle_reports(self, reports: dict[str, bytes]) -> None:
        """Batch handler for node reports (subject -> payload): liveness for every node, progress for owned jobs.

        The hot path of ingest: what one report costs beyond its decoding is kept to lookups in what the placement
        map last said (per node, then per job) and the in-place update of its ranks' tracks.
        """
        found: list[DerivedSymptom] = []
        if self.placements.version != self._here_version:  # each node's tracks are looked up again at its next report
            self._here, self._here_version = {}, self.placements.version
        record = self.decided  # a benchmark's: the reports' times are collected only for it
        sent: list[datetime] = []
        now, wall = self.clock.monotonic(), self.clock.now()
        node_of, placed_here, saw = self._node_of, self._here, self.liveness.saw  # looked up once a batch
        clocks = self.clocks
        seen = parsed = 0
        for subject, data in reports.items():
            node_id = node_of.get(subject)
            if node_id is None:
                try:
                    node_id = node_of[subject] = subjects.node_from_agent_subject(subject)
                except ValueError as exc:
                    self._malformed(subject, str(exc))
                    continue
            seen += 1
            here = placed_here.get(node_id)
            if here is None:
                here = placed_here[node_id] = self._placed_here(node_id)
            report_id = zlib.crc32(data[:REPORT_ID_BYTES])  # the same in every replica
            if not here and not self.partition.owns_node(node_id):
                saw(node_id, report_id, now=now)
                continue
            try:
                report = read_watched_report(data)
                saw(
                    node_id,
                    report_id,
                    report.gpus,
                    stopping=report.stopping,
                    interval_s=report.interval_s,
                    connection=report.connection,
                    now=now,
                )
            except MalformedEventError as exc:  # the report, or its GPUs (saw() records nothing then)
                self._malformed(node_id, str(exc))
                continue
            parsed += 1
            clocks.saw(node_id, report.time, wall, now=now)
            if here:
                found.extend(self._progress(node_id, report.ranks, here, now))
            elif report.ranks != EMPTY_ARRAY:  # no job of this replica's runs there: its ranks are only checked
                self._read_ranks(node_id, report.ranks)
            if record is not None:
                sent.append(report.time)
        self.reports_seen += seen
        self.reports_parsed += parsed
        if record is not None:
            record.append((self.clock.now(), sent))
        if found:
            self.pending.extend(found)
            await self.flush()

    def _placed_here(self, node_id: str) -> dict[str, frozenset[int]]:
        """The ranks placed on a node whose jobs this replica owns, by job (empty: none)."""
        owns = self.partition.owns_job
        ranks: dict[str, set[int]] = {}
        for placed in self.placements.on_node(node_id):
            if owns(placed.job_id):
                ranks.setdefault(placed.job_id, set()).add(placed.rank)
        return {job_id: frozenset(of_job) for job_id, of_job in ranks.items()}

    def _malformed(self, node: str, reason: str) -> None:
        """Count a report that cannot be used; log it at most once a minute per node."""
        self.reports_malformed += 1
        MALFORMED_REPORTS.inc()
        now = self.clock.monotonic()
        last = self._malformed_logged.get(node)
        if last is None or now - last >= MALFORMED_LOG_EVERY_S:
            self._malformed_logged[node] = now
            log.warning("ignoring malformed node reports", extra={"node_id": node, "reason": reason[:200]})

    def _progress(
        self, node_id: str, ranks: msgspec.Raw, here: dict[str, frozenset[int]], now: float
    ) -> list[DerivedSymptom]:
        """Keep a report's ranks for the node's next fold (FOLD_EVERY_S), or fold them now: into the tracks its
        earlier reports went to (NodeRanks) while it lists the same ranks, else looked up (and remembered)."""
        known = self._tracks.get(node_id)
        if known is not None and known.version == self._here_version:
            if not known.unread_reports:
                known.job.waiting.add(node_id)  # a close look at the job folds it first (settle)
            known.unread, known.unread_at = ranks, now
            known.unread_reports += 1
            if now < known.fold_at:
                return []
            return self._fold(node_id, known)
        found: list[DerivedSymptom] = []
        if known is not None:  # looked up under an earlier placement: its unread report is folded as it was read
            found = self._fold(node_id, known, look_up=False)
            self._tracks.pop(node_id, None)
        statuses = self._read_ranks(node_id, ranks)
        if statuses is None:
            return found
        return found + self._look_up(node_id, statuses, here, now, remember=True)

    def _fold(self, node_id: str, known: NodeRanks, *, look_up: bool = True) -> list[DerivedSymptom]:
        """Fold the node's unread report into its tracks and judge each rank's speed. Ranks it lists beyond them (its
        ranks changed) are looked up, unless `look_up` is False: then the node's tracks are dropped and its next
        report looks them up."""
        raw, at, reports = known.unread, known.unread_at, known.unread_reports
        known.unread, known.unread_reports = None, 0
        if raw is None:
            return []
        known.fold_at = at + FOLD_EVERY_S
        statuses = self._read_ranks(node_id, raw)
        if statuses is None:
            return []
        found: list[DerivedSymptom] = []
        folded = 0
        if len(known.tracks) == len(statuses):
            job = known.job
            # Judged only when its step time is above the job's limit or it was slow: otherwise judge() changes nothing
            # (the limit is the job's as this fold began; one refreshed meanwhile applies from the next fold).
            limit = self.stragglers.slow_above(job)
            folded, to_judge = fold(job, known.tracks, statuses, at, math.inf if limit is None else limit)
            for track in to_judge:
                if self.stragglers.judge(job, track, reports) is STRAGGLER:
                    found.append(self.stragglers.finding(track.job_id, track.rank))
                if track.slow_streak:
                    known.fold_at = at + FOLD_SLOW_S
            if folded == len(statuses):
                return found
        if self._tracks.get(node_id) is known:
            del self._tracks[node_id]  # it lists other ranks now: the rest are looked up
        if not look_up:
            return found
        here = self._here.get(node_id)
        if here is None:
            here = self._here[node_id] = self._placed_here(node_id)
        return found + self._look_up(node_id, statuses[folded:], here, at, remember=not folded)

    def _read_ranks(self, node_id: str, ranks: msgspec.Raw) -> tuple[RankSeen, ...] | None:
        """A report's ranks decoded; None (counted and logged as a malformed report) when they cannot be."""
        try:
            return read_ranks(ranks)
        except MalformedEventError as exc:
            self._malformed(node_id, str(exc))
            return None

    def settle(self, job: JobTrack) -> None:
        """Fold the reports the job's nodes sent since their last fold, before the job is judged (HangWatch.settle,
        and a suspect node's witnesses).

        Nothing is looked up here (the hang check passes over the book's jobs, which a lookup may add to): a node that
        lists other ranks now has them looked up at its next report, a second later.
        """
        waiting, job.waiting = job.waiting, set()
        for node_id in waiting:
            known = self._tracks.get(node_id)
            if known is not None and known.job is job:
                self.pending.extend(self._fold(node_id, known, look_up=False))

    def _look_up(
        self, node_id: str, ranks: tuple[RankSeen, ...], here: dict[str, frozenset[int]], now: float, *, remember: bool
    ) -> list[DerivedSymptom]:
        """Fold ranks looked up in the placement and the book; `remember`: keep their tracks for the node's next
        report when they are the whole report and all of one placed job."""
        found: list[DerivedSymptom] = []
        update, judge = self.book.update, self.stragglers.judge
        jobs: set[int] = set()
        tracks: list[RankTrack] = []
        job: JobTrack | None = None
        for status in ranks:
            placed = here.get(status.job_id)
            if placed is None or status.rank not in placed:
                remember = False  # another replica's job, or a rank of an earlier placement that this node still lists
                continue
            job, track = update(node_id, status, now)
            jobs.add(id(job))
            tracks.append(track)
            if judge(job, track) is STRAGGLER:
                found.append(self.stragglers.finding(status.job_id, status.rank))
        if remember and job is not None and len(jobs) == 1:
            # Nodes looked up together (a fresh detector, a placement) would fold together, one second in four:
            # their first fold comes at a random moment within FOLD_EVERY_S, and the next ones FOLD_EVERY_S apart.
            fold_at = now + FOLD_EVERY_S * random.random()  # noqa: S311 - spreading work, not a secret
            self._tracks[node_id] = NodeRanks(job, tuple(tracks), version=self._here_version, fold_at=fold_at)
        return found

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
            if self.peers is not None:
                self.pending.extend(self.peers.check())
            self.pending.extend(self.detector.early_exits.check())
            now = self.clock.monotonic()
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
            for node_id in {track.node_id for track in job.ranks.values()}:  # their tracks are looked up again
                known = self._tracks.get(node_id)
                if known is not None and known.job is job:
                    if not ended:  # a report read under the old placement is folded as it was read
                        self.pending.extend(self._fold(node_id, known, look_up=False))
                    self._tracks.pop(node_id, None)
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
