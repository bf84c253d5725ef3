"""Correlate stage: which jobs a symptom affects, and whether it opens, joins or re-roots a job's incident."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from reprise_common.events import Category, Culprit
from reprise_detector.classify import Classification
from reprise_detector.incidents.models import Incident
from reprise_detector.observe import Observation
from reprise_detector.placements import PlacementMap

# How fundamental a cause is: a deeper cause arriving later becomes the incident's root cause (an application crash
# is often the visible effect of a GPU or dependency fault; the reverse is not true).
CAUSE_DEPTH: Mapping[str, int] = {
    Category.UNKNOWN: 0,
    Category.APPLICATION: 1,
    Category.DEPENDENCY: 2,
    Category.NODE: 3,
    Category.INTERCONNECT: 3,
    Category.GPU_HARDWARE: 3,
}


class Decision(StrEnum):
    """What a symptom does to one job's incidents."""

    OPEN = "open"  # root-cause-grade and no active incident in the window: open one
    ATTACH = "attach"  # joins the active incident as one more symptom
    UPGRADE = "upgrade"  # joins the active incident and becomes its root cause (a deeper cause)
    RECORD = "record"  # not root-cause-grade and nothing to join: kept on its own for later correlation


@dataclass(frozen=True)
class Target:
    """A job a symptom affects, and who the symptom points at within that job."""

    job_id: str
    culprit: Culprit


def targets(observation: Observation, placements: PlacementMap) -> list[Target]:
    """The affected jobs: the exiting rank's job, or every job placed on the node for GPU and node symptoms."""
    node_id = observation.node_id
    if observation.job_id is not None and observation.rank is not None:
        gpu = placements.gpu_of(job_id=observation.job_id, node_id=node_id, rank=observation.rank)
        return [Target(observation.job_id, Culprit(node_id=node_id, gpu=gpu, rank=observation.rank))]
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


def decide(classification: Classification, incident: Incident | None) -> Decision:
    """Open, attach, upgrade or just record, given the job's active incident in the window (if any)."""
    if incident is None:
        return Decision.OPEN if classification.root_cause_grade else Decision.RECORD
    deeper = CAUSE_DEPTH.get(classification.category, 0) > CAUSE_DEPTH.get(incident.category, 0)
    return Decision.UPGRADE if classification.root_cause_grade and deeper else Decision.ATTACH
