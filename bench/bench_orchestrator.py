"""The orchestrator's recovery speed with a simulated fleet: real nats-server, Redis, checkpoint registry and
orchestrator processes, and processes simulating N agents (bench/orchestrator_fleet.py, the agent's real CommandBook,
no rank processes; ``--fleet-processes``, default 2, split the nodes between them: real agents answer a command at
the same time, a single simulating process one after the other).

Run from the repository root: ``make bench-orchestrator`` (or ``.venv/bin/python -m bench.bench_orchestrator``;
``--quick`` for a smoke run). Per fleet size N (16, 256, 2,048 nodes; a fresh job of N nodes per iteration), prints
the figures and saves bench/results/orchestrator.json:

  incident_to_launch_acked_<N>_nodes   an opened incident published → the last node's answer to its launch
                                       command (timestamped in the fleet); median and p99; target p99 ≤ 1 s at 2,048
  incident_to_running_<N>_nodes        the same incident → the recovery's finished_at (its `running` step)
  recovery_steps_<N>_nodes             each recovery step's duration (from GET /v1/jobs/{id}/recoveries start/end)
                                       and its mean share of incident → running
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from bench.common import latency_summary, write_result
from bench.orchestrator_fleet import LaunchAcks, LaunchAcksQuery, acks_subject, shard_nodes
from reprise_cli.servers import ManagedProcess, NatsServer, RedisServer, free_port, wait_until
from reprise_cli.topology import ROLE_COMMANDS
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.clock import utcnow
from reprise_common.errors import BusError, ConfigError
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
RECOVERY_TIMEOUT_S = 120.0
MAX_FAILED_IN_A_ROW = 3
FLEET_PROCESSES = 2  # real agents answer at once, each on its machine: the fleet's own queue should not be the figure
SHM = Path("/dev/shm")  # noqa: S108 - a directory of our own is made inside it


def summary_ms(samples_s: list[float]) -> dict[str, float]:
    """Median, p99, max and mean of durations in seconds, in milliseconds (with 100 runs or fewer, p99 is the max)."""
    summary = latency_summary([int(s * 1e9) for s in samples_s])
    return {k.replace("_us", "_ms"): round(v / 1000, 2) if k.endswith("_us") else v for k, v in summary.items()}


class OrchestratorStack:
    """nats-server, Redis, the checkpoint registry, one orchestrator and the simulated fleet's shards, as processes."""

    def __init__(self, root: Path, *, nodes: int, ranks_per_node: int, api_key: str, fleet_processes: int = 1) -> None:
        self.root = root
        self.nodes = nodes
        self.ranks_per_node = ranks_per_node
        self.fleet_processes = fleet_processes
        self.api_key = api_key
        self.nats = NatsServer(free_port(), free_port(), root / "nats", root / "logs" / "nats.log")
        self.redis = RedisServer(free_port(), root / "redis", root / "logs" / "redis.log")
        self.registry_port, self.orchestrator_port = free_port(), free_port()
        self.processes: list[ManagedProcess] = []
        # The fleet's N fence files are rewritten on every new fence: in memory, as an agent's own disk is not shared.
        self.fleet_state = Path(tempfile.mkdtemp(prefix="fleet-", dir=SHM if SHM.is_dir() else None))

    @property
    def orchestrator_url(self) -> str:
        """The orchestrator's REST base URL."""
        return f"http://127.0.0.1:{self.orchestrator_port}"

    def _service(self, role: str, port: int, env: Mapping[str, str]) -> ManagedProcess:
        base = {
            "REPRISE_NATS_URL": self.nats.url,
            "REPRISE_HTTP_HOST": "127.0.0.1",
            "REPRISE_HTTP_PORT": str(port),
            "REPRISE_STATE_DIR": str(self.root / role),
            "REPRISE_LOG_FORMAT": "json",
        }
        command = str(Path(sys.executable).parent / ROLE_COMMANDS[role])
        process = ManagedProcess(role, [command], self.root / "logs" / f"{role}.log", {**base, **env})
        process.start()
        self.processes.append(process)
        return process

    def start(self) -> None:
        """Start everything; return once the orchestrator sees every simulated node as placeable."""
        self.nats.start()
        self.redis.start()
        registry = self._service(
            "checkpoint-registry",
            self.registry_port,
            {"REPRISE_DATABASE_URL": f"sqlite:///{self.root / 'registry.db'}"},
        )
        orchestrator = self._service(
            "orchestrator",
            self.orchestrator_port,
            {
                "REPRISE_DATABASE_URL": f"sqlite:///{self.root / 'orchestrator.db'}",
                "REPRISE_REDIS_URL": self.redis.url,
                "REPRISE_REGISTRY_URL": f"http://127.0.0.1:{self.registry_port}",
                "REPRISE_ADMIN_API_KEY": self.api_key,
                "REPRISE_REPLICA_ID": "bench-orchestrator",
            },
        )
        _wait_ready(registry, f"http://127.0.0.1:{self.registry_port}")
        _wait_ready(orchestrator, self.orchestrator_url)
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
        """True when the orchestrator holds every simulated node as fresh."""
        try:
            nodes = httpx.get(f"{self.orchestrator_url}/v1/nodes", headers=self.headers, timeout=5).json()
        except httpx.HTTPError:
            return False
        return sum(not n["stale"] for n in nodes) >= self.nodes

    @property
    def headers(self) -> dict[str, str]:
        """The admin credentials every REST call carries."""
        return {"Authorization": f"Bearer {self.api_key}"}

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds each process has used so far, and the wall clock (monotonic) as `wall`."""
        processes = [*self.processes, *(s.process for s in (self.nats, self.redis) if s.process is not None)]
        used = {p.name: _process_cpu_s(p.pid) for p in processes}
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


def _process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


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


def _incident(job: dict[str, Any]) -> IncidentChange:
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


async def one_recovery(
    stack: OrchestratorStack, bus: Bus, http: httpx.AsyncClient, recoveries: Recoveries
) -> dict[str, Any]:
    """Submit a fresh job, publish an opened incident for it, time the recovery, cancel the job; one sample."""
    body = {"name": "bench", "node_count": stack.nodes, "ranks_per_node": stack.ranks_per_node, "command": ["train"]}
    submitted = time.perf_counter()
    job = (await http.post("/v1/jobs", json=body)).raise_for_status().json()
    submit_s = time.perf_counter() - submitted
    try:
        if job["state"] != "running":
            failed = f"submit failed: job {job['state']} {job.get('detail', '')}".strip()
            return {"submit_s": submit_s, "launch_acked_s": None, "running_s": None, "steps_s": {}, "outcome": failed}
        return await _recover(stack, bus, http, recoveries, job) | {"submit_s": submit_s}
    finally:  # a new job may only use nodes no active job runs on: free them for the next iteration
        (await http.post(f"/v1/jobs/{job['id']}/cancel")).raise_for_status()


async def _recover(
    stack: OrchestratorStack, bus: Bus, http: httpx.AsyncClient, recoveries: Recoveries, job: dict[str, Any]
) -> dict[str, Any]:
    incident = _incident(job)
    ended = recoveries.expect(job["id"])
    await bus.publish(subjects.incident(job["id"], "opened"), incident)
    published = incident.time.timestamp()
    acks = await launch_acks(stack, bus, job_id=job["id"], restart_epoch=job["restart_epoch"] + 1)
    with contextlib.suppress(TimeoutError):  # the event only wakes us early: the record below is what counts
        await asyncio.wait_for(ended, RECOVERY_TIMEOUT_S)
    found = (await http.get(f"/v1/jobs/{job['id']}/recoveries")).raise_for_status().json()["data"]
    if not found:
        raise RuntimeError(f"no recovery of job {job['id']} within {RECOVERY_TIMEOUT_S:g} s of its incident")
    recovery = found[0]
    total_s = _ts(recovery["finished_at"]) - published if recovery["finished_at"] else float("nan")
    steps: dict[str, float] = {}
    for entry in recovery["steps"]:
        if entry.get("ended_at"):
            steps[entry["step"]] = steps.get(entry["step"], 0.0) + _ts(entry["ended_at"]) - _ts(entry["started_at"])
    if recovery["finished_at"]:  # announcing steps, claiming, gaps between records
        steps["(between steps)"] = total_s - sum(steps.values())
    return {
        "launch_acked_s": max(acks.acked_at.values()) - published if acks.complete else None,
        "running_s": total_s if recovery["step"] == "running" else None,
        "steps_s": steps,
        "outcome": f"{recovery['step']}: {recovery['detail'] or 'not finished after the timeout'}",
    }


async def launch_acks(stack: OrchestratorStack, bus: Bus, *, job_id: str, restart_epoch: int) -> LaunchAcks:
    """When each node of the fleet acknowledged the launch, from every shard of the fleet."""

    async def ask(shard: int) -> LaunchAcks:
        nodes = len(shard_nodes(stack.nodes, shard=shard, shards=stack.fleet_processes))
        query = LaunchAcksQuery(job_id=job_id, restart_epoch=restart_epoch, nodes=nodes)
        return await bus.request(acks_subject(shard), query, LaunchAcks, timeout=query.timeout_s + 5)

    answers = await asyncio.gather(*(ask(shard) for shard in range(stack.fleet_processes)))
    acked_at = {node: at for answer in answers for node, at in answer.acked_at.items()}
    complete = all(answer.complete for answer in answers)
    return LaunchAcks(job_id=job_id, restart_epoch=restart_epoch, acked_at=acked_at, complete=complete)


def _ts(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def fleet_figures(nodes: int, samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of one fleet size from its samples."""
    acked = [s["launch_acked_s"] for s in samples if s["launch_acked_s"] is not None]
    running = [s["running_s"] for s in samples if s["running_s"] is not None]
    step_names = list(dict.fromkeys(name for s in samples for name in s["steps_s"]))
    steps: dict[str, Any] = {}
    for name in step_names:
        durations = [s["steps_s"][name] for s in samples if name in s["steps_s"]]
        shares = [s["steps_s"][name] / s["running_s"] for s in samples if name in s["steps_s"] and s["running_s"]]
        steps[name] = summary_ms(durations) | {"share": round(statistics.fmean(shares), 3) if shares else None}
    outcomes: dict[str, int] = {}
    for sample in samples:
        outcomes[sample["outcome"]] = outcomes.get(sample["outcome"], 0) + 1
    return {
        f"incident_to_launch_acked_{nodes}_nodes": summary_ms(acked) | {"missed": len(samples) - len(acked)},
        f"incident_to_running_{nodes}_nodes": summary_ms(running) | {"missed": len(samples) - len(running)},
        f"recovery_steps_{nodes}_nodes": steps,
        f"submit_{nodes}_nodes": summary_ms([s["submit_s"] for s in samples if s["submit_s"] is not None]),
        f"outcomes_{nodes}_nodes": outcomes,
    }


