"""Node reports in: every node's liveness, and the progress of the ranks of owned jobs folded into the book.

Reports arrive on core NATS in batches (the latest per node) and change only in-memory state (about 20 µs of CPU a
report in the bench, transport included). A replica parses a report only when the node runs a job it owns; every
replica still notes every node's liveness from the subject alone. A node's reports are folded into its ranks' tracks
seconds apart (FOLD_EVERY_S), and a rank's speed is judged as they are (stragglers). A malformed report is counted and
ignored (logged once a minute per node): the next one comes an interval later. The watch (watch.py) reads reports
through this, and ticks the stages that turn silences and stalls into symptoms.
"""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Sequence
from datetime import datetime
from typing import Annotated

import msgspec
from prometheus_client import Counter

from reprise_common import subjects
from reprise_common.clock import Clock
from reprise_common.errors import MalformedEventError
from reprise_common.logging import get_logger
from reprise_common.report_view import EMPTY_ARRAY, RankSeen, ReportSeen
from reprise_detector.kinds.base import Derived, Producer
from reprise_detector.node_clocks import NodeClocks
from reprise_detector.nodes.liveness import Liveness
from reprise_detector.partition import Partition
from reprise_detector.placements import PlacementMap
from reprise_detector.progress.book import JobTrack, NodeRanks, ProgressBook, RankTrack, fold
from reprise_detector.progress.stragglers import StragglerVerdict, StragglerWatch

STRAGGLER = StragglerVerdict.STRAGGLER  # bound once: an enum member looked up per rank costs about 0.2 µs

log = get_logger("reprise.detector.watch")  # the watch reads reports: their warnings keep its logger
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


class ReportReader:
    """Feeds liveness and progress from node reports; the derived symptoms a fold finds (stragglers) are returned, or
    kept in `pending` by what folds outside a batch of reports (settle, release)."""

    def __init__(
        self,
        *,
        placements: PlacementMap,
        partition: Partition,
        liveness: Liveness,
        book: ProgressBook,
        stragglers: StragglerWatch,
        clock: Clock,
        clocks: NodeClocks | None = None,
        producers: Sequence[Producer] = (),
    ) -> None:
        self.clocks = clocks or NodeClocks()  # each node's clock offset, from its reports' send times
        self.placements = placements
        self.partition = partition
        self.liveness = liveness
        self.book = book
        self.stragglers = stragglers
        self.producers = tuple(producers)  # ticked by the watch
        self._readers = tuple(p for p in producers if p.reads_reports)  # fed every report read
        self.clock = clock
        self.pending: list[Derived] = []
        self.reports_seen = 0
        self.reports_parsed = 0
        self.reports_malformed = 0
        # Set by a benchmark to a list: each batch's decision time with its reports' times is appended (nothing is kept
        # otherwise, so that measuring report time -> decision costs the hot path nothing when no one measures it).
        self.decided: list[tuple[datetime, list[datetime]]] | None = None
        self._malformed_logged: dict[str, float] = {}  # node (or subject) -> when its last bad report was logged
        self._here: dict[str, dict[str, frozenset[int]]] = {}  # node -> job -> its ranks placed there (owned jobs)
        self._here_version = -1  # the placement map's version _here was derived from
        self._tracks: dict[str, NodeRanks] = {}  # node -> the tracks its reports go to, and its latest not yet folded
        self._node_of: dict[str, str] = {}  # report subject -> its node (as many as liveness keeps nodes)

    def read_reports(self, reports: dict[str, bytes]) -> list[Derived]:
        """Note every node's liveness and the progress of owned jobs from a batch of reports (subject -> payload); the
        symptoms found.

        The hot path of ingest: what one report costs beyond its decoding is kept to lookups in what the placement
        map last said (per node, then per job) and the in-place update of its ranks' tracks.
        """
        found: list[Derived] = []
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
                node_id = self._node_from(subject)
                if node_id is None:
                    continue
            seen += 1
            here = placed_here.get(node_id)
            if here is None:
                here = placed_here[node_id] = self._placed_here(node_id)
            report_id = zlib.crc32(data[:REPORT_ID_BYTES])  # the same in every replica
            if not here and not self.partition.owns_node(node_id):
                saw(node_id, report_id, now=now)
                continue
            report = self._parse(node_id, report_id, data, now)
            if report is None:
                continue
            parsed += 1
            clocks.saw(node_id, report.time, wall, now=now)
            for producer in self._readers:
                found.extend(producer.on_report(node_id, report, now))
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
        return found

    def _node_from(self, subject: str) -> str | None:
        """The node a report subject names, remembered; None (counted as a malformed report) when it names none."""
        try:
            node_id = self._node_of[subject] = subjects.node_from_agent_subject(subject)
        except ValueError as exc:
            self._malformed(subject, str(exc))
            return None
        return node_id

    def _parse(self, node_id: str, report_id: int, data: bytes, now: float) -> WatchedReport | None:
        """A report decoded and its node's liveness and GPUs noted; None (counted as malformed) when it is unusable."""
        try:
            report = read_watched_report(data)
            self.liveness.saw(
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
            return None
        return report

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

    def _progress(self, node_id: str, ranks: msgspec.Raw, here: dict[str, frozenset[int]], now: float) -> list[Derived]:
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
        found: list[Derived] = []
        if known is not None:  # looked up under an earlier placement: its unread report is folded as it was read
            found = self._fold(node_id, known, look_up=False)
            self._tracks.pop(node_id, None)
        statuses = self._read_ranks(node_id, ranks)
        if statuses is None:
            return found
        return found + self._look_up(node_id, statuses, here, now, remember=True)

    def _fold(self, node_id: str, known: NodeRanks, *, look_up: bool = True) -> list[Derived]:
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
        found: list[Derived] = []
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
    ) -> list[Derived]:
        """Fold ranks looked up in the placement and the book; `remember`: keep their tracks for the node's next
        report when they are the whole report and all of one placed job."""
        found: list[Derived] = []
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

    def release(self, job: JobTrack, *, ended: bool) -> None:
        """Drop the tracks the job's nodes' reports go to, after its placement changed: they are looked up again at the
        nodes' next reports. A report read under the old placement is folded as it was read, unless the job ended."""
        for node_id in {track.node_id for track in job.ranks.values()}:
            known = self._tracks.get(node_id)
            if known is not None and known.job is job:
                if not ended:
                    self.pending.extend(self._fold(node_id, known, look_up=False))
                self._tracks.pop(node_id, None)
