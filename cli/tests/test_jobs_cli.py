"""`reprise job` against a running orchestrator (a real process with real NATS, Redis, SQLite and two agents)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
from sqlmodel import Session

from reprise_cli.client import PlatformClient
from reprise_cli.creds import admin_api_key_file, ensure_admin_api_key
from reprise_cli.jobs_cli import resolve_target
from reprise_cli.main import main
from reprise_cli.redis_server import RedisServer
from reprise_cli.servers import ManagedProcess, NatsServer, free_port, wait_until
from reprise_common.db import make_engine
from reprise_common.events import Category, Culprit, IncidentChange, RecommendedAction, Severity
from reprise_orchestrator.jobs.models import Job
from reprise_orchestrator.recoveries import service as recoveries
from reprise_orchestrator.recoveries.models import Recovery
from reprise_orchestrator.recoveries.records import StepRecord
from reprise_orchestrator.recoveries.states import RecoveryStep

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "jobs" / "ticker.yaml"
NODES = ("node-1", "node-2")


@dataclass(frozen=True)
class Platform:
    """The running orchestrator, the state dir holding its admin key, and its database."""

    url: str
    state_dir: Path
    admin_key: str
    database_url: str


def _processes(root: Path, nats: NatsServer, redis: RedisServer, key: str, port: int) -> list[ManagedProcess]:
    command = Path(sys.executable).parent
    orchestrator = ManagedProcess(
        "orchestrator",
        [str(command / "reprise-orchestrator")],
        root / "orchestrator.log",
        {
            "REPRISE_HTTP_PORT": str(port),
            "REPRISE_NATS_URL": nats.url,
            "REPRISE_REDIS_URL": redis.url,
            "REPRISE_DATABASE_URL": f"sqlite:///{root / 'orchestrator.db'}",
            "REPRISE_REGISTRY_URL": f"http://127.0.0.1:{free_port()}",  # none there: no recovery runs here
            "REPRISE_STATE_DIR": str(root / "orchestrator"),
            "REPRISE_ADMIN_API_KEY": key,
            "REPRISE_LOG_FORMAT": "text",
        },
    )
    agents = [
        ManagedProcess(
            f"agent-{node}",
            [str(command / "reprise-agent")],
            root / f"agent-{node}.log",
            {
                "REPRISE_NODE_ID": node,
                "REPRISE_NATS_URL": nats.url,
                "REPRISE_HTTP_PORT": str(free_port()),
                "REPRISE_STATE_DIR": str(root / node),
                "REPRISE_GPU_BACKEND": "sim",
                "REPRISE_GPU_COUNT": "2",
                "REPRISE_LOG_FORMAT": "text",
            },
            cwd=ROOT,  # the example job runs .venv/bin/python from where the agents started, as under `reprise up`
        )
        for node in NODES
    ]
    return [orchestrator, *agents]


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    root = tmp_path_factory.mktemp("platform")
    nats = NatsServer(port=free_port(), monitor_port=free_port(), store_dir=root / "nats", log_path=root / "nats.log")
    redis = RedisServer(port=free_port(), data_dir=root / "redis", log_path=root / "redis.log")
    state = root / "state"
    key = ensure_admin_api_key(state)  # as `reprise up` does: the state dir's key is the orchestrator's bootstrap key
    port = free_port()
    processes = _processes(root, nats, redis, key, port)
    nats.start()
    redis.start()
    try:
        for process in processes:
            process.start()
        client = PlatformClient(orchestrator=f"http://127.0.0.1:{port}", api_key=key)

        def placeable() -> bool:
            try:
                return sum(not node["stale"] for node in client.nodes()) == len(NODES)
            except httpx.HTTPError:
                return False

        assert wait_until(placeable, timeout_s=60, interval_s=0.2), processes[0].log_tail()
        client.close()
        yield Platform(f"http://127.0.0.1:{port}", state, key, f"sqlite:///{root / 'orchestrator.db'}")
    finally:
        for process in reversed(processes):
            process.stop(grace_s=15.0)
        redis.stop()
        nats.stop()


@pytest.fixture(autouse=True)
def _no_api_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("REPRISE_API_URL", raising=False)
    monkeypatch.delenv("REPRISE_API_KEY", raising=False)


def _job(platform: Platform, *argv: str) -> list[str]:
    return ["job", *argv, "--api-url", platform.url, "--state-dir", str(platform.state_dir)]


def _add_recovery(platform: Platform, job_id: str) -> None:
    """A finished recovery in the orchestrator's database, so `show` has steps to time."""
    start = datetime(2026, 1, 1, tzinfo=UTC)

    def step(name: RecoveryStep, begin: float, end: float | None, **data: object) -> StepRecord:
        finished = None if end is None else start + timedelta(seconds=end)
        return StepRecord.model_validate(
            {"step": name, "started_at": start + timedelta(seconds=begin), "ended_at": finished, "data": data}
        )

    incident = IncidentChange(
        source="detector",
        change="opened",
        incident_id="inc-cli",
        job_id=job_id,
        category=Category.APPLICATION,
        severity=Severity.CRITICAL,
        root_cause="rank 1 exited with exit code 1",
        culprit=Culprit(node_id="node-1", rank=1, exit_code=1),
        recommended_action=RecommendedAction.RESTART_JOB,
        first_symptom_at=start,
    )

    engine = make_engine(platform.database_url)
    with Session(engine) as session:
        assert session.get(Job, job_id) is not None  # the recovery's job, as the orchestrator stored it
        recovery = Recovery(
            id="rec-cli", job_id=job_id, fence=1, owner="test", step=RecoveryStep.LAUNCHING, started_at=start
        )
        steps = [
            step(RecoveryStep.DETECTED, 0, 0.25, **incident.model_dump()),
            step(RecoveryStep.STOPPING_RANKS, 0.25, 1.75),
            step(RecoveryStep.LAUNCHING, 1.75, None),
        ]
        recoveries.insert_claimed(session, recovery=recovery, steps=steps)
        session.commit()
    engine.dispose()


