"""What lets a containerized rank outlive its agent's process (docs/containers.md, "An agent restarted"): the agent's
SDK socket reached through a directory the next agent re-links, and a later agent's adoption of a container its
predecessor started (one it cannot adopt is removed by launch/containers.py, its init killed from the host while the
daemon is away)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import docker
import docker.errors

from reprise_agent.launch.container_handle import ContainerHandle
from reprise_agent.launch.container_output import copied_offset
from reprise_agent.launch.container_procs import descendants
from reprise_common.logging import get_logger
from reprise_common.procs import start_ticks

log = get_logger("reprise.agent.containers")

LABEL = "io.reprise"  # every label of ours starts with it: <LABEL>.node, .job, .epoch, .rank


def sdk_socket_link(sdk_socket: Path) -> Path | None:
    """``<socket>.d/<name>``, a hard link to the agent's SDK socket in a directory of its own (made or refreshed now),
    which containers mount instead of the socket: a file's bind keeps the inode it found, and a restarted agent binds
    a new one, which a running container sees only through a directory. None when no link can be made there."""
    directory = sdk_socket.with_name(sdk_socket.name + ".d")
    linked = directory / sdk_socket.name
    try:
        if linked.exists() and os.path.samefile(linked, sdk_socket):
            return linked
        directory.mkdir(mode=0o755, exist_ok=True)
        partial = directory / f".{secrets.token_hex(4)}.partial"
        os.link(sdk_socket, partial)
        os.replace(partial, linked)  # a rank reconnecting finds the old socket or the new, never none
    except OSError as exc:
        log.warning("sdk socket not linked: containers mount its file", extra={"error": str(exc)})
        return None
    return linked


def adopt(client: docker.DockerClient, record: Mapping[str, Any]) -> ContainerHandle | None:
    """Re-attach to a rank's container a dead agent's ledger names, when it still runs that rank's process (same
    init, same rank pid and start time); None when it is gone or not what the record says. On the running loop."""
    try:
        container = client.containers.get(str(record["container_id"]))
    except docker.errors.NotFound:
        return None
    state = container.attrs.get("State") or {}
    init_pid, pid = int(state.get("Pid") or 0), int(record.get("pid") or 0)
    if not state.get("Running") or init_pid != record.get("init_pid") or start_ticks(pid) != record.get("started"):
        return None
    if pid != init_pid and pid not in set(descendants(init_pid)):
        return None
    inbox, link = _path(record.get("inbox")), _path(record.get("inbox_link"))
    changes = {str(k): str(v) for k, v in dict(record.get("env_changes") or {}).items()}
    output = _path(record.get("output_file"))
    handle = ContainerHandle(
        container, init_pid=init_pid, pid=pid, inbox=inbox, inbox_link=link, env_changes=changes, output_file=output
    )
    offset = copied_offset(output) if output is not None else 0
    handle.follow(asyncio.get_running_loop(), since=_copied_until(record), offset=offset)
    return handle


def _path(text: object) -> Path | None:
    return Path(str(text)) if text else None


def _copied_until(record: Mapping[str, Any]) -> float:
    """When the dead agent last wrote the rank's log: its output from then on is copied (not all of it again)."""
    with contextlib.suppress(OSError, KeyError):
        return os.stat(str(record["log"])).st_mtime
    return time.time()
