"""The orchestrator benchmark's concurrent scenario: many jobs faulted at once, on one or more replicas.

On the stack of bench/orchestrator_stack.py (a fresh one per replica count; with several replicas REST calls go to
them in turn), a fleet of as many nodes as the largest round's jobs use plus SPARE_NODES. A round submits J jobs of
1 and 2 nodes in turn (POST /v1/jobs; each must come back `running`), then publishes one opened incident per job, all
at once (the time from the first incident's timestamp to the last publish acknowledged is kept as the spread), waits
for every recovery (up to a timeout per job, counted from the publish), waits SETTLE_S more, and cancels the jobs.
The 1-job round runs REPETITIONS times (after one warm-up round); its median is the reference of every round on the
same stack. The fleet's ranks take their first step `rank_start_s` after their launch (bench/orchestrator_fleet.py)
and their node reports it at once, as agents do: incident → running is the orchestrator's work plus that start.
Per round count:

  incident_to_running       incident published → the recovery's finished_at (GET /v1/jobs/{id}/recoveries), per job
  incident_to_claimed       incident published → the end of the recovery's `locked` step (the wait for a consumer)
  incident_to_launched      incident published → the last of the job's nodes acknowledged the new epoch's launch (the
                            orchestrator's own part, before `verifying` waits for the ranks' first step)
  slowest_launched_to_single_median  the same ratio for incident_to_launched: how much of the orchestrator's work the
                            jobs wait for one another, without the ranks' start
  slowest_to_single_median  the slowest job's incident_to_running / the 1-job median; target ≤ 2 at 50 jobs
  recoveries_per_job        how many recoveries each job got (exactly one expected)
  steps                     each recovery step's duration over the round's jobs (median, max), from the claim on
  launches_per_node         launch commands each node of a job executed, by restart epoch, from the fleet (repeats of
                            a command id are not executions); every node should show epoch 0 once, epoch 1 once
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.orchestrator_stack import (
    OrchestratorStack,
    Recoveries,
    incident_for,
    launch_acks,
    summary_ms,
    timestamp,
)
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.errors import BusError, ConfigError

SPARE_NODES = 4
REPETITIONS = 11  # the 1-job reference: a median of 11 rounds
JOB_TIMEOUT_S = 240.0
SETTLE_S = 3.0  # after the last recovery ended: a second recovery or a repeated launch would show by then
EXPECTED_LAUNCHES = {0: 1, 1: 1}  # once at submit, once for the recovery


def job_sizes(jobs: int) -> list[int]:
    """Nodes of each job of a round: 1, 2, 1, 2, …"""
    return [1 + index % 2 for index in range(jobs)]


def fleet_size(job_counts: list[int]) -> int:
    """A fleet that holds the largest round's jobs at once, plus spares."""
    return sum(job_sizes(max(job_counts))) + SPARE_NODES


@dataclass
class JobSample:
    """One job of a round: how long its recovery took and what it left behind."""

    job_id: str
    nodes: list[str]
    running_s: float | None = None  # None: not recovered within the timeout
    claimed_s: float | None = None
    launched_s: float | None = None  # incident published → the last of the job's nodes acknowledged its launch
    outcome: str = ""
    owner: str = ""
    recoveries: int = 0
    launches: dict[str, dict[int, int]] = field(default_factory=dict)  # node → restart epoch → executed
    steps_s: dict[str, float] = field(default_factory=dict)  # each recovery step's duration (attempts summed)


