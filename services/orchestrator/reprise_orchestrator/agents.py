"""Fenced commands to agents, sent to many nodes at once; every node's answer (or its absence) is returned."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.errors import BusError
from reprise_common.events import AgentCommand, CommandAction, CommandReply, CommandResult


@dataclass(frozen=True)
class NodeAnswer:
    """One node's answer to a command: a reply, or why there was none."""

    node_id: str
    reply: CommandReply | None
    error: str = ""

    @property
    def ok(self) -> bool:
        """True when the agent executed the command."""
        return self.reply is not None and self.reply.result is CommandResult.DONE

    @property
    def gone(self) -> bool:
        """True when nothing listens on the node's command subject: its agent is not running."""
        return self.reply is None and self.error.startswith("no responder")

    @property
    def stale(self) -> bool:
        """True when the agent refused our fence as stale: someone newer owns the job."""
        return self.reply is not None and self.reply.result is CommandResult.REJECTED_STALE_FENCE

    def summary(self) -> dict[str, Any]:
        """A compact record for the recovery's step history."""
        if self.reply is None:
            return {"node": self.node_id, "result": "no_answer", "error": self.error}
        return {"node": self.node_id, "result": self.reply.result.value, "duplicate": self.reply.duplicate}


async def command_nodes(
    bus: Bus,
    *,
    operation_id: str,
    job_id: str,
    fence: int,
    action: CommandAction,
    args_by_node: Mapping[str, dict[str, Any]],
    timeout_s: float,
) -> list[NodeAnswer]:
    """Send one command per node with the id `<operation>:<action>:<node>` so a resend is executed once."""

    async def one(node_id: str, args: dict[str, Any]) -> NodeAnswer:
        command = AgentCommand(
            command_id=f"{operation_id}:{action.value}:{node_id}", job_id=job_id, fence=fence, action=action, args=args
        )
        try:
            reply = await bus.request(subjects.node_command(node_id), command, CommandReply, timeout=timeout_s)
        except BusError as exc:
            return NodeAnswer(node_id=node_id, reply=None, error=str(exc))
        return NodeAnswer(node_id=node_id, reply=reply)

    return list(await asyncio.gather(*(one(node, args) for node, args in args_by_node.items())))
