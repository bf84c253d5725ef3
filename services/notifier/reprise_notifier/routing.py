"""Routing rules as data: which destinations an alert goes to, by job, team, label, severity, category and kind.

A routes file (REPRISE_NOTIFIER_ROUTES_FILE, format in docs/notifier.md) names destinations, whose URLs and secrets
come from an environment variable or a file, never from the file itself, and rules that send matching alerts to
them. Every rule that matches contributes its destinations; when none matches, the default route from the
environment (REPRISE_NOTIFIER_SLACK_URL / REPRISE_NOTIFIER_WEBHOOK_URL) takes the alert.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from reprise_common.errors import ConfigError
from reprise_common.events import Category, Severity
from reprise_common.labels import LabelKey
from reprise_common.subjects import token
from reprise_notifier.alerts.models import LOUD_KINDS, Alert, AlertKind
from reprise_notifier.settings import NotifierSettings
from reprise_notifier.signing import check_secret

DEFAULT_ROUTE = "default"
DEFAULT_SLACK = "default-slack"
DEFAULT_WEBHOOK = "default-webhook"
_INLINE_KEYS = ("url", "secret", "webhook_url")


class DestinationKind(StrEnum):
    """How a destination is spoken to."""

    SLACK = "slack"  # a Slack incoming webhook: Block Kit messages
    WEBHOOK = "webhook"  # any HTTP endpoint: signed JSON


@dataclass(frozen=True)
class Destination:
    """Where alerts go, known by its name everywhere; the URL and secret are SecretStr so no repr shows them."""

    name: str
    kind: DestinationKind
    url: SecretStr
    secret: SecretStr | None = None
    min_interval_s: float = 1.0


Selector = tuple[tuple[str, str], ...]  # (label key, value glob) pairs, every one must match


def selector_matches(selector: Selector, labels: Mapping[str, str]) -> bool:
    """True when the labels have every key of the selector with a value its glob matches (a missing key: no)."""
    return all(key in labels and fnmatch.fnmatchcase(labels[key], glob) for key, glob in selector)


# --- the file's schema -----------------------------------------------------------------------------------------
def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


def _selector(labels: Mapping[str, str]) -> Selector:
    return tuple(sorted(labels.items()))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)


class DestinationSpec(_Strict):
    """A destination in the routes file: its kind and where its URL (and secret) are read from."""

    kind: DestinationKind
    url_env: str | None = None
    url_file: Path | None = None
    secret_env: str | None = None
    secret_file: Path | None = None
    min_interval_s: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _one_source_each(self) -> DestinationSpec:
        if (self.url_env is None) == (self.url_file is None):
            raise ValueError("give exactly one of url_env or url_file")
        if self.kind is DestinationKind.WEBHOOK and (self.secret_env is None) == (self.secret_file is None):
            raise ValueError("a webhook needs exactly one of secret_env or secret_file (its HMAC secret)")
        return self


class TeamSpec(_Strict):
    """A team's jobs: by label selector (recommended), by job id globs, or both (either one makes a job the team's)."""

    labels: dict[LabelKey, str] = Field(
        default_factory=dict, description="label key -> value glob, every one must match"
    )
    jobs: list[str] = Field(default_factory=list, description="job id globs")

    @model_validator(mode="before")
    @classmethod
    def _globs_alone(cls, value: Any) -> Any:
        return {"jobs": value} if isinstance(value, str | list) else value  # the short form: a list of job id globs

    @field_validator("jobs", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return _as_list(value)

    @model_validator(mode="after")
    def _names_some_jobs(self) -> TeamSpec:
        if not self.labels and not self.jobs:
            raise ValueError("a team needs labels (a label selector) or jobs (job id globs)")
        return self


class MatchSpec(_Strict):
    """What an alert must be for a rule to take it; an empty field matches anything."""

    job: list[str] = Field(default_factory=list, description="job id globs; a prefix is written `prefix*`")
    team: list[str] = Field(default_factory=list, description="team names of the teams: section")
    labels: dict[LabelKey, str] = Field(
        default_factory=dict, description="label key -> value glob, every one must match"
    )
    severity: list[Severity] = Field(default_factory=list)
    category: list[Category] = Field(default_factory=list)
    kind: list[AlertKind] = Field(default_factory=lambda: list(LOUD_KINDS))

    @field_validator("job", "team", "severity", "category", "kind", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return _as_list(value)


class RouteSpec(_Strict):
    """One rule: a name, what it matches, and the destinations it sends to."""

    name: str
    match: MatchSpec = Field(default_factory=MatchSpec)
    to: list[str] = Field(min_length=1)

    @field_validator("to", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return _as_list(value)


class RoutesFile(_Strict):
    """The routes file."""

    version: Literal[1] = 1
    destinations: dict[str, DestinationSpec] = Field(default_factory=dict)
    teams: dict[str, TeamSpec] = Field(default_factory=dict, description="team name -> its label selector or job globs")
    routes: list[RouteSpec] = Field(default_factory=list)


# --- matching --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Route:
    """A rule ready to match: which jobs (globs and team selectors), labels, severities, categories, kinds."""

    name: str
    destinations: tuple[str, ...]
    job_globs: tuple[str, ...] = ()
    job_selectors: tuple[Selector, ...] = ()  # the label selectors of the rule's teams
    labels: Selector = ()
    severities: frozenset[Severity] = frozenset()
    categories: frozenset[Category] = frozenset()
    kinds: frozenset[AlertKind] = frozenset(LOUD_KINDS)

    def matches(self, alert: Alert) -> bool:
        """True when the alert passes every filter of the rule (an alert without a severity passes no severity)."""
        if self.kinds and alert.kind not in self.kinds:
            return False
        if (self.job_globs or self.job_selectors) and not self._is_one_of_its_jobs(alert):
            return False
        if not selector_matches(self.labels, alert.labels):
            return False
        if self.severities and alert.severity not in self.severities:
            return False
        return not self.categories or alert.category in self.categories

    def _is_one_of_its_jobs(self, alert: Alert) -> bool:
        """The job filter: `job` globs and the rule's teams together name the jobs the rule is about."""
        return any(fnmatch.fnmatchcase(alert.job_id, glob) for glob in self.job_globs) or any(
            selector_matches(selector, alert.labels) for selector in self.job_selectors
        )


