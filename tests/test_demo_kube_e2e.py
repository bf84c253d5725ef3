"""The demo's four faults on Kubernetes (`make demo SCHEDULER=kubernetes`, smaller): a real etcd and kube-apiserver,
the orchestrator on its kubernetes backend with its own ServiceAccount under RBAC, 2 nodes + 1 spare as Nodes labelled
for training, and the kubelet double running each pod the orchestrator binds to a node as a local process.

The same code as `reprise demo --scheduler kubernetes`: the job's allocation is one pod per node (its agent), a crash,
an XID 79 (the spare's pod takes the node's place, and the API server has the node unschedulable with Reprise's taint
and the incident in its annotation), a hang and the loss of a node (its processes end, its Node turns NotReady) are
each recovered without help, and the job ends with the fault-free reference's parameters, bit for bit.
"""

from __future__ import annotations

import os
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from reprise_cli.demo.kube_view import INCIDENT_ANNOTATION, TAINT_KEY, KubeView
from reprise_cli.demo.models import DemoRun, demo_faults
from reprise_cli.demo.scenario import Scenario
from reprise_cli.demo.training import Training
from reprise_cli.kube_cluster import kube_unavailable_reason

from .demo_checks import assert_demo_faults_recovered, demo_config, demo_stack

pytest.importorskip("torch", reason="PyTorch is not installed: the DDP demo job cannot run")
pytestmark = [
    pytest.mark.stack,
    pytest.mark.chaos,
    pytest.mark.timeout(420),
    pytest.mark.skipif(kube_unavailable_reason() is not None, reason=f"no kube-apiserver: {kube_unavailable_reason()}"),
]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@dataclass
class KubeRun:
    """The demo's run, and what the cluster showed of it before the stack stopped."""

    run: DemoRun
    xid_node: dict[str, Any] = field(default_factory=dict)  # the XID's node as the API server had it
    ran: dict[str, str] = field(default_factory=dict)  # every pod the kubelet double ran, and its node
    pids: list[int] = field(default_factory=list)  # the pods' processes alive at the end


def _run_on_kubernetes(tmp_path: Path, training: Training) -> KubeRun:
    config = demo_config(tmp_path / "state", scheduler="kubernetes")
    with demo_stack(config, training, tmp_path / "reference") as demo:
        kube = demo.stack.kube
        assert kube is not None and kube.kubelet is not None
        with closing(demo.stack.client()) as client:
            scenario = Scenario(demo.stack, client, training, say=print, work_dir=tmp_path / "job")
            scenario.kube = KubeView(kube)
            found = KubeRun(scenario.run(demo_faults(config.nodes), reference=demo.reference))
        found.xid_node = kube.read_node(found.run.faults[1].node_id)
        kubelet = kube.kubelet.kubelet
        assert kubelet is not None
        found.ran = dict(kubelet.node_of)
        found.pids = [process.pid for process in kubelet.processes.values()]
        return found


def test_on_kubernetes_the_demo_faults_are_recovered_with_the_reference_parameters(tmp_path: Path) -> None:
    found = _run_on_kubernetes(tmp_path, Training(steps=88, checkpoint_every=8, step_sleep=0.1))
    run, xid_node, ran, pids = found.run, found.xid_node, found.ran, found.pids

    assert_demo_faults_recovered(run)  # bit for bit, after a move to the spare's pod and a shrink
    assert run.job["backend"] == "kubernetes"
    _crash, xid, _hang, loss = run.faults
    # The XID's node: cordoned by the recovery, read back from the API server; the spare's pod took its place.
    assert xid.incident is not None and (xid.step("isolating") or {})["data"]["cordoned"] == "node-2"
    assert xid_node["spec"]["unschedulable"] is True
    assert [(t["key"], t["value"], t["effect"]) for t in xid_node["spec"]["taints"]] == [
        (TAINT_KEY, xid.incident["id"], "NoSchedule")
    ]
    assert xid_node["metadata"]["annotations"][INCIDENT_ANNOTATION] == xid.incident["id"]
    # The lost node: Reprise's own incident, the job shrunk to the node left; the Node NotReady in the API server.
    assert loss.incident is not None and loss.incident["category"] == "node"
    assert (loss.step("placing") or {})["data"]["decision"] == "shrink"
    assert "Ready=False" in loss.kubernetes["node"], loss.kubernetes
    assert len(run.job["placement"]) == 1
    # One pod per node of the allocation (2 + the spare), each bound to its own node and run by the kubelet double;
    # none of their processes outlives the stack.
    assert sorted(ran.values()) == ["node-1", "node-2", "spare-1"], ran
    assert pids and not [pid for pid in pids if _alive(pid)]
