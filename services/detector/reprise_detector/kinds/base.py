"""What every symptom kind is made of: the classification a rule gives, the rules of rules.yaml (`Rule`,
`TemplateRule`, or a subclass with a kind's own thresholds), what a symptom names (`Scope`, `Blame`), the observation
the pipeline carries, and, for the kinds the detector derives itself, their model (`Derived`) and the `Producer`
interface a kind's producer answers to. The kinds agents and the compute backend send are `wire.Wire`.

Derived symptoms are not wire events: they never leave the detector except as incidents. Each has a deterministic id
built from what it observed, so a replica that re-derives the same finding (after a restart, or a second tick) records
it once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar, NamedTuple, Protocol

import msgspec
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, field_validator

from reprise_common.clock import Clock
from reprise_common.errors import ConfigError
from reprise_common.events import Category, RecommendedAction, Severity

BUILTIN_RULES = "rules.yaml"


@dataclass(frozen=True)
class Classification:
    """What a symptom means: where the fault lies, how bad it is, what to do, and whether it can be a root cause."""

    category: Category
    severity: Severity
    action: RecommendedAction
    root_cause_grade: bool
    reason: str
    evidence_only: bool = False  # never recorded as a symptom: it only feeds the detector's own evidence


class Rule(BaseModel):
    """A classification as rules.yaml writes it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    category: Category
    severity: Severity
    action: RecommendedAction
    root_cause: bool


class TemplateRule(Rule):
    """A rule whose reason is a template filled from the event's fields."""

    reason: str = Field(min_length=1)

    @field_validator("reason")
    @classmethod
    def _renders(cls, value: str) -> str:
        try:
            value.format_map(Facts())
        except (ValueError, IndexError) as exc:
            raise ValueError(f"reason template {value!r} is not valid: {exc}") from exc
        return value

    def apply(self, facts: Facts) -> Classification:
        """The classification this rule gives, its reason filled in from facts."""
        return Classification(self.category, self.severity, self.action, self.root_cause, self.reason.format_map(facts))


def section_of(rules: BaseModel, section: str) -> Any:
    """A section of a rules file, as the kind that owns it shaped it."""
    return getattr(rules, section)


def replaced(builtin: BaseModel, operator: BaseModel, section: str) -> TemplateRule:
    """A section an operator's file replaces whole: the operator's rule, else the built-in one (which every such
    section has)."""
    rule = section_of(operator, section) or section_of(builtin, section)
    if not isinstance(rule, TemplateRule):
        raise ConfigError(f"built-in {BUILTIN_RULES} lacks the section {section}")
    return rule


class Facts(dict[str, Any]):
    """Template values; a field a template names but the event lacks renders as '?' instead of failing."""

    event: BaseModel | None = None

    @classmethod
    def of(cls, event: BaseModel, **extra: Any) -> Facts:
        """The event's fields (read when a template names them: dumping them all costs more) and extra values."""
        facts = cls(extra)
        facts.event = event
        return facts

    def __missing__(self, key: str) -> Any:
        if self.event is not None and key in type(self.event).model_fields:
            return getattr(self.event, key)
        return "?"


class Scope(NamedTuple):
    """What a symptom names within its node: a job and its rank (it then counts for that job alone), or a GPU (it then
    counts for every job placed on the node, the rank on that GPU blamed)."""

    job_id: str | None = None
    rank: int | None = None
    gpu: int | None = None


class Blame(NamedTuple):
    """What a rank's symptom adds to its culprit: how it exited, the launch it belongs to, a numeric fault's step."""

    exit_code: int | None = None
    restart_epoch: int | None = None
    fault_step: int | None = None


NO_BLAME = Blame()


class Derived(BaseModel):
    """A symptom the detector derives itself, and its kind: the rules.yaml section that classifies it (`section`, of
    the shape `rule`), how a rule applies to it (`facts`), what it names (`scope`, `blame`: the correlate stage's), how
    it reads on a symptom (`detail`), and what produces it (`producer`: None when a stage of the watch does)."""

    model_config = ConfigDict(frozen=True)

    section: ClassVar[str]
    rule: ClassVar[type[TemplateRule]] = TemplateRule

    event_id: str = Field(min_length=1, max_length=128)
    time: AwareDatetime
    node_id: str
    type: str

    def facts(self) -> dict[str, Any]:
        """Template values beyond the symptom's fields (numbers rounded for reading)."""
        return {}

    def classify(self, rule: TemplateRule) -> Classification:
        """The classification its section's rule gives."""
        return rule.apply(Facts.of(self, **self.facts()))

    def detail(self) -> str:
        """What was seen, in a line, for the symptom's record."""
        return self.type

    def scope(self) -> Scope:
        """The job, rank or GPU it names (none: it counts for every job placed on its node)."""
        return Scope()

    def blame(self) -> Blame:
        """What it adds to its culprit (the launch it belongs to, for a rank's symptom); nothing by default."""
        return NO_BLAME

    @classmethod
    def producer(cls, *, clock: Clock, rule: TemplateRule) -> Producer | None:
        """The producer the watch feeds for this kind; None when a stage of the watch produces it."""
        return None


class ReportView(Protocol):
    """What a producer reads of a node report (node_reports.WatchedReport): its GPUs and ranks still undecoded."""

    @property
    def time(self) -> datetime: ...

    @property
    def gpus(self) -> msgspec.Raw: ...

    @property
    def ranks(self) -> msgspec.Raw: ...


class SymptomEvent(Protocol):
    """What the pipeline reads of every symptom: a wire event of a kind in the registry, or a `Derived` one."""

    @property
    def event_id(self) -> str: ...

    @property
    def type(self) -> str: ...

    @property
    def time(self) -> datetime: ...


@dataclass(frozen=True)
class Observation:
    """One symptom as the detector sees it: who reported it (from the subject), what, and when."""

    event: SymptomEvent
    node_id: str
    kind: str
    time: datetime
    detail: str
    gpu: int | None = None
    job_id: str | None = None
    rank: int | None = None
    blame: Blame = NO_BLAME

    @property
    def event_id(self) -> str:
        """The id of the event this observation came from (the idempotency key)."""
        return self.event.event_id


class Producer(Protocol):
    """Turns what the detector hears into derived symptoms: fed the node reports a replica reads (when
    `reads_reports`; the node's identity from the subject), told of each symptom of an owned job the pipeline takes in,
    and ticked by the watch; `now` is the clock's monotonic time."""

    reads_reports: bool

    def on_report(self, node_id: str, report: ReportView, now: float) -> Sequence[Derived]:
        """The symptoms a node's report shows (most reports: none)."""
        ...

    def on_symptom(self, observation: Observation, classification: Classification) -> None:
        """Learn from a symptom of an owned job (a rank's exit, a peer's error)."""
        ...

    def tick(self, now: float) -> Sequence[Derived]:
        """The symptoms a silence or a deadline shows (checked every watch tick while the detector hears its nodes)."""
        ...


class Quiet:
    """A producer's hooks that do nothing: a producer overrides those it uses."""

    reads_reports = False

    def on_report(self, node_id: str, report: ReportView, now: float) -> Sequence[Derived]:
        """Nothing from reports."""
        return ()

    def on_symptom(self, observation: Observation, classification: Classification) -> None:
        """Nothing learnt from symptoms."""

    def tick(self, now: float) -> Sequence[Derived]:
        """Nothing on ticks."""
        return ()
