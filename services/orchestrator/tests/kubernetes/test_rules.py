"""The rules of the kubernetes backend without a server, table-tested: which condition changes are signals, and
what a cordon's taint and annotations say for a recovery's reason or an operator's."""

from __future__ import annotations

import pytest

from reprise_common.events import ComputeSignalKind
from reprise_orchestrator.compute.kubernetes.cordon import incident_of, taint_value
from reprise_orchestrator.compute.kubernetes.signals import Condition, NodeHealth, node_signals

DOWN, SILENT = ComputeSignalKind.NODE_DOWN, ComputeSignalKind.NODE_NOT_RESPONDING


def state(ready: str, network: str = "False") -> NodeHealth:
    return NodeHealth({"Ready": Condition(ready, since="t"), "NetworkUnavailable": Condition(network, since="t")})


@pytest.mark.parametrize(
    ("before", "after", "kinds"),
    [
        (None, state("False"), []),  # a node first seen is the baseline
        (state("True"), state("True"), []),
        (state("True"), state("False"), [DOWN]),
        (state("False"), state("False"), []),  # written again: no transition
        (state("True"), state("Unknown"), [SILENT]),
        (state("False"), state("Unknown"), [SILENT]),
        (state("Unknown"), state("True"), []),  # recovered: not a fault
        (state("True"), state("True", network="True"), [DOWN]),
        (state("True"), state("False", network="True"), [DOWN, DOWN]),
    ],
)
def test_which_changes_are_signals(
    before: NodeHealth | None, after: NodeHealth, kinds: list[ComputeSignalKind]
) -> None:
    assert [s.kind for s in node_signals("n1", before, after, backend="kubernetes")] == kinds


def test_a_transition_seen_by_two_replicas_is_one_event() -> None:
    first = node_signals("n1", state("True"), state("False"), backend="kubernetes")
    again = node_signals("n1", state("True"), state("False"), backend="kubernetes")
    assert [s.event_id for s in first] == [s.event_id for s in again]


@pytest.mark.parametrize(
    ("reason", "incident", "value"),
    [
        ("incident inc-79: XID 79 on gpu 3", "inc-79", "inc-79"),
        ("incident 0c4f/xid: bad", "0c4f/xid", "0c4f-xid"),  # made a valid label value
        ("cordoned by an operator", None, "operator"),
        (f"incident {'a' * 80}: long", "a" * 80, "a" * 63),
    ],
)
def test_the_taint_names_the_incident(reason: str, incident: str | None, value: str) -> None:
    assert incident_of(reason) == incident
    assert taint_value(reason) == value