async def measure(stack: OrchestratorStack, *, iterations: int, warmup: int) -> list[dict[str, Any]]:
    """Run warm-up recoveries (not counted), then `iterations` timed ones."""
    bus = Bus(url=stack.nats.url, service="bench-orchestrator")
    await bus.connect(attempts=20)
    recoveries = Recoveries()
    await recoveries.start(bus)
    samples = []
    limits = httpx.Timeout(60.0, connect=5.0)
    async with httpx.AsyncClient(base_url=stack.orchestrator_url, headers=stack.headers, timeout=limits) as http:
        try:
            for index in range(warmup + iterations):
                try:
                    sample = await one_recovery(stack, bus, http, recoveries)
                except (BusError, httpx.HTTPError, TimeoutError, RuntimeError) as exc:  # a lost sample counts too
                    sample = {"submit_s": None, "launch_acked_s": None, "running_s": None, "steps_s": {},
                              "outcome": f"error: {exc!r}"[:300]}  # fmt: skip
                acked, running = _fmt(sample["launch_acked_s"]), _fmt(sample["running_s"])
                label = f"#{index - warmup}" if index >= warmup else "warm-up"
                print(f"  {stack.nodes} nodes {label}: acked {acked}, running {running}", sample["outcome"], flush=True)
                if index >= warmup:
                    samples.append(sample)
                if sample["running_s"] is None:  # an overloaded fleet may have gone stale: wait until it is back
                    await asyncio.to_thread(wait_until, stack.fleet_placeable, timeout_s=30, interval_s=0.5)
                recent = samples[-MAX_FAILED_IN_A_ROW:]
                if len(recent) == MAX_FAILED_IN_A_ROW and all(s["running_s"] is None for s in recent):
                    break  # this size does not work here: the samples so far say how
        finally:
            await bus.close()
    return samples


