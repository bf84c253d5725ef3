"""docs/events.md documents every stream, subject, schema, field and enum value that the shared library defines.

The expectations are read from reprise_common.subjects and reprise_common.events, so adding a subject, a stream, an
event or a field without documenting it fails here, naming what is missing.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable
from pathlib import Path

import pytest

from reprise_common import events, subjects
from reprise_common.subjects import STREAMS, StreamSpec

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "events.md"
WIRE_CLASSES: tuple[type[events.Wire], ...] = (
    events.AgentCommand,
    events.PingCommand,
    events.LaunchCommand,
    events.StopCommand,
    events.CaptureStacksCommand,
    events.LaunchArgs,
    events.StopArgs,
    events.CommandReply,
    events.InjectFault,
    events.InjectReply,
    events.GpuStatus,
    events.RankStatus,
    events.Culprit,
    events.RankAssignment,
)
CORE_NATS = "core NATS"


@pytest.fixture(scope="module")
def doc() -> str:
    """The text of docs/events.md."""
    return DOC.read_text()


# --- what the code defines ----------------------------------------------------------------------------------------
def _subject_builders() -> dict[str, str]:
    """Each subject function's output with its parameters as `{name}`, e.g. reprise.cmd.{node_id} -> node_command."""
    templates: dict[str, str] = {}
    for name, function in inspect.getmembers(subjects, inspect.isfunction):
        if function.__module__ != subjects.__name__:
            continue
        parameters = list(inspect.signature(function).parameters)
        try:
            subject = _call(function, parameters)
        except (TypeError, ValueError):
            continue  # not a subject builder (token(), node_from_agent_subject())
        if not subject.startswith(f"{subjects.PREFIX}."):
            continue
        tokens = [f"{{{token}}}" if token in parameters else token for token in subject.split(".")]
        templates[".".join(tokens)] = name
    return templates


def _call(function: Callable[..., object], parameters: list[str]) -> str:
    result = function(*parameters)  # each parameter name is itself a valid subject token
    if not isinstance(result, str):
        raise TypeError(f"{function.__name__} does not return a subject")
    return result


def _subject_constants() -> dict[str, str]:
    """Each module-level subject pattern, e.g. reprise.incident.> -> INCIDENTS_ALL."""
    return {
        value: name
        for name, value in vars(subjects).items()
        if name.isupper() and isinstance(value, str) and value.startswith(f"{subjects.PREFIX}.")
    }


def _matches(pattern: str, subject: str) -> bool:
    """NATS subject matching; a `{name}` token of a template stands for one concrete token."""
    want, have = pattern.split("."), subject.split(".")
    for index, token in enumerate(want):
        if token == ">":
            return len(have) > index
        if index >= len(have) or (token != "*" and token != have[index]):
            return False
    return len(want) == len(have)


def _stream_of(subject: str) -> StreamSpec | None:
    return next((s for s in STREAMS if any(_matches(p, subject) for p in s.subjects)), None)


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)} {unit}"
    return f"{seconds:g} s"


def _enums() -> list[type[enum.Enum]]:
    return [
        value
        for value in vars(events).values()
        if inspect.isclass(value)
        and issubclass(value, enum.Enum)
        and value.__module__.startswith(events.__name__ + ".")
    ]


# --- reading the doc ----------------------------------------------------------------------------------------------
def _rows(doc: str, cell: str) -> list[str]:
    """Table rows (lines starting with |) that contain `cell` in backticks."""
    return [line for line in doc.splitlines() if line.startswith("|") and f"`{cell}`" in line]


def _section(doc: str, name: str) -> str:
    """The text under the heading that starts with `name` (in backticks), up to the next heading."""
    lines = doc.splitlines()
    starts = [
        i for i, line in enumerate(lines) if line.startswith("#") and line.lstrip("#").strip().startswith(f"`{name}`")
    ]
    assert starts, f"docs/events.md has no heading starting with `{name}`"
    body = []
    for line in lines[starts[0] + 1 :]:
        if line.startswith("#"):
            break
        body.append(line)
    return "\n".join(body)


# --- subjects -----------------------------------------------------------------------------------------------------
def test_the_code_defines_subjects_to_check() -> None:
    assert len(_subject_builders()) >= 8, f"found only {_subject_builders()} in subjects.py"
    assert len(_subject_constants()) >= 6, f"found only {_subject_constants()} in subjects.py"


@pytest.mark.parametrize(
    ("subject", "defined_by"),
    sorted({**_subject_builders(), **_subject_constants()}.items()),
    ids=str,
)
def test_every_subject_is_documented_with_its_stream(doc: str, subject: str, defined_by: str) -> None:
    rows = [row for row in _rows(doc, subject) if row.startswith(f"| `{subject}`")]
    assert rows, f"docs/events.md has no table row for `{subject}` (subjects.{defined_by})"
    stream = _stream_of(subject)
    expected = f"`{stream.name}`" if stream else CORE_NATS
    assert expected in rows[0], (
        f"docs/events.md row for `{subject}` (subjects.{defined_by}) does not say it goes to {expected}: {rows[0]}"
    )
    assert f"`{defined_by}" in rows[0], f"docs/events.md row for `{subject}` does not name subjects.{defined_by}"


