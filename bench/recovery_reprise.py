"""Reprise's cells of bench_recovery: the example as a job on a fresh local stack, several faults, the recoveries.

Cold: ``restart_mode: "cold"``, no standbys (every recovery stops all ranks and starts them again as new processes).
Fast path: ``restart_mode: "auto"``, the script run with ``--in-place`` (surviving ranks re-enter the training function
in their processes), agents with warm standbys. The stack has 4 nodes and a spare per fault a recovery may leave behind
(a cordoned GPU's node, a lost node), 1 rank per node; the policy allows every fault of the cell (restarts, the same
root cause in a row, cordons). On the fast path each fault waits until every live node has a warm standby ready again
(a fleet's standbys are back long before its next fault; the agents refill 2 s after a standby is taken instead of
10 s, so that the bench's faults can come seconds apart), and the standbys' memory is read from the node reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.recovery_containers import containerized, job_root
from bench.recovery_track import CellRun, FaultRecord, FaultTracker, RecoverySettings, System
from bench.vs_torchrun_common import Fault, step_of
from bench.vs_torchrun_reprise import (
    RankZeroLogs,
    follow_job,
    inject,
    job_body,
    platform,
    recovery_figures,
    unix_time,
)
from reprise_cli.client import PlatformClient
from reprise_cli.stack import Stack
from reprise_cli.topology import Runtime
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.events import GpuHealth, NodeReport
from reprise_orchestrator.settings import OrchestratorSettings

STANDBY_SPARES = OrchestratorSettings.model_fields["standby_spares"].default  # spares keeping a job's standbys
LATE = "standbys not ready again by the last fault step:"  # the note of a cell that ran out of steps
REPORT_FRESH_S = 3.0  # a node whose last report is older is gone (lost) and has no standbys to wait for
STAMP_SLACK_S = 0.1  # incidents and injections are stamped by processes on one host, one clock: a fault owns what
# opens from just before its injection until just before the next


class NodeReports:
    """The latest report of every node, read from NATS in a thread of its own, for the standbys' state and memory."""

    def __init__(self, client: PlatformClient) -> None:
        self.client = client
        self.latest: dict[str, tuple[float, NodeReport]] = {}
        self.rss_bytes: dict[int, int] = {}  # a ready standby's pid → its largest RSS seen
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._follow()), name="node-reports", daemon=True)

    def __enter__(self) -> NodeReports:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    async def _follow(self) -> None:
        bus = Bus(url=self.client.nats_url, service="bench-recovery", nkey_seed_file=self.client.nkey_seed_file)
        await bus.connect(attempts=5)
        try:
            await bus.nc.subscribe(subjects.AGENT_REPORTS, cb=self._on_report)
            while not self._stop.is_set():
                await asyncio.sleep(0.2)
        finally:
            await bus.close()

    async def _on_report(self, msg: Any) -> None:
        report = NodeReport.model_validate_json(msg.data)
        self.latest[report.node_id] = (time.time(), report)
        for standby in report.standbys:
            if standby.ready and standby.rss_bytes:
                self.rss_bytes[standby.pid] = max(standby.rss_bytes, self.rss_bytes.get(standby.pid, 0))

    def ready_standbys(self) -> dict[str, tuple[int, str]]:
        """Ready standbys per live node, and what the node is: "ranks" (it runs some), "spare" (a spare that could take
        some: every GPU usable) or "" (neither: a node a fault left out)."""
        now = time.time()
        found = {}
        for node, (seen, report) in list(self.latest.items()):
            if now - seen >= REPORT_FRESH_S:
                continue
            usable = all(g.health in (GpuHealth.OK, GpuHealth.DEGRADED) for g in report.gpus)
            role = "ranks" if report.ranks else "spare" if report.spare and usable else ""
            found[node] = (sum(s.ready for s in report.standbys), role)
        return found

    def warm(self, at_least: int, *, serving: bool = False) -> bool:
        """Every live node has `at_least` ready standbys. `serving` (a containerized job, whose standbys only the
        nodes that run its ranks and the first STANDBY_SPARES spares keep): every node that runs ranks, and as many
        spares as the orchestrator tells to keep them (all of them, where fewer)."""
        ready = self.ready_standbys()
        if not ready:
            return False
        if not serving:
            return all(count >= at_least for count, _ in ready.values())
        spares = [count >= at_least for count, role in ready.values() if role == "spare"]
        return all(count >= at_least for count, role in ready.values() if role == "ranks") and (
            sum(spares) >= min(STANDBY_SPARES, len(spares))
        )

    def memory(self) -> dict[str, Any]:
        """The ready standbys' resident memory (the largest reading of each)."""
        sizes = sorted(self.rss_bytes.values())
        if not sizes:
            return {"standbys_seen": 0}
        return {
            "standbys_seen": len(sizes),
            "standby_rss_mb_median": round(statistics.median(sizes) / 2**20, 1),
            "standby_rss_mb_max": round(sizes[-1] / 2**20, 1),
        }


