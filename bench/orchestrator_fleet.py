"""A simulated node fleet for the orchestrator benchmark: asyncio processes that are N agents to the platform.

For each node id it publishes NodeReports (every 1 to 2 s, phases spread) and answers ``reprise.cmd.<node>`` through the
agent's real CommandBook (fence check, at-most-once per command id, highest fence kept in a state file per node).
Its executor starts no process: a launch is recorded and the launched ranks appear in the node's reports, first in
their startup phase; ``--rank-start-s`` (default 1 s, what an in-place restart takes; a cold start of a PyTorch rank
takes several seconds) after the launch they take their first step (step = resume step + 1, so the orchestrator can
verify the recovery) and the node reports at once, as a real agent does at a rank's first heartbeat; the time each
node acknowledged each launch is kept, and how many launch commands each node executed per job and restart epoch
(repeats of a command id answered from the CommandBook are not executions). The benchmark asks for both on
``bench.fleet.launch-acks.<shard>``.

The fleet may be split into shards, one process each (``--shards S --shard k`` takes every S-th node from the k-th):
real agents answer a command at the same time on their own machines, one process answers them one after the other.
Each shard publishes the reports that are due every 0.1 s in one write, not one write per report.

Run by bench/bench_orchestrator.py as
``python -m bench.orchestrator_fleet --nats-url ... --nodes N --state-dir D [--shards S --shard k]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import random
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import nats.errors
from pydantic import AwareDatetime, Field, TypeAdapter

from reprise_agent.commands import CommandBook
from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.clock import utcnow
from reprise_common.errors import BusError
from reprise_common.events import (
    CaptureStacksCommand,
    CommandReply,
    CommandResult,
    GpuStatus,
    LaunchCommand,
    NodeReport,
    PingCommand,
    PrepareStandbysCommand,
    RankStatus,
    StopCommand,
    Wire,
    new_id,
    parse_command,
)
from reprise_common.logging import configure_logging, get_logger

log = get_logger("bench.fleet")
REPORT_TICK_S = 0.1
RANK_START_S = 1.0  # launch → a simulated rank's first heartbeat (an in-place restart's figure)


def node_names(count: int) -> list[str]:
    """The fleet's node ids, sorted as the orchestrator sorts them."""
    return [f"sim-{index:04d}" for index in range(count)]


def shard_nodes(count: int, *, shard: int, shards: int) -> list[str]:
    """The node ids one shard of the fleet simulates: every `shards`-th, from the `shard`-th."""
    return node_names(count)[shard::shards]


def shard_of(node_id: str, *, shards: int) -> int:
    """Which shard simulates a node (the inverse of `shard_nodes`)."""
    return int(node_id.rsplit("-", 1)[1]) % shards


def acks_subject(shard: int) -> str:
    """Where one shard answers the benchmark's LaunchAcksQuery."""
    return f"bench.fleet.launch-acks.{shard}"


class LaunchAcksQuery(Wire):
    """Wait until `nodes` nodes acknowledged the launch of a job's restart epoch, then answer (0: answer now)."""

    job_id: str
    restart_epoch: int = Field(ge=0)
    nodes: int = Field(ge=0)
    timeout_s: float = Field(default=60.0, gt=0)


class LaunchAcks(Wire):
    """Unix time at which each node acknowledged the launch (its first answer, not repeats), and the launch commands
    each node executed for the job so far, per restart epoch (every epoch, not only the one asked about)."""

    job_id: str
    restart_epoch: int
    acked_at: dict[str, float] = Field(default_factory=dict)
    complete: bool = False
    launches: dict[str, dict[int, int]] = Field(default_factory=dict)


@dataclass
class SimNode:
    """One simulated agent: its command book and the ranks its reports show."""

    node_id: str
    book: CommandBook
    ranks: dict[tuple[str, int], RankStatus] = field(default_factory=dict)
    report: bytes | None = None  # the serialised report with placeholders for its id and time; None: rebuild
    report_due: float = 0.0  # monotonic time of its next report


