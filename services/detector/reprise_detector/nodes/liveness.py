"""Node liveness: when each node last reported (the detector's clock), and which nodes went silent or dropped their
connection.

A node is judged by all it shows, not by one connection (docs/detector.md, "Node loss"). It becomes *suspect* when the
connection its agent reports on closes from the client's side (a killed agent or host: the server knows at once), or
when it misses 1.5 of its report intervals. A suspect is then asked of its jobs' other ranks (nodes/witnesses.py): a
node none of whose jobs spans other nodes is lost after a short grace (a reconnect within it is no loss); a node whose
jobs' other ranks stopped advancing with it is lost at once; a node whose jobs' other ranks go on advancing is alive
(its management link is cut, its data link is not: in a data-parallel job no step completes without it) and, past the
report limit, *unreachable*, said once, never recovered while they advance (up to a bound). Otherwise its reports
stopping for longer than the limit make it lost, as does a peer's collective failing naming a lost peer
(nodes/peers.py). An agent whose last report said it is stopping (a graceful restart) is judged by its reports alone.
A node whose agent's step the compute scheduler ended (its ranks' exits say so: a preemption, a time limit) is not lost
at all until it reports again: it was released, and the scheduler's signal tells the job's story.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from enum import StrEnum

import msgspec

from reprise_common.clock import Clock
from reprise_common.report_view import EMPTY_ARRAY, GpuSeen, read_gpus
from reprise_detector.kinds.node_lost import NodeLost
from reprise_detector.kinds.node_unreachable import NodeUnreachable

REPORT_IN_FLIGHT_S = 0.1  # a report arriving this soon after a dropped connection may have been sent before it
RELEASE_IN_FLIGHT_S = 2.0  # a report this soon after the scheduler ended the node's step was sent before that
DEFAULT_INTERVAL_S = 1.0  # a node's report interval until a report read says its own (the agents' default)
SUSPECT_FACTOR = 1.5  # report intervals a node may miss before its silence makes it suspect
RECHECK_S = 0.1  # how soon a silent node its witnesses have not decided is looked at again (within the report limit)


ReportId = int | str
"""An id of a node's report, the same in every replica (the watcher's: a checksum, formatted only when a loss names
it in its event id)."""


class NodeState(StrEnum):
    """What the detector believes of a node that has reported at least once."""

    ALIVE = "alive"
    LOST = "lost"


class Witness(StrEnum):
    """What a suspect node's jobs' ranks on other nodes say of it (nodes/witnesses.py)."""

    NONE = "none"  # no job of the node has ranks elsewhere: there is no one to ask
    BLIND = (
        "blind"  # they cannot tell: no steps reported (no SDK), not training, or stalled before the node fell silent
    )
    WAITING = "waiting"  # too soon to tell: they advanced lately, but not since the node fell silent
    ADVANCING = "advancing"  # they advanced since the node fell silent: it is alive, only its reports do not arrive
    STALLED = "stalled"  # they advanced until the node fell silent and stopped with it: it is gone


WitnessCall = Callable[[str, float, float], Witness]
"""(node, since, now) -> what the node's jobs' other ranks say of its suspicion since `since` (monotonic times)."""


_ALIVE = NodeState.ALIVE  # bound once: saw() compares with it at every report, and a lookup on the enum costs 70 ns


class NodeSeen(msgspec.Struct, gc=False):
    """The last report of one node, as received (not scanned by the garbage collector: see RankTrack)."""

    last_seen: float  # the detector's monotonic clock
    last_report_id: ReportId
    state: NodeState = NodeState.ALIVE
    gpus: tuple[GpuSeen, ...] = ()
    gpus_json: msgspec.Raw = EMPTY_ARRAY  # what `gpus` were decoded from (a copy): the same again is not decoded
    dropped_at: float | None = None  # when the server said its agent's connection closed (not reconnected since)
    dropped_id: str = ""  # that advisory's id
    dropped_reason: str = ""
    leaving: bool = False  # its agent's last report said it is stopping: a closed connection is expected
    released_at: float | None = None  # when the scheduler ended its agent's step (released()): silence is no loss
    interval_s: float = DEFAULT_INTERVAL_S  # how often it reports, as its last report read said
    connection: str = ""  # the NATS connection its last report said it was sent on ("" unknown)
    held_since: float | None = None  # since when its jobs' other ranks vouch for it while it is suspect
    unreachable_said: bool = False  # its unreachability was said for this silence (once)


class Liveness:
    """Stage: fed by every node report; check() returns a NodeLost once per silence longer than the limit.

    A node is known once it has reported: a node that never reported is not reported lost (its agent may not run
    yet). A lost node that reports again is alive; if it falls silent again, the new NodeLost has a new id (the last
    report differs) and joins the job's incident within the window instead of opening another one.
    """

    def __init__(
        self,
        *,
        clock: Clock,
        lost_after_s: float,
        reconnect_grace_s: float = 0.3,
        unreachable_after_s: float = 30.0,
        hold_max_s: float = 300.0,
    ) -> None:
        self.clock = clock
        self.lost_after_s = lost_after_s
        self.reconnect_grace_s = reconnect_grace_s
        self.unreachable_after_s = unreachable_after_s  # silent this long while vouched for: said unreachable, once
        self.hold_max_s = hold_max_s  # vouched for no longer than this: past it, its silence decides as any node's
        self.nodes: dict[str, NodeSeen] = {}
        self._least_interval_s = DEFAULT_INTERVAL_S  # the shortest report interval of any node (the silence pass)
        self._recheck_at: float | None = None  # a silent node's witnesses are to be asked again then (monotonic)
        # What a suspect's jobs' other ranks say of it (the watch sets nodes/witnesses.py's): until then, no one.
        self.witness: WitnessCall = lambda _node, _since, _now: Witness.NONE
        # Nodes whose agent's connection closed (dropped()): next_due() looks at these alone, not at every node, once
        # per wait of the watch loop. Kept until next_due() finds one no longer suspect.
        self._suspects: set[str] = set()
        # How far behind the reading of reports is, in seconds (set by the runtime: its report follower's lag_s).
        # Silences are judged as of that long ago: a node whose report waits unread is not lost for the reader's delay.
        self.lag: Callable[[], float] = lambda: 0.0

    def saw(
        self,
        node_id: str,
        report_id: ReportId,
        gpus: msgspec.Raw | None = None,
        *,
        stopping: bool = False,
        interval_s: float | None = None,
        connection: str | None = None,
        now: float | None = None,
    ) -> None:
        """Record a report from a node (identity from the subject); `gpus`: its GPUs as it sent them (JSON), decoded
        only when they differ from the node's last (MalformedEventError, with nothing recorded, when they cannot be);
        `stopping`: its agent's last before a graceful stop, so the connection that closes next is no evidence (gpus
        given: the report was read, it is not); `interval_s`: how often it reports (a report read says so);
        `connection`: the NATS connection it says it was sent on; `now`: the monotonic time it arrived (the clock's by
        default; a batch of reports passes its own)."""
        seen = self.nodes.get(node_id)
        fresh: tuple[tuple[GpuSeen, ...], msgspec.Raw] | None = None
        if gpus is not None and (seen is None or gpus != seen.gpus_json):  # compared in C, no decoding
            # A copy: the report's own buffer, which `gpus` points into, is freed with it.
            fresh = read_gpus(gpus), msgspec.Raw(bytes(gpus))
        if now is None:
            now = self.clock.monotonic()
        if seen is None:
            seen = self.nodes[node_id] = NodeSeen(now, report_id)
        seen.last_seen, seen.last_report_id = now, report_id
        if seen.state is not _ALIVE:  # what rarely changes is compared before it is written (every report)
            seen.state = _ALIVE
        if seen.held_since is not None or seen.unreachable_said:
            seen.held_since, seen.unreachable_said = None, False
        if seen.released_at is not None and not stopping and now - seen.released_at > RELEASE_IN_FLIGHT_S:
            seen.released_at = None  # a running agent reports again (the step's next allocation): judged as any
        if stopping:
            seen.leaving, seen.dropped_at = True, None
        elif gpus is not None and seen.leaving:
            seen.leaving = False  # a running agent's report (a new one after a graceful restart)
        if seen.dropped_at is not None and now - seen.dropped_at > REPORT_IN_FLIGHT_S:
            seen.dropped_at = None  # reporting again: it reconnected (the advisory may have been missed)
        if fresh is not None:
            seen.gpus, seen.gpus_json = fresh
        if interval_s is not None and interval_s != seen.interval_s:
            seen.interval_s = interval_s
            self._least_interval_s = min(self._least_interval_s, interval_s)
        if connection and connection != seen.connection:
            seen.connection = connection

    def dropped(self, node_id: str, *, advisory_id: str, reason: str) -> bool:
        """The server closed the connection of the node's agent; True when that makes the node suspect.

        Not for a node that never reported, one already lost, or one whose agent said it is stopping.
        """
        seen = self.nodes.get(node_id)
        if seen is None or seen.state is NodeState.LOST or seen.leaving or seen.dropped_at is not None:
            return False
        if seen.released_at is not None:
            return False
        seen.dropped_at, seen.dropped_id, seen.dropped_reason = self.clock.monotonic(), advisory_id, reason
        self._suspects.add(node_id)
        return True

    def reporting_connection(self, node_id: str) -> str:
        """The NATS connection the node's last report said it was sent on ("" unknown, or never reported)."""
        seen = self.nodes.get(node_id)
        return "" if seen is None else seen.connection

    def connected(self, node_id: str) -> None:
        """The node's agent connected (again): no suspicion stands, and a stopping agent is back."""
        seen = self.nodes.get(node_id)
        if seen is not None:
            seen.dropped_at, seen.leaving, seen.released_at = None, False, None

    def released(self, node_id: str) -> None:
        """The compute scheduler ended the step of the node's agent (a preemption, a time limit, a cancel: its ranks
        said so as they ended). Its silence and its closed connection are then no loss, until it reports again: the
        scheduler's own signal says what happened to the job."""
        seen = self.nodes.get(node_id)
        if seen is not None and seen.state is NodeState.ALIVE:
            seen.released_at, seen.dropped_at = self.clock.monotonic(), None

    def check(self) -> list[NodeLost | NodeUnreachable]:
        """Nodes that just became lost (each silence once), and those just found unreachable (each silence once).

        The pass over every node only compares its last report's time with the shortest suspicion; what a judgement
        takes is done for the few found. At 50,000 nodes a pass that judged each node in full held the event loop for
        13 ms, twice a second, while reports waited.
        """
        now, wall = self._judged_at()
        found: list[NodeLost | NodeUnreachable] = []
        self._recheck_at = None
        for node_id in list(self._suspects):  # next_due() forgets those no longer suspect
            seen = self.nodes[node_id]
            dropped_at = seen.dropped_at
            if not self._judged(seen) or dropped_at is None or now - dropped_at < self.reconnect_grace_s:
                continue
            verdict = self.witness(node_id, dropped_at, now)
            if verdict is Witness.NONE or verdict is Witness.STALLED:
                gone = now - dropped_at
                why = "" if verdict is Witness.NONE else ", and its jobs' ranks on other nodes stopped with it"
                how = f"its connection closed ({seen.dropped_reason}) and did not come back within {gone:.1f} s{why}"
                found.append(
                    self._lose(
                        node_id,
                        seen,
                        evidence_id=seen.dropped_id,
                        judged=(now, wall),
                        ago=gone,
                        limit=self.reconnect_grace_s,
                        how=how,
                    )
                )
            else:  # its jobs' other ranks are asked again with its silence, below, at every pass
                self._suspects.discard(node_id)
        heard_after = now - SUSPECT_FACTOR * self._least_interval_s
        for node_id in [node_id for node_id, seen in self.nodes.items() if seen.last_seen < heard_after]:
            seen = self.nodes[node_id]
            if self._judged(seen):
                symptom = self._judge_silence(node_id, seen, now, wall)
                if symptom is not None:
                    found.append(symptom)
        return found

    def _judge_silence(
        self, node_id: str, seen: NodeSeen, now: float, wall: datetime
    ) -> NodeLost | NodeUnreachable | None:
        """One silent node: lost when its jobs' other ranks stopped with it or the limit passed, unreachable (said once)
        while they advance without it; None while nothing is decided."""
        silent = now - seen.last_seen
        since = seen.last_seen + SUSPECT_FACTOR * seen.interval_s
        if seen.dropped_at is not None:
            since = min(since, seen.dropped_at)
        if now < since:
            return None
        report_id = str(seen.last_report_id)
        verdict = self.witness(node_id, since, now)
        if verdict is Witness.STALLED:
            how = f"no report for {silent:.1f} s, and its jobs' ranks on other nodes stopped advancing with it"
            return self._lose(
                node_id,
                seen,
                evidence_id=report_id,
                judged=(now, wall),
                ago=now - since,
                limit=since - seen.last_seen,
                how=how,
            )
        if verdict in (Witness.WAITING, Witness.ADVANCING) and now - since < self.lost_after_s:
            self._recheck_at = self.clock.monotonic() + RECHECK_S  # they may stop any moment: asked again soon
        if self._held(seen, verdict, now):
            if silent < self.unreachable_after_s or seen.unreachable_said:
                return None
            seen.unreachable_said = True
            return NodeUnreachable(
                event_id=f"node-unreachable:{node_id}:{report_id}"[:128],
                time=wall - timedelta(seconds=silent - self.unreachable_after_s),
                node_id=node_id,
                silent_s=silent,
                limit_s=self.unreachable_after_s,
                how=f"no report for {silent:.1f} s while its jobs' ranks on other nodes go on advancing with it",
            )
        if silent < self.lost_after_s:
            return None
        how = f"no report for {silent:.1f} s"
        return self._lose(
            node_id,
            seen,
            evidence_id=report_id,
            judged=(now, wall),
            ago=silent - self.lost_after_s,
            limit=self.lost_after_s,
            how=how,
        )

    def _held(self, seen: NodeSeen, verdict: Witness, now: float) -> bool:
        """Whether the node's witnesses vouch for it: once they saw it advance without reports, it stays vouched for
        (through a pause of its job's: evaluating, saving) until they stop with it, its job ends, or the bound."""
        if seen.held_since is not None and now - seen.held_since >= self.hold_max_s:
            return False
        if verdict is Witness.ADVANCING:
            if seen.held_since is None:
                seen.held_since = now
            return True
        return seen.held_since is not None and verdict in (Witness.WAITING, Witness.BLIND)

    @staticmethod
    def _lose(
        node_id: str,
        seen: NodeSeen,
        *,
        evidence_id: str,
        judged: tuple[float, datetime],
        ago: float,
        limit: float,
        how: str,
    ) -> NodeLost:
        """The node lost as of `ago` seconds before the `judged` moment (monotonic, wall), on the evidence
        `evidence_id` names."""
        seen.state, seen.dropped_at, seen.held_since = NodeState.LOST, None, None
        now, wall = judged
        return NodeLost(
            event_id=f"node-lost:{node_id}:{evidence_id}"[:128],
            time=wall - timedelta(seconds=ago),
            node_id=node_id,
            silent_s=now - seen.last_seen,
            limit_s=limit,
            how=how[:512],
        )

    @staticmethod
    def _judged(seen: NodeSeen) -> bool:
        """Whether a node's silence or closed connection can make it lost: it is alive, and not released."""
        return seen.state is NodeState.ALIVE and seen.released_at is None

    def overdue_at(self, node_id: str, factor: float) -> float | None:
        """The monotonic time the node's silence passes `factor` times its report interval; None for a node that never
        reported, is lost already, or whose agent said it is stopping (its silence is expected)."""
        seen = self.nodes.get(node_id)
        if seen is None or seen.state is not NodeState.ALIVE or seen.leaving or seen.released_at is not None:
            return None
        due = seen.last_seen + factor * seen.interval_s
        return due if seen.dropped_at is None else min(due, seen.dropped_at)  # its connection closed: overdue now

    def unheard(self, node_id: str, now: float) -> bool:
        """Whether the node's reports are overdue at `now` (monotonic): SUSPECT_FACTOR of its intervals missed."""
        due = self.overdue_at(node_id, SUSPECT_FACTOR)
        return due is not None and now > due

    def lost_on_evidence(self, node_id: str, *, factor: float, evidence: str) -> NodeLost | None:
        """The node lost at once, on other evidence than its silence (its peers' errors), when it has also been
        silent longer than `factor` times its report interval; None when it has not (or cannot be: overdue_at).

        The id is the one the silence would have had: a replica that calls the same silence lost by the limit instead
        records the same symptom.
        """
        due = self.overdue_at(node_id, factor)
        now, wall = self._judged_at()
        if due is None or now < due:
            return None
        seen = self.nodes[node_id]
        silent = now - seen.last_seen
        how = f"{evidence} and it has not reported for {silent:.1f} s"
        if seen.dropped_at is not None:
            how = f"{evidence} and its connection closed ({seen.dropped_reason})"
        return self._lose(
            node_id,
            seen,
            evidence_id=str(seen.last_report_id),
            judged=(now, wall),
            ago=now - due,
            limit=factor * seen.interval_s,
            how=how,
        )

    def _judged_at(self) -> tuple[float, datetime]:
        """The moment silences are judged as of (monotonic, wall): now, less how far behind the reading is."""
        lag = self.lag()
        return self.clock.monotonic() - lag, self.clock.now() - timedelta(seconds=lag)

    def heard_all(self, now: float) -> None:
        """The detector could not hear any node until `now` (its own connection was down): silences count from now."""
        for seen in self.nodes.values():
            seen.last_seen = max(seen.last_seen, now)

    def next_due(self) -> float | None:
        """The monotonic time the earliest suspicion's grace ends, or a silent node's witnesses are to be asked again;
        None when neither is pending."""
        due = self._recheck_at
        for node_id in list(self._suspects):
            seen = self.nodes[node_id]
            if seen.dropped_at is None or seen.state is not NodeState.ALIVE:
                self._suspects.discard(node_id)  # reconnected, reporting again, released or lost meanwhile
            elif due is None or seen.dropped_at + self.reconnect_grace_s < due:
                due = seen.dropped_at + self.reconnect_grace_s
        return due

    def age(self, node_id: str) -> float | None:
        """Seconds since the node's last report; None if it never reported."""
        seen = self.nodes.get(node_id)
        return None if seen is None else self.clock.monotonic() - seen.last_seen
