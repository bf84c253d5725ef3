"""The detector's speed on the local stack: a real nats-server, SQLite, and the real detector app in this process.

Run from the repository root: ``make bench-detector`` (or ``.venv/bin/python -m bench.bench_detector``). Prints the
figures and saves bench/results/detector.json:

  detection_latency_ms     rank.exited published (its event time) → the incident's `opened` change received by a
                           subscriber (published only after the commit); median and p99; target p99 ≤ 300 ms
  ingest                   node reports (core NATS) at 1 Hz from N simulated nodes (8 ranks each, every rank's
                           step advancing each second), published by separate generator processes from pre-rendered
                           payloads (bench/detector_ingest.py); per N, over a window of ``--seconds`` that begins once
                           the detector has caught up with the first report of every node (`caught_up_after_s`, at
                           most 6 s): reports/s offered and handled, reports superseded or dropped, report time →
                           handled (liveness updated, and the ranks folded into the progress book or kept for the
                           node's next fold, at most 4 s later and before any hang judgement of the job; every report
                           of the window) median / p99 (target ≤ 100 ms), and the 1-minute load average before and
                           during the round
                           (the machine may be shared: generators and nats-server share its cores with the
                           detector); three rounds per N, each on a fresh detector: the round with the median p99 is
                           kept, with every round's p99 and handled rate
  ingest_bare              the bare ceiling at the same N, one round right before the detector's rounds and two
                           right after: this process receiving the same reports from a nats-server of its own and
                           decoding each into the typed structs the detector reads, nothing else (report time →
                           decoded); the round with the median p99 is kept, as for the detector
  ingest_sustained_reports_per_s, ingest_bare_ceiling_reports_per_s, ingest_ratio
                           the rate handled at the highest N whose kept round handled ≥ 95% of N with p99 ≤ 100 ms,
                           for the detector and for the bare receiver, and the first divided by the second (target
                           ≥ 0.6): a slow hour of a shared host lowers both; `ingest_load_avg_1m` says how busy it
                           was. The rates rise until both series have failed two in a row.
  storm                    one rank SIGKILLed and 16,383 peers failing with gloo/NCCL errors in one job, published
                           by another process on the stream's subjects with message ids (done when the stream
                           holds them all):
                           incidents opened (must be 1), symptoms committed (counted in SQL afterwards), the time
                           to publish them all, to the incident's `opened` change received, and until the detector
                           has acknowledged every symptom (it does so only after the commit and the publish; target
                           ≤ 2 s), all from the first symptom's publish; the detector process's CPU seconds over
                           that time and the 1-minute load average before and during (the machine may be shared);
                           five storms, each on a fresh detector: the run with the median decision time is kept,
                           with every run's time in `all_symptoms_decided_s_each`
  node_loss                real agent processes on a nats-server with the stack's credentials: agent SIGKILLed →
                           the job's incident opened (median, p99 over ``--kills``, default 30; target median ≤ 1 s),
                           and the incidents opened over ``--restarts`` graceful agent restarts, as many
                           nats-server restarts and as many second-connection closes (0 expected);
                           bench/detector_node_loss.py says how

``--only latency ingest storm node-loss`` runs some parts; their figures replace those of the same name in the saved
results.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlmodel import Session, func, select

from bench.common import RESULTS_DIR, write_result
from bench.detector_ingest import (
    CATCH_UP_SPAN_S,
    P99_LIMIT_MS,
    RANKS_PER_NODE,
    Load,
    bare_round,
    measure_window,
    node_names,
    passed,
    summary_ms,
    sustained,
)
from bench.detector_node_loss import node_loss
from reprise_cli.servers import NatsServer, free_port
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.clock import utcnow
from reprise_common.events import IncidentChange, JobPlacement, RankAssignment, RankExited, parse_event
from reprise_detector.app import create_app
from reprise_detector.incidents.models import Incident, Symptom
from reprise_detector.runtime import EVENTS_DURABLE, Runtime
from reprise_detector.settings import DetectorSettings

PARTS = ("latency", "ingest", "storm", "node-loss")
GLOO = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.7]:29500"


class Stack:
    """nats-server, SQLite and the detector app (with its consumers) in this process."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.nats = NatsServer(free_port(), free_port(), root / "nats", root / "nats.log")
        self.exit = AsyncExitStack()
        self.bus: Bus | None = None
        self.runtime: Runtime | None = None

    async def start(self) -> None:
        await asyncio.to_thread(self.nats.start)
        settings = DetectorSettings(
            nats_url=self.nats.url,
            database_url=f"sqlite:///{self.root / 'detector.db'}",
            log_level="WARNING",
            incident_window_s=60,
        )
        app = create_app(settings)
        await self.exit.enter_async_context(app.router.lifespan_context(app))
        self.runtime = app.state.runtime
        assert self.runtime is not None
        await self.runtime.wait_started(timeout=30)
        self.bus = Bus(url=self.nats.url, service="bench")
        await self.bus.connect(attempts=20)

    async def stop(self) -> None:
        if self.bus is not None:
            await self.bus.close()
        await self.exit.aclose()
        await asyncio.to_thread(self.nats.stop)

    async def place(self, job_id: str, nodes: list[str]) -> None:
        assert self.bus is not None and self.runtime is not None
        ranks = [
            RankAssignment(rank=n * RANKS_PER_NODE + g, node_id=node, gpu=g, local_rank=g)
            for n, node in enumerate(nodes)
            for g in range(RANKS_PER_NODE)
        ]
        placement = JobPlacement(source="bench", job_id=job_id, restart_epoch=0, world_size=len(ranks), ranks=ranks)
        seq = await self.bus.publish(subjects.placement(job_id), placement)
        assert await self.runtime.placements.wait_for_seq(seq, timeout=90)

    def symptoms(self) -> dict[str, int]:
        """The symptoms this detector recorded so far, by kind (a healthy ingest round records none)."""
        assert self.runtime is not None
        with Session(self.runtime.engine) as session:
            rows = session.exec(select(Symptom.kind, func.count()).group_by(Symptom.kind)).all()
        return {kind: count for kind, count in rows}

    async def events_settled(self, timeout: float = 120.0) -> None:
        assert self.bus is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = await self.bus.js.consumer_info(subjects.AGENT_STREAM, EVENTS_DURABLE)
            if not info.num_pending and not info.num_ack_pending:
                return
            await asyncio.sleep(0.05)


