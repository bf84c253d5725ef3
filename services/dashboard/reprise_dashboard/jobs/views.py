"""The overview (every job) and a job's page: ranks, checkpoints, recoveries with their timeline, drills, advice."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from reprise_common.errors import NotFoundError
from reprise_common.settings import IdStr
from reprise_dashboard.jobs.goodput import DEFINITION, Goodput, goodput, job_end
from reprise_dashboard.jobs.models import JobRecord, RecoveryRecord
from reprise_dashboard.jobs.timeline import Timeline, layout
from reprise_dashboard.render import page
from reprise_dashboard.runtime import Runtime, RuntimeDep
from reprise_dashboard.upstreams import Fetched, Service

router = APIRouter(tags=["pages"])
OVERVIEW_JOBS = 50  # the newest jobs; older ones are a job page away
# A failure rate observed over less than a node-day of history is noise: the registry's configured rate is used then.
OBSERVED_MIN_NODE_HOURS = 24.0


@dataclass(frozen=True)
class JobRow:
    """One job on the overview."""

    job: JobRecord
    goodput: Goodput | None
    goodput_error: str
    last_incident: dict[str, Any] | None


@dataclass(frozen=True)
class RecoveryView:
    """A recovery with its timeline and how long it took (so far)."""

    recovery: RecoveryRecord
    timeline: Timeline
    seconds: float


async def recoveries_of(runtime: Runtime, job_id: str) -> Fetched[list[RecoveryRecord]]:
    """A job's recoveries, newest first."""
    return (await runtime.upstreams.get(Service.ORCHESTRATOR, f"/v1/jobs/{job_id}/recoveries")).items(RecoveryRecord)


def recovery_view(recovery: RecoveryRecord, *, now: datetime) -> RecoveryView:
    """A recovery ready for the page: its timeline and its duration from the first symptom."""
    timeline = layout(recovery, now=now)
    return RecoveryView(recovery=recovery, timeline=timeline, seconds=timeline.span_s)


async def _job_row(runtime: Runtime, job: JobRecord, now: datetime) -> JobRow:
    recoveries, incidents = await asyncio.gather(
        recoveries_of(runtime, job.id),
        runtime.upstreams.get(Service.DETECTOR, "/v1/incidents", {"job_id": job.id, "limit": 1}),
    )
    last = incidents.data["data"][0] if incidents.ok and incidents.data and incidents.data.get("data") else None
    if not recoveries.ok or recoveries.data is None:
        return JobRow(job=job, goodput=None, goodput_error=recoveries.error, last_incident=last)
    return JobRow(job=job, goodput=goodput(job, recoveries.data, now=now), goodput_error="", last_incident=last)


@router.get("/", response_class=HTMLResponse, summary="Overview: jobs with state, restarts, goodput, last incident")
async def overview(request: Request, runtime: RuntimeDep) -> HTMLResponse:
    """Every recent job with its state, restarts, goodput so far and last incident; open incidents and nodes."""
    now = runtime.clock.now()
    jobs_answer, open_incidents = await asyncio.gather(
        runtime.upstreams.get(Service.ORCHESTRATOR, "/v1/jobs", {"limit": OVERVIEW_JOBS}),
        runtime.upstreams.get(Service.DETECTOR, "/v1/incidents", {"state": "open", "limit": 5}),
    )
    jobs = jobs_answer.items(JobRecord)
    rows = list(await asyncio.gather(*(_job_row(runtime, job, now) for job in jobs.data or [])))
    states: dict[str, int] = {}
    for row in rows:
        states[row.job.state] = states.get(row.job.state, 0) + 1
    context = {
        "section": "overview",
        "jobs": jobs,
        "rows": rows,
        "states": states,
        "open_incidents": open_incidents,
        "definition": DEFINITION,
    }
    return page(request, "overview.html", context)


@router.get("/jobs/{job_id}", response_class=HTMLResponse, summary="A job: ranks, checkpoints, recoveries, drills")
async def job_page(job_id: IdStr, request: Request, runtime: RuntimeDep) -> HTMLResponse:
    """A job's ranks on nodes, checkpoints, recovery history with its timeline, drills and the advisor's interval."""
    now = runtime.clock.now()
    up = runtime.upstreams
    job_answer, recoveries, drills, checkpoints, incidents = await asyncio.gather(
        up.get(Service.ORCHESTRATOR, f"/v1/jobs/{job_id}"),
        recoveries_of(runtime, job_id),
        up.get(Service.ORCHESTRATOR, f"/v1/jobs/{job_id}/drills"),
        up.get(Service.REGISTRY, f"/v1/jobs/{job_id}/checkpoints", {"limit": 20}),
        up.get(Service.DETECTOR, "/v1/incidents", {"job_id": job_id, "limit": 20}),
    )
    if job_answer.not_found:
        raise NotFoundError(f"the orchestrator knows no job {job_id}")
    job = job_answer.one(JobRecord)
    advice = await _advice(runtime, job.data, now) if job.data else job
    good = goodput(job.data, recoveries.data, now=now) if job.data and recoveries.data is not None else None
    views = [recovery_view(r, now=now) for r in recoveries.data or []]
    context = {
        "section": "jobs",
        "now": now,  # the same instant for the timeline and the steps table
        "job_id": job_id,
        "job": job,
        "goodput": good,
        "definition": DEFINITION,
        "recoveries": recoveries,
        "recovery_views": views,
        "drills": drills,
        "checkpoints": checkpoints,
        "incidents": incidents,
        "advice": advice,
    }
    return page(request, "job.html", context)


async def _advice(runtime: Runtime, job: JobRecord, now: datetime) -> Fetched[Any]:
    """The registry's checkpoint advice for the job's size, with its restarts as the observed failure history."""
    if not job.nodes:
        return Fetched(service=Service.REGISTRY, error="the job runs on no node now: no advice")
    hours = (job_end(job, now=now) - job.created_at).total_seconds() / 3600
    params: dict[str, Any] = {"node_count": len(job.nodes)}
    if job.restarts and hours * len(job.nodes) >= OBSERVED_MIN_NODE_HOURS:
        params |= {"observed_failures": job.restarts, "observed_hours": hours}
    return await runtime.upstreams.get(Service.REGISTRY, f"/v1/jobs/{job.id}/advisor", params)
