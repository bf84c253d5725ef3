"""What every benchmark shares: a description of the machine, latency summaries, and saving results as JSON."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine_info() -> dict[str, Any]:
    """The machine a figure was measured on: without it a number means little."""
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "cores": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "kernel": platform.release(),
        "arch": platform.machine(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
    }


def _cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines()
    except OSError:
        return platform.processor() or "unknown"
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model", "cpu model"):
            return value.strip()
    return platform.processor() or "unknown"


def wait_quiet(*, busy_below: float = 0.25, window_s: float = 2.0, limit_s: float = 60.0) -> dict[str, float]:
    """Wait until the machine's CPUs were busy less than `busy_below` of a `window_s` window (what an earlier run left
    behind has ended: a stack going down, a daemon cleaning up), at most `limit_s`; how long it waited and the last
    window's busy share."""
    began = time.monotonic()
    while True:
        before = _cpu_ticks()
        time.sleep(window_s)
        after = _cpu_ticks()
        total = sum(after) - sum(before)
        busy = 1.0 - (after[3] + after[4] - before[3] - before[4]) / total if total > 0 else 0.0  # idle + iowait
        waited = time.monotonic() - began
        if busy < busy_below or waited >= limit_s:
            return {"waited_s": round(waited, 1), "busy_share": round(busy, 3)}


def _cpu_ticks() -> list[int]:
    """The machine's CPU time by kind (user, nice, system, idle, iowait, ...), in ticks, from /proc/stat."""
    with open("/proc/stat", encoding="ascii") as stat:
        return [int(field) for field in stat.readline().split()[1:]]


def latency_summary(samples_ns: Sequence[int]) -> dict[str, float]:
    """Median, p99, max and mean of per-call durations, in microseconds."""
    ordered = sorted(samples_ns)
    count = len(ordered)
    if not count:
        return {"calls": 0}
    return {
        "calls": count,
        "median_us": round(ordered[count // 2] / 1000, 3),
        "p99_us": round(ordered[min(count - 1, int(count * 0.99))] / 1000, 3),
        "max_us": round(ordered[-1] / 1000, 3),
        "mean_us": round(sum(ordered) / count / 1000, 3),
    }


def process_cpu_s(pid: int | None = None) -> float:
    """CPU time this process has used, in seconds, from the scheduler's exact accounting where Linux has it; with
    `pid`, the CPU time of every thread of that process (user + system, in clock ticks), NaN once it has exited.

    getrusage() is sampled at the timer tick on many kernels and overcharges a process that wakes on ticks.
    """
    if pid is not None:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text(encoding="ascii").rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return float("nan")
    try:
        return int(Path("/proc/self/schedstat").read_text(encoding="ascii").split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        times = os.times()
        return times.user + times.system


def rss_kib(pid: int) -> int | None:
    """A process's resident memory now, in KiB (VmRSS); None once it has exited."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text(encoding="utf-8").splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def write_result(name: str, figures: dict[str, Any]) -> Path:
    """Save a benchmark's figures with the machine description as bench/results/<name>.json (atomically)."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    target = RESULTS_DIR / f"{name}.json"
    partial = target.with_suffix(".json.tmp")
    document = {"benchmark": name, "machine": machine_info(), "figures": figures}
    partial.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    os.replace(partial, target)
    return target


def replace_block(doc: Path, begin: str, end: str, text: str) -> bool:
    """Replace what lies between the markers `begin` and `end` in `doc` with `text` (a table a bench generated);
    False when the doc has no such block."""
    try:
        content = doc.read_text(encoding="utf-8")
    except FileNotFoundError:
        return False
    head, found_begin, rest = content.partition(begin)
    _old, found_end, tail = rest.partition(end)
    if not found_begin or not found_end:
        return False
    doc.write_text(f"{head}{begin}\n{text}\n{end}{tail}", encoding="utf-8")
    return True
