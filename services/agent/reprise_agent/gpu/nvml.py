"""The real GPU backend: per-GPU readings from NVML and a listener thread for the driver's XID events.

Every field is read on its own: NOT_SUPPORTED (or a driver too old to have the function) gives None quietly, any other
NVML error gives None and is noted in the status's ``error``, and GPU_IS_LOST marks the GPU lost for good (a lost GPU
does not come back without a reset) with one LOST signal. Nothing here raises to the caller after construction.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pynvml

from reprise_agent.gpu.base import FATAL_XIDS, GpuSignal, SignalKind
from reprise_common.events import GpuHealth, GpuStatus
from reprise_common.logging import get_logger

log = get_logger("reprise.agent.gpu")

XID_WAIT_MS = 500  # how long one nvmlEventSetWait blocks, hence how long close() may wait for the listener
_MIB = 1024 * 1024
_XID_EVENT = pynvml.nvmlEventTypeXidCriticalError
_GPU_SENSOR = pynvml.NVML_TEMPERATURE_GPU
_NVLINK_COUNTERS = (
    pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT,
    pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA,
    pynvml.NVML_NVLINK_ERROR_DL_REPLAY,
    pynvml.NVML_NVLINK_ERROR_DL_RECOVERY,
)
# Bits of nvmlClocksEventReason* (formerly nvmlClocksThrottleReason*), named as the simulator names them.
CLOCK_EVENT_REASONS = {
    0x001: "gpu_idle",
    0x002: "applications_clocks_setting",
    0x004: "sw_power_cap",
    0x008: "hw_slowdown",
    0x010: "sync_boost",
    0x020: "sw_thermal_slowdown",
    0x040: "hw_thermal_slowdown",
    0x080: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
    0x200: "board_limit",
    0x400: "reliability",
}
# Throttling that means heat or power trouble; sw_power_cap and gpu_idle are normal operation.
DEGRADING_REASONS = frozenset({"hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"})
_QUIET_ERRORS = frozenset({pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND})


def _code(exc: pynvml.NVMLError) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def _handle_key(handle: Any) -> int | None:
    """The address a device handle points at: the event's handle is another pointer object to the same device."""
    value = ctypes.cast(handle, ctypes.c_void_p).value
    return int(value) if value is not None else None


def decode_clock_reasons(mask: int) -> list[str]:
    """Names of the set bits of a clocks-event-reasons mask; unknown bits as hex."""
    names = [name for bit, name in CLOCK_EVENT_REASONS.items() if mask & bit]
    unknown = mask & ~sum(CLOCK_EVENT_REASONS)
    return names + ([f"unknown_{unknown:#x}"] if unknown else [])


@dataclass
class _Gpu:
    index: int
    handle: Any = None
    uuid: str = ""
    lost: str = ""  # why, once NVML said the GPU is lost
    last_xid: int | None = None
    fatal_xid: int | None = None  # an XID after which the GPU needs a reset (REFERENCE.md)
    nvlinks: list[int] | None = None  # the links NVML knows of, probed once
    noted: set[str] = field(default_factory=set)  # fields whose read error was already logged


