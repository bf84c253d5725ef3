"""Fixtures of the partition cases: each node on a namespaced host of its own (cli/reprise_cli/netns.py), the
platform's servers on the hosts' gateway, and a real DDP job whose ranks train over the hosts' data link.

Skipped, with the reason, where namespaced hosts cannot run (not root, no iproute2 or iptables). Every namespace,
link and rule a test made is removed after it, failed or not; a run that was killed is swept at the next start.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from reprise_cli.netns import HostNetwork, NamespacedStack, netns_unavailable_reason, sweep_abandoned
from reprise_cli.topology import StackConfig, node_ids

from .harness import PartitionedJob, submit_training

UNAVAILABLE = netns_unavailable_reason()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every case here skips with the same reason where namespaced hosts cannot run; the long ones (marked chaos)
    run only when the chaos cases are asked for (`make chaos`: -m chaos), to keep `make test` to a few minutes."""
    chaos_asked = "chaos" in (config.option.markexpr or "")
    for item in items:
        if Path(str(item.path)).parent != Path(__file__).parent:
            continue
        if UNAVAILABLE is not None:
            item.add_marker(pytest.mark.skip(reason=f"partition cases not run: {UNAVAILABLE}"))
        elif item.get_closest_marker("chaos") and not chaos_asked:
            item.add_marker(pytest.mark.skip(reason="a long partition case: run by `make chaos` (-m chaos)"))


def _destroy(network: HostNetwork) -> None:
    """Remove the network and fail the test if anything of it is left."""
    network.destroy()
    left = network.leftovers()
    assert not left, f"the namespaced hosts left {left} behind"


@pytest.fixture
def host_network() -> Iterator[HostNetwork]:
    """Two bare namespaced hosts, "a" and "b", destroyed after the test."""
    sweep_abandoned()
    network = HostNetwork.create(["a", "b"])
    try:
        yield network
    finally:
        _destroy(network)


@pytest.fixture(scope="module")
def partitioned_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NamespacedStack]:
    """`reprise up` on free ports with node-1, node-2 and spare-1 each on a host of its own (two simulated GPUs
    each); the servers and services in this namespace, on the hosts' gateway. One per module: its cases run in
    order on it (a stack and a job take a minute to start on a small machine)."""
    sweep_abandoned()
    config = StackConfig(nodes=2, spares=1, gpus_per_node=2, state_dir=tmp_path_factory.mktemp("stack") / "state")
    network = HostNetwork.create([node for node, _spare in node_ids(config)])
    stack = NamespacedStack(replace(config, host=network.gateway), free_ports=True, network=network)
    try:
        stack.start(timeout_s=90)
        yield stack
    finally:
        try:
            stack.stop()
        finally:
            _destroy(network)


@pytest.fixture(scope="module")
def training(partitioned_stack: NamespacedStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PartitionedJob]:
    """The DDP example on node-1 and node-2 (one rank each, gloo over the data link), past its first steps."""
    job = submit_training(partitioned_stack, tmp_path_factory.mktemp("job"))
    try:
        yield job
    finally:
        job.close()
