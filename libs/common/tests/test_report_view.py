"""The hot-path view of a node report reads what NodeReport reads: the same fields, defaults, limits and verdicts."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from pydantic import BaseModel, ValidationError

from reprise_common.errors import MalformedEventError
from reprise_common.events import ContainerSupport, GpuHealth, GpuStatus, NodeReport, RankStatus
from reprise_common.report_view import ContainersSeen, GpuSeen, RankSeen, ReportSeen, read_report

PAIRS: list[tuple[type[msgspec.Struct], type[BaseModel]]] = [
    (GpuSeen, GpuStatus),
    (RankSeen, RankStatus),
    (ReportSeen, NodeReport),
    (ContainersSeen, ContainerSupport),
]


@pytest.mark.parametrize(("view", "model"), PAIRS, ids=[view.__name__ for view, _ in PAIRS])
def test_every_field_the_view_reads_has_the_schemas_name_and_default(
    view: type[msgspec.Struct], model: type[BaseModel]
) -> None:
    for field in msgspec.structs.fields(view):
        assert field.name in model.model_fields, f"{model.__name__} has no {field.name}"
        schema_field = model.model_fields[field.name]
        if field.default is not msgspec.NODEFAULT:
            default = list(field.default) if isinstance(field.default, tuple) else field.default  # () reads as []
            assert default == schema_field.get_default(call_default_factory=True), field.name
        elif field.default_factory is msgspec.NODEFAULT:
            assert schema_field.is_required(), field.name
        else:
            assert schema_field.default_factory is not None, field.name


def test_a_rank_is_read_whole() -> None:
    # The progress book takes either; a field added to RankStatus must reach the hot path too.
    assert {f.name for f in msgspec.structs.fields(RankSeen)} == set(RankStatus.model_fields)


def _report(**changes: Any) -> dict[str, Any]:
    """A valid report as JSON values, with top-level keys replaced (None: removed)."""
    body: dict[str, Any] = {
        "type": "node.report",
        "event_id": "r-1",
        "time": "2026-11-30T07:00:00.250000+00:00",
        "source": "node-1",
        "node_id": "node-1",
        "interval_s": 1.0,
        "gpu_backend": "sim",
        "gpus": [{"index": 0, "health": "degraded", "last_xid": 48, "temperature_c": 71.5}, {"index": 1}],
        "ranks": [
            {"job_id": "job-a", "rank": 0, "step": 12, "phase": "training", "step_time_last_s": 0.8, "cpu_s": 3.5},
            {"job_id": "job-a", "rank": 1, "alive": False, "exit_code": -9, "proc_state": "", "unknown_field": 1},
        ],
    }
    for key, value in changes.items():
        if value is None:
            body.pop(key)
        else:
            body[key] = value
    return body


def _rank(**changes: Any) -> dict[str, Any]:
    return _report(ranks=[{"job_id": "job-a", "rank": 0} | changes])


REPORTS = {
    "valid": _report(),
    "no ranks or gpus": _report(ranks=None, gpus=None),
    "integral float step time": _rank(step_time_last_s=1),
    "naive time": _report(time="2026-11-30T07:00:00"),
    "time not a time": _report(time="yesterday"),
    "negative rank": _rank(rank=-1),
    "rank not a number": _rank(rank="zero"),
    "no job": _report(ranks=[{"rank": 0}]),
    "two-letter state": _rank(proc_state="RS"),
    "negative cpu": _rank(cpu_s=-0.5),
    "alive not a bool": _rank(alive="maybe"),
    "gpu health unknown to the schema": _report(gpus=[{"index": 0, "health": "on fire"}]),
    "negative gpu index": _report(gpus=[{"index": -1}]),
    "ranks not a list": _report(ranks={"0": {}}),
    "every gpu health": _report(gpus=[{"index": i, "health": h.value} for i, h in enumerate(GpuHealth)]),
    "containers": _report(containers={"mount_roots": ["/data", "/scratch"], "images": ["team/t:1"]}),
    "containers, any image": _report(containers={"mount_roots": ["/data"]}),
    "an empty mount root": _report(containers={"mount_roots": [""]}),
    "too many images": _report(containers={"images": [f"i{n}" for n in range(2000)]}),
}


def _schema_reads(data: bytes) -> dict[str, Any] | None:
    try:
        report = NodeReport.model_validate_json(data)
    except ValidationError:
        return None
    return report.model_dump(include={"time", "gpus", "ranks", "containers"}) | {
        "gpus": [g.model_dump(include={"index", "health", "last_xid"}) for g in report.gpus]
    }


def _view_reads(data: bytes) -> dict[str, Any] | None:
    try:
        report = read_report(data)
    except MalformedEventError:
        return None
    return {
        "time": report.time,
        "gpus": [msgspec.structs.asdict(g) for g in report.gpus],
        "ranks": [msgspec.structs.asdict(r) for r in report.ranks],
        "containers": None if report.containers is None else json.loads(msgspec.json.encode(report.containers)),
    }


@pytest.mark.parametrize("body", list(REPORTS.values()), ids=list(REPORTS))
def test_the_view_accepts_and_refuses_what_the_schema_does_and_reads_the_same_values(body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    assert _view_reads(data) == _schema_reads(data)


def test_a_refused_report_names_the_field() -> None:
    with pytest.raises(MalformedEventError, match=r"ranks\[0\]\.rank"):
        read_report(json.dumps(_rank(rank=-1)).encode())
    with pytest.raises(MalformedEventError, match="truncated"):
        read_report(b'{"ranks": [')
