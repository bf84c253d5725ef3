"""The watch stages and decisions, table-driven with an injected clock: liveness, hangs, stragglers, root-cause
order, reputation rules and partitions."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import msgspec
import pytest

from reprise_common import subjects
from reprise_common.bus import Outcome
from reprise_common.clock import ManualClock
from reprise_common.events import (
    Category,
    JobPlacement,
    NodeReport,
    QuarantineReason,
    RankAssignment,
    RankStatus,
    RecommendedAction,
    Severity,
)
from reprise_detector import node_reports
from reprise_detector.classify import Classification
from reprise_detector.correlate import Decision, decide
from reprise_detector.incidents.models import Incident
from reprise_detector.node_reports import FOLD_EVERY_S, FOLD_SLOW_S
from reprise_detector.nodes.liveness import Liveness, NodeState
from reprise_detector.nodes.models import NodeFaultBase
from reprise_detector.nodes.reputation import ReputationRules, judge
from reprise_detector.partition import Partition, partition_of
from reprise_detector.placements import PlacementMap
from reprise_detector.progress import stragglers
from reprise_detector.progress.book import ProgressBook, fold
from reprise_detector.progress.hangs import HangWatch, limit_for
from reprise_detector.progress.limits import HangLimits, LimitReason
from reprise_detector.progress.stragglers import StragglerVerdict, StragglerWatch
from reprise_detector.settings import DetectorSettings
from reprise_detector.watch import HANG_MIN_GAP_S, REHEAR_S, Watcher

T0 = datetime(2026, 1, 1, tzinfo=UTC)


# --- liveness -----------------------------------------------------------------------------------------------------
def test_a_silent_node_is_lost_once_and_a_flapping_node_gets_a_new_id_per_silence() -> None:
    clock = ManualClock(T0)
    live = Liveness(clock=clock, lost_after_s=5)
    live.saw("node-1", "s1")
    live.saw("node-2", "s2")
    clock.advance(4.9)
    live.saw("node-2", "s3")
    assert live.check() == []
    clock.advance(0.2)
    [lost] = live.check()
    assert (lost.node_id, lost.event_id) == ("node-1", "node-lost:node-1:s1")
    assert lost.time == T0 + timedelta(seconds=5)  # when the limit was crossed, not when we looked
    clock.advance(10)
    assert [n.node_id for n in live.check()] == ["node-2"]  # node-1 is not reported again while it stays silent
    live.saw("node-1", "s9")
    assert live.nodes["node-1"].state is NodeState.ALIVE
    clock.advance(6)
    assert [n.event_id for n in live.check()] == ["node-lost:node-1:s9"]


def test_the_pass_over_silences_finds_every_silent_node_and_no_other() -> None:
    """check() picks the nodes silent past the limit by their last report's time alone, then judges those: a node heard
    again is not among them, a released or lost one is passed over, and the rest are each reported once."""
    clock = ManualClock(T0)
    live = Liveness(clock=clock, lost_after_s=5)
    for node in ("node-1", "node-2", "node-3", "node-4", "node-5"):
        live.saw(node, f"r-{node}")
        clock.advance(0.1)
    live.released("node-2")  # its step ended: silence is no loss
    clock.advance(3)
    live.saw("node-1", "r-again")  # heard again: now the most recent
    clock.advance(2.5)  # node-2 to node-5 have been silent for 5.1-5.4 s, node-1 for 2.5 s
    assert [lost.node_id for lost in live.check()] == ["node-3", "node-4", "node-5"]
    clock.advance(3)  # node-1 silent for 5.5 s; node-3 to node-5 already lost, node-2 released, ahead of it
    assert [lost.node_id for lost in live.check()] == ["node-1"]
    live.saw("node-4", "r-back")
    clock.advance(5.5)
    assert [lost.node_id for lost in live.check()] == ["node-4"]


def test_a_closed_connection_makes_a_node_lost_after_the_grace_unless_it_comes_back() -> None:
    clock = ManualClock(T0)
    live = Liveness(clock=clock, lost_after_s=60, reconnect_grace_s=0.3)
    for node in ("node-1", "node-2", "node-3", "node-4"):
        live.saw(node, f"r-{node}")
    assert not live.dropped("node-9", advisory_id="a0", reason="Client Closed")  # never reported: not known
    assert live.next_due() is None
    clock.advance(1.0)
    assert live.dropped("node-1", advisory_id="a1", reason="Client Closed")
    assert not live.dropped("node-1", advisory_id="a1b", reason="Client Closed")  # the first drop counts
    assert live.dropped("node-2", advisory_id="a2", reason="Stale Connection")
    live.saw("node-4", "r-bye", msgspec.Raw(b"[]"), stopping=True)  # its last report: stopping (a graceful restart)
    assert not live.dropped("node-4", advisory_id="a4", reason="Client Closed")
    assert live.next_due() == clock.monotonic() + 0.3
    clock.advance(0.2)
    assert live.dropped("node-3", advisory_id="a3", reason="Client Closed")
    clock.advance(0.05)
    live.saw("node-3", "r-late")  # sent before its connection closed: no sign of life
    live.connected("node-2")  # reconnected (a network blip, a NATS restart)
    assert live.check() == []
    clock.advance(0.15)
    [lost] = live.check()
    assert (lost.node_id, lost.event_id, lost.limit_s) == ("node-1", "node-lost:node-1:a1", 0.3)
    assert lost.how == "its connection closed (Client Closed) and did not come back within 0.4 s"
    assert lost.time == T0 + timedelta(seconds=1.0)  # when the connection closed
    assert live.nodes["node-3"].state is NodeState.ALIVE  # dropped at 1.2 s: its grace ends at 1.5 s
    clock.advance(0.15)
    assert [n.node_id for n in live.check()] == ["node-3"]
    assert live.next_due() is None
    clock.advance(0.2)
    live.saw("node-2", "r-2b")
    assert live.check() == []  # node-2 and node-4 are alive; node-1 and node-3 are reported once
    live.saw("node-1", "r-back")  # back, reporting: a new drop counts again
    assert live.dropped("node-1", advisory_id="a5", reason="Client Closed")
    clock.advance(0.2)
    live.saw("node-1", "r-after")  # a report well after the drop: it reconnected, the advisory was missed
    clock.advance(0.2)
    assert live.check() == []


# --- hangs --------------------------------------------------------------------------------------------------------
def _status(rank: int, step: int | None, phase: str = "training", **extra: float | str | None) -> RankStatus:
    return RankStatus(job_id="job-a", rank=rank, step=step, phase=phase, heartbeat_age_s=0.0, **extra)  # type: ignore[arg-type]


LIMITS = HangLimits(floor_s=10, k=5, startup_s=100, checkpointing_s=200, evaluating_s=300, loading_data_s=400)
# phase, p99 step time, override timeout, seconds stalled, hung?, limit reason
HANG_TABLE = [
    ("training", 1.0, None, 9.0, False, LimitReason.FLOOR),
    ("training", 1.0, None, 11.0, True, LimitReason.FLOOR),
    ("training", 4.0, None, 19.0, False, LimitReason.LEARNED),  # 5 x 4 s = 20 s > floor
    ("training", 4.0, None, 21.0, True, LimitReason.LEARNED),
    ("training", 4.0, 30.0, 25.0, False, LimitReason.OVERRIDE),
    ("training", 4.0, 30.0, 31.0, True, LimitReason.OVERRIDE),
    ("startup", None, None, 99.0, False, LimitReason.STARTUP),
    ("startup", None, None, 101.0, True, LimitReason.STARTUP),
    ("checkpointing", 1.0, None, 150.0, False, LimitReason.CHECKPOINTING),
    ("checkpointing", 1.0, None, 201.0, True, LimitReason.CHECKPOINTING),
    ("eval", 1.0, None, 299.0, False, LimitReason.EVALUATING),
    ("validation", 1.0, 30.0, 301.0, True, LimitReason.EVALUATING),  # a phase's own limit outlasts an override
    ("data_loading", 1.0, None, 399.0, False, LimitReason.LOADING_DATA),
    ("data_loading", 1.0, None, 401.0, True, LimitReason.LOADING_DATA),
    ("warmup", 1.0, None, 11.0, True, LimitReason.FLOOR),  # a phase without a limit of its own is training
]


def test_a_rank_stopped_in_a_long_phase_is_timed_as_training_from_when_it_was_seen_stopped() -> None:
    clock = ManualClock(T0)
    book = ProgressBook(clock)
    watch = HangWatch(clock=clock, book=book, defaults=LIMITS)
    for rank in range(2):
        book.update("node-1", _status(rank, 7, "eval", phase_age_s=0.0, proc_state="S"))
    clock.advance(60)  # a minute into the evaluation (its own limit: 300 s), rank 1 is frozen
    book.update("node-1", _status(0, 7, "eval", phase_age_s=60.0, proc_state="S"))
    book.update("node-1", _status(1, 7, "eval", phase_age_s=60.0, proc_state="T"))
    clock.advance(LIMITS.floor_s - 1)
    book.update("node-1", _status(1, 7, "eval", phase_age_s=69.0, proc_state="T"))
    assert watch.check() == []  # stopped for less than the training limit
    clock.advance(2)
    book.update("node-1", _status(1, 7, "eval", phase_age_s=71.0, proc_state="T"))
    [hung] = watch.check()
    assert (hung.rank, hung.limit_reason, hung.phase) == (1, LimitReason.FLOOR.value, "eval")
    assert "stopped" in hung.culprit_reason


def test_the_default_limits_call_a_hang_within_3x_the_p99_step_time_or_15_s() -> None:
    defaults = HangLimits()
    assert (defaults.floor_s, defaults.k) == (15.0, 3.0)
    settings = DetectorSettings()
    assert (settings.hang_floor_s, settings.hang_k) == (defaults.floor_s, defaults.k)


@pytest.mark.parametrize("case", HANG_TABLE, ids=str)
def test_hang_limits_are_phase_aware_learned_and_overridable(
    case: tuple[str, float | None, float | None, float, bool, LimitReason],
) -> None:
    phase, p99, override, stalled, hung, why = case
    clock = ManualClock(T0)
    book = ProgressBook(clock)
    watch = HangWatch(clock=clock, book=book, defaults=LIMITS)
    extra = {"step_time_p99_s": p99} if p99 else {}
    for rank in range(2):
        book.update("node-1", _status(rank, 7 if phase != "startup" else None, phase, phase_age_s=0.0, **extra))
    clock.advance(stalled)
    overrides = {"job-a": HangLimits(**{**LIMITS.__dict__, "timeout_s": override})} if override else None
    found = watch.check(overrides)
    assert bool(found) is hung
    if found:
        assert found[0].limit_reason == why.value
        assert watch.check(overrides) == []  # once per stall


def test_a_hang_names_the_ranks_that_stopped_first_and_those_that_lag() -> None:
    clock = ManualClock(T0)
    book = ProgressBook(clock)
    watch = HangWatch(clock=clock, book=book, defaults=LIMITS)
    for rank in range(4):
        book.update(f"node-{rank // 2}", _status(rank, 10, step_time_p99_s=0.5))
    for step in range(11, 20):  # ranks 0, 1 and 3 keep going; rank 2 stops at step 10
        clock.advance(0.5)
        for rank in (0, 1, 3):
            book.update(f"node-{rank // 2}", _status(rank, step, step_time_p99_s=0.5))
    clock.advance(12)
    [hung] = watch.check()
    assert (hung.rank, hung.node_id, hung.stalled_ranks, hung.lagging_ranks) == (2, "node-1", [2], [2])
    assert hung.step == 10 and hung.stalled_s > LIMITS.floor_s
    book.update("node-1", _status(2, 11, step_time_p99_s=0.5))  # progress resumes: a later stall is a new hang
    assert not book.jobs["job-a"].hung


def test_a_relaunched_rank_at_the_step_its_predecessor_stopped_at_is_not_stalled() -> None:
    clock = ManualClock(T0)
    book = ProgressBook(clock)
    watch = HangWatch(clock=clock, book=book, defaults=LIMITS)
    for rank in range(2):
        book.update("node-1", _status(rank, 4, restart_epoch=0))
    clock.advance(LIMITS.floor_s - 1)  # the recovery replaces both ranks; the new ones reach step 4 again
    for rank in range(2):
        book.update("node-1", _status(rank, 4, restart_epoch=1))
    clock.advance(2)  # past the floor since epoch 0's step 4, not since epoch 1's
    assert watch.check() == []
    clock.advance(LIMITS.floor_s)
    assert [h.rank for h in watch.check()] == [0]  # epoch 1 really stalled at step 4


# Four ranks stop at the same step at the same time (every peer waits in the same collective); per rank: the process
# state and the CPU seconds used during the 70 s stall, then the rank blamed and the start of the reason.
CULPRIT_TABLE = [
    (["S", "S", "T", "S"], [1.0, 1.0, 0.0, 1.0], 2, "its process is stopped"),  # frozen by SIGSTOP
    (["S", "D", "S", "S"], [1.0, 0.0, 1.0, 1.0], 1, "its process is stuck in uninterruptible sleep"),
    (["S", "S", "S", "R"], [1.0, 1.0, 1.0, 69.0], 3, "busy without progress"),  # spinning at ~100 % of a core
    (["R", "R", "R", "R"], [60.0, 60.0, 60.0, 69.0], 0, "stopped first"),  # all busy: CPU says nothing
    (["S", "S", "S", "S"], [1.0, 1.0, 1.0, 1.0], 0, "stopped first"),
    (["", "", "", ""], [None, None, None, None], 0, "stopped first"),  # an agent that cannot read /proc
]


@pytest.mark.parametrize(("states", "cpu", "blamed", "reason"), CULPRIT_TABLE)
def test_a_hang_blames_the_rank_the_kernel_holds_or_that_spins(
    states: list[str], cpu: list[float | None], blamed: int, reason: str
) -> None:
    clock = ManualClock(T0)
    book = ProgressBook(clock)
    watch = HangWatch(clock=clock, book=book, defaults=LIMITS)
    for rank in range(4):
        book.update(
            f"node-{rank}", _status(rank, 10, step_time_p99_s=0.5, cpu_s=100.0 if cpu[rank] is not None else None)
        )
    clock.advance(70)
    for rank in range(4):
        used = cpu[rank]
        book.update(
            f"node-{rank}",
            _status(rank, 10, step_time_p99_s=0.5, proc_state=states[rank], cpu_s=None if used is None else 100 + used),
        )
    [hung] = watch.check()
    assert (hung.rank, hung.node_id, hung.stalled_ranks) == (blamed, f"node-{blamed}", [0, 1, 2, 3])
    assert hung.culprit_reason.startswith(reason), hung.culprit_reason


def test_a_hang_called_at_the_first_deadline_still_blames_the_frozen_rank() -> None:
    """Checked the moment the first rank passes its limit, only that rank is over it; the frozen rank, whose last step
    came a moment later and whose stall counts from when it was seen stopped, must still be the one blamed."""
    clock = ManualClock(T0)
    book = ProgressBook(clock)
    watch = HangWatch(clock=clock, book=book, defaults=LIMITS)  # floor 10 s
    for rank in (2, 0, 1, 3):  # every rank's last step, 20 ms apart: rank 3 is frozen right after its own
        book.update(f"node-{rank}", _status(rank, 35, step_time_p99_s=0.1))
        clock.advance(0.02)
    clock.advance(0.5)
    book.update("node-3", _status(3, 35, step_time_p99_s=0.1, proc_state="T"))  # its next report: stopped
    assert watch.check() == []
    clock.advance(10.0 - clock.monotonic() + 0.001)  # just past rank 2's limit; the others' come later
    [hung] = watch.check()
    assert (hung.rank, hung.node_id) == (3, "node-3"), hung
    assert hung.culprit_reason.startswith("its process is stopped"), hung.culprit_reason
    assert hung.stalled_ranks == [0, 1, 2, 3]


def test_a_pass_looks_closely_only_at_jobs_that_can_be_due_and_finds_a_hang_at_the_first_pass_past_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = ManualClock(T0)
    book = ProgressBook(clock)
    watch = HangWatch(clock=clock, book=book, defaults=LIMITS)  # floor 10 s
    looks: list[str] = []
    judge = watch._judge
    monkeypatch.setattr(watch, "_judge", lambda job_id, *args: looks.append(job_id) or judge(job_id, *args))
    for job in ("job-a", "job-b"):
        for rank in range(4):
            book.update("node-1", RankStatus(job_id=job, rank=rank, step=10, phase="training", heartbeat_age_s=0.0))
    found = []
    for _ in range(21):  # 10.5 s of passes every 0.5 s
        clock.advance(0.5)
        found += watch.check()
        if found:
            break
    assert sorted(h.job_id for h in found) == ["job-a", "job-b"]
    assert clock.monotonic() == 10.5  # the first pass after the 10 s floor
    assert len(looks) <= 3 * 2  # the first look, one at the limit and one just past it: not 21 a job
    book.update("node-1", RankStatus(job_id="job-a", rank=0, step=10, phase="checkpointing", heartbeat_age_s=0.0))
    assert book.jobs["job-a"].next_check == 0.0  # a new phase, another limit: due at the next pass


def test_ranks_joining_a_job_bring_no_close_look_before_they_can_pass_a_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh detector meets a job's nodes one report at a time: the job is looked at once its first rank could have
    passed a limit, not as each rank joins (at 45,000 nodes that was a close look at every job at every pass for
    seconds); a rank that joined late is still hung at its own limit."""
    clock = ManualClock(T0)
    book = ProgressBook(clock)
    watch = HangWatch(clock=clock, book=book, defaults=LIMITS)  # floor 10 s, the least of its limits
    looks: list[str] = []
    judge = watch._judge
    monkeypatch.setattr(watch, "_judge", lambda job_id, *args: looks.append(job_id) or judge(job_id, *args))
    book.update("node-0", RankStatus(job_id="job-a", rank=0, step=10, phase="training", heartbeat_age_s=0.0))
    for rank in range(1, 8):  # one node's ranks a pass, 0.5 s apart; rank 0 keeps stepping
        clock.advance(0.5)
        book.update("node-0", RankStatus(job_id="job-a", rank=0, step=10 + rank, phase="training"))
        assert watch.check() == []
        book.update(f"node-{rank}", RankStatus(job_id="job-a", rank=rank, step=10, phase="training"))
    assert looks == []
    assert watch.next_due == 10.0  # the watch wakes when the first rank could have passed the floor
    clock.advance(6.4)  # 9.9 s
    assert watch.check() == [] and looks == []
    clock.advance(0.2)  # 10.1 s: rank 0 could have passed the floor (it kept stepping)
    assert watch.check() == [] and looks == ["job-a"]
    clock.advance(0.5)  # 10.6 s: rank 1, which joined at 0.5 s and never stepped, has
    [hung] = watch.check()
    assert (hung.rank, hung.stalled_s, len(looks)) == (1, pytest.approx(10.1), 2)


