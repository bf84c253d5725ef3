"""gpu.xid: an XID error the driver reported for one GPU. Sent by the agent (GpuXid); classified by two sections of
rules.yaml: `xid`, the table of known codes (an operator's entry replaces the built-in entry for the same code, and
codes the built-in table lacks are added), and `unknown_xid`, the rule for a code in neither (an operator's replaces
the built-in one); it counts for every job placed on the node, the rank on that GPU blamed."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import BaseModel, Field

from reprise_common.events import GpuXid
from reprise_detector.kinds.base import Classification, Facts, Rule, Scope, TemplateRule, replaced, section_of
from reprise_detector.kinds.wire import Wire


class XidRule(Rule):
    """The meaning of one or more XID codes."""

    xids: list[int] = Field(min_length=1)
    meaning: str = Field(min_length=1)


@dataclass(frozen=True)
class XidRules:
    """The merged XID table, by code, and the rule for a code not in it."""

    xids: Mapping[int, XidRule]
    unknown: TemplateRule


class GpuXidKind(Wire[GpuXid, XidRules]):
    """An XID, worded by its code's meaning."""

    event = GpuXid
    sections = {"xid": (list[XidRule], Field(default_factory=list)), "unknown_xid": (TemplateRule | None, None)}

    def merge(self, builtin: BaseModel, operator: BaseModel) -> XidRules:
        """The built-in table with the operator's entries over it, code by code."""
        table: list[XidRule] = [*section_of(builtin, "xid"), *section_of(operator, "xid")]
        xids = {code: rule for rule in table for code in rule.xids}
        return XidRules(xids=xids, unknown=replaced(builtin, operator, "unknown_xid"))

    def classify(self, event: GpuXid, rules: XidRules) -> Classification:
        """Its code's row, else the unknown rule."""
        rule = rules.xids.get(event.xid)
        if rule is None:
            return rules.unknown.apply(Facts.of(event))
        reason = f"XID {event.xid} on GPU {event.gpu}: {rule.meaning}"
        return Classification(rule.category, rule.severity, rule.action, rule.root_cause, reason)

    def scope(self, event: GpuXid) -> Scope:
        """Its GPU: every job placed on the node, the rank on it blamed."""
        return Scope(gpu=event.gpu)

    def detail(self, event: GpuXid) -> str:
        """The driver's message, else the code."""
        return event.message or f"XID {event.xid}"


KIND = GpuXidKind()
