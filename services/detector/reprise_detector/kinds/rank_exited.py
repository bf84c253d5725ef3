"""rank.exited: a rank's process ended, with how and the last lines it printed. Sent by the agent (RankExited);
classified by the `rank_exited` section of rules.yaml, an ordered list whose first matching rule decides (an operator's
rules are tried before the built-in ones); it counts for its job alone, its culprit carrying the exit code and the
launch. A rank the compute scheduler ended with its node's step is evidence only, fixed here (`scheduler_ended`).

The rule each exit chose is remembered by what the rules look at (a storm's peers fail alike, so they match once), and
so is the line of an error text that names a failed peer (`ExitRules.peer_failure`, for nodes/peers.py).
"""

from __future__ import annotations

import functools
import re
import signal
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, field_validator

from reprise_common.events import Category, RankExited, RecommendedAction, Severity
from reprise_detector.kinds.base import Blame, Classification, Facts, Scope, TemplateRule, section_of
from reprise_detector.kinds.wire import Wire

EXIT_RULE_CACHE = 4096  # distinct rank exits (by what the rules look at) whose rule is remembered
LOG_TAIL_LINES = 5  # of a rank's log tail, in its symptom's detail


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


ExitKey = tuple[bool, str | None, int | None, tuple[str, ...]]  # what the rules look at: OOM, signal, code, log tail


@dataclass(frozen=True)
class ExitRules:
    """The merged rank-exit rules, in the order they are tried, and what they chose so far."""

    rules: tuple[ExitRule, ...]
    _chosen: dict[ExitKey, ExitRule | None] = field(default_factory=dict, init=False, repr=False, compare=False)
    _peer_lines: dict[str, str | None] = field(default_factory=dict, init=False, repr=False, compare=False)

    def rule_for(self, key: ExitKey) -> ExitRule | None:
        """The first rule that matches an exit (None: none does), remembered by what the rules look at."""
        if key in self._chosen:
            return self._chosen[key]
        oom_killed, sig, exit_code, log_tail = key
        lines = list(log_tail)
        found = next(
            (
                rule
                for rule in self.rules
                if rule.when.matches(oom_killed=oom_killed, signal=sig, exit_code=exit_code, log_tail=lines)
            ),
            None,
        )
        if len(self._chosen) >= EXIT_RULE_CACHE:
            self._chosen.clear()
        self._chosen[key] = found
        return found

    def peer_failure(self, text: str) -> str | None:
        """The first line of an error text that the log pattern of a `peer_failure` rank-exit rule matches (a
        connection to a peer reset, a gloo or NCCL transport error); None when no line names a failed peer."""
        if text in self._peer_lines:  # a storm's peers fail alike: their texts are matched once
            return self._peer_lines[text]
        patterns = [_pattern(r.when.log) for r in self.rules if r.peer_failure and r.when.log is not None]
        found = next((line for line in text.splitlines() if any(p.search(line) for p in patterns)), None)
        if len(self._peer_lines) >= EXIT_RULE_CACHE:
            self._peer_lines.clear()
        self._peer_lines[text] = found
        return found


class RankExitedKind(Wire[RankExited, ExitRules]):
    """A rank's exit, worded by the rule its exit and log tail match."""

    event = RankExited
    sections = {"rank_exited": (list[ExitRule], Field(default_factory=list))}

    def merge(self, builtin: BaseModel, operator: BaseModel) -> ExitRules:
        """The operator's rules, then the built-in ones."""
        return ExitRules((*section_of(operator, "rank_exited"), *section_of(builtin, "rank_exited")))

    def classify(self, event: RankExited, rules: ExitRules) -> Classification:
        """The first matching rule's; an exit no rule matches is an unknown warning."""
        if event.scheduler_ended:
            return scheduler_ended(event)
        sig = normalise_signal(event.signal, event.exit_code)
        how = f"signal {sig}" if sig else f"exit code {event.exit_code}"
        rule = rules.rule_for((event.oom_killed, sig, event.exit_code, tuple(event.log_tail)))
        if rule is None:
            return Classification(
                Category.UNKNOWN, Severity.WARNING, RecommendedAction.NONE, False, f"rank exit: {how}"
            )
        return rule.apply(Facts.of(event, signal=sig, how=how))

    def scope(self, event: RankExited) -> Scope:
        """Its job and rank."""
        return Scope(job_id=event.job_id, rank=event.rank)

    def detail(self, event: RankExited) -> str:
        """The last lines of its log tail."""
        return "\n".join(event.log_tail[-LOG_TAIL_LINES:])

    def blame(self, event: RankExited) -> Blame:
        """Its exit code and launch."""
        return Blame(exit_code=event.exit_code, restart_epoch=event.restart_epoch)


def scheduler_ended(event: RankExited) -> Classification:
    """A rank the compute scheduler ended with its node's step (a preemption, a time limit, a cancel): no fault of the
    rank or the node, whatever its exit or log tail; fixed here like rank_parked.parked. The scheduler's own signal
    opens the incident and names the cause; this exit only tells the detector the node was released
    (nodes/liveness.py)."""
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


KIND = RankExitedKind()
