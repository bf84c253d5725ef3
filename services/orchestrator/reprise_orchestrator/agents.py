"""Fenced commands to agents, sent to many nodes at once; every node's answer (or its absence) is returned."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from reprise_common import subjects
from reprise_common.bus import Bus
from reprise_common.clock import utcnow
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


def answers_record(answers: Sequence[NodeAnswer]) -> dict[str, Any]:
    """What a step records of a command's answers: how many nodes answered how, and each node that did not execute it.

    Counts rather than one entry per node: the record is rewritten with every later step of the recovery.
    """
    return {
        "nodes": len(answers),
        "results": dict(Counter(a.reply.result.value if a.reply else "no_answer" for a in answers)),
        "duplicates": sum(a.reply is not None and a.reply.duplicate for a in answers),
        "not_done": [a.summary() for a in answers if not a.ok],
    }


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
    issued_at = utcnow()
    subject_of = {node_id: subjects.node_command(node_id) for node_id in args_by_node}
    commands = {
        subject_of[node_id]: AgentCommand(
            command_id=f"{operation_id}:{action.value}:{node_id}",
            job_id=job_id,
            fence=fence,
            action=action,
            args=args,
            issued_at=issued_at,
        )
        for node_id, args in args_by_node.items()
    }
    replies = await bus.request_many(commands, CommandReply, timeout=timeout_s)
    answers = []
    for node_id, subject in subject_of.items():
        reply = replies[subject]
        if isinstance(reply, BusError):
            answers.append(NodeAnswer(node_id=node_id, reply=None, error=str(reply)))
        else:
            answers.append(NodeAnswer(node_id=node_id, reply=reply))
    return answers
