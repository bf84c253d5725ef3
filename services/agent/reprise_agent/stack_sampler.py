"""A low-rate sample of the main-thread stack of each rank that reports no steps (a script without the SDK), so that
the detector can tell a rank waiting in a collective, and the rank its peers wait for, with no change to the script.

One py-spy dump at a time, each rank every `interval_s` (spread out when a node has many ranks), never more than one
dump per MIN_GAP_S, each bounded by `within_s`: about 10 ms of CPU a dump (measured), 2 % of a core at most. The
dump runs as a child process and its answer is read asynchronously, so the agent's event loop never waits on it.
A rank "stands still" when two samples in a row show it at the same place (same_place: the same stack but for the
line of its innermost common frame, and one callee more or less: a loop that polls a file or a queue stands at one
place though its innermost frame moves) and, between them, the process used
under IDLE_SHARE of a core, read or wrote under IO_IDLE_BYTES_S through its system calls (a collective that completes
moves bytes: gloo's sockets count; a loader that reads, too) and, where the GPU backend can say, ran no GPU work while
outside a collective: the report's `still_s` counts from the first of them (docs/detector.md, "Hangs without the
SDK"). The same place in a healthy loop, sampled twice, is not still: it used CPU, I/O or its GPU in between.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from reprise_agent.ranks import RankProcess
from reprise_agent.stacks import capture
from reprise_common.events import WAITS_IN_MAX, WHERE_MAX, ThreadStack
from reprise_common.logging import get_logger
from reprise_common.thread_stacks import top_frame, waits_in

log = get_logger("reprise.agent.stack_sampler")
Frames = tuple[tuple[str, str, int | None], ...]
IDLE_SHARE = 0.25  # under this share of one core between two samples at the same stack, a rank stood still ...
IO_IDLE_BYTES_S = 1024.0  # ... and read and wrote under this many bytes a second (a print now and then is no work)
MIN_GAP_S = 0.5  # the least time between two dumps on one node, whatever the number of ranks
WITHIN_S = 2.0  # the longest one dump may take


@runtime_checkable
class ProcessActivity(Protocol):
    """A GPU backend that can say which processes used a GPU lately (NVML; the simulated backend cannot)."""

    def gpu_busy_pids(self, since_s: float) -> set[int]:
        """The pids that ran GPU work in the last `since_s` seconds."""
        ...


@dataclass
class Where:
    """What the samples of one rank's process showed: its stack, and since when it stands still there."""

    pid: int
    key: Frames  # its main thread's frames (function, file, line), outermost first
    top: str
    waits_in: str
    first_at: float  # monotonic time of the first sample at this stack, in a row
    sampled_at: float
    cpu_s: float | None
    io_chars: int | None  # bytes it read and wrote through system calls so far (/proc/<pid>/io rchar + wchar)
    still: bool = False  # a later sample showed the same stack, idle in between


@dataclass(frozen=True)
class Work:
    """What a process had done by a sample: its CPU seconds, its I/O bytes, and whether it used a GPU since the last."""

    cpu_s: float | None
    io_chars: int | None
    busy_gpu: bool

    def idle_since(self, last: Where, now: float, in_collective: bool) -> bool:
        """Whether it did no work since the last sample; unknown counts as work (no false hang on a blind read)."""
        elapsed = now - last.sampled_at
        if self.cpu_s is None or last.cpu_s is None or self.cpu_s - last.cpu_s >= IDLE_SHARE * elapsed:
            return False
        if self.io_chars is None or last.io_chars is None or self.io_chars - last.io_chars >= IO_IDLE_BYTES_S * elapsed:
            return False
        return in_collective or not self.busy_gpu  # a collective's kernels keep a GPU busy while they wait


def stack_key(threads: Sequence[ThreadStack]) -> Frames:
    """The main thread's (the first) frames, outermost first."""
    if not threads:
        return ()
    return tuple((f.function, f.file, f.line) for f in reversed(threads[0].frames))


def same_place(a: Frames, b: Frames) -> bool:
    """Whether two samples show the main thread at one place: every frame but the innermost common one equal, that
    one in the same function, and at most one callee more on either side (a wait loop's sleep, its check)."""
    n = min(len(a), len(b))
    if n == 0 or abs(len(a) - len(b)) > 1:
        return False
    return a[: n - 1] == b[: n - 1] and a[n - 1][:2] == b[n - 1][:2]


