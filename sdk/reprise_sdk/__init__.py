"""Reprise training SDK: three lines in a training script keep Reprise informed of its progress.

    import reprise_sdk
    start = reprise_sdk.resume().checkpoint            # the checkpoint to resume from, or None
    reprise_sdk.heartbeat(step, loss=loss)             # once per step
    reprise_sdk.checkpoint_saved(path, step, files)    # after this rank wrote its part of a checkpoint

Every call costs microseconds, never blocks and never raises; outside Reprise (no ``REPRISE_SDK_SOCKET``) it does
nothing. ``reprise_sdk.torch`` has checkpoint helpers for PyTorch; importing ``reprise_sdk`` never imports torch.
The SDK's own modules import each other relatively so that the package can be vendored as it is.
"""

from ._client import (
    PROTOCOL_VERSION,
    SOCKET_ENV,
    PhaseScope,
    SdkStats,
    checkpoint_saved,
    heartbeat,
    phase,
    stats,
)
from ._resume import ResumeInfo, resume
from ._verify import CheckpointCorruptError, verify_files

__all__ = [
    "PROTOCOL_VERSION",
    "SOCKET_ENV",
    "CheckpointCorruptError",
    "PhaseScope",
    "ResumeInfo",
    "SdkStats",
    "checkpoint_saved",
    "heartbeat",
    "phase",
    "resume",
    "stats",
    "verify_files",
]
