"""The namespaced hosts themselves: each reaches the gateway over its management link and the other hosts over its
data link; a cut silences exactly the link and direction it names and heals; nothing is left behind."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from reprise_cli.netns import Direction, HostNetwork, Link
from reprise_cli.ports import free_port

CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1).close()"


def reaches(network: HostNetwork, host: str, address: str, port: int) -> bool:
    """True when a TCP connection from inside `host` to address:port is accepted within a second."""
    return network.exec(host, sys.executable, "-c", CONNECT, address, str(port), check=False).returncode == 0


@pytest.fixture
def gateway_listener(host_network: HostNetwork) -> Iterator[int]:
    """A TCP listener on the gateway in this namespace, where the platform's servers listen; its port."""
    server = socket.create_server((host_network.gateway, free_port()))
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                server.accept()[0].close()
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    server.close()


@pytest.fixture
def data_listener(host_network: HostNetwork) -> Iterator[int]:
    """A TCP listener inside host b on its data address; its port."""
    port = free_port()
    b = host_network.hosts["b"]
    serve = (
        f"import socket; s = socket.create_server(('{b.data_ip}', {port})); print('up', flush=True)\n"
        "while True: s.accept()[0].close()"
    )
    proc = subprocess.Popen(b.argv([sys.executable, "-c", serve]), stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
    yield port
    proc.kill()
    proc.wait()


def test_links_cuts_and_heal(host_network: HostNetwork, gateway_listener: int, data_listener: int) -> None:
    net, gateway, b_data = host_network, host_network.gateway, host_network.hosts["b"].data_ip
    assert reaches(net, "a", gateway, gateway_listener) and reaches(net, "a", b_data, data_listener)

    net.cut("a", links=(Link.MANAGEMENT,))  # the control plane is gone, the ranks' link is not
    assert not reaches(net, "a", gateway, gateway_listener)
    assert reaches(net, "a", b_data, data_listener)
    assert reaches(net, "b", gateway, gateway_listener)  # only host a is cut
    net.heal("a")
    assert reaches(net, "a", gateway, gateway_listener)

    for direction in (Direction.IN, Direction.OUT):  # either half of a TCP handshake lost: no connection
        net.cut("a", links=(Link.DATA,), direction=direction)
        assert not reaches(net, "a", b_data, data_listener), direction
        assert reaches(net, "a", gateway, gateway_listener), direction
        net.heal("a")
    assert reaches(net, "a", b_data, data_listener)

    net.cut("b", links=tuple(Link))  # b falls silent on both links, as with a power loss
    assert not reaches(net, "a", b_data, data_listener) and not reaches(net, "b", gateway, gateway_listener)
    net.heal("b", links=(Link.MANAGEMENT,))  # one link back, the other still cut
    assert reaches(net, "b", gateway, gateway_listener) and not reaches(net, "a", b_data, data_listener)
    net.heal("b")
    assert reaches(net, "a", b_data, data_listener) and reaches(net, "b", gateway, gateway_listener)

    net.set_link("a", Link.MANAGEMENT, up=False)
    assert not reaches(net, "a", gateway, gateway_listener)
    net.heal("a")
    assert reaches(net, "a", gateway, gateway_listener)


def test_destroy_removes_everything_even_with_a_process_inside() -> None:
    network = HostNetwork.create(["x", "y"])
    try:
        proc = subprocess.Popen(network.hosts["x"].argv(["sleep", "60"]))
        network.cut("x", links=(Link.MANAGEMENT,))
        assert network.leftovers()  # made, and seen
        assert network.hosts["x"].namespace.endswith("-x") and network.gateway.startswith("10.")
    finally:
        network.destroy()
    assert proc.wait(timeout=5) != 0  # killed by destroy: nothing keeps the namespace alive
    assert network.leftovers() == []
    other = HostNetwork.create(["x"])
    try:
        assert other.token != network.token and other.management != network.management  # a second run does not collide
    finally:
        other.destroy()