async def one_round(
    stack: OrchestratorStack, bus: Bus, clients: list[httpx.AsyncClient], recoveries: Recoveries, *, jobs: int,
    job_timeout_s: float,
) -> tuple[list[JobSample], dict[str, Any]]:  # fmt: skip
    """Submit `jobs` jobs, fault them all at once, wait for their recoveries, cancel them; a sample per job."""
    submitted: list[tuple[httpx.AsyncClient, dict[str, Any]]] = []
    began = time.perf_counter()
    try:
        for index, nodes in enumerate(job_sizes(jobs)):
            http = clients[index % len(clients)]
            body = {"name": "bench-concurrent", "node_count": nodes, "ranks_per_node": stack.ranks_per_node,
                    "command": ["train"]}  # fmt: skip
            submitted.append((http, (await http.post("/v1/jobs", json=body)).raise_for_status().json()))
        submit_s = time.perf_counter() - began
        not_running = [job for _http, job in submitted if job["state"] != "running"]
        if not_running:
            raise RuntimeError(f"{len(not_running)} of {jobs} jobs not running after submit: {not_running[0]}")
        incidents = [incident_for(job) for _http, job in submitted]
        ended = [recoveries.expect(job["id"]) for _http, job in submitted]
        cpu_before = stack.cpu_s()
        await asyncio.gather(*(bus.publish(subjects.incident(i.job_id, "opened"), i) for i in incidents))
        spread_s = time.time() - incidents[0].time.timestamp()
        await asyncio.wait(ended, timeout=job_timeout_s)  # the event only wakes us early: the records count
        cpu_after = stack.cpu_s()
        await asyncio.sleep(SETTLE_S)
        # One read at a time: a burst of reads would load the orchestrator being measured (with 50 at once, one
        # replica ran out of database connections and stalled for 30 s)
        samples = [
            await _sample(stack, bus, http, job, i.time.timestamp())
            for (http, job), i in zip(submitted, incidents, strict=True)
        ]
    finally:  # a new job may only use nodes no active job runs on: free them for the next round
        for http, job in submitted:
            (await http.post(f"/v1/jobs/{job['id']}/cancel")).raise_for_status()
    # CPU seconds each process used from the publish to the last recovery's end (per job: the orchestrators' cost)
    cpu = {name: round(cpu_after[name] - cpu_before[name], 3) for name in cpu_after if name != "wall"}
    timing = {"submit_s": round(submit_s, 3), "publish_spread_s": round(spread_s, 3),
              "wall_s": round(time.perf_counter() - began, 1), "cpu_s_during_recoveries": cpu,
              "recoveries_wall_s": round(cpu_after["wall"] - cpu_before["wall"], 3)}  # fmt: skip
    return list(samples), timing


async def _sample(
    stack: OrchestratorStack, bus: Bus, http: httpx.AsyncClient, job: dict[str, Any], published: float
) -> JobSample:
    sample = JobSample(job_id=job["id"], nodes=list(dict.fromkeys(r["node_id"] for r in job["placement"])))
    try:
        found = (await http.get(f"/v1/jobs/{job['id']}/recoveries")).raise_for_status().json()["data"]
        # node_ids=[]: every shard answers at once with what its nodes executed for the job
        acks = await launch_acks(stack, bus, job_id=job["id"], restart_epoch=1, node_ids=[], timeout_s=1.0)
    except (httpx.HTTPError, BusError, TimeoutError) as exc:  # this job's figures are lost, not the round's
        sample.outcome = f"not read: {exc!r}"[:200]
        return sample
    sample.recoveries = len(found)
    sample.launches = {node: acks.launches.get(node, {}) for node in sorted({*sample.nodes, *acks.launches})}
    acked = [acks.acked_at[node] for node in sample.nodes if node in acks.acked_at]
    if len(acked) == len(sample.nodes):
        sample.launched_s = max(acked) - published
    if not found:
        sample.outcome = "no recovery"
        return sample
    first = found[-1]  # newest first: the one our incident started
    sample.owner = first["owner"]
    sample.outcome = f"{first['step']}: {first['detail'] or 'not finished within the timeout'}"
    locked = next((s for s in first["steps"] if s["step"] == "locked" and s.get("ended_at")), None)
    if locked is not None:
        sample.claimed_s = timestamp(locked["ended_at"]) - published
    if first["step"] == "running" and first["finished_at"]:
        sample.running_s = timestamp(first["finished_at"]) - published
    for step in first["steps"][1:]:  # from the claim on (detected is the detector's)
        if step.get("ended_at"):
            took = timestamp(step["ended_at"]) - timestamp(step["started_at"])
            sample.steps_s[step["step"]] = sample.steps_s.get(step["step"], 0.0) + took
    return sample


