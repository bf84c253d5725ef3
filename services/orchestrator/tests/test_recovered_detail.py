"""What a recovered alert says of the ranks' state: from the survivors (0 steps redone) or from the checkpoint, why."""

from __future__ import annotations

from reprise_orchestrator.recoveries.flows import _recovered_detail
from reprise_orchestrator.recoveries.records import Resumed, Verified, VerifyPath
from reprise_orchestrator.recoveries.steps import StepResult


def _passed(resumed: Resumed | None) -> str:
    return _recovered_detail(VerifyPath.STEPS, StepResult(Verified(path=VerifyPath.STEPS, resumed=resumed)))


def test_the_peer_path_says_its_step_and_that_nothing_was_redone() -> None:
    said = _passed(Resumed(via="peer", step=47, why="state of step 47 from rank 0"))
    assert said == "training progressing again: resumed at step 47 from the surviving ranks' state, 0 steps redone"


def test_the_checkpoint_path_says_why_and_a_job_that_said_nothing_reads_as_before() -> None:
    said = _passed(Resumed(via="checkpoint", why="the survivors disagree (5, 6)"))
    assert said == "training progressing again from the checkpoint (the survivors disagree (5, 6))"
    assert _passed(None) == "training progressing again"
