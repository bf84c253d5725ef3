"""The baseline of bench_recovery: ``until torchrun ...; do :; done``, every failure a cold restart of everything.

torchrun runs with ``--max-restarts 0``: a failed worker ends it (its agent stops the other workers) and the shell
starts it again, a fresh agent with a fresh store, and the script resumes from its newest committed checkpoint
(``--resume-latest``). Rank crash and XID 79 (to a process on a GPU that fell off the bus, the same death): SIGKILL of
rank 3's worker. Hang: SIGSTOP of it; nothing watches progress, so the loop restarts only when the peers' collective
times out (the script's 5 minutes), and the cell gives up after ``hang_bound_s``. Node loss: two "nodes", each its own
loop of ``torchrun --nnodes 1:2`` (c10d rendezvous, 2 workers each); the node not holding rank 0 is SIGKILLed, loop,
agent and workers; the survivor's loop carries on at world size 2, and a replacement node's loop is started once
training moves again (a node back from the cluster), so the next fault finds the full world again.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from bench.recovery_track import SCRIPT_COLLECTIVE_TIMEOUT_S, CellRun, FaultTracker, RecoverySettings, System
from bench.vs_torchrun_common import POLL_S, Fault, digest_of
from bench.vs_torchrun_torchrun import AGENT_NOTICED, Agents, worker_ranks
from reprise_cli.servers import ManagedProcess, free_port

LAST_CALL_S = 3  # c10d's wait for more nodes once the minimum joined (default 30 s, which would add to every loss)


def run_cell(fault: Fault, settings: RecoverySettings, root: Path) -> CellRun:
    """One run of the loop with `settings.faults` faults of one kind; everything it started is killed at the end."""
    root.mkdir(parents=True)
    cell = CellRun(System.LOOP, fault, launched_at=time.time())
    agents = Agents(root)
    nodes = _Nodes(agents, settings) if fault is Fault.NODE_LOSS else None
    try:
        if nodes is None:
            agents.start("loop", _standalone_args(settings), settings, loop=True)
        else:
            nodes.start("node-a")
            nodes.start("node-b")
        _watch(agents, nodes, cell, settings)
    finally:
        agents.kill_all()
    _detections(agents, cell)
    cell.load_average.append(round(os.getloadavg()[0], 2))
    return cell


def _standalone_args(settings: RecoverySettings) -> list[str]:
    return ["--standalone", "--nproc-per-node", str(settings.world_size), "--max-restarts", "0"]


class _Nodes:
    """The node loops of a node-loss cell (they share one rendezvous endpoint) and which of them are gone."""

    def __init__(self, agents: Agents, settings: RecoverySettings) -> None:
        self.agents, self.settings, self.port = agents, settings, free_port()
        self.lost: list[ManagedProcess] = []
        self.replacements = 0

    def start(self, name: str) -> None:
        """Start one node's loop."""
        args = ["--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}",
                "--rdzv-id", "bench", "--rdzv-conf", f"last_call_timeout={LAST_CALL_S}",
                "--nproc-per-node", str(self.settings.world_size // 2), "--max-restarts", "0"]  # fmt: skip
        self.agents.start(name, args, self.settings, loop=True)

    def lose_one(self) -> str:
        """SIGKILL the live node without rank 0: its loop and agent (one process group), then its workers."""
        live = [agent for agent in self.agents.agents if agent not in self.lost and agent.alive()]
        held = {id(agent): worker_ranks(agent) for agent in live}
        victim = next((agent for agent in live if held[id(agent)] and 0 not in held[id(agent)]), None)
        if victim is None:
            raise RuntimeError(f"no node to lose: workers {[sorted(held[id(a)]) for a in live]}")
        victim.signal(signal.SIGKILL)
        for pid in held[id(victim)].values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.lost.append(victim)
        return f"SIGKILL {victim.name} (loop, agent, workers of ranks {sorted(held[id(victim)])})"

    def replace(self) -> None:
        """A replacement node joins (its loop starts), once per node lost."""
        if self.replacements < len(self.lost):
            self.replacements += 1
            self.start(f"node-r{self.replacements}")


def _hit(agents: Agents, nodes: _Nodes | None, fault: Fault, rank: int) -> str:
    if nodes is not None:
        return nodes.lose_one()
    pid = worker_ranks(agents.agents[0]).get(rank)
    if pid is None:
        raise RuntimeError(f"torchrun has no live worker of rank {rank}")
    sig = signal.SIGSTOP if fault is Fault.HANG else signal.SIGKILL
    os.kill(pid, sig)
    return f"{sig.name} rank {rank} (pid {pid})"


def _watch(agents: Agents, nodes: _Nodes | None, cell: CellRun, settings: RecoverySettings) -> None:
    """Follow every loop's log: inject when due, start replacements, stop at the digest, the timeout or a bound."""
    tracker = FaultTracker(settings)
    cell.records = tracker.records
    deadline = cell.launched_at + settings.run_timeout_s
    bound = settings.hang_bound_s if cell.fault is Fault.HANG else settings.ready_timeout_s
    while time.time() < deadline:
        for _agent, stamp, line in agents.poll():
            tracker.feed(line)
            if tracker.due(line):
                at = time.time()
                tracker.injected(at, _hit(agents, nodes, cell.fault, settings.victim_rank))
            if digest := digest_of(line):
                cell.digest, cell.finished_at = digest, stamp
                return
        if nodes is not None and not tracker.recovering:
            nodes.replace()
        last = tracker.records[-1] if tracker.records else None
        if last is not None and tracker.recovering and time.time() - last.injected_at > bound:
            cell.notes.append(f"training did not move within {bound:g} s of fault {len(cell.records)}")
            if cell.fault is Fault.HANG:
                cell.notes.append(
                    f"nothing watches progress: the loop restarts after the collective timeout "
                    f"({SCRIPT_COLLECTIVE_TIMEOUT_S:g} s in the script)"
                )
            return
        time.sleep(POLL_S)
    cell.notes.append(f"still running after {settings.run_timeout_s:g} s: stopped")


def _detections(agents: Agents, cell: CellRun) -> None:
    """Each fault's detection: the first line of a torchrun agent about a failed worker after it."""
    lines = sorted((stamp, line) for follower in agents.followers for stamp, line in follower.lines)
    bounds = [record.injected_at for record in cell.records[1:]] + [float("inf")]
    for record, until in zip(cell.records, bounds, strict=True):
        for stamp, line in lines:
            if record.injected_at <= stamp < until and AGENT_NOTICED.search(line):
                record.detected_at, record.detected_by = stamp, line.split("] ", 1)[-1][:160]
                break