def test_the_soonest_deadline_of_a_watched_job_is_known_after_a_check() -> None:
    """The watch wakes at that deadline instead of at the next interval, so a hang is called at its limit."""
    clock = ManualClock(T0)
    book = ProgressBook(clock)
    watch = HangWatch(clock=clock, book=book, defaults=LIMITS)  # floor 10 s
    book.update("node-1", _status(0, 5))  # at monotonic 0
    clock.advance(2)
    book.update("node-1", RankStatus(job_id="job-b", rank=0, step=7, phase="training", heartbeat_age_s=0.0))
    assert watch.next_due is None  # nothing looked at yet
    clock.advance(1)
    assert watch.check() == []
    assert watch.next_due == 10.0  # job-a's rank passes its 10 s floor first (job-b's at 12 s)
    clock.advance(6.5)
    assert watch.check() == []  # nobody is due: both jobs are skipped, their deadlines kept
    assert watch.next_due == 10.0
    clock.advance(0.6)  # just past it
    [hung] = watch.check()
    assert hung.job_id == "job-a"
    assert watch.next_due == 12.0  # the hung job is no longer watched


def test_the_watch_checks_hangs_at_a_jobs_deadline_not_only_every_interval() -> None:
    clock = ManualClock(T0)
    book = ProgressBook(clock)
    hangs = HangWatch(clock=clock, book=book, defaults=LIMITS)
    watcher = Watcher(
        detector=None, placements=None, partition=None, liveness=None, book=book, hangs=hangs,  # type: ignore[arg-type]
        stragglers=None, engine=None, clock=clock, hang_check_interval_s=5.0,  # type: ignore[arg-type]
    )  # fmt: skip
    assert watcher._hangs_due() == float("-inf")  # never checked: due now
    watcher._hangs_checked_at = 8.0
    assert watcher._hangs_due() == 13.0  # no deadline known: the interval's
    hangs.next_due = 10.0
    assert watcher._hangs_due() == 10.0  # a job's limit is passed before the interval's check
    hangs.next_due = 8.01
    assert watcher._hangs_due() == 8.0 + HANG_MIN_GAP_S  # but checks stay a little apart
    watcher._hang_gap_s = 0.4  # the last check took 20 ms: some 5 % of the time at most
    assert watcher._hangs_due() == 8.4
    hangs.next_due = 20.0
    assert watcher._hangs_due() == 13.0


