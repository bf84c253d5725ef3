"""Reprise for the ``pytorch_lightning`` package (``pip install reprise-sdk[lightning]``)::

    from reprise_sdk.integrations.pytorch_lightning import RepriseCallback, resume_checkpoint, trainer_args

    trainer = pl.Trainer(max_steps=1000, callbacks=[RepriseCallback("/ckpt/run-1", every_n_train_steps=100)],
                        **trainer_args())
    trainer.fit(model, ckpt_path=resume_checkpoint())

For ``lightning.pytorch`` use ``reprise_sdk.integrations.lightning``: the same names.
"""

from __future__ import annotations

from typing import Any

from pytorch_lightning import Callback
from pytorch_lightning.plugins.environments import TorchElasticEnvironment

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
