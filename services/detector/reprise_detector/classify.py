"""Classify stage: map a symptom to a category, severity and recommended action using rules kept as data."""

from __future__ import annotations

import functools
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator

from reprise_common.errors import ConfigError
from reprise_common.events import (
    Category,
    ComputeSignal,
    ComputeSignalKind,
    DependencyFailed,
    GpuLost,
    GpuXid,
    RankExited,
    RankNumeric,
    RankParked,
    RankStacks,
    RecommendedAction,
    Severity,
)
from reprise_detector import kinds, stacks
from reprise_detector.kinds.base import Classification, Derived, Facts, Rule, SymptomEvent, TemplateRule
from reprise_detector.observe import numeric_summary

BUILTIN_RULES = "rules.yaml"
EXIT_RULE_CACHE = 4096  # distinct rank exits (by what the rules look at) whose rule is remembered


class XidRule(Rule):
    """The meaning of one or more XID codes."""

    xids: list[int] = Field(min_length=1)
    meaning: str = Field(min_length=1)


class ExitMatch(BaseModel):
    """Fields a rank exit must match; a field left out matches anything."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    oom_killed: bool | None = None
    signal: str | None = None
    exit_code: int | None = None
    log: str | None = Field(default=None, description="a regular expression searched in each line of the log tail")

    @field_validator("log")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"log pattern {value!r} is not a valid regular expression: {exc}") from exc
        return value

    @field_validator("signal")
    @classmethod
    def _normalise(cls, value: str | None) -> str | None:
        return normalise_signal(value, None)

    def matches(self, *, oom_killed: bool, signal: str | None, exit_code: int | None, log_tail: list[str]) -> bool:
        """True when every given field equals the exit's (and the log pattern, if any, is found in the tail)."""
        return (
            (self.oom_killed is None or self.oom_killed == oom_killed)
            and (self.signal is None or self.signal == signal)
            and (self.exit_code is None or self.exit_code == exit_code)
            and (self.log is None or any(_pattern(self.log).search(line) for line in log_tail))
        )


class ExitRule(TemplateRule):
    """A rank-exit rule: the first whose `when` matches decides."""

    when: ExitMatch = Field(default_factory=ExitMatch)
    peer_failure: bool = Field(
        default=False, description="its log pattern names a failed peer: early evidence of a silent node's loss"
    )


class FixedSections(BaseModel):
    """The sections of rules.yaml for the symptoms agents and the compute backend send (RulesFile adds one per derived
    kind, kinds/)."""

    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = 1
    xid: list[XidRule] = Field(default_factory=list)
    unknown_xid: TemplateRule | None = None
    gpu_lost: TemplateRule | None = None
    dependency_failed: TemplateRule | None = None
    rendezvous_unreachable: TemplateRule | None = None
    rank_exited: list[ExitRule] = Field(default_factory=list)
    rank_stacks: TemplateRule | None = None
    rank_numeric: TemplateRule | None = None
    compute_signal: dict[ComputeSignalKind, TemplateRule] = Field(default_factory=dict)


# The shape of rules.yaml and of an operator's rules file (every section optional in the latter): the fixed sections
# and one per derived kind, of its kind's rule shape.
RulesFile = create_model(
    "RulesFile",
    __base__=FixedSections,
    **{section: (rule | None, None) for section, rule in kinds.sections().items()},  # type: ignore[call-overload]
)


# The fixed sections that hold one template rule each: RulesFile and RuleBook have a field of each name.
TEMPLATE_SECTIONS = (
    "unknown_xid",
    "gpu_lost",
    "dependency_failed",
    "rendezvous_unreachable",
    "rank_stacks",
    "rank_numeric",
)


