"""Peer recovery: after a restart in place, the ranks that survived hand their state to the ranks that joined.

In a data-parallel job every rank holds the whole model and optimizer at the last step it completed. A script names
that state once a step (``replica.hold(step, trainer.state)``: the step and a function that returns the state, no
copy), and after (re)joining the process group asks for it (``replica.restore()``):

1. **Vote.** Every rank says the step it holds (-1: none, a new process) through an all-gather over the new group.
   The survivors must all hold the same step; otherwise, with no survivor, or when peer recovery is off or the
   recovery rolls back past bad data (``resume().skip_steps``), the ranks fall back to the checkpoint together.
2. **Transfer.** The lowest surviving rank serialises its state (``torch.save``) and broadcasts the bytes with their
   SHA-256; every rank checks the digest and loads the bytes (``weights_only``).
3. **Agree again.** If any rank could not take the state, every rank falls back to the checkpoint.

The result says which path was taken and why, and the rank tells its agent (a "resumed" message), whose report carries
it to the recovery's verifying step. ``REPRISE_PEER_RESTORE=0`` (the job's env) turns peer recovery off.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from . import _client
from ._resume import resume

PEER_ENV = "REPRISE_PEER_RESTORE"
NONE_HELD = -1


@dataclass(frozen=True)
class Restored:
    """How this rank's state came back: from a peer (`state` set) or not (`state` None: load the checkpoint)."""

    path: str  # "peer" or "checkpoint"
    step: int | None  # the step the state is at, for the peer path
    reason: str  # why the checkpoint, or which rank sent the state
    state: dict[str, Any] | None = None
    source_rank: int | None = None
    transfer_bytes: int = 0

    @property
    def from_peer(self) -> bool:
        return self.state is not None


class Replica:
    """This process's completed step and the function that returns its state at that step (kept across restarts)."""

    def __init__(self) -> None:
        self.step = NONE_HELD
        self.state_of: Callable[[], dict[str, Any]] | None = None
        self.last: Restored | None = None

    def hold(self, step: int, state_of: Callable[[], dict[str, Any]]) -> None:
        """Say that `step` is complete and `state_of()` returns the state at it (call once a step: no copy is made)."""
        self.step, self.state_of = int(step), state_of

    def forget(self) -> None:
        self.step, self.state_of = NONE_HELD, None

    def restore(self) -> Restored:
        """The collective after joining a process group: the vote, then the transfer or the fallback (every rank)."""
        held = self.step if self.state_of is not None else NONE_HELD
        steps: list[int] = [NONE_HELD] * dist.get_world_size()
        dist.all_gather_object(steps, held)
        source, step, reason = _choose(steps)
        if source is None or step is None:
            result = Restored("checkpoint", None, reason)
        else:
            result = self._transfer(source, step)
        self.last = result
        _client.resumed(result.path, result.step, result.reason)
        if result.state is None:
            self.forget()  # the state held is not the one training goes on from
        return result

    def _transfer(self, source: int, step: int) -> Restored:
        me = dist.get_rank()
        header: list[Any] = [0, "", ""]
        payload = torch.empty(0, dtype=torch.uint8)
        if me == source:
            header, payload = _serialise(self.state_of)
        dist.broadcast_object_list(header, src=source)
        size, digest, failure = header
        if failure:
            return Restored("checkpoint", None, f"rank {source} could not serialise its state: {failure}")
        if me != source:
            payload = torch.empty(size, dtype=torch.uint8)
        dist.broadcast(payload, src=source)
        state, error = _take(payload, digest)
        errors: list[str] = [""] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        refused = [f"rank {rank}: {text}" for rank, text in enumerate(errors) if text]
        if refused:
            return Restored("checkpoint", None, "the transfer failed on " + "; ".join(refused)[:512])
        return Restored("peer", step, f"state of step {step} from rank {source}", state, source, size)


def _choose(steps: list[int]) -> tuple[int | None, int | None, str]:
    """The rank to send and the step, or None and why the checkpoint is used instead."""
    if os.environ.get(PEER_ENV, "1") == "0":
        return None, None, f"peer recovery is off ({PEER_ENV}=0)"
    if resume().skip_steps is not None:
        return None, None, "the recovery rolls back past bad data: the survivors' state is not to be kept"
    survivors = {rank: step for rank, step in enumerate(steps) if step != NONE_HELD}
    if not survivors:
        return None, None, "no rank survived holding a replica"
    held = sorted(set(survivors.values()))
    if len(held) > 1:
        return None, None, f"the survivors disagree on the step they hold ({', '.join(map(str, held))})"
    return min(survivors), held[0], ""


def _serialise(state_of: Callable[[], dict[str, Any]] | None) -> tuple[list[Any], torch.Tensor]:
    """On the source rank: the header [size, SHA-256, ""] and the bytes to broadcast, or [0, "", what failed]."""
    try:
        assert state_of is not None
        buffer = io.BytesIO()
        torch.save(state_of(), buffer)
        data = bytearray(buffer.getbuffer())
        return [len(data), hashlib.sha256(data).hexdigest(), ""], torch.frombuffer(data, dtype=torch.uint8)
    except Exception as exc:  # any failure is a fallback, said to every rank
        return [0, "", f"{type(exc).__name__}: {exc}"[:256]], torch.empty(0, dtype=torch.uint8)


def _take(payload: torch.Tensor, digest: str) -> tuple[dict[str, Any] | None, str]:
    """The state from the broadcast bytes, checked against the digest; or None and what was wrong."""
    try:
        data = payload.numpy().tobytes()
        if hashlib.sha256(data).hexdigest() != digest:
            return None, "the bytes received differ from the sender's digest"
        state = torch.load(io.BytesIO(data), weights_only=True)
        if not isinstance(state, dict):
            return None, f"the state is a {type(state).__name__}, not a dict"
        return state, ""
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"[:256]


replica = Replica()
