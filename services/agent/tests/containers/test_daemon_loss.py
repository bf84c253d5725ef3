"""The Docker daemon killed and restarted under a running containerized rank (a daemon of this test's own): the rank
trains on while the daemon is away, and the restarted daemon (no live restore) ends its container, whose end is
reported once: with the daemon's word (its stop's SIGTERM) when it answers first, else as a SIGKILL found from the
container's init."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from reprise_agent.launch.containers import ContainerEngine
from reprise_cli.dockerd import DockerDaemon
from reprise_common.procs import process_alive

from .conftest import PYTHON, Engine
from .test_container_launcher import ENV, engine_for, job

TICKER = "import time\nwhile True:\n    print('tick', flush=True)\n    time.sleep(0.2)\n"


async def test_a_rank_outlives_its_daemons_death_and_the_restarted_daemon_ends_it(
    docker_engine: Engine, tmp_path: Path
) -> None:
    daemon = DockerDaemon(tmp_path / "dockerd")
    daemon.start()
    try:
        engine: ContainerEngine = engine_for(docker_engine, tmp_path)
        engine.base_url = daemon.url
        await asyncio.to_thread(_import_image, docker_engine, daemon)
        handle = await engine.for_job(job(docker_engine.image)).start(
            [PYTHON, "-c", TICKER], env=ENV, cwd=None, warm=False
        )
        assert await asyncio.wait_for(handle.output.readline(), 30) == b"tick\n"

        assert daemon.process is not None
        daemon.process.signal(signal.SIGKILL)
        await asyncio.sleep(2.0)
        assert process_alive(handle.pid) and handle.returncode is None  # no daemon, and the rank trains on

        await asyncio.to_thread(daemon.start)
        # The daemon's own stop when it answered before the init's end was seen; else a kill, as far as anyone could
        # tell then. Either way one exit.
        assert await asyncio.wait_for(handle.wait(), 60) in (-signal.SIGTERM, -signal.SIGKILL)
    finally:
        daemon.stop()


def _import_image(source: Engine, daemon: DockerDaemon) -> None:
    """The session's base image in this test's own daemon (from the cache: no build)."""
    from reprise_cli.dockerd import ensure_base_image

    assert ensure_base_image(daemon.url) == source.image
