"""The detector pipeline: ingest -> classify -> correlate -> root cause / suppress -> dedup -> persist -> publish.

The Detector ingests (observe, classify, find the owned jobs a symptom hits, tell the stages that learn from it) and
publishes; the stages from correlate to persist are persist.Recorder's. A whole batch of symptoms is decided in one
transaction and announced after the commit, one change per incident per batch (a storm of 16,384 peers failing after
one crash is one incident and a handful of messages, not 16,384).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import nats.errors
from sqlalchemy.engine import Engine
from sqlalchemy.exc import OperationalError

from reprise_common import subjects
from reprise_common.bus import Bus, Delivery, Outcome
from reprise_common.clock import Clock
from reprise_common.consumer import ACK, Item, Verdict
from reprise_common.errors import BusError, MalformedEventError
from reprise_common.events import Event, RankExited
from reprise_common.logging import get_logger
from reprise_detector.classify import RuleBook
from reprise_detector.correlate import out_of_placement, targets
from reprise_detector.drops import Drops
from reprise_detector.early_exit import EarlyExits
from reprise_detector.incidents.flows import PendingChange, publish_changes
from reprise_detector.kinds.base import Derived, Observation, Producer
from reprise_detector.node_clocks import NodeClocks
from reprise_detector.nodes import reputation
from reprise_detector.nodes.liveness import Liveness
from reprise_detector.nodes.peers import PeerErrors
from reprise_detector.observe import IngestError, derived, observe
from reprise_detector.partition import Partition
from reprise_detector.persist import Recorder, Work
from reprise_detector.placements import PlacementMap

log = get_logger("reprise.detector.pipeline")
DEFAULT_CLOCK_SKEW_S = 1.0
DEFAULT_EARLY_EXIT_GRACE_S = 15.0
PLACEMENTS_WAIT_S = 2.0  # how long a batch waits for placements published before it (they race on two consumers)


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
        producers: Sequence[Producer] = (),
    ) -> None:
        self.engine = engine
        self.bus = bus
        self.placements = placements
        self.rules = rules
        self.clock = clock
        self.partition = partition or Partition()
        self.reputation_rules = reputation_rules or reputation.ReputationRules()
        self.recorder = Recorder(
            engine=engine, placements=placements, window_s=window_s, clock=clock, reputation_rules=self.reputation_rules
        )
        self.clock_skew_s = clock_skew_s  # how far before its arrival an agent event's time may lie
        self.clocks = NodeClocks()  # each node's clock offset, from its reports (the watch feeds it)
        self._lock = asyncio.Lock()  # the event consumer and the watch loop take turns on the database
        self.drops = Drops(clock)
        self.early_exits = EarlyExits(clock=clock, placements=placements, grace_s=early_exit_grace_s)
        self.peers = peers  # where the ranks' errors that name a failed peer go (early evidence of node loss)
        # What derives symptoms from what the pipeline takes in and the watch ticks: peers' errors, early exits, and
        # the derived kinds' own producers (kinds/).
        self.producers: list[Producer] = [*([peers] if peers is not None else []), self.early_exits, *producers]
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

    async def process_derived(self, symptoms: Sequence[Derived]) -> Outcome:
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
                for producer in self.producers:  # early exits, peers' errors, and the kinds' own
                    producer.on_symptom(w.observation, w.classification)
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
                if self.recorder.quarantines_pending:
                    await reputation.publish_pending(self.engine, self.bus, window_s=self.reputation_rules.window_s)
                    self.recorder.quarantines_pending = False
            except BusError as exc:
                log.warning("could not publish; will retry", extra={"error": str(exc)})
                return Outcome.RETRY
        return Outcome.ACK

    def _note_step_end(self, observation: Observation) -> None:
        """A rank of the job's placement that the scheduler ended with its node's step: the node is released, its
        agent's silence no loss (the scheduler's signal about the job opens the incident)."""
        event = observation.event
        if self.liveness is not None and isinstance(event, RankExited) and event.scheduler_ended:
            self.liveness.released(observation.node_id)

    def persist(self, work: list[Work]) -> list[PendingChange]:
        """Record a batch of symptoms and their incident changes in one transaction; repeats replay their changes."""
        return self.recorder.persist(work)
