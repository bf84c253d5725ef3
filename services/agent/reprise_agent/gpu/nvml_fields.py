"""Reading one NVIDIA GPU's fields through NVML: each field on its own, the newest function the driver has first.

NOT_SUPPORTED (or a driver too old to have the function) gives None quietly, any other NVML error gives None and is
noted, and GPU_IS_LOST stops the pass and says why (the backend then marks the GPU lost for good).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pynvml

from reprise_common.events import GpuHealth, GpuStatus

_MIB = 1024 * 1024
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
_QUIET_ERRORS = frozenset({pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_FUNCTION_NOT_FOUND})


def nvml_error_code(exc: pynvml.NVMLError) -> int | None:
    """The NVML_ERROR_* code an NVMLError carries, if any."""
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def decode_clock_reasons(mask: int) -> list[str]:
    """Names of the set bits of a clocks-event-reasons mask; unknown bits as hex."""
    names = [name for bit, name in CLOCK_EVENT_REASONS.items() if mask & bit]
    unknown = mask & ~sum(CLOCK_EVENT_REASONS)
    return names + ([f"unknown_{unknown:#x}"] if unknown else [])


@dataclass
class NvmlGpu:
    """What the backend holds of one GPU between readings."""

    index: int
    handle: Any = None
    uuid: str = ""
    lost: str = ""  # why, once NVML said the GPU is lost
    last_xid: int | None = None
    fatal_xid: int | None = None  # an XID after which the GPU needs a reset (REFERENCE.md)
    nvlinks: list[int] | None = None  # the links NVML knows of, probed once
    noted: set[str] = field(default_factory=set)  # fields whose read error was already logged


class FieldReads:
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
            if nvml_error_code(exc) == pynvml.NVML_ERROR_GPU_IS_LOST:
                self.lost = f"{exc} (reading {name})"
            elif nvml_error_code(exc) not in _QUIET_ERRORS:
                self.errors.append(f"{name}: {exc}")
            return None


class NvmlFields:
    """The field reads of one NVML binding: the pynvml module, or a stand-in with the same functions."""

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml

    def read(self, gpu: NvmlGpu, reads: FieldReads, last_xid: int | None) -> GpuStatus:
        """Every field of an open GPU in one pass; health OK until the caller judges the readings."""
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
                if nvml_error_code(exc) != pynvml.NVML_ERROR_FUNCTION_NOT_FOUND:
                    raise
        return getattr(self._nvml, names[-1])(handle, *args)

    def _retired_pages(self, handle: Any) -> int:
        causes = (
            pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
            pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
        )
        return sum(len(self._nvml.nvmlDeviceGetRetiredPages(handle, cause)) for cause in causes)

    def _nvlink_errors(self, handle: Any, gpu: NvmlGpu) -> int:
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
                    if nvml_error_code(exc) not in _QUIET_ERRORS:
                        raise
        if not counted:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return total

    def _link_exists(self, handle: Any, link: int) -> bool:
        try:
            self._nvml.nvmlDeviceGetNvLinkState(handle, link)
        except pynvml.NVMLError as exc:
            if nvml_error_code(exc) in _QUIET_ERRORS or nvml_error_code(exc) == pynvml.NVML_ERROR_INVALID_ARGUMENT:
                return False
            raise
        return True
