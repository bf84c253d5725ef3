"""`reprise up` as a user runs it: real servers and services as processes, readiness, Ctrl-C, NATS outage.

Also the walking skeleton: an injected XID 79 travels agent → detector → orchestrator → agents → registry.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from reprise_cli.client import poll
from reprise_cli.creds import ensure_redis_password, read_admin_api_key
from reprise_cli.redis_server import REDIS_USER
from reprise_cli.servers import free_stack_ports
from reprise_cli.stack import Stack
from reprise_cli.topology import DEFAULT_PORTS
from reprise_common.events import FaultKind, InjectFault
from reprise_common.procs import process_alive

pytestmark = pytest.mark.stack


def test_walking_skeleton_xid79_to_fenced_recovery(stack: Stack) -> None:
    client = stack.client()
    try:
        nodes = poll(client.nodes, lambda n: len(n) == 3, timeout_s=15)
        assert {n["node_id"] for n in nodes} == {"node-1", "node-2", "spare-1"}
        job = client.submit_job(name="skeleton", node_count=2, ranks_per_node=2)
        assert job["state"] == "running"
        assert {r["node_id"] for r in job["placement"]} == {"node-1", "node-2"}  # spares are not used for new jobs

        reply = client.inject(InjectFault(kind=FaultKind.XID, gpu=1, xid=79), node_id="node-2")
        assert reply.accepted and "killed rank 3" in reply.detail

        incidents = poll(lambda: client.incidents(job["id"]), bool, timeout_s=15)
        assert len(incidents) == 1
        incident = incidents[0]
        assert incident["category"] == "gpu_hardware"
        assert (incident["culprit_node_id"], incident["culprit_gpu"], incident["culprit_rank"]) == ("node-2", 1, 3)

        recoveries = poll(
            lambda: client.recoveries(job["id"]), lambda r: bool(r) and r[0]["step"] == "running", timeout_s=60
        )
        assert len(recoveries) == 1, recoveries
        recovery = recoveries[0]
        assert recovery["incident_id"] == incident["id"]
        assert recovery["fence"] > 1  # the submit took fence 1 under the same lock
        steps = {s["step"]: s for s in recovery["steps"]}
        assert list(steps) == [
            "detected",
            "locked",
            "stopping_ranks",
            "isolating",
            "placing",
            "restoring",
            "launching",
            "verifying",
            "running",
        ], json.dumps(recovery, indent=1)
        assert recovery["outcome"] == "recovered" and recovery["attempt"] == 1
        stop_answers = steps["stopping_ranks"]["data"]["answers"]
        assert stop_answers == {"nodes": 2, "results": {"done": 2}, "duplicates": 0, "not_done": []}, stop_answers
        assert steps["isolating"]["data"]["cordoned"] == "node-2"  # XID 79: the GPU fell off the bus
        placing = steps["placing"]["data"]
        assert (placing["decision"], placing["replaced"]) == ("spares", {"node-2": "spare-1"})
        assert steps["restoring"]["data"]["checkpoint"] is None  # the registry answered: nothing validated yet
        assert client.latest_checkpoint(job["id"]).status_code == 404
        relaunched = client.job(job["id"])
        assert relaunched["restart_epoch"] == 1
        assert [(r["rank"], r["node_id"]) for r in relaunched["placement"]] == [
            (0, "node-1"),
            (1, "node-1"),
            (2, "spare-1"),
            (3, "spare-1"),
        ]  # the spare takes the cordoned node's place, so rank numbers stay
        assert {n["node_id"]: n["cordoned"] for n in client.nodes()} == {
            "node-1": False,
            "node-2": True,
            "spare-1": False,
        }

        # launch, stop, launch on node-1; launch, stop on node-2; one launch on the spare: each fenced, each once
        for node, executed, alive in (("node-1", 3, 2), ("node-2", 2, 0), ("spare-1", 1, 2)):
            status = httpx.get(stack.url(f"agent-{node}") + "/v1/status").json()
            assert status["commands_executed"] == executed, (node, status)
            assert len([r for r in status["ranks"] if r["alive"]]) == alive, (node, status)
    finally:
        client.close()
    _redis_admits_only_the_orchestrators_user(stack)


def _redis_admits_only_the_orchestrators_user(stack: Stack) -> None:
    """The recovery above ran through the stack's Redis as its ACL user; nobody else gets in, and that user cannot
    wipe the fences or touch other keys."""
    port = stack.config.ports["redis"]
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port, socket_timeout=2).ping()
    password = ensure_redis_password(stack.config.state_dir)
    user = redis.Redis(port=port, username=REDIS_USER, password=password, socket_timeout=2)
    try:
        assert any(key.startswith(b"reprise:fence:") for key in user.scan_iter(match="reprise:*"))
        for refused in (("FLUSHALL",), ("SET", "elsewhere", "1"), ("CONFIG", "GET", "dir")):
            with pytest.raises(redis.ResponseError, match="no permissions"):
                user.execute_command(*refused)
    finally:
        user.close()


def test_drills_from_the_cli_and_a_cancel_that_stops_everything(stack: Stack) -> None:
    client = stack.client()
    try:
        poll(client.nodes, lambda n: len(n) == 3, timeout_s=15)
        job = client.submit(
            {
                "name": "drilled",
                "node_count": 2,
                "ranks_per_node": 1,
                "command": [sys.executable, "-m", "reprise_cli.workloads.ticker"],
                "policy": {"hang_timeout_s": 2, "recovery_time_objective_s": 60},
            }
        )
        assert job["state"] == "running"
        drill = [
            sys.executable,
            "-m",
            "reprise_cli",
            "drill",
            "--job",
            job["id"],
            "--api-url",
            stack.url("orchestrator"),
        ]
        drill += ["--state-dir", str(stack.config.state_dir), "--timeout", "90"]
        for fault in ("kill-rank", "hang"):  # a crash, then a rank frozen with SIGSTOP: the job's 2 s hang limit
            done = subprocess.run([*drill, "--fault", fault], check=False, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0 and " passed: detection " in done.stdout, done.stdout + done.stderr
        drills = client._orchestrator("GET", f"/v1/jobs/{job['id']}/drills")["data"]
        assert [(d["fault"], d["state"]) for d in drills] == [("hang", "passed"), ("kill-rank", "passed")]
        timings = [(d["fault"], d["detection_s"], d["recovery_s"]) for d in drills]
        assert all(0 < detected < recovered for _, detected, recovered in timings), timings

        cancelled = client.cancel(job["id"])
        assert cancelled["state"] == "cancelled"
        for node in ("node-1", "node-2"):
            status = httpx.get(stack.url(f"agent-{node}") + "/v1/status").json()
            assert not [r for r in status["ranks"] if r["alive"]], status
        refused = client.http.post(
            f"{stack.url('orchestrator')}/v1/jobs/{job['id']}/drills",
            json={"fault": "kill-rank"},
            headers={"Authorization": f"Bearer {read_admin_api_key(stack.config.state_dir)}"},
        )
        assert refused.status_code == 409 and "cancelled" in refused.json()["detail"]

        short = client.submit(
            {
                "name": "short",
                "node_count": 2,
                "ranks_per_node": 1,
                "command": [sys.executable, "-c", "import reprise_sdk, time; reprise_sdk.heartbeat(1); time.sleep(1)"],
            }
        )  # every rank exits 0: the job completes, no recovery starts
        finished = poll(lambda: client.job(short["id"]), lambda j: j["state"] != "running", timeout_s=30)
        assert finished["state"] == "completed" and client.recoveries(short["id"]) == [], finished
    finally:
        client.close()


def test_readyz_reports_nats_outage_and_services_reconnect(stack: Stack) -> None:
    assert stack.nats is not None
    names = [spec.name for spec in stack.specs if spec.role != "checkpoint-registry"]  # the registry needs no NATS
    for name in names:
        assert httpx.get(stack.url(name) + "/healthz").status_code == 200

    stack.nats.stop()
    killed_at = time.monotonic()

    def all_report_down() -> bool:
        return all(httpx.get(stack.url(n) + "/readyz", timeout=2).status_code == 503 for n in names)

    assert poll(all_report_down, bool, timeout_s=10)
    noticed = time.monotonic() - killed_at
    bodies = [httpx.get(stack.url(n) + "/readyz", timeout=2).json() for n in names]
    assert all(b["checks"]["nats"] == "down" for b in bodies)
    print(f"every service reported NATS down {noticed:.2f}s after the kill")

    stack.nats.start()

    def all_ready() -> bool:
        return all(httpx.get(stack.url(n) + "/readyz", timeout=2).status_code == 200 for n in names)

    assert poll(all_ready, bool, timeout_s=30)


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.chaos
def test_killed_redis_and_detector_come_back_a_lost_node_stays_down_and_stop_restarts_nothing(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    """kill -9 Redis and the detector: the supervisor restarts each on its port, with its credentials, and the
    services become ready again; an agent held down (the demo's node loss) stays dead; stop() leaves nothing."""
    said: list[str] = []

    def told(text: str) -> bool:
        said.append(capsys.readouterr().out)
        return text in "".join(said)

    assert stack.redis is not None and stack.redis.process is not None
    redis_pid, detector = stack.redis.process.pid, stack.services["detector"]
    detector_pid = detector.pid
    os.killpg(redis_pid, signal.SIGKILL)
    os.killpg(detector_pid, signal.SIGKILL)

    assert poll(lambda: stack.redis is not None and stack.redis.ready(), bool, timeout_s=30)
    assert stack.redis.process is not None and stack.redis.process.pid != redis_pid
    assert poll(lambda: detector.alive() and detector.pid != detector_pid and _ready(stack.url("detector")), bool,
                timeout_s=60)  # fmt: skip
    assert poll(lambda: _ready(stack.url("orchestrator")), bool, timeout_s=30)  # its Redis client reconnected
    password = ensure_redis_password(stack.config.state_dir)
    user = redis.Redis(port=stack.config.ports["redis"], username=REDIS_USER, password=password, socket_timeout=2)
    try:
        assert user.ping()  # the same port, user and password as before the kill
    finally:
        user.close()
    assert told("supervisor: redis crashed (signal SIGKILL)") and told("supervisor: detector restarted")

    lost = stack.services["agent-spare-1"]
    lost_pid = lost.pid
    stack.hold_node_down("spare-1")  # as the demo does before it injects a node loss
    os.killpg(lost_pid, signal.SIGKILL)
    assert poll(lambda: told("agent-spare-1 exited (signal SIGKILL), held down"), bool, timeout_s=10)
    assert lost.pid == lost_pid and not lost.alive()

    pids = stack.pids()
    before_stop = len("".join(said))
    stack.stop()
    assert [pid for pid in pids if process_alive(pid)] == []
    told("")
    assert "supervisor:" not in "".join(said)[before_stop:]  # nothing the stop ended was taken for a crash


def test_reprise_up_serves_and_ctrl_c_leaves_no_process(tmp_path: Path) -> None:
    ports = free_stack_ports(DEFAULT_PORTS)
    argv = [
        str(Path(sys.executable).parent / "reprise"), "up", "--nodes", "2", "--spares", "1",
        "--state-dir", str(tmp_path / "state"),
        "--nats-port", str(ports["nats"]), "--nats-monitor-port", str(ports["nats-monitor"]),
        "--redis-port", str(ports["redis"]), "--registry-port", str(ports["checkpoint-registry"]),
        "--detector-port", str(ports["detector"]), "--orchestrator-port", str(ports["orchestrator"]),
        "--notifier-port", str(ports["notifier"]), "--slack-receiver-port", str(ports["slack-receiver"]),
        "--dashboard-port", str(ports["dashboard"]), "--agent-port", str(ports["agent"]),
    ]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    descendants: list[int] = []
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("ready.") or len(lines) > 50:
                break
        assert lines[-1].startswith("ready."), "".join(lines)
        urls = [line.split()[1] for line in lines if "/healthz" in line]
        assert len(urls) == 8  # registry, detector, orchestrator, notifier, dashboard, 3 agents
        for url in urls:
            assert httpx.get(url + "/healthz").status_code == 200
        descendants = _descendants(proc.pid)
        assert len(descendants) >= 11, descendants  # nats, redis, the Slack receiver, 8 services

        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, rest
        assert "stopped." in rest
        assert [pid for pid in descendants if process_alive(pid)] == []
    finally:  # never leave a stack behind, whatever failed above
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in descendants:
            if process_alive(pid):
                os.killpg(pid, signal.SIGKILL)


def _descendants(root: int) -> list[int]:
    """Every live process below root in the process tree (children keep their parent even in their own session)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and process_alive(pid)]
        found += children
        frontier += children
    return found


SAVER = """
import os, sys, time, torch, torch.distributed as dist
from reprise_sdk import heartbeat
from reprise_sdk.torch import save_checkpoint
dist.init_process_group("gloo")
for step in range(1, 6):
    heartbeat(step)
save_checkpoint(os.path.join(sys.argv[1], "step-5"), 5, {"w": torch.full((4,), float(dist.get_rank()))})
heartbeat(6)
time.sleep(600)
"""


def test_checkpoint_from_a_real_job_becomes_the_validated_restore_point(stack: Stack, tmp_path: Path) -> None:
    client = stack.client()
    try:
        poll(client.nodes, lambda n: len(n) == 3, timeout_s=15)
        command = [sys.executable, "-c", SAVER, str(tmp_path / "ckpt")]
        job = client.submit_job(name="saver", node_count=2, ranks_per_node=1, command=command)
        assert job["state"] == "running"
        latest = poll(lambda: client.latest_checkpoint(job["id"]), lambda r: r.status_code == 200, timeout_s=90)
        assert latest.status_code == 200, latest.text
        body = latest.json()
        assert body["step"] == 5 and body["path"] == str(tmp_path / "ckpt" / "step-5")
        files = client.http.get(f"{stack.url('checkpoint-registry')}/v1/checkpoints/{body['id']}/files").json()
        entries = files["data"]
        assert sorted(Path(f["path"]).name for f in entries) == ["rank-00000.pt", "rank-00001.pt"]
        assert {f["algorithm"] for f in entries} == {"sha256"}  # the writer's digests, verified by the registry
    finally:
        client.close()


@pytest.mark.chaos
def test_an_agent_killed_9_with_ranks_running_is_recovered_once_when_it_comes_back(stack: Stack) -> None:
    """kill -9 of a node's agent: its ranks die with it (parent-death signal) and the supervisor brings a fresh agent
    back within a second, before the node counts as lost. The job must still be recovered, exactly once."""
    client = stack.client()
    try:
        poll(client.nodes, lambda n: len(n) == 3, timeout_s=15)
        job = client.submit_job(name="agent-killed", node_count=2, ranks_per_node=1)
        assert job["state"] == "running"
        victim = next(r["node_id"] for r in job["placement"] if r["rank"] == 1)
        pids = [r["pid"] for r in httpx.get(stack.url(f"agent-{victim}") + "/v1/status").json()["ranks"]]
        stack.services[f"agent-{victim}"].signal(signal.SIGKILL)

        recoveries = poll(
            lambda: client.recoveries(job["id"]),
            lambda r: bool(r) and all(x["step"] in ("running", "failed", "held") for x in r),
            timeout_s=60,
        )
        assert len(recoveries) == 1, recoveries
        assert recoveries[0]["outcome"] == "recovered", recoveries[0]
        assert not any(process_alive(pid) for pid in pids)  # the old ranks died with their agent
        time.sleep(3)  # nothing else follows
        assert len(client.recoveries(job["id"])) == 1
        assert client.job(job["id"])["state"] == "running"
    finally:
        client.close()


GLOO_JOB = """
import os, time
import torch
import torch.distributed as dist
import reprise_sdk

STUCK = os.environ.get("STUCK_RANK") == os.environ["RANK"] and os.environ["REPRISE_RESTART_EPOCH"] == "0"


def load_batch(step):
    while STUCK and step >= 5:  # a data loader that never returns, outside any collective
        time.sleep(0.05)
    return torch.ones(4)


dist.init_process_group("gloo", init_method="env://")
step = 0
while True:
    step += 1
    batch = load_batch(step)
    dist.all_reduce(batch)
    reprise_sdk.heartbeat(step)
    time.sleep(0.1)
"""


def test_a_hung_gloo_job_leaves_every_ranks_stack_on_its_incident_naming_the_culprit(
    stack: Stack, tmp_path: Path
) -> None:
    script = tmp_path / "gloo_job.py"
    script.write_text(GLOO_JOB)
    client = stack.client()

    def hung_and_recovered(job: dict[str, Any]) -> dict[str, Any]:
        def stacked() -> dict[str, Any] | None:
            found = client.incidents(job["id"])
            if not found:
                return None
            detail: dict[str, Any] = client.http.get(f"{client.detector}/v1/incidents/{found[0]['id']}").json()
            return detail if len(detail["stacks"]) == 2 and detail["stacks_verdict"] else None

        detail = poll(stacked, bool, timeout_s=60)
        assert detail is not None, client.incidents(job["id"])
        recovered = poll(lambda: client.recoveries(job["id"]), lambda r: r and r[0]["step"] == "running", timeout_s=90)
        assert recovered and recovered[0]["step"] == "running", recovered
        return detail

    def training(job_id: str) -> bool:
        ranks = [httpx.get(stack.url(f"agent-{n}") + "/v1/status").json()["ranks"] for n in ("node-1", "node-2")]
        return all(any(r["job_id"] == job_id and (r["step"] or 0) >= 3 for r in found) for found in ranks)

    try:
        poll(client.nodes, lambda n: len(n) == 3, timeout_s=15)
        spec = {
            "node_count": 2,
            "ranks_per_node": 1,
            "command": [sys.executable, str(script)],
            "policy": {"hang_timeout_s": 3, "recovery_time_objective_s": 120},
        }
        frozen = client.submit({**spec, "name": "frozen"})
        assert poll(lambda: training(frozen["id"]), bool, timeout_s=60), "the job never trained"
        reply = client.inject(InjectFault(kind=FaultKind.RANK_HANG, rank=1, job_id=frozen["id"]), node_id="node-2")
        assert reply.accepted, reply.detail
        detail = hung_and_recovered(frozen)
        assert detail["category"] == "hang"
        assert (detail["culprit_node_id"], detail["culprit_rank"]) == ("node-2", 1)
        by_rank = {s["rank"]: s for s in detail["stacks"]}
        assert [by_rank[r]["node_id"] for r in (0, 1)] == ["node-1", "node-2"]
        assert by_rank[1]["proc_state"] == "T" and by_rank[0]["waits_in"] == "all_reduce"
        assert all(s["error"] == "" and s["threads"][0]["frames"] for s in detail["stacks"])
        assert detail["stacks_verdict"].startswith("rank 1 on node-2: its process is stopped")
        client.cancel(frozen["id"])

        stuck = client.submit({**spec, "name": "stuck", "env": {"STUCK_RANK": "0"}})
        detail = hung_and_recovered(stuck)
        assert (detail["culprit_node_id"], detail["culprit_rank"]) == ("node-1", 0)
        assert detail["stacks_verdict"].startswith("rank 0 on node-1: its stack is at load_batch (gloo_job.py:")
        assert "not in all_reduce, where ranks [1] wait" in detail["stacks_verdict"]
    finally:
        client.close()