def test_a_reconnect_is_seen_before_the_bus_moves_its_generation() -> None:
    """After a NATS outage the client is connected a moment before the bus bumps `generation` (it provisions the
    streams first): a tick in that moment judged every node's silence of the outage and called nodes lost."""

    @dataclass
    class Connection:
        connected: bool = True
        generation: int = 1
        disconnects: int = 0

    clock = ManualClock(T0)
    bus = Connection()
    liveness = Liveness(clock=clock, lost_after_s=5.0)
    watcher = Watcher(
        detector=None, placements=None, partition=None, liveness=liveness, book=ProgressBook(clock),  # type: ignore[arg-type]
        hangs=HangWatch(clock=clock, book=ProgressBook(clock), defaults=LIMITS), stragglers=None,  # type: ignore[arg-type]
        engine=None, clock=clock, hang_check_interval_s=0.5, bus=bus,  # type: ignore[arg-type]
    )  # fmt: skip
    assert watcher._hearing()
    bus.connected, bus.disconnects = False, 1  # the outage
    clock.advance(6.0)
    assert not watcher._hearing()
    bus.connected = True  # reconnected; generation not bumped yet
    assert not watcher._hearing()  # the missed reports are not silences: hear everyone again first
    clock.advance(REHEAR_S)
    assert watcher._hearing()


