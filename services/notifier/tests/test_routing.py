"""Routing rules as data: matching by job glob, team, label, severity, category and kind; secrets from env or files
only."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from reprise_common.errors import ConfigError
from reprise_common.events import Category, Severity
from reprise_notifier.alerts.models import Alert, AlertKind
from reprise_notifier.routing import DEFAULT_SLACK, DestinationKind, Routing, load_routing
from reprise_notifier.settings import NotifierSettings

SLACK_URL = "https://hooks.slack.example/services/T1/B1/secretsecret"
ENV = {
    "OPS_URL": SLACK_URL,
    "LLM_URL": "https://hooks.slack.example/services/T1/B2/llmsecret",
    "PAGER_URL": "https://pager.example/hook",
    "PAGER_SECRET": "a-signing-secret-of-some-length",
    "VISION_URL": "https://hooks.slack.example/services/T1/B3/visionsecret",
}
ROUTES = """
version: 1
destinations:
  ops: {kind: slack, url_env: OPS_URL}
  llm-team: {kind: slack, url_env: LLM_URL, min_interval_s: 2}
  pager: {kind: webhook, url_env: PAGER_URL, secret_env: PAGER_SECRET}
  vision: {kind: slack, url_env: VISION_URL}
teams:
  llm: ["llm-*", "pretrain-*"]
  vision: {labels: {team: vision}}
  research: {labels: {team: research}, jobs: "exp-*"}
routes:
  - name: llm-to-its-team
    match: {team: llm}
    to: llm-team
  - name: critical-hardware-pages
    match: {severity: critical, category: [gpu_hardware, interconnect], kind: [opened, failed]}
    to: [pager, ops]
  - name: all-updates-of-debug-jobs
    match: {job: "debug-*", kind: [opened, updated, recovery_step, recovered, failed]}
    to: ops
  - name: vision-to-its-team
    match: {team: vision}
    to: vision
  - name: research-to-ops
    match: {team: research}
    to: ops
  - name: gold-production-failures-page
    match: {labels: {env: prod, "example.com/tier": "gold*"}, kind: failed}
    to: pager
