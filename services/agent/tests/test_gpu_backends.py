"""Every GPU backend available here behaves as the GpuBackend interface promises.

The simulated backend runs everywhere; the real NVML backend runs only where NVML initialises (tests marked ``gpu``,
skipped with NVML's own reason elsewhere: ``pytest -m gpu services/agent`` on a GPU machine, see bench/gpu_check.sh).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pynvml
import pytest

from reprise_agent.gpu.base import GpuBackend
from reprise_agent.gpu.factory import open_backend
from reprise_agent.gpu.nvml import NvmlGpus
from reprise_common.events import GpuHealth, GpuStatus

SIM_COUNT = 4


def _nvml_init_error() -> str | None:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return str(exc)
    pynvml.nvmlShutdown()
    return None


def _require_nvml() -> None:
    reason = _nvml_init_error()
    if reason is not None:
        pytest.skip(f"real NVML not tested: nvmlInit failed here ({reason})")


def _gpu_count(backend: GpuBackend) -> int:
    return backend.count if isinstance(backend, NvmlGpus) else SIM_COUNT


@pytest.fixture(params=["sim", pytest.param("nvml", marks=pytest.mark.gpu)])
def backend(request: pytest.FixtureRequest) -> Iterator[GpuBackend]:
    """Each backend this machine can run, opened as the agent opens it."""
    if request.param == "nvml":
        _require_nvml()
    opened = open_backend(request.param, count=SIM_COUNT, node_id="node-a")
    assert opened.name == request.param
    yield opened
    opened.close()


def assert_sane(status: GpuStatus) -> None:
    """Readings a working GPU could give; None is allowed for any field the GPU does not report."""
    ranges = {
        "temperature_c": (0, 130),
        "power_w": (0, 2000),
        "utilization_pct": (0, 100),
        "memory_total_mib": (1, 1 << 22),
        "memory_used_mib": (0, status.memory_total_mib or 1 << 22),
        "ecc_sbe": (0, None),
        "ecc_dbe": (0, None),
        "retired_pages": (0, None),
        "pcie_replay_count": (0, None),
        "nvlink_errors": (0, None),
    }
    for name, (low, high) in ranges.items():
        value = getattr(status, name)
        if value is not None:
            assert value >= low, f"GPU {status.index} {name}={value}"
            assert high is None or value <= high, f"GPU {status.index} {name}={value}"
    assert all(isinstance(reason, str) and reason for reason in status.throttle_reasons)


def test_one_status_per_gpu_in_index_order(backend: GpuBackend) -> None:
    statuses = backend.statuses()
    assert len(statuses) == _gpu_count(backend) > 0
    assert [s.index for s in statuses] == list(range(len(statuses)))
    uuids = [s.uuid for s in statuses]
    assert all(uuids) and len(set(uuids)) == len(uuids)


def test_readings_are_in_sane_ranges_on_healthy_gpus(backend: GpuBackend) -> None:
    for status in backend.statuses():
        assert status.health not in (GpuHealth.LOST, GpuHealth.UNKNOWN), status.error
        assert_sane(status)


def test_no_signals_when_nothing_happened(backend: GpuBackend) -> None:
    backend.statuses()
    assert backend.drain_signals() == []


def test_close_twice_is_harmless(backend: GpuBackend) -> None:
    backend.close()
    backend.close()


# --- the real NVML backend only -----------------------------------------------------------------------------
@pytest.fixture
def nvml_gpus() -> Iterator[NvmlGpus]:
    _require_nvml()
    gpus = NvmlGpus()
    yield gpus
    gpus.close()


@pytest.mark.gpu
def test_open_backend_gives_the_real_nvml_backend_where_nvml_works() -> None:
    _require_nvml()
    backend = open_backend("nvml", count=0, node_id="node-a")
    try:
        assert isinstance(backend, NvmlGpus)
        assert backend.count == pynvml_device_count()
    finally:
        backend.close()


def pynvml_device_count() -> int:
    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()


@pytest.mark.gpu
def test_every_field_is_read_or_none(nvml_gpus: NvmlGpus) -> None:
    for status in nvml_gpus.statuses():
        print(status.model_dump_json())  # what this GPU answered, for the run's log
        assert status.error == "", f"GPU {status.index}: {status.error}"
        # every NVIDIA GPU NVML supports reports these
        assert status.temperature_c is not None
        assert status.memory_total_mib is not None
        assert status.uuid.startswith("GPU-")
        assert_sane(status)


@pytest.mark.gpu
def test_xid_listener_starts_and_stops_within_a_second(nvml_gpus: NvmlGpus) -> None:
    if not nvml_gpus.xid_gpus:
        pytest.skip("no GPU here accepts XID event registration")
    assert nvml_gpus.xid_listening
    started = time.monotonic()
    nvml_gpus.close()
    assert time.monotonic() - started < 1.0
    assert not nvml_gpus.xid_listening