def round_figures(
    samples: list[JobSample],
    *,
    reference_s: float | None,
    job_timeout_s: float,
    launched_reference_s: float | None = None,
) -> dict[str, Any]:
    """The figures of one job count from its samples, against the 1-job medians (to `running`, and to launched)."""
    running = [s.running_s for s in samples if s.running_s is not None]
    claimed = [s.claimed_s for s in samples if s.claimed_s is not None]
    launched = [s.launched_s for s in samples if s.launched_s is not None]
    all_recovered = len(running) == len(samples)
    patterns = Counter(_pattern(epochs) for s in samples for epochs in s.launches.values())
    figures: dict[str, Any] = {
        "jobs_sampled": len(samples),
        "nodes": sum(len(s.nodes) for s in samples),
        "recovered": len(running),
        "all_recovered": all_recovered,
        "incident_to_running": summary_ms(running),
        "incident_to_claimed": summary_ms(claimed),
        "incident_to_launched": summary_ms(launched),
        "slowest_to_single_median": round(max(running) / reference_s, 2) if reference_s and all_recovered else None,
        "slowest_launched_to_single_median": (
            round(max(launched) / launched_reference_s, 2) if launched_reference_s and launched else None
        ),
        "recoveries_per_job": {str(k): v for k, v in sorted(Counter(s.recoveries for s in samples).items())},
        "exactly_one_recovery_per_job": all(s.recoveries == 1 for s in samples),
        "launches_per_node": dict(patterns),
        "exactly_one_launch_per_node": all(e == EXPECTED_LAUNCHES for s in samples for e in s.launches.values()),
        "owners": dict(Counter(s.owner for s in samples)),
        "outcomes": dict(Counter(s.outcome for s in samples)),
        "running_s_sorted": [round(v, 2) for v in sorted(running)],
        "steps": {
            name: summary_ms([s.steps_s[name] for s in samples if name in s.steps_s])
            for name in dict.fromkeys(name for s in samples for name in s.steps_s)
        },
    }
    if reference_s and not all_recovered:  # the missed ones took longer than the timeout
        figures["slowest_to_single_median_at_least"] = round(job_timeout_s / reference_s, 2)
    return figures


def _pattern(epochs: dict[int, int]) -> str:
    return ", ".join(f"epoch {e}: {n}" for e, n in sorted(epochs.items())) or "none"


