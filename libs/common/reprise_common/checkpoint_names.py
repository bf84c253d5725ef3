"""Names of the checkpoints a script writes itself: a pattern such as ``snapshot-{step}.pt`` is checked once, when the
job is submitted, and matched by the agents that look for new checkpoints.

A pattern is one name (no ``/``) made of literal characters (letters, digits and ``._+=@,-``), ``*`` (any run of
characters), ``{step}`` (the step: 1-18 digits, exactly once) and, for per-rank files only, ``{rank}`` (1-7 digits,
exactly once). A placeholder never touches ``*`` or another placeholder, so the step read from a name is never a
guess. Nothing here backtracks without bound: names are at most 255 characters and the groups are digits only.
"""

from __future__ import annotations

import itertools
import re
from enum import StrEnum

PATTERN_MAX = 200
NAME_MAX = 255  # the longest file name Linux file systems take
STEP, RANK, ANY = "{step}", "{rank}", "*"
HF_PREFIX = "checkpoint-"  # transformers' PREFIX_CHECKPOINT_DIR: Trainer names its checkpoints checkpoint-<step>
_LITERAL_CHARS = r"A-Za-z0-9._+=@,\-"
_TOKENS = re.compile(rf"\{{step\}}|\{{rank\}}|\*|[{_LITERAL_CHARS}]+")
_GROUPS = {STEP: r"(?P<step>[0-9]{1,18})", RANK: r"(?P<rank>[0-9]{1,7})", ANY: r"[^/]*"}


class CheckpointLayout(StrEnum):
    """How a script lays out the checkpoints it writes without the SDK."""

    FILE = "file"  # one file per checkpoint in the directory (rank 0 saves it): snapshot-{step}.pt
    PER_RANK = "per_rank"  # one file per rank in the directory: model-{step}-rank{rank}.pt
    DCP = "dcp"  # a torch.distributed.checkpoint directory per checkpoint; its .metadata is written last
    HF = "hf"  # Hugging Face Trainer's checkpoint-{step}/ directories; trainer_state.json is written last


class PatternProblem(StrEnum):
    """Why a pattern cannot name checkpoints."""

    BAD_CHARACTER = "bad_character"
    NO_STEP = "no_step"
    AMBIGUOUS = "ambiguous"
    RANK = "rank"
    MATCHES_NOTHING = "matches_nothing"


class PatternError(ValueError):
    """A pattern that cannot name checkpoints; `problem` says which rule it breaks."""

    def __init__(self, problem: PatternProblem, message: str) -> None:
        super().__init__(message)
        self.problem = problem


def compile_pattern(pattern: str, layout: CheckpointLayout) -> re.Pattern[str]:
    """The pattern as a regular expression with a `step` group (and `rank` for per-rank files); PatternError."""
    tokens = _tokens(pattern)
    _check_placeholders(tokens, layout)
    shortest = sum(len(t) for t in tokens if t not in _GROUPS) + sum(1 for t in tokens if t in (STEP, RANK))
    if shortest > NAME_MAX:
        raise PatternError(PatternProblem.MATCHES_NOTHING, f"every name it matches is over {NAME_MAX} characters")
    regex = re.compile("".join(_GROUPS.get(t, re.escape(t)) for t in tokens))
    if layout is CheckpointLayout.HF and not _reads_step(regex, f"{HF_PREFIX}1234", 1234):
        raise PatternError(
            PatternProblem.MATCHES_NOTHING,
            f"Hugging Face Trainer names its checkpoints {HF_PREFIX}<step>: this pattern matches none of them"
            f" (use {HF_PREFIX}{STEP})",
        )
    return regex


def read_name(regex: re.Pattern[str], name: str) -> tuple[int, int | None] | None:
    """The step (and rank, for per-rank files) a name carries, or None when it does not match."""
    if len(name) > NAME_MAX:
        return None
    found = regex.fullmatch(name)
    if found is None:
        return None
    rank = found.groupdict().get("rank")
    return int(found["step"]), int(rank) if rank is not None else None


def name_of(pattern: str, *, step: int, rank: int | None = None) -> str | None:
    """The name a pattern gives a step (and rank) when it has no `*`; None when it has one."""
    if ANY in pattern:
        return None
    name = pattern.replace(STEP, str(step))
    return name.replace(RANK, str(rank)) if rank is not None else name


def _tokens(pattern: str) -> list[str]:
    tokens: list[str] = []
    at = 0
    while at < len(pattern):
        found = _TOKENS.match(pattern, at)
        if found is None:
            raise _bad_character(pattern[at])
        tokens.append(found.group())
        at = found.end()
    return tokens


def _bad_character(bad: str) -> PatternError:
    if bad in "/\x00":
        return PatternError(PatternProblem.MATCHES_NOTHING, f"{bad!r} is in no file name: the pattern matches nothing")
    if bad in "{}":
        return PatternError(PatternProblem.BAD_CHARACTER, f"{bad!r}: the only placeholders are {STEP} and {RANK}")
    return PatternError(PatternProblem.BAD_CHARACTER, f"{bad!r}: a pattern holds letters, digits, ._+=@,- and *")


def _check_placeholders(tokens: list[str], layout: CheckpointLayout) -> None:
    steps, ranks = tokens.count(STEP), tokens.count(RANK)
    if steps == 0:
        raise PatternError(PatternProblem.NO_STEP, f"the pattern yields no step: name where it is with {STEP}")
    if steps > 1:
        raise PatternError(PatternProblem.NO_STEP, f"{STEP} appears {steps} times: the step must be read once")
    if layout is CheckpointLayout.PER_RANK and ranks != 1:
        raise PatternError(PatternProblem.RANK, f"per-rank files name their rank once, with {RANK}")
    if layout is not CheckpointLayout.PER_RANK and ranks:
        raise PatternError(PatternProblem.RANK, f"{RANK} is for the per_rank layout only")
    for left, right in itertools.pairwise(tokens):
        if left in _GROUPS and right in _GROUPS:
            raise PatternError(
                PatternProblem.AMBIGUOUS, f"{left} touches {right}: the step could not be read from a name"
            )


def _reads_step(regex: re.Pattern[str], name: str, step: int) -> bool:
    found = read_name(regex, name)
    return found is not None and found[0] == step
