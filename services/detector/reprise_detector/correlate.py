"""Correlate stage: which jobs a symptom affects, and whether it opens, joins or re-roots a job's incident."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from reprise_common.events import CAUSE_DEPTH, Culprit, Severity
from reprise_detector.classify import Classification
from reprise_detector.incidents.models import Incident
from reprise_detector.kinds.base import Observation
from reprise_detector.placements import PlacementMap


class Decision(StrEnum):
    """What a symptom does to one job's incidents."""

    OPEN = "open"  # root-cause-grade and no active incident in the window: open one
    ATTACH = "attach"  # root-cause-grade, joins the active incident without leading it (same tier, later)
    UPGRADE = "upgrade"  # joins the active incident and becomes its root cause (deeper tier, or earlier in the tier)
    SUPPRESS = "suppress"  # a secondary symptom: joins the active incident as evidence only
    RECORD = "record"  # not root-cause-grade and nothing to join: kept on its own, adopted if an incident opens


@dataclass(frozen=True)
class Target:
    """A job a symptom affects, and who the symptom points at within that job."""

    job_id: str
    culprit: Culprit


class OutOfPlacement(StrEnum):
    """Why a symptom about a job does not count for it: only the nodes of the job's placement speak for the job."""

    JOB_NOT_PLACED = "job_not_placed"  # the job id has no active placement (never placed, or no longer running)
    RANK_NOT_ON_NODE = "rank_not_on_node"  # the placement puts that rank elsewhere (or the job has no such rank)
    JOB_NOT_ON_NODE = "job_not_on_node"  # a job's own dependency or a compute signal, about a node not in its placement


def out_of_placement(observation: Observation, placements: PlacementMap) -> OutOfPlacement | None:
    """Why a symptom naming a job comes from outside that job's placement; None when it may speak for the job (or
    names no job: node-wide symptoms hit the jobs placed on the node)."""
    job_id = observation.job_id
    if job_id is None:
        return None
    if not placements.is_placed(job_id):
        return OutOfPlacement.JOB_NOT_PLACED
    if observation.rank is not None:
        placed = placements.has_rank(job_id=job_id, node_id=observation.node_id, rank=observation.rank)
        return None if placed else OutOfPlacement.RANK_NOT_ON_NODE
    if not observation.node_id:
        return None  # about the whole job (the scheduler's word: preempted, at its time limit): no node to check
    return None if job_id in placements.jobs_on(observation.node_id) else OutOfPlacement.JOB_NOT_ON_NODE


def targets(observation: Observation, placements: PlacementMap) -> list[Target]:
    """The affected jobs: the job and rank a symptom names (its culprit as the kind blames it), the job a dependency or
    a compute signal names (the whole job when it names no node), or every job placed on the node for GPU, node and
    node-wide symptoms (its culprit the rank on the GPU it names)."""
    node_id = observation.node_id
    if observation.job_id is not None and observation.rank is not None:
        gpu = placements.gpu_of(job_id=observation.job_id, node_id=node_id, rank=observation.rank)
        blame = observation.blame
        culprit = Culprit(
            node_id=node_id,
            gpu=gpu,
            rank=observation.rank,
            exit_code=blame.exit_code,
            restart_epoch=blame.restart_epoch,
            fault_step=blame.fault_step,
        )
        return [Target(observation.job_id, culprit)]
    if observation.job_id is not None and not node_id:  # about the whole job, placed (out_of_placement)
        return [Target(observation.job_id, Culprit(node_id=None))]
    if observation.job_id is not None:  # a job's own dependency (its rendezvous master), or a signal naming both
        placed_here = observation.job_id in placements.jobs_on(node_id)
        return [Target(observation.job_id, Culprit(node_id=node_id))] if placed_here else []
    return [
        Target(
            job_id,
            Culprit(
                node_id=node_id,
                gpu=observation.gpu,
                rank=placements.rank_on_gpu(job_id=job_id, node_id=node_id, gpu=observation.gpu),
            ),
        )
        for job_id in placements.jobs_on(node_id)
    ]


def decide(classification: Classification, at: datetime, incident: Incident | None) -> Decision:
    """Open, attach, upgrade, suppress or just record, given the job's active incident in the window (if any)."""
    if not classification.root_cause_grade:
        return Decision.RECORD if incident is None else Decision.SUPPRESS
    if incident is None:
        return Decision.OPEN
    mine, theirs = CAUSE_DEPTH.get(classification.category, 0), CAUSE_DEPTH.get(incident.category, 0)
    earlier = mine == theirs and incident.root_cause_at is not None and at < incident.root_cause_at
    return Decision.UPGRADE if mine > theirs or earlier else Decision.ATTACH


def is_warning(classification: Classification) -> bool:
    """Warning causes (stragglers) keep incidents of their own apart from fatal ones; evidence joins fatal ones."""
    return classification.root_cause_grade and classification.severity is not Severity.CRITICAL
