"""The stack the orchestrator benchmarks run on, and what their scenarios share.

Real nats-server, Redis, the checkpoint registry, one or more orchestrator replicas (sharing the database, Redis and
the registry, as services/orchestrator/tests/test_replicas.py runs them) and the simulated fleet's shards
(bench/orchestrator_fleet.py), as processes. Used by bench/bench_orchestrator.py (one recovery at a time, by fleet
size) and bench/orchestrator_concurrent.py (many jobs faulted at once).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from bench.common import latency_summary, process_cpu_s
from bench.orchestrator_fleet import LaunchAcks, LaunchAcksQuery, acks_subject, shard_of
from reprise_cli.redis_server import RedisServer
from reprise_cli.servers import ManagedProcess, NatsServer, free_port, wait_until
from reprise_cli.topology import ROLE_COMMANDS
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.clock import utcnow
from reprise_common.errors import ConfigError
from reprise_common.events import (
    Category,
    Culprit,
    IncidentChange,
    RecommendedAction,
    RecoveryChange,
    Severity,
    new_id,
    parse_event,
)

REPO = Path(__file__).resolve().parents[1]
FLEET_PROCESSES = 2  # real agents answer at once, each on its machine: the fleet's own queue should not be the figure
SHM = Path("/dev/shm")  # noqa: S108 - a directory of our own is made inside it


def summary_ms(samples_s: list[float]) -> dict[str, float]:
    """Median, p99, max and mean of durations in seconds, in milliseconds (with 100 runs or fewer, p99 is the max)."""
    summary = latency_summary([int(s * 1e9) for s in samples_s])
    return {k.replace("_us", "_ms"): round(v / 1000, 2) if k.endswith("_us") else v for k, v in summary.items()}


def timestamp(iso: str) -> float:
    """Unix time of an ISO 8601 time from the orchestrator's REST answers."""
    return datetime.fromisoformat(iso).timestamp()


class OrchestratorStack:
    """nats-server, Redis, the checkpoint registry, `replicas` orchestrators and the simulated fleet's shards."""

    def __init__(
        self,
        root: Path,
        *,
        nodes: int,
        ranks_per_node: int,
        api_key: str,
        fleet_processes: int = 1,
        replicas: int = 1,
    ) -> None:
        self.root = root
        self.nodes = nodes
        self.ranks_per_node = ranks_per_node
        self.fleet_processes = fleet_processes
        self.api_key = api_key
        self.nats = NatsServer(free_port(), free_port(), root / "nats", root / "logs" / "nats.log")
        self.redis = RedisServer(free_port(), root / "redis", root / "logs" / "redis.log")
        self.registry_port = free_port()
        self.orchestrator_ports = [free_port() for _ in range(replicas)]
        self.processes: list[ManagedProcess] = []
        # The fleet's N fence files are rewritten on every new fence: in memory, as an agent's own disk is not shared.
        self.fleet_state = Path(tempfile.mkdtemp(prefix="fleet-", dir=SHM if SHM.is_dir() else None))

    @property
    def orchestrator_urls(self) -> list[str]:
        """Every replica's REST base URL."""
        return [f"http://127.0.0.1:{port}" for port in self.orchestrator_ports]

    @property
    def orchestrator_url(self) -> str:
        """The first replica's REST base URL."""
        return self.orchestrator_urls[0]

    def _service(self, name: str, role: str, port: int, env: Mapping[str, str]) -> ManagedProcess:
        base = {
            "REPRISE_NATS_URL": self.nats.url,
            "REPRISE_HTTP_HOST": "127.0.0.1",
            "REPRISE_HTTP_PORT": str(port),
            "REPRISE_STATE_DIR": str(self.root / name),
            "REPRISE_LOG_FORMAT": "json",
        }
        command = str(Path(sys.executable).parent / ROLE_COMMANDS[role])
        process = ManagedProcess(name, [command], self.root / "logs" / f"{name}.log", {**base, **env})
        process.start()
        self.processes.append(process)
        return process

    def _orchestrator(self, index: int) -> ManagedProcess:
        # One replica keeps the names the single-replica figures have always had (orchestrator_pct_of_core).
        name = "orchestrator" if index == 0 else f"orchestrator-{index}"
        replica_id = "bench-orchestrator" if len(self.orchestrator_ports) == 1 else f"bench-orchestrator-{index}"
        env = {
            "REPRISE_DATABASE_URL": f"sqlite:///{self.root / 'orchestrator.db'}",
            "REPRISE_REDIS_URL": self.redis.url,
            "REPRISE_REGISTRY_URL": f"http://127.0.0.1:{self.registry_port}",
            "REPRISE_ADMIN_API_KEY": self.api_key,
            "REPRISE_REPLICA_ID": replica_id,
        }
        return self._service(name, "orchestrator", self.orchestrator_ports[index], env)

    def start(self) -> None:
        """Start everything; return once every replica sees every simulated node as placeable."""
        self.nats.start()
        self.redis.start()
        registry = self._service(
            "checkpoint-registry",
            "checkpoint-registry",
            self.registry_port,
            {"REPRISE_DATABASE_URL": f"sqlite:///{self.root / 'registry.db'}"},
        )
        first = self._orchestrator(0)  # alone first: it creates the tables the other replicas then find
        _wait_ready(registry, f"http://127.0.0.1:{self.registry_port}")
        _wait_ready(first, self.orchestrator_url)
        others = [self._orchestrator(index) for index in range(1, len(self.orchestrator_ports))]
        for process, url in zip(others, self.orchestrator_urls[1:], strict=True):
            _wait_ready(process, url)
        for shard in range(self.fleet_processes):
            argv = [sys.executable, "-m", "bench.orchestrator_fleet", "--nats-url", self.nats.url,
                    "--nodes", str(self.nodes), "--state-dir", str(self.fleet_state),
                    "--shards", str(self.fleet_processes), "--shard", str(shard)]  # fmt: skip
            fleet = ManagedProcess(f"fleet-{shard}", argv, self.root / "logs" / f"fleet-{shard}.log", cwd=REPO)
            fleet.start()
            self.processes.append(fleet)
        if not wait_until(self.fleet_placeable, timeout_s=60, interval_s=0.5):
            raise ConfigError(f"the fleet's {self.nodes} nodes did not all become placeable: {fleet.log_tail(5)}")

    def fleet_placeable(self) -> bool:
        """True when every replica holds every simulated node as fresh."""
        for url in self.orchestrator_urls:
            try:
                nodes = httpx.get(f"{url}/v1/nodes", headers=self.headers, timeout=5).json()
            except httpx.HTTPError:
                return False
            if sum(not n["stale"] for n in nodes) < self.nodes:
                return False
        return True

    @property
    def headers(self) -> dict[str, str]:
        """The admin credentials every REST call carries."""
        return {"Authorization": f"Bearer {self.api_key}"}

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds each process has used so far, and the wall clock (monotonic) as `wall`."""
        processes = [*self.processes, *(s.process for s in (self.nats, self.redis) if s.process is not None)]
        used = {p.name: process_cpu_s(p.pid) for p in processes}
        return used | {"wall": time.monotonic()}

    def cpu_share(self, before: dict[str, float]) -> dict[str, float]:
        """Each process's share of one core since `before`, and the machine's load: a busy machine slows all."""
        after = self.cpu_s()
        wall = after.pop("wall") - before["wall"]
        shares = {f"{name}_pct_of_core": round(100 * (after[name] - before[name]) / wall, 1) for name in after}
        return shares | {"wall_s": round(wall, 1), "load_avg_1m_after": round(os.getloadavg()[0], 2)}

    def stop(self) -> None:
        """Stop the fleet and the services, then Redis and NATS."""
        for process in reversed(self.processes):
            process.stop(grace_s=10.0)
        self.redis.stop()
        self.nats.stop()
        shutil.rmtree(self.fleet_state, ignore_errors=True)


def _wait_ready(process: ManagedProcess, url: str) -> None:
    def ready() -> bool:
        try:
            return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    if not wait_until(ready, timeout_s=60, interval_s=0.2):
        raise ConfigError(f"{process.name} not ready: {process.log_tail(5)}")


class Recoveries:
    """Waits for a job's recovery to end, from the recovery changes the orchestrator publishes."""

    def __init__(self) -> None:
        self._ended: dict[str, asyncio.Future[RecoveryChange]] = {}

    async def start(self, bus: Bus) -> None:
        """Follow every recovery change."""

        async def on_change(msg: Any) -> None:
            event = parse_event(msg.data)
            if isinstance(event, RecoveryChange) and event.change in ("succeeded", "failed"):
                future = self._ended.get(event.job_id)
                if future is not None and not future.done():
                    future.set_result(event)

        await bus.nc.subscribe(subjects.RECOVERIES_ALL, cb=on_change)

    def expect(self, job_id: str) -> asyncio.Future[RecoveryChange]:
        """A future for the end of the job's next recovery (register before publishing the incident)."""
        future: asyncio.Future[RecoveryChange] = asyncio.get_running_loop().create_future()
        self._ended[job_id] = future
        return future


