"""The pipeline's persist stage: a batch of symptoms (Work) recorded with their incident changes in one transaction.

Each symptom is correlated with its job's incident (root cause, suppression, dedup per event and job), and the
batch's changes are coalesced per incident (Changes), to be announced after the commit.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session

from reprise_common.clock import Clock
from reprise_common.db import session_scope
from reprise_common.events import Culprit, IncidentChangeKind, RankStacks
from reprise_common.logging import get_logger
from reprise_detector import stacks
from reprise_detector.classify import Classification
from reprise_detector.correlate import Decision, OutOfPlacement, Target, decide, is_warning
from reprise_detector.incidents import service
from reprise_detector.incidents.flows import PendingChange, pending_change
from reprise_detector.incidents.models import Incident, Symptom
from reprise_detector.kinds.base import Observation
from reprise_detector.nodes import reputation
from reprise_detector.placements import PlacementMap

log = get_logger("reprise.detector.pipeline")


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


class Recorder:
    """Records batches of symptoms and their incident changes; every symptom is recorded once per event and job."""

    def __init__(
        self,
        *,
        engine: Engine,
        placements: PlacementMap,
        window_s: float,
        clock: Clock,
        reputation_rules: reputation.ReputationRules,
    ) -> None:
        self.engine = engine
        self.placements = placements
        self.window_s = window_s
        self.clock = clock
        self.reputation_rules = reputation_rules
        self.quarantines_pending = True  # check once after a start: a recommendation may be unannounced

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
                    self.quarantines_pending = True
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
        """Record a symptom for one job it hits: open its incident, upgrade it, join it, or keep it as evidence."""
        observation, classification = item.observation, item.classification
        key = (target.job_id, is_warning(classification))
        captured = observation.event if isinstance(observation.event, RankStacks) else None
        incident = self._incident_for(session, item, target, changes.active.get(key), captured=captured, warning=key[1])
        epoch, current = target.culprit.restart_epoch, self.placements.epoch_of(target.job_id)
        replaced = epoch is not None and current is not None and epoch < current  # about ranks already replaced
        if captured is None and not replaced and self._relaunched_since(incident, item, target):
            incident = None  # that incident's ranks were replaced by a recovery: this is a new fault
        decision = decide(classification, observation.time, incident)
        if replaced and decision is Decision.OPEN:
            decision = Decision.RECORD  # a late word of a launch a recovery replaced: evidence, never a new fault
        incident = self._enact(session, item, target, decision=decision, incident=incident, changes=changes, now=now)
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

    def _incident_for(
        self,
        session: Session,
        item: Work,
        target: Target,
        active: Incident | None,
        *,
        captured: RankStacks | None,
        warning: bool,
    ) -> Incident | None:
        """The incident a symptom may join: the one its stacks' capture was ordered for, else the job's active one of
        its kind (this batch's while the symptom is within its window)."""
        observation = item.observation
        if captured is not None:  # stacks are evidence for the incident their capture was ordered for, if active
            return service.get_active(session, incident_id=captured.incident_id, job_id=target.job_id)
        if active is None or abs((observation.time - active.first_symptom_at).total_seconds()) > self.window_s:
            return service.get_active_for_job(
                session, job_id=target.job_id, around=observation.time, window_s=self.window_s, warning=warning
            )
        return active

    def _relaunched_since(self, incident: Incident | None, item: Work, target: Target) -> bool:
        """Whether a recovery relaunched the job after the incident's first symptom, and before this one."""
        relaunched = self.placements.relaunched_at.get(target.job_id)
        return (
            incident is not None
            and relaunched is not None
            and incident.first_symptom_at < relaunched <= item.observation.time
        )

    def _enact(
        self,
        session: Session,
        item: Work,
        target: Target,
        *,
        decision: Decision,
        incident: Incident | None,
        changes: Changes,
        now: datetime,
    ) -> Incident | None:
        """Open or upgrade the incident as decided (a node's fault it leads counts toward its reputation); the incident
        the symptom is about."""
        observation, classification = item.observation, item.classification
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
        return incident

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