def test_submit_list_show_cancel(platform: Platform, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_job(platform, "submit", str(EXAMPLE))) == 0
    submitted = capsys.readouterr().out
    job_id = submitted.split()[1]
    assert submitted.startswith(f"job {job_id} running on node-1, node-2 (4 ranks)"), submitted

    assert main(_job(platform, "list")) == 0
    listed = capsys.readouterr().out
    assert any(line.startswith(job_id) and "ticker" in line and "running" in line for line in listed.splitlines())
    assert main(_job(platform, "list", "--state", "failed")) == 0
    assert job_id not in capsys.readouterr().out

    _add_recovery(platform, job_id)
    assert main(_job(platform, "show", job_id)) == 0
    shown = capsys.readouterr().out
    assert f"job {job_id}  ticker  running" in shown
    assert "recovery rec-cli  launching" in shown
    durations = [line.split() for line in shown.splitlines() if line.startswith("    ") and "step" not in line]
    assert durations[-3:] == [["detected", "0.250"], ["stopping_ranks", "1.500"], ["launching", "running"]]

    assert main(_job(platform, "cancel", job_id)) == 0
    assert capsys.readouterr().out.strip() == f"job {job_id} cancelled"
    assert main(_job(platform, "show", job_id)) == 0
    assert f"job {job_id}  ticker  cancelled" in capsys.readouterr().out


