"""Each command's reply is typed at both ends and carries on the wire the keys it always carried, no others."""

from __future__ import annotations

import json

import pytest

from reprise_common.events import (
    AgentReply,
    CommandReply,
    CommandResult,
    LaunchData,
    LaunchReply,
    PingData,
    PingReply,
    RankStopped,
    RecoveryChange,
    RecoveryChangeKind,
    RecoveryOutcome,
    RecoveryStep,
    ReplyData,
    ReplyEnvelope,
    StopData,
    StopReply,
)

ENVELOPE = {"command_id": "c-1", "node_id": "n-1"}


def _data(reply: ReplyEnvelope) -> dict[str, object]:
    return dict(json.loads(reply.model_dump_json())["data"])


@pytest.mark.parametrize(
    ("reply", "keys"),
    [
        (PingReply(**ENVELOPE, result=CommandResult.DONE, data=PingData(ranks=2, spare=True)), {"ranks", "spare"}),
        (
            LaunchReply(**ENVELOPE, result=CommandResult.DONE, data=LaunchData(pids=[7], in_place=[])),
            {"pids", "in_place"},
        ),
        (
            LaunchReply(**ENVELOPE, result=CommandResult.FAILED, data=LaunchData(restore_refused="x")),
            {"restore_refused"},
        ),
        (
            StopReply(**ENVELOPE, result=CommandResult.DONE, data=StopData(stopped=[], parked=[1])),
            {"stopped", "parked"},
        ),
        (
            AgentReply(**ENVELOPE, result=CommandResult.REJECTED_STALE_FENCE, data=ReplyData(highest_fence=4)),
            {"highest_fence"},
        ),
        (AgentReply(**ENVELOPE, result=CommandResult.FAILED, detail="bad command"), set()),
    ],
    ids=["ping", "launch", "refused-restore", "stop", "stale", "failed"],
)
def test_a_reply_carries_only_the_keys_its_writer_set(reply: ReplyEnvelope, keys: set[str]) -> None:
    assert set(_data(reply)) == keys


def test_each_command_reads_its_reply_typed_and_any_reader_as_a_dict() -> None:
    stop = StopReply(
        **ENVELOPE,
        result=CommandResult.DONE,
        data=StopData(stopped=[RankStopped(rank=0, exit_code=None, signal="SIGKILL")], parked=[1, 2]),
    )
    wire = stop.model_dump_json()
    assert StopReply.model_validate_json(wire).data.parked == [1, 2]
    assert CommandReply.model_validate_json(wire).data["stopped"] == [
        {"rank": 0, "exit_code": None, "signal": "SIGKILL"}
    ]
    stale = AgentReply(**ENVELOPE, result=CommandResult.REJECTED_STALE_FENCE, data=ReplyData(highest_fence=9))
    as_launch = LaunchReply.model_validate_json(stale.model_dump_json())  # a refusal reads as any command's reply
    assert (as_launch.data.highest_fence, as_launch.data.pids, as_launch.data.restore_refused) == (9, [], None)


def test_a_recovery_change_reads_enums_back_and_writes_the_strings_it_always_wrote() -> None:
    stepping = {
        "source": "orchestrator",
        "change": "step",
        "recovery_id": "r-1",
        "job_id": "j-1",
        "step": "launching",
        "fence": 3,
        "outcome": "",
    }
    event = RecoveryChange.model_validate(stepping)
    assert (event.change, event.step, event.outcome) == (RecoveryChangeKind.STEP, RecoveryStep.LAUNCHING, None)
    assert json.loads(event.to_bytes())["outcome"] == ""
    ended = RecoveryChange.model_validate(stepping | {"change": "failed", "step": "failed", "outcome": "no_capacity"})
    assert ended.outcome is RecoveryOutcome.NO_CAPACITY
    assert json.loads(ended.to_bytes())["outcome"] == "no_capacity"