def policy(system: System, settings: RecoverySettings) -> dict[str, Any]:
    """The job's policy: every fault of the cell allowed, the hang limit, and the restart mode of the system."""
    allowance = settings.faults + 3
    return {
        "max_restarts": allowance,
        "max_same_error": allowance,  # the same fault five times in a row is the bench, not a broken job
        "max_cordon_share": 1.0,  # one node cordoned per XID 79: the circuit breaker would stop the third
        "restart_mode": "auto" if system.in_place else "cold",
    }


def run_cell(system: System, fault: Fault, settings: RecoverySettings, root: Path) -> CellRun:
    """One run of the job with `settings.faults` faults of one kind on a fresh stack."""
    root.mkdir(parents=True)
    # Standby interpreters for a job of processes; for a containerized one, standby containers of its image only
    # (none of the interpreters it would not use, which imported torch beside its containers' on the same cores).
    standbys = settings.standbys if system.standbys and not system.in_containers else 0
    containers = settings.standbys if system.standbys and system.in_containers else 0
    runtime: Runtime = "docker" if system.in_containers else "process"
    stack_of = platform(root, settings, spares=settings.spares(fault), standbys=standbys, runtime=runtime)
    with (
        _agents_environment(
            REPRISE_STANDBY_REFILL_DELAY_S=f"{settings.standby_refill_delay_s:g}",
            REPRISE_CONTAINER_STANDBYS=str(containers),
        ),
        stack_of as (stack, client),
        NodeReports(client) as reports,
    ):
        if standbys and not _wait(lambda: reports.warm(standbys), settings.ready_timeout_s):
            raise RuntimeError(f"the standbys were not ready after {settings.ready_timeout_s:g} s")
        run = _Run(stack, client, settings, CellRun(system, fault, launched_at=time.time()))
        job = run.submit(root)
        if job is None:
            return run.cell
        try:
            run.watch(job, RankZeroLogs(stack.config.state_dir, job["id"]), reports if system.standbys else None)
            _analyse(client, job["id"], run.cell)
            run.cell.extra |= _save_cost(client, job["id"], settings) | (reports.memory() if system.standbys else {})
        finally:
            with contextlib.suppress(httpx.HTTPError):
                client.cancel(job["id"])
        if not run.cell.digest:
            run.cell.notes.append(f"logs kept under {stack.log_dir} and {stack.config.state_dir / 'agents'}")
    run.cell.load_average.append(round(os.getloadavg()[0], 2))
    return run.cell


