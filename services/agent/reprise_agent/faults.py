"""Fault injection, on a node with simulated GPUs only: a GPU fault through the simulated driver, a rank killed or
frozen, or the whole node lost (its ranks, then its agent, with no goodbye)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from signal import SIGKILL, SIGSTOP

from pydantic import ValidationError

from reprise_agent.gpu.base import GpuBackend
from reprise_agent.gpu.sim import SimulatedGpus
from reprise_agent.ranks import RankSupervisor
from reprise_common.events import PROCESS_FAULTS, FaultKind, InjectFault, InjectReply, Wire
from reprise_common.logging import get_logger

log = get_logger("reprise.agent")


class FaultInjector:
    """Answers the node's injection requests; `flush_gpu_signals` publishes the driver's errors before a rank dies of
    them, `lose_node` silences the agent before its ranks die."""

    def __init__(
        self,
        *,
        node_id: str,
        gpus: GpuBackend,
        supervisor: RankSupervisor,
        flush_gpu_signals: Callable[[], None],
        lose_node: Callable[[], None],
    ) -> None:
        self.node_id = node_id
        self.gpus = gpus
        self.supervisor = supervisor
        self.flush_gpu_signals = flush_gpu_signals
        self.lose_node = lose_node

    async def on_inject(self, data: bytes) -> Wire:
        """Inject one fault; the reply says whether it was and what it did."""
        try:
            fault = InjectFault.model_validate_json(data)
        except ValidationError as exc:
            return InjectReply(accepted=False, detail=f"bad fault: {exc.errors()[0]['msg']}")
        if not isinstance(self.gpus, SimulatedGpus):
            return InjectReply(
                accepted=False, detail=f"fault injection needs the sim backend (this node: {self.gpus.name})"
            )
        if fault.kind in PROCESS_FAULTS:
            return self._inject_process_fault(fault)
        result = self.gpus.inject(fault)
        self.flush_gpu_signals()  # the driver reports the error before the process dies of it
        detail = result.detail
        if result.fatal:
            victim = self.supervisor.rank_on_gpu(fault.gpu)
            if victim is not None:
                self.supervisor.kill(victim)
                detail += f"; killed rank {victim.rank} of job {victim.job_id}"
        log.warning("fault injected", extra={"fault": fault.model_dump(mode="json"), "detail": detail})
        return InjectReply(accepted=result.accepted, detail=detail)

    def _inject_process_fault(self, fault: InjectFault) -> InjectReply:
        """Kill or freeze a rank, or lose the whole node (its ranks, then this agent, with no goodbye)."""
        alive = sorted(
            (r for r in self.supervisor.ranks() if r.alive and fault.job_id in (None, r.job_id)),
            key=lambda r: r.rank,
        )
        if fault.kind is FaultKind.NODE_LOSS:
            self.lose_node()
            for rank in alive:
                self.supervisor.kill(rank)
            log.warning("fault injected: node loss", extra={"ranks": [r.rank for r in alive]})
            asyncio.get_running_loop().call_later(0.2, os.kill, os.getpid(), SIGKILL)  # after the reply
            return InjectReply(
                accepted=True, detail=f"node {self.node_id} lost: killed {len(alive)} ranks and its agent"
            )
        victim = next((r for r in alive if fault.rank in (None, r.rank)), None)
        if victim is None:
            return InjectReply(accepted=False, detail=f"no live rank {fault.rank} on {self.node_id}")
        sig = SIGKILL if fault.kind is FaultKind.RANK_KILL else SIGSTOP
        self.supervisor.kill(victim, sig)
        detail = f"{'killed' if sig is SIGKILL else 'froze (SIGSTOP)'} rank {victim.rank} of job {victim.job_id}"
        log.warning("fault injected", extra={"fault": fault.model_dump(mode="json"), "detail": detail})
        return InjectReply(accepted=True, detail=detail)
