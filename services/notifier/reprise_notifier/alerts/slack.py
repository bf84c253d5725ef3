"""Slack messages in Block Kit: one alert, or several coalesced into one message, always within Slack's limits.

Limits (api.slack.com/reference/block-kit): 50 blocks per message, section text 3000 characters, section fields
10 of 2000 characters each, header text 150, block_id 255, button URL 3000, context 10 elements. User text is
escaped (&, <, >) before it is cut, and a cut never leaves half an escape. Each alert's section carries the
delivery id as its block_id, so a receiver (and the tests) can tell which alerts a message holds.
"""

from __future__ import annotations

import re
from typing import Any

from reprise_common.events import Culprit
from reprise_notifier.alerts.models import Alert, AlertKind, Item

MAX_BLOCKS = 50
MAX_SECTION_TEXT = 3000
MAX_FIELD_TEXT = 2000
MAX_FIELDS = 10
MAX_HEADER_TEXT = 150
MAX_BLOCK_ID = 255
MAX_BUTTON_URL = 3000
MAX_FALLBACK_TEXT = 3000  # Slack cuts `text` at 40,000 characters; a notification needs far less
MAX_DIGEST_ALERTS = 40  # header + context + one section per alert stays under MAX_BLOCKS
DIGEST_ROOT_CAUSE = 300  # per alert in a coalesced message, so 40 alerts stay a readable size
LABELS_TEXT = 500  # a job's labels in a message's context: brief, even with 64 long ones
ELLIPSIS = "…"
STACKS_LABEL = "Stacks of the hung ranks"  # the link to a hang's stacks on the dashboard
_PARTIAL_ENTITY = re.compile(r"&[a-z]{0,4}$")

TITLES: dict[AlertKind, str] = {
    AlertKind.OPENED: "Incident opened",
    AlertKind.UPDATED: "Incident updated",
    AlertKind.RESOLVED: "Incident resolved",
    AlertKind.RECOVERY_STARTED: "Recovery started",
    AlertKind.RECOVERY_STEP: "Recovery step",
    AlertKind.RECOVERED: "Recovered",
    AlertKind.FAILED: "Recovery failed",
}
_EMOJI: dict[AlertKind, str] = {
    AlertKind.UPDATED: ":arrows_counterclockwise:",
    AlertKind.RESOLVED: ":white_check_mark:",
    AlertKind.RECOVERY_STARTED: ":hammer_and_wrench:",
    AlertKind.RECOVERY_STEP: ":fast_forward:",
    AlertKind.RECOVERED: ":white_check_mark:",
    AlertKind.FAILED: ":x:",
}
_SEVERITY_EMOJI = {"critical": ":red_circle:", "warning": ":large_orange_circle:", "info": ":large_blue_circle:"}


def render(items: list[Item]) -> dict[str, Any]:
    """The Slack payload for the alerts of one send: a full message for one, a coalesced list for several."""
    if not items:
        raise ValueError("nothing to render")
    if len(items) > MAX_DIGEST_ALERTS:
        raise ValueError(f"at most {MAX_DIGEST_ALERTS} alerts fit one message, got {len(items)}")
    return single(*items[0]) if len(items) == 1 else digest(items)


def single(delivery_id: str, alert: Alert) -> dict[str, Any]:
    """One alert as a full message: header, root cause, facts, context and a dashboard button."""
    facts = [
        f"*Job*\n`{escape(alert.job_id)}`",
        f"*Category / severity*\n{_category(alert)}",
        f"*Culprit*\n{escape(culprit_text(alert.culprit))}",
        f"*Action*\n{escape(_action(alert))}",
    ]
    if alert.time_to_recover_s is not None:
        facts.append(f"*Time to recover*\n{duration_text(alert.time_to_recover_s)}")
    blocks: list[dict[str, Any]] = [
        _header(f"{emoji(alert)} {TITLES[alert.kind]}: {alert.job_id}"),
        _section(f"*Root cause:* {escape(alert.root_cause) or '_not known yet_'}", block_id=delivery_id),
        {"type": "section", "fields": [_mrkdwn(fact, MAX_FIELD_TEXT) for fact in facts[:MAX_FIELDS]]},
        {"type": "context", "elements": _context_elements(alert)},
    ]
    buttons = [
        {"type": "button", "text": _plain(label, 75), "url": url}
        for label, url in (("Open incident", alert.link), (STACKS_LABEL, alert.stacks_link))
        if url and len(url) <= MAX_BUTTON_URL
    ]
    if buttons:
        blocks.append({"type": "actions", "elements": buttons})
    return {"text": fallback_text([(delivery_id, alert)]), "blocks": blocks}


def digest(items: list[Item]) -> dict[str, Any]:
    """Several alerts as one message, oldest first: one section each."""
    blocks: list[dict[str, Any]] = [
        _header(f":bell: Reprise: {len(items)} alerts"),
        {
            "type": "context",
            "elements": [_mrkdwn("Several alerts at once, listed in one message (oldest first).", MAX_SECTION_TEXT)],
        },
    ]
    blocks += [_section(_digest_entry(alert), block_id=delivery_id) for delivery_id, alert in items]
    return {"text": fallback_text(items), "blocks": blocks}


