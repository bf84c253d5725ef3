"""The stack sampler on real processes and the real py-spy: a process idle at one place in Python stands still, one
that burns CPU at the same place does not, and a rank not sampled adds nothing to its status."""

from __future__ import annotations

import asyncio
import sys
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path

import pynvml
import pytest

from reprise_agent.gpu.nvml import NvmlGpus
from reprise_agent.gpu.sim import SimulatedGpus
from reprise_agent.launch.processes import ProcessHandle
from reprise_agent.ranks import RankProcess
from reprise_agent.stack_sampler import ProcessActivity, StackSampler, same_place
from reprise_agent.stacks import find_py_spy

PY_SPY = find_py_spy()
needs_py_spy = pytest.mark.skipif(PY_SPY is None, reason="py-spy is not installed")
IDLE = "import time\ndef wait():\n    while True:\n        time.sleep(0.05)\nwait()\n"
BUSY = "def spin():\n    while True:\n        sum(range(10_000))\nspin()\n"


async def _rank(code: str, rank: int, tmp_path: Path) -> tuple[RankProcess, asyncio.subprocess.Process]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code)
    return RankProcess("job-p", rank, rank, None, ProcessHandle(proc), tmp_path / f"{rank}.log", deque()), proc


@pytest.fixture
async def ranks(tmp_path: Path) -> AsyncIterator[list[RankProcess]]:
    """Rank 0 idles in a Python loop, rank 1 spins in one."""
    started = [await _rank(IDLE, 0, tmp_path), await _rank(BUSY, 1, tmp_path)]
    await asyncio.sleep(0.5)  # past the interpreter's start
    yield [rank for rank, _ in started]
    for _, proc in started:
        proc.kill()
        await proc.wait()


@needs_py_spy
async def test_an_idle_rank_stands_still_at_its_frame_and_a_busy_one_does_not(ranks: list[RankProcess]) -> None:
    sampler = StackSampler(py_spy=PY_SPY, interval_s=1.0)
    idle, busy = ranks
    for _ in range(3):
        for rank in ranks:
            await sampler.sample(rank)
        await asyncio.sleep(0.6)
    still = sampler.fields(idle)
    assert still["where"].startswith(("wait (", "<module>")) or "sleep" in still["where"], still
    assert still["waits_in"] == "" and still["still_s"] >= 1.0, still
    moving = sampler.fields(busy)
    assert moving["where"] and moving["still_s"] == 0.0, moving
    assert sampler.samples == 6 and sampler.errors == 0


@needs_py_spy
async def test_the_sampler_picks_only_the_ranks_it_is_asked_to_and_reports_nothing_for_the_others(
    ranks: list[RankProcess],
) -> None:
    sampler = StackSampler(py_spy=PY_SPY, interval_s=0.5)
    task = asyncio.create_task(sampler.run(lambda: ranks, lambda r: r.rank == 0))
    await asyncio.sleep(2.5)
    task.cancel()
    assert sampler.fields(ranks[0])["where"]
    assert sampler.fields(ranks[1]) == {}  # it reports steps: no sample, no cost
    assert 2 <= sampler.samples <= 5  # every interval_s, not faster


def test_the_simulated_gpu_backend_cannot_say_which_processes_used_a_gpu() -> None:
    assert not isinstance(SimulatedGpus(count=1, node_id="n"), ProcessActivity)  # sim: CPU, I/O and stacks only


def test_the_nvml_backend_says_which_processes_used_a_gpu() -> None:
    try:
        gpus = NvmlGpus()
    except pynvml.NVMLError as exc:
        pytest.skip(f"real NVML not tested: {exc}")
    try:
        assert isinstance(gpus, ProcessActivity)
        busy = gpus.gpu_busy_pids(5.0)
        assert all(isinstance(pid, int) and pid > 0 for pid in busy), busy
    finally:
        gpus.close()


def test_a_loop_that_polls_stands_at_one_place_and_a_step_through_the_code_does_not() -> None:
    loop = (("<module>", "t.py", 71), ("main", "t.py", 66), ("step", "t.py", 47))
    asleep = (*loop, ("wait_while", "t.py", 34))
    checking = (*loop, ("wait_while", "t.py", 33), ("exists", "pathlib.py", 1235))
    assert same_place(asleep, checking) and same_place(checking, asleep) and same_place(asleep, asleep)
    in_all_reduce = (*loop[:2], ("step", "t.py", 40), ("wrapper", "c10d_logger.py", 83), ("all_reduce", "c.py", 1))
    assert not same_place(asleep, in_all_reduce)  # another call of the step, deeper
    assert not same_place(asleep, (*loop[:2], ("evaluate", "t.py", 20), ("forward", "linear.py", 125)))
