"""compute.signal: a failure signal of the compute backend (a cluster scheduler such as Slurm: a node set down or not
responding, a job preempted or at its time limit), announced by the orchestrator that runs the backend (ComputeSignal
on reprise.compute.<backend>.signal). Classified by the `compute_signal` section of rules.yaml, one rule per signal
kind (an operator's entry replaces the built-in one of the same kind; the built-in file must cover every kind). A
signal about a node counts for every job placed on it (or the job it names); one about a whole job names no node and
counts for that job."""

from __future__ import annotations

from pydantic import BaseModel, Field

from reprise_common import subjects
from reprise_common.errors import ConfigError
from reprise_common.events import ComputeSignal, ComputeSignalKind
from reprise_detector.kinds.base import BUILTIN_RULES, Classification, Facts, Scope, TemplateRule, section_of
from reprise_detector.kinds.wire import Wire

SignalRules = dict[ComputeSignalKind, TemplateRule]


class SchedulerSignalKind(Wire[ComputeSignal, SignalRules]):
    """A scheduler's signal, one rule per signal kind."""

    event = ComputeSignal
    sections = {"compute_signal": (SignalRules, Field(default_factory=dict))}
    on_node_clock = False  # sent by the orchestrator, not by the node it names

    def merge(self, builtin: BaseModel, operator: BaseModel) -> SignalRules:
        """The built-in rules with the operator's over them, kind by kind; every kind must have one."""
        signals: SignalRules = {**section_of(builtin, "compute_signal"), **section_of(operator, "compute_signal")}
        if missing := sorted(set(ComputeSignalKind) - set(signals)):
            raise ConfigError(f"built-in {BUILTIN_RULES} lacks compute_signal rules for {', '.join(missing)}")
        return signals

    def classify(self, event: ComputeSignal, rules: SignalRules) -> Classification:
        """Its signal kind's rule; a whole job's signal names no node, a node's no job."""
        facts = Facts.of(event, node_id=event.node_id or "(not named)", job_id=event.job_id or "(not named)")
        return rules[event.kind].apply(facts)

    def node_of(self, event: ComputeSignal, subject: str) -> str:
        """The node the signal names ("" for a whole job's), taken as given: only the orchestrator may publish on a
        backend's signal subject (the server's permissions), as for a placement; the backend must be the subject's."""
        expected = subjects.compute_signal(event.backend)
        node_id = subjects.token(event.node_id) if event.node_id is not None else ""
        if subject != expected:
            raise ValueError(f"a {event.backend} signal on {subject}, not on {expected}")
        return node_id

    def scope(self, event: ComputeSignal) -> Scope:
        """The job it names, if any."""
        return Scope(job_id=event.job_id)

    def detail(self, event: ComputeSignal) -> str:
        """The backend, the signal's kind and what the scheduler said."""
        if event.detail:
            return f"{event.backend} {event.kind.value}: {event.detail}"
        return f"{event.backend} {event.kind}"


KIND = SchedulerSignalKind()
