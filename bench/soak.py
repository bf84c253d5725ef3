"""The soak (`make soak`, not in CI): the whole local platform for a long time under a random fault every interval.

Real processes: NATS, Redis, every service, one agent per node, JOBS one-rank jobs of the ticker workload. Every
EVERY seconds one fault, drawn with a fixed seed: a rank killed, a rank frozen (SIGSTOP: a hang), an XID 79, a node
lost (its agent and ranks killed), or one of the platform's own processes killed with SIGKILL (NATS, Redis, the
detector, the orchestrator, the registry, the notifier), which the stack's supervisor restarts. A node hit by an XID
or lost is repaired once its job recovered (agent restarted fresh, node uncordoned), so capacity stays.

What must hold, and is counted: every job fault recovered by exactly one recovery; no recovery that no job fault
explains; after a platform fault every service ready again; each service's memory (RSS) flat after warm-up. Writes
bench/results/soak.json.
"""

from __future__ import annotations

import argparse
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

from bench.common import machine_info, rss_kib, write_result
from reprise_cli.client import PlatformClient, poll
from reprise_cli.servers import ManagedProcess, free_stack_ports
from reprise_cli.stack import Stack
from reprise_cli.topology import DEFAULT_PORTS, StackConfig, agent_name
from reprise_common.clock import utcnow
from reprise_common.events import FaultKind, InjectFault

JOB_FAULTS = ("rank kill", "rank hang", "XID 79", "node loss")
PLATFORM_FAULTS = ("nats", "redis", "detector", "orchestrator", "checkpoint-registry", "notifier")
TERMINAL = {"running", "failed", "held"}
CLOCK_SLACK = timedelta(seconds=1)


@dataclass
class FaultRecord:
    """One injected fault and what came of it."""

    kind: str
    at: str  # ISO time of the injection
    target: str  # job id, or the process killed
    node_id: str = ""
    recovered: bool | None = None  # a job fault: its recovery ended with the job running
    recovery_s: float | None = None  # a job fault: injection to the recovery's end
    ready_again_s: float | None = None  # a platform fault: until every service answered /readyz 200
    detail: str = ""


