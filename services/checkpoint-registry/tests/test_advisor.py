"""The checkpoint-interval advisor reproduces the reference values and is served by the API."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from reprise_registry.advisor import formulas

MINUTE = 60.0


@pytest.mark.parametrize(
    ("mtbf_min", "expected_min", "tolerance_min"),
    [(24 * 60, 117, 0.5), (6 * 60, 57, 0.5), (15, 9.1, 0.05)],
)
def test_daly_reproduces_the_reference_values(mtbf_min: float, expected_min: float, tolerance_min: float) -> None:
    interval = formulas.daly_interval_s(save_cost_s=5 * MINUTE, mtbf_s=mtbf_min * MINUTE)
    assert interval / MINUTE == pytest.approx(expected_min, abs=tolerance_min)


def test_young_and_daly_limits() -> None:
    assert formulas.young_interval_s(save_cost_s=300, mtbf_s=86400) == pytest.approx(7200)
    assert formulas.daly_interval_s(save_cost_s=1000, mtbf_s=400) == 400  # δ ≥ 2M: checkpoint once per MTBF


def test_ettr_is_best_near_the_daly_interval() -> None:
    mtbf = formulas.job_mtbf_s(node_count=512, failures_per_node_day=0.005)
    best = formulas.daly_interval_s(save_cost_s=60, mtbf_s=mtbf)

    def ettr(interval: float) -> float:
        return formulas.expected_ettr(interval_s=interval, save_cost_s=60, mtbf_s=mtbf, restart_overhead_s=300)

    assert ettr(best) > ettr(best / 4) and ettr(best) > ettr(best * 4)
    assert 0 < ettr(best) < 1


def test_advisor_api_reports_inputs_and_both_ettrs(sqlite_client: TestClient) -> None:
    params = {"node_count": 1, "save_cost_s": 300, "current_interval_s": 3600, "failures_per_node_day": 1.0}
    advice = sqlite_client.get("/v1/jobs/job-x/advisor", params=params).json()
    assert advice["job_mtbf_s"] == pytest.approx(86400)
    assert advice["recommended_interval_s"] / MINUTE == pytest.approx(117, abs=0.5)
    assert advice["ettr_at_recommended"] > advice["ettr_at_current"]
    assert advice["failure_rate_source"] == "given" and advice["current_interval_source"] == "given"
    observed = sqlite_client.get(
        "/v1/jobs/job-x/advisor", params={"node_count": 100, "observed_failures": 10, "observed_hours": 24}
    ).json()
    assert observed["failures_per_node_day"] == pytest.approx(0.1) and observed["failure_rate_source"] == "observed"
    assert observed["save_cost_source"] == "default" and observed["ettr_at_current"] is None


@pytest.mark.parametrize(
    ("field", "value"),
    [("save_cost_s", 1.49e308), ("failures_per_node_day", 1e-310), ("current_interval_s", "inf")],
)
def test_advisor_refuses_inputs_that_would_make_the_advice_infinite(
    sqlite_client: TestClient, field: str, value: float | str
) -> None:
    # Found by the OpenAPI fuzz: √(2δM) overflowed to infinity and the answer said `"young_interval_s": null`.
    answer = sqlite_client.get("/v1/jobs/job-x/advisor", params={"node_count": 512, field: value})
    assert answer.status_code == 422, answer.text
    assert [error["loc"] for error in answer.json()["detail"]] == [["query", field]]


@pytest.mark.parametrize(
    ("failures", "hours"),
    [(1, 1e-320), (1_000_000_000, 1e-300), (1_000_000_000, 0.001)],
)
def test_an_observed_rate_out_of_bounds_is_a_422_naming_the_hours(
    sqlite_client: TestClient, failures: int, hours: float
) -> None:
    # Found from outside: 1e-320 hours underflowed the node-days to 0, and the answer was a 500 (ZeroDivisionError).
    params = {"node_count": 4, "observed_failures": failures, "observed_hours": hours}
    answer = sqlite_client.get("/v1/jobs/job-x/advisor", params=params)
    assert answer.status_code == 422, answer.text
    assert [error["loc"] for error in answer.json()["detail"]] == [["query", "observed_hours"]]