def test_a_tick_for_a_hang_deadline_alone_does_not_pass_over_the_nodes() -> None:
    """Hang deadlines can bring ticks twenty times a second; node loss is looked for at the interval's ticks (and when
    a suspect's grace ends), so the pass over every node is not made at each."""

    @dataclass
    class Placements:
        last_seq: int = -1  # what the watch last pruned at: nothing placed since

    @dataclass
    class Stub:  # the detector as the tick uses it: its early exits, and the pipeline derived symptoms go through
        found: list[object]

        def check(self) -> list[object]:
            return []

        @property
        def early_exits(self) -> Stub:
            return self

        async def process_derived(self, batch: list[object]) -> object:
            self.found.extend(batch)
            return Outcome.ACK

    clock = ManualClock(T0)
    liveness = Liveness(clock=clock, lost_after_s=5.0)
    detector = Stub([])
    book = ProgressBook(clock)
    watcher = Watcher(
        detector=detector, placements=Placements(), partition=None, liveness=liveness, book=book,  # type: ignore[arg-type]
        hangs=HangWatch(clock=clock, book=book, defaults=LIMITS), stragglers=None, engine=None,  # type: ignore[arg-type]
        clock=clock, hang_check_interval_s=0.5,
    )  # fmt: skip
    liveness.saw("node-1", 7)
    clock.advance(6.0)
    asyncio.run(watcher.tick(nodes=False))
    assert detector.found == []
    asyncio.run(watcher.tick())
    assert [lost.event_id for lost in detector.found] == ["node-lost:node-1:7"]  # type: ignore[attr-defined]


