"""Reprise training SDK: three lines in a training script keep Reprise informed of its progress.

    import reprise_sdk
    start = reprise_sdk.resume().checkpoint            # the checkpoint to resume from, or None
    reprise_sdk.heartbeat(step, loss=loss)             # once per step
    reprise_sdk.checkpoint_saved(path, step, files)    # after this rank wrote its part of a checkpoint

``reprise_sdk.run(train)`` runs the training function so that, after a peer's failure, this rank restarts in place
(same process, same imports) when the agent hands it the next epoch, instead of being killed and started cold.

Every call costs microseconds, never blocks and never raises (but for a restart ordered under ``run``); outside
Reprise (no ``REPRISE_SDK_SOCKET``) it does nothing. ``reprise_sdk.torch`` has checkpoint helpers for PyTorch;
importing ``reprise_sdk`` never imports torch. The SDK's own modules import each other relatively so that the package
can be vendored as it is.
"""

from ._client import (
    PROTOCOL_VERSION,
    SOCKET_ENV,
    PhaseScope,
    RestartRequested,
    SdkStats,
    checkpoint_saved,
    heartbeat,
    phase,
    stats,
)
from ._inplace import run
from ._resume import ResumeInfo, resume
from ._verify import CheckpointCorruptError, verify_files

__all__ = [
    "PROTOCOL_VERSION",
    "SOCKET_ENV",
    "CheckpointCorruptError",
    "PhaseScope",
    "RestartRequested",
    "ResumeInfo",
    "SdkStats",
    "checkpoint_saved",
    "heartbeat",
    "phase",
    "resume",
    "run",
    "stats",
    "verify_files",
]
