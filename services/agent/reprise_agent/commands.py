"""Fenced, idempotent command execution: a command id runs at most once; a stale fencing token is refused."""

from __future__ import annotations

import asyncio
import json
import os
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from reprise_common.events import AgentCommand, AgentReply, CommandResult, ReplyData, ReplyEnvelope
from reprise_common.logging import get_logger

log = get_logger("reprise.agent.commands")
C = TypeVar("C", bound=AgentCommand)


class CommandBook:
    """Remembers the highest fence per job (on disk, so a restart cannot forget it) and each command's answer."""

    def __init__(self, *, node_id: str, state_file: Path, remember: int = 10_000) -> None:
        self.node_id = node_id
        self.state_file = state_file
        self.remember = remember
        self._fences: dict[str, int] = self._load()
        self._answers: OrderedDict[str, asyncio.Future[ReplyEnvelope]] = OrderedDict()
        self.executed = 0

    def _load(self) -> dict[str, int]:
        try:
            return {str(k): int(v) for k, v in json.loads(self.state_file.read_text()).items()}
        except FileNotFoundError:
            return {}

    def _save(self) -> None:
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._fences))
        os.replace(tmp, self.state_file)

    def highest_fence(self, job_id: str) -> int:
        """The highest fencing token accepted for a job (-1 if none)."""
        return self._fences.get(job_id, -1)

    async def run(self, command: C, execute: Callable[[C], Awaitable[ReplyEnvelope]]) -> ReplyEnvelope:
        """Execute a command once; a repeat (even while the first is running) gets the first answer.

        The fence is checked first, repeats included: an owner that lost the job gets "stale" even for a command id
        that its successor already executed, so it learns it has been replaced.
        """
        if command.fence < self.highest_fence(command.job_id):
            return self._stale(command)
        known = self._answers.get(command.command_id)
        if known is not None:
            first = await asyncio.shield(known)
            return first.model_copy(update={"duplicate": True})
        future: asyncio.Future[ReplyEnvelope] = asyncio.get_running_loop().create_future()
        self._answers[command.command_id] = future
        while len(self._answers) > self.remember:
            self._answers.popitem(last=False)
        reply = await self._fenced(command, execute)
        future.set_result(reply)
        return reply

    def _stale(self, command: AgentCommand) -> AgentReply:
        highest = self.highest_fence(command.job_id)
        log.warning(
            "stale fence refused",
            extra={"job_id": command.job_id, "fence": command.fence, "highest": highest, "cmd": command.command_id},
        )
        return AgentReply(
            command_id=command.command_id,
            node_id=self.node_id,
            result=CommandResult.REJECTED_STALE_FENCE,
            detail=f"stale fencing token {command.fence} for job {command.job_id}: highest seen is {highest}",
            data=ReplyData(highest_fence=highest),
        )

    async def _fenced(self, command: C, execute: Callable[[C], Awaitable[ReplyEnvelope]]) -> ReplyEnvelope:
        highest = self.highest_fence(command.job_id)
        if command.fence < highest:  # a newer owner got in while this command waited its turn
            return self._stale(command)
        if command.fence > highest:
            self._fences[command.job_id] = command.fence
            self._save()
        self.executed += 1
        try:
            return await execute(command)
        except Exception as exc:  # the answer says what went wrong; the agent keeps serving
            log.exception("command failed", extra={"cmd": command.command_id})
            return AgentReply(
                command_id=command.command_id,
                node_id=self.node_id,
                result=CommandResult.FAILED,
                detail=repr(exc),
            )
