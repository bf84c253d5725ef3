"""The orchestrator's recovery speed with a simulated fleet: real nats-server, Redis, checkpoint registry and
orchestrator processes, and processes simulating N agents (bench/orchestrator_fleet.py, the agent's real CommandBook,
no rank processes; ``--fleet-processes``, default 2, split the nodes between them: real agents answer a command at
the same time, a single simulating process one after the other). The stack is bench/orchestrator_stack.py.

Run from the repository root: ``make bench-orchestrator`` (or ``.venv/bin/python -m bench.bench_orchestrator``;
``--quick`` for a smoke run). It runs two scenarios and saves both in bench/results/orchestrator.json:

- ``sizes``: one recovery at a time, per fleet size N (16, 256, 2,048 nodes, ``--nodes``; a fresh job of N nodes
  per iteration);
- ``concurrent``: many jobs faulted at once (1, 10, 50 jobs of 1 or 2 nodes, ``--jobs``) on 1 and 3 orchestrator
  replicas (``--replicas``); what it measures is in bench/orchestrator_concurrent.py.

``--scenario sizes|concurrent`` runs one of them. A run with any option changed from its default is partial and does
not overwrite orchestrator.json: it saves bench/results/orchestrator-sizes.json, orchestrator-concurrent.json, or
(``--scenario all`` with other options changed) orchestrator-partial.json.

The sizes scenario's figures:

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
import secrets
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import write_result
from bench.orchestrator_concurrent import JOB_TIMEOUT_S, REPETITIONS, run_concurrent
from bench.orchestrator_fleet import RANK_START_S, node_names
from bench.orchestrator_stack import (
    FLEET_PROCESSES,
    OrchestratorStack,
    Recoveries,
    incident_for,
    launch_acks,
    summary_ms,
    timestamp,
)
from reprise_cli.servers import wait_until
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.errors import BusError, ConfigError

RECOVERY_TIMEOUT_S = 120.0
MAX_FAILED_IN_A_ROW = 3


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
    incident = incident_for(job)
    ended = recoveries.expect(job["id"])
    await bus.publish(subjects.incident(job["id"], "opened"), incident)
    published = incident.time.timestamp()
    epoch, node_ids = job["restart_epoch"] + 1, node_names(stack.nodes)
    acks = await launch_acks(stack, bus, job_id=job["id"], restart_epoch=epoch, node_ids=node_ids)
    with contextlib.suppress(TimeoutError):  # the event only wakes us early: the record below is what counts
        await asyncio.wait_for(ended, RECOVERY_TIMEOUT_S)
    found = (await http.get(f"/v1/jobs/{job['id']}/recoveries")).raise_for_status().json()["data"]
    if not found:
        raise RuntimeError(f"no recovery of job {job['id']} within {RECOVERY_TIMEOUT_S:g} s of its incident")
    recovery = found[0]
    total_s = timestamp(recovery["finished_at"]) - published if recovery["finished_at"] else float("nan")
    steps: dict[str, float] = {}
    for entry in recovery["steps"]:
        if entry.get("ended_at"):
            steps[entry["step"]] = (
                steps.get(entry["step"], 0.0) + timestamp(entry["ended_at"]) - timestamp(entry["started_at"])
            )
    if recovery["finished_at"]:  # announcing steps, claiming, gaps between records
        steps["(between steps)"] = total_s - sum(steps.values())
    return {
        "launch_acked_s": max(acks.acked_at.values()) - published if acks.complete else None,
        "running_s": total_s if recovery["step"] == "running" else None,
        "steps_s": steps,
        "outcome": f"{recovery['step']}: {recovery['detail'] or 'not finished after the timeout'}",
    }


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


def run_sizes(args: argparse.Namespace, api_key: str) -> dict[str, Any]:
    """The sizes scenario: each fleet size on a fresh stack, one recovery at a time."""
    figures: dict[str, Any] = {}
    for nodes in args.nodes or ([16, 256] if args.quick else [16, 256, 2048]):
        iterations = args.iterations or (5 if args.quick else 30 if nodes >= 2048 else 100)
        warmup = 1 if args.quick else 3
        result = run_size(nodes, ranks_per_node=args.ranks_per_node, iterations=iterations, warmup=warmup,
                          api_key=api_key, fleet_processes=args.fleet_processes)  # fmt: skip
        for key, value in result.items():
            print(key, value, flush=True)
        figures |= result
    return figures


def run_concurrent_all(args: argparse.Namespace, api_key: str) -> dict[str, Any]:
    """The concurrent scenario for each replica count, each on a fresh stack."""
    figures: dict[str, Any] = {}
    job_counts = args.jobs or ([1, 10] if args.quick else [1, 10, 50])
    for replicas in args.replicas:
        result = run_concurrent(replicas=replicas, job_counts=job_counts,
                                repetitions=args.repetitions or (2 if args.quick else REPETITIONS),
                                job_timeout_s=args.job_timeout, api_key=api_key,
                                fleet_processes=args.fleet_processes, ranks_per_node=args.ranks_per_node)  # fmt: skip
        for key, value in result.items():
            shown = {k: v for k, v in value.items() if k != "running_s_sorted"} if isinstance(value, dict) else value
            print(key, shown, flush=True)
        figures |= result
    return figures


def main() -> None:
    """Run the scenarios asked for, print and save the figures (a partial run under another name)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=("sizes", "concurrent", "all"), default="all")
    parser.add_argument("--quick", action="store_true", help="a smoke run: fewer sizes, jobs and iterations")
    parser.add_argument("--nodes", type=int, nargs="*", help="sizes: fleet sizes (default 16 256 2048)")
    parser.add_argument("--iterations", type=int, help="sizes: recoveries per fleet size (default 100, 2,048: 30)")
    parser.add_argument("--jobs", type=int, nargs="*", help="concurrent: jobs faulted at once (default 1 10 50)")
    parser.add_argument("--replicas", type=int, nargs="*", default=[1, 3], help="concurrent: orchestrator replicas")
    parser.add_argument("--repetitions", type=int, help=f"concurrent: 1-job rounds (default {REPETITIONS})")
    parser.add_argument(
        "--job-timeout", type=float, default=JOB_TIMEOUT_S, help="concurrent: seconds a round waits for a recovery"
    )
    parser.add_argument("--ranks-per-node", type=int, default=1, help="ranks (GPUs used) per node (default 1)")
    parser.add_argument(
        "--fleet-processes",
        type=int,
        default=FLEET_PROCESSES,
        help=f"processes simulating the fleet (default {FLEET_PROCESSES})",
    )
    args = parser.parse_args()
    full = vars(args) == vars(parser.parse_args([]))
    figures: dict[str, Any] = {
        "ranks_per_node": args.ranks_per_node,
        "fleet_processes": args.fleet_processes,
        "rank_start_s": RANK_START_S,
    }
    api_key = secrets.token_urlsafe(32)
    if args.scenario in ("sizes", "all"):
        figures |= run_sizes(args, api_key)
    if args.scenario in ("concurrent", "all"):
        figures |= run_concurrent_all(args, api_key)
    figures["targets"] = {
        "incident_to_launch_acked_2048_nodes.p99_ms": "<= 1000",
        **{f"concurrent_{r}_replicas_50_jobs.slowest_to_single_median": "<= 2" for r in (1, 3)},
    }
    name = "orchestrator" if full else f"orchestrator-{'partial' if args.scenario == 'all' else args.scenario}"
    print("saved", write_result(name, figures))


if __name__ == "__main__":
    main()