class StackSampler:
    """Samples the stacks of the ranks `stepless` picks, one at a time; fields() puts the latest in a rank's status."""

    def __init__(
        self,
        *,
        py_spy: Path | None,
        interval_s: float,
        within_s: float = WITHIN_S,
        activity: ProcessActivity | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.py_spy = py_spy
        self.interval_s = interval_s
        self.within_s = within_s
        self.activity = activity
        self.clock = clock
        self.samples = 0  # dumps taken (a bench reads it)
        self.errors = 0
        self._seen: dict[tuple[str, int], Where] = {}

    async def run(self, ranks: Callable[[], list[RankProcess]], stepless: Callable[[RankProcess], bool]) -> None:
        """Sample forever: the most overdue of the live step-less ranks, when its interval has passed."""
        if self.py_spy is None or self.interval_s <= 0:
            log.info("no stack sampling: py-spy is not installed on this node, or sampling is off")
            return
        while True:
            live = [r for r in ranks() if r.alive and stepless(r)]
            self._drop_others(live)
            due = min(live, key=self._due_at, default=None)
            wait = self._due_at(due) - self.clock() if due is not None else self.interval_s
            if due is None or wait > 0:
                await asyncio.sleep(min(max(wait, MIN_GAP_S), self.interval_s))
                continue
            await self.sample(due)
            await asyncio.sleep(MIN_GAP_S)

    def _due_at(self, rank: RankProcess) -> float:
        seen = self._seen.get((rank.job_id, rank.rank))
        if seen is None or seen.pid != rank.handle.pid:
            return float("-inf")
        return seen.sampled_at + self.interval_s

    def _drop_others(self, live: Collection[RankProcess]) -> None:
        """Forget ranks that ended or began to report steps."""
        keep = {(r.job_id, r.rank) for r in live}
        for key in [k for k in self._seen if k not in keep]:
            del self._seen[key]

    async def sample(self, rank: RankProcess) -> None:
        """Dump one rank's stack now and note whether it stood still since its last sample."""
        assert self.py_spy is not None
        pid = rank.handle.pid
        found = (await capture([rank.handle], py_spy=self.py_spy, within_s=self.within_s))[pid]
        self.samples += 1
        now, key = self.clock(), (rank.job_id, rank.rank)
        if found.error or not found.threads:
            self.errors += 1
            self._seen.pop(key, None)
            return
        cpu = rank.handle.usage()
        work = Work(cpu.cpu_s if cpu else None, rank.handle.io_bytes(), await self._gpu_busy(pid, key))
        self._seen[key] = self._next(self._seen.get(key), pid, found.threads, now, work)

    async def _gpu_busy(self, pid: int, key: tuple[str, int]) -> bool:
        """Whether the process used a GPU since its last sample (False where the backend cannot say)."""
        seen = self._seen.get(key)
        if self.activity is None or seen is None:
            return False
        with contextlib.suppress(Exception):  # a driver call that fails says nothing either way
            return pid in await asyncio.to_thread(self.activity.gpu_busy_pids, self.clock() - seen.sampled_at)
        return False

    @staticmethod
    def _next(last: Where | None, pid: int, threads: list[ThreadStack], now: float, work: Work) -> Where:
        """The rank's Where after a sample: still when the stack is the last one's and it idled in between."""
        key, collective = stack_key(threads), (waits_in(threads) or "")[:WAITS_IN_MAX]
        top = top_frame(threads)[:WHERE_MAX]
        if (
            last is None
            or last.pid != pid
            or not same_place(last.key, key)
            or not work.idle_since(last, now, bool(collective))
        ):
            return Where(pid, key, top, collective, now, now, work.cpu_s, work.io_chars)
        return Where(pid, key, top, collective, last.first_at, now, work.cpu_s, work.io_chars, still=True)

    def fields(self, rank: RankProcess) -> dict[str, Any]:
        """The rank's sample as RankStatus fields (where, waits_in, still_s); none for a rank not sampled."""
        seen = self._seen.get((rank.job_id, rank.rank))
        if seen is None or seen.pid != rank.handle.pid or not rank.alive:
            return {}
        still = round(max(self.clock() - seen.first_at, 0.0), 3) if seen.still else 0.0
        return {"where": seen.top, "waits_in": seen.waits_in, "still_s": still}
