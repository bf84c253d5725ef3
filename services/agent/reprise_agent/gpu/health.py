"""What a GPU's readings mean, whichever backend read them: failed hardware, degraded, unreadable, or fine."""

from __future__ import annotations

from reprise_common.events import GpuHealth, GpuStatus

# Throttling that means heat or power trouble; sw_power_cap and gpu_idle are normal operation.
DEGRADING_REASONS = frozenset({"hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"})


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
