"""How a rank's captured Python stacks read, the same for the agent's stack sampler and the detector's hang verdict:
the torch.distributed call its main thread (the first) waits in, and where that thread is."""

from __future__ import annotations

from collections.abc import Sequence

from reprise_common.events import ThreadStack

COLLECTIVES_PATH = "torch/distributed/"  # a frame of this package in a rank's main thread: it waits in a collective


def _path(file: str) -> str:
    return file.replace("\\", "/")


def waits_in(threads: Sequence[ThreadStack]) -> str | None:
    """The torch.distributed function the main thread is in, innermost first; None when it is in none."""
    if not threads:
        return None
    for frame in threads[0].frames:
        if COLLECTIVES_PATH in _path(frame.file):
            return frame.function
    return None


def top_frame(threads: Sequence[ThreadStack]) -> str:
    """Where the main thread is: its innermost frame, "function (file:line)"; "" without frames."""
    if not threads or not threads[0].frames:
        return ""
    frame = threads[0].frames[0]
    where = _path(frame.file).rsplit("/", 1)[-1]
    return f"{frame.function} ({where}:{frame.line})" if frame.line is not None else f"{frame.function} ({where})"
