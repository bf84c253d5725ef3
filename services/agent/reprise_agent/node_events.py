"""The events a node publishes about what its agent saw: a rank's exit or parking, a rank lost with an earlier agent
process, a saved checkpoint, GPU signals, a failed dependency, a rank's captured stacks."""

from __future__ import annotations

from pydantic import ValidationError

from reprise_agent.depchecks.checker import CheckResult, rendezvous_job
from reprise_agent.gpu.base import GpuSignal, SignalKind
from reprise_agent.progress.messages import SdkMessage
from reprise_agent.ranks import LostRank, RankProcess
from reprise_agent.stacks import Capture
from reprise_common.events import (
    PARKED_WHY_MAX,
    CheckpointSaved,
    DependencyFailed,
    FileDigest,
    GpuLost,
    GpuXid,
    RankExited,
    RankParked,
    RankStacks,
)
from reprise_common.logging import get_logger

log = get_logger("reprise.agent")


def rank_exited(node_id: str, rank: RankProcess, *, scheduler_ended: bool) -> RankExited:
    """A supervised rank's exit, with its log tail."""
    return RankExited(
        source=node_id,
        node_id=node_id,
        job_id=rank.job_id,
        rank=rank.rank,
        exit_code=rank.exit_code,
        signal=rank.exit_signal,
        oom_killed=rank.oom_killed,
        log_tail=list(rank.tail),
        restart_epoch=rank.restart_epoch,
        scheduler_ended=scheduler_ended,
    )


def lost_rank_exited(node_id: str, lost: LostRank, *, tail_lines: int) -> RankExited:
    """A rank that died with the agent's previous process, reported as any rank killed."""
    return RankExited(
        source=node_id,
        node_id=node_id,
        job_id=lost.job_id,
        rank=lost.rank,
        signal="SIGKILL",
        log_tail=[*lost.tail(tail_lines - 1), "(lost with the agent's previous process)"],
        restart_epoch=lost.restart_epoch,
    )


def rank_parked(node_id: str, rank: RankProcess) -> RankParked:
    """A rank that parked for a restart in place, with what it caught."""
    return RankParked(
        source=node_id,
        node_id=node_id,
        job_id=rank.job_id,
        rank=rank.rank,
        restart_epoch=rank.restart_epoch,
        why=rank.parked_why[:PARKED_WHY_MAX],
    )


def checkpoint_saved(
    node_id: str, message: SdkMessage, *, restart_epoch: int, world_size: int | None
) -> CheckpointSaved:
    """A checkpoint the SDK says a rank saved; invalid digests are dropped (the registry hashes the files then)."""
    try:
        digests = [
            FileDigest(path=name, size_bytes=size, digest=digest, algorithm="sha256")
            for name, size, digest in message.sha256
        ]
    except ValidationError as exc:  # a bad digest from a script: report the files, let the registry hash them
        log.warning("ignoring invalid checkpoint digests", extra={"job_id": message.job_id, "error": str(exc)})
        digests = []
    return CheckpointSaved(
        source=node_id,
        node_id=node_id,
        job_id=message.job_id,
        rank=message.rank,
        step=message.step or 0,
        path=message.path,
        files=list(message.files),
        restart_epoch=restart_epoch,
        world_size=world_size,
        file_digests=digests,
    )


def gpu_event(node_id: str, signal: GpuSignal) -> GpuXid | GpuLost | None:
    """An XID or a lost GPU as its event; None for a signal that is neither."""
    if signal.kind is SignalKind.XID and signal.xid is not None:
        return GpuXid(source=node_id, node_id=node_id, gpu=signal.gpu, xid=signal.xid, message=signal.message)
    if signal.kind is SignalKind.LOST:
        return GpuLost(source=node_id, node_id=node_id, gpu=signal.gpu, reason=signal.message)
    return None


def dependency_failed(node_id: str, result: CheckResult) -> DependencyFailed:
    """A dependency check that failed (a job's rendezvous master names the job)."""
    return DependencyFailed(
        source=node_id,
        node_id=node_id,
        dependency=result.name,
        detail=result.detail,
        job_id=rendezvous_job(result.name),
    )


def rank_stacks(node_id: str, rank: RankProcess, *, incident_id: str, found: Capture) -> RankStacks:
    """A rank's captured stacks for an incident, or why there are none."""
    return RankStacks(
        source=node_id,
        node_id=node_id,
        job_id=rank.job_id,
        rank=rank.rank,
        restart_epoch=rank.restart_epoch,
        incident_id=incident_id,
        pid=found.pid,
        proc_state=found.proc_state,
        threads=found.threads,
        capture_ms=found.took_ms,
        error=found.error,
    )