def test_a_job_with_a_dead_rank_is_not_called_hung() -> None:
    clock = ManualClock(T0)
    book = ProgressBook(clock)
    watch = HangWatch(clock=clock, book=book, defaults=LIMITS)
    book.update("node-1", _status(0, 5))
    book.update("node-1", RankStatus(job_id="job-a", rank=1, step=5, phase="training", alive=False))
    clock.advance(1000)
    assert watch.check() == []


# --- stragglers ---------------------------------------------------------------------------------------------------
# step time of rank 3 in each report (ranks 0-2 run at 1.0 s), and the verdict for rank 3 after it
STRAGGLER_TABLE = [
    ([1.1, 1.0, 1.2], [StragglerVerdict.NORMAL] * 3),
    ([2.0, 2.0, 2.0], [StragglerVerdict.SLOW, StragglerVerdict.SLOW, StragglerVerdict.STRAGGLER]),
    ([2.0, 2.0, 1.0, 2.0, 2.0], [StragglerVerdict.SLOW] * 2 + [StragglerVerdict.NORMAL] + [StragglerVerdict.SLOW] * 2),
    ([2.0] * 5, [StragglerVerdict.SLOW] * 2 + [StragglerVerdict.STRAGGLER] + [StragglerVerdict.SLOW] * 2),
]


@pytest.mark.parametrize(("times", "verdicts"), STRAGGLER_TABLE)
def test_stragglers_need_n_slow_reports_in_a_row(times: list[float], verdicts: list[StragglerVerdict]) -> None:
    clock = ManualClock(T0)
    book = ProgressBook(clock)
    watch = StragglerWatch(clock=clock, book=book, factor=1.5, reports=3)
    seen = []
    for step, slow in enumerate(times):
        folded = [book.update("node-1", _status(r, step, step_time_last_s=slow if r == 3 else 1.0)) for r in range(4)]
        seen.append(watch.judge(*folded[3]))
    assert seen == verdicts


def test_a_slow_look_counts_the_reports_since_the_last_look() -> None:
    """A rank's status is looked at when it is folded, every few reports: a slow look extends the streak by every
    report since the last look, except the first slow look, which counts one (the reports before it may have been
    fast); a fast look ends the streak."""
    clock = ManualClock(T0)
    book = ProgressBook(clock)
    watch = StragglerWatch(clock=clock, book=book, factor=1.5, reports=5)

    def look(step: int, slow: float, reports: int) -> tuple[StragglerVerdict, int]:
        folded = [book.update("node-1", _status(r, step, step_time_last_s=slow if r == 3 else 1.0)) for r in range(4)]
        verdict = watch.judge(*folded[3], reports)
        return verdict, folded[3][1].slow_streak

    assert look(1, 1.0, 1) == (StragglerVerdict.NORMAL, 0)
    assert look(5, 2.0, 4) == (StragglerVerdict.SLOW, 1)  # slow at this look only: the three before may have been fast
    assert look(9, 2.0, 4) == (StragglerVerdict.STRAGGLER, 5)  # slow at both ends of four reports
    assert look(13, 1.0, 4) == (StragglerVerdict.NORMAL, 0)
    assert look(17, 2.0, 4) == (StragglerVerdict.SLOW, 1)


def test_a_relaunched_rank_starts_a_new_streak() -> None:
    """The slow reports of a rank's last launch (maybe on another node) say nothing about its new process: a relaunch
    neither completes the old streak nor keeps a reported straggler from being reported again."""
    clock = ManualClock(T0)
    book = ProgressBook(clock)
    watch = StragglerWatch(clock=clock, book=book, factor=1.5, reports=3)

    def report(step: int, epoch: int, slow: float) -> StragglerVerdict:
        folded = [
            book.update("node-1", _status(r, step, step_time_last_s=slow if r == 3 else 1.0, restart_epoch=epoch))
            for r in range(4)
        ]
        return watch.judge(*folded[3])

    assert [report(step, 0, 2.0) for step in (1, 2)] == [StragglerVerdict.SLOW] * 2
    verdicts = [report(step, 1, 2.0) for step in (1, 2, 3)]  # relaunched from step 0, still slow
    assert verdicts == [StragglerVerdict.SLOW, StragglerVerdict.SLOW, StragglerVerdict.STRAGGLER]
    verdicts = [report(step, 2, 2.0) for step in (1, 2, 3)]  # reported in launch 1; relaunched again, still slow
    assert verdicts == [StragglerVerdict.SLOW, StragglerVerdict.SLOW, StragglerVerdict.STRAGGLER]


def test_a_nodes_ranks_fold_in_one_pass_while_each_status_is_of_its_track() -> None:
    """A report's ranks are folded into the tracks its node's last report went to, in one pass: it stops at the first
    status of another rank (the node lists other ranks now), and returns the ranks whose speed needs judging."""
    clock = ManualClock(T0)
    book = ProgressBook(clock)
    tracks = [book.update("node-1", _status(rank, 1, step_time_last_s=1.0))[1] for rank in range(4)]
    job = book.jobs["job-a"]
    updates = job.updates
    clock.advance(1.0)
    now = clock.monotonic()
    statuses = [_status(rank, 2, step_time_last_s=3.0 if rank == 2 else 1.0) for rank in range(4)]
    folded, to_judge = fold(job, tracks, statuses, now, slow_above=1.5)
    assert (folded, to_judge, job.updates - updates) == (4, [tracks[2]], 4)
    assert [(t.step, t.advanced_at) for t in tracks] == [(2, now)] * 4
    clock.advance(1.0)
    moved = [_status(0, 3), _status(1, 3), _status(9, 3), _status(3, 3)]  # rank 9 in rank 2's place
    folded, _ = fold(job, tracks, moved, clock.monotonic())
    assert folded == 2
    assert [t.step for t in tracks] == [3, 3, 2, 2]  # the rest is left for a lookup


def test_too_few_ranks_to_compare_is_unknown() -> None:
    clock = ManualClock(T0)
    book = ProgressBook(clock)
    watch = StragglerWatch(clock=clock, book=book, factor=1.5, reports=1)
    book.update("node-1", _status(0, 1, step_time_last_s=1.0))
    assert watch.judge(*book.update("node-1", _status(1, 1, step_time_last_s=9.0))) is StragglerVerdict.UNKNOWN


