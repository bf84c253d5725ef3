"""What reprise_sdk.heartbeat() costs a training loop, and what the agent's SDK socket costs the agent.

Run from the repository root: ``.venv/bin/python -m bench.bench_sdk [--calls 200000]``. Prints a table and saves
bench/results/sdk.json. Each measurement runs in a fresh child process (the training script's side); the agent's
side is the real SdkServer in this process, on its own event loop, so sender and receiver do not share a GIL.

Scenarios (the no-op column is an empty function timed the same way, after the same pause):
  outside-reprise                    no REPRISE_SDK_SOCKET: every call is a no-op
  agent-absent                       the socket path does not exist (agent gone), the shipped 0.1 s interval
  agent-absent-every-call            the same with interval 0: every call tries to send and counts a drop
  live[-with-metric]                 the agent's SdkServer, shipped interval, back to back: most calls coalesced
  live-socket-every-call[-with-metric]  interval 0, every call sends a datagram to a live socket that the child
                                     empties every 8 calls outside the timing: what a call that sends costs
  live-every-call-after-10ms-sleep   interval 0, the SdkServer, the process sleeping 10 ms between calls as a loop
                                     waiting for its GPU does: on a virtual machine, cold caches dominate
  agent-cpu                          8 ranks heartbeating every 10 ms for 10 s: the SdkServer's CPU, % of one core
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import latency_summary, process_cpu_s, write_result
from reprise_agent.progress.book import ProgressBook
from reprise_agent.progress.server import SdkServer

HEARTBEAT_LOOP = """
import os, time, reprise_sdk
end = time.monotonic() + float(os.environ["BENCH_SECONDS"])
step = 0
while time.monotonic() < end:
    step += 1
    time.sleep(0.01)
    reprise_sdk.heartbeat(step, loss=1.0 / step)
