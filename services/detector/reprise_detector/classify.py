"""Classify stage: map a symptom to a category, severity and recommended action using rules kept as data.

rules.yaml holds a section (or several) per symptom kind; each kind (kinds/) says which sections it owns and how an
operator's file (REPRISE_RULES_PATH, every section optional) merges into the built-in ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from reprise_common.errors import ConfigError
from reprise_detector import kinds
from reprise_detector.kinds.base import BUILTIN_RULES, Classification, Derived, SymptomEvent, TemplateRule, replaced
from reprise_detector.kinds.rank_exited import KIND as RANK_EXITED
from reprise_detector.kinds.wire import Wire

__all__ = ["BUILTIN_RULES", "Classification", "RuleBook", "RulesFile", "TemplateRule", "load_rules"]

R = TypeVar("R")


class Header(BaseModel):
    """What rules.yaml holds beyond the kinds' sections."""

    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = 1


# The shape of rules.yaml and of an operator's rules file (every section optional in the latter): each kind's sections.
RulesFile = create_model("RulesFile", __base__=Header, **kinds.sections())  # type: ignore[call-overload]


@dataclass(frozen=True)
class RuleBook:
    """The merged rules, ready to classify symptoms: each kind's, by symptom type."""

    wire: Mapping[str, Any]  # each wire kind's merged rules (of the shape its kind merges them into)
    derived: Mapping[str, TemplateRule]  # each derived kind's rule

    def rules(self, kind: Wire[Any, R]) -> R:
        """A wire kind's merged rules."""
        return cast(R, self.wire[kind.type])

    def classify(self, event: SymptomEvent) -> Classification:
        """Classify one symptom event by its kind's rules (kinds/)."""
        if isinstance(event, Derived):
            return event.classify(self.derived[event.type])
        return kinds.wire()[event.type].classify(event, self.wire[event.type])

    def peer_failure(self, text: str) -> str | None:
        """The first line of an error text that names a failed peer (a `peer_failure` rank-exit rule's pattern)."""
        return self.rules(RANK_EXITED).peer_failure(text)


def load_rules(path: Path | None = None) -> RuleBook:
    """The built-in rules, extended and overridden by an operator's file when one is given."""
    builtin = _read(resources.files("reprise_detector").joinpath(BUILTIN_RULES).read_text(), BUILTIN_RULES)
    operator = _read(path.read_text(), str(path)) if path is not None else RulesFile()
    wire = {type_: kind.merge(builtin, operator) for type_, kind in kinds.wire().items()}
    derived = {type_: replaced(builtin, operator, kind.section) for type_, kind in kinds.kinds().items()}
    return RuleBook(wire=wire, derived=derived)


def _read(text: str, where: str) -> BaseModel:
    try:
        rules: BaseModel = RulesFile.model_validate(yaml.safe_load(text) or {})
    except yaml.YAMLError as exc:
        raise ConfigError(f"rules file {where} is not valid YAML: {exc}") from exc
    except ValidationError as exc:
        first = exc.errors()[0]
        at = ".".join(str(p) for p in first["loc"]) or "(root)"
        raise ConfigError(f"rules file {where}: {at}: {first['msg']}") from exc
    return rules
