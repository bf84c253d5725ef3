"""What the real NVML backend reads on this machine: versions, one status per GPU, XID registration, read latency.

Prints the JSON and writes it to the path given (default bench/results/nvml.json). Records numbers; asserts nothing.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import pynvml

from reprise_agent.gpu.factory import open_backend
from reprise_agent.gpu.nvml import NvmlGpus

READS = 20


def _version(read: Any) -> str:
    try:
        return str(read())
    except pynvml.NVMLError as exc:
        return f"unreadable: {exc}"


def check() -> dict[str, Any]:
    """Open the backend as the agent does and record what it sees."""
    backend = open_backend("nvml", count=0, node_id="gpu-check")
    if not isinstance(backend, NvmlGpus):
        return {"available": False, "error": getattr(backend, "error", "not the NVML backend")}
    result: dict[str, Any] = {
        "available": True,
        "driver_version": _version(pynvml.nvmlSystemGetDriverVersion),
        "nvml_version": _version(pynvml.nvmlSystemGetNVMLVersion),
        "cuda_driver_version": _version(pynvml.nvmlSystemGetCudaDriverVersion),
        "gpu_count": backend.count,
        "xid_gpus": backend.xid_gpus,
        "xid_listening": backend.xid_listening,
    }
    timings = []
    for _ in range(READS):
        started = time.perf_counter()
        statuses = backend.statuses()
        timings.append(time.perf_counter() - started)
    result["statuses_ms"] = {"p50": 1000 * statistics.median(timings), "max": 1000 * max(timings), "n": READS}
    result["gpus"] = [s.model_dump(mode="json") for s in statuses]
    result["signals"] = [vars(s) for s in backend.drain_signals()]
    started = time.perf_counter()
    backend.close()
    result["close_ms"] = 1000 * (time.perf_counter() - started)
    return result


def main() -> None:
    """Run the check, print it, save it."""
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results/nvml.json")
    result = check()
    text = json.dumps(result, indent=2, default=str)
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    if not result["available"]:
        sys.exit(1)  # this script runs on GPU machines: no NVML there is the finding


if __name__ == "__main__":
    main()