# --- root-cause order ---------------------------------------------------------------------------------------------
def _cls(category: Category, root: bool = True) -> Classification:
    return Classification(category, Severity.CRITICAL, RecommendedAction.RESTART_JOB, root, "r")


def _incident(category: Category, at: datetime) -> Incident:
    return Incident(
        job_id="j",
        category=category,
        severity=Severity.CRITICAL,
        root_cause="r",
        recommended_action=RecommendedAction.RESTART_JOB,
        first_symptom_at=at,
        root_cause_at=at,
        opened_at=at,
        updated_at=at,
    )


HW, NODE, APP, DEP, UNK = (
    Category.GPU_HARDWARE,
    Category.NODE,
    Category.APPLICATION,
    Category.DEPENDENCY,
    Category.UNKNOWN,
)
EARLY, LATE = T0, T0 + timedelta(seconds=2)
# new symptom (category, root-cause-grade, time), active incident (category, root time) or None, decision
DECIDE_TABLE = [
    ((APP, True, LATE), None, Decision.OPEN),
    ((APP, False, LATE), None, Decision.RECORD),
    ((APP, False, LATE), (APP, EARLY), Decision.SUPPRESS),
    ((HW, False, LATE), (APP, EARLY), Decision.SUPPRESS),  # a follow-on XID never leads
    ((HW, True, LATE), (NODE, EARLY), Decision.UPGRADE),  # hardware outranks node loss
    ((NODE, True, LATE), (APP, EARLY), Decision.UPGRADE),  # node loss outranks a crash
    ((APP, True, LATE), (NODE, EARLY), Decision.ATTACH),
    ((NODE, True, LATE), (HW, EARLY), Decision.ATTACH),
    ((APP, True, LATE), (APP, EARLY), Decision.ATTACH),  # the later crash of the same tier
    ((APP, True, EARLY), (APP, LATE), Decision.UPGRADE),  # the earliest crash leads, whatever the arrival order
    ((UNK, True, EARLY), (APP, LATE), Decision.UPGRADE),  # SIGKILL (unknown) and exit 1 are one tier
    ((DEP, True, LATE), (APP, EARLY), Decision.UPGRADE),
]


@pytest.mark.parametrize(("symptom", "active", "decision"), DECIDE_TABLE)
def test_root_cause_order(
    symptom: tuple[Category, bool, datetime], active: tuple[Category, datetime] | None, decision: Decision
) -> None:
    category, root, at = symptom
    incident = _incident(*active) if active else None
    assert decide(_cls(category, root), at, incident) is decision


# --- reputation ---------------------------------------------------------------------------------------------------
def _fault(event: str, job: str, hours: float, xid: int | None = 48) -> NodeFaultBase:
    return NodeFaultBase(
        node_id="node-1",
        event_id=event,
        job_key=job,
        kind="gpu.xid",
        xid=xid,
        category=Category.GPU_HARDWARE,
        time=T0 + timedelta(hours=hours),
    )


RULES = ReputationRules(xid=48, xid_count=2, jobs=3, window_s=86400)
# faults, reasons that fire at the last fault's time
REPUTATION_TABLE = [
    ([_fault("e1", "a", 0)], []),
    ([_fault("e1", "a", 0), _fault("e2", "a", 23)], [QuarantineReason.REPEATED_XID]),
    ([_fault("e1", "a", 0), _fault("e2", "a", 25)], []),  # more than 24 h apart
    ([_fault("e1", "a", 0), _fault("e1", "b", 0)], []),  # one XID seen by two jobs is one XID
    (
        [_fault("e1", "a", 0, 79), _fault("e2", "b", 1, 79), _fault("e3", "c", 2, 79)],
        [QuarantineReason.FAULTS_ACROSS_JOBS],
    ),
    ([_fault("e1", "a", 0, 79), _fault("e2", "a", 1, 79), _fault("e3", "b", 2, 79)], []),
    (
        [_fault("e1", "a", 0), _fault("e2", "b", 1), _fault("e3", "c", 2, 79)],
        [QuarantineReason.REPEATED_XID, QuarantineReason.FAULTS_ACROSS_JOBS],
    ),
]


@pytest.mark.parametrize(("faults", "reasons"), REPUTATION_TABLE)
def test_reputation_rules(faults: list[NodeFaultBase], reasons: list[QuarantineReason]) -> None:
    now = max(f.time for f in faults)
    assert [j.reason for j in judge(faults, RULES, now=now)] == reasons


# --- partitions ---------------------------------------------------------------------------------------------------
def test_every_job_has_exactly_one_owner_and_the_split_is_fair() -> None:
    parts = [Partition(i, 2) for i in range(2)]
    jobs = [f"job-{n}" for n in range(1000)]
    owners = [[p.index for p in parts if p.owns_job(j)] for j in jobs]
    assert all(len(o) == 1 for o in owners)
    share = sum(o == [0] for o in owners) / len(jobs)
    assert 0.4 < share < 0.6
    assert partition_of("job-7", 2) == partition_of("job-7", 2)
    assert Partition().durable("detector-events") == "detector-events"
    assert parts[1].durable("detector-events") == "detector-events-p1of2"


