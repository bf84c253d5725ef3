"""listening_ports: a process's listening TCP ports read from /proc, also while the process opens and closes files.

The kubernetes cases find a pod's agent by the port it listens on. A descriptor closed between the listing of
/proc/<pid>/fd and its readlink made the whole read come back empty, and the case took the agent for gone (a CI run:
"no pod's agent listens on node node-3" while its rank trained there).
"""

from __future__ import annotations

import subprocess
import sys

from reprise_cli.kube_cluster import listening_ports

CHURNING = """
import socket
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen()
print(server.getsockname()[1], flush=True)
while True:
    open("/proc/self/stat").close()
"""
READS = 500


def test_a_process_busy_opening_files_is_read_with_its_listening_port_every_time() -> None:
    process = subprocess.Popen([sys.executable, "-c", CHURNING], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        port = int(process.stdout.readline())
        found = [listening_ports(process.pid) for _ in range(READS)]
        assert sum(ports != [port] for ports in found) == 0, [p for p in found if p != [port]][:5]
    finally:
        process.kill()
        process.wait()
    assert listening_ports(process.pid) == []  # gone: nothing, and no error
