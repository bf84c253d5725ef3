"""dependency.failed: something a node or a job depends on failed (storage, a registry, a job's rendezvous master).
Sent by the agent (DependencyFailed); classified by two sections of rules.yaml: `dependency_failed` for the node's own
dependencies (it counts for every job placed on the node) and `rendezvous_unreachable` for a job's (its rendezvous
master: it counts for that job alone, as evidence); an operator's rule replaces the built-in one of its section."""

from __future__ import annotations

from typing import NamedTuple

from pydantic import BaseModel

from reprise_common.events import DependencyFailed
from reprise_detector.kinds.base import Classification, Facts, Scope, TemplateRule, replaced
from reprise_detector.kinds.wire import Wire


class DependencyRules(NamedTuple):
    """The rule for a node's dependency and for a job's."""

    node: TemplateRule
    job: TemplateRule


class DependencyFailedKind(Wire[DependencyFailed, DependencyRules]):
    """A failed dependency, the node's or a job's."""

    event = DependencyFailed
    sections = {"dependency_failed": (TemplateRule | None, None), "rendezvous_unreachable": (TemplateRule | None, None)}

    def merge(self, builtin: BaseModel, operator: BaseModel) -> DependencyRules:
        """Each section: the operator's rule, else the built-in one."""
        return DependencyRules(
            node=replaced(builtin, operator, "dependency_failed"),
            job=replaced(builtin, operator, "rendezvous_unreachable"),
        )

    def classify(self, event: DependencyFailed, rules: DependencyRules) -> Classification:
        """A job's own (its rendezvous master), or the node's."""
        rule = rules.job if event.job_id is not None else rules.node
        return rule.apply(Facts.of(event))

    def scope(self, event: DependencyFailed) -> Scope:
        """The job it names, if any (none: every job placed on the node)."""
        return Scope(job_id=event.job_id)

    def detail(self, event: DependencyFailed) -> str:
        """The dependency and what failed."""
        return f"{event.dependency}: {event.detail}"


KIND = DependencyFailedKind()