def test_a_placement_prunes_the_ranks_of_its_own_job_only() -> None:
    """A relaunch that moves or drops ranks prunes them from the book; the jobs whose placement did not change are not
    passed over (their ranks are all placed: reports add only placed ranks), so a placement costs the ranks of its
    job, not every rank tracked."""

    def placement(job_id: str, epoch: int, ranks: dict[int, str], *, active: bool = True) -> JobPlacement:
        assigned = [RankAssignment(rank=r, node_id=node, gpu=0, local_rank=0) for r, node in ranks.items()]
        return JobPlacement(
            source="test", job_id=job_id, restart_epoch=epoch, world_size=len(ranks), ranks=assigned, active=active
        )

    clock = ManualClock(T0)
    book = ProgressBook(clock)
    placements = PlacementMap()
    watcher = Watcher(
        detector=None, placements=placements, partition=None, liveness=None, book=book,  # type: ignore[arg-type]
        hangs=None, stragglers=None, engine=None, clock=clock, hang_check_interval_s=1.0,  # type: ignore[arg-type]
    )  # fmt: skip
    placements.apply(placement("job-a", 0, {0: "node-1", 1: "node-1"}))
    placements.apply(placement("job-b", 0, {0: "node-2"}))
    placements.apply(placement("job-c", 0, {0: "node-3"}))

    def status(job_id: str, rank: int) -> RankStatus:
        return RankStatus(job_id=job_id, rank=rank, step=5, phase="training", heartbeat_age_s=0.0)

    for node, job_id, rank in [
        ("node-1", "job-a", 0),
        ("node-1", "job-a", 1),
        ("node-2", "job-b", 0),
        ("node-3", "job-c", 0),
    ]:
        book.update(node, status(job_id, rank))
    watcher._prune()  # the placements above: every rank tracked is placed
    assert {job: set(track.ranks) for job, track in book.jobs.items()} == {"job-a": {0, 1}, "job-b": {0}, "job-c": {0}}
    # job-b's track of a rank it no longer has would go only with a new placement of job-b
    book.update("node-2", status("job-b", 7))
    placements.apply(placement("job-a", 1, {0: "node-1", 1: "node-4"}))  # rank 1 moved
    placements.apply(placement("job-c", 0, {}, active=False))  # job-c ended
    watcher._prune()
    assert {job: set(track.ranks) for job, track in book.jobs.items()} == {"job-a": {0}, "job-b": {0, 7}}
    placements.apply(placement("job-b", 1, {0: "node-2"}))
    watcher._prune()
    assert set(book.jobs["job-b"].ranks) == {0}


def _fleet(clock: ManualClock, ranks: dict[str, list[int]]) -> tuple[Watcher, ProgressBook, HangWatch]:
    """A watch over job-a's ranks on each node (node -> ranks), with real placements, liveness, book and stages."""
    placements = PlacementMap()
    assigned = [RankAssignment(rank=r, node_id=node, gpu=r, local_rank=r) for node, rs in ranks.items() for r in rs]
    placements.apply(
        JobPlacement(source="test", job_id="job-a", restart_epoch=0, world_size=len(assigned), ranks=assigned)
    )
    book = ProgressBook(clock)
    hangs = HangWatch(clock=clock, book=book, defaults=LIMITS)
    watcher = Watcher(
        detector=None, placements=placements, partition=Partition(), liveness=Liveness(clock=clock, lost_after_s=60),  # type: ignore[arg-type]
        book=book, hangs=hangs, stragglers=StragglerWatch(clock=clock, book=book, factor=1.5, reports=5),
        engine=None, clock=clock, hang_check_interval_s=1.0,  # type: ignore[arg-type]
    )  # fmt: skip
    return watcher, book, hangs


def _report(watcher: Watcher, node: str, statuses: list[RankStatus]) -> None:
    report = NodeReport(source=node, node_id=node, gpu_backend="sim", interval_s=1.0, ranks=statuses)
    asyncio.run(watcher.handle_reports({subjects.node_report(node): report.model_dump_json().encode()}))


def test_a_nodes_reports_are_folded_every_few_seconds_and_a_job_is_judged_on_the_latest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reports are folded into the ranks' tracks at most FOLD_EVERY_S apart; the ones between wait (the latest of
    each node) until then or until a close look at the job, which folds them first: a rank that stepped in a
    report not folded yet is not called hung."""
    monkeypatch.setattr(node_reports.random, "random", lambda: 0.99)  # its first fold 3.96 s after its first report
    clock = ManualClock(T0)
    watcher, book, hangs = _fleet(clock, {"node-1": [0, 1]})
    _report(watcher, "node-1", [_status(0, 1), _status(1, 1)])  # a node's first report is folded at once
    tracks = book.jobs["job-a"].ranks
    assert [t.step for t in tracks.values()] == [1, 1]
    for step in (2, 3):  # within FOLD_EVERY_S of the last fold: kept unread
        clock.advance(1.0)
        _report(watcher, "node-1", [_status(0, step), _status(1, step)])
    assert [t.step for t in tracks.values()] == [1, 1]
    clock.advance(LIMITS.floor_s - 2.0 + 0.5)  # 10.5 s after step 1, 8.5 s after step 3
    assert hangs.check() == []  # the close look folded step 3 first
    assert [(t.step, t.advanced_at) for t in tracks.values()] == [(3, 2.0)] * 2
    clock.advance(2.0)  # 10.5 s after step 3
    [hung] = hangs.check()
    assert (hung.step, hung.stalled_s) == (3, 10.5)


@pytest.mark.parametrize("first_fold", [0.0, 0.3, 0.99])
def test_a_node_whose_reports_keep_coming_is_folded_at_most_fold_every_s_apart(
    first_fold: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After its tracks are looked up, a node's first fold comes at a random moment within FOLD_EVERY_S (nodes looked
    up together must not fold together), and then every FOLD_EVERY_S."""
    monkeypatch.setattr(node_reports.random, "random", lambda: first_fold)
    clock = ManualClock(T0)
    watcher, book, _ = _fleet(clock, {"node-1": [0], "node-2": [1]})
    folded = []
    for step in range(1, 26):
        _report(watcher, "node-1", [_status(0, step)])
        if book.jobs["job-a"].ranks[0].step == step:
            folded.append(step - 1)  # seconds after the first report
        clock.advance(1.0)
    first = max(1, math.ceil(first_fold * FOLD_EVERY_S))  # the first report at or after it (one a second)
    assert FOLD_EVERY_S == 8.0
    assert folded == [0, *range(first, 25, 8)]


