"""Choose a GPU backend by name; a node without working NVML gets a backend that says why instead of a crash."""

from __future__ import annotations

import pynvml

from reprise_agent.gpu.base import GpuBackend, GpuSignal
from reprise_agent.gpu.nvml import NvmlGpus
from reprise_agent.gpu.sim import SimulatedGpus
from reprise_common.errors import ConfigError
from reprise_common.events import GpuStatus
from reprise_common.logging import get_logger

log = get_logger("reprise.agent.gpu")

BACKENDS = ("sim", "nvml")


class UnavailableGpus:
    """The GPUs asked for cannot be read on this node: no statuses, no signals, and ``error`` says why."""

    name = "unavailable"

    def __init__(self, error: str, *, requested: str = "nvml") -> None:
        self.error = error
        self.requested = requested
        log.error("GPU backend unavailable; reporting no GPUs", extra={"backend": requested, "reason": error})

    def statuses(self) -> list[GpuStatus]:
        """No GPU can be read."""
        return []

    def drain_signals(self) -> list[GpuSignal]:
        """Nothing can happen to GPUs nobody can see."""
        return []

    def close(self) -> None:
        """Nothing to release."""


def open_backend(name: str, *, count: int, node_id: str) -> GpuBackend:
    """The backend called ``name``: ``sim`` (``count`` simulated GPUs) or ``nvml`` (this node's real GPUs)."""
    if name == "sim":
        return SimulatedGpus(count, node_id=node_id)
    if name == "nvml":
        return _open_nvml()
    raise ConfigError(f"unknown GPU backend {name!r}: use one of {', '.join(BACKENDS)}")


def _open_nvml() -> GpuBackend:
    try:
        backend = NvmlGpus()
    except (pynvml.NVMLError, pynvml.NVMLLibraryMismatchError) as exc:
        # library missing, driver not loaded, no permission, driver/library mismatch: the agent runs on without GPUs
        return UnavailableGpus(f"NVML unavailable: {exc}")
    if backend.count == 0:
        backend.close()
        return UnavailableGpus("NVML unavailable: NVML reports no GPU on this node")
    return backend
