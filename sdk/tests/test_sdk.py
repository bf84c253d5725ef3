"""The SDK against a real Unix datagram socket standing in for the agent, and in real subprocesses."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

RANK_ENV = {
    "RANK": "3",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "8",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.0.0.7",
    "MASTER_PORT": "29612",
    "REPRISE_JOB_ID": "job-7",
    "REPRISE_NODE_ID": "node-2",
    "REPRISE_RESTART_EPOCH": "4",
    "REPRISE_RESUME_CHECKPOINT": "/ckpt/job-7/step-1200",
}
ALL_ENV = [*RANK_ENV, "REPRISE_SDK_SOCKET", "REPRISE_SDK_INTERVAL_S", "REPRISE_SKIP_STEPS"]


class Agent:
    """The agent's end of the socket, reduced to receiving datagrams."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(5)

    def receive(self, count: int) -> list[dict[str, Any]]:
        return [json.loads(self.sock.recv(256 * 1024)) for _ in range(count)]

    def nothing_waiting(self) -> bool:
        self.sock.settimeout(0.05)
        try:
            self.sock.recv(256 * 1024)
        except TimeoutError:
            return True
        finally:
            self.sock.settimeout(5)
        return False

    def close(self) -> None:
        self.sock.close()
        self.path.unlink(missing_ok=True)


@pytest.fixture
def agent(short_dir: Path) -> Iterator[Agent]:
    receiver = Agent(short_dir / "sdk.sock")
    yield receiver
    receiver.close()


@pytest.fixture
def sdk(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., ModuleType]]:
    """Configure the environment, then give the SDK, reset so that it reads that environment afresh."""
    import reprise_sdk
    from reprise_sdk import _client

    def configure(**env: str) -> ModuleType:
        for name in ALL_ENV:
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        _client._reset()
        return reprise_sdk

    yield configure
    _client._reset()


def test_outside_reprise_every_call_is_a_no_op(sdk: Callable[..., ModuleType]) -> None:
    reprise_sdk = sdk()
    for step in range(1000):
        reprise_sdk.heartbeat(step, loss=0.5)
    with reprise_sdk.phase("checkpointing"):
        reprise_sdk.checkpoint_saved("/ckpt/1", 1, ["/ckpt/1/a"])
    assert reprise_sdk.stats() == reprise_sdk.SdkStats(enabled=False, sent=0, dropped=0)
    info = reprise_sdk.resume()
    assert (info.job_id, info.rank, info.world_size, info.checkpoint) == ("", 0, 1, None)


def test_heartbeats_arrive_at_the_agent_as_json(sdk: Callable[..., ModuleType], agent: Agent) -> None:
    reprise_sdk = sdk(**RANK_ENV, REPRISE_SDK_SOCKET=str(agent.path), REPRISE_SDK_INTERVAL_S="0")
    before = time.time_ns()
    reprise_sdk.heartbeat(11)
    reprise_sdk.heartbeat(12, loss=0.25, lr=3e-4, grad_norm=float("nan"), tokens=1_234_567_890)
    first, second = agent.receive(2)
    assert first == {
        "v": 1,
        "job": "job-7",
        "rank": 3,
        "epoch": 4,
        "k": "hb",
        "step": 11,
        "t_ns": first["t_ns"],
        "phase": "",
    }
    assert before <= first["t_ns"] <= second["t_ns"] <= time.time_ns()
    assert second["step"] == 12
    metrics = second["m"]
    assert metrics["loss"] == 0.25 and metrics["lr"] == 3e-4 and metrics["tokens"] == 1_234_567_890
    assert metrics["grad_norm"] != metrics["grad_norm"]  # NaN survives: a diverging loss is worth seeing
    assert reprise_sdk.stats() == reprise_sdk.SdkStats(enabled=True, sent=2, dropped=0)


def test_heartbeats_within_the_interval_ride_on_the_next_message(sdk: Callable[..., ModuleType], agent: Agent) -> None:
    reprise_sdk = sdk(**RANK_ENV, REPRISE_SDK_SOCKET=str(agent.path), REPRISE_SDK_INTERVAL_S="60")
    for step in range(1, 6):
        reprise_sdk.heartbeat(step, loss=1.0 / step)
    assert agent.receive(1)[0]["step"] == 1
    assert agent.nothing_waiting()
    reprise_sdk.phase("eval")  # the held-back step must reach the agent before the phase changes
    held, phase = agent.receive(2)
    assert (held["k"], held["step"], held["m"], held["phase"]) == ("hb", 5, {"loss": 0.2}, "")
    assert (phase["k"], phase["phase"]) == ("phase", "eval")


