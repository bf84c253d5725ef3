"""How the NVML backend degrades: no NVML on this node, and NVML answering with errors, lost GPUs and XID events.

The first test uses the real pynvml against this machine's real absence of a driver. The rest drive NvmlGpus through a
small stand-in for the pynvml module (GPUs are an edge we cannot run here): real ctypes device handles, pynvml's own
error classes and constants, a blocking event wait that times out as NVML does, and NOT_SUPPORTED for anything a GPU
was not given an answer for.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pynvml
import pytest

from reprise_agent.gpu.base import GpuSignal, SignalKind
from reprise_agent.gpu.factory import UnavailableGpus, open_backend
from reprise_agent.gpu.health import gpu_health
from reprise_agent.gpu.nvml import NvmlGpus
from reprise_agent.gpu.nvml_fields import decode_clock_reasons
from reprise_common.errors import ConfigError
from reprise_common.events import GpuHealth, GpuStatus

GIB = 1024**3


def _nvml_init_error() -> str | None:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return str(exc)
    pynvml.nvmlShutdown()
    return None


# --- the real degrade path ----------------------------------------------------------------------------------
def test_nvml_backend_without_nvml_reports_why_instead_of_crashing(caplog: pytest.LogCaptureFixture) -> None:
    reason = _nvml_init_error()
    if reason is None:
        pytest.skip("NVML initialises on this machine: the degrade path cannot happen here")
    with caplog.at_level(logging.WARNING, logger="reprise.agent.gpu"):
        backend = open_backend("nvml", count=8, node_id="node-a")
    assert isinstance(backend, UnavailableGpus)
    assert backend.error == f"NVML unavailable: {reason}"
    assert backend.statuses() == []
    assert backend.drain_signals() == []
    backend.close()
    backend.close()
    logged = [r for r in caplog.records if r.getMessage() == "GPU backend unavailable; reporting no GPUs"]
    assert len(logged) == 1
    assert logged[0].__dict__["reason"] == backend.error


def test_unknown_backend_name_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="'cuda'"):
        open_backend("cuda", count=1, node_id="node-a")


# --- a small NVML stand-in ----------------------------------------------------------------------------------
def _not_supported(*_: Any) -> Any:
    raise pynvml.NVMLError_NotSupported()


def _nvlinks(count: int, errors_per_counter: int) -> dict[str, Any]:
    def state(link: int) -> int:
        return 1 if link < count else _not_supported()

    return {"nvmlDeviceGetNvLinkState": state, "nvmlDeviceGetNvLinkErrorCounter": lambda link, c: errors_per_counter}


def healthy_answers(**overrides: Any) -> dict[str, Any]:
    """What an idle Ampere-or-later GPU answers; page retirement and NVLink are left unsupported."""
    ecc = {pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED: 3, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED: 0}
    answers: dict[str, Any] = {
        "nvmlDeviceGetTemperatureV": 41,
        "nvmlDeviceGetPowerUsage": 250_500,  # milliwatts
        "nvmlDeviceGetUtilizationRates": pynvml.c_nvmlUtilization_t(gpu=87, memory=40),
        "nvmlDeviceGetMemoryInfo": pynvml.c_nvmlMemory_t(total=80 * GIB, free=60 * GIB, used=20 * GIB),
        "nvmlDeviceGetTotalEccErrors": lambda error_type, counter: ecc[error_type],
        "nvmlDeviceGetRemappedRows": (0, 0, 0, 0),
        "nvmlDeviceGetPcieReplayCounter": 2,
        "nvmlDeviceGetCurrentClocksEventReasons": pynvml.nvmlClocksEventReasonGpuIdle,
        "nvmlDeviceGetSupportedEventTypes": pynvml.nvmlEventTypeAll,
        "nvmlDeviceRegisterEvents": None,
    }
    return answers | overrides


@dataclass
class FakeGpu:
    answers: dict[str, Any] = field(default_factory=healthy_answers)
    lost: bool = False
    open_error: pynvml.NVMLError | None = None  # what nvmlDeviceGetHandleByIndex raises, if anything


class FakeNvml:
    """The pynvml functions NvmlGpus calls; a name pynvml lacks raises AttributeError, as the module would."""

    def __init__(self, gpus: list[FakeGpu]) -> None:
        self.gpus = gpus
        self._devices = [pynvml.struct_c_nvmlDevice_t() for _ in gpus]
        self.events: queue.Queue[tuple[int, int]] = queue.Queue()
        self.registered: list[int] = []
        self.shutdowns = 0
        self.event_sets_freed = 0

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if not (name.startswith("nvmlDevice") and hasattr(pynvml, name)):
            raise AttributeError(name)
        return lambda handle, *args: self._answer(handle, name, *args)

    def _index(self, handle: Any) -> int:
        address = ctypes.cast(handle, ctypes.c_void_p).value
        return next(i for i, d in enumerate(self._devices) if ctypes.addressof(d) == address)

    def _answer(self, handle: Any, name: str, *args: Any) -> Any:
        gpu = self.gpus[self._index(handle)]
        if gpu.lost:
            raise pynvml.NVMLError_GpuIsLost()
        answer = gpu.answers.get(name, _not_supported)
        if isinstance(answer, pynvml.NVMLError):
            raise answer
        return answer(*args) if callable(answer) else answer

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        if (error := self.gpus[index].open_error) is not None:
            raise error
        return ctypes.pointer(self._devices[index])

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return f"GPU-fake-{self._index(handle)}"

    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: Any) -> None:
        self._answer(handle, "nvmlDeviceRegisterEvents")
        self.registered.append(self._index(handle))

    def nvmlEventSetCreate(self) -> object:
        return object()

    def nvmlEventSetFree(self, event_set: Any) -> None:
        self.event_sets_freed += 1

    def nvmlEventSetWait(self, event_set: Any, timeout_ms: int) -> Any:
        try:
            index, xid = self.events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise pynvml.NVMLError_Timeout() from None
        data = pynvml.c_nvmlEventData_t(eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=xid)
        data.device = ctypes.pointer(self._devices[index])  # a new pointer object to the same device, as NVML returns
        return data


@pytest.fixture
def make_backend() -> Iterator[Callable[..., tuple[NvmlGpus, FakeNvml]]]:
    opened: list[NvmlGpus] = []

    def make(*gpus: FakeGpu, xid_wait_ms: int = 50) -> tuple[NvmlGpus, FakeNvml]:
        fake = FakeNvml(list(gpus))
        opened.append(NvmlGpus(nvml=fake, xid_wait_ms=xid_wait_ms))
        return opened[-1], fake

    yield make
    for backend in opened:
        backend.close()


def wait_for_signals(backend: NvmlGpus, timeout_s: float = 2.0) -> list[GpuSignal]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if signals := backend.drain_signals():
            return signals
        time.sleep(0.01)
    return []


# --- readings through the stand-in --------------------------------------------------------------------------
def test_readings_are_converted_and_unsupported_fields_are_none(make_backend: Any) -> None:
    backend, _ = make_backend(FakeGpu(), FakeGpu(healthy_answers(**_nvlinks(2, errors_per_counter=1))))
    first, second = backend.statuses()
    assert [first.index, second.index] == [0, 1]
    assert first.uuid == "GPU-fake-0"
    assert first.health is GpuHealth.OK
    assert (first.temperature_c, first.power_w, first.utilization_pct) == (41, 250.5, 87)
    assert (first.memory_used_mib, first.memory_total_mib) == (20 * 1024, 80 * 1024)
    assert (first.ecc_sbe, first.ecc_dbe, first.pcie_replay_count) == (3, 0, 2)
    assert (first.remapped_rows_pending, first.remapped_rows_failed) == (False, False)
    assert first.throttle_reasons == ["gpu_idle"]
    # NOT_SUPPORTED is no error: the field is simply absent
    assert (first.retired_pages, first.retired_pages_pending, first.nvlink_errors) == (None, None, None)
    assert first.error == ""
    assert second.nvlink_errors == 2 * 4  # two links, four counters each


def test_another_error_on_one_field_leaves_only_that_field_empty(make_backend: Any) -> None:
    denied = healthy_answers(nvmlDeviceGetPowerUsage=pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION))
    backend, _ = make_backend(FakeGpu(denied))
    (status,) = backend.statuses()
    assert status.power_w is None
    assert status.error == "power_w: Insufficient Permissions"
    assert status.temperature_c == 41
    assert status.health is GpuHealth.OK


def test_an_older_driver_without_clock_event_reasons_falls_back_to_throttle_reasons(make_backend: Any) -> None:
    older = healthy_answers(
        nvmlDeviceGetCurrentClocksEventReasons=pynvml.NVMLError_FunctionNotFound(),
        nvmlDeviceGetCurrentClocksThrottleReasons=pynvml.nvmlClocksThrottleReasonHwThermalSlowdown,
    )
    backend, _ = make_backend(FakeGpu(older))
    (status,) = backend.statuses()
    assert status.throttle_reasons == ["hw_thermal_slowdown"]
    assert status.health is GpuHealth.DEGRADED


def test_a_gpu_that_answers_nothing_is_unknown_with_the_reasons(make_backend: Any) -> None:
    broken = {name: pynvml.NVMLError_Unknown() for name in healthy_answers()}
    backend, _ = make_backend(FakeGpu(broken))
    (status,) = backend.statuses()
    assert status.health is GpuHealth.UNKNOWN
    assert "temperature_c: Unknown Error" in status.error


@pytest.mark.parametrize(
    ("overrides", "health"),
    [
        ({"nvmlDeviceGetCurrentClocksEventReasons": pynvml.nvmlClocksEventReasonHwThermalSlowdown}, GpuHealth.DEGRADED),
        ({"nvmlDeviceGetCurrentClocksEventReasons": pynvml.nvmlClocksEventReasonSwPowerCap}, GpuHealth.OK),
        ({"nvmlDeviceGetRemappedRows": (0, 1, 1, 0)}, GpuHealth.DEGRADED),
        ({"nvmlDeviceGetRemappedRows": (0, 1, 0, 1)}, GpuHealth.FAILED),
        ({"nvmlDeviceGetTotalEccErrors": lambda error_type, counter: 1}, GpuHealth.FAILED),
    ],
)
def test_health_follows_the_readings(make_backend: Any, overrides: dict[str, Any], health: GpuHealth) -> None:
    backend, _ = make_backend(FakeGpu(healthy_answers(**overrides)))
    assert backend.statuses()[0].health is health


def test_an_older_gpu_reports_retired_pages_and_a_pending_retirement_degrades_it(make_backend: Any) -> None:
    pre_ampere = healthy_answers(
        nvmlDeviceGetRemappedRows=pynvml.NVMLError_NotSupported(),
        nvmlDeviceGetRetiredPages=lambda cause: [0x1000],  # one page per cause: two in all
        nvmlDeviceGetRetiredPagesPendingStatus=pynvml.NVML_FEATURE_ENABLED,
    )
    backend, _ = make_backend(FakeGpu(pre_ampere))
    (status,) = backend.statuses()
    assert (status.retired_pages, status.retired_pages_pending) == (2, True)
    assert (status.remapped_rows_pending, status.remapped_rows_failed) == (None, None)
    assert status.health is GpuHealth.DEGRADED


def test_a_gpu_that_cannot_be_opened_is_unknown_until_it_can(make_backend: Any) -> None:
    backend, fake = make_backend(FakeGpu(open_error=pynvml.NVMLError_NoPermission()), FakeGpu())
    first, second = backend.statuses()
    assert (first.health, first.error) == (GpuHealth.UNKNOWN, "cannot open GPU 0: Insufficient Permissions")
    assert second.health is GpuHealth.OK
    fake.gpus[0].open_error = None
    assert backend.statuses()[0].health is GpuHealth.OK
    assert backend.statuses()[0].uuid == "GPU-fake-0"


def test_a_gpu_lost_mid_run_is_reported_lost_with_one_signal(make_backend: Any) -> None:
    backend, fake = make_backend(FakeGpu(), FakeGpu())
    assert [s.health for s in backend.statuses()] == [GpuHealth.OK, GpuHealth.OK]
    fake.gpus[1].lost = True
    for _ in range(3):
        statuses = backend.statuses()
        assert [s.health for s in statuses] == [GpuHealth.OK, GpuHealth.LOST]
        assert "GPU is lost" in statuses[1].error
        assert statuses[1].uuid == "GPU-fake-1"
    signals = backend.drain_signals()
    assert [(s.kind, s.gpu) for s in signals] == [(SignalKind.LOST, 1)]
    assert backend.drain_signals() == []


def test_an_xid_event_becomes_a_signal_for_the_right_gpu(make_backend: Any) -> None:
    backend, fake = make_backend(FakeGpu(), FakeGpu(), FakeGpu())
    assert backend.xid_listening
    fake.events.put((2, 31))
    (signal,) = wait_for_signals(backend)
    assert (signal.kind, signal.gpu, signal.xid) == (SignalKind.XID, 2, 31)
    statuses = backend.statuses()
    assert (statuses[2].last_xid, statuses[2].health) == (31, GpuHealth.OK)  # 31 is usually the application's fault
    fake.events.put((0, 48))
    (signal,) = wait_for_signals(backend)
    assert (signal.gpu, signal.xid) == (0, 48)
    assert backend.statuses()[0].health is GpuHealth.FAILED  # a double-bit ECC error needs a reset


def test_gpus_without_xid_events_are_not_registered(make_backend: Any) -> None:
    no_xid = healthy_answers(nvmlDeviceGetSupportedEventTypes=pynvml.nvmlEventTypePState)
    backend, fake = make_backend(FakeGpu(no_xid), FakeGpu())
    assert backend.xid_gpus == [1]
    assert fake.registered == [1]


def test_no_listener_when_no_gpu_has_xid_events(make_backend: Any) -> None:
    backend, fake = make_backend(FakeGpu(healthy_answers(nvmlDeviceRegisterEvents=pynvml.NVMLError_NotSupported())))
    assert not backend.xid_listening
    assert fake.event_sets_freed == 1


def test_close_stops_the_listener_within_a_second_and_shuts_nvml_down_once(make_backend: Any) -> None:
    backend, fake = make_backend(FakeGpu(), xid_wait_ms=500)  # the production wait
    assert backend.xid_listening
    started = time.monotonic()
    backend.close()
    assert time.monotonic() - started < 1.0
    assert not backend.xid_listening
    backend.close()
    assert (fake.shutdowns, fake.event_sets_freed) == (1, 1)
    assert backend.statuses() == []


def test_clock_reasons_decode_to_names() -> None:
    assert decode_clock_reasons(0) == []
    assert decode_clock_reasons(0x60) == ["sw_thermal_slowdown", "hw_thermal_slowdown"]
    assert decode_clock_reasons(0x8001) == ["gpu_idle", "unknown_0x8000"]


def test_health_of_a_status_read_elsewhere() -> None:
    assert gpu_health(GpuStatus(index=0, temperature_c=40)) is GpuHealth.OK
    assert gpu_health(GpuStatus(index=0, error="temperature_c: Unknown Error")) is GpuHealth.UNKNOWN
    assert gpu_health(GpuStatus(index=0, temperature_c=40), fatal_xid=79) is GpuHealth.FAILED