def _fmt(seconds: float | None) -> str:
    return "missed" if seconds is None else f"{seconds * 1000:.0f} ms"


def run_size(
    nodes: int, *, ranks_per_node: int, iterations: int, warmup: int, api_key: str, fleet_processes: int
) -> dict[str, Any]:
    """One fleet size on a fresh stack: its figures, or the error that stopped it; logs are kept when any failed."""
    root = Path(tempfile.mkdtemp(prefix=f"bench-orchestrator-{nodes}-"))
    stack = OrchestratorStack(
        root, nodes=nodes, ranks_per_node=ranks_per_node, api_key=api_key, fleet_processes=fleet_processes
    )
    try:
        stack.start()
        print(f"{nodes} nodes: stack up, {iterations} recoveries", flush=True)
        before = stack.cpu_s()
        samples = asyncio.run(measure(stack, iterations=iterations, warmup=warmup))
        cpu = stack.cpu_share(before)
    except (RuntimeError, ConfigError, httpx.HTTPError, TimeoutError) as exc:
        print(f"{nodes} nodes: stopped by {exc!r}; the processes' logs are in {root / 'logs'}", flush=True)
        return {f"error_{nodes}_nodes": {"error": repr(exc)[:500]}}
    finally:
        stack.stop()
    if all(s["running_s"] is not None for s in samples):
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"{nodes} nodes: some recoveries failed; the processes' logs are in {root / 'logs'}", flush=True)
    return fleet_figures(nodes, samples) | {f"cpu_{nodes}_nodes": cpu}


