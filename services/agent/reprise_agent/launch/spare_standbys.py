"""A spare's standbys of a containerized job it never ran: the launch and the rank environment they are made from,
as a launch of the job here would make its ranks' (the orchestrator's PrepareStandbysCommand, docs/containers.md)."""

from __future__ import annotations

from pathlib import Path

from reprise_agent.rank_env import rank_env
from reprise_common.events import LaunchArgs, PrepareStandbysArgs, RankAssignment

# The rendezvous of a rank to come is not known yet: a standby is made before it, and takes the rank's on assignment.
UNKNOWN_MASTER = ("standby", 1)


def standby_launch(args: PrepareStandbysArgs, *, node_id: str) -> LaunchArgs:
    """A launch of the job's ranks of one node here, carrying what its standbys are made from (image, mounts, limits,
    command, environment, checkpoint directory) and how many it may need at once (its ranks here)."""
    master_addr, master_port = UNKNOWN_MASTER
    ranks = [RankAssignment(rank=i, node_id=node_id, local_rank=i) for i in range(args.ranks_per_node)]
    return LaunchArgs(
        restart_epoch=0, world_size=len(ranks), master_addr=master_addr, master_port=master_port, command=args.command,
        env=args.env, cwd=args.cwd, ranks=ranks, checkpoints=args.checkpoints, container=args.container,
    )  # fmt: skip


def standby_env(
    job_id: str, launch: LaunchArgs, *, node_id: str, sdk_socket: Path | None, inbox_dir: Path | None
) -> dict[str, str]:
    """The environment the standbys start with: a rank's of this launch (its own replaces it on assignment)."""
    return rank_env(
        job_id, launch, launch.ranks[0], node_id=node_id, resume_files=None, sdk_socket=sdk_socket, inbox_dir=inbox_dir
    )