"""


def child(calls: int, pause_us: int, with_metric: bool, own_socket: bool) -> None:
    """Time `calls` heartbeats one by one in this process and print the summary as one JSON line.

    With a pause between calls the process sleeps, as a loop waiting for its GPU does; the cost of a no-op call after
    the same pause is measured too, for reference. With `own_socket` this process binds the socket the SDK sends to
    and empties it every 8 calls, outside the timed calls.
    """
    import reprise_sdk  # noqa: PLC0415 - only the child, whose environment the parent chose, loads the SDK

    receiver = _bind(os.environ["REPRISE_SDK_SOCKET"]) if own_socket else None
    clock = time.perf_counter_ns

    def nothing() -> None:
        return None

    baseline = []
    for _ in range(min(calls, 10_000)):
        if pause_us:
            time.sleep(pause_us / 1e6)
        start = clock()
        nothing()
        baseline.append(clock() - start)
    samples = [0] * calls
    heartbeat = reprise_sdk.heartbeat
    for step in range(calls):
        if pause_us:
            time.sleep(pause_us / 1e6)
        if with_metric:
            start = clock()
            heartbeat(step, loss=0.123456)
            samples[step] = clock() - start
        else:
            start = clock()
            heartbeat(step)
            samples[step] = clock() - start
        if receiver is not None and step % 8 == 7:
            _empty(receiver)
    stats = reprise_sdk.stats()
    summary = latency_summary(samples)
    summary.update(noop_call_median_us=latency_summary(baseline)["median_us"], sent=stats.sent, dropped=stats.dropped)
    print(json.dumps(summary))


def _bind(path: str) -> socket.socket:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # left by the previous scenario
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(path)
    receiver.setblocking(False)
    return receiver


def _empty(receiver: socket.socket) -> None:
    with contextlib.suppress(BlockingIOError):
        while True:
            receiver.recv(65536)


async def run_child(env: dict[str, str], *args: str) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.bench_sdk", "--child", *args, env=env, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark child failed with exit code {proc.returncode}")
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


def rank_env(socket_path: Path, rank: int = 0, extra: dict[str, str] | None = None) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("REPRISE_")}
    own = {"REPRISE_SDK_SOCKET": str(socket_path), "REPRISE_JOB_ID": "bench", "RANK": str(rank)}
    return {**base, **own, **(extra or {})}


async def agent_cpu(server: SdkServer, seconds: float = 10.0) -> dict[str, Any]:
    """Eight ranks heartbeating every 10 ms: the agent-side CPU of receiving them, measured in the middle."""
    env = {"BENCH_SECONDS": str(seconds)}
    procs = [
        await asyncio.create_subprocess_exec(sys.executable, "-c", HEARTBEAT_LOOP, env=rank_env(server.path, rank, env))
        for rank in range(8)
    ]
    await asyncio.sleep(2.0)
    cpu, wall, received = process_cpu_s(), time.monotonic(), server.received
    await asyncio.sleep(seconds - 4.0)
    cpu, wall, received = process_cpu_s() - cpu, time.monotonic() - wall, server.received - received
    for proc in procs:
        await proc.wait()
    return {
        "ranks": 8,
        "step_interval_s": 0.01,
        "datagrams_per_s": round(received / wall, 1),
        "agent_cpu_pct_of_one_core": round(100 * cpu / wall, 3),
        "garbage": server.garbage,
    }


async def measure(calls: int) -> dict[str, Any]:
    directory = Path(tempfile.mkdtemp(prefix="rp-bench-", dir="/tmp"))
    missing = directory / "absent.sock"
    server = SdkServer(directory / "sdk.sock", ProgressBook())
    await server.start()
    every_call = {"REPRISE_SDK_INTERVAL_S": "0"}
    paced = str(min(calls, 1_000))
    figures: dict[str, Any] = {}
    try:
        outside = {k: v for k, v in os.environ.items() if not k.startswith("REPRISE_")}
        figures["outside-reprise"] = await run_child(outside, str(calls), "0", "0", "0")
        figures["agent-absent"] = await run_child(rank_env(missing), str(calls), "0", "0", "0")
        absent_every = rank_env(missing, extra=every_call)
        figures["agent-absent-every-call"] = await run_child(absent_every, str(calls), "0", "0", "0")
        figures["live"] = await run_child(rank_env(server.path), str(calls), "0", "0", "0")
        figures["live-with-metric"] = await run_child(rank_env(server.path), str(calls), "0", "1", "0")
        own = rank_env(directory / "own.sock", extra=every_call)
        figures["live-socket-every-call"] = await run_child(own, str(calls), "0", "0", "1")
        figures["live-socket-every-call-with-metric"] = await run_child(own, str(calls), "0", "1", "1")
        server_every = rank_env(server.path, extra=every_call)
        figures["live-every-call-after-10ms-sleep"] = await run_child(server_every, paced, "10000", "0", "0")
        figures["agent-cpu"] = await agent_cpu(server)
    finally:
        server.close()
        shutil.rmtree(directory, ignore_errors=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200_000, help="heartbeat calls per back-to-back scenario")
    parser.add_argument("--child", nargs=4, metavar=("CALLS", "PAUSE_US", "METRIC", "OWN"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        calls, pause_us, metric, own_socket = args.child
        child(int(calls), int(pause_us), metric == "1", own_socket == "1")
        return
    figures = asyncio.run(measure(args.calls))
    print(f"{'scenario':40} {'calls':>7} {'median µs':>10} {'p99 µs':>9} {'sent':>7} {'dropped':>7} {'no-op µs':>9}")
    for name, row in figures.items():
        if "median_us" in row:
            print(
                f"{name:40} {row['calls']:>7} {row['median_us']:>10.3f} {row['p99_us']:>9.3f}"
                f" {row['sent']:>7} {row['dropped']:>7} {row['noop_call_median_us']:>9.3f}"
            )
    cpu = figures["agent-cpu"]
    print(
        f"agent CPU, 8 ranks x 100 steps/s: {cpu['agent_cpu_pct_of_one_core']:.2f}% of one core"
        f" ({cpu['datagrams_per_s']} datagrams/s)"
    )
    print(f"saved {write_result('sdk', figures)}")


if __name__ == "__main__":
    main()
