"""The Lightning integration, written once for both packages that ship Lightning (``lightning`` and
``pytorch_lightning`` define distinct classes, and a Trainer takes only callbacks of its own package).

Nothing here imports a framework: the trainer is used through the attributes both packages share.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._client import PhaseScope, heartbeat, phase
from .._resume import resume
from ._saved import commit_and_report, files_written, forget_commit, verified_restore_point

CHECKPOINT_FILE = "model.ckpt"  # one file per checkpoint, in a directory of its own: step-00000040/model.ckpt


class LightningHooks:
    """RepriseCallback's hooks: heartbeat with the loss, phases for validation and saving, checkpoints reported.

    `every_n_train_steps` 0 saves nothing on its own (``save(trainer)`` still does).
    """

    def __init__(self, dirpath: str | os.PathLike[str], *, every_n_train_steps: int = 0) -> None:
        self.dirpath = Path(dirpath).absolute()
        self.every_n_train_steps = every_n_train_steps
        self._saved_step = -1
        self._validation: PhaseScope | None = None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Heartbeat with the step's loss, then save on the callback's cadence (what ModelCheckpoint does here)."""
        step = int(trainer.global_step)
        heartbeat(step, **_loss_of(outputs))
        if self.every_n_train_steps > 0 and step > 0 and step % self.every_n_train_steps == 0:
            self.save(trainer)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        """A long validation is not a hang: the detector times it with the evaluation limit."""
        self._validation = phase("validation")

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        """Back to the phase validation interrupted."""
        self._leave_validation()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """A validation cut short by an error (a failed peer) does not leave the phase set for the next epoch."""
        self._leave_validation()

    def save(self, trainer: Any) -> Path:
        """Save a checkpoint through the trainer (every rank calls this) into its own directory, and report it."""
        step = int(trainer.global_step)
        directory = self.dirpath / f"step-{step:08d}"
        target = directory / CHECKPOINT_FILE
        if step == self._saved_step:
            return target
        with phase("checkpointing"):
            forget_commit(directory)
            # Lightning ends the save with a barrier: then every rank's part (a sharded strategy's too) is written
            trainer.save_checkpoint(target, weights_only=False)
            commit_and_report(directory, step, files_written(directory) if trainer.is_global_zero else [])
        self._saved_step = step
        return target

    def _leave_validation(self) -> None:
        scope, self._validation = self._validation, None
        if scope is not None:
            scope.__exit__(None, None, None)


def _loss_of(outputs: Any) -> dict[str, float]:
    """The loss training_step returned (a tensor, or a mapping with "loss"), as a float so a NaN is seen at once."""
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    if loss is None:
        return {}
    try:
        return {"loss": float(loss)}
    except (TypeError, ValueError, RuntimeError):  # not a scalar: heartbeat without it
        return {}


def resume_checkpoint() -> str | None:
    """The file to give ``trainer.fit(ckpt_path=...)``: Reprise's restore point, checked against the registry's
    digests (CheckpointCorruptError otherwise), or None for a fresh start."""
    checkpoint = verified_restore_point()  # every rank reads it all (a file, or a sharded strategy's directory)
    return None if checkpoint is None else str(Path(checkpoint) / CHECKPOINT_FILE)


def one_gpu_per_rank() -> bool:
    """The agent gives each rank its own GPU (CUDA_VISIBLE_DEVICES): every rank sees exactly one, as its device 0."""
    import torch  # noqa: PLC0415 - Lightning imported it already

    return bool(torch.cuda.is_available() and torch.cuda.device_count() == 1)


class EnvironmentHooks:
    """The ranks as the agent launched them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT): Lightning starts none.

    Mixed into each package's TorchElasticEnvironment. Where each rank sees one GPU of its own (the agent's
    CUDA_VISIBLE_DEVICES), that GPU is its device 0.
    """

    def local_rank(self) -> int:
        """The rank's device index on its node."""
        return 0 if one_gpu_per_rank() else int(os.environ["LOCAL_RANK"])


def trainer_args(environment: Any) -> dict[str, Any]:
    """``Trainer`` arguments matching the ranks Reprise launched ({} outside Reprise: Lightning decides)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return {}
    info = resume()
    per_node = 1 if one_gpu_per_rank() else max(1, info.local_world_size)
    return {"num_nodes": max(1, info.world_size // per_node), "devices": per_node, "plugins": [environment]}