@dataclass(frozen=True)
class Routing:
    """Every destination by name, the rules in file order, and the default route."""

    destinations: dict[str, Destination]
    routes: tuple[Route, ...] = ()
    default: Route | None = None

    def destinations_for(self, alert: Alert) -> list[Destination]:
        """The destinations of every matching rule, each once, in rule order; the default route's if none matched."""
        matched = [route for route in self.routes if route.matches(alert)]
        if not matched and self.default is not None and self.default.matches(alert):
            matched = [self.default]
        names = dict.fromkeys(name for route in matched for name in route.destinations)
        return [self.destinations[name] for name in names]


# --- loading ---------------------------------------------------------------------------------------------------
def load_routing(settings: NotifierSettings, environ: Mapping[str, str] | None = None) -> Routing:
    """The routing of the routes file plus the default route; ConfigError names what is wrong (never a secret)."""
    env = os.environ if environ is None else environ
    destinations: dict[str, Destination] = {}
    routes: tuple[Route, ...] = ()
    if settings.notifier_routes_file is not None:
        spec = parse_routes(settings.notifier_routes_file.read_text(), source=str(settings.notifier_routes_file))
        destinations = {name: _destination(name, d, settings, env) for name, d in spec.destinations.items()}
        routes = tuple(_route(r, spec, destinations) for r in spec.routes)
    default = _default_route(settings, destinations)
    return Routing(destinations=destinations, routes=routes, default=default)


def parse_routes(text: str, *, source: str = "routes file") -> RoutesFile:
    """Parse and validate a routes file's YAML; an inline URL or secret is refused without repeating it."""
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML ({getattr(exc, 'problem', 'syntax error')})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping with destinations, teams and routes")
    for name, destination in (raw.get("destinations") or {}).items():
        inline = [key for key in _INLINE_KEYS if isinstance(destination, dict) and key in destination]
        if inline:
            raise ConfigError(
                f"{source}: destination {name!r} has an inline {inline[0]}: secrets never go in the routes file; "
                "use url_env / url_file (and secret_env / secret_file)"
            )
    try:
        return RoutesFile.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"{source}: {problems}") from None


