"""One-line integrations of the training SDK with training frameworks (each imports its framework only when imported).

* ``reprise_sdk.integrations.lightning``: ``RepriseCallback`` for ``lightning.pytorch`` (``reprise-sdk[lightning]``);
  ``reprise_sdk.integrations.pytorch_lightning``: the same for the ``pytorch_lightning`` package;
* ``reprise_sdk.integrations.transformers``: ``RepriseCallback`` for Hugging Face ``Trainer``
  (``reprise-sdk[transformers]``).

Each heartbeats with the loss, sets the SDK's phases for evaluation and saving, reports every checkpoint the framework
wrote (with SHA-256 digests, and a ``COMMITTED`` marker once every rank's files are durable) and has a helper that
gives the framework's own resume argument Reprise's restore point, checked against the registry's digests.
"""
