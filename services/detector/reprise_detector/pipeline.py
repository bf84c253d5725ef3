"""The detector pipeline: ingest -> classify -> correlate -> root cause / suppress -> dedup -> persist -> publish.

A whole batch of symptoms is decided in one transaction and announced after the commit, one change per incident per
batch (a storm of 16,384 peers failing after one crash is one incident and a handful of messages, not 16,384).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

import nats.errors
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlmodel import Session

from reprise_common import subjects
from reprise_common.bus import Bus, Delivery, Outcome
from reprise_common.clock import Clock
from reprise_common.consumer import ACK, Item, Verdict
from reprise_common.db import session_scope
from reprise_common.errors import BusError, MalformedEventError
from reprise_common.events import Culprit, Event, RankExited, RankParked, RankStacks
from reprise_common.logging import get_logger
from reprise_detector import stacks
from reprise_detector.classify import Classification, RuleBook
from reprise_detector.correlate import Decision, OutOfPlacement, Target, decide, is_warning, out_of_placement, targets
from reprise_detector.derived import DerivedSymptom
from reprise_detector.drops import Drops
from reprise_detector.early_exit import EarlyExits
from reprise_detector.incidents import service
from reprise_detector.incidents.flows import PendingChange, pending_change, publish_changes
from reprise_detector.incidents.models import Incident, IncidentChangeKind, Symptom
from reprise_detector.node_clocks import NodeClocks
from reprise_detector.nodes import reputation
from reprise_detector.nodes.liveness import Liveness
from reprise_detector.nodes.peers import PeerErrors
from reprise_detector.observe import IngestError, Observation, derived, observe
from reprise_detector.partition import Partition
from reprise_detector.placements import PlacementMap

log = get_logger("reprise.detector.pipeline")
DEFAULT_CLOCK_SKEW_S = 1.0
DEFAULT_EARLY_EXIT_GRACE_S = 15.0
PLACEMENTS_WAIT_S = 2.0  # how long a batch waits for placements published before it (they race on two consumers)


@dataclass(frozen=True)
class Work:
    """One symptom ready to persist: what was seen, what it means, and the jobs (owned by this replica) it hits."""

    observation: Observation
    classification: Classification
    targets: list[Target]
    owned: bool = True  # False: another replica owns it, or it is dropped; nothing is recorded here
    dropped: OutOfPlacement | None = None  # why it does not count for the job it names


@dataclass
class Changes:
    """The changes of one batch, coalesced per incident: opened (at its count then) and the last update."""

    incidents: dict[str, Incident] = field(default_factory=dict)
    opened: dict[str, int] = field(default_factory=dict)
    updated: dict[str, int] = field(default_factory=dict)
    active: dict[tuple[str, bool], Incident] = field(default_factory=dict)  # (job, warning) -> incident, this batch
    rows: list[dict[str, Any]] = field(default_factory=list)  # symptoms to insert at once
    counts: dict[str, int] = field(default_factory=dict)  # incident -> its symptom count, written once at the end
    decisions: Counter[str] = field(default_factory=Counter)  # how many symptoms got each decision
    faulty_nodes: set[str] = field(default_factory=set)  # nodes whose fault history grew in this batch

    def note(self, incident: Incident, kind: IncidentChangeKind, seq: int) -> None:
        """Remember a change an incident went through."""
        incident_id = incident.id  # read once: each read of a mapped attribute costs (16,384 symptoms in a storm)
        self.incidents[incident_id] = incident
        target = self.opened if kind is IncidentChangeKind.OPENED else self.updated
        target[incident_id] = max(seq, target.get(incident_id, 0))

    def join(self, incident: Incident, kind: IncidentChangeKind) -> int:
        """Count one more symptom for an incident and remember the change; its count now (the change's number)."""
        incident_id = incident.id
        count = self.counts.get(incident_id)  # not .get(id, default): the default would read the mapped attribute
        count = (incident.symptom_count if count is None else count) + 1
        self.counts[incident_id] = count
        self.note(incident, kind, count)
        return count

    def write_counts(self, now: datetime) -> None:
        """Put the symptom counts of this batch on the incidents."""
        for incident_id, count in self.counts.items():
            service.set_symptom_count(self.incidents[incident_id], count=count, now=now)

    def pending(self, now: datetime, placements: PlacementMap) -> list[PendingChange]:
        """The messages to publish, opened before updated for each incident, with the labels of its job."""
        out: list[PendingChange] = []
        for incident_id, incident in self.incidents.items():
            labels = placements.labels_of(incident.job_id)
            opened = self.opened.get(incident_id)
            if opened is not None:
                out.append(pending_change(incident, IncidentChangeKind.OPENED, seq=opened, now=now, labels=labels))
            updated = self.updated.get(incident_id)
            if updated is not None and (opened is None or updated > opened):
                out.append(pending_change(incident, IncidentChangeKind.UPDATED, seq=updated, now=now, labels=labels))
        return out


class Detector:
    """Turns symptoms into incidents; every stage is idempotent per event id."""

    def __init__(
        self,
        *,
        engine: Engine,
        bus: Bus,
        placements: PlacementMap,
        rules: RuleBook,
        window_s: float,
        clock: Clock,
        partition: Partition | None = None,
        reputation_rules: reputation.ReputationRules | None = None,
        clock_skew_s: float = DEFAULT_CLOCK_SKEW_S,
        early_exit_grace_s: float = DEFAULT_EARLY_EXIT_GRACE_S,
        peers: PeerErrors | None = None,
        liveness: Liveness | None = None,
    ) -> None:
        self.engine = engine
        self.bus = bus
        self.placements = placements
        self.rules = rules
        self.window_s = window_s
        self.clock = clock
        self.partition = partition or Partition()
        self.reputation_rules = reputation_rules or reputation.ReputationRules()
        self.clock_skew_s = clock_skew_s  # how far before its arrival an agent event's time may lie
        self.clocks = NodeClocks()  # each node's clock offset, from its reports (the watch feeds it)
        self._lock = asyncio.Lock()  # the event consumer and the watch loop take turns on the database
        self._quarantines_pending = True  # check once after a start: a recommendation may be unannounced
        self.drops = Drops(clock)
        self.early_exits = EarlyExits(clock=clock, placements=placements, grace_s=early_exit_grace_s)
        self.peers = peers  # where the ranks' errors that name a failed peer go (early evidence of node loss)
        self.liveness = liveness  # told of nodes the compute scheduler released (their ranks' exits say so)

    # --- ingest -----------------------------------------------------------------------------------------------
    async def handle(self, event: Event, delivery: Delivery) -> Outcome:
        """Single-event handler (the shared Bus.consumer contract)."""
        [verdict] = await self.handle_batch([Item(event, delivery, b"")])
        if verdict.outcome is Outcome.REJECT:
            raise MalformedEventError(verdict.reason)
        return verdict.outcome

    async def handle_batch(self, items: list[Item]) -> list[Verdict]:
        """Batch handler for agent events; every item is acknowledged only after the commit and the publish."""
        began = self.clock.monotonic()
        verdicts: list[Verdict] = [ACK] * len(items)
        work: list[Work] = []
        for index, item in enumerate(items):
            try:
                observation = (
                    observe(
                        item.event,
                        item.delivery.subject,
                        stored_ns=item.delivery.stored_ns,
                        skew_s=self.clock_skew_s,
                        clocks=self.clocks,
                    )
                    if item.event is not None
                    else None
                )
            except IngestError as exc:
                verdicts[index] = Verdict(Outcome.REJECT, f"unusable: {exc}")
                continue
            if observation is not None:
                work.append(self.prepare(observation))
        if any(w.dropped is not None for w in work):
            work = await self._again_with_placements(work)
        prepared = self.clock.monotonic()
        outcome = await self.process(work)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "agent events handled",
                extra={
                    "messages": len(items),
                    "symptoms": len(work),
                    "outcome": outcome.value,
                    "prepare_ms": round((prepared - began) * 1000, 1),  # observe, classify, find the jobs
                    "decide_ms": round((self.clock.monotonic() - prepared) * 1000, 1),  # persist, commit, publish
                },
            )
        return [v if v.outcome is Outcome.REJECT else Verdict(outcome) for v in verdicts]

    async def _again_with_placements(self, work: list[Work]) -> list[Work]:
        """Prepare the dropped symptoms again once the placements published so far are applied: a job's first events
        may be read before its placement, which another consumer brings."""
        try:
            info = await self.bus.js.stream_info(subjects.PLACEMENTS_STREAM)
        except (nats.errors.Error, BusError, TimeoutError):
            return work
        if self.placements.last_seq >= info.state.last_seq:
            return work
        await self.placements.wait_for_seq(info.state.last_seq, timeout=PLACEMENTS_WAIT_S)
        return [self.prepare(w.observation) if w.dropped is not None else w for w in work]

    def prepare(self, observation: Observation) -> Work:
        """Classify a symptom and find the jobs it hits that this replica owns (none when it is dropped)."""
        classification = self.rules.classify(observation.event)
        dropped = out_of_placement(observation, self.placements)
        if dropped is not None:
            return Work(observation, classification, [], owned=False, dropped=dropped)
        hit = targets(observation, self.placements)
        if not hit:
            return Work(observation, classification, [], owned=self.partition.owns_node(observation.node_id))
        mine = [t for t in hit if self.partition.owns_job(t.job_id)]
        return Work(observation, classification, mine, owned=bool(mine))

    async def process_derived(self, symptoms: Sequence[DerivedSymptom]) -> Outcome:
        """Persist symptoms the detector derived itself (node loss, hangs, stragglers)."""
        return await self.process([self.prepare(derived(s)) for s in symptoms])

    async def process(self, work: list[Work]) -> Outcome:
        """Persist a batch, then publish its changes; RETRY when the database or the bus is unavailable."""
        for w in work:
            job_id = w.observation.job_id
            if w.dropped is not None:
                if job_id is not None and self.partition.owns_job(job_id) and not w.classification.evidence_only:
                    self.drops.note(w.dropped, w.observation)
            elif w.owned and job_id is not None:
                self._note_clean_exit(w.observation)
                self._note_peer_error(w)
                self._note_step_end(w.observation)
        work = [w for w in work if w.owned and not w.classification.evidence_only]  # a parked rank: noted, not kept
        if not work:
            return Outcome.ACK
        async with self._lock:
            try:
                changes = await asyncio.to_thread(self.persist, work)
            except OperationalError as exc:
                log.warning("database unavailable; will retry", extra={"error": str(exc).splitlines()[0]})
                return Outcome.RETRY
            try:
                await publish_changes(self.bus, changes)
                if self._quarantines_pending:
                    await reputation.publish_pending(self.engine, self.bus, window_s=self.reputation_rules.window_s)
                    self._quarantines_pending = False
            except BusError as exc:
                log.warning("could not publish; will retry", extra={"error": str(exc)})
                return Outcome.RETRY
        return Outcome.ACK

    def _note_clean_exit(self, observation: Observation) -> None:
        event = observation.event
        if isinstance(event, RankExited) and event.exit_code == 0 and observation.job_id is not None:
            self.early_exits.note(
                job_id=observation.job_id, rank=event.rank, node_id=observation.node_id, time=observation.time
            )

    def _note_peer_error(self, work: Work) -> None:
        """A rank of the job's current launch that failed or parked because of a peer (a secondary exit, a survivor
        of a restart in place) is evidence against the job's silent nodes (nodes/peers.py); one whose exit is a cause
        of its own (a crash) explains its peers'."""
        observation, event = work.observation, work.observation.event
        if self.peers is None or not isinstance(event, RankExited | RankParked):
            return
        if isinstance(event, RankExited) and event.scheduler_ended:
            return  # its peers' step ended with it: their errors are the scheduler's doing, no node's
        job_id = observation.job_id
        if job_id is None or event.restart_epoch not in (None, self.placements.epoch_of(job_id)):
            return  # a replaced launch's rank, stopped by the recovery that replaced it
        if work.classification.root_cause_grade:
            self.peers.crashed(job_id=job_id)
            return
        text = "\n".join(event.log_tail) if isinstance(event, RankExited) else event.why
        self.peers.note(job_id=job_id, node_id=observation.node_id, rank=event.rank, text=text, time=observation.time)

    def _note_step_end(self, observation: Observation) -> None:
        """A rank of the job's placement that the scheduler ended with its node's step: the node is released, its
        agent's silence no loss (the scheduler's signal about the job opens the incident)."""
        event = observation.event
        if self.liveness is not None and isinstance(event, RankExited) and event.scheduler_ended:
            self.liveness.released(observation.node_id)

    # --- persist ----------------------------------------------------------------------------------------------
    def persist(self, work: list[Work]) -> list[PendingChange]:
        """Record a batch of symptoms and their incident changes in one transaction; repeats replay their changes."""
        try:
            return self._persist_once(work)
        except IntegrityError:
            # A symptom of this batch was committed concurrently (another delivery): the retry replays it.
            return self._persist_once(work)

    def _persist_once(self, work: list[Work]) -> list[PendingChange]:
        now = self.clock.now()
        changes = Changes()
        with session_scope(self.engine) as session:
            existing = service.get_symptoms_by_events(session, event_ids=[w.observation.event_id for w in work])
            done: set[str] = set()
            for item in work:
                event_id = item.observation.event_id
                if event_id in done:
                    continue  # the same event twice in one batch
                done.add(event_id)
                todo = self._not_yet_recorded(session, item, existing.get(event_id, []), changes)
                if todo is None:
                    continue
                self._correlate(session, todo, changes, now)
                if reputation.counts_toward_reputation(item.classification):
                    job_ids = [t.job_id for t in todo.targets]
                    reputation.record(
                        session, observation=item.observation, classification=item.classification, job_ids=job_ids
                    )
                    changes.faulty_nodes.add(item.observation.node_id)
            changes.write_counts(now)
            service.insert_symptoms(session, changes.rows)
            for node_id in sorted(changes.faulty_nodes):
                if reputation.recommend(session, node_id=node_id, rules=self.reputation_rules, now=now):
                    self._quarantines_pending = True
            log.debug("batch persisted", extra={"symptoms": len(work), **changes.decisions})
            return changes.pending(now, self.placements)

    def _not_yet_recorded(self, session: Session, item: Work, recorded: list[Symptom], changes: Changes) -> Work | None:
        """The part of the work not recorded yet (None: all of it was); what was recorded replays its changes.

        Another replica records the same event for the jobs it owns, so "recorded" is per (event, job).
        """
        if not recorded:
            return item
        mine = {t.job_id for t in item.targets}
        already = [s for s in recorded if (s.job_id in mine if item.targets else s.job_id is None)]
        if already:
            self._replay(session, already, changes)
        if not item.targets:
            return None if already else item
        done = {s.job_id for s in already}
        todo = [t for t in item.targets if t.job_id not in done]
        return replace(item, targets=todo) if todo else None

    def _correlate(self, session: Session, item: Work, changes: Changes, now: datetime) -> None:
        observation, classification = item.observation, item.classification
        if not item.targets:
            changes.rows.append(
                service.symptom_row(
                    observation=observation, classification=classification, job_id=None, incident_id=None, now=now
                )
            )
            return
        for target in item.targets:
            self._apply(session, item, target, changes, now)

    def _apply(self, session: Session, item: Work, target: Target, changes: Changes, now: datetime) -> None:
        observation, classification = item.observation, item.classification
        key = (target.job_id, is_warning(classification))
        captured = observation.event if isinstance(observation.event, RankStacks) else None
        incident = changes.active.get(key)
        if captured is not None:  # stacks are evidence for the incident their capture was ordered for, if active
            incident = service.get_active(session, incident_id=captured.incident_id, job_id=target.job_id)
        elif incident is None or abs((observation.time - incident.first_symptom_at).total_seconds()) > self.window_s:
            incident = service.get_active_for_job(
                session, job_id=target.job_id, around=observation.time, window_s=self.window_s, warning=key[1]
            )
        epoch, current = target.culprit.restart_epoch, self.placements.epoch_of(target.job_id)
        replaced = epoch is not None and current is not None and epoch < current  # about ranks already replaced
        relaunched = self.placements.relaunched_at.get(target.job_id)
        if (
            captured is None
            and not replaced
            and incident is not None
            and relaunched is not None
            and incident.first_symptom_at < relaunched <= observation.time
        ):
            incident = None  # that incident's ranks were replaced by a recovery: this is a new fault
        decision = decide(classification, observation.time, incident)
        if replaced and decision is Decision.OPEN:
            decision = Decision.RECORD  # a late word of a launch a recovery replaced: evidence, never a new fault
        if decision is Decision.OPEN:
            incident = service.create(
                session,
                job_id=target.job_id,
                classification=classification,
                culprit=target.culprit,
                first_symptom_at=observation.time,
                now=now,
            )
            service.insert_symptoms(session, changes.rows)  # the symptoms kept so far in this batch can be adopted
            orphans = service.get_recorded_for_job(
                session, job_id=target.job_id, around=observation.time, window_s=self.window_s
            )
            service.adopt(incident, orphans, now=now)
        elif decision is Decision.UPGRADE and incident is not None:
            service.upgrade(
                incident, classification=classification, culprit=target.culprit, at=observation.time, now=now
            )
        if decision in (Decision.OPEN, Decision.UPGRADE) and reputation.leads_reputation(classification):
            reputation.record(session, observation=observation, classification=classification, job_ids=[target.job_id])
            changes.faulty_nodes.add(observation.node_id)
        joined = incident if decision is not Decision.RECORD else None
        row = service.symptom_row(
            observation=observation,
            classification=classification,
            job_id=target.job_id,
            incident_id=joined.id if joined is not None else None,
            now=now,
            decision=decision.value,
        )
        changes.rows.append(row)
        changes.decisions[decision.value] += 1
        if joined is None:
            return
        changes.active[key] = joined
        kind = IncidentChangeKind.OPENED if decision is Decision.OPEN else IncidentChangeKind.UPDATED
        row["change"], row["change_seq"] = kind.value, changes.join(joined, kind)
        if captured is not None:
            self._judge_stacks(session, joined, captured, target, now)

    def _judge_stacks(
        self, session: Session, incident: Incident, captured: RankStacks, target: Target, now: datetime
    ) -> None:
        """Keep a rank's stacks with the incident and let all its stacks so far name the culprit (stacks.culprit)."""
        service.add_stacks(session, incident_id=incident.id, job_id=target.job_id, event=captured, now=now)
        verdict = stacks.culprit(service.stack_views(session, incident_id=incident.id))
        if verdict is None:
            return
        incident.stacks_verdict = verdict.line()
        if (incident.culprit_node_id, incident.culprit_rank) != (verdict.node_id, verdict.rank):
            gpu = self.placements.gpu_of(job_id=target.job_id, node_id=verdict.node_id, rank=verdict.rank)
            epoch = captured.restart_epoch if verdict.rank == captured.rank else incident.culprit_restart_epoch
            service.set_culprit(
                incident, Culprit(node_id=verdict.node_id, gpu=gpu, rank=verdict.rank, restart_epoch=epoch)
            )

    def _replay(self, session: Session, existing: list[Symptom], changes: Changes) -> None:
        for symptom in existing:
            if symptom.incident_id is None or symptom.change is None or symptom.change_seq is None:
                continue
            incident = service.get(session, incident_id=symptom.incident_id)
            changes.note(incident, IncidentChangeKind(symptom.change), symptom.change_seq)
        log.info("event already recorded; replaying its changes", extra={"symptoms": len(existing)})