def test_a_bad_job_file_shows_each_field_error(
    platform: Platform, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: ''\nnode_count: 0\ncommand: []\n")
    assert main(_job(platform, "submit", str(bad))) == 1
    err = capsys.readouterr().err
    assert "the API refused the job spec (HTTP 422):" in err
    for field in ("name", "node_count", "command"):
        assert f"\n  {field}: " in err, err

    ambiguous = tmp_path / "ambiguous.yaml"
    ambiguous.write_text("name: x\ncommand: ['true']\n")
    assert main(_job(platform, "submit", str(ambiguous))) == 1
    assert "(the job as a whole): Value error, give exactly one of nodes" in capsys.readouterr().err

    for content, message in (("name: [unclosed\n", "is not valid YAML"), ("- a list\n", "must be a mapping")):
        bad.write_text(content)
        assert main(_job(platform, "submit", str(bad))) == 2
        assert message in capsys.readouterr().err
    assert main(_job(platform, "submit", str(tmp_path / "missing.yaml"))) == 2
    assert "cannot read" in capsys.readouterr().err


def test_key_from_flag_env_or_state_dir(
    platform: Platform, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "no-stack"
    base = ["job", "list", "--api-url", platform.url]
    assert main([*base, "--state-dir", str(empty)]) == 1
    assert "missing API key" in capsys.readouterr().err
    assert main([*base, "--state-dir", str(platform.state_dir)]) == 0
    assert main([*base, "--state-dir", str(empty), "--api-key", platform.admin_key]) == 0

    reader = httpx.post(
        f"{platform.url}/v1/api-keys",
        json={"name": "cli-reader", "scopes": ["read"]},
        headers={"Authorization": f"Bearer {platform.admin_key}"},
    ).json()["key"]
    monkeypatch.setenv("REPRISE_API_URL", platform.url)
    monkeypatch.setenv("REPRISE_API_KEY", reader)
    capsys.readouterr()
    assert main(["job", "list", "--state-dir", str(platform.state_dir)]) == 0  # the env var wins over the state dir
    assert main(["job", "submit", str(EXAMPLE), "--state-dir", str(platform.state_dir)]) == 1
    assert "API key 'cli-reader' lacks the 'operate' scope" in capsys.readouterr().err


def test_defaults_are_the_local_stack(tmp_path: Path) -> None:
    args = argparse.Namespace(api_url=None, api_key=None, state_dir=str(tmp_path))
    assert resolve_target(args, environ={}).url == "http://127.0.0.1:8730"
    assert resolve_target(args, environ={}).api_key is None
    key = ensure_admin_api_key(tmp_path)
    assert resolve_target(args, environ={}).api_key == key
    assert admin_api_key_file(tmp_path).stat().st_mode & 0o777 == 0o600
    assert ensure_admin_api_key(tmp_path) == key  # created once


def test_unknown_job_and_unreachable_api(platform: Platform, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_job(platform, "show", "job-nope")) == 1
    assert "job job-nope not found (HTTP 404)" in capsys.readouterr().err
    nowhere = f"http://127.0.0.1:{free_port()}"
    assert main(["job", "list", "--api-url", nowhere, "--api-key", "k"]) == 2
    assert f"cannot reach the orchestrator at {nowhere}" in capsys.readouterr().err


def test_labels_in_a_job_file_are_shown_and_filter_the_list(
    platform: Platform, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    labelled = tmp_path / "labelled.yaml"
    labelled.write_text(EXAMPLE.read_text() + "labels:\n  team: ml\n  example.com/tier: gold\n")
    assert main(_job(platform, "submit", str(labelled))) == 0
    job_id = capsys.readouterr().out.split()[1]
    try:
        assert main(_job(platform, "show", job_id)) == 0
        assert "\n  labels     example.com/tier=gold team=ml\n" in capsys.readouterr().out

        assert main(_job(platform, "list", "--label", "team=ml", "--label", "example.com/tier=gold")) == 0
        assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]] == [job_id]
        assert main(_job(platform, "list", "--label", "team=web")) == 0
        assert capsys.readouterr().out.strip() == "no jobs labelled team=web"
        assert main(_job(platform, "list", "--label", "team")) == 1
        assert "label selector 'team': expected key=value" in capsys.readouterr().err
    finally:
        assert main(_job(platform, "cancel", job_id)) == 0

    labelled.write_text(EXAMPLE.read_text() + "labels:\n  team x: ml\n")
    assert main(_job(platform, "submit", str(labelled))) == 1
    assert "\n  labels.team x.[key]: Value error, label key 'team x'" in capsys.readouterr().err
