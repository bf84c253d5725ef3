"""The report load of bench_detector's ingest part, and the bare ceiling its detector rounds are measured against.

Load: node reports (core NATS) at 1 Hz from N simulated nodes (8 ranks each, every rank's step advancing each
second), rendered once per node and published by generator processes that live for the whole part (started once,
so a round does not wait seconds for them to import).

Bare ceiling: one Python process (this one, like the detector in the detector's rounds) that subscribes to the same
reports on a nats-server of its own and does only what every report costs at the least: nats-py hands it over, and
`reprise_common.report_view.read_report` decodes it into the typed structs the detector reads. Its rate at p99
report time → decoded ≤ 100 ms, measured exactly as the detector's (same load, same rates, same window, same
rule), is what this machine allows a Python consumer of reports in that hour; the detector's sustained rate divided
by it is the figure that a slow or busy hour of a shared host does not move.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.common import process_cpu_s
from reprise_cli.servers import NatsServer, free_port
from reprise_common import subjects
from reprise_common.clock import utcnow
from reprise_common.errors import MalformedEventError
from reprise_common.report_view import read_report

RANKS_PER_NODE = 8
SLOTS_PER_S = 100
P99_LIMIT_MS = 100.0
HANDLED_SHARE = 0.95  # a round counts when it handled at least this share of the rate offered (N reports/s)
LEAD_S = 2.5  # from sending the generators their round to its first report
# A round's window begins once the receiver has caught up with the live reports (every report it handled in the last
# CATCH_UP_SPAN_S within the p99 limit), at least a second after the first report (a fresh detector creates every
# node's tracks from its first report, more than a second's work at 40,000 nodes) and at most this long after it;
# `caught_up_after_s` says when (None: it had not caught up).
CATCH_UP_MAX_S = 6.0
CATCH_UP_SPAN_S = 0.5  # caught up: every report handled in the last half second within the limit


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


def node_names(nodes: int) -> list[str]:
    """N nodes in jobs of 64 nodes (512 ranks) each: node `g<job>-<index>`."""
    return [f"g{n // 64}-{n % 64}" for n in range(nodes)]


def template(node: str) -> bytes:
    """A node's report as bytes with %-placeholders for what changes between reports: the time and the step."""
    group, index = node.rsplit("-", 1)
    ranks = [
        {
            "job_id": f"job-{group}",
            "rank": int(index) * RANKS_PER_NODE + g,
            "gpu": g,
            "step": "@S@",
            "phase": "training",
            "heartbeat_age_s": 0.1,
            "step_time_p50_s": 1.0,
            "step_time_p99_s": 1.1,
            "step_time_last_s": 1.0,
        }
        for g in range(RANKS_PER_NODE)
    ]
    body = {
        "type": "node.report",
        "event_id": f"{node}-@S@",
        "time": "@T@",
        "source": node,
        "node_id": node,
        "interval_s": 1.0,
        "gpu_backend": "sim",
        "gpus": [{"index": g, "health": "ok", "temperature_c": 60.0} for g in range(RANKS_PER_NODE)],
        "ranks": ranks,
    }
    text = json.dumps(body).replace("%", "%%").replace('"@S@"', "%(s)d").replace("@S@", "%(s)d")
    return text.replace("@T@", "%(t)s").encode()


