"""reprise_sdk.run in a real subprocess, with a real Unix datagram socket standing in for the agent's two ends.

`short_dir` is sdk/tests/conftest.py's.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from reprise_sdk._inplace import await_rendezvous, peer_failure

SCRIPT = """
import os, sys, time
import reprise_sdk

def train(info):
    print(f"enter rank={info.rank} epoch={info.restart_epoch} pid={os.getpid()}", flush=True)
    if info.restart_epoch >= 1:
        if os.environ.get("FAIL_AFTER") == "bug":
            raise ValueError("the script's own bug")
        return "done"
    if os.environ.get("FAIL_AFTER") == "peer":
        raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
    if os.environ.get("FAIL_AFTER") == "bug":
        raise ValueError("the script's own bug")
    step = 0
    while True:
        step += 1
        try:
            reprise_sdk.heartbeat(step)
        except Exception:
            print("a script's except Exception caught the order", flush=True)
            raise
        time.sleep(0.01)

print("result", reprise_sdk.run(train), flush=True)
"""


class FakeAgent:
    """The agent's SDK socket (what ranks send) and its order socket (what it writes to a rank's inbox)."""

    def __init__(self, directory: Path) -> None:
        self.inbox_dir = directory / "inbox"
        self.inbox_dir.mkdir(mode=0o700)
        self.path = directory / "sdk.sock"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(self.path))
        self.sock.settimeout(20)
        self.orders = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

    def next_of(self, kind: str) -> dict[str, Any]:
        while True:
            message: dict[str, Any] = json.loads(self.sock.recv(256 * 1024))
            if message["k"] == kind:
                return message

    def order(self, pid: int, order: dict[str, Any]) -> None:
        self.orders.sendto(json.dumps(order).encode(), str(self.inbox_dir / f"{pid}.sock"))

    def env(self) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("REPRISE_", "RANK", "WORLD_SIZE"))}
        return {
            **base,
            "REPRISE_SDK_SOCKET": str(self.path),
            "REPRISE_SDK_INBOX_DIR": str(self.inbox_dir),
            "REPRISE_JOB_ID": "job-1",
            "RANK": "2",
            "REPRISE_RESTART_EPOCH": "0",
            "REPRISE_SDK_PARK_S": "20",
        }


def start(agent: FakeAgent, tmp: Path, **env: str) -> subprocess.Popen[str]:
    script = tmp / "rank.py"
    script.write_text(SCRIPT)
    return subprocess.Popen(
        [sys.executable, str(script)],
        env={**agent.env(), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_an_ordered_restart_parks_the_rank_and_the_next_epoch_enters_train_again_in_the_same_process(
    short_dir: Path,
) -> None:
    agent = FakeAgent(short_dir)
    proc = start(agent, short_dir)
    try:
        hello = agent.next_of("inplace")
        assert (hello["job"], hello["rank"], hello["epoch"]) == ("job-1", 2, 0)
        agent.next_of("hb")  # training
        agent.order(proc.pid, {"k": "park"})
        parked = agent.next_of("parked")
        assert parked["why"] == "restart ordered" and parked["epoch"] == 0
        agent.order(proc.pid, {"k": "assign", "env": {"RANK": "5", "REPRISE_RESTART_EPOCH": "1"}})
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert f"enter rank=2 epoch=0 pid={proc.pid}" in out
    assert f"enter rank=5 epoch=1 pid={proc.pid}" in out
    assert "result done" in out
    assert "a script's except Exception caught the order" not in out  # a BaseException: it goes past the script
    assert not list(agent.inbox_dir.iterdir())  # the inbox is removed when run() returns


def test_a_peers_failure_parks_the_rank_and_a_message_of_the_new_epoch_carries_its_new_rank(short_dir: Path) -> None:
    agent = FakeAgent(short_dir)
    proc = start(agent, short_dir, FAIL_AFTER="peer")
    try:
        parked = agent.next_of("parked")
        assert "Connection reset by peer" in parked["why"]
        agent.order(proc.pid, {"k": "assign", "env": {"RANK": "0", "REPRISE_RESTART_EPOCH": "3"}})
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "enter rank=0 epoch=3" in out, out


def test_the_scripts_own_error_ends_the_process_as_before(short_dir: Path) -> None:
    agent = FakeAgent(short_dir)
    proc = start(agent, short_dir, FAIL_AFTER="bug")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 1 and "ValueError: the script's own bug" in out, out
    agent.sock.settimeout(0.2)
    with pytest.raises(TimeoutError):
        agent.next_of("parked")


def test_a_parked_rank_that_gets_no_assignment_in_time_exits_with_the_peers_error(short_dir: Path) -> None:
    agent = FakeAgent(short_dir)
    proc = start(agent, short_dir, FAIL_AFTER="peer", REPRISE_SDK_PARK_S="0.5")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 1 and "Connection reset by peer" in out, out


def test_a_malformed_order_is_ignored(short_dir: Path) -> None:
    agent = FakeAgent(short_dir)
    proc = start(agent, short_dir, FAIL_AFTER="peer")
    try:
        agent.next_of("parked")
        for garbage in (b"not json", b"[]", json.dumps({"k": "assign", "env": {"A=B": "1"}}).encode()):
            agent.orders.sendto(garbage, str(agent.inbox_dir / f"{proc.pid}.sock"))
        agent.order(proc.pid, {"k": "assign", "env": {"RANK": "1", "REPRISE_RESTART_EPOCH": "1"}})
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "enter rank=1 epoch=1" in out, out


def test_outside_reprise_run_is_one_call() -> None:
    import reprise_sdk

    env_before = dict(os.environ)
    os.environ.pop("REPRISE_SDK_INBOX_DIR", None)
    try:
        assert reprise_sdk.run(lambda info: (info.rank, info.restart_epoch)) == (0, 0)
    finally:
        os.environ.clear()
        os.environ.update(env_before)


def test_a_failed_collective_is_told_from_the_scripts_own_errors() -> None:
    reset = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
    assert peer_failure(reset)
    try:
        try:
            raise reset
        finally:
            raise RuntimeError("cleanup failed")
    except RuntimeError as during:
        assert peer_failure(during)
    assert not peer_failure(RuntimeError("Tensors must be contiguous"))
    assert not peer_failure(ValueError("Connection reset by peer"))  # not what a collective raises


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_rank_other_than_0_waits_for_rank_0s_store_before_it_joins() -> None:
    """torch's store client backs off for about half a second when nobody listens yet; waiting here avoids that."""
    port = _free_port()
    env = {"RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    listener = socket.socket()
    listening = threading.Event()

    def store_comes_up_late() -> None:
        time.sleep(0.3)
        listener.bind(("127.0.0.1", port))
        listener.listen()
        listening.set()

    threading.Thread(target=store_comes_up_late, daemon=True).start()
    with listener:
        assert await_rendezvous(env, within_s=20) is True
        assert listening.is_set()  # it returned because the store listens, not because it gave up
        listener.settimeout(5)
        accepted, _ = listener.accept()  # the probe's connection reached rank 0's listener
        accepted.close()


def test_rank_0_a_world_of_one_and_an_unusable_address_do_not_wait() -> None:
    port = str(_free_port())
    base = {"WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    assert await_rendezvous({**base, "RANK": "0"}) is False
    assert await_rendezvous({**base, "RANK": "1", "WORLD_SIZE": "1"}) is False
    assert await_rendezvous({**base, "RANK": "1", "MASTER_PORT": "99999"}) is False
    assert await_rendezvous({**base, "RANK": "1", "MASTER_ADDR": ""}) is False


def test_the_wait_for_rank_0s_store_is_bounded() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    started = time.monotonic()
    assert await_rendezvous(env, within_s=0.2) is False  # nobody listens: torch's own connect takes over
    assert time.monotonic() - started < 15  # a generous ceiling: only that it gives up, not how fast


NCCL_SCRIPT = """
import os, socket
import torch
import torch.distributed as dist
import reprise_sdk

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def train(info):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="1", RANK="0")
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    total = torch.full((1024,), float(info.restart_epoch + 1), device="cuda")
    dist.all_reduce(total)
    torch.cuda.synchronize()
    print(f"epoch={info.restart_epoch} pid={os.getpid()} sum={total.sum().item():.0f}", flush=True)
    if info.restart_epoch >= 1:
        dist.destroy_process_group()
        return "done"
    step = 0
    while True:
        step += 1
        reprise_sdk.heartbeat(step)
        dist.all_reduce(total)

print("result", reprise_sdk.run(train), flush=True)
"""


@pytest.mark.gpu
def test_an_nccl_group_is_aborted_at_a_park_and_a_new_one_built_in_the_same_process(short_dir: Path) -> None:
    """The NCCL path of in-place restart on a real GPU: at a park `run` aborts the NCCL process group (not a plain
    destroy, which can wait on a collective a dead peer never joins), and the next epoch builds a new one in the same
    process. One GPU holds one NCCL rank, so the group is a world of one."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or not torch.distributed.is_nccl_available():
        pytest.skip("needs a CUDA GPU and NCCL")
    agent = FakeAgent(short_dir)
    script = short_dir / "rank.py"
    script.write_text(NCCL_SCRIPT)
    env = {**agent.env(), "RANK": "0"}
    proc = subprocess.Popen(
        [sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    agent.sock.settimeout(60)  # importing torch with CUDA, and NCCL's first communicator, take a while
    try:
        agent.next_of("inplace")
        agent.next_of("hb")  # training, collectives running
        agent.order(proc.pid, {"k": "park"})
        assert agent.next_of("parked")["why"] == "restart ordered"
        agent.order(proc.pid, {"k": "assign", "env": {"RANK": "0", "REPRISE_RESTART_EPOCH": "1"}})
        out, _ = proc.communicate(timeout=40)
    except (TimeoutError, subprocess.TimeoutExpired, AssertionError):
        proc.kill()
        raise AssertionError(proc.communicate()[0]) from None
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert f"epoch=0 pid={proc.pid} sum=1024" in out and f"epoch=1 pid={proc.pid} sum=2048" in out, out
    assert "not torn down cleanly" not in out, out  # the abort itself worked
    assert "result done" in out, out
