"""The detector's speed on the local stack: a real nats-server, SQLite, and the real detector app in this process.

Run from the repository root: ``make bench-detector`` (or ``.venv/bin/python -m bench.bench_detector``). Prints the
figures and saves bench/results/detector.json:

  detection_latency_ms     rank.exited published (its event time) → the incident's `opened` change received by a
                           subscriber (published only after the commit); median and p99; target p99 ≤ 300 ms
  ingest                   node reports at 1 Hz from N simulated nodes (8 ranks each), published by separate
                           generator processes; per N: reports/s the detector handled and report time → decision
                           (progress, straggler and liveness state updated) median / p99; target p99 ≤ 100 ms
  ingest_sustained_reports_per_s   the highest rate handled with p99 ≤ 100 ms (target ≥ 20,000)
  storm                    one rank SIGKILLed and 16,383 peers failing with gloo/NCCL errors in one job: incidents
                           opened (must be 1), time to the incident opened, and time until every symptom is
                           committed (target ≤ 2 s), from the first symptom's publish
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import tempfile
import time
from contextlib import AsyncExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlmodel import Session, func, select

from bench.common import write_result
from reprise_cli.servers import NatsServer, free_port
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.clock import utcnow
from reprise_common.events import IncidentChange, JobPlacement, RankAssignment, RankExited, parse_event
from reprise_detector.app import create_app
from reprise_detector.incidents.models import Incident, Symptom
from reprise_detector.runtime import EVENTS_DURABLE, Runtime
from reprise_detector.settings import DetectorSettings

RANKS_PER_NODE = 8
GLOO = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.7]:29500"


def pct(samples: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def summary_ms(samples_s: list[float]) -> dict[str, float]:
    """Median and p99 in milliseconds."""
    return {
        "count": len(samples_s),
        "median_ms": round(statistics.median(samples_s) * 1000, 2) if samples_s else float("nan"),
        "p99_ms": round(pct(samples_s, 0.99) * 1000, 2),
    }


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

    async def events_settled(self, timeout: float = 120.0) -> None:
        assert self.bus is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = await self.bus.js.consumer_info("AGENT", EVENTS_DURABLE)
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
def _generator(url: str, nodes: list[str], seconds: float, start_at: float) -> None:
    """A load generator process: every node reports once a second (spread over the second), for `seconds`."""
    import nats  # noqa: PLC0415 - only in the child

    async def run() -> None:
        nc = await nats.connect(url)
        templates = []
        for node in nodes:
            ranks = [
                {
                    "job_id": f"job-{node.rsplit('-', 1)[0]}",
                    "rank": int(node.rsplit("-", 1)[1]) * RANKS_PER_NODE + g,
                    "gpu": g,
                    "step": "__S__",
                    "phase": "training",
                    "heartbeat_age_s": 0.1,
                    "step_time_p50_s": 1.0,
                    "step_time_p99_s": 1.1,
                    "step_time_last_s": 1.0,
                }
                for g in range(RANKS_PER_NODE)
            ]
            gpus = [{"index": g, "health": "ok", "temperature_c": 60.0} for g in range(RANKS_PER_NODE)]
            body = {
                "type": "node.report",
                "event_id": "__I__",
                "time": "__T__",
                "source": node,
                "node_id": node,
                "interval_s": 1.0,
                "gpu_backend": "sim",
                "gpus": gpus,
                "ranks": ranks,
            }
            text = json.dumps(body).replace('"__S__"', "__S__")
            templates.append((subjects.node_report(node), text))
        while time.time() < start_at:
            await asyncio.sleep(0.01)
        step = 0
        end = start_at + seconds
        per_slot = max(1, len(templates) // 100)  # 100 slots per second
        while time.time() < end:
            second = time.time()
            step += 1
            for index in range(0, len(templates), per_slot):
                now = datetime.now(UTC).isoformat()
                for subject, text in templates[index : index + per_slot]:
                    payload = text.replace("__T__", now).replace("__S__", str(step)).replace("__I__", f"{step}{index}")
                    await nc.publish(subject, payload.encode())
                slot_end = second + (index + per_slot) / len(templates)
                await asyncio.sleep(max(0.0, slot_end - time.time()))
            await nc.flush()
            await asyncio.sleep(max(0.0, second + 1 - time.time()))
        await nc.drain()

    asyncio.run(run())


async def ingest(stack: Stack, nodes: int, seconds: float, generators: int) -> dict[str, Any]:
    assert stack.runtime is not None
    names = [f"g{n // 64}-{n % 64}" for n in range(nodes)]  # jobs of 64 nodes (512 ranks) each
    for group in range(0, nodes, 64):
        await stack.place(f"job-g{group // 64}", names[group : group + 64])
    watcher = stack.runtime.watcher
    watcher.lag_s.clear()
    seen0 = watcher.reports_seen
    start_at = time.time() + 6.0  # spawned generators import for a few seconds
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_generator, args=(stack.nats.url, names[i::generators], seconds, start_at))
        for i in range(generators)
    ]
    for proc in procs:
        proc.start()
    await asyncio.sleep(max(0.0, start_at - time.time()) + 1.0)  # skip the first second (warm-up)
    watcher.lag_s.clear()
    seen1, t1 = watcher.reports_seen, time.monotonic()
    await asyncio.sleep(seconds - 1.5)
    seen2, t2 = watcher.reports_seen, time.monotonic()
    lags = list(watcher.lag_s)
    for proc in procs:
        await asyncio.to_thread(proc.join, 30)
    await asyncio.sleep(1.0)
    for group in range(0, nodes, 64):  # end the jobs so the next round starts clean
        assert stack.bus is not None
        done = JobPlacement(source="bench", job_id=f"job-g{group // 64}", restart_epoch=0, world_size=0, active=False)
        await stack.bus.publish(subjects.placement(f"job-g{group // 64}"), done)
    return {
        "nodes": nodes,
        "offered_reports_per_s": nodes,
        "handled_reports_per_s": round((seen2 - seen1) / (t2 - t1)),
        "total_reports": watcher.reports_seen - seen0,
        "report_to_decision": summary_ms(lags),
    }


# --- storm ----------------------------------------------------------------------------------------------------
async def storm(stack: Stack, ranks: int) -> dict[str, Any]:
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
    engine = stack.runtime.engine

    def count() -> tuple[int, int]:
        with Session(engine) as session:
            incidents = session.exec(select(func.count()).select_from(Incident).where(Incident.job_id == "storm")).one()
            symptoms = session.exec(select(func.count()).select_from(Symptom).where(Symptom.job_id == "storm")).one()
            return int(incidents), int(symptoms)

    start = time.monotonic()
    seen: dict[str, float] = {}

    async def watch() -> None:
        while True:
            incidents, symptoms = await asyncio.to_thread(count)
            if incidents and "opened" not in seen:
                seen["opened"] = time.monotonic()
            seen["incidents"], seen["symptoms"] = incidents, symptoms
            if symptoms >= len(events) or time.monotonic() > start + 120:
                seen["decided"] = time.monotonic()
                return
            await asyncio.sleep(0.02)

    ctx = multiprocessing.get_context("spawn")
    started = ctx.Value("d", 0.0)
    payloads = [(subjects.node_event(e.node_id, e.type), e.to_bytes(), e.event_id) for e in events]
    child = ctx.Process(target=_publish_storm, args=(stack.nats.url, payloads, started))
    child.start()
    while not started.value:
        await asyncio.sleep(0.001)
    start = time.monotonic() - (time.time() - started.value)
    watcher = asyncio.create_task(watch())
    await asyncio.to_thread(child.join, 120)
    sent = len(events)
    published_s = time.monotonic() - start
    await watcher
    return {
        "symptoms": sent,
        "incidents": int(seen["incidents"]),
        "symptoms_committed": int(seen["symptoms"]),
        "publish_all_s": round(published_s, 3),
        "incident_opened_within_s": round(seen.get("opened", float("nan")) - start, 3),
        "all_symptoms_decided_s": round(seen["decided"] - start, 3),
    }


def _publish_storm(url: str, payloads: list[tuple[str, bytes, str]], started: Any) -> None:
    """The storm's publisher, in its own process so it does not share the detector's event loop."""
    import nats  # noqa: PLC0415 - only in the child

    async def run() -> None:
        nc = await nats.connect(url)
        js = nc.jetstream(timeout=30)
        started.value = time.time()
        for chunk in range(0, len(payloads), 512):
            await asyncio.gather(
                *(js.publish(s, d, headers={"Nats-Msg-Id": i}) for s, d, i in payloads[chunk : chunk + 512])
            )
        await nc.drain()

    asyncio.run(run())


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-detector-") as tmp:
        stack = Stack(Path(tmp))
        await stack.start()
        try:
            figures: dict[str, Any] = {}
            figures["detection_latency_ms"] = await detection_latency(stack, args.latency_runs)
            print("detection latency", figures["detection_latency_ms"], flush=True)
            rounds = []
            for nodes in args.nodes:
                result = await ingest(stack, nodes, args.seconds, args.generators)
                print("ingest", result, flush=True)
                rounds.append(result)
            figures["ingest"] = rounds
            good = [
                r["handled_reports_per_s"]
                for r in rounds
                if r["report_to_decision"]["p99_ms"] <= 100 and r["handled_reports_per_s"] >= 0.95 * r["nodes"]
            ]
            figures["ingest_sustained_reports_per_s"] = max(good, default=0)
            figures["storm"] = await storm(stack, args.storm_ranks)
            print("storm", figures["storm"], flush=True)
        finally:
            await stack.stop()
    path = write_result("detector", figures)
    print(f"saved {path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latency-runs", type=int, default=200)
    parser.add_argument("--nodes", type=int, nargs="*", default=[2000, 5000, 10000, 20000])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--generators", type=int, default=4)
    parser.add_argument("--storm-ranks", type=int, default=16384)
    asyncio.run(main(parser.parse_args()))