"""
PROD_GOLD = {"env": "prod", "example.com/tier": "gold-2"}

OPS = "destinations:\n  ops: {kind: slack, url_env: OPS_URL}\n"
WEAK_SECRET_ROUTES = "destinations:\n  ops: {kind: webhook, url_env: PAGER_URL, secret_env: WEAK}\n"


def _routing(tmp_path: Path, text: str = ROUTES, env: dict[str, str] | None = None, **settings: Any) -> Routing:
    routes = tmp_path / "routes.yaml"
    routes.write_text(text)
    return load_routing(NotifierSettings(notifier_routes_file=routes, **settings), ENV if env is None else env)


def _alert(job_id: str, kind: AlertKind = AlertKind.OPENED, **fields: Any) -> Alert:
    values: dict[str, Any] = {"category": Category.APPLICATION, "severity": Severity.CRITICAL, **fields}
    return Alert(event_id="e", kind=kind, job_id=job_id, occurred_at=datetime(2026, 1, 1, tzinfo=UTC), **values)


@pytest.mark.parametrize(
    ("alert", "destinations"),
    [
        (_alert("llm-7b"), ["llm-team"]),
        (_alert("pretrain-1", AlertKind.RECOVERED), ["llm-team"]),
        (_alert("llm-7b", AlertKind.UPDATED), []),  # quiet: no rule asks for updates of llm jobs
        (_alert("job-1", category=Category.GPU_HARDWARE), ["pager", "ops"]),
        (_alert("llm-7b", category=Category.GPU_HARDWARE), ["llm-team", "pager", "ops"]),
        (_alert("job-1", AlertKind.RECOVERED, category=Category.GPU_HARDWARE), []),  # the pager wants no recoveries
        (_alert("job-1", category=Category.GPU_HARDWARE, severity=Severity.WARNING), []),
        (_alert("job-1", category=None, severity=None), []),  # unknown severity matches no severity filter
        (_alert("debug-3", AlertKind.RECOVERY_STEP), ["ops"]),
        (_alert("xdebug-3", AlertKind.RECOVERY_STEP), []),  # a glob, not a substring
        # by label: a team's selector, and a rule's own labels
        (_alert("vit-1", labels={"team": "vision"}), ["vision"]),
        (_alert("vit-1", labels={"team": "visionary"}), []),  # the whole value must match the glob
        (_alert("vit-1", labels={"team": "Vision"}), []),  # case-sensitive
        (_alert("vit-1", labels={"owner": "vision"}), []),  # the key must be the selector's
        (_alert("vit-1"), []),  # no labels (an event from before labels): no label selector matches
        (_alert("exp-1"), ["ops"]),  # a team of both: its job globs ...
        (_alert("job-9", labels={"team": "research"}), ["ops"]),  # ... or its labels
        (_alert("job-1", AlertKind.FAILED, labels=PROD_GOLD), ["pager"]),
        (_alert("job-1", AlertKind.OPENED, labels=PROD_GOLD), []),  # the rule wants failures only
        (_alert("job-1", AlertKind.FAILED, labels={**PROD_GOLD, "example.com/tier": "silver"}), []),  # glob value
        (_alert("job-1", AlertKind.FAILED, labels={"env": "prod"}), []),  # a missing key does not match
        (_alert("job-1", AlertKind.FAILED, labels={**PROD_GOLD, "team": "x"}), ["pager"]),  # more labels are fine
        (_alert("llm-7b", AlertKind.FAILED, labels={**PROD_GOLD, "team": "vision"}), ["llm-team", "vision", "pager"]),
    ],
)
def test_rules_match_table(tmp_path: Path, alert: Alert, destinations: list[str]) -> None:
    routing = _routing(tmp_path)
    assert [d.name for d in routing.destinations_for(alert)] == destinations


def test_destinations_read_their_secrets_and_keep_them_hidden(tmp_path: Path) -> None:
    routing = _routing(tmp_path, slack_min_interval_s=1.5)
    ops, team, pager = (routing.destinations[name] for name in ("ops", "llm-team", "pager"))
    assert (ops.kind, ops.min_interval_s, team.min_interval_s) == (DestinationKind.SLACK, 1.5, 2.0)
    assert pager.kind is DestinationKind.WEBHOOK and pager.secret is not None
    assert pager.secret.get_secret_value() == ENV["PAGER_SECRET"] and ops.url.get_secret_value() == SLACK_URL
    shown = repr(routing)
    assert all(value not in shown for value in ENV.values())


def test_the_default_route_takes_what_no_rule_matched(tmp_path: Path) -> None:
    routing = _routing(tmp_path, notifier_slack_url=SecretStr(SLACK_URL))
    assert [d.name for d in routing.destinations_for(_alert("job-1"))] == [DEFAULT_SLACK]
    assert [d.name for d in routing.destinations_for(_alert("llm-7b"))] == ["llm-team"]
    assert routing.destinations_for(_alert("job-1", AlertKind.UPDATED)) == []  # the default sends loud kinds only
    chatty = load_routing(NotifierSettings(notifier_slack_url=SecretStr(SLACK_URL), notifier_default_kinds=["updated"]))
    assert [d.name for d in chatty.destinations_for(_alert("job-1", AlertKind.UPDATED))] == [DEFAULT_SLACK]


def test_a_url_file_is_read(tmp_path: Path) -> None:
    url_file = tmp_path / "ops-url"
    url_file.write_text(SLACK_URL + "\n")
    routing = _routing(tmp_path, f"destinations:\n  ops: {{kind: slack, url_file: {url_file}}}\n", env={})
    assert routing.destinations["ops"].url.get_secret_value() == SLACK_URL


@pytest.mark.parametrize(
    ("text", "env", "message"),
    [
        ("destinations:\n  ops: {kind: slack, url: " + SLACK_URL + "}\n", ENV, "inline url"),
        ("destinations:\n  ops: {kind: slack, url_env: NOPE}\n", ENV, "NOPE .URL. is not set"),
        ("destinations:\n  ops: {kind: slack, url_file: /nonexistent/x}\n", ENV, "cannot read URL file"),
        ("destinations:\n  ops: {kind: webhook, url_env: PAGER_URL}\n", ENV, "needs exactly one of secret_env"),
        (WEAK_SECRET_ROUTES, {**ENV, "WEAK": "changeme"}, "real secret"),
        ("destinations:\n  ops: {kind: slack, url_env: BAD}\n", {"BAD": "ftp://x/" + "s" * 9}, "must start with https"),
        ("destinations:\n  ops: {kind: email, url_env: OPS_URL}\n", ENV, "destinations.ops.kind"),
        ("routes:\n  - {name: r, to: [ghost]}\n", ENV, "unknown destinations \\['ghost'\\]"),
        (OPS + "routes:\n  - {name: r, to: ops, match: {team: x}}\n", ENV, "team 'x'"),
        (OPS + "routes:\n  - {name: r, to: ops, match: {labels: a}}\n", ENV, "routes.0.match.labels: Input should be"),
        (OPS + "routes:\n  - {name: r, to: ops, match: {labels: {team x: ml}}}\n", ENV, "label key 'team x'"),
        (OPS + "routes:\n  - {name: r, to: ops, match: {labels: {Ex.com/t: ml}}}\n", ENV, "prefix before '/'"),
        (OPS + "routes:\n  - {name: r, to: ops, match: {labels: {gpus: 8}}}\n", ENV, "match.labels.gpus: Input should"),
        (OPS + "routes:\n  - {name: r, to: ops, match: {label: {team: ml}}}\n", ENV, "match.label: Extra inputs"),
        (OPS + "teams: {t: {}}\n", ENV, "teams.t: Value error, a team needs labels"),
        (OPS + "teams: {t: {labels: {team: ml}, owner: x}}\n", ENV, "teams.t.owner: Extra inputs"),
        (OPS + "teams: {t: {labels: {team x: ml}}}\n", ENV, "teams.t.labels.team x.\\[key\\]: Value error"),
        ("destinations:\n  default-slack: {kind: slack, url_env: OPS_URL}\n", ENV, "reserved"),
        ("routes: [", ENV, "not valid YAML"),
    ],
)
def test_bad_routes_are_refused_without_repeating_a_secret(
    tmp_path: Path, text: str, env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as refused:
        _routing(tmp_path, text, env=env)
    for secret in (SLACK_URL, "secretsecret", "changeme", ENV["PAGER_SECRET"]):
        assert secret not in str(refused.value)