class Fleet:
    """N simulated agents on one NATS connection."""

    def __init__(
        self,
        bus: Bus,
        node_ids: list[str],
        *,
        state_dir: Path,
        gpus: int,
        shard: int = 0,
        seed: int = 1,
        rank_start_s: float = RANK_START_S,
    ) -> None:
        self.bus = bus
        self.rank_start_s = rank_start_s
        self.shard = shard
        self.gpus = [GpuStatus(index=g, uuid=f"GPU-sim-{g}", temperature_c=55.0) for g in range(gpus)]
        self.nodes = {
            node_id: SimNode(node_id, CommandBook(node_id=node_id, state_file=state_dir / node_id / "fences.json"))
            for node_id in node_ids
        }
        self.random = random.Random(seed + shard)  # noqa: S311 - report jitter, not a secret
        self._acks: dict[tuple[str, int], dict[str, float]] = {}
        self._launches: dict[str, dict[str, dict[int, int]]] = {}  # job → node → restart epoch → executed
        self._acked = asyncio.Condition()
        self._tasks: list[asyncio.Task[None]] = []
        self._starting: set[asyncio.Task[None]] = set()  # launched ranks waiting to take their first step

    async def start(self) -> None:
        """Answer every node's commands and the benchmark's queries, then start reporting."""
        for node in self.nodes.values():
            await self.bus.serve(subjects.node_command(node.node_id), self._answerer(node))
        await self.bus.serve(acks_subject(self.shard), self._on_query)
        self._tasks.append(asyncio.create_task(self._report_loop(), name="reports"))

    async def stop(self) -> None:
        """Stop reporting."""
        tasks = [*self._tasks, *self._starting]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _answerer(self, node: SimNode) -> Callable[[bytes], Awaitable[Wire]]:
        async def on_command(data: bytes) -> Wire:
            command = parse_command(data)
            reply = await node.book.run(command, lambda c: self._execute(node, c))
            if isinstance(command, LaunchCommand) and reply.result is CommandResult.DONE and not reply.duplicate:
                await self._record_ack(node.node_id, command)
            return reply

        return on_command

    async def _record_ack(self, node_id: str, command: LaunchCommand) -> None:
        key = (command.job_id, command.args.restart_epoch)
        async with self._acked:
            self._acks.setdefault(key, {})[node_id] = time.time()  # wall clock: compared with the publisher's
            self._acked.notify_all()

    async def _execute(
        self,
        node: SimNode,
        command: PingCommand | LaunchCommand | StopCommand | PrepareStandbysCommand | CaptureStacksCommand,
    ) -> CommandReply:
        if isinstance(command, LaunchCommand):
            epoch = command.args.restart_epoch
            per_epoch = self._launches.setdefault(command.job_id, {}).setdefault(node.node_id, {})
            per_epoch[epoch] = per_epoch.get(epoch, 0) + 1
            resume_step = 0  # the benchmark's jobs have no validated checkpoint: they resume from the beginning
            node.ranks = {  # one job per node at a time, as the benchmark runs them
                (command.job_id, a.rank): RankStatus(
                    job_id=command.job_id,
                    rank=a.rank,
                    restart_epoch=epoch,
                    gpu=a.gpu,
                )
                for a in command.args.ranks
            }
            node.report = None
            start = asyncio.create_task(self._first_step(node, command.job_id, epoch, resume_step + 1))
            self._starting.add(start)
            start.add_done_callback(self._starting.discard)
            data: dict[str, object] = {"pids": [0] * len(node.ranks)}
        elif isinstance(command, StopCommand):
            stopped = [key for key in node.ranks if key[0] == command.job_id]
            for key in stopped:
                del node.ranks[key]
            node.report = None
            data = {"stopped": [{"rank": rank, "exit_code": None, "signal": "SIGTERM"} for _job, rank in stopped]}
        elif isinstance(command, PrepareStandbysCommand):
            data = {"standbys": 0}  # simulated nodes keep no standbys
        elif isinstance(command, CaptureStacksCommand):
            data = {"captured": [], "failed": []}  # simulated ranks have no Python stacks
        else:
            data = {"ranks": len(node.ranks), "spare": False}
        return CommandReply(command_id=command.command_id, node_id=node.node_id, result=CommandResult.DONE, data=data)

    async def _first_step(self, node: SimNode, job_id: str, epoch: int, step: int) -> None:
        """The launched ranks take their first step after the start time, and the node reports at once."""
        await asyncio.sleep(self.rank_start_s)
        launched = {key: rank for key, rank in node.ranks.items() if key[0] == job_id and rank.restart_epoch == epoch}
        if not launched:  # stopped or relaunched meanwhile
            return
        for key, rank in launched.items():
            node.ranks[key] = rank.model_copy(update={"step": step, "phase": "training", "heartbeat_age_s": 0.0})
        node.report = None
        await self._publish_report(node)
        node.report_due = time.monotonic() + self.random.uniform(1.0, 2.0)

    async def _on_query(self, data: bytes) -> Wire:
        query = LaunchAcksQuery.model_validate_json(data)
        key = (query.job_id, query.restart_epoch)
        async with self._acked:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._acked.wait_for(lambda: len(self._acks.get(key, {})) >= query.nodes), query.timeout_s
                )
            acked = dict(self._acks.get(key, {}))
        launches = {node: dict(epochs) for node, epochs in self._launches.get(query.job_id, {}).items()}
        return LaunchAcks(
            job_id=query.job_id,
            restart_epoch=query.restart_epoch,
            acked_at=acked,
            complete=len(acked) >= query.nodes,
            launches=launches,
        )

    async def _report_loop(self) -> None:
        start = time.monotonic()
        for node in self.nodes.values():  # spread the fleet's reports over time
            node.report_due = start + self.random.uniform(0.0, 1.0)
        while True:
            now = time.monotonic()
            for node in self.nodes.values():
                if node.report_due <= now:
                    await self._publish_report(node)
                    node.report_due = now + self.random.uniform(1.0, 2.0)
            await asyncio.sleep(REPORT_TICK_S)

    async def _publish_report(self, node: SimNode) -> None:
        if node.report is None:
            node.report = self._report_template(node)
        # Only the id and the time change between reports: patch them into the serialised template, which
        # costs the fleet a fraction of serialising N reports a second.
        data = node.report.replace(_SENTINEL_ID, new_id().encode()).replace(_SENTINEL_TIME, _json_time(utcnow()))
        try:
            # A report is a snapshot: core publish, as agents do, keeps the fleet's time for
            # answering commands rather than waiting for N publish acknowledgements a second. The client buffers
            # it; the tick's reports leave in one write.
            await self.bus.nc.publish(subjects.node_report(node.node_id), data)
        except (BusError, nats.errors.Error):
            log.warning("report not sent", extra={"node_id": node.node_id})

    def _report_template(self, node: SimNode) -> bytes:
        report = NodeReport(
            event_id=_SENTINEL_ID.decode(),
            time=SENTINEL_TIME,
            source=node.node_id,
            node_id=node.node_id,
            address="127.0.0.1",
            interval_s=1.5,
            gpu_backend="sim",
            gpus=self.gpus,
            ranks=list(node.ranks.values()),
        )
        return report.to_bytes()