@dataclass
class Soak:
    """A running soak: the stack, its jobs, the faults so far, memory samples."""

    stack: Stack
    client: PlatformClient
    rng: random.Random
    say: Callable[[str], None] = print
    jobs: list[str] = field(default_factory=list)
    faults: list[FaultRecord] = field(default_factory=list)
    memory: dict[str, list[tuple[float, int, int]]] = field(default_factory=dict)  # name -> (t, pid, rss KiB)

    def submit(self, count: int) -> None:
        """Start `count` one-rank jobs of the ticker, with give-up rules wide enough for a soak."""
        policy = {
            "elastic_min_nodes": 1,
            "hang_timeout_s": 3,
            "backoff_initial_s": 0,
            "max_restarts": 1000,
            "max_same_error": 100,
            "max_recoveries_without_progress": 100,
            "max_cordon_share": 1.0,
        }
        for index in range(count):
            spec = {
                "name": f"soak-{index}",
                "node_count": 1,
                "ranks_per_node": 1,
                "command": [sys.executable, "-m", "reprise_cli.workloads.ticker"],
                "policy": policy,
            }
            job = self.client.submit(spec)
            if job["state"] != "running":
                raise RuntimeError(f"soak job {index} did not start: {job['detail']}")
            self.jobs.append(job["id"])

    # --- faults -------------------------------------------------------------------------------------------------
    def one_fault(self) -> FaultRecord:
        """Inject one fault drawn at random and follow it to its end."""
        if self.rng.random() < 0.3:
            return self.platform_fault(self.rng.choice(PLATFORM_FAULTS))
        return self.job_fault(self.rng.choice(JOB_FAULTS), self.rng.choice(self.jobs))

    def job_fault(self, kind: str, job_id: str) -> FaultRecord:
        job = self.client.job(job_id)
        if job["state"] != "running" or not job["placement"]:
            return FaultRecord(kind, utcnow().isoformat(), job_id, detail=f"skipped: job {job['state']}")
        rank = job["placement"][0]
        node_id = rank["node_id"]
        events = {
            "rank kill": InjectFault(kind=FaultKind.RANK_KILL, rank=rank["rank"], job_id=job_id),
            "rank hang": InjectFault(kind=FaultKind.RANK_HANG, rank=rank["rank"], job_id=job_id),
            "XID 79": InjectFault(kind=FaultKind.XID, gpu=rank.get("gpu") or 0, xid=79),
            "node loss": InjectFault(kind=FaultKind.NODE_LOSS, job_id=job_id),
        }
        if kind == "node loss":
            self.stack.hold_node_down(node_id)  # the supervisor must not bring the lost node back by itself
        injected = utcnow()
        reply = self.client.inject(events[kind], node_id=node_id)
        record = FaultRecord(kind, injected.isoformat(), job_id, node_id=node_id, detail=reply.detail)
        if not reply.accepted:
            record.detail = f"refused: {reply.detail}"
            if kind == "node loss":
                self.stack.release_node(node_id)
            return record
        recovery = self._recovery_after(job_id, injected, timeout_s=180)
        if recovery is not None:
            record.recovered = recovery.get("outcome") == "recovered"
            if not record.recovered:
                record.detail = f"{recovery.get('outcome')}: {recovery.get('detail', '')}"
            ended = recovery.get("finished_at")
            if ended:
                record.recovery_s = (datetime.fromisoformat(ended) - injected).total_seconds()
        else:
            record.recovered, record.detail = False, f"no recovery ended within 180 s ({reply.detail})"
        if kind in ("XID 79", "node loss"):
            self._repair(node_id, uncordon=kind == "XID 79")  # a lost node is left out, not cordoned
        return record

    def _recovery_after(self, job_id: str, since: datetime, *, timeout_s: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            mine = [
                r
                for r in self.client.recoveries(job_id)
                if datetime.fromisoformat(r["started_at"]) >= since - CLOCK_SLACK
            ]
            if mine and all(r["step"] in TERMINAL for r in mine):
                return min(mine, key=lambda r: r["started_at"])
            time.sleep(0.5)
        return None

    def _repair(self, node_id: str, *, uncordon: bool) -> None:
        """The node is fixed: a fresh agent (a new simulated GPU), and uncordoned after an XID."""
        self.stack.hold_node_down(node_id)
        self.stack.services[agent_name(node_id)].stop(grace_s=5.0)
        self.stack.release_node(node_id)
        if uncordon:
            self.client.uncordon(node_id)

    def platform_fault(self, name: str) -> FaultRecord:
        process = self._platform_process(name)
        started = time.monotonic()
        record = FaultRecord(f"kill -9 {name}", utcnow().isoformat(), name)
        process.signal(signal.SIGKILL)
        time.sleep(1.0)  # the supervisor notices and restarts it after its backoff
        record.ready_again_s = self._ready_again(timeout_s=120, started=started)
        if record.ready_again_s is None:
            record.detail = "not every service ready again within 120 s"
        return record

    def _platform_process(self, name: str) -> ManagedProcess:
        server = {"nats": self.stack.nats, "redis": self.stack.redis}.get(name)
        process = server.process if server is not None else self.stack.services[name]
        assert process is not None
        return process

    def _ready_again(self, *, timeout_s: float, started: float) -> float | None:
        names = [spec.name for spec in self.stack.specs]
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as http:
            while time.monotonic() < deadline:
                try:
                    if all(http.get(self.stack.url(n) + "/readyz").status_code == 200 for n in names):
                        return time.monotonic() - started
                except httpx.HTTPError:
                    pass
                time.sleep(0.25)
        return None

    # --- memory -------------------------------------------------------------------------------------------------
    def sample_memory(self, now: float) -> None:
        processes = {"nats": self._platform_process("nats"), "redis": self._platform_process("redis")}
        processes.update(self.stack.services)
        for name, process in processes.items():
            if process.proc is None or not process.alive():
                continue
            rss = rss_kib(process.pid)
            if rss is not None:
                self.memory.setdefault(name, []).append((now, process.pid, rss))


def memory_growth(samples: list[tuple[float, int, int]], *, warm_up_s: float) -> dict[str, Any]:
    """RSS after warm-up and at the end of the longest-lived process (a restart starts a new one)."""
    by_pid: dict[int, list[tuple[float, int]]] = {}
    for t, pid, rss in samples:
        by_pid.setdefault(pid, []).append((t, rss))
    pid, run = max(by_pid.items(), key=lambda item: item[1][-1][0] - item[1][0][0])
    warm = [rss for t, rss in run if t - run[0][0] >= warm_up_s] or [run[-1][1]]
    first, last = warm[0], warm[-1]
    return {
        "restarts": len(by_pid) - 1,
        "observed_s": round(run[-1][0] - run[0][0], 1),
        "rss_after_warm_up_mib": round(first / 1024, 1),
        "rss_at_end_mib": round(last / 1024, 1),
        "growth_mib": round((last - first) / 1024, 1),
        "growth_pct": round(100.0 * (last - first) / first, 1) if first else None,
    }


def summarize(soak: Soak, *, started: datetime, warm_up_s: float) -> dict[str, Any]:
    """Per fault kind: count, recovered exactly once, recovery times; unplanned recoveries; memory per service."""
    job_faults = [f for f in soak.faults if f.kind in JOB_FAULTS and not f.detail.startswith(("skipped", "refused"))]
    recoveries = [r for job in soak.jobs for r in soak.client.recoveries(job)]
    explained: set[str] = set()
    once = 0
    times = sorted(soak.faults, key=lambda f: f.at)
    for fault in job_faults:
        at = datetime.fromisoformat(fault.at) - CLOCK_SLACK
        later = [datetime.fromisoformat(f.at) for f in times if f.at > fault.at]
        until = min(later) if later else utcnow()
        mine = [
            r
            for r in recoveries
            if r["job_id"] == fault.target and at <= datetime.fromisoformat(r["started_at"]) < until
        ]
        explained |= {r["id"] for r in mine}
        once += len(mine) == 1 and bool(fault.recovered)
    unplanned = [r for r in recoveries if r["id"] not in explained and r["started_at"] >= started.isoformat()]
    kinds: dict[str, Any] = {}
    for kind in sorted({f.kind for f in soak.faults}):
        mine_faults = [f for f in soak.faults if f.kind == kind]
        durations = [d for f in mine_faults if (d := f.recovery_s or f.ready_again_s) is not None]
        kinds[kind] = {
            "count": len(mine_faults),
            "recovered": sum(1 for f in mine_faults if f.recovered),
            "ready_again": sum(1 for f in mine_faults if f.ready_again_s is not None),
            "median_s": round(statistics.median(durations), 2) if durations else None,
            "max_s": round(max(durations), 2) if durations else None,
        }
    return {
        "faults": len(soak.faults),
        "job_faults": len(job_faults),
        "job_faults_recovered_exactly_once": once,
        "unplanned_recoveries": [(r["id"], r["job_id"], r["step"], r.get("outcome")) for r in unplanned],
        "by_kind": kinds,
        "jobs_running_at_end": sum(1 for j in soak.jobs if soak.client.job(j)["state"] == "running"),
        "memory": {name: memory_growth(s, warm_up_s=warm_up_s) for name, s in sorted(soak.memory.items()) if s},
        "log": [asdict(f) for f in soak.faults],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--jobs", type=int, default=10)
    parser.add_argument("--every", type=float, default=30.0, help="seconds between faults")
    parser.add_argument("--nodes", type=int, default=12)
    parser.add_argument("--spares", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--warm-up", type=float, default=300.0, help="seconds before memory counts as warmed up")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="reprise-soak-"))
    config = StackConfig(
        nodes=args.nodes, spares=args.spares, gpus_per_node=1, state_dir=work / "state",
        ports=free_stack_ports(DEFAULT_PORTS, agents=args.nodes + args.spares),
    )  # fmt: skip
    stack = Stack(config)
    stack.start(timeout_s=180)
    started = utcnow()
    try:
        with closing(stack.client()) as client:
            soak = Soak(stack, client, random.Random(args.seed))  # noqa: S311 - a reproducible draw, not a secret
            every_node = args.nodes + args.spares  # the services are ready before every agent has reported
            poll(client.nodes, lambda nodes: len([n for n in nodes if not n["stale"]]) == every_node, timeout_s=60)
            soak.submit(args.jobs)
            began = time.monotonic()
            deadline = began + args.minutes * 60
            next_fault = began + args.every
            while time.monotonic() < deadline:
                soak.sample_memory(time.monotonic() - began)
                if time.monotonic() >= next_fault:
                    fault = soak.one_fault()
                    soak.faults.append(fault)
                    print(
                        f"[{(time.monotonic() - began) / 60:5.1f} min] {fault.kind:<28} {fault.target:<22} "
                        f"recovered={fault.recovered} recovery_s={fault.recovery_s} "
                        f"ready_again_s={fault.ready_again_s} {fault.detail[:80]}",
                        flush=True,
                    )
                    next_fault = max(next_fault + args.every, time.monotonic() + 5)
                time.sleep(5.0)
            figures = summarize(soak, started=started, warm_up_s=args.warm_up)
    finally:
        stack.stop()
    figures = {"machine": machine_info(), "settings": vars(args), **figures}
    path = write_result("soak", figures)
    print({k: v for k, v in figures.items() if k not in ("log", "machine")})
    print(f"written to {path}")
    ok = figures["job_faults_recovered_exactly_once"] == figures["job_faults"] and not figures["unplanned_recoveries"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
