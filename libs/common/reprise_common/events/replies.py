"""An agent's answers to commands: one reply type per command, each with its own typed data.

On the wire a reply is ``{command_id, node_id, result, detail, data, duplicate}``; what ``data`` holds depends on the
command (and on the result: a stale refusal carries the agent's highest fence, a refused restore its reason). A reply
leaves off the wire every data field its writer did not set, so each reply carries the keys it always carried.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import AwareDatetime, Field, NonNegativeInt, SerializerFunctionWrapHandler, model_serializer

from reprise_common.events.base import Wire


class CommandResult(StrEnum):
    """How an agent answered a command."""

    DONE = "done"
    REJECTED_STALE_FENCE = "rejected_stale_fence"
    FAILED = "failed"


# In a failed launch's reply data: why the agent refused the restored checkpoint (a file differs from the manifest).
RESTORE_REFUSED = "restore_refused"


class ReplyData(Wire):
    """What any reply's data may carry; a field its writer did not set stays off the wire."""

    highest_fence: int | None = Field(default=None, description="a stale refusal's: the highest fence the agent saw")

    @model_serializer(mode="wrap")
    def _set_fields_only(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        dumped: dict[str, Any] = handler(self)
        return {key: value for key, value in dumped.items() if key in self.model_fields_set}


class PingData(ReplyData):
    """What a node runs: how many ranks, and whether it is a spare."""

    ranks: NonNegativeInt = 0
    spare: bool = False


class LaunchData(ReplyData):
    """The launched ranks' process ids, and the ranks that restarted in place (parked ones resumed)."""

    pids: list[int] = Field(default_factory=list)
    in_place: list[NonNegativeInt] = Field(default_factory=list)
    restore_refused: str | None = Field(
        default=None, description="a failed launch's: why the agent refused the restored checkpoint"
    )


class RankStopped(Wire):
    """How one stopped rank ended."""

    rank: NonNegativeInt
    exit_code: int | None = None
    signal: str | None = Field(default=None, description="the signal's name (SIGKILL) when one ended it")


class StopData(ReplyData):
    """The ranks stopped, and those parked for a restart in place (sorted)."""

    stopped: list[RankStopped] = Field(default_factory=list)
    parked: list[NonNegativeInt] = Field(default_factory=list)
    ended_at: AwareDatetime | None = Field(
        default=None,
        description="when every rank the stop left unparked had ended, on the agent's clock (its reports' clock): a "
        "report the node built before then may still show them alive",
    )


class PrepareStandbysData(ReplyData):
    """How many standby containers of the job this node keeps now (0 after a drop, or where it keeps none)."""

    standbys: NonNegativeInt = 0


class CaptureStacksData(ReplyData):
    """The ranks whose stacks were captured (sorted), and those of them whose capture failed (its rank.stacks event
    says why); both empty when this incident's stacks were captured here already."""

    captured: list[NonNegativeInt] = Field(default_factory=list)
    failed: list[NonNegativeInt] = Field(default_factory=list)


class ReplyEnvelope(Wire):
    """What every reply carries besides its data; a repeated command id gets the first answer again."""

    command_id: str
    node_id: str
    result: CommandResult
    detail: str = ""
    duplicate: bool = False


class AgentReply(ReplyEnvelope):
    """A reply whatever the command: a refusal (stale fence) or a failure before the command ran."""

    data: ReplyData = Field(default_factory=ReplyData)


class PingReply(AgentReply):
    """The answer to a ping."""

    data: PingData = Field(default_factory=PingData)


class LaunchReply(AgentReply):
    """The answer to a launch."""

    data: LaunchData = Field(default_factory=LaunchData)


class StopReply(AgentReply):
    """The answer to a stop."""

    data: StopData = Field(default_factory=StopData)


class PrepareStandbysReply(AgentReply):
    """The answer to a prepare-standbys command."""

    data: PrepareStandbysData = Field(default_factory=PrepareStandbysData)


class CaptureStacksReply(AgentReply):
    """The answer to a stack capture."""

    data: CaptureStacksData = Field(default_factory=CaptureStacksData)


class CommandReply(ReplyEnvelope):
    """Any command's reply with its data untyped, for readers that do not know which command was answered."""

    data: dict[str, Any] = Field(default_factory=dict)
