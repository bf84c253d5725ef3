"""The Reprise side of bench_vs_torchrun: the example as a job on the local stack, a fault, the recovery.

Each run starts a fresh stack (4 nodes + 1 spare, 1 rank per node, simulated GPUs) in its own state directory, so a
cordoned node or a lost agent of one run cannot change the next one.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from bench.vs_torchrun_common import POLL_S, REPO, SCRIPT, Fault, LogFollower, Outcome, Settings, digest_of
from reprise_cli.client import PlatformClient, poll, step_seconds
from reprise_cli.creds import read_admin_api_key
from reprise_cli.servers import free_stack_ports
from reprise_cli.stack import Stack
from reprise_cli.topology import DEFAULT_PORTS, Runtime, StackConfig
from reprise_common.events import FaultKind, InjectFault

SPARES = 1
STOPPED_STATES = frozenset({"failed", "held", "cancelled"})


@contextlib.contextmanager
def platform(
    root: Path, settings: Settings, *, spares: int = SPARES, standbys: int = 0, runtime: Runtime = "process"
) -> Iterator[tuple[Stack, PlatformClient]]:
    """A fresh local stack (`standbys` warm interpreters per node; `runtime` docker: the agents run containerized ranks
    on the stack's own dockerd) and a client for it; all stopped on the way out."""
    config = StackConfig(
        nodes=settings.world_size,
        spares=spares,
        gpus_per_node=1,
        standbys=standbys,
        state_dir=root / "state",
        ports=free_stack_ports(DEFAULT_PORTS),
        runtime=runtime,
    )
    stack = Stack(config, say=lambda _text: None)
    try:
        stack.start(timeout_s=120)
        client = PlatformClient(
            orchestrator=stack.url("orchestrator"),
            detector=stack.url("detector"),
            registry=stack.url("checkpoint-registry"),
            nats_url=config.nats_url,
            nkey_seed_file=stack.admin_seed,
            api_key=read_admin_api_key(config.state_dir),
        )
        try:
            poll(client.nodes, lambda nodes: len(nodes) >= settings.world_size + spares, timeout_s=60)
            yield stack, client
        finally:
            client.close()
    finally:
        stack.stop()


def job_body(
    name: str,
    settings: Settings,
    root: Path,
    *,
    policy: dict[str, Any] | None = None,
    script_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """POST /v1/jobs: the example with the same arguments as under torchrun (plus `script_args`), one rank per node;
    `policy` adds to (or overrides) the policy every run has."""
    checkpoints = root / "ckpt"
    return {
        "name": name,
        "node_count": settings.world_size,
        "ranks_per_node": 1,
        "command": [sys.executable, str(SCRIPT), *settings.script_args(checkpoints), *script_args],
        "working_dir": str(REPO),
        "checkpoint_dir": str(checkpoints),
        "env": {"OMP_NUM_THREADS": "1"} if env is None else env,  # what torchrun sets for its workers
        "policy": {
            "max_restarts": settings.max_restarts,
            "elastic_min_nodes": settings.world_size - 1,
            "hang_timeout_s": settings.hang_timeout_s,
            **(policy or {}),
        },
    }


class RankZeroLogs:
    """Rank 0's output of every launch of a job, wherever the agents wrote it (one file per restart epoch)."""

    def __init__(self, state_dir: Path, job_id: str) -> None:
        self.state_dir = state_dir
        self.pattern = f"agents/*/ranks/{job_id}/epoch-*-rank-0.log"
        self.followers: dict[Path, tuple[int, LogFollower]] = {}

    def poll(self) -> list[tuple[int, float, str]]:
        """New lines: (restart epoch, stamp, line)."""
        for path in self.state_dir.glob(self.pattern):
            if path not in self.followers:
                epoch = int(path.name.split("-")[1])
                self.followers[path] = (epoch, LogFollower(path))
        now = time.time()
        return [(epoch, stamp, line) for epoch, f in self.followers.values() for stamp, line in f.poll(now)]

    def lines(self, *, min_epoch: int) -> list[tuple[float, str]]:
        """Every line read so far from launches at or after `min_epoch`, epoch by epoch."""
        chosen = sorted((epoch, f.lines) for epoch, f in self.followers.values() if epoch >= min_epoch)
        return [entry for _epoch, lines in chosen for entry in lines]


class StopCheck:
    """Whether a job has stopped, asked of the orchestrator at most once a second by a loop that polls faster."""

    def __init__(self, client: PlatformClient, job_id: str) -> None:
        self.client, self.job_id, self._next = client, job_id, 0.0

    def state(self) -> str:
        """The state the job stopped in ("" while it runs, or when it was asked less than a second ago)."""
        if time.time() < self._next:
            return ""
        self._next = time.time() + 1.0
        state: str = self.client.job(self.job_id)["state"]
        return state if state in STOPPED_STATES else ""


def fault_event(fault: Fault, *, job_id: str, rank: int, gpu: int) -> InjectFault:
    """The injection request (as the orchestrator's drills build it)."""
    kinds = {
        Fault.RANK_CRASH: FaultKind.RANK_KILL,
        Fault.HANG: FaultKind.RANK_HANG,
        Fault.NODE_LOSS: FaultKind.NODE_LOSS,
    }
    if fault is Fault.XID79:
        return InjectFault(kind=FaultKind.XID, gpu=gpu, xid=79)
    return InjectFault(kind=kinds[fault], rank=rank, job_id=job_id)


def run(fault: Fault, settings: Settings, root: Path) -> Outcome:
    """Submit the job on a fresh stack, inject the fault at the fault step, watch it to the end."""
    with platform(root, settings) as (stack, client):
        outcome = Outcome("reprise", fault, launched_at=time.time())
        job = client.submit(job_body(f"vs-torchrun-{fault.value}", settings, root))
        if job["state"] != "running":
            outcome.notes.append(f"the job did not start: {job['state']} {job.get('detail', '')}")
            return outcome
        logs = RankZeroLogs(stack.config.state_dir, job["id"])
        if fault is Fault.NODE_LOSS:  # the victim's agent kills itself: the stack's supervisor must leave it dead
            victim = next(r for r in job["placement"] if r["rank"] == settings.victim_rank)
            stack.hold_node_down(victim["node_id"])
        try:
            _watch(client, job, logs, outcome, settings)
            _analyse(client, job["id"], logs, outcome)
        finally:
            with contextlib.suppress(httpx.HTTPError):
                client.cancel(job["id"])
        if not outcome.digest:
            outcome.notes.append(f"logs kept under {stack.log_dir} and {stack.config.state_dir / 'agents'}")
    return outcome


def _watch(
    client: PlatformClient, job: dict[str, Any], logs: RankZeroLogs, outcome: Outcome, settings: Settings
) -> None:
    """Inject when rank 0 reports the fault step; return at the digest, a stopped job, or the run timeout."""

    def on_line(line: str) -> None:
        if outcome.fault_due(line, settings):
            _inject(client, job, outcome, settings)

    end = follow_job(
        client, job["id"], logs, since=outcome.launched_at, limit_s=settings.run_timeout_s, on_line=on_line
    )
    outcome.digest, outcome.finished_at = end.digest, end.at
    outcome.extra |= {"final_restart_epoch": end.epoch} if end.digest else {}
    outcome.notes += [end.note] if end.note else []


@dataclass(frozen=True)
class JobEnd:
    """How following a job's rank 0 ended: its digest (when, in which restart epoch), or why not."""

    digest: str | None = None
    at: float | None = None
    epoch: int | None = None
    note: str = ""


def follow_job(
    client: PlatformClient,
    job_id: str,
    logs: RankZeroLogs,
    *,
    since: float,
    limit_s: float,
    on_line: Callable[[str], None],
) -> JobEnd:
    """Hand each of rank 0's lines to `on_line`, in the order written, until the digest, a stopped job, or `limit_s`
    after `since`."""
    stopped = StopCheck(client, job_id)
    while time.time() < since + limit_s:
        for epoch, stamp, line in sorted(logs.poll(), key=lambda entry: entry[0]):
            on_line(line)
            if digest := digest_of(line):
                return JobEnd(digest, stamp, epoch)
        if state := stopped.state():
            return JobEnd(note=f"the job ended {state}")
        time.sleep(POLL_S)
    return JobEnd(note=f"still running after {limit_s:g} s: stopped")


@dataclass(frozen=True)
class Injection:
    """A fault sent to an agent: when (taken before the request), how long the request took, the agent's answer."""

    at: float
    call_s: float
    detail: str
    accepted: bool


def inject(client: PlatformClient, job: dict[str, Any], fault: Fault, victim_rank: int) -> Injection:
    """Inject `fault` into the rank `victim_rank` of `job`'s placement (or its GPU, or its node)."""
    victim = next(r for r in job["placement"] if r["rank"] == victim_rank)
    event = fault_event(fault, job_id=job["id"], rank=victim["rank"], gpu=victim.get("gpu") or 0)
    # Stamped before the call: the NATS connection it opens first counts against Reprise, never for it.
    at = time.time()
    reply = client.inject(event, node_id=victim["node_id"])
    return Injection(at, round(time.time() - at, 3), f"{victim['node_id']}: {reply.detail}", reply.accepted)


def _inject(client: PlatformClient, job: dict[str, Any], outcome: Outcome, settings: Settings) -> None:
    injection = inject(client, job, outcome.fault, settings.victim_rank)
    outcome.injected_at = injection.at
    outcome.extra["inject_call_s"], outcome.extra["injected"] = injection.call_s, injection.detail
    if not injection.accepted:
        outcome.notes.append(f"the fault was refused: {injection.detail}")


def _analyse(client: PlatformClient, job_id: str, logs: RankZeroLogs, outcome: Outcome) -> None:
    """The incident (detection), the recovery's steps, and rank 0's lines after the fault (progress)."""
    if outcome.injected_at is None:
        return
    since = outcome.injected_at - 1.0  # stamps come from other processes' clocks on the same host
    incidents = sorted(
        (i for i in client.incidents(job_id) if unix_time(i["opened_at"]) >= since), key=lambda i: i["opened_at"]
    )
    if incidents:
        first = incidents[0]
        outcome.detected_at = unix_time(first["opened_at"])
        outcome.detected_by = f"incident {first['category']}: {first['root_cause']}"[:160]
        outcome.extra["incidents"] = len(incidents)
    recoveries = [r for r in client.recoveries(job_id) if unix_time(r["started_at"]) >= since]
    if recoveries:
        outcome.extra |= recovery_figures(recoveries[-1], outcome.injected_at)  # newest first: the earliest
        outcome.extra["recoveries"] = len(recoveries)
    outcome.resume_from_lines(logs.lines(min_epoch=1), since=outcome.injected_at)


def recovery_figures(recovery: dict[str, Any], injected_at: float) -> dict[str, Any]:
    """What the orchestrator did: outcome, placement, checkpoint, each step's seconds."""
    data = {step["step"]: step.get("data") or {} for step in recovery["steps"]}
    finished = recovery.get("finished_at")
    return {
        "recovery_outcome": recovery.get("outcome"),
        "recovery_attempts": recovery.get("attempt"),
        "recovery_running_after_s": round(unix_time(finished) - injected_at, 2) if finished else None,
        "placement_decision": data.get("placing", {}).get("decision"),
        "cordoned": data.get("isolating", {}).get("cordoned"),
        "restored_checkpoint": data.get("restoring", {}).get("checkpoint"),
        "resumed": data.get("verifying", {}).get("resumed"),  # the ranks' state: from the survivors, or why not
        "recovery_steps_s": {step["step"]: _rounded(step_seconds(step)) for step in recovery["steps"]},
    }


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 3)


def unix_time(stamp: str) -> float:
    """A service's ISO 8601 timestamp as unix time."""
    return datetime.fromisoformat(stamp).timestamp()