def _generator(share: int, of: int, rounds: Any, done: Any, *, offered: Any, until: Any) -> None:
    """A load generator process: for each round it is sent (url, nodes, seconds, start_at), its share of the nodes
    reports once a second for `seconds` (or until the wall time `until` holds, when set), spread over 100 slots a
    second; None ends it.

    Payloads are rendered once per node; per report only the time and the step are filled in. A slot's reports are
    published without waiting on each (core NATS: the client writes them out together); `offered` counts them.
    """
    import nats  # noqa: PLC0415 - only in the child

    async def run(url: str, nodes: int, seconds: float, start_at: float) -> None:
        nc = await nats.connect(url, pending_size=64 * 1024 * 1024)
        plan = [(subjects.node_report(node), template(node)) for node in node_names(nodes)[share::of]]
        per_slot = -(-len(plan) // SLOTS_PER_S)
        while time.time() < start_at:
            await asyncio.sleep(0.01)
        step = 0
        while time.time() < min(start_at + seconds, until.value or float("inf")):
            second = time.time()
            step += 1
            for slot, first in enumerate(range(0, len(plan), per_slot)):
                values = {b"t": datetime.now(UTC).isoformat().encode(), b"s": step}
                for subject, payload in plan[first : first + per_slot]:
                    await nc.publish(subject, payload % values)
                with offered.get_lock():
                    offered.value += min(per_slot, len(plan) - first)
                await asyncio.sleep(max(0.0, second + (slot + 1) / SLOTS_PER_S - time.time()))
            await asyncio.sleep(max(0.0, second + 1 - time.time()))
        await nc.drain()

    done.put(share)  # imported: ready for rounds
    while (job := rounds.get()) is not None:
        asyncio.run(run(*job))
        done.put(share)


class Load:
    """The generator processes, started once for all rounds; each round is sent to them and awaited."""

    def __init__(self, generators: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.offered = ctx.Value("q", 0)
        self.until = ctx.Value("d", 0.0)  # when set, the wall time the round ends early (its window has ended)
        self._done = ctx.Queue()
        self._rounds = [ctx.Queue() for _ in range(generators)]
        self.procs = [
            ctx.Process(
                target=_generator,
                args=(i, generators, q, self._done),
                kwargs={"offered": self.offered, "until": self.until},
                daemon=True,
            )
            for i, q in enumerate(self._rounds)
        ]

    @property
    def pids(self) -> list[int]:
        """The generators' process ids."""
        return [proc.pid for proc in self.procs if proc.pid is not None]

    async def start(self) -> None:
        """Spawn the generators, and wait until they are ready (they import for a few seconds)."""
        for proc in self.procs:
            proc.start()
        await self.wait()

    def send(self, url: str, nodes: int, seconds: float) -> float:
        """Start a round of N nodes reporting to `url` for `seconds`; returns the wall time its first report is due."""
        start_at = time.time() + LEAD_S
        self.until.value = 0.0
        for queue in self._rounds:
            queue.put((url, nodes, seconds, start_at))
        return start_at

    async def wait(self, timeout: float = 60.0) -> None:
        """Until every generator finished its round (or, after start(), its imports)."""
        for _ in self._rounds:
            await asyncio.to_thread(self._done.get, True, timeout)

    def stop(self) -> None:
        """End the generators."""
        for queue in self._rounds:
            queue.put(None)
        for proc in self.procs:
            proc.join(10)


def cpu_s(pids: dict[str, list[int]]) -> dict[str, float]:
    """CPU seconds used so far by each group of processes."""
    return {name: sum(process_cpu_s(pid) for pid in group) for name, group in pids.items()}


async def bare_round(root: Path, load: Load, nodes: int, seconds: float) -> dict[str, Any]:
    """One round of the bare ceiling: the round's reports received from a nats-server of its own and decoded, nothing
    else; the same figures as a detector round (report time → decoded instead of → decided)."""
    import nats  # noqa: PLC0415 - the one place the bench talks to NATS without the project's Bus

    server = NatsServer(free_port(), free_port(), root / f"bare-nats-{nodes}", root / f"bare-nats-{nodes}.log")
    await asyncio.to_thread(server.start)
    received, malformed = [0], [0]
    lags: list[float] = []
    window_lags: list[float] = []  # those of the measured window
    span = max(1, round(nodes * CATCH_UP_SPAN_S))  # the reports of the last CATCH_UP_SPAN_S, at 1 Hz from each node

    async def decode(msg: Any) -> None:
        try:
            report = read_report(msg.data)
        except MalformedEventError:
            malformed[0] += 1
            return
        received[0] += 1
        lags.append((utcnow() - report.time).total_seconds())

    nc = await nats.connect(server.url)
    try:
        # The same pending limits as the detector's report subscription (reprise_common.follow).
        await nc.subscribe(subjects.AGENT_REPORTS, cb=decode, pending_msgs_limit=200_000, pending_bytes_limit=512 << 20)
        await nc.flush()
        window = await measure_window(
            load,
            server.url,
            nodes,
            seconds,
            handled=lambda: received[0],
            lag_now=lambda: max(lags[-span:]) if len(lags) >= span else None,
            begin=lags.clear,
            end=lambda: window_lags.extend(lags),
            pids={
                "receiver": [os.getpid()],
                "nats_server": [server.process.pid] if server.process else [],
                "generators": load.pids,
            },
        )
        return window | {"report_to_decoded": summary_ms(window_lags), "malformed": malformed[0]}
    finally:
        await nc.close()
        await asyncio.to_thread(server.stop)


async def measure_window(
    load: Load,
    url: str,
    nodes: int,
    seconds: float,
    *,
    handled: Callable[[], int],
    lag_now: Callable[[], float | None],
    begin: Callable[[], None],
    end: Callable[[], None],
    pids: dict[str, list[int]],
) -> dict[str, Any]:
    """Run a round of N nodes reporting to `url`, and measure its window of `seconds`, which `begin` and `end` are
    called at (it begins once the receiver caught up: CATCH_UP_MAX_S); the figures every round has, the receiver's
    named by the first of `pids`."""
    load_before = os.getloadavg()[0]  # the machine is shared: what else ran shows here
    start_at = load.send(url, nodes, CATCH_UP_MAX_S + seconds + 1.0)
    await asyncio.sleep(max(0.0, start_at - time.time()) + 1.0)
    while ((lag := lag_now()) is None or lag * 1000 > P99_LIMIT_MS) and time.time() < start_at + CATCH_UP_MAX_S:
        # `lag_now`: the worst lag of the reports handled in the last CATCH_UP_SPAN_S
        await asyncio.sleep(0.05)
    caught_up_after = time.time() - start_at
    begin()
    seen1, offered1, t1, cpu1 = handled(), load.offered.value, time.monotonic(), cpu_s(pids)
    await asyncio.sleep(seconds)
    seen2, offered2, t2, cpu2 = handled(), load.offered.value, time.monotonic(), cpu_s(pids)
    end()
    load.until.value = time.time()
    load_during = os.getloadavg()[0]
    await load.wait()
    receiver = next(iter(pids))
    return {
        "nodes": nodes,
        "offered_reports_per_s": round((offered2 - offered1) / (t2 - t1)),
        "handled_reports_per_s": round((seen2 - seen1) / (t2 - t1)),
        "caught_up_after_s": round(caught_up_after, 2) if caught_up_after < CATCH_UP_MAX_S else None,
        "cpu_pct_of_one_core": {name: round(100 * (cpu2[name] - cpu1[name]) / (t2 - t1)) for name in pids},
        f"{receiver}_cpu_us_per_report": round((cpu2[receiver] - cpu1[receiver]) / max(1, seen2 - seen1) * 1e6, 1),
        "load_avg_1m_before": round(load_before, 2),
        "load_avg_1m_during": round(load_during, 2),
    }


def passed(result: dict[str, Any], lag_key: str) -> bool:
    """Whether a round kept p99 ≤ 100 ms while handling ≥ 95% of the N reports a second offered."""
    p99_ms: float = result[lag_key]["p99_ms"]
    handled: float = result["handled_reports_per_s"]
    return p99_ms <= P99_LIMIT_MS and handled >= HANDLED_SHARE * result["nodes"]


def sustained(rounds: list[dict[str, Any]], lag_key: str) -> dict[str, Any] | None:
    """The kept round at the highest rate that passed, if any."""
    return max((r for r in rounds if passed(r, lag_key)), key=lambda r: r["nodes"], default=None)
