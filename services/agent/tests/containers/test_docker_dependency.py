"""The agent's own Docker daemon as a dependency: checked without being configured, its loss a dependency failure
(the detector asks a human), against a real dockerd and a socket where none answers."""

from __future__ import annotations

from pathlib import Path

import pytest

from reprise_agent.depchecks.checker import DependencyChecker
from reprise_agent.depchecks.specs import DockerCheck, HttpCheck, with_docker
from reprise_common.clock import ManualClock

from .conftest import Engine


async def test_the_agents_daemon_answers_and_a_missing_one_is_a_failure(docker_engine: Engine, tmp_path: Path) -> None:
    gone = f"unix://{tmp_path / 'nobody.sock'}"
    checker = DependencyChecker(
        [DockerCheck(name="docker", url=docker_engine.url), DockerCheck(name="gone", url=gone, timeout_s=1)],
        clock=ManualClock(),
    )
    results = {r.name: r for r in await checker.run_once()}
    assert results["docker"].ok and "answered its ping" in results["docker"].detail
    assert not results["gone"].ok and "is unreachable" in results["gone"].detail
    assert [edge.name for edge in await checker.poll()] == ["gone"]  # one failure edge, reported once


def test_an_agent_with_a_daemon_checks_it_unless_the_operator_already_does() -> None:
    configured = [HttpCheck(url="http://s3.local/health")]
    added = with_docker(configured, "unix:///run/reprise/docker.sock")
    assert [(s.kind, s.name) for s in added] == [("http", "http:http://s3.local/health"), ("docker", "docker")]
    own = [DockerCheck(name="mine", url="tcp://10.0.0.9:2375")]
    assert with_docker(own, "unix:///run/reprise/docker.sock") == own
    assert with_docker(configured, None) == configured


@pytest.mark.parametrize("url", ["/var/run/docker.sock", "http://docker", ""])
def test_a_docker_check_needs_a_unix_or_tcp_url(url: str) -> None:
    with pytest.raises(ValueError, match="url"):
        DockerCheck(url=url)
