"""The registry of symptom kinds: one module per kind in this package, each naming its kind as `KIND`.

A kind the detector derives itself is a model (a `base.Derived` subclass) that says how it is produced, classified
(its rules.yaml section), correlated and worded. A kind agents or the compute backend send is a `wire.Wire` instance
for its event model of the shared library, saying how it is observed, classified (its rules.yaml sections and how an
operator's file merges into them), correlated and worded. A module added here is found by the registry: classify,
observe, correlate and the watch look kinds up here, never by type.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Mapping
from typing import Any

from reprise_common.clock import Clock
from reprise_detector.kinds.base import Derived, Producer, TemplateRule
from reprise_detector.kinds.wire import Wire


@functools.cache
def _found() -> tuple[object, ...]:
    """The `KIND` of every module of this package that has one, in the modules' order."""
    modules = sorted(info.name for info in pkgutil.iter_modules(__path__))
    found = (getattr(importlib.import_module(f"{__name__}.{module}"), "KIND", None) for module in modules)
    return tuple(kind for kind in found if kind is not None)


@functools.cache
def kinds() -> Mapping[str, type[Derived]]:
    """Every derived kind, by its symptom type ("node.lost")."""
    derived = (k for k in _found() if isinstance(k, type) and issubclass(k, Derived))
    return {kind.model_fields["type"].default: kind for kind in derived}


@functools.cache
def wire() -> Mapping[str, Wire[Any, Any]]:
    """Every wire kind, by its symptom type ("gpu.xid")."""
    return {kind.type: kind for kind in _found() if isinstance(kind, Wire)}


@functools.cache
def _by_model() -> Mapping[type, Wire[Any, Any]]:
    return {kind.event: kind for kind in wire().values()}


def of(event: object) -> Wire[Any, Any] | None:
    """The wire kind of an event; None for an event that is no symptom (a report, a placement)."""
    return _by_model().get(type(event))


def sections() -> Mapping[str, tuple[Any, Any]]:
    """Every section of rules.yaml, as a field definition of the rules file (name -> (annotation, default)): each wire
    kind's, then each derived kind's (of its kind's rule shape)."""
    found: dict[str, tuple[Any, Any]] = {}
    owned = [kind.sections for kind in wire().values()]
    owned += [{kind.section: (kind.rule | None, None)} for kind in kinds().values()]
    for fields in owned:
        if clash := found.keys() & fields.keys():
            raise RuntimeError(f"rules.yaml sections claimed by two kinds: {sorted(clash)}")
        found.update(fields)
    return found


def producers(*, clock: Clock, rules: Mapping[str, TemplateRule]) -> list[Producer]:
    """A producer for each kind that has its own (`rules`: each kind's rule, by symptom type)."""
    made = (kind.producer(clock=clock, rule=rules[type_]) for type_, kind in kinds().items())
    return [producer for producer in made if producer is not None]
