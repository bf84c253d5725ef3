"""Block Kit messages stay within Slack's limits whatever the incident says, and read well when it is ordinary."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest

from reprise_cli.slack_receiver import check_slack_payload
from reprise_common.events import Category, Culprit, RecommendedAction, Severity
from reprise_notifier.alerts import flows, slack, webhook
from reprise_notifier.alerts.models import Alert, AlertKind, IncidentRecord

WHEN = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def _alert(kind: AlertKind = AlertKind.OPENED, **fields: Any) -> Alert:
    base: dict[str, Any] = {
        "event_id": "e1",
        "kind": kind,
        "job_id": "llm-7b",
        "occurred_at": WHEN,
        "incident_id": "inc-1",
        "category": Category.GPU_HARDWARE,
        "severity": Severity.CRITICAL,
        "root_cause": "XID 79: GPU fell off the bus",
        "culprit": Culprit(node_id="node-2", gpu=1, rank=3),
        "recommended_action": RecommendedAction.RESTART_EXCLUDE_NODE,
        "link": "https://reprise.example/incidents/inc-1",
    }
    return Alert(**{**base, **fields})


def _texts(payload: dict[str, Any]) -> list[tuple[str, str]]:
    """(block type, text) for every text in the message, fields included."""
    found = []
    for block in payload["blocks"]:
        if "text" in block:
            found.append((block["type"], block["text"]["text"]))
        found += [(block["type"], f["text"]) for f in block.get("fields", [])]
        found += [(block["type"], e["text"]) for e in block.get("elements", []) if isinstance(e.get("text"), str)]
    return found


def _assert_within_limits(payload: dict[str, Any]) -> None:
    assert len(payload["blocks"]) <= slack.MAX_BLOCKS
    assert 0 < len(payload["text"]) <= slack.MAX_FALLBACK_TEXT
    for kind, text in _texts(payload):
        limit = {"header": slack.MAX_HEADER_TEXT}.get(kind, slack.MAX_SECTION_TEXT)
        assert len(text) <= limit, (kind, len(text))
    for block in payload["blocks"]:
        assert len(block.get("fields", [])) <= slack.MAX_FIELDS
        assert all(len(f["text"]) <= slack.MAX_FIELD_TEXT for f in block.get("fields", []))
    assert check_slack_payload(json.dumps(payload)) is None  # the receiver answers as Slack would: ok


def test_a_huge_incident_is_cut_to_slacks_limits() -> None:
    huge = _alert(
        job_id="j" * 64,
        root_cause="<rank 3> NCCL & gloo said: " + "x" * 20_000 + " & more <tail>",
        culprit=Culprit(node_id="n" * 64, gpu=7, rank=4095),
        action_taken="a" * 5000,
        link="https://reprise.example/incidents/" + "i" * 4000,  # too long for a button: left out
    )
    payload = slack.render([("d" * 300, huge)])
    _assert_within_limits(payload)
    root = payload["blocks"][1]["text"]["text"]
    assert root.startswith("*Root cause:* &lt;rank 3&gt; NCCL &amp; gloo said:")  # escaped, then cut
    assert root.endswith(slack.ELLIPSIS) and len(root) == slack.MAX_SECTION_TEXT
    assert all(b["type"] != "actions" for b in payload["blocks"])
    assert len(payload["blocks"][1]["block_id"]) == slack.MAX_BLOCK_ID


def test_forty_huge_alerts_fit_one_message_and_more_are_refused() -> None:
    items = [(f"delivery-{i}", _alert(job_id=f"job-{i}", root_cause="&<>" * 5000)) for i in range(40)]
    payload = slack.render(items)
    _assert_within_limits(payload)
    assert [b.get("block_id") for b in payload["blocks"][2:]] == [f"delivery-{i}" for i in range(40)]
    assert payload["text"].startswith("40 Reprise alerts: Incident opened job-0; ")
    with pytest.raises(ValueError, match="at most 40"):
        slack.render([*items, ("one-more", _alert())])


@pytest.mark.parametrize("cut", range(1, 12))
def test_a_cut_never_leaves_half_an_escape(cut: int) -> None:
    text = slack.truncate(slack.escape("a" * 10 + "&<>" * 10), 10 + cut)
    assert len(text) <= 10 + cut
    body = text.removesuffix(slack.ELLIPSIS)
    assert body.count("&") == body.count(";"), text


@pytest.mark.parametrize(
    ("kind", "fields", "header", "action"),
    [
        (AlertKind.OPENED, {}, ":red_circle: Incident opened: llm-7b", "recommended: restart_exclude_node"),
        (AlertKind.OPENED, {"severity": Severity.WARNING}, ":large_orange_circle: Incident opened: llm-7b", None),
        (
            AlertKind.RECOVERED,
            {"action_taken": "recovery rec-1 (fence 2): training relaunched", "time_to_recover_s": 185},
            ":white_check_mark: Recovered: llm-7b",
            "recovery rec-1 (fence 2): training relaunched",
        ),
        (AlertKind.FAILED, {"action_taken": "recovery rec-1 failed at launching"}, ":x: Recovery failed: llm-7b", None),
        (AlertKind.RECOVERED, {"root_cause": "", "category": None, "severity": None}, None, None),
    ],
)
def test_a_single_alert_reads_well(
    kind: AlertKind, fields: dict[str, Any], header: str | None, action: str | None
) -> None:
    payload = slack.render([("d1", _alert(kind, **fields))])
    _assert_within_limits(payload)
    texts = dict(_texts(payload)[:2])
    if header is not None:
        assert texts["header"] == header
    facts = [f["text"] for f in payload["blocks"][2]["fields"]]
    assert "*Culprit*\nnode node-2 · GPU 1 · rank 3" in facts
    if action is not None:
        assert f"*Action*\n{action}" in facts
    if "time_to_recover_s" in fields:
        assert "*Time to recover*\n3 min 5 s" in facts
    if not fields.get("root_cause", "x"):
        assert texts["section"] == "*Root cause:* _not known yet_"
        assert "*Category / severity*\nunknown" in facts


@pytest.mark.parametrize(
    ("seconds", "text"), [(0.4, "0.4 s"), (42, "42 s"), (59.6, "1 min 0 s"), (185, "3 min 5 s"), (7800, "2 h 10 min")]
)
def test_durations(seconds: float, text: str) -> None:
    assert slack.duration_text(seconds) == text


def test_labels_show_briefly_in_the_context_sorted_escaped_and_cut() -> None:
    plain = slack.render([("d1", _alert())])
    [context] = [b for b in plain["blocks"] if b["type"] == "context"]
    assert len(context["elements"]) == 1  # no labels, no labels line

    labelled = slack.render([("d1", _alert(labels={"team": "ml", "example.com/tier": "gold", "x": "<b>"}))])
    _assert_within_limits(labelled)
    [context] = [b for b in labelled["blocks"] if b["type"] == "context"]
    assert context["elements"][1]["text"] == "labels `example.com/tier=gold` `team=ml` `x=&lt;b&gt;`"

    many = {f"example.com/key-{i:02}": "v" * 63 for i in range(64)}
    payload = slack.render([("d1", _alert(labels=many))])
    _assert_within_limits(payload)
    [context] = [b for b in payload["blocks"] if b["type"] == "context"]
    shown = context["elements"][1]["text"]
    assert len(shown) == slack.LABELS_TEXT and shown.endswith(slack.ELLIPSIS)
    assert shown.startswith("labels `example.com/key-00=")


def test_each_alert_of_a_coalesced_message_shows_its_own_labels() -> None:
    items = [
        ("d1", _alert(labels={"team": "ml", "env": "prod"})),
        ("d2", _alert(job_id="other")),
        ("d3", _alert(labels={f"example.com/key-{i:02}": "v" * 63 for i in range(64)})),
    ]
    payload = slack.render(items)
    _assert_within_limits(payload)
    entries = {b["block_id"]: b["text"]["text"] for b in payload["blocks"] if b["type"] == "section"}
    assert entries["d1"].endswith("\n*Labels:* `env=prod` `team=ml`")
    assert "Labels" not in entries["d2"]  # no labels, no labels line
    last_line = entries["d3"].rsplit("\n", 1)[1]
    assert len(last_line) == slack.LABELS_TEXT and last_line.endswith(slack.ELLIPSIS)


@pytest.mark.parametrize(
    ("category", "dashboard_url", "stacks"),
    [
        (Category.HANG, "https://reprise.example", "https://reprise.example/incidents/inc-h1#stacks"),
        (Category.HANG, "", None),  # no dashboard: no links at all
        (Category.APPLICATION, "https://reprise.example", None),  # only a hang has stacks to show
    ],
)
def test_a_hang_links_to_the_stacks_of_its_hung_ranks(
    category: Category, dashboard_url: str, stacks: str | None, make_incident: Any, make_recovery: Any
) -> None:
    event = make_incident(incident_id="inc-h1", category=category, root_cause="rank 1 stopped making progress")
    opened = flows.from_incident(event, dashboard_url=dashboard_url)
    record = IncidentRecord(
        id=event.incident_id,
        job_id=event.job_id,
        state="open",
        category=category.value,  # type: ignore[arg-type]  # as SQL reads it back: a plain string
        severity=Severity.CRITICAL,
        root_cause=event.root_cause,
        recommended_action=RecommendedAction.RESTART_JOB,
        first_symptom_at=event.first_symptom_at,
        updated_at=event.time,
    )
    recovered = flows.from_recovery(make_recovery(event), record, dashboard_url=dashboard_url)

    for alert in (opened, recovered):
        payload = slack.render([("d1", alert)])
        _assert_within_limits(payload)
        buttons = [
            (e["text"]["text"], e["url"]) for b in payload["blocks"] if b["type"] == "actions" for e in b["elements"]
        ]
        links = [("Open incident", f"{dashboard_url}/incidents/inc-h1")] if dashboard_url else []
        if stacks:
            links.append(("Stacks of the hung ranks", stacks))
        assert buttons == links, alert.kind

    coalesced = slack.render([("d1", opened), ("d2", recovered)])
    _assert_within_limits(coalesced)
    entries = [b["text"]["text"] for b in coalesced["blocks"] if b["type"] == "section"]
    shown = [f"<{stacks}|stacks of the hung ranks>" in entry for entry in entries] if stacks else []
    assert all(shown) and all(("stacks of the hung ranks" in entry) is bool(stacks) for entry in entries), entries

    body = webhook.render([("d1", opened)], message_id="m1", sent_at=WHEN)
    assert body["alerts"][0]["stacks_link"] == (stacks or "")