@contextlib.contextmanager
def _agents_environment(**variables: str) -> Iterator[None]:
    """Variables the stack's processes inherit from this one, for as long as the stack runs."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _wait(ready: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.time() + timeout_s
    while not ready():
        if time.time() > deadline:
            return False
        time.sleep(0.2)
    return True


@dataclass
class _Run:
    """One cell's run on its stack: the job's submission, its faults, its end."""

    stack: Stack
    client: PlatformClient
    settings: RecoverySettings
    cell: CellRun

    def submit(self, root: Path) -> dict[str, Any] | None:
        """Submit the job; None (with the reason in the cell) when it is refused or does not start."""
        system, cell = self.cell.system, self.cell
        in_place = ["--in-place"] if system.in_place else []
        # the checkpoint, on every rank
        env = {"REPRISE_PEER_RESTORE": "0"} if system in (System.FAST, System.FAST_CONTAINER) else {}
        if system.in_containers:  # the job's files under the nodes' mount roots
            root = job_root(self.stack)
        body = job_body(f"recovery-{system.value}-{cell.fault.value}", self.settings, root,
                        policy=policy(system, self.settings), script_args=in_place, env=env)  # fmt: skip
        if system.in_containers:
            body = containerized(body, self.stack, root)
        try:
            job = self.client.submit(body)
        except httpx.HTTPStatusError as exc:
            refused = exc.response.text[:300]
            if system.in_place or "restart_mode" not in refused:
                cell.skipped = f"the orchestrator refused the job: {refused}"
                return None
            # An orchestrator without the field has one path, the cold one: the cell measures it all the same.
            cell.notes.append("the orchestrator has no restart_mode: its only path is the cold one")
            body["policy"].pop("restart_mode")
            job = self.client.submit(body)
        if job["state"] != "running":
            cell.skipped = f"the job did not start: {job['state']} {job.get('detail', '')}"
            return None
        return job

    def watch(self, job: dict[str, Any], logs: RankZeroLogs, reports: NodeReports | None) -> None:
        """Inject each fault when due, until the digest, a stopped job, or the run timeout."""
        tracker, cell = FaultTracker(self.settings), self.cell
        cell.records = tracker.records
        # Containers: one of the job's standby containers ready on each node serving it (at most its ranks there).
        serving = cell.system.in_containers

        def on_line(line: str) -> None:
            tracker.feed(line)
            if not tracker.due(line):
                return
            if reports is None or reports.warm(1, serving=serving):
                self._inject(job["id"], tracker)
            elif (step_of(line) or (0, 0.0))[0] + self.settings.checkpoint_every <= self.settings.steps:
                return
            elif not tracker.records:  # a cell with no fault says nothing: its one fault hits without them
                cell.notes.append("standbys never ready: the cell's one fault hit without them")
                self._inject(job["id"], tracker)
            elif not any(note.startswith(LATE) for note in cell.notes):  # a fault without them is not the fast path
                cell.notes.append(f"{LATE} {len(tracker.records)} faults")

        end = follow_job(
            self.client, job["id"], logs, since=cell.launched_at, limit_s=self.settings.run_timeout_s, on_line=on_line
        )
        cell.digest, cell.finished_at = end.digest, end.at
        cell.extra |= {"final_restart_epoch": end.epoch} if end.digest else {}
        cell.notes += [end.note] if end.note else []

    def _inject(self, job_id: str, tracker: FaultTracker) -> None:
        job = self.client.job(job_id)  # the placement now: an earlier recovery may have moved the victim
        victim = self.settings.victim_rank
        if self.cell.fault is Fault.NODE_LOSS:  # the victim's agent kills itself: the supervisor must leave it dead
            self.stack.hold_node_down(next(r for r in job["placement"] if r["rank"] == victim)["node_id"])
        injection = inject(self.client, job, self.cell.fault, victim)
        record = tracker.injected(injection.at, injection.detail)
        record.extra["inject_call_s"] = injection.call_s
        if not injection.accepted:
            record.extra["refused"] = True


def _analyse(client: PlatformClient, job_id: str, cell: CellRun) -> None:
    """Each fault's first incident (detection) and recovery (what the orchestrator did, step by step)."""
    incidents = sorted(client.incidents(job_id), key=lambda i: i["opened_at"])
    recoveries = sorted(client.recoveries(job_id), key=lambda r: r["started_at"])
    for record, until in zip(cell.records, _window_ends(cell.records), strict=True):
        since = record.injected_at - STAMP_SLACK_S
        incident = next((i for i in incidents if since <= unix_time(i["opened_at"]) < until), None)
        if incident is not None:
            record.detected_at = unix_time(incident["opened_at"])
            record.detected_by = f"incident {incident['category']}: {incident['root_cause']}"[:160]
        recovery = next((r for r in recoveries if since <= unix_time(r["started_at"]) < until), None)
        if recovery is not None:
            record.extra |= recovery_figures(recovery, record.injected_at) | _restart_path(recovery)


def _window_ends(records: list[FaultRecord]) -> list[float]:
    return [record.injected_at - STAMP_SLACK_S for record in records[1:]] + [float("inf")]


def _restart_path(recovery: dict[str, Any]) -> dict[str, Any]:
    """The path the orchestrator chose and why, from whichever step recorded it."""
    for step in recovery["steps"]:
        data = step.get("data") or {}
        chosen = {key: value for key, value in data.items() if "mode" in key or "path" in key or key == "why"}
        if chosen:
            return {"restart_path": chosen}
    return {}


def _save_cost(client: PlatformClient, job_id: str, settings: RecoverySettings) -> dict[str, Any]:
    """The checkpoint save cost the registry's advisor measured for this job (median begin → commit)."""
    try:
        advice = (
            client.http.get(f"{client.registry}/v1/jobs/{job_id}/advisor", params={"node_count": settings.world_size})
            .raise_for_status()
            .json()
        )
    except httpx.HTTPError as exc:
        return {"save_cost_s": None, "save_cost_source": f"advisor unavailable: {exc}"}
    return {"save_cost_s": advice["save_cost_s"], "save_cost_source": advice["save_cost_source"]}
