"""A rank's start, cold against warm: how long from the agent's launch until the script runs its first line of work.

Run from the repository root: ``make bench-standby`` (or ``.venv/bin/python -m bench.bench_standby``). The script is
what a PyTorch rank does first (``import torch, torch.distributed``, then prints a line); the time is from the launch
(the process is started, or a waiting standby is handed the command) to that line. Cold and warm launches alternate,
``--rounds`` of each (default 7), side by side on the same machine, so a busy moment hits both alike. The warm side
uses the agent's own ``StandbyPool`` (one standby; its replacement starts importing at once, beside the warm rank, as
on a node). Each round waits until a standby is ready, which a real node's standby is long before a fault, so the cold
launch never competes with a refill. Also the resident memory of a ready standby beside that of a plain interpreter
with the same imports, and the CPU a ready standby uses while it waits (``--idle-s``, before the rounds). Prints the
figures and saves bench/results/standby.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import process_cpu_s, rss_kib, write_result
from reprise_agent.launch.standby import StandbyPool

RANK = "import torch, torch.distributed, torch._dynamo\nprint('first line of work', flush=True)\n"
PRELOAD = ["torch", "torch.distributed", "torch._dynamo"]


async def _first_line(proc: asyncio.subprocess.Process, began: float) -> float:
    """Seconds from `began` to the script's first line of work (then the process is waited for, untimed)."""
    assert proc.stdout is not None
    took = float("nan")
    while True:
        line = await proc.stdout.readline()
        if b"first line of work" in line:
            took = time.perf_counter() - began
        if not line:
            break
    await proc.wait()
    return took


async def cold(script: Path) -> float:
    """Seconds from starting a fresh interpreter on the script to its first line of work."""
    began = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    return await _first_line(proc, began)


async def warm(pool: StandbyPool, script: Path) -> tuple[float, int | None]:
    """Seconds from handing the script to a ready standby to its first line of work; the standby's RSS before."""
    while not any(s.ready for s in pool.statuses()):
        await asyncio.sleep(0.05)
    rss = next(s.rss_bytes for s in pool.statuses() if s.ready)
    began = time.perf_counter()
    proc = await pool.take([sys.executable, str(script)], dict(os.environ), None)
    assert proc is not None, "the standby refused the command"
    return await _first_line(proc, began), rss


async def idle_cpu_pct(pool: StandbyPool, seconds: float) -> float:
    """The CPU a ready standby used while it waited `seconds` for an assignment, in % of one core."""
    while not any(s.ready for s in pool.statuses()):
        await asyncio.sleep(0.05)
    pid = next(s.pid for s in pool.statuses() if s.ready)
    before = process_cpu_s(pid)
    await asyncio.sleep(seconds)
    return 100 * (process_cpu_s(pid) - before) / seconds


async def plain_rss_mb() -> float | None:
    """The resident memory of a plain interpreter that imported the standby's modules and waits: what a standby's
    memory is compared with."""
    code = f"import {', '.join(PRELOAD)}; print('ready', flush=True); import time; time.sleep(600)"
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        await proc.stdout.readline()
        kib = rss_kib(proc.pid)
        return round(kib / 1024, 1) if kib is not None else None
    finally:
        proc.kill()
        await proc.wait()


async def run(rounds: int, idle_s: float) -> dict[str, object]:
    """Alternate cold and warm launches; their medians, the ratio and the standbys' memory."""
    with tempfile.TemporaryDirectory(prefix="reprise-standby-") as work:
        script = Path(work) / "rank.py"
        script.write_text(RANK)
        pool = StandbyPool(python=sys.executable, size=1, preload=PRELOAD)
        pool.start()
        colds: list[float] = []
        warms: list[float] = []
        rss: list[int] = []
        try:
            idle = await idle_cpu_pct(pool, idle_s)
            plain = await plain_rss_mb()
            for _ in range(rounds):
                while not any(s.ready for s in pool.statuses()):  # the cold launch runs with the pool at rest
                    await asyncio.sleep(0.05)
                colds.append(await cold(script))
                took, memory = await warm(pool, script)  # its replacement starts at once, as on a node
                warms.append(took)
                rss.extend([memory] if memory else [])
        finally:
            await pool.close()
    cold_median, warm_median = statistics.median(colds), statistics.median(warms)
    return {
        "rounds": rounds,
        "preload": PRELOAD,
        "cold_s": [round(x, 3) for x in colds],
        "warm_s": [round(x, 3) for x in warms],
        "cold_median_s": round(cold_median, 3),
        "warm_median_s": round(warm_median, 3),
        "cold_over_warm": round(cold_median / warm_median, 1),
        "standby_rss_mb_median": round(statistics.median(rss) / 2**20, 1) if rss else None,
        "plain_interpreter_rss_mb": plain,  # the same imports in a plain `python -c`, waiting
        "standby_idle_cpu_pct_of_core": round(idle, 3),  # over idle_s of waiting, ready (target <= 0.1)
        "idle_s": idle_s,
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    """Measure, print, save."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--idle-s", type=float, default=20.0, help="how long a ready standby's idle CPU is measured")
    args = parser.parse_args()
    figures = asyncio.run(run(args.rounds, args.idle_s))
    for key, value in figures.items():
        print(f"{key:>24}: {value}")
    print(f"saved {write_result('standby', figures)}")


if __name__ == "__main__":
    main()
