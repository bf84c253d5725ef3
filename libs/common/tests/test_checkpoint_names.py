"""The checkpoint name patterns: which names they match, the step (and rank) they read, and why a pattern is refused."""

from __future__ import annotations

import pytest

from reprise_common.checkpoint_names import CheckpointLayout, PatternError, PatternProblem, compile_pattern, read_name

FILE, PER_RANK, DCP, HF = CheckpointLayout


@pytest.mark.parametrize(
    ("pattern", "layout", "name", "read"),
    [
        ("snapshot-{step}.pt", FILE, "snapshot-120.pt", (120, None)),
        ("snapshot-{step}.pt", FILE, "snapshot-120.pt.tmp", None),  # a writer's temporary name is not a checkpoint
        ("snapshot-{step}.pt", FILE, "snapshot-.pt", None),
        ("epoch=*-step={step}.ckpt", FILE, "epoch=3-step=900.ckpt", (900, None)),
        ("model-{step}-rank{rank}.pt", PER_RANK, "model-7-rank12.pt", (7, 12)),
        ("step_{step}", DCP, "step_0", (0, None)),
        ("checkpoint-{step}", HF, "checkpoint-500", (500, None)),
        ("checkpoint-{step}", HF, "tmp-checkpoint-500", None),
        ("s{step}", FILE, "s" + "9" * 19, None),  # more digits than a step has
    ],
)
def test_a_pattern_reads_the_step_from_the_names_it_matches(
    pattern: str, layout: CheckpointLayout, name: str, read: tuple[int, int | None] | None
) -> None:
    assert read_name(compile_pattern(pattern, layout), name) == read


@pytest.mark.parametrize(
    ("pattern", "layout", "problem"),
    [
        ("snapshot.pt", FILE, PatternProblem.NO_STEP),
        ("s-{step}-{step}", FILE, PatternProblem.NO_STEP),
        ("s-{step}*", FILE, PatternProblem.AMBIGUOUS),
        ("m-{step}{rank}", PER_RANK, PatternProblem.AMBIGUOUS),
        ("m-{step}.pt", PER_RANK, PatternProblem.RANK),
        ("m-{step}-{rank}.pt", FILE, PatternProblem.RANK),
        ("dir/s-{step}", FILE, PatternProblem.MATCHES_NOTHING),
        ("ckpt-{step}", HF, PatternProblem.MATCHES_NOTHING),
        ("s {step}", FILE, PatternProblem.BAD_CHARACTER),
        ("s-{steps}", FILE, PatternProblem.BAD_CHARACTER),
    ],
)
def test_a_pattern_that_cannot_name_checkpoints_is_refused_with_its_reason(
    pattern: str, layout: CheckpointLayout, problem: PatternProblem
) -> None:
    with pytest.raises(PatternError) as refused:
        compile_pattern(pattern, layout)
    assert refused.value.problem is problem