async def measure(
    stack: OrchestratorStack, *, job_counts: list[int], repetitions: int, job_timeout_s: float
) -> dict[str, Any]:
    """A warm-up round, the 1-job reference `repetitions` times, then every other job count once."""
    bus = Bus(url=stack.nats.url, service="bench-orchestrator-concurrent")
    await bus.connect(attempts=20)
    recoveries = Recoveries()
    await recoveries.start(bus)
    limits = httpx.Timeout(60.0, connect=5.0)
    clients = [
        httpx.AsyncClient(base_url=url, headers=stack.headers, timeout=limits) for url in stack.orchestrator_urls
    ]
    replicas = len(clients)
    figures: dict[str, Any] = {}
    try:
        single: list[JobSample] = []
        for index in range(1 + repetitions):
            samples, timing = await one_round(stack, bus, clients, recoveries, jobs=1, job_timeout_s=job_timeout_s)
            label = f"#{index - 1}" if index else "warm-up"
            print(f"  {replicas} replicas, 1 job {label}: {_describe(samples)} ({timing['wall_s']} s)", flush=True)
            single += samples if index else []
        running = [s.running_s for s in single if s.running_s is not None]
        # the median as every figure here takes it (the upper one of an even count)
        reference_s = summary_ms(running)["median_ms"] / 1000 if running else None
        launched = [s.launched_s for s in single if s.launched_s is not None]
        launched_reference_s = summary_ms(launched)["median_ms"] / 1000 if launched else None
        against = {"reference_s": reference_s, "launched_reference_s": launched_reference_s}
        for jobs in sorted(set(job_counts)):
            key = f"concurrent_{replicas}_replicas_{jobs}_jobs"
            if jobs == 1:
                figures[key] = round_figures(single, job_timeout_s=job_timeout_s, **against)
                figures[key] |= {"repetitions": repetitions}
                continue
            try:
                samples, timing = await one_round(
                    stack, bus, clients, recoveries, jobs=jobs, job_timeout_s=job_timeout_s
                )
            except (BusError, httpx.HTTPError, TimeoutError, RuntimeError) as exc:
                print(f"  {replicas} replicas, {jobs} jobs: stopped by {exc!r}", flush=True)
                figures[key] = {"error": repr(exc)[:500]}
                continue
            figures[key] = round_figures(samples, job_timeout_s=job_timeout_s, **against) | timing
            print(f"  {replicas} replicas, {jobs} jobs: {_describe(samples)} ({timing['wall_s']} s)", flush=True)
        figures[f"concurrent_{replicas}_replicas_reference_ms"] = round(reference_s * 1000, 1) if reference_s else None
    finally:
        for http in clients:
            await http.aclose()
        await bus.close()
    return figures


def _describe(samples: list[JobSample]) -> str:
    running = sorted(s.running_s for s in samples if s.running_s is not None)
    times = f"median {running[len(running) // 2]:.2f} s, max {running[-1]:.2f} s" if running else "no times"
    recs = dict(Counter(s.recoveries for s in samples))
    launches = all(e == EXPECTED_LAUNCHES for s in samples for e in s.launches.values())
    return f"recovered {len(running)}/{len(samples)}, {times}, recoveries per job {recs}, launches exact {launches}"


def run_concurrent(
    *, replicas: int, job_counts: list[int], repetitions: int, job_timeout_s: float, api_key: str,
    fleet_processes: int, ranks_per_node: int,
) -> dict[str, Any]:  # fmt: skip
    """The concurrent scenario on a fresh stack of `replicas` orchestrators; logs are kept when anything failed."""
    nodes = fleet_size([*job_counts, 1])
    root = Path(tempfile.mkdtemp(prefix=f"bench-orchestrator-concurrent-{replicas}-"))
    stack = OrchestratorStack(root, nodes=nodes, ranks_per_node=ranks_per_node, api_key=api_key,
                              fleet_processes=fleet_processes, replicas=replicas)  # fmt: skip
    try:
        stack.start()
        print(f"concurrent, {replicas} replicas: stack up, {nodes} nodes", flush=True)
        before = stack.cpu_s()
        figures = asyncio.run(
            measure(stack, job_counts=job_counts, repetitions=repetitions, job_timeout_s=job_timeout_s)
        )
        figures[f"cpu_concurrent_{replicas}_replicas"] = stack.cpu_share(before)
    except (RuntimeError, ConfigError, httpx.HTTPError, TimeoutError, BusError) as exc:
        print(f"concurrent, {replicas} replicas: stopped by {exc!r}; the logs are in {root / 'logs'}", flush=True)
        return {f"error_concurrent_{replicas}_replicas": {"error": repr(exc)[:500]}}
    finally:
        stack.stop()
    clean = all(
        isinstance(f, dict) and f.get("all_recovered") and f.get("exactly_one_recovery_per_job")
        and f.get("exactly_one_launch_per_node")
        for key, f in figures.items() if key.endswith("_jobs")
    )  # fmt: skip
    if clean:
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"concurrent, {replicas} replicas: not every job recovered cleanly; logs in {root / 'logs'}", flush=True)
    return figures | {f"fleet_nodes_concurrent_{replicas}_replicas": nodes}
