"""The group every containerized rank runs in beside its image's user (``REPRISE_CONTAINER_GID``, docs/containers.md,
"Users"): what the agent makes for its ranks to write (a rank's inbox directory, a standby's FIFO, a rank's output
file, a checkpoint directory the agent creates, the SDK socket) belongs to that group, so that a rank whose container
runs as a user other than root, named or numeric, uses them as a root rank does, and no host user outside the group
can. The containers get it as a supplementary group (``group_add``); the agent needs no knowledge of the image's
users."""

from __future__ import annotations

import os
from pathlib import Path

from reprise_common.logging import get_logger

log = get_logger("reprise.agent.containers")

DEFAULT_GID = 46271  # a group no host user is in (an operator whose hosts use this number sets another)
DIRECTORY, FILE, SHARED_DIRECTORY = 0o2770, 0o660, 0o2775  # setgid: what a rank makes in there keeps the group


def grant(path: Path, gid: int, mode: int) -> None:
    """Give `path` to the group with `mode`. An agent that may not (not root) leaves it as it is, with a warning: a
    rank of a user other than root then cannot use it."""
    try:
        os.chown(path, -1, gid)
        os.chmod(path, mode)
    except PermissionError as exc:
        log.warning("not given to the containers' group", extra={"path": str(path), "gid": gid, "error": str(exc)})
