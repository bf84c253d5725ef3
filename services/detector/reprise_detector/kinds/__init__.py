"""The registry of the symptom kinds the detector derives itself: one module per kind in this package, each naming its
model (a `base.Derived` subclass) as `KIND`; the model says how the kind is produced, classified (its rules.yaml
section), correlated and worded. A module added here is found by the registry: classify, observe, correlate and the
watch look kinds up here, never by type.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Mapping

from reprise_common.clock import Clock
from reprise_detector.kinds.base import Derived, Producer, TemplateRule


@functools.cache
def kinds() -> Mapping[str, type[Derived]]:
    """Every derived kind, by its symptom type ("node.lost")."""
    found: dict[str, type[Derived]] = {}
    for module in sorted(info.name for info in pkgutil.iter_modules(__path__)):
        kind: type[Derived] | None = getattr(importlib.import_module(f"{__name__}.{module}"), "KIND", None)
        if kind is not None:
            found[kind.model_fields["type"].default] = kind
    return found


def sections() -> Mapping[str, type[TemplateRule]]:
    """The rules.yaml section of every derived kind, and the shape of its rule."""
    return {kind.section: kind.rule for kind in kinds().values()}


def producers(*, clock: Clock, rules: Mapping[str, TemplateRule]) -> list[Producer]:
    """A producer for each kind that has its own (`rules`: each kind's rule, by symptom type)."""
    made = (kind.producer(clock=clock, rule=rules[type_]) for type_, kind in kinds().items())
    return [producer for producer in made if producer is not None]
