"""`python -m reprise_detector` as a real process: it serves, is ready, and stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from reprise_cli.servers import NatsServer, free_port

from .conftest import ADMIN_HEADERS, ADMIN_KEY


def test_the_service_runs_and_stops_on_sigterm(nats_server: NatsServer, tmp_path: Path) -> None:
    port = free_port()
    env = {
        **os.environ,
        "REPRISE_NATS_URL": nats_server.url,
        "REPRISE_DATABASE_URL": f"sqlite:///{tmp_path / 'detector.db'}",
        "REPRISE_HTTP_PORT": str(port),
        "REPRISE_LOG_FORMAT": "json",
        "REPRISE_ADMIN_API_KEY": ADMIN_KEY,
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "reprise_detector"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 20
        ready = None
        while time.monotonic() < deadline:
            try:
                ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1)
                if ready.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        assert ready is not None and ready.status_code == 200, ready
        assert httpx.get(f"http://127.0.0.1:{port}/v1/incidents", headers=ADMIN_HEADERS, timeout=2).json() == {
            "data": [],
            "count": 0,
        }
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal it caught, as a supervisor expects.
        assert proc.wait(timeout=15) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = proc.stdout.read().decode() if proc.stdout else ""
    print(output)
    assert '"service": "detector"' in output
    assert "Application shutdown complete" in output