@dataclass(frozen=True)
class RuleBook:
    """The merged rules, ready to classify symptoms."""

    xids: Mapping[int, XidRule]
    unknown_xid: TemplateRule
    gpu_lost: TemplateRule
    dependency_failed: TemplateRule
    rendezvous_unreachable: TemplateRule
    rank_exited: tuple[ExitRule, ...]
    rank_stacks: TemplateRule
    rank_numeric: TemplateRule
    compute_signals: Mapping[ComputeSignalKind, TemplateRule]
    derived: Mapping[str, TemplateRule]  # each derived kind's rule, by symptom type (kinds/)
    # The rule each rank exit chose, by what the rules look at: a storm's peers fail alike, so they match once.
    _exit_rules: dict[tuple[bool, str | None, int | None, tuple[str, ...]], ExitRule | None] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _peer_lines: dict[str, str | None] = field(default_factory=dict, init=False, repr=False, compare=False)

    def peer_failure(self, text: str) -> str | None:
        """The first line of an error text that the log pattern of a `peer_failure` rank-exit rule matches (a
        connection to a peer reset, a gloo or NCCL transport error); None when no line names a failed peer."""
        if text in self._peer_lines:  # a storm's peers fail alike: their texts are matched once
            return self._peer_lines[text]
        patterns = [_pattern(r.when.log) for r in self.rank_exited if r.peer_failure and r.when.log is not None]
        found = next((line for line in text.splitlines() if any(p.search(line) for p in patterns)), None)
        if len(self._peer_lines) >= EXIT_RULE_CACHE:
            self._peer_lines.clear()
        self._peer_lines[text] = found
        return found

    def classify(self, event: SymptomEvent) -> Classification:
        """Classify one symptom event."""
        match event:
            case GpuXid():
                return self._xid(event)
            case GpuLost():
                return self.gpu_lost.apply(Facts.of(event, reason=event.reason or "no reason given"))
            case DependencyFailed():  # a job's own (its rendezvous master), or the node's
                rule = self.rendezvous_unreachable if event.job_id is not None else self.dependency_failed
                return rule.apply(Facts.of(event))
            case RankExited():
                return self._rank_exited(event)
            case RankStacks() | RankNumeric() | ComputeSignal() | RankParked():
                return self._reported(event)
            case Derived():
                return event.classify(self.derived[event.type])

    def _reported(self, event: RankStacks | RankNumeric | ComputeSignal | RankParked) -> Classification:
        match event:
            case RankParked():
                return parked(event)
            case RankStacks():
                return self.rank_stacks.apply(Facts.of(event, summary=stacks.summary(event)))
            case RankNumeric():
                return self.rank_numeric.apply(Facts.of(event, summary=numeric_summary(event)))
            case ComputeSignal():  # a whole job's signal names no node, a node's no job
                facts = Facts.of(event, node_id=event.node_id or "(not named)", job_id=event.job_id or "(not named)")
                return self.compute_signals[event.kind].apply(facts)

    def _xid(self, event: GpuXid) -> Classification:
        rule = self.xids.get(event.xid)
        if rule is None:
            return self.unknown_xid.apply(Facts.of(event))
        reason = f"XID {event.xid} on GPU {event.gpu}: {rule.meaning}"
        return Classification(rule.category, rule.severity, rule.action, rule.root_cause, reason)

    def _rank_exited(self, event: RankExited) -> Classification:
        if event.scheduler_ended:
            return scheduler_ended(event)
        sig = normalise_signal(event.signal, event.exit_code)
        how = f"signal {sig}" if sig else f"exit code {event.exit_code}"
        key = (event.oom_killed, sig, event.exit_code, tuple(event.log_tail))
        if key in self._exit_rules:
            rule = self._exit_rules[key]
        else:
            rule = self._exit_rule(*key)
            if len(self._exit_rules) >= EXIT_RULE_CACHE:
                self._exit_rules.clear()
            self._exit_rules[key] = rule
        if rule is None:
            return Classification(
                Category.UNKNOWN, Severity.WARNING, RecommendedAction.NONE, False, f"rank exit: {how}"
            )
        return rule.apply(Facts.of(event, signal=sig, how=how))

    def _exit_rule(
        self, oom_killed: bool, signal: str | None, exit_code: int | None, log_tail: tuple[str, ...]
    ) -> ExitRule | None:
        lines = list(log_tail)
        for rule in self.rank_exited:
            if rule.when.matches(oom_killed=oom_killed, signal=signal, exit_code=exit_code, log_tail=lines):
                return rule
        return None


