"""Rank supervision: the job's ranks on this node, started through a launcher, watched, parked, stopped."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from reprise_agent.launch.base import ImageLaunchers, Launcher, RankHandle
from reprise_agent.launch.container_policy import LaunchRefusedError
from reprise_agent.ledger import LostRank, load_launch, read_ledger, save_launch, write_ledger
from reprise_agent.progress.messages import MessageKind, SdkMessage
from reprise_agent.rank_env import rank_env, write_resume_files
from reprise_common.errors import RepriseError
from reprise_common.events import LaunchArgs, RankAssignment, RankStatus
from reprise_common.logging import get_logger
from reprise_common.procs import describe_exit

log = get_logger("reprise.agent.ranks")


@dataclass
class RankProcess:
    """One running (or finished) rank."""

    job_id: str
    rank: int
    local_rank: int
    gpu: int | None
    handle: RankHandle
    log_path: Path
    tail: deque[str]
    restart_epoch: int = 0
    stopping: bool = False
    exit_code: int | None = None
    exit_signal: str | None = None
    oom_killed: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)
    in_place: bool = False  # it runs under reprise_sdk.run: it can be parked and handed the next epoch
    signalled: bool = False  # this agent signalled it (a stop, an injected fault): not an outside signal
    parked: asyncio.Event = field(default_factory=asyncio.Event)  # it waits for the next epoch
    parked_why: str = ""
    state_seen: str = ""  # its scheduler state at the last status() ...
    state_since: float = 0.0  # ... and since when (monotonic) the samples showed it, in a row

    @property
    def alive(self) -> bool:
        """True until the process has exited."""
        return not self.done.is_set()

    def status(self) -> RankStatus:
        """This rank as a node report shows it; a live one with its scheduler state and CPU time."""
        sample = self.handle.usage() if self.alive else None
        state, now = sample.state if sample else "", time.monotonic()
        if state != self.state_seen:
            self.state_seen, self.state_since = state, now
        return RankStatus(
            job_id=self.job_id,
            rank=self.rank,
            restart_epoch=self.restart_epoch,
            pid=self.handle.pid,
            gpu=self.gpu,
            alive=self.alive,
            exit_code=None if self.alive else self.handle.returncode,  # negative for a signal, as the schema says
            proc_state=state,
            proc_state_age_s=round(now - self.state_since, 3) if state else None,
            cpu_s=sample.cpu_s if sample else None,
            io_bytes=self.handle.io_bytes() if self.alive else None,
        )


ExitCallback = Callable[[RankProcess], Awaitable[None]]
ParkedCallback = Callable[[RankProcess], None]


class RankSupervisor:
    """Starts, watches and stops ranks; calls on_exit for every exit it did not cause itself, and on_parked once each
    time a rank that can restart in place says it parked."""

    def __init__(
        self,
        *,
        node_id: str,
        state_dir: Path,
        launcher: Launcher,
        on_exit: ExitCallback,
        on_parked: ParkedCallback | None = None,
        tail_lines: int = 50,
        sdk_socket: Path | None = None,
        inbox_dir: Path | None = None,
        containers: ImageLaunchers | None = None,
    ) -> None:
        self.node_id = node_id
        self.launcher = launcher
        self.containers = containers  # the launchers of jobs whose ranks run in an image; None: this node runs none
        self.sdk_socket = sdk_socket
        self.inbox_dir = inbox_dir
        if inbox_dir is not None:
            inbox_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._orders = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # the agent → rank channel (in place)
        self._orders.setblocking(False)
        self.launches: dict[str, LaunchArgs] = {}  # job id → its latest launch on this node
        self.log_dir = state_dir / "ranks"
        self.ledger = self.log_dir / "live.json"  # the ranks running now, for the next agent if this one dies
        self.on_exit = on_exit
        self.on_parked = on_parked
        self.tail_lines = tail_lines
        self._ranks: dict[tuple[str, int], RankProcess] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def ranks(self) -> list[RankProcess]:
        """Every rank this agent knows, running or finished (finished ones until the job is stopped)."""
        return list(self._ranks.values())

    def rank_on_gpu(self, gpu: int) -> RankProcess | None:
        """The live rank using a GPU, if any."""
        return next((r for r in self._ranks.values() if r.gpu == gpu and r.alive), None)

    async def launch(self, job_id: str, spec: LaunchArgs) -> tuple[list[int], list[int]]:
        """Start this node's ranks of a job: a parked rank (restart in place) takes an assignment on its own GPU, the
        others start afresh; parked ranks left over are stopped. Any other earlier rank must be stopped first.

        Returns the pids of the ranks and the ranks restarted in place.
        """
        parked = [r for r in self._ranks.values() if r.job_id == job_id and r.alive and r.parked.is_set()]
        if any(r.alive and not r.parked.is_set() for r in self._ranks.values() if r.job_id == job_id):
            raise RuntimeError(f"job {job_id} already has live ranks on {self.node_id}: stop it first")
        launcher = self._launcher(spec)  # a refused container spec or a missing image fails before anything changes
        self._forget(job_id)
        for rank in parked:  # they are re-keyed by their new rank below
            del self._ranks[(job_id, rank.rank)]
        self.launches[job_id] = spec
        save_launch(self.log_dir / job_id, spec)
        resume_files = write_resume_files(self.log_dir / job_id, spec)
        pids, in_place = [], []
        for assignment in spec.ranks:
            taken = next((r for r in parked if r.gpu == assignment.gpu), None)
            if taken is not None:
                parked.remove(taken)
                if self._assign(taken, job_id, spec, assignment, resume_files):
                    self._ranks[(job_id, assignment.rank)] = taken
                    pids.append(taken.handle.pid)
                    in_place.append(assignment.rank)
                    continue
                self._discard(taken)
            rank = await self._start(launcher, job_id, spec, assignment, resume_files)
            self._ranks[(job_id, assignment.rank)] = rank
            pids.append(rank.handle.pid)
        for rank in parked:  # more parked ranks than this node's share of the new epoch
            self._discard(rank)
        self._record()
        return pids, in_place

    def _launcher(self, spec: LaunchArgs) -> Launcher:
        """The job's launcher: processes, or containers of its image when its spec names one."""
        if spec.container is None:
            return self.launcher
        if self.containers is None:
            raise LaunchRefusedError("container: this node runs no containers (its agent has no REPRISE_DOCKER_URL)")
        return self.containers.for_job(spec)

    def _assign(
        self, rank: RankProcess, job_id: str, spec: LaunchArgs, assignment: RankAssignment, resume_files: Path | None
    ) -> bool:
        """Hand a parked rank the next epoch through its inbox; False when it is unreachable (it is then replaced)."""
        env = rank.handle.rank_env(self._env(job_id, spec, assignment, resume_files))
        if not self._order(rank, {"k": "assign", "env": env}):
            return False
        rank.rank, rank.local_rank, rank.restart_epoch = assignment.rank, assignment.local_rank, spec.restart_epoch
        rank.parked.clear()
        rank.parked_why = ""
        rank.tail.clear()  # an exit's log tail must be this epoch's, not the peer error that parked it
        rank.log_path = self._log_path(job_id, spec.restart_epoch, assignment.rank)  # the pump moves to it
        log.info("rank restarted in place", extra={"job_id": job_id, "rank": rank.rank, "pid": rank.handle.pid})
        return True

    def _env(
        self, job_id: str, spec: LaunchArgs, assignment: RankAssignment, resume_files: Path | None
    ) -> dict[str, str]:
        """What a rank of this launch finds in its environment on top of the agent's own."""
        return rank_env(
            job_id,
            spec,
            assignment,
            node_id=self.node_id,
            resume_files=resume_files,
            sdk_socket=self.sdk_socket,
            inbox_dir=self.inbox_dir,
        )

    def _log_path(self, job_id: str, epoch: int, rank: int) -> Path:
        """Where a rank's output of one restart epoch goes (its directory created)."""
        path = self.log_dir / job_id / f"epoch-{epoch}-rank-{rank}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def _order(self, rank: RankProcess, order: dict[str, object]) -> bool:
        """Send one order to a rank's inbox (``<inbox dir>/<pid>.sock``); False when it is not there."""
        if self.inbox_dir is None:
            return False
        try:
            self._orders.sendto(json.dumps(order).encode(), str(self.inbox_dir / f"{rank.handle.pid}.sock"))
        except OSError as exc:
            log.warning("rank's inbox unreachable", extra={"job_id": rank.job_id, "rank": rank.rank, "error": str(exc)})
            return False
        return True

    def _discard(self, rank: RankProcess) -> None:
        """Stop a parked rank the new epoch has no place for (its exit is not a fault)."""
        rank.stopping = True
        rank.handle.kill()

    def on_sdk_message(self, message: SdkMessage) -> None:
        """A rank says it can restart in place, or that it is parked; a message of an earlier epoch is ignored."""
        rank = self._ranks.get((message.job_id, message.rank))
        if rank is None or not rank.alive or rank.restart_epoch != message.restart_epoch:
            return
        if message.kind is MessageKind.IN_PLACE:
            rank.in_place = True
            self._record()  # an adopting agent must know it can park
        elif message.kind is MessageKind.PARKED and rank.in_place and not rank.parked.is_set():
            rank.parked_why = message.why
            rank.parked.set()
            if self.on_parked is not None:
                self.on_parked(rank)

    def _record(self) -> None:
        """Write the ledger of running ranks (atomically): a rank whose agent dies is not forgotten."""
        write_ledger(self.ledger, [
            {"job_id": r.job_id, "rank": r.rank, "restart_epoch": r.restart_epoch, "local_rank": r.local_rank,
             "gpu": r.gpu, "in_place": r.in_place, **r.handle.record(), "log": str(r.log_path)}
            for r in self._ranks.values() if r.alive and not r.stopping
        ])  # fmt: skip

    def orphans(self) -> list[LostRank]:
        """The ranks an earlier process of this agent left running when it died (killed or crashed): a rank whose
        container still runs is adopted (supervised on as if this process had started it); the others died with it,
        or are killed now (nothing supervises them any more), and are returned to be reported lost."""
        lost, adopted = [], set[str]()
        for entry in read_ledger(self.ledger):
            if self._adopt(entry) is not None:
                adopted.add(str(entry["container_id"]))
                continue
            containers = self.containers if "container_id" in entry else None
            with contextlib.suppress(RepriseError):  # a daemon that is down: its containers are its to end
                (containers or self.launcher).kill_lost(entry)
            lost.append(LostRank.of(entry))
        if self.containers is not None:
            with contextlib.suppress(RepriseError):  # containers of this node the ledger did not name
                self.containers.remove_strays(self.node_id, keep=adopted)
        self._record()
        return lost

    def _adopt(self, entry: dict[str, Any]) -> RankProcess | None:
        """Supervise on a containerized rank of the dead agent's ledger, when its container still runs it."""
        if self.containers is None or "container_id" not in entry:
            return None
        try:
            handle = self.containers.adopt(entry)
        except RepriseError:  # the daemon does not answer: the rank is removed and reported lost
            return None
        if handle is None:
            return None
        job_id = str(entry["job_id"])
        rank = RankProcess(
            job_id=job_id, rank=int(entry["rank"]), local_rank=int(entry.get("local_rank") or 0),
            gpu=entry.get("gpu"), handle=handle, log_path=Path(entry["log"]), tail=deque(maxlen=self.tail_lines),
            restart_epoch=int(entry["restart_epoch"]), in_place=bool(entry.get("in_place")),
        )  # fmt: skip
        self._ranks[(job_id, rank.rank)] = rank
        if job_id not in self.launches and (spec := load_launch(self.log_dir / job_id)) is not None:
            self.launches[job_id] = spec
        self._supervise(rank)
        log.info("rank adopted", extra={"job_id": job_id, "rank": rank.rank, "pid": handle.pid})
        return rank

    async def _start(
        self, launcher: Launcher, job_id: str, spec: LaunchArgs, assignment: RankAssignment, resume_files: Path | None
    ) -> RankProcess:
        env = self._env(job_id, spec, assignment, resume_files)
        log_path = self._log_path(job_id, spec.restart_epoch, assignment.rank)
        # Standbys serve relaunches: a job's first start is on no recovery's critical path, and taking them then would
        # leave none for its first fault.
        handle = await launcher.start(spec.command, env=env, cwd=spec.cwd, warm=spec.restart_epoch > 0)
        rank = RankProcess(
            job_id=job_id,
            rank=assignment.rank,
            local_rank=assignment.local_rank,
            gpu=assignment.gpu,
            handle=handle,
            log_path=log_path,
            tail=deque(maxlen=self.tail_lines),
            restart_epoch=spec.restart_epoch,
        )
        self._supervise(rank)
        log.info(
            "rank started", extra={"job_id": job_id, "rank": assignment.rank, "pid": handle.pid, "warm": handle.warm}
        )
        return rank

    def _supervise(self, rank: RankProcess) -> None:
        task = asyncio.create_task(self._watch(rank), name=f"rank:{rank.job_id}:{rank.rank}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch(self, rank: RankProcess) -> None:
        await self._pump(rank, rank.handle.output)
        returncode = await rank.handle.wait()
        rank.exit_code, rank.exit_signal = describe_exit(returncode)
        rank.oom_killed = rank.handle.oom_killed()
        rank.done.set()
        log.info(
            "rank exited",
            extra={
                "job_id": rank.job_id,
                "rank": rank.rank,
                "code": rank.exit_code,
                "signal": rank.exit_signal,
            },
        )
        self._record()
        if not rank.stopping:
            await self.on_exit(rank)

    @staticmethod
    async def _pump(rank: RankProcess, stream: asyncio.StreamReader) -> None:
        """Copy the rank's output into its log, the current epoch's file (a rank restarted in place changes epoch)."""
        path = rank.log_path
        sink: IO[str] = path.open("a", encoding="utf-8")
        try:
            while True:
                try:
                    raw = await stream.readline()
                except ValueError:  # a line longer than the stream limit: keep what fits
                    raw = await stream.read(64 * 1024)
                if not raw:
                    return
                if rank.log_path != path:
                    sink.close()
                    path = rank.log_path
                    sink = path.open("a", encoding="utf-8")
                line = raw.decode("utf-8", errors="replace").rstrip("\n")
                rank.tail.append(line[:2000])
                sink.write(line + "\n")
                sink.flush()
        finally:
            sink.close()

    def kill(self, rank: RankProcess, sig: int = signal.SIGKILL) -> None:
        """Signal a rank (all of it), as a fault would (the exit is reported)."""
        rank.signalled = True
        rank.handle.signal(sig)

    async def park(self, job_id: str, *, within_s: float, kill: Set[int] = frozenset()) -> list[RankProcess]:
        """Have the job's ranks that can restart in place (not those in `kill`) park: each is ordered to, and the
        ones parked within `within_s` are returned; they are left alive for the next launch."""
        able = [r for r in self._ranks.values() if r.job_id == job_id and r.alive and r.in_place and r.rank not in kill]
        for rank in able:
            if not rank.parked.is_set():
                self._order(rank, {"k": "park"})
        waits = [asyncio.wait_for(r.parked.wait(), timeout=within_s) for r in able if not r.parked.is_set()]
        await asyncio.gather(*waits, return_exceptions=True)
        return [r for r in able if r.alive and r.parked.is_set()]

    async def stop(self, job_id: str, *, grace_s: float, keep: Set[int] = frozenset()) -> list[RankProcess]:
        """SIGTERM every rank of the job but those in `keep` (parked), wait up to grace_s, then SIGKILL them."""
        ranks = [r for r in self._ranks.values() if r.job_id == job_id and r.rank not in keep]
        for rank in ranks:
            rank.stopping = True
            if rank.alive:
                rank.signalled = True
                rank.handle.terminate()
        waits = [asyncio.wait_for(r.done.wait(), timeout=grace_s) for r in ranks if r.alive]
        results = await asyncio.gather(*waits, return_exceptions=True)
        if any(isinstance(result, TimeoutError) for result in results):
            for rank in ranks:
                if rank.alive:
                    self.kill(rank, signal.SIGKILL)
            await asyncio.gather(*(r.done.wait() for r in ranks))
        for rank in ranks:  # nothing of the rank may survive its main process
            rank.handle.kill()
        return ranks

    def _forget(self, job_id: str) -> None:
        for key in [k for k, r in self._ranks.items() if r.job_id == job_id and not r.alive]:
            del self._ranks[key]

    async def stop_all(self, *, grace_s: float) -> None:
        """Stop every job's ranks (agent shutdown)."""
        for job_id in {r.job_id for r in self._ranks.values()}:
            await self.stop(job_id, grace_s=grace_s)