def main() -> None:
    """Measure each fleet size on a fresh stack, print and save the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 and 256 nodes, a few iterations: a smoke run")
    parser.add_argument("--nodes", type=int, nargs="*", help="fleet sizes (default 16 256 2048)")
    parser.add_argument("--iterations", type=int, help="timed recoveries per fleet size (default 100, 2,048: 30)")
    parser.add_argument("--ranks-per-node", type=int, default=1, help="ranks (GPUs used) per node (default 1)")
    parser.add_argument(
        "--fleet-processes",
        type=int,
        default=FLEET_PROCESSES,
        help=f"processes simulating the fleet (default {FLEET_PROCESSES})",
    )
    args = parser.parse_args()
    sizes = args.nodes or ([16, 256] if args.quick else [16, 256, 2048])
    figures: dict[str, Any] = {"ranks_per_node": args.ranks_per_node, "fleet_processes": args.fleet_processes}
    api_key = secrets.token_urlsafe(32)
    for nodes in sizes:
        iterations = args.iterations or (5 if args.quick else 30 if nodes >= 2048 else 100)
        warmup = 1 if args.quick else 3
        result = run_size(nodes, ranks_per_node=args.ranks_per_node, iterations=iterations, warmup=warmup,
                          api_key=api_key, fleet_processes=args.fleet_processes)  # fmt: skip
        for key, value in result.items():
            print(key, value, flush=True)
        figures |= result
    figures["targets"] = {"incident_to_launch_acked_2048_nodes.p99_ms": "<= 1000"}
    print("saved", write_result("orchestrator", figures))


if __name__ == "__main__":
    main()
