"""Reprise for PyTorch Lightning (``lightning.pytorch``; ``pip install reprise-sdk[lightning]``)::

    from reprise_sdk.integrations.lightning import RepriseCallback, resume_checkpoint, trainer_args

    trainer = L.Trainer(max_steps=1000, callbacks=[RepriseCallback("/ckpt/run-1", every_n_train_steps=100)],
                        **trainer_args())
    trainer.fit(model, ckpt_path=resume_checkpoint())

For the ``pytorch_lightning`` package use ``reprise_sdk.integrations.pytorch_lightning``: the same names.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback
from lightning.pytorch.plugins.environments import TorchElasticEnvironment

from . import _lightning_hooks
from ._lightning_hooks import CHECKPOINT_FILE, EnvironmentHooks, LightningHooks, resume_checkpoint

__all__ = ["CHECKPOINT_FILE", "RepriseCallback", "RepriseEnvironment", "resume_checkpoint", "trainer_args"]


class RepriseCallback(LightningHooks, Callback):
    """Heartbeats with the loss, phases for validation and saving, and a reported checkpoint every N steps, each into
    ``<dirpath>/step-NNNNNNNN/model.ckpt`` (one directory each, as Reprise's registry wants them)."""


class RepriseEnvironment(EnvironmentHooks, TorchElasticEnvironment):
    """The ranks as the agent launched them (see EnvironmentHooks)."""


def trainer_args() -> dict[str, Any]:
    """``num_nodes``, ``devices`` and the cluster environment of the ranks Reprise launched ({} outside Reprise)."""
    return _lightning_hooks.trainer_args(RepriseEnvironment())