def _json_time(moment: datetime) -> bytes:
    return _TIME.dump_json(moment)


SENTINEL_TIME = datetime(2000, 1, 1, tzinfo=UTC)
_TIME: TypeAdapter[datetime] = TypeAdapter(AwareDatetime)
_SENTINEL_ID = b"f" * 32
_SENTINEL_TIME = _json_time(SENTINEL_TIME)


async def run(
    nats_url: str, node_ids: list[str], state_dir: Path, *, gpus: int, shard: int, rank_start_s: float
) -> None:
    """Be the fleet (or one shard of it) until SIGTERM."""
    bus = Bus(url=nats_url, service=f"bench-fleet-{shard}", provision=False)
    await bus.connect(attempts=40)
    fleet = Fleet(bus, node_ids, state_dir=state_dir, gpus=gpus, shard=shard, rank_start_s=rank_start_s)
    await fleet.start()
    # A real agent's heap is small; one process holding N agents would pause for full collections N times larger.
    gc.collect()
    gc.freeze()
    log.info("fleet up", extra={"nodes": len(node_ids), "shard": shard})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await fleet.stop()
    await bus.close()


def main() -> None:
    """Parse the command line and run the fleet."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nats-url", required=True)
    parser.add_argument("--nodes", type=int, required=True, help="the whole fleet's size")
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--shards", type=int, default=1, help="processes the fleet is split into")
    parser.add_argument("--shard", type=int, default=0, help="which of them this is (0-based)")
    parser.add_argument("--rank-start-s", type=float, default=RANK_START_S, help="launch → a rank's first step")
    args = parser.parse_args()
    configure_logging("bench-fleet", level="WARNING", fmt="text")
    node_ids = shard_nodes(args.nodes, shard=args.shard, shards=args.shards)
    asyncio.run(
        run(args.nats_url, node_ids, args.state_dir, gpus=args.gpus, shard=args.shard, rank_start_s=args.rank_start_s)
    )


if __name__ == "__main__":
    main()
