"""Simulated GPUs for machines without them (tests, demo, development), with fault injection."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from reprise_agent.gpu.base import FATAL_XIDS, GpuSignal, SignalKind
from reprise_common.events import FaultKind, GpuHealth, GpuStatus, InjectFault

_XID_BY_FAULT = {FaultKind.ECC_DBE: 48, FaultKind.OFF_BUS: 79, FaultKind.NVLINK: 74}


@dataclass
class _SimGpu:
    index: int
    health: GpuHealth = GpuHealth.OK
    temperature_c: float = 45.0
    ecc_sbe: int = 0
    ecc_dbe: int = 0
    last_xid: int | None = None
    throttle_reasons: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class InjectionResult:
    """What an injected fault did: whether it was accepted and whether it is fatal for the rank on that GPU."""

    accepted: bool
    fatal: bool
    detail: str


class SimulatedGpus:
    """A node's GPUs in memory; faults change their state and emit the signals the real driver would."""

    name = "sim"
    error = ""

    def __init__(self, count: int, *, node_id: str = "node") -> None:
        self._gpus = [_SimGpu(index=i) for i in range(count)]
        self._signals: list[GpuSignal] = []
        self._lock = threading.Lock()
        self._node_id = node_id

    def statuses(self) -> list[GpuStatus]:
        """Current readings; a lost GPU reports nothing but its loss."""
        with self._lock:
            return [self._status(gpu) for gpu in self._gpus]

    def _status(self, gpu: _SimGpu) -> GpuStatus:
        if gpu.health is GpuHealth.LOST:
            return GpuStatus(index=gpu.index, uuid=self._uuid(gpu.index), health=GpuHealth.LOST, last_xid=gpu.last_xid)
        return GpuStatus(
            index=gpu.index,
            uuid=self._uuid(gpu.index),
            health=gpu.health,
            temperature_c=gpu.temperature_c,
            power_w=300.0,
            utilization_pct=0.0,
            memory_used_mib=0.0,
            memory_total_mib=81920.0,
            ecc_sbe=gpu.ecc_sbe,
            ecc_dbe=gpu.ecc_dbe,
            throttle_reasons=list(gpu.throttle_reasons),
            last_xid=gpu.last_xid,
        )

    def _uuid(self, index: int) -> str:
        return f"GPU-sim-{self._node_id}-{index}"

    def drain_signals(self) -> list[GpuSignal]:
        """Signals since the last call."""
        with self._lock:
            signals, self._signals = self._signals, []
        return signals

    def inject(self, fault: InjectFault) -> InjectionResult:
        """Apply a fault as the real hardware would show it."""
        with self._lock:
            if fault.gpu >= len(self._gpus):
                return InjectionResult(False, False, f"no GPU {fault.gpu}: this node has {len(self._gpus)}")
            gpu = self._gpus[fault.gpu]
            if gpu.health is GpuHealth.LOST:
                return InjectionResult(False, False, f"GPU {fault.gpu} is already lost")
            if fault.kind is FaultKind.THERMAL:
                gpu.temperature_c = 94.0
                gpu.throttle_reasons = ["hw_thermal_slowdown", "sw_thermal_slowdown"]
                gpu.health = GpuHealth.DEGRADED
                return InjectionResult(True, False, f"GPU {fault.gpu} is thermally throttled")
            xid = fault.xid if fault.kind is FaultKind.XID else _XID_BY_FAULT[fault.kind]
            if xid is None:
                return InjectionResult(False, False, "an xid fault needs an xid number")
            return self._apply_xid(gpu, xid)

    def _apply_xid(self, gpu: _SimGpu, xid: int) -> InjectionResult:
        gpu.last_xid = xid
        self._signals.append(GpuSignal(SignalKind.XID, gpu.index, xid, f"simulated Xid {xid}"))
        if xid == 48:
            gpu.ecc_dbe += 1
        if xid == 92:
            gpu.ecc_sbe += 1000
        fatal = xid in FATAL_XIDS
        if xid == 79:
            gpu.health = GpuHealth.LOST
            self._signals.append(GpuSignal(SignalKind.LOST, gpu.index, None, "GPU has fallen off the bus"))
        elif fatal:
            gpu.health = GpuHealth.FAILED
        return InjectionResult(True, fatal, f"Xid {xid} on GPU {gpu.index}" + (" (fatal)" if fatal else ""))

    def close(self) -> None:
        """Nothing to release."""