# --- detection latency ----------------------------------------------------------------------------------------
async def detection_latency(stack: Stack, runs: int) -> dict[str, Any]:
    assert stack.bus is not None
    opened: dict[str, float] = {}

    async def on_opened(msg: Any) -> None:
        event = parse_event(msg.data)
        assert isinstance(event, IncidentChange)
        opened[event.job_id] = time.time()

    sub = await stack.bus.nc.subscribe(subjects.INCIDENTS_OPENED, cb=on_opened)
    samples: list[float] = []
    for n in range(runs):
        job = f"lat-{n}"
        await stack.place(job, [f"lat-node-{n % 16}"])
        crash = RankExited(source="n", node_id=f"lat-node-{n % 16}", job_id=job, rank=3, signal="SIGKILL")
        await stack.bus.publish(subjects.node_event(f"lat-node-{n % 16}", crash.type), crash)
        deadline = time.monotonic() + 5
        while job not in opened and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        if job in opened:
            samples.append(opened[job] - crash.time.timestamp())
    await sub.unsubscribe()
    return summary_ms(samples) | {"missed": runs - len(samples)}


# --- ingest ---------------------------------------------------------------------------------------------------
def _full_collections(pauses_ms: list[float]) -> Callable[[str, dict[str, Any]], None]:
    """A gc callback that records how long each full collection (generation 2) paused the process."""
    started = [0.0]

    def record(phase: str, info: dict[str, Any]) -> None:
        if info["generation"] == 2:
            if phase == "start":
                started[0] = time.perf_counter()
            else:
                pauses_ms.append(round((time.perf_counter() - started[0]) * 1000, 1))

    return record


