"""The node agent's costs and speed, measured on a real agent process with real ranks and a real nats-server.

Run from the repository root: ``make bench-agent`` (or ``.venv/bin/python -m bench.bench_agent``). Prints the figures
and saves bench/results/agent.json:

  agent_cpu_pct_of_one_core      the whole agent process (8 simulated GPUs, reports every 1 s, NATS) while 8 ranks
                                 heartbeat through the SDK every 10 ms; target ≤ 2 %
  agent_cpu_pct_idle             the same agent with no ranks, for comparison
  sdk_heartbeat_us               reprise_sdk.heartbeat() in a rank talking to that agent (median, p99); target ≤ 5 µs
  sdk_heartbeat_every_call_us    the same with coalescing off (REPRISE_SDK_INTERVAL_S=0): every call sends
  rank_exit_to_event_ms          SIGKILL of a rank → its rank.exited event received by a NATS subscriber (median, p99);
                                 target ≤ 200 ms

``--gpu-backend nvml`` runs the agent on the machine's real GPUs instead (a GPU machine: bench/gpu_check.sh's setup)
and saves bench/results/agent-nvml.json, with what the last report said of the GPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.bench_sdk import HEARTBEAT_LOOP, rank_env, run_child
from bench.common import write_result
from reprise_cli.servers import ManagedProcess, NatsServer, free_port, wait_until
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.events import (
    CommandReply,
    CommandResult,
    LaunchArgs,
    LaunchCommand,
    NodeReport,
    RankAssignment,
    RankExited,
    StopArgs,
    StopCommand,
)

NODE = "bench-1"
SLEEPER = [sys.executable, "-c", "import time; time.sleep(3600)"]


def cpu_seconds(pid: int) -> float:
    """CPU time of a process from the scheduler's exact accounting."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9


async def cpu_share(pid: int, seconds: float) -> float:
    """Percent of one core a process used over the next `seconds`."""
    cpu, wall = cpu_seconds(pid), time.monotonic()
    await asyncio.sleep(seconds)
    return 100 * (cpu_seconds(pid) - cpu) / (time.monotonic() - wall)


class Bench:
    """An agent process, its NATS, and a client that commands it and listens to it."""

    def __init__(self, root: Path, gpu_backend: str = "sim") -> None:
        self.root = root
        self.nats = NatsServer(free_port(), free_port(), root / "nats", root / "nats.log")
        self.port = free_port()
        self.agent = ManagedProcess(
            "agent",
            [sys.executable, "-m", "reprise_agent"],
            root / "agent.log",
            {
                "REPRISE_NODE_ID": NODE,
                "REPRISE_HTTP_PORT": str(self.port),
                "REPRISE_STATE_DIR": str(root / "agent"),
                "REPRISE_GPU_BACKEND": gpu_backend,
                "REPRISE_GPU_COUNT": "8",  # simulated GPUs; the real backend has what the machine has
                "REPRISE_LOG_LEVEL": "WARNING",
            },
        )
        self.bus: Bus | None = None
        self.exits: dict[str, int] = {}  # job id -> time the rank.exited event arrived (ns)
        self.reports: list[NodeReport] = []
        self.fence = 0

    async def start(self) -> None:
        await asyncio.to_thread(self.nats.start)
        self.agent.env["REPRISE_NATS_URL"] = self.nats.url
        self.agent.start()
        ready = await asyncio.to_thread(wait_until, self._ready, timeout_s=30)
        if not ready:
            raise RuntimeError(f"agent not ready: {self.agent.log_tail()}")
        self.bus = Bus(url=self.nats.url, service="bench")
        await self.bus.connect(attempts=10)
        await self.bus.nc.subscribe(subjects.node_event(NODE, "rank.exited"), cb=self._on_exit)
        await self.bus.nc.subscribe(subjects.node_report(NODE), cb=self._on_report)

    def _ready(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    async def _on_exit(self, msg: Any) -> None:
        arrived = time.time_ns()
        self.exits[RankExited.model_validate_json(msg.data).job_id] = arrived

    async def _on_report(self, msg: Any) -> None:
        self.reports.append(NodeReport.model_validate_json(msg.data))

    async def command(self, cmd: LaunchCommand | StopCommand) -> CommandReply:
        assert self.bus is not None
        reply = await self.bus.request(subjects.node_command(NODE), cmd, CommandReply, timeout=30)
        if reply.result is not CommandResult.DONE:
            raise RuntimeError(f"{cmd.action} failed: {reply.detail}")
        return reply

    def command_id(self, job_id: str, action: str) -> str:
        """A new command id for the job (each command runs once)."""
        self.fence += 1
        return f"{job_id}:{action}:{self.fence}"

    async def launch(self, job_id: str, command: list[str], ranks: int, env: dict[str, str] | None = None) -> list[int]:
        assignments = [RankAssignment(rank=r, node_id=NODE, gpu=r, local_rank=r) for r in range(ranks)]
        args = LaunchArgs(restart_epoch=0, world_size=ranks, master_addr="127.0.0.1", master_port=29500,
                          command=command, ranks=assignments, env=env or {})  # fmt: skip
        reply = await self.command(LaunchCommand(command_id=self.command_id(job_id, "launch"), job_id=job_id, fence=1,
                                                 args=args))  # fmt: skip
        return [int(pid) for pid in reply.data["pids"]]

    async def stop_job(self, job_id: str, *, grace_s: float) -> None:
        """Stop the job's ranks on the node."""
        command_id = self.command_id(job_id, "stop")
        await self.command(StopCommand(command_id=command_id, job_id=job_id, fence=1, args=StopArgs(grace_s=grace_s)))

    async def stop(self) -> None:
        if self.bus is not None:
            await self.bus.close()
        await asyncio.to_thread(self.agent.stop)
        await asyncio.to_thread(self.nats.stop)


async def measure_cpu(bench: Bench, seconds: float) -> dict[str, Any]:
    idle = await cpu_share(bench.agent.pid, seconds)
    await bench.launch("heartbeats", [sys.executable, "-c", HEARTBEAT_LOOP], 8, {"BENCH_SECONDS": str(seconds + 10)})
    await asyncio.sleep(4.0)  # ranks import the SDK and settle
    busy = await cpu_share(bench.agent.pid, seconds)
    last = bench.reports[-1]
    stepping = [r.step for r in last.ranks if r.job_id == "heartbeats"]
    await bench.stop_job("heartbeats", grace_s=2)
    return {
        "agent_cpu_pct_of_one_core": round(busy, 3),
        "agent_cpu_pct_idle": round(idle, 3),
        "ranks_reported": len(stepping),
        "last_reported_steps": stepping,
        "window_s": seconds,
        "gpu_error": last.gpu_error,
        "gpus": [g.model_dump(mode="json") for g in last.gpus],
    }


async def measure_exit_latency(bench: Bench, samples: int) -> dict[str, Any]:
    latencies_ms = []
    for i in range(samples):
        job = f"exit-{i}"
        [pid] = await bench.launch(job, SLEEPER, 1)
        await asyncio.sleep(0.2)
        killed = time.time_ns()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while job not in bench.exits and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        if job not in bench.exits:
            raise RuntimeError(f"no rank.exited event for {job} within 5 s")
        latencies_ms.append((bench.exits[job] - killed) / 1e6)
        await bench.stop_job(job, grace_s=1)
    ordered = sorted(latencies_ms)
    return {
        "samples": samples,
        "median": round(statistics.median(ordered), 3),
        "p99": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 3),
        "max": round(ordered[-1], 3),
    }


