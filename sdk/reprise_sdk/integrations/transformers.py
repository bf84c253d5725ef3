"""Reprise for the Hugging Face ``Trainer`` (``pip install reprise-sdk[transformers]``)::

    from reprise_sdk.integrations.transformers import RepriseCallback, resume_checkpoint

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[RepriseCallback()])
    trainer.train(resume_from_checkpoint=resume_checkpoint())

The Trainer writes ``<output_dir>/checkpoint-N/`` (rank 0 the model, optimizer, scheduler and trainer state, each rank
its RNG state); after every save the callback waits for every rank, and rank 0 reports all the files with their
SHA-256 digests and writes the ``COMMITTED`` marker, so Reprise's registry validates it like an SDK checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .._client import PhaseScope, heartbeat, phase
from .._inplace import run as _run
from .._resume import ResumeInfo
from ._saved import commit_and_report, files_written, forget_commit, verified_restore_point, wait_for_every_rank

__all__ = ["RepriseCallback", "resume_checkpoint", "run"]

T = TypeVar("T")

_LOGGED = {"loss": "loss", "grad_norm": "grad_norm", "learning_rate": "lr"}  # the Trainer's log keys, as reported


class RepriseCallback(TrainerCallback):
    """Heartbeats every step (with the loss as the Trainer logs it), phases for evaluation and saving, and a report
    of every checkpoint the Trainer saved."""

    def __init__(self) -> None:
        self._phase: PhaseScope | None = None

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Heartbeat, then enter the phase of what the Trainer does next in this step (evaluate, save)."""
        heartbeat(state.global_step)
        if control.should_evaluate:
            self._enter("evaluation")
        elif control.should_save:
            self._enter_saving(args, state)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        """The loss (mean over ``logging_steps``), gradient norm and learning rate ride on a heartbeat."""
        metrics = _numbers(logs or {})
        if "loss" in metrics:
            heartbeat(state.global_step, **metrics)

    def on_prediction_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """An evaluation started outside the training loop (``trainer.evaluate()``) is an evaluation phase too."""
        if self._phase is None:
            self._enter("evaluation")

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Evaluation done: saving comes next when the Trainer will save in this step."""
        self._leave()
        if control.should_save:
            self._enter_saving(args, state)

    def on_predict(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, metrics: Any, **kwargs: Any
    ) -> None:
        """A ``trainer.predict()`` is over: its evaluation phase too."""
        self._leave()

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Every rank's part is written: commit the checkpoint and report it (rank 0 lists every rank's files)."""
        directory = _checkpoint_directory(args, state)
        if self._phase is None:
            self._enter("checkpointing")
        try:
            wait_for_every_rank()  # on every rank, whatever it wrote: a rank that skipped it would stall the others
            if directory.is_dir():  # not where a hyperparameter search's trial saved elsewhere
                files = files_written(directory) if state.is_world_process_zero else []
                commit_and_report(directory, state.global_step, files)
        finally:
            self._leave()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """No phase outlives training."""
        self._leave()

    def _enter_saving(self, args: TrainingArguments, state: TrainerState) -> None:
        self._enter("checkpointing")
        forget_commit(_checkpoint_directory(args, state))

    def _enter(self, name: str) -> None:
        self._leave()
        self._phase = phase(name)

    def _leave(self) -> None:
        scope, self._phase = self._phase, None
        if scope is not None:
            scope.__exit__(None, None, None)


def _numbers(logs: dict[str, Any]) -> dict[str, float]:
    """The logged loss, gradient norm and learning rate that are numbers (a log entry may be anything)."""
    found = {}
    for key, name in _LOGGED.items():
        try:
            found[name] = float(logs[key])
        except (KeyError, TypeError, ValueError):
            continue
    return found


def _checkpoint_directory(args: TrainingArguments, state: TrainerState) -> Path:
    """Where the Trainer saves the checkpoint of this step (``Trainer._save_checkpoint`` without a trial)."""
    return Path(str(args.output_dir)).absolute() / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"


def resume_checkpoint() -> str | None:
    """The directory to give ``trainer.train(resume_from_checkpoint=...)``: Reprise's restore point with every file
    checked against the registry's digests (CheckpointCorruptError otherwise), or None for a fresh start."""
    return verified_restore_point()


def run(train: Callable[[ResumeInfo], T]) -> T:
    """``reprise_sdk.run`` for a script that builds its Trainer inside `train`: a surviving rank restarts in place.

    accelerate (under the Trainer) keeps the rank, world size and process group of the first epoch in process-wide
    singletons; they are forgotten before each call of `train`, so the next epoch's arguments read its environment.
    """

    def fresh(info: ResumeInfo) -> T:
        _forget_accelerate_state()
        return train(info)

    return _run(fresh)


def _forget_accelerate_state() -> None:
    """Clear accelerate's shared state (its own tests do the same between runs; it has no public reset)."""
    from accelerate.state import (  # type: ignore[import-untyped]  # noqa: PLC0415 - the Trainer imported it
        AcceleratorState,
        GradientState,
    )

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