# --- streams ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", STREAMS, ids=lambda s: s.name)
def test_every_stream_is_documented_with_its_limits(doc: str, stream: StreamSpec) -> None:
    rows = [row for row in _rows(doc, stream.name) if row.startswith(f"| `{stream.name}`")]
    assert rows, f"docs/events.md has no stream table row starting with `{stream.name}`"
    cells = [cell.strip() for cell in rows[0].strip("|").split("|")]
    expected = {
        "subjects": ", ".join(f"`{s}`" for s in stream.subjects),
        "max age": _duration(stream.max_age_s),
        "max msgs per subject": "unlimited" if stream.max_msgs_per_subject < 0 else str(stream.max_msgs_per_subject),
        "duplicate window": _duration(stream.duplicate_window_s),
    }
    header = [
        cell.strip().lower()
        for cell in next(line for line in doc.splitlines() if line.startswith("| Stream |")).strip("|").split("|")
    ]
    documented = {key: cells[header.index(key)] if key in header else None for key in expected}
    drifted = {
        key: {"code": value, "doc": documented[key]} for key, value in expected.items() if documented[key] != value
    }
    assert not drifted, f"docs/events.md describes stream {stream.name} differently from subjects.py: {drifted}"


# --- schemas ------------------------------------------------------------------------------------------------------
def test_schema_version_is_documented(doc: str) -> None:
    assert f"SCHEMA_VERSION = {events.SCHEMA_VERSION}" in doc, (
        f"docs/events.md does not state SCHEMA_VERSION = {events.SCHEMA_VERSION}"
    )


def test_envelope_fields_are_documented(doc: str) -> None:
    section = _section(doc, "Event")
    missing = [name for name in events.Event.model_fields if f"| `{name}` |" not in section]
    assert not missing, f"docs/events.md `Event` envelope lacks fields {missing}"


@pytest.mark.parametrize("event_class", events.EVENT_TYPES, ids=lambda c: c.__name__)
def test_every_event_is_documented(doc: str, event_class: type[events.Event]) -> None:
    section = _section(doc, event_class.__name__)
    type_name = event_class.model_fields["type"].default
    heading = next(line for line in doc.splitlines() if line.startswith("#") and f"`{event_class.__name__}`" in line)
    assert f"`{type_name}`" in heading, (
        f"docs/events.md heading for {event_class.__name__} lacks its type `{type_name}`"
    )
    own = [name for name in event_class.model_fields if name not in events.Event.model_fields]
    missing = [name for name in own if f"| `{name}` |" not in section]
    assert not missing, f"docs/events.md section `{event_class.__name__}` lacks fields {missing}"
    extra = sorted(
        {line.split("`")[1] for line in section.splitlines() if line.startswith("| `")} - set(event_class.model_fields)
    )
    assert not extra, f"docs/events.md section `{event_class.__name__}` documents fields the schema lacks: {extra}"


@pytest.mark.parametrize("wire_class", WIRE_CLASSES, ids=lambda c: c.__name__)
def test_every_wire_model_is_documented(doc: str, wire_class: type[events.Wire]) -> None:
    section = _section(doc, wire_class.__name__)
    fields = set(wire_class.model_fields)
    if wire_class is not events.AgentCommand and issubclass(wire_class, events.AgentCommand):
        fields -= set(events.AgentCommand.model_fields)  # each command's section documents what it adds
    documented = {line.split("`")[1] for line in section.splitlines() if line.startswith("| `")}
    assert documented == fields, (
        f"docs/events.md section `{wire_class.__name__}`: missing {sorted(fields - documented)}, "
        f"not in the model {sorted(documented - fields)}"
    )


@pytest.mark.parametrize("enum_class", _enums(), ids=lambda c: c.__name__)
def test_every_enum_value_is_documented(doc: str, enum_class: type[enum.Enum]) -> None:
    rows = [row for row in _rows(doc, enum_class.__name__) if row.startswith(f"| `{enum_class.__name__}`")]
    assert rows, f"docs/events.md has no enumeration row for `{enum_class.__name__}`"
    documented = {cell.strip().strip("`") for cell in rows[0].strip("|").split("|")[1].split(",")}
    values = {str(member.value) for member in enum_class}
    assert documented == values, (
        f"docs/events.md `{enum_class.__name__}`: missing {sorted(values - documented)}, "
        f"not in the code {sorted(documented - values)}"
    )