def test_a_node_with_a_slow_rank_is_folded_again_sooner_so_its_straggler_is_not_reported_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nodes are folded FOLD_EVERY_S (8 s) apart, but one whose rank is in a slow streak FOLD_SLOW_S (4 s) after: the
    straggler is reported at the look after its first slow one, 4 s later, with every report between counted."""
    monkeypatch.setattr(node_reports.random, "random", lambda: 0.0)  # the node's first fold at its second report
    clock = ManualClock(T0)
    watcher, _, _ = _fleet(clock, {"node-1": [0, 1, 2]})

    async def keep(*_args: object) -> None:  # no pipeline here: what the watch finds stays pending
        return None

    monkeypatch.setattr(watcher, "flush", keep)
    reported_at: list[int] = []
    for second in range(30):
        slow = 3.0 if second >= 10 else 1.0  # rank 2 three times the others' step time from the report at 10 s
        _report(watcher, "node-1", [_status(r, second, step_time_last_s=slow if r == 2 else 1.0) for r in (0, 1, 2)])
        reported_at += [second] * len(watcher.pending)
        watcher.pending.clear()
        clock.advance(1.0)
    # Folded at 0 s (its first report), 1 s, 9 s and 17 s (8 s apart); slow at the look at 17 s, so looked at again at
    # 21 s, when its streak reaches 5 reports: reported then, 11 s after its first slow report (at 25 s before).
    assert (FOLD_EVERY_S, FOLD_SLOW_S) == (8.0, 4.0)
    assert reported_at == [21]


def test_a_stopped_rank_is_timed_from_when_its_agent_first_saw_it_stopped() -> None:
    """A status may be folded seconds after an earlier report first showed the stop: the state's age dates it."""
    clock = ManualClock(T0)
    book = ProgressBook(clock)
    _, first = book.update("node-1", _status(0, 5, "eval", proc_state="T", proc_state_age_s=3.0))
    _, track = book.update("node-1", _status(1, 5, "eval", proc_state="S"))
    clock.advance(10.0)
    book.update("node-1", _status(1, 5, "eval", proc_state="T", proc_state_age_s=2.5))
    assert (first.stopped_since, track.stopped_since) == (-3.0, 7.5)
    book.update("node-1", _status(1, 5, "eval", proc_state="T"))  # an agent that does not say: still stopped since
    assert track.stopped_since == 7.5


def test_a_step_folded_late_is_timed_from_its_heartbeat_even_without_its_phases_age() -> None:
    """A status may be folded seconds after it arrived: its ages date its step and its phase. One that does not say its
    phase's age was in that phase at its heartbeat at least; its stall does not count from when it was folded."""
    clock = ManualClock(T0)
    book = ProgressBook(clock)

    def status(step: int, heartbeat_age_s: float, phase_age_s: float | None = None) -> RankStatus:
        return RankStatus(job_id="job-a", rank=0, step=step, heartbeat_age_s=heartbeat_age_s, phase_age_s=phase_age_s)

    _, track = book.update("node-1", status(4, 3.0), now=10.0)
    assert limit_for(track, None, LIMITS)[2] == 7.0
    book.update("node-1", status(5, 2.5), now=14.0)  # a new step, folded 2.5 s after its beat
    assert (track.advanced_at, track.phase_since, limit_for(track, None, LIMITS)[2]) == (11.5, 11.5, 11.5)
    book.update("node-1", status(6, 1.0, phase_age_s=30.0), now=20.0)  # an agent that says
    assert (track.advanced_at, track.phase_since) == (19.0, -10.0)


def test_silences_and_stalls_are_judged_as_of_the_reading_of_reports() -> None:
    """While reports wait unread (`lag`: the reading is that far behind), a node is not silent nor a rank stalled for
    that delay; what is called is dated as of the reading."""
    clock = ManualClock(T0)
    lag = [0.0]
    live = Liveness(clock=clock, lost_after_s=5.0)
    book = ProgressBook(clock)
    hangs = HangWatch(clock=clock, book=book, defaults=LIMITS)
    live.lag = hangs.lag = lambda: lag[0]
    live.saw("node-1", "r-1")
    book.update("node-1", _status(0, 10))
    clock.advance(12.0)
    lag[0] = 7.5  # the reports of the last 7.5 s wait
    assert (live.check(), hangs.check()) == ([], [])
    lag[0] = 1.0
    [lost] = live.check()
    assert (lost.silent_s, lost.time) == (11.0, T0 + timedelta(seconds=5.0))
    [hung] = hangs.check()
    assert (hung.stalled_s, hung.time) == (11.0, T0 + timedelta(seconds=LIMITS.floor_s))


def test_a_jobs_median_unknown_at_a_nodes_lookup_is_known_at_its_next_fold(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node's first report is folded rank by rank, and the job's median step time is unknown until three ranks
    have one: it is known from the third (not a round of updates later), so the node's next fold, seconds later,
    compares with it."""
    monkeypatch.setattr(node_reports.random, "random", lambda: 0.0)  # the node's first fold at its next report
    clock = ManualClock(T0)
    watcher, book, _ = _fleet(clock, {"node-1": [0, 1, 2]})

    def statuses(step: int) -> list[RankStatus]:
        return [_status(r, step, step_time_last_s=3.0 if r == 2 else 1.0) for r in range(3)]

    _report(watcher, "node-1", statuses(1))
    assert book.jobs["job-a"].ranks[2].slow_streak == 1  # judged against the median of the three
    clock.advance(1.0)
    _report(watcher, "node-1", statuses(2))
    assert book.jobs["job-a"].ranks[2].slow_streak == 2


def test_the_median_of_a_job_without_step_times_is_recomputed_once_a_round() -> None:
    """A job whose ranks report no step time (no SDK) has no median: it is recomputed once per round of statuses,
    not at every look (a pass over every rank of the job each time), and as soon as three ranks have a step time."""
    clock = ManualClock(T0)
    book = ProgressBook(clock)
    watch = StragglerWatch(clock=clock, book=book, factor=1.5, reports=5)
    recomputed = 0
    for step in range(3):  # three rounds of 64 ranks, each rank looked at as it is folded
        for rank in range(64):
            job, _ = book.update("node-1", _status(rank, step))
            due = stragglers._median_due(job)
            assert watch.slow_above(job) is None
            recomputed += due
    assert recomputed <= 4
    for rank in range(3):
        job, _ = book.update("node-1", _status(rank, 3, step_time_last_s=1.0))
    assert watch.slow_above(job) == 1.5  # three ranks with a step time: known at once, not a round later
