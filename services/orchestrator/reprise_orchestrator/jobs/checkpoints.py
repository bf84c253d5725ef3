"""The job spec's `checkpoints` section: where a script that does not use the SDK saves its own checkpoints; and the
agents' refusal of a restored one whose files differ.

Checked when the job is submitted, so that an agent never watches a place the registry would refuse: the directory
is absolute, free of '..', and resolves strictly inside one of the checkpoint roots (the registry's rule); the pattern
yields a step and can match a name of its layout (reprise_common.checkpoint_names).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from pydantic import ValidationInfo, field_validator, model_validator

from reprise_common.checkpoint_names import HF_PREFIX, STEP, CheckpointLayout, compile_pattern
from reprise_common.errors import RepriseError
from reprise_common.events import CheckpointWatch, LaunchReply
from reprise_orchestrator.compute.backend import Answers

RESTORE_TOKENS = ("{restore_path}", "{restore_step}")


class OutsideRootsError(RepriseError):
    """The section's directory does not lie inside the checkpoint roots; `field` names it within the section."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class CheckpointSpec(CheckpointWatch):
    """Where the script saves its checkpoints, how their names carry the step, and how a restore reaches it."""

    model_config = {"extra": "forbid", "frozen": True}

    @model_validator(mode="before")
    @classmethod
    def _hf_default_pattern(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("layout") == CheckpointLayout.HF and "pattern" not in data:
            return {**data, "pattern": f"{HF_PREFIX}{STEP}"}
        return data

    @field_validator("directory")
    @classmethod
    def _absolute(cls, directory: str) -> str:
        if "\x00" in directory or not os.path.isabs(directory):
            raise ValueError(f"{directory!r} is not an absolute path")
        if ".." in PurePosixPath(directory).parts:
            raise ValueError(f"{directory!r} contains '..': it could leave the checkpoint roots")
        return directory

    @field_validator("pattern")
    @classmethod
    def _pattern_names_checkpoints(cls, pattern: str, info: ValidationInfo) -> str:
        layout = info.data.get("layout")
        if layout is not None:  # else the layout itself is refused
            compile_pattern(pattern, layout)  # PatternError is a ValueError: a 422 naming the pattern
        return pattern

    @field_validator("restore_args")
    @classmethod
    def _known_tokens(cls, args: list[str]) -> list[str]:
        for arg in args:
            leftover = arg
            for token in RESTORE_TOKENS:
                leftover = leftover.replace(token, "")
            if "{" in leftover or "}" in leftover:
                raise ValueError(f"{arg!r}: the only placeholders are {' and '.join(RESTORE_TOKENS)}")
        return args

    def watch(self) -> CheckpointWatch:
        """What the agents need of it."""
        return CheckpointWatch.model_validate(self.model_dump())


def confine(spec: CheckpointSpec, roots: Sequence[Path]) -> None:
    """Refuse (OutsideRootsError naming `directory`) a directory that does not resolve strictly inside a root."""
    resolved = Path(os.path.realpath(spec.directory))  # symlinks count where they point
    if any(resolved != root and resolved.is_relative_to(root) for root in roots):
        if resolved.exists() and not resolved.is_dir():
            raise OutsideRootsError("directory", f"{spec.directory} is not a directory")
        return
    roots_text = ", ".join(str(root) for root in roots)
    raise OutsideRootsError("directory", f"{spec.directory} resolves outside the checkpoint roots ({roots_text})")


def refused_restore(answers: Answers[LaunchReply]) -> str | None:
    """Why an agent refused to start ranks on the restored checkpoint (a file differs from what the registry
    validated), naming the node; None when none did."""
    for answer in answers.items:
        if answer.reply is not None and answer.reply.data.restore_refused is not None:
            return f"{answer.node_id}: {answer.reply.data.restore_refused}"[:1024]
    return None