def fallback_text(items: list[Item]) -> str:
    """The plain-text `text` Slack shows in notifications and where blocks cannot be shown."""
    if len(items) == 1:
        alert = items[0][1]
        line = f"{TITLES[alert.kind]}: job {alert.job_id}"
        if alert.root_cause:
            line += f" - {alert.root_cause}"
        return truncate(escape(line), MAX_FALLBACK_TEXT)
    names = "; ".join(f"{TITLES[alert.kind]} {alert.job_id}" for _id, alert in items)
    return truncate(escape(f"{len(items)} Reprise alerts: {names}"), MAX_FALLBACK_TEXT)


# --- pieces ----------------------------------------------------------------------------------------------------
def emoji(alert: Alert) -> str:
    """The alert's emoji: by severity for an opened incident, by kind otherwise."""
    if alert.kind is AlertKind.OPENED:
        return _SEVERITY_EMOJI.get(alert.severity.value if alert.severity else "", ":red_circle:")
    return _EMOJI[alert.kind]


def culprit_text(culprit: Culprit) -> str:
    """Node, GPU and rank, as far as known."""
    parts = []
    if culprit.node_id:
        parts.append(f"node {culprit.node_id}")
    if culprit.gpu is not None:
        parts.append(f"GPU {culprit.gpu}")
    if culprit.rank is not None:
        parts.append(f"rank {culprit.rank}")
    return " · ".join(parts) or "unknown"


def duration_text(seconds: float) -> str:
    """A short human duration: 42 s, 3 min 5 s, 2 h 10 min."""
    whole = round(seconds)
    if whole < 60:
        return f"{seconds:.0f} s" if seconds >= 1 else f"{seconds:.1f} s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


def escape(text: str) -> str:
    """Escape the three characters Slack's mrkdwn treats as control characters."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def truncate(text: str, limit: int) -> str:
    """Cut text to at most `limit` characters, ending with an ellipsis and never inside an escape."""
    if len(text) <= limit:
        return text
    cut = _PARTIAL_ENTITY.sub("", text[: limit - len(ELLIPSIS)])
    return cut + ELLIPSIS


def _category(alert: Alert) -> str:
    if alert.category is None:
        return "unknown"
    return f"{alert.category.value} / {alert.severity.value if alert.severity else 'unknown'}"


def _action(alert: Alert) -> str:
    if alert.action_taken:
        return alert.action_taken
    if alert.recommended_action is not None:
        return f"recommended: {alert.recommended_action.value}"
    return "none yet"


def labels_text(labels: dict[str, str]) -> str:
    """The job's labels in one line, sorted by key: `env=prod` `team=ml`."""
    return " ".join(f"`{escape(key)}={escape(value)}`" for key, value in sorted(labels.items()))


def _context_elements(alert: Alert) -> list[dict[str, Any]]:
    elements = [_mrkdwn(_context(alert), MAX_SECTION_TEXT)]
    if alert.labels:
        elements.append(_mrkdwn(f"labels {labels_text(alert.labels)}", LABELS_TEXT))
    return elements


def _context(alert: Alert) -> str:
    parts = [f"incident `{escape(alert.incident_id)}`" if alert.incident_id else "no incident"]
    if alert.recovery_id:
        parts.append(f"recovery `{escape(alert.recovery_id)}`")
    if alert.symptom_count is not None:
        parts.append(f"{alert.symptom_count} symptom{'s' if alert.symptom_count != 1 else ''}")
    parts.append(alert.occurred_at.strftime("%Y-%m-%d %H:%M:%S UTC"))
    return " · ".join(parts)


def _digest_entry(alert: Alert) -> str:
    lines = [f"{emoji(alert)} *{TITLES[alert.kind]}* · job `{escape(alert.job_id)}` · {_category(alert)}"]
    if alert.root_cause:
        lines.append(f"*Root cause:* {truncate(escape(alert.root_cause), DIGEST_ROOT_CAUSE)}")
    facts = [f"*Culprit:* {escape(culprit_text(alert.culprit))}", f"*Action:* {escape(_action(alert))}"]
    if alert.time_to_recover_s is not None:
        facts.append(f"*Time to recover:* {duration_text(alert.time_to_recover_s)}")
    if alert.link:
        facts.append(f"<{alert.link}|open incident>")
    if alert.stacks_link:
        facts.append(f"<{alert.stacks_link}|{STACKS_LABEL.lower()}>")
    lines.append(" · ".join(facts))
    if alert.labels:
        lines.append(truncate(f"*Labels:* {labels_text(alert.labels)}", LABELS_TEXT))
    return "\n".join(lines)


def _plain(text: str, limit: int) -> dict[str, Any]:
    return {"type": "plain_text", "text": truncate(text, limit), "emoji": True}


def _mrkdwn(text: str, limit: int) -> dict[str, Any]:
    return {"type": "mrkdwn", "text": truncate(text, limit)}


def _header(text: str) -> dict[str, Any]:
    return {"type": "header", "text": _plain(text, MAX_HEADER_TEXT)}


def _section(text: str, *, block_id: str) -> dict[str, Any]:
    return {"type": "section", "block_id": block_id[:MAX_BLOCK_ID], "text": _mrkdwn(text, MAX_SECTION_TEXT)}