async def ingest(stack: Stack, load: Load, nodes: int, seconds: float) -> dict[str, Any]:
    """One detector round: N nodes report for `seconds` to a fresh detector; what it handled, and how late."""
    assert stack.runtime is not None and stack.runtime.reports is not None and stack.bus is not None
    names = node_names(nodes)
    for group in range(0, nodes, 64):
        await stack.place(f"job-g{group // 64}", names[group : group + 64])
    watcher, follower = stack.runtime.watcher, stack.runtime.reports
    seen0, superseded0 = watcher.reports_seen, follower.superseded
    decided: list[tuple[datetime, list[datetime]]] = []  # every batch decided, with its reports' times
    watcher.decided = decided
    pauses_ms: list[float] = []
    record = _full_collections(pauses_ms)

    counts: dict[str, int] = {}  # superseded and dropped at the window's start, then over it

    def begin() -> None:
        decided.clear()
        gc.callbacks.append(record)
        counts["superseded"], counts["dropped"] = follower.superseded, follower.dropped

    def end() -> None:
        gc.callbacks.remove(record)
        watcher.decided = None
        counts["superseded"], counts["dropped"] = (
            follower.superseded - counts["superseded"],
            follower.dropped - counts["dropped"],
        )

    def lag_now() -> float | None:
        """The worst lag of the reports decided in the last CATCH_UP_SPAN_S (None before any)."""
        if not decided:
            return None
        since, worst = decided[-1][0] - timedelta(seconds=CATCH_UP_SPAN_S), 0.0
        for at, times in reversed(decided):
            if at < since:
                break
            if times:
                worst = max(worst, (at - times[0]).total_seconds())  # a batch's first report waited longest
        return worst

    window = await measure_window(
        load,
        stack.nats.url,
        nodes,
        seconds,
        handled=lambda: watcher.reports_seen,
        lag_now=lag_now,
        begin=begin,
        end=end,
        pids={
            "detector": [os.getpid()],
            "nats_server": [stack.nats.process.pid] if stack.nats.process else [],
            "generators": load.pids,
        },
    )
    lags = [(at - time).total_seconds() for at, times in decided for time in times]
    await asyncio.sleep(1.0)
    symptoms = await asyncio.to_thread(stack.symptoms)  # a round whose detector fell behind: did it call anything?
    for group in range(0, nodes, 64):  # end the jobs so the next round starts clean
        done = JobPlacement(source="bench", job_id=f"job-g{group // 64}", restart_epoch=0, world_size=0, active=False)
        await stack.bus.publish(subjects.placement(f"job-g{group // 64}"), done)
    return window | {
        "total_reports": watcher.reports_seen - seen0,
        "superseded": counts["superseded"],  # in the window
        "dropped": counts["dropped"],
        "superseded_before_window": follower.superseded - superseded0 - counts["superseded"],
        "report_to_decision": summary_ms(lags),
        "full_gc_pauses_ms": pauses_ms,
        "symptoms": symptoms,
    }


async def ingest_part(args: argparse.Namespace) -> dict[str, Any]:
    """Rising rates; at each, the bare ceiling's rounds right before and right after the detector's.

    Both series measured alike: `--ingest-runs` rounds a rate (the detector's each on a fresh detector; the bare
    ceiling's one before the detector's and the rest after), the one with the median p99 kept. Each series stops
    after two rates in a row that its kept round failed.
    """
    load = Load(args.generators)
    await load.start()
    detector_rounds: list[dict[str, Any]] = []
    bare_rounds: list[dict[str, Any]] = []
    loads_1m = [os.getloadavg()[0]]
    try:
        with tempfile.TemporaryDirectory(prefix="bench-detector-bare-") as tmp:
            for nodes in args.nodes:
                detector_on = _going(detector_rounds, "report_to_decision")
                bare_on = _going(bare_rounds, "report_to_decoded")
                if not (detector_on or bare_on):
                    break
                bare = [await bare_round(Path(tmp), load, nodes, args.seconds)] if bare_on else []
                if bare:
                    print("bare", bare[-1], flush=True)
                if detector_on:
                    detector_rounds.append(await _detector_rate(load, nodes, args))
                if bare_on:
                    for _ in range(args.ingest_runs - 1):
                        bare.append(await bare_round(Path(tmp), load, nodes, args.seconds))
                        print("bare", bare[-1], flush=True)
                    bare_rounds.append(_median_round(bare, "report_to_decoded"))
                loads_1m.append(os.getloadavg()[0])
    finally:
        load.stop()
    return _ingest_figures(detector_rounds, bare_rounds, loads_1m)


