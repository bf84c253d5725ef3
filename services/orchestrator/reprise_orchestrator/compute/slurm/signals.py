"""Slurm's own failure signals: what changed between two reads of its nodes and jobs, as ComputeSignals.

A pure function of two reads, so the poller reports each transition once and the rules are table-tested without a
cluster. Each signal's event id is built from the transition itself (its kind, the node or job, the node's reason or
the job's restart count), so replicas that see the same transition publish it under one message id and the COMPUTE
stream keeps it once (within its duplicate window, 2 min).

Reprise's allocations are the Slurm jobs named `reprise-<job id>` (`allocation_name`): job signals carry the
platform's job id, and other users' jobs are not ours to report.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from reprise_common.events import ComputeSignal, ComputeSignalKind
from reprise_orchestrator.compute.backend import compute_signal
from reprise_orchestrator.compute.slurm.models import SlurmJob, SlurmJobState, SlurmNode

ALLOCATION_PREFIX = "reprise-"

# A node flag that appears is a signal: Slurm lost contact with the node's slurmd, or set the node down.
_NODE_FLAGS = (("NOT_RESPONDING", ComputeSignalKind.NODE_NOT_RESPONDING), ("DOWN", ComputeSignalKind.NODE_DOWN))
# A job that ends in one of these states is a signal (preemption and the time limit are not the hardware's fault).
_JOB_ENDS = {
    SlurmJobState.NODE_FAIL: ComputeSignalKind.NODE_FAIL,
    SlurmJobState.PREEMPTED: ComputeSignalKind.PREEMPTED,
    SlurmJobState.TIMEOUT: ComputeSignalKind.TIME_LIMIT,
}
ENDED = frozenset(
    {
        SlurmJobState.COMPLETED,
        SlurmJobState.CANCELLED,
        SlurmJobState.FAILED,
        SlurmJobState.TIMEOUT,
        SlurmJobState.NODE_FAIL,
        SlurmJobState.PREEMPTED,
        SlurmJobState.BOOT_FAIL,
        SlurmJobState.DEADLINE,
        SlurmJobState.OUT_OF_MEMORY,
    }
)


def allocation_name(job_id: str) -> str:
    """The Slurm job name of a platform job's allocation."""
    return f"{ALLOCATION_PREFIX}{job_id}"


def platform_job(job: SlurmJob) -> str | None:
    """The platform job whose allocation this Slurm job is, or None when it is not one of Reprise's."""
    if job.name.startswith(ALLOCATION_PREFIX) and len(job.name) > len(ALLOCATION_PREFIX):
        return job.name[len(ALLOCATION_PREFIX) :]
    return None


@dataclass(frozen=True)
class SlurmView:
    """One read of Slurm: every node by name, and Reprise's allocations by Slurm job id."""

    nodes: Mapping[str, SlurmNode] = field(default_factory=dict)
    jobs: Mapping[int, SlurmJob] = field(default_factory=dict)


def signals(before: SlurmView, after: SlurmView, *, backend: str) -> list[ComputeSignal]:
    """The failure signals of what changed from `before` to `after`: node flags that appeared, jobs that ended on a
    fault, and allocations Slurm requeued because one of their nodes failed."""
    return [*_node_signals(before, after, backend), *_job_signals(before, after, backend)]


def _node_signals(before: SlurmView, after: SlurmView, backend: str) -> Iterator[ComputeSignal]:
    for name, node in after.nodes.items():
        old = before.nodes.get(name)
        if old is None:  # a node we had not seen: no transition we saw
            continue
        for flag, kind in _NODE_FLAGS:
            if flag in node.state and flag not in old.state:
                detail = f"Slurm shows node {name} {'+'.join(sorted(node.state))}" + (
                    f": {node.reason}" if node.reason else ""
                )
                yield compute_signal(backend, kind, (name, node.reason), node_id=name, detail=detail)


def _job_signals(before: SlurmView, after: SlurmView, backend: str) -> Iterator[ComputeSignal]:
    for slurm_id, job in after.jobs.items():
        job_id = platform_job(job)
        if job_id is None:
            continue
        old = before.jobs.get(slurm_id)
        lost = [node for node in (old or job).nodes if node in after.nodes and after.nodes[node].down]
        kind = _JOB_ENDS.get(job.state)
        if kind is not None and (old is None or old.state is not job.state):
            failed = lost[0] if kind is ComputeSignalKind.NODE_FAIL and lost else None
            detail = f"Slurm job {slurm_id} ended {job.state.value}" + (f" ({job.reason})" if job.reason else "")
        elif old is not None and job.restart_count > old.restart_count and lost:
            # A job submitted with --requeue whose node fails is requeued at once: it never shows NODE_FAIL.
            kind, failed = ComputeSignalKind.NODE_FAIL, lost[0]
            detail = f"Slurm requeued job {slurm_id} after its node(s) {', '.join(lost)} failed"
        elif old is not None and job.restart_count > old.restart_count and job.excluded_nodes == old.excluded_nodes:
            # Requeued with no node down and no node newly left out (Reprise's own requeue leaves its bad nodes out):
            # preempted by a job of higher priority (PreemptMode=REQUEUE never shows PREEMPTED), or an operator's
            # `scontrol requeue`. Either way the scheduler took the nodes back and will run the job again.
            kind, failed = ComputeSignalKind.PREEMPTED, None
            detail = f"Slurm requeued job {slurm_id} (preempted, or by an operator): it runs again when allowed"
        else:
            continue
        key = (str(slurm_id), str(job.restart_count))
        yield compute_signal(backend, kind, key, node_id=failed, job_id=job_id, detail=detail)


def controller_unavailable(backend: str, job_id: str, *, since: str, detail: str) -> ComputeSignal:
    """The signal of a controller that stopped answering, for one of the jobs it runs (`since`: when it last answered,
    which keys the outage)."""
    text = f"the {backend} controller does not answer ({detail}): the job runs on, but nothing can be placed, drained"
    text += " or requeued until it does"
    return compute_signal(
        backend, ComputeSignalKind.CONTROLLER_UNAVAILABLE, (job_id, since), job_id=job_id, detail=text
    )
