"""The real GPU backend: per-GPU readings from NVML and a listener thread for the driver's XID events.

Each field is read on its own (``nvml_fields``); GPU_IS_LOST marks the GPU lost for good (a lost GPU does not come back
without a reset) with one LOST signal, and other read errors are noted in the status's ``error``. Nothing here raises
to the caller after construction.
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any

import pynvml

from reprise_agent.gpu.base import FATAL_XIDS, GpuSignal, SignalKind
from reprise_agent.gpu.health import gpu_health
from reprise_agent.gpu.nvml_fields import FieldReads, NvmlFields, NvmlGpu, nvml_error_code
from reprise_common.events import GpuHealth, GpuStatus
from reprise_common.logging import get_logger

log = get_logger("reprise.agent.gpu")

XID_WAIT_MS = 500  # how long one nvmlEventSetWait blocks, hence how long close() may wait for the listener
_XID_EVENT = pynvml.nvmlEventTypeXidCriticalError


def _handle_key(handle: Any) -> int | None:
    """The address a device handle points at: the event's handle is another pointer object to the same device."""
    value = ctypes.cast(handle, ctypes.c_void_p).value
    return int(value) if value is not None else None


class NvmlGpus:
    """This node's NVIDIA GPUs through NVML; construction raises NVMLError when NVML cannot start."""

    name = "nvml"
    error = ""  # the backend as a whole works; per-GPU problems are in each GpuStatus.error

    def __init__(self, *, nvml: Any = pynvml, xid_wait_ms: int = XID_WAIT_MS) -> None:
        # `nvml` is the pynvml module, or a stand-in with the same functions; errors and constants come from pynvml.
        self._nvml = nvml
        self._fields = NvmlFields(nvml)
        self._xid_wait_ms = xid_wait_ms
        nvml.nvmlInit()
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except pynvml.NVMLError:
            nvml.nvmlShutdown()
            raise
        self._lock = threading.Lock()
        self._signals: list[GpuSignal] = []
        self._index_by_key: dict[int | None, int] = {}
        self._gpus = [NvmlGpu(index=i) for i in range(count)]
        self._closed = False
        self._stop = threading.Event()
        self._event_set: Any = None
        self._listener: threading.Thread | None = None
        self.xid_gpus: list[int] = []  # GPUs registered for XID events
        for gpu in self._gpus:
            self._open(gpu)
        self._start_xid_listener()

    @property
    def count(self) -> int:
        """How many GPUs NVML reported."""
        return len(self._gpus)

    @property
    def xid_listening(self) -> bool:
        """Whether the XID listener thread is running."""
        return self._listener is not None and self._listener.is_alive()

    # --- readings ---------------------------------------------------------------------------------------------
    def statuses(self) -> list[GpuStatus]:
        """One status per GPU in NVML index order; empty once closed."""
        if self._closed:
            return []
        return [self._status(gpu) for gpu in self._gpus]

    def _status(self, gpu: NvmlGpu) -> GpuStatus:
        why_not = self._open(gpu)
        with self._lock:
            last_xid, fatal_xid = gpu.last_xid, gpu.fatal_xid
        if gpu.lost:
            return GpuStatus(index=gpu.index, uuid=gpu.uuid, health=GpuHealth.LOST, last_xid=last_xid, error=gpu.lost)
        if why_not:
            return GpuStatus(index=gpu.index, health=GpuHealth.UNKNOWN, last_xid=last_xid, error=why_not)
        reads = FieldReads(gpu.handle)
        status = self._fields.read(gpu, reads, last_xid)
        if reads.lost:
            self._mark_lost(gpu, reads.lost)
            return GpuStatus(index=gpu.index, uuid=gpu.uuid, health=GpuHealth.LOST, last_xid=last_xid, error=gpu.lost)
        for error in reads.errors:
            name = error.split(":", 1)[0]
            if name not in gpu.noted:
                gpu.noted.add(name)
                log.warning("GPU field unreadable", extra={"gpu": gpu.index, "detail": error})
        return status.model_copy(update={"health": gpu_health(status, fatal_xid=fatal_xid)})

    def _open(self, gpu: NvmlGpu) -> str:
        """Get the GPU's handle and UUID if not held yet; returns why not, or ''."""
        if gpu.handle is not None or gpu.lost:
            return ""
        try:
            handle = self._nvml.nvmlDeviceGetHandleByIndex(gpu.index)
            uuid = self._nvml.nvmlDeviceGetUUID(handle)
        except pynvml.NVMLError as exc:
            if nvml_error_code(exc) == pynvml.NVML_ERROR_GPU_IS_LOST:
                self._mark_lost(gpu, f"{exc} (opening GPU {gpu.index})")
                return ""
            return f"cannot open GPU {gpu.index}: {exc}"
        gpu.uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
        with self._lock:
            gpu.handle = handle
            self._index_by_key[_handle_key(handle)] = gpu.index
        return ""

    def _mark_lost(self, gpu: NvmlGpu, reason: str) -> None:
        with self._lock:
            if gpu.lost:
                return
            gpu.lost = reason
            self._signals.append(GpuSignal(SignalKind.LOST, gpu.index, None, f"NVML: {reason}"))
        log.error("GPU lost", extra={"gpu": gpu.index, "reason": reason})

    def drain_signals(self) -> list[GpuSignal]:
        """XID and LOST signals since the last call."""
        with self._lock:
            signals, self._signals = self._signals, []
        return signals

    def gpu_busy_pids(self, since_s: float) -> set[int]:
        """The pids with SM or memory-copy time on any GPU in the last `since_s` seconds (NVML's per-process
        utilization samples; the stack sampler's evidence that a rank outside a collective works on its GPU). A GPU
        that cannot say adds nothing. Pids are the host's: an agent in another pid namespace than its ranks sees none.
        """
        since_us = max(int((time.time() - since_s) * 1_000_000), 0)
        busy: set[int] = set()
        for gpu in self._gpus:
            if gpu.handle is None or gpu.lost:
                continue
            try:
                samples = self._nvml.nvmlDeviceGetProcessUtilization(gpu.handle, since_us)
            except pynvml.NVMLError:  # NOT_FOUND: no sample in the window; others: this GPU cannot say
                continue
            busy.update(int(s.pid) for s in samples if s.smUtil or s.memUtil)
        return busy

    # --- XID events -------------------------------------------------------------------------------------------
    def _start_xid_listener(self) -> None:
        n = self._nvml
        try:
            event_set = n.nvmlEventSetCreate()
        except pynvml.NVMLError as exc:
            log.warning("no XID events: cannot create an NVML event set", extra={"reason": str(exc)})
            return
        for gpu in self._gpus:
            if gpu.handle is None:
                continue
            try:
                if not int(n.nvmlDeviceGetSupportedEventTypes(gpu.handle)) & _XID_EVENT:
                    continue
                n.nvmlDeviceRegisterEvents(gpu.handle, _XID_EVENT, event_set)
            except pynvml.NVMLError as exc:
                log.warning("no XID events for this GPU", extra={"gpu": gpu.index, "reason": str(exc)})
                continue
            self.xid_gpus.append(gpu.index)
        if not self.xid_gpus:
            self._free_event_set(event_set)
            return
        self._event_set = event_set
        self._listener = threading.Thread(target=self._listen, name="nvml-xid", daemon=True)
        self._listener.start()

    def _listen(self) -> None:
        last_error = ""
        while not self._stop.is_set():
            try:
                data = self._nvml.nvmlEventSetWait(self._event_set, self._xid_wait_ms)
            except pynvml.NVMLError as exc:
                if nvml_error_code(exc) != pynvml.NVML_ERROR_TIMEOUT:
                    if str(exc) != last_error:
                        last_error = str(exc)
                        log.warning("waiting for XID events failed", extra={"reason": last_error})
                    self._stop.wait(self._xid_wait_ms / 1000)  # a persistent error must not spin
                continue
            if int(data.eventType) & _XID_EVENT:
                self._on_xid(data.device, int(data.eventData))

    def _on_xid(self, device: Any, xid: int) -> None:
        with self._lock:
            index = self._index_by_key.get(_handle_key(device))
            if index is not None:
                gpu = self._gpus[index]
                gpu.last_xid = xid
                if xid in FATAL_XIDS:
                    gpu.fatal_xid = xid
                self._signals.append(GpuSignal(SignalKind.XID, index, xid, f"Xid {xid} reported by the driver"))
        if index is None:
            log.warning("XID for a device this agent does not know", extra={"xid": xid})
        else:
            log.warning("XID", extra={"gpu": index, "xid": xid})

    def _free_event_set(self, event_set: Any) -> None:
        try:
            self._nvml.nvmlEventSetFree(event_set)
        except pynvml.NVMLError as exc:
            log.warning("could not free the NVML event set", extra={"reason": str(exc)})

    # --- lifecycle --------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the XID listener and shut NVML down; a second call does nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self._listener is not None:
            self._listener.join(timeout=4 * self._xid_wait_ms / 1000)
            if self._listener.is_alive():
                # NVML is still inside nvmlEventSetWait: freeing or shutting down under it is unsafe.
                log.warning("XID listener did not stop; leaving NVML initialised")
                return
        if self._event_set is not None:
            self._free_event_set(self._event_set)
        try:
            self._nvml.nvmlShutdown()
        except pynvml.NVMLError as exc:
            log.warning("nvmlShutdown failed", extra={"reason": str(exc)})