async def _detector_rate(load: Load, nodes: int, args: argparse.Namespace) -> dict[str, Any]:
    """The detector's rounds at one rate, each on a fresh detector; the one with the median p99 is kept."""
    runs = []
    for _ in range(args.ingest_runs):
        runs.append(await on_fresh_stack(lambda s: ingest(s, load, nodes, args.seconds)))
        print("ingest", runs[-1], flush=True)
    return _median_round(runs, "report_to_decision")


def _median_round(runs: list[dict[str, Any]], lag_key: str) -> dict[str, Any]:
    """Of a rate's rounds, the one with the median p99, with every round's p99 and handled rate."""
    p99s = sorted(r[lag_key]["p99_ms"] for r in runs)
    kept = min(runs, key=lambda r: abs(r[lag_key]["p99_ms"] - statistics.median(p99s)))
    handled = sorted(r["handled_reports_per_s"] for r in runs)
    cpu_key = next(key for key in kept if key.endswith("_cpu_us_per_report"))
    cpu = sorted(r[cpu_key] for r in runs)
    return kept | {
        "runs": len(runs),
        "p99_ms_each": p99s,
        "handled_reports_per_s_each": handled,
        f"{cpu_key}_each": cpu,
    }


def _going(rounds: list[dict[str, Any]], lag_key: str) -> bool:
    """Whether a series goes on to the next rate: not after two failed rates in a row (one can be the host's)."""
    return not (len(rounds) >= 2 and not passed(rounds[-1], lag_key) and not passed(rounds[-2], lag_key))


def _ingest_figures(
    detector_rounds: list[dict[str, Any]], bare_rounds: list[dict[str, Any]], loads_1m: list[float]
) -> dict[str, Any]:
    """The rounds, and the sustained rates of both series with their ratio (printed as well)."""
    detector = sustained(detector_rounds, "report_to_decision")
    bare = sustained(bare_rounds, "report_to_decoded")
    rate = detector["handled_reports_per_s"] if detector else 0
    ceiling = bare["handled_reports_per_s"] if bare else 0
    rows = side_by_side(detector_rounds, bare_rounds)
    figures = {
        "ingest": detector_rounds,
        "ingest_bare": bare_rounds,
        "ingest_sustained_reports_per_s": rate,
        "ingest_sustained_nodes": detector["nodes"] if detector else 0,  # reporting at 1 Hz: the rate offered
        "ingest_bare_ceiling_reports_per_s": ceiling,
        "ingest_bare_ceiling_nodes": bare["nodes"] if bare else 0,
        # False: the bare receiver passed the highest rate tried, so the ceiling is higher and the ratio lower
        "ingest_bare_ceiling_reached": bool(bare_rounds) and not passed(bare_rounds[-1], "report_to_decoded"),
        "ingest_ratio": round(rate / ceiling, 3) if ceiling else None,
        "ingest_cpu_side_by_side": rows,
        "ingest_load_avg_1m": {
            "start": round(loads_1m[0], 2),
            "end": round(loads_1m[-1], 2),
            "max": round(max(loads_1m), 2),
        },
    }
    same_rate = next((r for r in rows if detector and r["nodes"] == detector["nodes"]), None)
    if same_rate is not None:
        print(
            f"ingest: CPU a report at {same_rate['nodes']:,} nodes, side by side: detector"
            f" {same_rate['detector_cpu_us_per_report']} µs, bare {same_rate['receiver_cpu_us_per_report']} µs,"
            f" ratio {same_rate['cpu_ratio']}",
            flush=True,
        )
    print(
        f"ingest: bare ceiling {ceiling:,} reports/s"
        f"{'' if figures['ingest_bare_ceiling_reached'] else ' (not reached: higher)'}, detector sustained {rate:,}"
        f" reports/s (p99 <= {P99_LIMIT_MS:.0f} ms), ratio {figures['ingest_ratio']} (target >= 0.6);"
        f" load average 1 min {figures['ingest_load_avg_1m']}",
        flush=True,
    )
    return figures


