"""Each node's clock offset, measured from its reports (node_clocks.py): the largest `sent - received` over recent
reports, left alone within the trust band, following a clock that steps."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from reprise_detector.node_clocks import BUCKET_S, TRUST_S, NodeClocks

T0 = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)


def feed(clocks: NodeClocks, offset_s: float, transits_s: list[float], *, start: float = 0.0) -> float:
    """Reports of node-1, its clock `offset_s` ahead, each taking its transit; the monotonic time after them."""
    now = start
    for transit in transits_s:
        received = T0 + timedelta(seconds=now + transit)
        clocks.saw("node-1", T0 + timedelta(seconds=now + offset_s), received, now=now + transit)
        now += 1.0
    return now


def test_the_offset_is_the_clock_error_less_the_shortest_transit() -> None:
    clocks = NodeClocks()
    feed(clocks, 2.0, [0.3, 0.01, 0.8])
    assert abs(clocks.offset_s("node-1") - 1.99) < 1e-6
    event = T0 + timedelta(seconds=12)
    assert clocks.corrected("node-1", event) == event - timedelta(seconds=clocks.offset_s("node-1"))


def test_a_clock_behind_is_corrected_forward() -> None:
    clocks = NodeClocks()
    feed(clocks, -3.0, [0.02, 0.5])
    assert abs(clocks.offset_s("node-1") + 3.02) < 1e-6


def test_offsets_within_the_trust_band_and_unknown_nodes_are_left_alone() -> None:
    clocks = NodeClocks()
    feed(clocks, TRUST_S - 0.05, [0.0, 0.0])
    assert clocks.offset_s("node-1") == 0.0
    assert clocks.offset_s("node-2") == 0.0
    assert clocks.corrected("node-2", T0) == T0


def test_a_clock_stepped_back_is_followed_within_two_buckets() -> None:
    clocks = NodeClocks()
    now = feed(clocks, 5.0, [0.01] * 3)
    assert clocks.offset_s("node-1") > 4.9
    now = feed(clocks, 0.0, [0.01] * int(BUCKET_S), start=now + BUCKET_S)  # NTP stepped it right
    assert clocks.offset_s("node-1") > 4.9  # the previous bucket still holds the old offset
    feed(clocks, 0.0, [0.01] * int(BUCKET_S), start=now)
    assert clocks.offset_s("node-1") == 0.0
