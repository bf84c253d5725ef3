"""Checkpoints that do not stop training: ``save_checkpoint(..., background=True)`` and its DCP twin.

The training thread only copies the state into host memory (each tensor cloned to the CPU, every other value
deep-copied) and goes on; a writer thread serialises the copy, writes it, commits the checkpoint once every rank's part
is durable and reports it to the agent. The order is the synchronous save's, so a save interrupted at any point leaves
nothing the registry validates: a file is renamed into place only once synced, the ``COMMITTED`` marker is written only
after every rank renamed its file, and the report goes last. Ranks agree through a gloo group of the checkpoints' own,
never the training's group, whose collectives run on the training thread.

One save at a time: a new save first waits for the one before (a save left from a process group that was torn down
since, by a restart in place, is abandoned instead: it can never commit). The host copy is bounded by
``REPRISE_SDK_BACKGROUND_MAX_BYTES`` (default 32 GiB): a larger state is saved synchronously, said once on stderr.
``background_stats()`` tells what is held now and at most.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

MAX_BYTES_ENV = "REPRISE_SDK_BACKGROUND_MAX_BYTES"
DEFAULT_MAX_BYTES = 32 << 30
GROUP_TIMEOUT = timedelta(minutes=10)  # how long a background commit waits for the slowest rank's file


@dataclass(frozen=True)
class BackgroundStats:
    """Background saves of this process: how many ended well or not, and the host memory their copies hold."""

    saves: int
    failed: int
    abandoned: int
    held_bytes: int  # the host copies held now: those of the newest save, kept for the next one to reuse
    peak_bytes: int
    last_blocking_s: float  # how long the training thread was held by the newest save (waiting + copying)


class PendingSave:
    """A save in flight: `wait()` returns the files it wrote, or raises what stopped it."""

    def __init__(self, directory: str, step: int, held_bytes: int, world: object) -> None:
        self.directory = directory
        self.step = step
        self.held_bytes = held_bytes
        self.world = world  # the training's process group when it began (None: none)
        self.files: list[str] = []
        self.error: BaseException | None = None
        self.abandoned = False
        self._done = threading.Event()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> list[str]:
        """The files written, once the save is committed and reported; TimeoutError if it is still going."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the background save of step {self.step} is still writing")
        if self.error is not None:
            raise self.error
        return self.files


Work = Callable[[PendingSave], list[str]]


class _Writer:
    """The one save in flight of this process, and the counters behind background_stats()."""

    def __init__(self) -> None:
        self.current: PendingSave | None = None
        self.saves = self.failed = self.abandoned = self.peak_bytes = 0
        self.last_blocking_s = 0.0
        self.group: tuple[object, Any] | None = None  # (training group, the checkpoints' gloo group beside it)
        self.warned = False
        self.staging: list[torch.Tensor] = []  # the host copies of the newest save, reused by the next

    def settle_previous(self) -> None:
        """Wait for the save in flight, or abandon it when its process group is gone."""
        previous = self.current
        if previous is None or previous.done():
            return
        if previous.world is not _world():
            previous.abandoned = True
            self.abandoned += 1
            self.staging = []  # its thread may still read them
            return
        with contextlib.suppress(Exception):  # its error is its caller's, through PendingSave.wait
            previous.wait()

    def start(self, pending: PendingSave, work: Work) -> None:
        self.current = pending
        self.peak_bytes = max(self.peak_bytes, pending.held_bytes)
        threading.Thread(target=self._run, args=(pending, work), name="reprise-ckpt", daemon=True).start()

    def _run(self, pending: PendingSave, work: Work) -> None:
        try:
            pending.files = work(pending)
            self.saves += not pending.abandoned
        except BaseException as exc:  # kept for the caller's wait(), said on stderr
            pending.error = exc
            self.failed += 1
            _say(f"the background save of step {pending.step} into {pending.directory} failed: {exc!r}")
        finally:
            pending._done.set()

    def stats(self) -> BackgroundStats:
        held = sum(t.nelement() * t.element_size() for t in self.staging)
        return BackgroundStats(
            self.saves, self.failed, self.abandoned, held, self.peak_bytes, round(self.last_blocking_s, 6)
        )


writer = _Writer()


def background_stats() -> BackgroundStats:
    """What this process's background saves did and hold (``reprise_sdk.torch.background_stats``)."""
    return writer.stats()


def wait_for_saves(timeout: float | None = None) -> None:
    """Block until the save in flight, if any, is committed and reported (call it before the script exits)."""
    if writer.current is not None:
        with contextlib.suppress(Exception):
            writer.current.wait(timeout)


def max_bytes() -> int:
    try:
        return max(0, int(os.environ.get(MAX_BYTES_ENV) or DEFAULT_MAX_BYTES))
    except ValueError:
        return DEFAULT_MAX_BYTES


def tensors_bytes(state: Any) -> int:
    """Bytes of the tensors in `state` (dicts, lists and tuples are looked into)."""
    return sum(t.nelement() * t.element_size() for t in _tensors(state))


def fits(nbytes: int) -> bool:
    """Whether a copy of `nbytes` may be held; the first state too large for the bound is said once."""
    if nbytes <= max_bytes():
        return True
    if not writer.warned:
        writer.warned = True
        _say(f"a {nbytes}-byte state is over {MAX_BYTES_ENV} ({max_bytes()}); it is saved synchronously")
    return False


def host_copy(state: Any) -> Any:
    """A copy of `state` that later training steps cannot change: tensors copied to the CPU, the rest deep-copied
    (shared tensors stay shared). The tensors land in the previous save's buffers when the shapes are the same (the
    usual case: the same model every time), which saves the page faults of fresh memory; those buffers stay held."""
    tensors = list({id(t): t for t in _tensors(state)}.values())
    buffers = writer.staging if [_shape(b) for b in writer.staging] == [_shape(t) for t in tensors] else []
    memo: dict[int, Any] = {}
    for index, tensor in enumerate(tensors):
        source = tensor.detach()
        memo[id(tensor)] = buffers[index].copy_(source) if buffers else source.to("cpu", copy=True)
    writer.staging = [memo[id(t)] for t in tensors]
    return copy.deepcopy(state, memo)


def _shape(tensor: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(tensor.shape), tensor.dtype, tensor.layout, tensor.is_contiguous())


def begin(directory: str, step: int, nbytes: int, prepare: Callable[[], Work]) -> PendingSave:
    """Once the previous save settled, `prepare()` on this thread (the host copy; a collective if it makes the
    group) and the work it returns on the writer thread; the time all this held the caller is recorded."""
    started = time.perf_counter()
    writer.settle_previous()
    work = prepare()
    pending = PendingSave(directory, step, nbytes, _world())
    writer.start(pending, work)
    writer.last_blocking_s = time.perf_counter() - started
    return pending


def finished(directory: str, step: int, files: list[str]) -> PendingSave:
    """A save that was done synchronously, as a settled PendingSave."""
    pending = PendingSave(directory, step, 0, _world())
    pending.files = files
    pending._done.set()
    return pending


def checkpoint_group() -> Any:
    """The gloo group of the checkpoints' own beside the training's default group (made once per default group, a
    collective on every rank); None without a process group."""
    world = _world()
    if world is None:
        return None
    if writer.group is None or writer.group[0] is not world:
        writer.group = (world, dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT))
    return writer.group[1]


def _world() -> object:
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _tensors(state: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    stack = [state]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return found


def _say(text: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        print(f"reprise_sdk: {text}", file=sys.stderr, flush=True)