def test_a_first_non_finite_value_is_sent_at_once_never_coalesced_away(
    sdk: Callable[..., ModuleType], agent: Agent
) -> None:
    reprise_sdk = sdk(**RANK_ENV, REPRISE_SDK_SOCKET=str(agent.path), REPRISE_SDK_INTERVAL_S="60")
    reprise_sdk.heartbeat(1, loss=2.0)
    reprise_sdk.heartbeat(2, loss=1.9)  # held back
    reprise_sdk.heartbeat(3, loss=float("nan"), lr=1e-3)  # the step a numeric fault began at: sent now
    reprise_sdk.heartbeat(4, loss=float("inf"))  # still not finite: held back as usual
    first, fault = agent.receive(2)
    assert (first["step"], fault["step"]) == (1, 3)
    assert fault["m"]["loss"] != fault["m"]["loss"] and fault["m"]["lr"] == 1e-3
    assert agent.nothing_waiting()
    reprise_sdk.heartbeat(5, loss=1.0)  # finite again: held back
    reprise_sdk.heartbeat(6, loss=float("-inf"))  # a new first non-finite value
    assert agent.receive(1)[0]["step"] == 6


def test_phase_context_restores_the_previous_phase_even_on_error(sdk: Callable[..., ModuleType], agent: Agent) -> None:
    reprise_sdk = sdk(**RANK_ENV, REPRISE_SDK_SOCKET=str(agent.path), REPRISE_SDK_INTERVAL_S="0")
    reprise_sdk.phase("warmup")
    with pytest.raises(RuntimeError), reprise_sdk.phase("checkpointing"):
        reprise_sdk.heartbeat(3)
        with reprise_sdk.phase("upload"):
            pass
        raise RuntimeError("disk full")
    reprise_sdk.heartbeat(4)
    messages = agent.receive(7)
    assert [(m["k"], m["phase"]) for m in messages] == [
        ("phase", "warmup"),
        ("phase", "checkpointing"),
        ("hb", "checkpointing"),
        ("phase", "upload"),
        ("phase", "checkpointing"),
        ("phase", "warmup"),
        ("hb", "warmup"),
    ]


def test_checkpoint_saved_reports_path_step_and_files(sdk: Callable[..., ModuleType], agent: Agent) -> None:
    reprise_sdk = sdk(**RANK_ENV, REPRISE_SDK_SOCKET=str(agent.path))
    reprise_sdk.checkpoint_saved(Path("/ckpt/job-7/step-1300"), 1300, [Path("/ckpt/job-7/step-1300/rank-00003.pt")])
    (message,) = agent.receive(1)
    assert message["k"] == "ckpt"
    assert (message["job"], message["rank"], message["epoch"], message["step"]) == ("job-7", 3, 4, 1300)
    assert message["path"] == "/ckpt/job-7/step-1300"
    assert message["files"] == ["/ckpt/job-7/step-1300/rank-00003.pt"]


