"""A Hugging Face ``Trainer`` job under Reprise: a tiny GPT-2 built from a config (nothing downloaded), trained on
synthetic token sequences on CPU, with Reprise's callback as its one added line and Reprise's restore point as its
``resume_from_checkpoint``.

Runs alone, under ``torchrun`` or under Reprise (the agent sets the rank environment and the checkpoint)::

    torchrun --nproc-per-node 2 examples/hf_train.py --steps 40 --output-dir /tmp/hf-run
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is built from a config: nothing is fetched
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # after the environment that transformers reads at import
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from reprise_sdk.integrations.transformers import RepriseCallback, resume_checkpoint, run

VOCAB, CONTEXT = 64, 16


class Sequences(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Token sequences that follow a rule (each token is the previous plus a per-sequence stride): learnable."""

    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, VOCAB, (size, 1), generator=generator)
        strides = torch.randint(1, 4, (size, 1), generator=generator)
        self.tokens = (starts + strides * torch.arange(CONTEXT)) % VOCAB

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


class Pace(TrainerCallback):
    """Sleeps after each step, so that a demo or a test can inject a fault while the job runs."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Sleep; changes no number."""
        time.sleep(self.seconds)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (examples/README.md)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps in the whole run")
    parser.add_argument("--save-every", type=int, default=10, help="a checkpoint-N/ every K steps")
    parser.add_argument("--eval-every", type=int, default=0, help="an evaluation every K steps (0: never)")
    parser.add_argument("--output-dir", type=Path, default=Path("hf-run"), help="where checkpoint-N/ directories go")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds slept after each step")
    parser.add_argument("--in-place", action="store_true", help="under reprise_sdk's run: survivors restart in place")
    return parser.parse_args(argv)


def build_trainer(options: argparse.Namespace) -> Trainer:
    """The model, data and arguments: every run with the same options trains the same way."""
    torch.manual_seed(options.seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=32, n_layer=2, n_head=2)
    evaluating = options.eval_every > 0
    args = TrainingArguments(
        output_dir=str(options.output_dir),
        max_steps=options.steps,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        save_strategy="steps",
        save_steps=options.save_every,
        eval_strategy="steps" if evaluating else "no",
        eval_steps=options.eval_every if evaluating else None,
        logging_steps=1,  # the loss of every step reaches Reprise's heartbeat
        logging_nan_inf_filter=False,  # a NaN loss is reported as it is: Reprise's numeric watch sees it
        report_to=[],
        use_cpu=True,
        seed=options.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
        ddp_find_unused_parameters=False,
    )
    callbacks: list[TrainerCallback] = [RepriseCallback()]  # the one line Reprise needs
    if options.step_sleep:
        callbacks.append(Pace(options.step_sleep))
    return Trainer(
        model=GPT2LMHeadModel(config),
        args=args,
        train_dataset=Sequences(512, options.seed),
        eval_dataset=Sequences(64, options.seed + 1) if evaluating else None,
        callbacks=callbacks,
    )


def train(options: argparse.Namespace) -> None:
    """Train from Reprise's restore point (or from scratch) to the last step; rank 0 prints the parameters' digest."""
    trainer = build_trainer(options)
    start = resume_checkpoint()  # Reprise's restore point, checked against the registry's digests; None: fresh
    if start is not None:
        print(f"resuming from {start}", flush=True)
    trainer.train(resume_from_checkpoint=start)
    if trainer.is_world_process_zero():
        digest = hashlib.sha256()
        assert trainer.model is not None
        for tensor in trainer.model.state_dict().values():
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
        print(f"trained to step {trainer.state.global_step}", flush=True)
        print(f"params-sha256 {digest.hexdigest()}", flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    """Train; with --in-place, under the integration's run so that a surviving rank keeps its process."""
    options = parse_args(argv)
    if options.in_place:
        run(lambda _info: train(options))
    else:
        train(options)


if __name__ == "__main__":
    main()
