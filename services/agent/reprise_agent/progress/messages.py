"""The SDK's wire protocol: parsing one datagram into an SdkMessage, or refusing it with a reason.

The SDK (``reprise_sdk``) sends one compact JSON object per datagram, protocol version 1::

    {"v":1,"job":"j1","rank":0,"epoch":0,"k":"hb","step":12,"t_ns":1767225600000000000,"phase":"","m":{"loss":0.5}}
    {"v":1,"job":"j1","rank":0,"epoch":0,"k":"phase","t_ns":1767225600000000000,"phase":"checkpointing"}
    {"v":1,"job":"j1","rank":0,"epoch":0,"k":"ckpt","step":12,"t_ns":...,"path":"/ckpt/12","files":["/ckpt/12/a"]}

Unknown fields are ignored; a newer protocol version, an unknown kind or anything unparsable is refused (the socket
counts and drops it). Eight ranks heartbeating every 10 ms are 800 datagrams a second: parsing is one ``json.loads``
and a few type checks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

PROTOCOL_VERSION = 1
_MAX_TEXT = 4096


class MessageKind(StrEnum):
    """What an SDK message reports."""

    HEARTBEAT = "hb"
    PHASE = "phase"
    CHECKPOINT = "ckpt"
    IN_PLACE = "inplace"  # the rank runs under reprise_sdk.run: it can restart in place
    PARKED = "parked"  # the rank left its training function and waits for the next epoch (`why`: what it caught)
    RESUMED = "resumed"  # where the rank's state came from after it joined: `via` peer (at `step`) or checkpoint


class MalformedSdkMessage(ValueError):
    """A datagram that is not a version-1 SDK message; the reason says what was wrong."""


@dataclass(frozen=True, slots=True)
class SdkMessage:
    """One parsed SDK message; `sent_ns` is the sender's wall time, `phase` "" when the script set none."""

    kind: MessageKind
    job_id: str
    rank: int
    restart_epoch: int
    sent_ns: int
    step: int | None = None
    phase: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    path: str = ""
    files: tuple[str, ...] = ()
    sha256: tuple[tuple[str, int, str], ...] = ()  # (file, size, SHA-256 hex) computed by the writer
    why: str = ""  # a parked rank's reason, or why a rank resumed the way it did
    via: str = ""  # a resumed rank's source: "peer" or "checkpoint"


def parse_message(data: bytes) -> SdkMessage:
    """Parse one datagram, or raise MalformedSdkMessage with a one-line reason."""
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than the parser's stack
        raise MalformedSdkMessage(f"not JSON: {exc}") from None
    if type(raw) is not dict:
        raise MalformedSdkMessage("not a JSON object")
    if raw.get("v") != PROTOCOL_VERSION:
        raise MalformedSdkMessage(f"protocol version {raw.get('v')!r} not supported (this reader knows 1)")
    try:
        kind = MessageKind(str(raw.get("k")))
    except ValueError:
        raise MalformedSdkMessage(f"unknown kind {raw.get('k')!r}") from None
    job_id = _text(raw, "job")
    if not job_id:
        raise MalformedSdkMessage("job is empty")
    rank, epoch, sent_ns = _count(raw, "rank"), _count(raw, "epoch"), _count(raw, "t_ns")
    if kind is MessageKind.PHASE:
        return SdkMessage(kind, job_id, rank, epoch, sent_ns, phase=_text(raw, "phase"))
    if kind is MessageKind.IN_PLACE or kind is MessageKind.PARKED:
        return SdkMessage(kind, job_id, rank, epoch, sent_ns, why=_text(raw, "why"))
    if kind is MessageKind.RESUMED:
        return _resumed(raw, job_id, rank, epoch, sent_ns)
    step = _count(raw, "step")
    if kind is MessageKind.HEARTBEAT:
        return SdkMessage(kind, job_id, rank, epoch, sent_ns, step, phase=_text(raw, "phase"), metrics=_metrics(raw))
    path, files = _text(raw, "path"), raw.get("files", [])
    if not path:
        raise MalformedSdkMessage("path is empty")
    if type(files) is not list or not all(type(f) is str for f in files):
        raise MalformedSdkMessage("files is not a list of strings")
    return SdkMessage(kind, job_id, rank, epoch, sent_ns, step, path=path, files=tuple(files), sha256=_sha256(raw))


RESUMED_VIA = ("peer", "checkpoint")


def _resumed(raw: dict[str, Any], job_id: str, rank: int, epoch: int, sent_ns: int) -> SdkMessage:
    via = _text(raw, "via")
    if via not in RESUMED_VIA:
        raise MalformedSdkMessage(f"via is not one of {', '.join(RESUMED_VIA)}: {via!r}")
    step = _count(raw, "step") if "step" in raw else None
    return SdkMessage(MessageKind.RESUMED, job_id, rank, epoch, sent_ns, step, why=_text(raw, "why")[:512], via=via)


def _sha256(raw: dict[str, Any]) -> tuple[tuple[str, int, str], ...]:
    digests = raw.get("sha256", {})
    if type(digests) is not dict:
        raise MalformedSdkMessage("sha256 is not an object")
    found = []
    for name, entry in digests.items():
        if type(entry) is not list or len(entry) != 2 or type(entry[0]) is not int or type(entry[1]) is not str:
            raise MalformedSdkMessage(f"sha256 entry for {name!r} is not [size, hex digest]")
        found.append((name, entry[0], entry[1]))
    return tuple(found)


def _count(raw: dict[str, Any], name: str) -> int:
    value = raw.get(name)
    if type(value) is not int or value < 0:
        raise MalformedSdkMessage(f"{name} is not a non-negative integer: {value!r}")
    return value


def _text(raw: dict[str, Any], name: str) -> str:
    value = raw.get(name, "")
    if type(value) is not str or len(value) > _MAX_TEXT:
        raise MalformedSdkMessage(f"{name} is not a string of at most {_MAX_TEXT} characters")
    return value


def _metrics(raw: dict[str, Any]) -> dict[str, float]:
    metrics = raw.get("m")
    if metrics is None:
        return {}
    if type(metrics) is not dict:
        raise MalformedSdkMessage("m is not an object")
    try:
        return {k: float(v) for k, v in metrics.items() if type(v) in (int, float)}
    except OverflowError:  # an integer too large for a float
        raise MalformedSdkMessage("a metric is out of range") from None