def incident_for(job: dict[str, Any]) -> IncidentChange:
    """An opened incident for a job, naming its first rank (application, critical, restart the job), timed now."""
    culprit = job["placement"][0]
    now = utcnow()
    return IncidentChange(
        source="bench",
        change="opened",
        incident_id=f"inc-{new_id()[:12]}",
        job_id=job["id"],
        category=Category.APPLICATION,
        severity=Severity.CRITICAL,
        root_cause=f"rank {culprit['rank']} failed: exit code 1 (benchmark)",
        culprit=Culprit(node_id=culprit["node_id"], gpu=culprit.get("gpu"), rank=culprit["rank"]),
        recommended_action=RecommendedAction.RESTART_JOB,
        first_symptom_at=now,
        time=now,
    )


async def launch_acks(
    stack: OrchestratorStack,
    bus: Bus,
    *,
    job_id: str,
    restart_epoch: int,
    node_ids: list[str],
    timeout_s: float = 60.0,
) -> LaunchAcks:
    """When each of `node_ids` acknowledged the launch, and every node's executed launches of the job, from every
    shard of the fleet (each waits up to `timeout_s` for its share of `node_ids`)."""

    async def ask(shard: int) -> LaunchAcks:
        nodes = sum(shard_of(node, shards=stack.fleet_processes) == shard for node in node_ids)
        query = LaunchAcksQuery(job_id=job_id, restart_epoch=restart_epoch, nodes=nodes, timeout_s=timeout_s)
        return await bus.request(acks_subject(shard), query, LaunchAcks, timeout=query.timeout_s + 5)

    answers = await asyncio.gather(*(ask(shard) for shard in range(stack.fleet_processes)))
    return LaunchAcks(
        job_id=job_id,
        restart_epoch=restart_epoch,
        acked_at={node: at for answer in answers for node, at in answer.acked_at.items()},
        complete=all(answer.complete for answer in answers),
        launches={node: epochs for answer in answers for node, epochs in answer.launches.items()},
    )
