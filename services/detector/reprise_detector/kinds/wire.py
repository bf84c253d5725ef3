"""What every symptom kind that agents or the compute backend send is made of: `Wire`, the kind of one event model of
the shared library (the model stays there: it is the wire's contract, docs/events.md). A wire kind says which sections
of rules.yaml it owns and how an operator's file merges into them (`sections`, `merge`), how its merged rules classify
an event (`classify`), what an event names and how it reads (`scope`, `detail`, `blame`: observe and correlate), and
where its node comes from (`node_of`, `on_node_clock`).

`Template` is the common shape: one section holding one template rule, which an operator's rule replaces whole.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel

from reprise_common import subjects
from reprise_common.events import Event
from reprise_common.logging import get_logger
from reprise_detector.kinds.base import Blame, Classification, Facts, Scope, TemplateRule, replaced

log = get_logger("reprise.detector.observe")

E = TypeVar("E", bound=Event)  # the kind's event model
R = TypeVar("R")  # the kind's merged rules


class Wire(ABC, Generic[E, R]):
    """The kind of one wire event: `event` is its model; `sections` its rules.yaml sections, as field definitions of
    the rules file (name -> (annotation, default), as pydantic.create_model takes them: every one optional in an
    operator's file)."""

    event: type[E]
    sections: ClassVar[Mapping[str, tuple[Any, Any]]] = {}
    on_node_clock: ClassVar[bool] = True  # sent by an agent: its time is corrected by its node's clock offset

    @functools.cached_property
    def type(self) -> str:
        """Its symptom type ("gpu.xid"), the model's."""
        return str(self.event.model_fields["type"].default)

    @abstractmethod
    def merge(self, builtin: BaseModel, operator: BaseModel) -> R:
        """Its rules: the built-in file's sections, merged with an operator's (every section optional there)."""

    @abstractmethod
    def classify(self, event: E, rules: R) -> Classification:
        """The classification its merged rules give an event."""

    def scope(self, event: E) -> Scope:
        """The job, rank or GPU it names (none: it counts for every job placed on its node)."""
        return Scope()

    def detail(self, event: E) -> str:
        """What was seen, in a line, for the symptom's record."""
        return self.type

    def blame(self, event: E) -> Blame:
        """What it adds to its culprit (a rank's exit code, its launch, a numeric fault's step)."""
        return Blame()

    def node_of(self, event: E, subject: str) -> str:
        """The node it is about: the agent's, from the subject the server authorised (ValueError: not an agent's)."""
        node_id = subjects.node_from_agent_subject(subject)
        if getattr(event, "node_id", node_id) != node_id:
            log.warning("payload node_id differs from the subject; using the subject", extra={"subject": subject})
        return node_id


class Template(Wire[E, TemplateRule]):
    """A kind classified by one section holding one template rule (`section`), filled from the event's fields and
    `facts`; an operator's rule replaces the built-in one."""

    section: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "section" in cls.__dict__:
            cls.sections = {cls.section: (TemplateRule | None, None)}

    def merge(self, builtin: BaseModel, operator: BaseModel) -> TemplateRule:
        """The operator's rule, else the built-in one."""
        return replaced(builtin, operator, self.section)

    def classify(self, event: E, rules: TemplateRule) -> Classification:
        """The section's rule, its reason filled in."""
        return rules.apply(Facts.of(event, **self.facts(event)))

    def facts(self, event: E) -> dict[str, Any]:
        """Template values beyond the event's fields."""
        return {}