def parked(event: RankParked) -> Classification:
    """A rank parked for a restart in place survived a fault: never a cause nor a symptom, whatever an operator's rules
    say, so fixed here rather than in rules.yaml; its `why` is evidence of a lost peer (nodes/peers.py) and nothing
    more."""
    reason = f"rank {event.rank} parked for a restart in place: {event.why or 'no reason given'}"
    return Classification(
        Category.APPLICATION, Severity.INFO, RecommendedAction.NONE, False, reason, evidence_only=True
    )


def scheduler_ended(event: RankExited) -> Classification:
    """A rank the compute scheduler ended with its node's step (a preemption, a time limit, a cancel): no fault of the
    rank or the node, whatever its exit or log tail; fixed here like `parked`. The scheduler's own signal opens the
    incident and names the cause; this exit only tells the detector the node was released (nodes/liveness.py)."""
    reason = f"rank {event.rank} ended with its node's scheduler step ({event.signal or event.exit_code})"
    return Classification(
        Category.APPLICATION, Severity.INFO, RecommendedAction.NONE, False, reason, evidence_only=True
    )


def normalise_signal(value: str | None, exit_code: int | None) -> str | None:
    """A signal as its SIG name, from a name ("KILL", "sigkill"), a number, or a shell-style exit code (137)."""
    if value:
        text = value.strip().upper()
        if text.lstrip("-").isdigit():
            return _signal_name(abs(int(text))) or text
        return text if text.startswith("SIG") else f"SIG{text}"
    if exit_code is not None and exit_code < 0:
        return _signal_name(-exit_code)
    if exit_code is not None and exit_code > 128:
        return _signal_name(exit_code - 128)
    return None


@functools.cache
def _pattern(text: str) -> re.Pattern[str]:
    return re.compile(text)


def _signal_name(number: int) -> str | None:
    try:
        return signal.Signals(number).name
    except ValueError:
        return None


def load_rules(path: Path | None = None) -> RuleBook:
    """The built-in rules, extended and overridden by an operator's file when one is given."""
    builtin = _read(resources.files("reprise_detector").joinpath(BUILTIN_RULES).read_text(), BUILTIN_RULES)
    operator = _read(path.read_text(), str(path)) if path is not None else RulesFile()
    xids = {code: rule for rule in (*builtin.xid, *operator.xid) for code in rule.xids}
    templates: dict[str, TemplateRule] = {}
    for section in TEMPLATE_SECTIONS:  # an operator's rule replaces the built-in one of its section
        templates[section] = _section(builtin, operator, section)
    derived = {type_: _section(builtin, operator, kind.section) for type_, kind in kinds.kinds().items()}
    signals = {**builtin.compute_signal, **operator.compute_signal}
    if missing := sorted(set(ComputeSignalKind) - set(signals)):
        raise ConfigError(f"built-in {BUILTIN_RULES} lacks compute_signal rules for {', '.join(missing)}")
    exits = (*operator.rank_exited, *builtin.rank_exited)
    return RuleBook(xids=xids, rank_exited=exits, compute_signals=signals, derived=derived, **templates)


def _section(builtin: BaseModel, operator: BaseModel, section: str) -> TemplateRule:
    """A section's rule: the operator's, else the built-in one (which every section has)."""
    rule = getattr(operator, section) or getattr(builtin, section)
    if not isinstance(rule, TemplateRule):
        raise ConfigError(f"built-in {BUILTIN_RULES} lacks the section {section}")
    return rule


def _read(text: str, where: str) -> FixedSections:
    try:
        return RulesFile.model_validate(yaml.safe_load(text) or {})
    except yaml.YAMLError as exc:
        raise ConfigError(f"rules file {where} is not valid YAML: {exc}") from exc
    except ValidationError as exc:
        first = exc.errors()[0]
        at = ".".join(str(p) for p in first["loc"]) or "(root)"
        raise ConfigError(f"rules file {where}: {at}: {first['msg']}") from exc
