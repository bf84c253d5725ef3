"""REST routes for jobs."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.exceptions import RequestValidationError
from pydantic import AfterValidator

from reprise_common.auth import REDACTED, may_see_secrets
from reprise_common.labels import check_selector, parse_selector
from reprise_orchestrator.compute.kubernetes.models import KubernetesSpec, NotAllowedError, confine
from reprise_orchestrator.deps import DepsDep, SessionDep
from reprise_orchestrator.jobs import checkpoints, flows, service
from reprise_orchestrator.jobs.models import Job, JobCreate, JobPublic, JobsPublic, JobState
from reprise_orchestrator.jobs.placement import ContainerRefusedError
from reprise_orchestrator.settings import OrchestratorSettings

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
LabelSelector = Annotated[str, AfterValidator(check_selector)]


def _public(job: Job, request: Request) -> JobPublic:
    """The job as this caller may see it: env values (often secrets) only with the operate scope."""
    public = JobPublic.model_validate(job, from_attributes=True)
    env = job.job_spec().env
    if env and not may_see_secrets(request):
        public.spec = {**public.spec, "env": dict.fromkeys(env, REDACTED)}
    return public


@router.post("", status_code=201, response_model=JobPublic)
async def submit_job(body: JobCreate, deps: DepsDep, request: Request) -> JobPublic:
    """Register a job, place its ranks and launch them; a `checkpoints` directory outside the checkpoint roots, a
    `kubernetes` namespace, node selector or service account the operator did not allow, or a `container` no usable
    node's agent runs (its image allow-list, its mount roots), is a 422 naming it, and nothing is stored."""
    if body.checkpoints is not None:
        try:
            checkpoints.confine(body.checkpoints, deps.settings.checkpoint_roots)
        except checkpoints.OutsideRootsError as exc:
            loc = ("body", "checkpoints", exc.field)
            error = {"type": "value_error", "loc": loc, "msg": str(exc), "input": body.checkpoints.directory}
            raise RequestValidationError([error]) from exc
    if body.kubernetes is not None:
        _allowed_on_kubernetes(body.kubernetes, deps.settings)
    try:
        job = await flows.submit(deps, body)
    except ContainerRefusedError as exc:
        refused: dict[str, object] = {"type": "value_error", "loc": ("body", *exc.field), "msg": str(exc)}
        raise RequestValidationError([refused]) from exc
    return _public(job, request)


def _allowed_on_kubernetes(spec: KubernetesSpec, settings: OrchestratorSettings) -> None:
    """A 422 naming the field where a job's `kubernetes` section asks for what the operator did not allow."""
    try:
        confine(
            spec,
            namespaces=settings.kubernetes_namespaces,
            node_selectors=settings.kubernetes_node_selectors,
            service_accounts=settings.kubernetes_service_accounts,
        )
    except NotAllowedError as exc:
        error = {"type": "value_error", "loc": ("body", "kubernetes", *exc.field), "msg": str(exc)}
        raise RequestValidationError([error]) from exc


@router.get("", response_model=JobsPublic)
def list_jobs(
    request: Request,
    session: SessionDep,
    state: JobState | None = None,
    label: Annotated[
        list[LabelSelector] | None, Query(description="key=value; repeated, a job must carry every label given")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> JobsPublic:
    """Jobs, newest first, optionally by state and by labels."""
    labels = [parse_selector(selector) for selector in label or []]
    data = [_public(job, request) for job in service.get_all(session, state=state, labels=labels, limit=limit)]
    return JobsPublic(data=data, count=len(data))


@router.get("/{job_id}", response_model=JobPublic)
def get_job(job_id: str, session: SessionDep, request: Request) -> JobPublic:
    """One job (env values redacted for a read-only key)."""
    return _public(service.get(session, job_id=job_id), request)