class _Reads:
    """One pass over one GPU's fields: unsupported → None, other errors → None and noted, lost → stop reading."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.errors: list[str] = []
        self.lost = ""

    def get(self, name: str, read: Callable[..., Any], *args: Any) -> Any:
        """One field, or None."""
        if self.lost:
            return None
        try:
            return read(self.handle, *args)
        except pynvml.NVMLError as exc:
            if _code(exc) == pynvml.NVML_ERROR_GPU_IS_LOST:
                self.lost = f"{exc} (reading {name})"
            elif _code(exc) not in _QUIET_ERRORS:
                self.errors.append(f"{name}: {exc}")
            return None


class NvmlGpus:
    """This node's NVIDIA GPUs through NVML; construction raises NVMLError when NVML cannot start."""

    name = "nvml"
    error = ""  # the backend as a whole works; per-GPU problems are in each GpuStatus.error

    def __init__(self, *, nvml: Any = pynvml, xid_wait_ms: int = XID_WAIT_MS) -> None:
        # `nvml` is the pynvml module, or a stand-in with the same functions; errors and constants come from pynvml.
        self._nvml = nvml
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
        self._gpus = [_Gpu(index=i) for i in range(count)]
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

    def _status(self, gpu: _Gpu) -> GpuStatus:
        why_not = self._open(gpu)
        with self._lock:
            last_xid, fatal_xid = gpu.last_xid, gpu.fatal_xid
        if gpu.lost:
            return GpuStatus(index=gpu.index, uuid=gpu.uuid, health=GpuHealth.LOST, last_xid=last_xid, error=gpu.lost)
        if why_not:
            return GpuStatus(index=gpu.index, health=GpuHealth.UNKNOWN, last_xid=last_xid, error=why_not)
        reads = _Reads(gpu.handle)
        status = self._read(gpu, reads, last_xid)
        if reads.lost:
            self._mark_lost(gpu, reads.lost)
            return GpuStatus(index=gpu.index, uuid=gpu.uuid, health=GpuHealth.LOST, last_xid=last_xid, error=gpu.lost)
        for error in reads.errors:
            name = error.split(":", 1)[0]
            if name not in gpu.noted:
                gpu.noted.add(name)
                log.warning("GPU field unreadable", extra={"gpu": gpu.index, "detail": error})
        return status.model_copy(update={"health": gpu_health(status, fatal_xid=fatal_xid)})

    def _read(self, gpu: _Gpu, reads: _Reads, last_xid: int | None) -> GpuStatus:
        n = self._nvml
        corrected, uncorrected = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        temperature = reads.get("temperature_c", self._temperature)
        power_mw = reads.get("power_w", n.nvmlDeviceGetPowerUsage)
        utilization = reads.get("utilization_pct", n.nvmlDeviceGetUtilizationRates)
        memory = reads.get("memory", n.nvmlDeviceGetMemoryInfo)
        sbe = reads.get("ecc_sbe", n.nvmlDeviceGetTotalEccErrors, corrected, pynvml.NVML_VOLATILE_ECC)
        dbe = reads.get("ecc_dbe", n.nvmlDeviceGetTotalEccErrors, uncorrected, pynvml.NVML_VOLATILE_ECC)
        retired = reads.get("retired_pages", self._retired_pages)
        retired_pending = reads.get("retired_pages_pending", n.nvmlDeviceGetRetiredPagesPendingStatus)
        remapped = reads.get("remapped_rows", n.nvmlDeviceGetRemappedRows)  # (corr, unc, pending, failure)
        replay = reads.get("pcie_replay_count", n.nvmlDeviceGetPcieReplayCounter)
        nvlink = reads.get("nvlink_errors", self._nvlink_errors, gpu)
        reasons = reads.get("throttle_reasons", self._clock_reasons)
        return GpuStatus(
            index=gpu.index,
            uuid=gpu.uuid,
            health=GpuHealth.OK,
            temperature_c=temperature,
            power_w=None if power_mw is None else power_mw / 1000,
            utilization_pct=None if utilization is None else utilization.gpu,
            memory_used_mib=None if memory is None else memory.used / _MIB,
            memory_total_mib=None if memory is None else memory.total / _MIB,
            ecc_sbe=sbe,
            ecc_dbe=dbe,
            retired_pages=retired,
            retired_pages_pending=None if retired_pending is None else bool(retired_pending),
            remapped_rows_pending=None if remapped is None else bool(remapped[2]),
            remapped_rows_failed=None if remapped is None else bool(remapped[3]),
            pcie_replay_count=replay,
            nvlink_errors=nvlink,
            throttle_reasons=[] if reasons is None else reasons,
            last_xid=last_xid,
            error="; ".join(reads.errors),
        )

    def _temperature(self, handle: Any) -> Any:
        return self._first_available(("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature"), handle, _GPU_SENSOR)

    def _clock_reasons(self, handle: Any) -> list[str]:
        names = ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons")
        return decode_clock_reasons(int(self._first_available(names, handle)))

    def _first_available(self, names: tuple[str, ...], handle: Any, *args: Any) -> Any:
        """Call the newest of several NVML functions this binding and driver have."""
        for name in names[:-1]:
            read = getattr(self._nvml, name, None)
            if read is None:
                continue
            try:
                return read(handle, *args)
            except pynvml.NVMLError as exc:
                if _code(exc) != pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                    raise
        return getattr(self._nvml, names[-1])(handle, *args)

    def _retired_pages(self, handle: Any) -> int:
        causes = (
            pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
            pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
        )
        return sum(len(self._nvml.nvmlDeviceGetRetiredPages(handle, cause)) for cause in causes)

    def _nvlink_errors(self, handle: Any, gpu: _Gpu) -> int:
        """CRC, replay and recovery counters summed over the links that report them."""
        if gpu.nvlinks is None:
            gpu.nvlinks = [link for link in range(pynvml.NVML_NVLINK_MAX_LINKS) if self._link_exists(handle, link)]
        total, counted = 0, False
        for link in gpu.nvlinks:
            for counter in _NVLINK_COUNTERS:
                try:
                    total += int(self._nvml.nvmlDeviceGetNvLinkErrorCounter(handle, link, counter))
                    counted = True
                except pynvml.NVMLError as exc:
                    if _code(exc) not in _QUIET_ERRORS:
                        raise
        if not counted:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return total

    def _link_exists(self, handle: Any, link: int) -> bool:
        try:
            self._nvml.nvmlDeviceGetNvLinkState(handle, link)
        except pynvml.NVMLError as exc:
            if _code(exc) in _QUIET_ERRORS or _code(exc) == pynvml.NVML_ERROR_INVALID_ARGUMENT:
                return False
            raise
        return True

    def _open(self, gpu: _Gpu) -> str:
        """Get the GPU's handle and UUID if not held yet; returns why not, or ''."""
        if gpu.handle is not None or gpu.lost:
            return ""
        try:
            handle = self._nvml.nvmlDeviceGetHandleByIndex(gpu.index)
            uuid = self._nvml.nvmlDeviceGetUUID(handle)
        except pynvml.NVMLError as exc:
            if _code(exc) == pynvml.NVML_ERROR_GPU_IS_LOST:
                self._mark_lost(gpu, f"{exc} (opening GPU {gpu.index})")
                return ""
            return f"cannot open GPU {gpu.index}: {exc}"
        gpu.uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
        with self._lock:
            gpu.handle = handle
            self._index_by_key[_handle_key(handle)] = gpu.index
        return ""

    def _mark_lost(self, gpu: _Gpu, reason: str) -> None:
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
                if _code(exc) != pynvml.NVML_ERROR_TIMEOUT:
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


def gpu_health(status: GpuStatus, *, fatal_xid: int | None = None) -> GpuHealth:
    """What a GPU's readings mean: failed hardware, degraded, unreadable, or fine."""
    if status.remapped_rows_failed or (status.ecc_dbe or 0) > 0 or fatal_xid is not None:
        return GpuHealth.FAILED
    throttled = DEGRADING_REASONS.intersection(status.throttle_reasons)
    if throttled or status.retired_pages_pending or status.remapped_rows_pending:
        return GpuHealth.DEGRADED
    readings = status.model_dump(exclude={"index", "uuid", "health", "throttle_reasons", "last_xid", "error"})
    if status.error and all(value is None for value in readings.values()):
        return GpuHealth.UNKNOWN
    return GpuHealth.OK
