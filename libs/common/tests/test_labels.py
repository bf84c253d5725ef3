"""Job labels: the Kubernetes key and value syntax, selectors, and label fields that old events do not have."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest

from reprise_common.events import (
    Category,
    Culprit,
    Event,
    IncidentChange,
    JobPlacement,
    RecommendedAction,
    RecoveryChange,
    Severity,
    parse_event,
)
from reprise_common.labels import check_key, check_selector, check_value, parse_selector

WHEN = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize(
    "key",
    [
        "team",
        "a",
        "A.b_c-9",
        "x" * 63,
        "example.com/team",
        "reprise.io/cost-center",
        "a-b.c/d",
        ("d" * 63 + ".") * 3 + "d/n",
    ],
)
def test_valid_keys(key: str) -> None:
    assert check_key(key) == key


@pytest.mark.parametrize(
    ("key", "problem"),
    [
        ("", "the name must be 1-63"),
        ("team x", "the name must be 1-63"),
        ("-team", "the name must be 1-63"),
        ("team.", "the name must be 1-63"),
        ("x" * 64, "the name must be 1-63"),
        ("é", "the name must be 1-63"),
        ("example.com/", "the name must be 1-63"),
        ("/team", "the prefix before '/' must be a DNS subdomain"),
        ("Example.com/team", "the prefix before '/' must be a DNS subdomain"),
        ("a_b.com/team", "the prefix before '/' must be a DNS subdomain"),
        ("a/b/c", "the prefix before '/' must be a DNS subdomain"),
        ("-a.com/team", "the prefix before '/' must be a DNS subdomain"),
        ("a" * 254 + "/team", "the prefix before '/' must be a DNS subdomain"),
    ],
)
def test_invalid_keys_say_what_is_wrong(key: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        check_key(key)


@pytest.mark.parametrize("value", ["", "ml", "v1.2_rc-3", "x" * 63, "A"])
def test_valid_values(value: str) -> None:
    assert check_value(value) == value


@pytest.mark.parametrize("value", ["x" * 64, "-ml", "ml_", "m l", "ml/x", "ml*"])
def test_invalid_values(value: str) -> None:
    with pytest.raises(ValueError, match="label value"):
        check_value(value)


@pytest.mark.parametrize(
    ("text", "parsed"),
    [("team=ml", ("team", "ml")), ("team=", ("team", "")), ("example.com/tier=gold", ("example.com/tier", "gold"))],
)
def test_selectors(text: str, parsed: tuple[str, str]) -> None:
    assert parse_selector(text) == parsed
    assert check_selector(text) == text


@pytest.mark.parametrize(
    ("text", "problem"), [("team", "expected key=value"), ("=ml", "label key"), ("a=b=c", "value")]
)
def test_bad_selectors(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_selector(text)


def _incident(**fields: Any) -> IncidentChange:
    return IncidentChange(
        source="detector",
        change="opened",
        incident_id="inc-1",
        job_id="job-1",
        category=Category.APPLICATION,
        severity=Severity.CRITICAL,
        root_cause="rank 0 exited 1",
        culprit=Culprit(rank=0),
        recommended_action=RecommendedAction.RESTART_JOB,
        first_symptom_at=WHEN,
        **fields,
    )


def _placement(**fields: Any) -> JobPlacement:
    return JobPlacement(source="orchestrator", job_id="job-1", restart_epoch=0, world_size=0, **fields)


def _recovery(**fields: Any) -> RecoveryChange:
    return RecoveryChange(
        source="orchestrator", change="started", recovery_id="rec-1", job_id="job-1", step="locked", fence=1, **fields
    )


@pytest.mark.parametrize("build", [_incident, _placement, _recovery])
def test_events_carry_labels_and_old_events_parse_without_them(build: Callable[..., Event]) -> None:
    labelled = build(labels={"team": "ml", "example.com/tier": "gold"})
    assert parse_event(labelled.to_bytes()).model_dump()["labels"] == {"team": "ml", "example.com/tier": "gold"}
    old = labelled.model_dump(mode="json")
    del old["labels"]  # as a writer from before labels sent it
    parsed = parse_event(json.dumps(old).encode())
    assert type(parsed) is type(labelled) and parsed.model_dump()["labels"] == {}
