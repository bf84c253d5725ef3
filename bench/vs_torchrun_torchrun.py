"""The torchrun side of bench_vs_torchrun: the example under torchrun's elastic agent, a fault, what torchrun does.

torchrun starts each worker in a session of its own, so killing the agent's process group leaves its workers; the
helpers below find the workers through /proc (their parent and their RANK variable) to hit one, or to end them all.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.vs_torchrun_common import (
    OUTSIDE_REPRISE,
    POLL_S,
    REPO,
    SCRIPT,
    Fault,
    LogFollower,
    Outcome,
    Settings,
    digest_of,
    venv_command,
)
from reprise_cli.servers import ManagedProcess, free_port, wait_until

# What torchrun's agent logs when it notices a failed worker (torch/distributed/elastic/multiprocessing/api.py and
# agent/server/api.py): the first such line after the fault is its detection.
AGENT_NOTICED = re.compile(r"failed \(exitcode|Sending process \d+ closing signal|Worker group (FAILED|UNHEALTHY)")
WORKER_FAILED = re.compile(r"failed \(exitcode")  # the agent's line for each worker group that failed
GLOO_INIT_FAILED = "RuntimeError: Gloo connectFullMesh failed"  # a worker that could not build its gloo group
WORKER_SCAN_S = 1.0


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def descendants(pid: int, *, depth: int = 2) -> list[int]:
    """The processes below `pid` down to `depth` generations (a shell loop's torchrun, then its workers)."""
    found, generation = [], [pid]
    for _ in range(depth):
        generation = [child for parent in generation for child in children(parent)]
        found += generation
    return found


def environment_of(pid: int) -> dict[str, str]:
    """A process's environment as it started (empty if it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {key: value for key, _, value in pairs}


def worker_ranks(agent: ManagedProcess) -> dict[int, int]:
    """An agent's live workers (or those of the torchrun a shell loop runs now): global rank → pid."""
    ranks = {}
    for pid in descendants(agent.pid):
        rank = environment_of(pid).get("RANK")
        if rank is not None and rank.isdigit():
            ranks[int(rank)] = pid
    return ranks


@dataclass
class Agents:
    """torchrun agent processes with their logs, and every worker pid seen (to end them whatever happens)."""

    root: Path
    agents: list[ManagedProcess] = field(default_factory=list)
    followers: list[LogFollower] = field(default_factory=list)
    workers: set[int] = field(default_factory=set)
    _next_scan: float = 0.0

    def start(self, name: str, torchrun_args: list[str], settings: Settings, *, loop: bool = False) -> ManagedProcess:
        """Start one torchrun agent running the example; with `loop`, a shell that re-runs it until it exits 0."""
        log = self.root / f"{name}.log"
        argv = [venv_command("torchrun"), *torchrun_args, str(SCRIPT), *settings.script_args(self.root / "ckpt")]
        if loop:
            argv = ["bash", "-c", 'until "$@"; do :; done', "torchrun-loop", *argv]
        agent = ManagedProcess(name, argv, log, env=dict(OUTSIDE_REPRISE), cwd=REPO)
        agent.start()
        self.agents.append(agent)
        self.followers.append(LogFollower(log))
        return agent

    def poll(self) -> list[tuple[int, float, str]]:
        """New lines of every agent's log: (agent index, stamp, line)."""
        now = time.time()
        if now >= self._next_scan:  # a scan of /proc costs CPU the workers share: once a second is enough
            self._next_scan = now + WORKER_SCAN_S
            for agent in self.agents:
                if agent.alive():
                    self.workers.update(descendants(agent.pid))
        return [(i, stamp, line) for i, follower in enumerate(self.followers) for stamp, line in follower.poll(now)]

    def kill_all(self) -> None:
        """SIGKILL the agents (a shell loop first, so that it starts no torchrun again), then every worker (stopped ones
        included: they are in sessions of their own)."""
        for agent in self.agents:
            if agent.alive():
                self.workers.update(descendants(agent.pid))
                agent.signal(signal.SIGKILL)
        for pid in self.workers:
            if str(SCRIPT) in _cmdline(pid):  # the pid still belongs to a worker, not to a recycled process
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        for agent in self.agents:
            agent.stop(grace_s=5.0)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def run_single(fault: Fault, settings: Settings, root: Path) -> Outcome:
    """One agent, `--standalone --nproc-per-node 4 --max-restarts 3`; the fault hits rank `victim_rank` at step S."""
    args = ["--standalone", "--nproc-per-node", str(settings.world_size), "--max-restarts", str(settings.max_restarts)]
    agents = Agents(root)
    outcome = Outcome("torchrun", fault, launched_at=time.time())
    agent = agents.start("torchrun", args, settings)
    try:
        _watch(agents, outcome, settings, inject=lambda: _hit_worker(agent, fault, settings.victim_rank))
        outcome.extra["agent_exit_code"] = agent.proc.poll() if agent.proc else None
    finally:
        agents.kill_all()
    _analyse(outcome, agents.followers[0].lines, settings)
    return outcome


def _hit_worker(agent: ManagedProcess, fault: Fault, rank: int) -> str:
    """SIGKILL (crash, XID 79) or SIGSTOP (hang) the worker of `rank`; what was done."""
    pid = worker_ranks(agent).get(rank)
    if pid is None:
        raise RuntimeError(f"torchrun has no live worker of rank {rank}")
    sig = signal.SIGSTOP if fault is Fault.HANG else signal.SIGKILL
    os.kill(pid, sig)
    return f"{sig.name} rank {rank} (pid {pid})"


def run_node_loss(settings: Settings, root: Path) -> Outcome:
    """Two agents of 2 workers each under c10d rendezvous (1 to 2 nodes); one agent and its workers are killed."""
    port = free_port()
    args = ["--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", "bench", "--nproc-per-node", str(settings.world_size // 2),
            "--max-restarts", str(settings.max_restarts)]  # fmt: skip
    agents = Agents(root)
    outcome = Outcome("torchrun", Fault.NODE_LOSS, launched_at=time.time())
    try:
        first = agents.start("torchrun-node-a", args, settings)
        # The first agent binds the rendezvous endpoint and hosts the c10d store: the second one is the one lost.
        if not wait_until(lambda: _listening(port) or not first.alive(), timeout_s=60, interval_s=0.1):
            raise RuntimeError(f"torchrun's rendezvous never listened on {port}: {first.log_tail(5)}")
        agents.start("torchrun-node-b", args, settings)
        _watch(agents, outcome, settings, inject=lambda: _lose_node(agents))
        outcome.extra["survivor_exit_code"] = first.proc.poll() if first.proc else None
    finally:
        agents.kill_all()
    _analyse(outcome, agents.followers[0].lines, settings)
    return outcome


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _lose_node(agents: Agents) -> str:
    """SIGKILL the agent that hosts neither the rendezvous nor rank 0, and its workers: the node is gone."""
    victim = agents.agents[1]
    workers = worker_ranks(victim)
    if 0 in workers:
        raise RuntimeError("the second agent holds rank 0: the lost node would take the store with it")
    for pid in workers.values():
        os.kill(pid, signal.SIGKILL)
    victim.signal(signal.SIGKILL)
    return f"SIGKILL agent {victim.pid} and its workers (ranks {sorted(workers)})"


def _watch(agents: Agents, outcome: Outcome, settings: Settings, *, inject: Callable[[], str]) -> None:
    """Follow the logs: inject at the fault step, stop when the run ends, times out, or a hang passes its bound."""
    deadline = outcome.launched_at + settings.run_timeout_s
    while time.time() < deadline:
        for _agent, stamp, line in agents.poll():
            if outcome.fault_due(line, settings):
                outcome.injected_at = time.time()
                outcome.extra["injected"] = inject()
            if digest_of(line):
                outcome.finished_at = stamp
        if not agents.agents[0].alive():
            return
        if (
            outcome.fault is Fault.HANG
            and outcome.injected_at
            and time.time() - outcome.injected_at > settings.hang_bound_s
        ):
            outcome.notes.append(f"not recovered within the {settings.hang_bound_s:g} s bound")
            return
        time.sleep(POLL_S)
    outcome.notes.append(f"still running after {settings.run_timeout_s:g} s: stopped")


def _analyse(outcome: Outcome, lines: list[tuple[float, str]], settings: Settings) -> None:
    """Detection, restart, progress and the digest, from the (surviving) agent's log."""
    for stamp, line in lines:
        if outcome.digest is None and (digest := digest_of(line)):
            outcome.digest = digest
        if outcome.injected_at is None or stamp < outcome.injected_at or outcome.detected_at is not None:
            continue
        if AGENT_NOTICED.search(line):
            outcome.detected_at, outcome.detected_by = stamp, line.split("] ", 1)[-1][:160]
    if outcome.injected_at is not None:
        outcome.resume_from_lines(lines, since=outcome.injected_at)
        after = [line for stamp, line in lines if stamp >= outcome.injected_at]
        failed_groups = max(0, sum(bool(WORKER_FAILED.search(line)) for line in after) - 1)  # the first: the fault
        in_gloo_init = sum(line.startswith(GLOO_INIT_FAILED) for line in after)
        outcome.extra |= {"failed_restarts": failed_groups, "workers_failed_in_gloo_init": in_gloo_init}
        if failed_groups:
            outcome.notes.append(
                f"{failed_groups} of {settings.max_restarts} restarts failed; {in_gloo_init} restarted workers could "
                "not build their gloo group (connectFullMesh: connection refused)"
            )
    if outcome.fault is Fault.HANG and outcome.detected_at is None:
        outcome.notes.append("torchrun has no progress watchdog: it waits for the gloo collective timeout (5 min)")
    if outcome.fault is Fault.XID79:
        outcome.notes.append("torchrun sees a dead rank only: it cannot cordon the GPU or the node")
    if outcome.digest is None and outcome.fault is Fault.NONE:
        outcome.notes.append("the fault-free run did not finish")