def side_by_side(detector_rounds: list[dict[str, Any]], bare_rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """At each rate both series passed, the median CPU a report of each receiver over the rate's rounds, and their
    ratio (bare ÷ detector): the rounds of a rate run within minutes, interleaved, so a host whose speed drifts over the
    run moves this figure less than the ratio of the two ceilings, which are reached at different rates and times."""
    bare_at = {r["nodes"]: r for r in bare_rounds if passed(r, "report_to_decoded")}
    rows = []
    for detector in detector_rounds:
        bare = bare_at.get(detector["nodes"])
        if bare is None or not passed(detector, "report_to_decision"):
            continue
        detector_us = statistics.median(detector["detector_cpu_us_per_report_each"])
        bare_us = statistics.median(bare["receiver_cpu_us_per_report_each"])
        rows.append(
            {
                "nodes": detector["nodes"],
                "detector_cpu_us_per_report": detector_us,
                "receiver_cpu_us_per_report": bare_us,
                "cpu_ratio": round(bare_us / detector_us, 3) if detector_us else None,
            }
        )
    return rows


# --- storm ----------------------------------------------------------------------------------------------------
async def storm(stack: Stack, ranks: int) -> dict[str, Any]:
    """Publish the storm from another process; time the `opened` change and the acknowledgement of every symptom.

    The detector acknowledges a message only after its batch committed (and its changes were published), so its
    consumer's count of acknowledged messages tells when every symptom is decided without querying the database
    while it works; the rows are counted once at the end.
    """
    assert stack.bus is not None and stack.runtime is not None
    nodes = [f"storm-{n}" for n in range(ranks // RANKS_PER_NODE)]
    await stack.place("storm", nodes)
    t0 = utcnow()
    events = [
        RankExited(source="n", node_id=nodes[0], job_id="storm", rank=5, signal="SIGKILL", time=t0),
        *(
            RankExited(
                source="n",
                node_id=nodes[r // RANKS_PER_NODE],
                job_id="storm",
                rank=r,
                exit_code=1,
                log_tail=["Traceback (most recent call last):", GLOO],
                time=t0,
            )
            for r in range(ranks)
            if r != 5
        ),
    ]
    [consumer] = [c for c in stack.runtime.consumers if c.durable == EVENTS_DURABLE]
    engine = stack.runtime.engine
    acked_before = consumer.acked
    opened: list[float] = []

    async def on_opened(_msg: Any) -> None:
        opened.append(time.monotonic())

    sub = await stack.bus.nc.subscribe(subjects.incident("storm", "opened"), cb=on_opened)
    load_before = os.getloadavg()[0]
    ctx = multiprocessing.get_context("spawn")
    started, finished = ctx.Value("d", 0.0), ctx.Value("d", 0.0)
    payloads = [(subjects.node_event(e.node_id, e.type), e.to_bytes(), e.event_id) for e in events]
    gc.freeze()  # the storm as this process built it is not the detector's: its collections must not scan it
    child = ctx.Process(target=_publish_storm, args=(stack.nats.url, payloads, started, finished))
    child.start()
    while not started.value:
        await asyncio.sleep(0.001)
    start = time.monotonic() - (time.time() - started.value)
    cpu_before = sum(os.times()[:2])  # every thread of this process: the detector's loop and its database thread
    while consumer.acked - acked_before < len(events) and time.monotonic() < start + 120:
        await asyncio.sleep(0.005)
    decided = time.monotonic()
    cpu_s = sum(os.times()[:2]) - cpu_before
    load_during = os.getloadavg()[0]
    await asyncio.to_thread(child.join, 120)
    await sub.unsubscribe()

    def count() -> tuple[int, int]:
        with Session(engine) as session:
            incidents = session.exec(select(func.count()).select_from(Incident).where(Incident.job_id == "storm")).one()
            symptoms = session.exec(select(func.count()).select_from(Symptom).where(Symptom.job_id == "storm")).one()
            return int(incidents), int(symptoms)

    gc.unfreeze()
    incidents, symptoms = await asyncio.to_thread(count)
    return {
        "symptoms": len(events),
        "incidents": incidents,
        "symptoms_committed": symptoms,
        "publish_all_s": round(finished.value - started.value, 3),
        "incident_opened_within_s": round(min(opened, default=float("nan")) - start, 3),
        "all_symptoms_decided_s": round(decided - start, 3),
        "detector_cpu_s": round(cpu_s, 2),
        "load_avg_1m_before": round(load_before, 2),
        "load_avg_1m_during": round(load_during, 2),
    }


def _publish_storm(url: str, payloads: list[tuple[str, bytes, str]], started: Any, finished: Any) -> None:
    """The storm's publisher, in its own process so it does not share the detector's event loop.

    The symptoms are published on their stream subjects with their message ids, as the agents do, but as core NATS
    publishes written out together (16,384 agents would publish from 2,048 machines, not from this one's cores); the
    stream confirms them: publishing ends when the stream holds them all.
    """
    import nats  # noqa: PLC0415 - only in the child

    async def run() -> None:
        nc = await nats.connect(url)
        js = nc.jetstream(timeout=30)
        stored = (await js.stream_info(subjects.AGENT_STREAM)).state.messages
        started.value = time.time()
        for subject, data, msg_id in payloads:
            await nc.publish(subject, data, headers={"Nats-Msg-Id": msg_id})
        await nc.flush()
        deadline = time.monotonic() + 120
        while (await js.stream_info(subjects.AGENT_STREAM)).state.messages < stored + len(
            payloads
        ) and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        finished.value = time.time()
        await nc.drain()

    asyncio.run(run())


async def on_fresh_stack(measure: Callable[[Stack], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    """One measurement on a detector of its own: nothing left by an earlier one (e.g. thousands of nodes that went
    silent, so lost, after an ingest round) competes with it."""
    with tempfile.TemporaryDirectory(prefix="bench-detector-") as tmp:
        stack = Stack(Path(tmp))
        await stack.start()
        try:
            return await measure(stack)
        finally:
            await stack.stop()


async def main(args: argparse.Namespace) -> None:
    parts = set(args.only or PARTS)
    figures: dict[str, Any] = {}
    if "latency" in parts:
        figures["detection_latency_ms"] = await on_fresh_stack(lambda s: detection_latency(s, args.latency_runs))
        print("detection latency", figures["detection_latency_ms"], flush=True)
    if "ingest" in parts:
        figures |= await ingest_part(args)
    if "storm" in parts:
        runs = []
        for _ in range(args.storm_runs):
            runs.append(await on_fresh_stack(lambda s: storm(s, args.storm_ranks)))
            print("storm", runs[-1], flush=True)
        decided = sorted(r["all_symptoms_decided_s"] for r in runs)
        median_run = min(runs, key=lambda r: abs(r["all_symptoms_decided_s"] - statistics.median(decided)))
        figures["storm"] = median_run | {"runs": len(runs), "all_symptoms_decided_s_each": decided}
    if "node-loss" in parts:
        with tempfile.TemporaryDirectory(prefix="reprise-bench-node-loss-") as tmp:
            figures["node_loss"] = await node_loss(
                Path(tmp), nodes=args.node_loss_nodes, kills=args.kills, restarts=args.restarts
            )
    if args.only:  # a partial run replaces only its own figures in the saved results
        saved = RESULTS_DIR / "detector.json"
        figures = (json.loads(saved.read_text(encoding="utf-8"))["figures"] if saved.exists() else {}) | figures
    path = write_result("detector", figures)
    print(f"saved {path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latency-runs", type=int, default=200)
    parser.add_argument(
        "--nodes",
        type=int,
        nargs="*",
        default=[*range(5000, 60001, 5000), 70000, 80000, 90000, 100000, 120000, 150000],
        help="the rising rates (nodes reporting at 1 Hz); each series stops after two failed rates in a row, so the "
        "bare receiver's go on past the detector's until its own ceiling (it passed 80,000 on a quiet host)",
    )
    parser.add_argument(
        "--ingest-runs",
        type=int,
        default=3,
        help="rounds per rate, each on a fresh detector; the one with the median p99 is kept",
    )
    parser.add_argument("--seconds", type=float, default=7.0, help="the measured window of an ingest round")
    parser.add_argument("--generators", type=int, default=2)
    parser.add_argument("--storm-ranks", type=int, default=16384)
    parser.add_argument("--storm-runs", type=int, default=5, help="storms on fresh detectors; the median is kept")
    parser.add_argument("--node-loss-nodes", type=int, default=4, help="agents of the node-loss part")
    parser.add_argument("--kills", type=int, default=30, help="agents killed in the node-loss part")
    parser.add_argument(
        "--restarts",
        type=int,
        default=30,
        help="graceful agent restarts, nats-server restarts and second-connection closes, each",
    )
    parser.add_argument("--only", nargs="+", choices=PARTS, help="run only these parts (default: all)")
    asyncio.run(main(parser.parse_args()))
