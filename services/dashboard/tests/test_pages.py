"""Pages when the services they read are down or hang: always an answer, naming what is missing, never a 500.

The services here are real absences: ports nobody listens on, and a socket that accepts but never answers.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import ValidationError

from reprise_dashboard.jobs.models import JobRecord
from reprise_dashboard.render import TEMPLATES, format_duration, hide_urls
from reprise_dashboard.settings import DashboardSettings
from reprise_dashboard.upstreams import Fetched, Service

PAGES_AND_SOURCES = {
    "/": ["Orchestrator", "Detector"],
    "/jobs/job-1": ["Orchestrator", "Detector", "Checkpoint registry"],
    "/incidents?state=open&category=gpu_hardware": ["Detector"],
    "/incidents/inc-1": ["Detector"],
    "/nodes": ["Orchestrator", "Detector"],
    "/alerts": ["Notifier"],
}


@pytest.mark.parametrize("path", list(PAGES_AND_SOURCES))
async def test_every_page_answers_and_names_the_services_that_are_down(
    path: str, in_process: Callable[..., Any], down_settings: Callable[..., DashboardSettings]
) -> None:
    client = await in_process(down_settings())
    response = await client.get(path)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/html")
    for name in PAGES_AND_SOURCES[path]:
        assert f"{name} unavailable" in response.text, (name, response.text)
    assert "is unreachable (ConnectError)" in response.text


async def test_a_service_that_hangs_is_named_with_the_timeout(
    in_process: Callable[..., Any], down_settings: Callable[..., DashboardSettings], silent_port: int
) -> None:
    client = await in_process(down_settings(detector_url=f"http://127.0.0.1:{silent_port}", http_timeout_s=0.3))
    response = await client.get("/incidents")
    assert response.status_code == 200
    assert "Detector unavailable" in response.text and "did not answer within 0.3 s" in response.text


async def test_every_asset_is_served_by_the_dashboard_itself(
    in_process: Callable[..., Any], down_settings: Callable[..., DashboardSettings]
) -> None:
    client = await in_process(down_settings())
    html = (await client.get("/")).text
    links = re.findall(r'(?:src|href)="([^"]*)"', html)
    assert links and all(link.startswith(("/", "#")) for link in links), links  # no CDN: works offline
    for asset, kind in (("/static/dashboard.css", "text/css"), ("/static/dashboard.js", "javascript")):
        response = await client.get(asset)
        assert response.status_code == 200 and kind in response.headers["content-type"], asset


async def test_readiness_needs_nats_liveness_does_not(
    in_process: Callable[..., Any], down_settings: Callable[..., DashboardSettings]
) -> None:
    client = await in_process(down_settings())
    assert (await client.get("/healthz")).status_code == 200
    ready = await client.get("/readyz")
    assert ready.status_code == 503
    assert ready.json()["checks"] == {"nats": "down", "live feed": "down"}


def test_alert_details_never_show_a_url() -> None:
    detail = "Slack said 404 no_service for https://hooks.slack.com/services/T0/B0/secret and http://10.0.0.1/x"
    shown = hide_urls(detail)
    assert "hooks.slack.com" not in shown and "secret" not in shown and "10.0.0.1" not in shown
    assert shown == "Slack said 404 no_service for [URL hidden] and [URL hidden]"


def test_an_answer_of_the_wrong_shape_is_an_error_not_a_crash() -> None:
    answer = Fetched(service=Service.ORCHESTRATOR, data={"data": [{"id": "job-1"}]})  # no name, state, times
    parsed = answer.items(JobRecord)
    assert not parsed.ok and parsed.data is None
    assert parsed.error == "the orchestrator answered in an unexpected shape"


def test_settings_refuse_a_url_without_scheme_and_trim_slashes() -> None:
    with pytest.raises(ValidationError):
        DashboardSettings(detector_url="127.0.0.1:8720")
    settings = DashboardSettings(orchestrator_url="http://o:8730/", read_api_key="")
    assert settings.orchestrator_url == "http://o:8730" and settings.read_api_key is None


@pytest.mark.parametrize(
    ("seconds", "shown"), [(None, "—"), (0.421, "0.42 s"), (12.34, "12.3 s"), (245, "4 m 05 s"), (7380, "2 h 03 m")]
)
def test_durations_for_people(seconds: float | None, shown: str) -> None:
    assert format_duration(seconds) == shown


def test_job_labels_show_sorted_and_escaped() -> None:
    job = JobRecord.model_validate(
        {"id": "job-1", "name": "a", "state": "running", "created_at": "2026-01-01T00:00:00Z",
         "updated_at": "2026-01-01T00:00:00Z", "labels": {"team": "ml", "example.com/tier": "<gold>"}}
    )  # fmt: skip
    html = str(TEMPLATES.env.get_template("_macros.html").module.labels(job.labels))  # type: ignore[attr-defined]
    chips = re.findall(r'<span class="badge job-label">([^<]*)</span>', html)
    assert chips == ["example.com/tier=&lt;gold&gt;", "team=ml"]
    older = JobRecord.model_validate({k: v for k, v in job.model_dump(mode="json").items() if k != "labels"})
    assert older.labels == {}  # an orchestrator from before labels