async def measure_sdk(bench: Bench, calls: int) -> tuple[dict[str, Any], dict[str, Any]]:
    sock = Path(bench.root / "agent" / "sdk.sock")
    coalesced = await run_child(rank_env(sock), str(calls), "0", "0", "0")
    every = await run_child(rank_env(sock, extra={"REPRISE_SDK_INTERVAL_S": "0"}), str(calls), "0", "0", "0")
    keep = ("calls", "median_us", "p99_us", "sent", "dropped")
    return {k: coalesced[k] for k in keep}, {k: every[k] for k in keep}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="rp-agent-bench-", dir="/tmp") as tmp:
        bench = Bench(Path(tmp), args.gpu_backend)
        await bench.start()
        try:
            cpu = await measure_cpu(bench, args.seconds)
            exits = await measure_exit_latency(bench, args.samples)
            sdk, sdk_every = await measure_sdk(bench, args.calls)
        finally:
            await bench.stop()
    return {
        "agent_cpu_pct_of_one_core": cpu["agent_cpu_pct_of_one_core"],
        "agent_cpu_pct_idle": cpu["agent_cpu_pct_idle"],
        "agent_cpu_setup": {
            "gpu_backend": args.gpu_backend,
            "gpus": len(cpu["gpus"]),
            "ranks": 8,
            "heartbeat_every_s": 0.01,
            "report_interval_s": 1.0,
            "window_s": cpu["window_s"],
            "ranks_reported": cpu["ranks_reported"],
            "last_reported_steps": cpu["last_reported_steps"],
        },
        "sdk_heartbeat_us": sdk,
        "sdk_heartbeat_every_call_us": sdk_every,
        "rank_exit_to_event_ms": exits,
        "last_report_gpus": cpu["gpus"] if args.gpu_backend != "sim" else None,
        "gpu_error": cpu["gpu_error"],
        "targets": {"agent_cpu_pct_of_one_core": 2.0, "sdk_heartbeat_median_us": 5.0, "rank_exit_to_event_ms": 200.0},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0, help="CPU measurement window")
    parser.add_argument("--samples", type=int, default=40, help="rank kills for the exit-latency figure")
    parser.add_argument("--calls", type=int, default=200_000, help="heartbeat calls for the SDK cost figure")
    parser.add_argument("--gpu-backend", choices=("sim", "nvml"), default="sim", help="the agent's GPUs")
    args = parser.parse_args()
    figures = asyncio.run(run(args))
    gpus = figures["agent_cpu_setup"]["gpus"]
    if figures["gpu_error"]:
        print(f"GPU backend {args.gpu_backend} unavailable: {figures['gpu_error']}")
    busy = figures["agent_cpu_pct_of_one_core"]
    print(f"agent CPU, {gpus} GPUs + 8 ranks at 100 heartbeats/s: {busy:.2f}% of one core")
    print(f"agent CPU, idle:                                 {figures['agent_cpu_pct_idle']:.2f}% of one core")
    sdk, every = figures["sdk_heartbeat_us"], figures["sdk_heartbeat_every_call_us"]
    print(f"SDK heartbeat():          median {sdk['median_us']:.3f} µs, p99 {sdk['p99_us']:.3f} µs")
    print(f"SDK heartbeat(), no coalescing: median {every['median_us']:.3f} µs, p99 {every['p99_us']:.3f} µs")
    exits = figures["rank_exit_to_event_ms"]
    print(f"rank SIGKILL → rank.exited received: median {exits['median']:.1f} ms, p99 {exits['p99']:.1f} ms")
    print(f"saved {write_result('agent' if args.gpu_backend == 'sim' else f'agent-{args.gpu_backend}', figures)}")


if __name__ == "__main__":
    main()
