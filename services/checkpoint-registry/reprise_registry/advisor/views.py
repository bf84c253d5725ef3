"""GET /v1/jobs/{job_id}/advisor: the recommended checkpoint interval and the ETTR it buys."""

from __future__ import annotations

import itertools
import math
import statistics
from typing import Annotated, Literal

from fastapi import APIRouter, Query
from sqlmodel import Field, Session, SQLModel, col, select

from reprise_registry.advisor import formulas
from reprise_registry.checkpoints.models import Checkpoint, CheckpointState
from reprise_registry.checkpoints.views import unprocessable
from reprise_registry.deps import DepsDep, ReadSession

router = APIRouter(prefix="/v1", tags=["advisor"])
MEASURE_WINDOW = 20  # recent checkpoints used to measure save cost and interval
DEFAULT_SAVE_COST_S = 60.0  # until the job has committed a checkpoint and none is given
# Bounds on the inputs keep every interval and ETTR a finite number: unbounded, a save cost of 1e308 s or a failure
# rate of 1e-310 made √(2δM) infinite, which JSON can only show as null.
MAX_SECONDS = 30 * 86_400.0  # a save, an interval or a restart longer than 30 days is a typo
MIN_FAILURES_PER_NODE_DAY = 1e-6  # one failure per node every ~2,700 years
MAX_FAILURES_PER_NODE_DAY = 1_000.0  # a node failing every 86 s is no node
MAX_OBSERVED_HOURS = 1_000_000.0  # ~114 years


class Advice(SQLModel):
    """The advisor's answer; every input is shown with where it came from."""

    job_id: str
    node_count: int
    failures_per_node_day: float
    failure_rate_source: Literal["observed", "configured", "given"]
    job_mtbf_s: float
    save_cost_s: float
    save_cost_source: Literal["given", "measured", "default"]
    restart_overhead_s: float
    young_interval_s: float
    daly_interval_s: float
    recommended_interval_s: float = Field(description="Daly's interval")
    current_interval_s: float | None
    current_interval_source: Literal["given", "measured", "unknown"]
    ettr_at_current: float | None
    ettr_at_recommended: float


def measured(session: Session, job_id: str) -> tuple[float | None, float | None]:
    """Median save cost (begin → commit) and median interval between checkpoints of the job's recent checkpoints."""
    query = (
        select(Checkpoint.created_at, Checkpoint.committed_at)
        .where(Checkpoint.job_id == job_id, col(Checkpoint.committed_at).is_not(None))
        .where(col(Checkpoint.state) != CheckpointState.CORRUPT)
        .order_by(col(Checkpoint.step).desc())
        .limit(MEASURE_WINDOW)
    )
    rows = [(created, committed) for created, committed in session.execute(query).all() if committed is not None]
    costs = [(committed - created).total_seconds() for created, committed in rows]
    starts = sorted(created for created, _ in rows)
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(starts)]
    return (statistics.median(costs) if costs else None, statistics.median(gaps) if gaps else None)


@router.get("/jobs/{job_id}/advisor", response_model=Advice)
def advise(
    job_id: str,
    *,
    session: ReadSession,
    deps: DepsDep,
    node_count: Annotated[int, Query(ge=1, le=1_000_000)],
    save_cost_s: Annotated[float | None, Query(gt=0, le=MAX_SECONDS)] = None,
    current_interval_s: Annotated[float | None, Query(gt=0, le=MAX_SECONDS)] = None,
    failures_per_node_day: Annotated[
        float | None, Query(ge=MIN_FAILURES_PER_NODE_DAY, le=MAX_FAILURES_PER_NODE_DAY)
    ] = None,
    observed_failures: Annotated[int | None, Query(ge=0, le=1_000_000_000)] = None,
    observed_hours: Annotated[float | None, Query(gt=0, le=MAX_OBSERVED_HOURS)] = None,
    restart_overhead_s: Annotated[float | None, Query(ge=0, le=MAX_SECONDS)] = None,
) -> Advice:
    """Young/Daly interval from the job's failure rate and save cost, with expected ETTR now and at the advice."""
    measured_cost, measured_interval = measured(session, job_id)
    rate, rate_source = _failure_rate(deps, node_count, failures_per_node_day, observed_failures, observed_hours)
    cost = save_cost_s or measured_cost or DEFAULT_SAVE_COST_S
    cost_source: Literal["given", "measured", "default"] = (
        "given" if save_cost_s else "measured" if measured_cost else "default"
    )
    interval = current_interval_s or measured_interval
    interval_source: Literal["given", "measured", "unknown"] = (
        "given" if current_interval_s else "measured" if measured_interval else "unknown"
    )
    overhead = deps.settings.restart_overhead_s if restart_overhead_s is None else restart_overhead_s
    mtbf = formulas.job_mtbf_s(node_count=node_count, failures_per_node_day=rate)
    daly = formulas.daly_interval_s(save_cost_s=cost, mtbf_s=mtbf)

    def ettr(at: float) -> float:
        return formulas.expected_ettr(interval_s=at, save_cost_s=cost, mtbf_s=mtbf, restart_overhead_s=overhead)

    return Advice(
        job_id=job_id,
        node_count=node_count,
        failures_per_node_day=rate,
        failure_rate_source=rate_source,
        job_mtbf_s=mtbf,
        save_cost_s=cost,
        save_cost_source=cost_source,
        restart_overhead_s=overhead,
        young_interval_s=formulas.young_interval_s(save_cost_s=cost, mtbf_s=mtbf),
        daly_interval_s=daly,
        recommended_interval_s=daly,
        current_interval_s=interval,
        current_interval_source=interval_source,
        ettr_at_current=ettr(interval) if interval else None,
        ettr_at_recommended=ettr(daly),
    )


def _failure_rate(
    deps: DepsDep, node_count: int, given: float | None, failures: int | None, hours: float | None
) -> tuple[float, Literal["observed", "configured", "given"]]:
    """Per-node failures per day: given, else observed (failures over node-days, if any), else configured.

    An observed rate must lie within the bounds a given one has: a tiny `observed_hours` (1e-320 underflows the
    node-days to 0) or one too short for the failures counted is a 422 naming it, not a division by zero.
    """
    if given is not None:
        return given, "given"
    if failures and hours:
        node_days = node_count * hours / 24
        rate = failures / node_days if node_days > 0 else math.inf
        if not MIN_FAILURES_PER_NODE_DAY <= rate <= MAX_FAILURES_PER_NODE_DAY:
            raise unprocessable(
                ("query", "observed_hours"),
                f"{failures} failures over {hours:g} h on {node_count} nodes is {rate:g} failures per node-day, "
                f"outside [{MIN_FAILURES_PER_NODE_DAY:g}, {MAX_FAILURES_PER_NODE_DAY:g}]",
                hours,
            )
        return rate, "observed"
    return deps.settings.failures_per_node_day, "configured"