def test_agent_absent_then_back_drops_are_counted_never_raised(
    sdk: Callable[..., ModuleType], short_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = short_dir / "late.sock"
    reprise_sdk = sdk(**RANK_ENV, REPRISE_SDK_SOCKET=str(path), REPRISE_SDK_INTERVAL_S="0")
    for step in range(100):
        reprise_sdk.heartbeat(step)
    reprise_sdk.phase("eval")
    reprise_sdk.checkpoint_saved("/ckpt/1", 1)
    assert reprise_sdk.stats() == reprise_sdk.SdkStats(enabled=True, sent=0, dropped=102)
    assert capsys.readouterr().err.count("unreachable") == 1  # said once, not per message

    late = Agent(path)  # the agent starts (or restarts) on the same path: the SDK finds it again
    try:
        time.sleep(0.6)  # past the re-connect interval
        reprise_sdk.heartbeat(100)
        assert late.receive(1)[0]["step"] == 100
    finally:
        late.close()
    reprise_sdk.heartbeat(101)  # and gone again
    assert reprise_sdk.stats().dropped == 103


def test_a_full_agent_queue_drops_heartbeats_without_blocking(sdk: Callable[..., ModuleType], agent: Agent) -> None:
    reprise_sdk = sdk(**RANK_ENV, REPRISE_SDK_SOCKET=str(agent.path), REPRISE_SDK_INTERVAL_S="0")
    for step in range(200):  # the agent reads nothing: the kernel queue fills after a few datagrams
        reprise_sdk.heartbeat(step)
    stats = reprise_sdk.stats()
    assert stats.sent + stats.dropped == 200
    assert stats.dropped > 150
    assert agent.receive(1)[0]["step"] == 0


def test_invalid_arguments_are_dropped_and_named_once(
    sdk: Callable[..., ModuleType], agent: Agent, capsys: pytest.CaptureFixture[str]
) -> None:
    reprise_sdk = sdk(**RANK_ENV, REPRISE_SDK_SOCKET=str(agent.path), REPRISE_SDK_INTERVAL_S="0")
    reprise_sdk.heartbeat(1.5)
    reprise_sdk.heartbeat(2.5)
    reprise_sdk.heartbeat(3, loss="low")
    reprise_sdk.checkpoint_saved("/ckpt", "latest")
    reprise_sdk.heartbeat(4)
    assert agent.receive(1)[0]["step"] == 4
    assert reprise_sdk.stats() == reprise_sdk.SdkStats(enabled=True, sent=1, dropped=4)
    err = capsys.readouterr().err
    assert err.count("reprise_sdk: message dropped") == 2  # one ValueError, one TypeError
    assert "'d'" in err and "real number" in err


def test_resume_reads_what_the_agent_set(sdk: Callable[..., ModuleType]) -> None:
    reprise_sdk = sdk(**RANK_ENV)
    assert reprise_sdk.resume() == reprise_sdk.ResumeInfo(
        job_id="job-7",
        node_id="node-2",
        rank=3,
        local_rank=1,
        world_size=8,
        local_world_size=2,
        restart_epoch=4,
        checkpoint="/ckpt/job-7/step-1200",
        master_addr="10.0.0.7",
        master_port=29612,
    )


@pytest.mark.parametrize(
    ("raw", "span", "step_skipped"),
    [("", None, False), ("57-59", (57, 59), True), ("57", (57, 57), False), (" 12-12 ", (12, 12), False)],
)
def test_resume_reads_the_steps_whose_data_to_skip(
    sdk: Callable[..., ModuleType], raw: str, span: tuple[int, int] | None, step_skipped: bool
) -> None:
    info = sdk(**{**RANK_ENV, "REPRISE_SKIP_STEPS": raw}).resume()
    assert info.skip_steps == span
    assert info.skips(58) is step_skipped and not info.skips(60)


@pytest.mark.parametrize("raw", ["x-3", "5-3", "-1-2", "3-"])
def test_resume_names_a_malformed_skip_span(sdk: Callable[..., ModuleType], raw: str) -> None:
    with pytest.raises(ValueError, match="REPRISE_SKIP_STEPS"):
        sdk(**{**RANK_ENV, "REPRISE_SKIP_STEPS": raw}).resume()


def test_resume_without_a_checkpoint_starts_fresh(sdk: Callable[..., ModuleType]) -> None:
    reprise_sdk = sdk(**{**RANK_ENV, "REPRISE_RESUME_CHECKPOINT": ""})
    assert reprise_sdk.resume().checkpoint is None


def test_resume_names_a_malformed_variable(sdk: Callable[..., ModuleType]) -> None:
    reprise_sdk = sdk(**{**RANK_ENV, "WORLD_SIZE": "eight"})
    with pytest.raises(ValueError, match="WORLD_SIZE='eight'"):
        reprise_sdk.resume()


def run_script(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ALL_ENV}
    return subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, timeout=60, check=True
    )


def test_importing_the_sdk_never_imports_torch() -> None:
    done = run_script("import sys, reprise_sdk; reprise_sdk.heartbeat(1); print('torch' in sys.modules)", {})
    assert done.stdout.strip() == "False"


def test_a_held_back_heartbeat_is_sent_when_the_script_ends(agent: Agent) -> None:
    code = "import reprise_sdk\nfor step in range(1, 8):\n    reprise_sdk.heartbeat(step)\n"
    run_script(code, {**RANK_ENV, "REPRISE_SDK_SOCKET": str(agent.path), "REPRISE_SDK_INTERVAL_S": "60"})
    assert [m["step"] for m in agent.receive(2)] == [1, 7]