def _read_secret(owner: str, what: str, env_name: str | None, file: Path | None, env: Mapping[str, str]) -> str:
    if env_name is not None:
        value = env.get(env_name, "").strip()
        if not value:
            raise ConfigError(f"destination {owner!r}: environment variable {env_name} ({what}) is not set")
        return value
    assert file is not None  # the schema requires one of the two
    try:
        value = file.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"destination {owner!r}: cannot read {what} file {file}: {exc.strerror}") from None
    if not value:
        raise ConfigError(f"destination {owner!r}: {what} file {file} is empty")
    return value


def _destination(name: str, spec: DestinationSpec, settings: NotifierSettings, env: Mapping[str, str]) -> Destination:
    try:
        token(name)
    except ValueError as exc:
        raise ConfigError(f"destination name: {exc}") from None
    url = _read_secret(name, "URL", spec.url_env, spec.url_file, env)
    if not url.startswith(("https://", "http://")):
        raise ConfigError(f"destination {name!r}: its URL must start with https:// or http://")
    secret = None
    if spec.kind is DestinationKind.WEBHOOK:
        value = _read_secret(name, "signing secret", spec.secret_env, spec.secret_file, env)
        try:
            secret = SecretStr(check_secret(f"destination {name!r} signing secret", value))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    interval = spec.min_interval_s or _default_interval(spec.kind, settings)
    return Destination(name=name, kind=spec.kind, url=SecretStr(url), secret=secret, min_interval_s=interval)


def _default_interval(kind: DestinationKind, settings: NotifierSettings) -> float:
    return settings.slack_min_interval_s if kind is DestinationKind.SLACK else settings.webhook_min_interval_s


def _route(spec: RouteSpec, routes_file: RoutesFile, destinations: dict[str, Destination]) -> Route:
    unknown = [name for name in spec.to if name not in destinations]
    if unknown:
        raise ConfigError(f"route {spec.name!r} sends to unknown destinations {unknown}")
    globs = list(spec.match.job)
    selectors: list[Selector] = []
    for team in spec.match.team:
        if team not in routes_file.teams:
            raise ConfigError(f"route {spec.name!r} names team {team!r}, which the teams: section does not define")
        members = routes_file.teams[team]
        globs += members.jobs
        if members.labels:
            selectors.append(_selector(members.labels))
    return Route(
        name=spec.name,
        destinations=tuple(spec.to),
        job_globs=tuple(globs),
        job_selectors=tuple(selectors),
        labels=_selector(spec.match.labels),
        severities=frozenset(spec.match.severity),
        categories=frozenset(spec.match.category),
        kinds=frozenset(spec.match.kind),
    )


def _default_route(settings: NotifierSettings, destinations: dict[str, Destination]) -> Route | None:
    names: list[str] = []
    taken = {DEFAULT_SLACK, DEFAULT_WEBHOOK} & set(destinations)
    if taken:
        raise ConfigError(f"destination names {sorted(taken)} are reserved for the default route")
    if settings.notifier_slack_url is not None:
        destinations[DEFAULT_SLACK] = Destination(
            DEFAULT_SLACK, DestinationKind.SLACK, settings.notifier_slack_url, None, settings.slack_min_interval_s
        )
        names.append(DEFAULT_SLACK)
    if settings.notifier_webhook_url is not None:
        destinations[DEFAULT_WEBHOOK] = Destination(
            DEFAULT_WEBHOOK,
            DestinationKind.WEBHOOK,
            settings.notifier_webhook_url,
            settings.notifier_webhook_secret,
            settings.webhook_min_interval_s,
        )
        names.append(DEFAULT_WEBHOOK)
    if not names:
        return None
    return Route(name=DEFAULT_ROUTE, destinations=tuple(names), kinds=frozenset(settings.notifier_default_kinds))
