"""The fault scenario: a real DDP job under Reprise, faults injected one at a time, each recovery followed.

Each fault waits until the previous recovery was verified and training saved (and the registry validated) a newer
checkpoint, then lands half a checkpoint interval past it, so every recovery restores a newer checkpoint and
recomputes a few steps. Only public interfaces are used: the orchestrator's, detector's and registry's REST APIs,
fault injection over NATS, the agents' status pages and the rank logs the agents write; on Slurm also `sinfo` (what
Slurm shows of the nodes) and the lost node's slurmd, killed with its agent; on Kubernetes the nodes as the API server
has them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx

from reprise_cli.client import PlatformClient, poll
from reprise_cli.demo.errors import DemoFailure
from reprise_cli.demo.kube_view import KubeView
from reprise_cli.demo.models import TERMINAL, DemoRun, Fault, FaultPlan, FaultRun, fault_event
from reprise_cli.demo.narrate import incident_line, nodes_of, step_lines
from reprise_cli.demo.sampler import StepSampler
from reprise_cli.demo.slurm_view import SlurmView, down, drained, not_responding
from reprise_cli.demo.training import ReferenceRun, Training, digest_in, job_spec, rank_log
from reprise_cli.stack import Stack
from reprise_common.clock import utcnow

CLOCK_SLACK = timedelta(seconds=1)  # records stamped by services may precede our own reading of the same clock
POLL_S = 0.25


@dataclass
class Scenario:
    """Runs the job and its faults against a started stack, narrating each event through `say`."""

    stack: Stack
    client: PlatformClient
    training: Training
    say: Callable[[str], None]
    work_dir: Path
    timeout_s: float = 120.0
    sampler: StepSampler | None = None
    slurm: SlurmView | None = None  # on Slurm: what sinfo shows of the nodes
    kube: KubeView | None = None  # on Kubernetes: what the API server has of the nodes
    image: str | None = None  # the ranks run in containers of this image (work_dir under the nodes' mount roots)
    job: dict[str, Any] = field(default_factory=dict)
    claimed: set[str] = field(default_factory=set)  # recoveries an injected fault accounts for
    narrated: dict[str, set[tuple[int, str]]] = field(default_factory=dict)  # recovery -> steps already told
    _looked_at: float = 0.0

    def run(self, faults: Sequence[FaultPlan], *, reference: ReferenceRun, name: str = "demo-ddp") -> DemoRun:
        """Reference, job, faults one after another, final digest; stops early when a recovery fails."""
        nodes, spares = self.stack.config.nodes, self.stack.config.spares
        if not reference.began:
            reference.start()
        self.say(f"fault-free reference: {len(reference.ranks)} local gloo ranks without the platform ...")
        ref = reference.finish()
        self.say(f"reference done in {ref.wall_s:.1f} s: params-sha256 {ref.digest[:16]}…")
        spec = job_spec(
            self.training, name=name, nodes=nodes, min_nodes=max(1, nodes - 1), work_dir=self.work_dir, image=self.image
        )
        if self.slurm is None and self.kube is None:
            self._wait_for_nodes(nodes + spares)
        elif self.slurm is not None:  # one allocation of the job's nodes and its spares; its agents start in it
            spec["slurm"] = {"spares": spares, "output": str(self.work_dir / "slurm-%j.out")}
        result = DemoRun(training=self.training, reference=ref, job={}, submitted_at=utcnow())
        self.work_dir.mkdir(parents=True, exist_ok=True)  # the ranks' working directory
        self.job = result.job = self.client.submit(spec)
        if self.slurm is not None or self.kube is not None:
            self._wait_for_allocation(nodes, spares)
        result.running_at = utcnow()
        self.say(f"job {self.job['id']} {self.job['state']} on {', '.join(nodes_of(self.job))}")
        if self.job["state"] != "running":
            raise DemoFailure(f"the job did not start: {self.job['detail']}")
        self.sampler = StepSampler(job_id=self.job["id"])
        self._point_sampler()
        self.sampler.start()
        try:
            self._faults(faults, result)
        finally:
            self.sampler.stop()
            result.samples = self.sampler.samples()
        result.recoveries = sorted(self.client.recoveries(self.job["id"]), key=lambda r: r["started_at"])
        result.job = self.client.job(self.job["id"])
        return result

    def _faults(self, faults: Sequence[FaultPlan], result: DemoRun) -> None:
        restored = 0
        self._wait_for_standbys()
        for plan in faults:
            self._wait_for_new_checkpoint(past_step=restored)
            fault = self._inject(plan)
            result.faults.append(fault)
            self._follow(fault, known_incidents={f.incident["id"] for f in result.faults if f.incident})
            if not fault.recovered:
                return
            if self.slurm is not None and plan.fault is Fault.XID79:
                self._slurm_drained(fault)
            if self.kube is not None and plan.fault is Fault.XID79:
                self._kube_cordoned(fault)
            restored = fault.restored_step or 0
        result.digest = self._wait_for_the_end()
        result.finished_at = utcnow()
        for fault in result.faults:
            if self.slurm is not None and fault.plan.fault is Fault.NODE_LOSS:
                self._slurm_saw_the_loss(fault)
            if self.kube is not None and fault.plan.fault is Fault.NODE_LOSS:
                self._kube_saw_the_loss(fault)
        if result.digest is not None:
            state = poll(lambda: self.client.job(self.job["id"])["state"], lambda s: s != "running", timeout_s=30)
            self.say(f"job {state}" + (": every rank exited 0" if state == "completed" else " after training ended"))

    # --- waiting ----------------------------------------------------------------------------------------------
    def _wait_for_allocation(self, nodes: int, spares: int) -> None:
        """On Slurm or Kubernetes: until the job's allocation runs (one agent per node, started with it)."""
        how = "Slurm allocation" if self.slurm is not None else "Kubernetes pods (one per node, each an agent)"
        self.say(f"job {self.job['id']} {self.job['state']}: {how} of {nodes} nodes + {spares} spare")
        self.job = poll(
            lambda: self.client.job(self.job["id"]), lambda j: j["state"] != "pending", timeout_s=self.timeout_s
        )
        reporting = sorted(node["node_id"] for node in self.client.nodes())
        if self.job["state"] == "pending":
            if self.slurm is not None:
                slurm = ", ".join(f"{node} {state}" for node, (state, _) in self.slurm.cluster.node_view().items())
                where = f"Slurm's nodes: {slurm or 'not known'}; the agents' errors are in the allocation's output, "
                where += f"{self.work_dir}/slurm-<Slurm job id>.out"
            else:
                where = f"the pods' output is in {self.stack.log_dir / 'pods'}"
            raise DemoFailure(
                f"the job is still pending {self.timeout_s:g} s after its submission: agents report from "
                f"{', '.join(reporting) or 'no node'}; {where}"
            )
        started = "srun" if self.slurm is not None else "its pod, run by the kubelet"
        self.say(f"allocation running, an agent on each node ({started}); {len(reporting)} nodes report")

    def _wait_for_nodes(self, count: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        while len([n for n in self.client.nodes() if not n["stale"]]) < count:
            if time.monotonic() > deadline:
                raise DemoFailure(f"fewer than {count} nodes report after {self.timeout_s:g} s")
            time.sleep(POLL_S)

    def _wait_for_standbys(self) -> None:
        """Until every node's warm standbys imported their modules. On the built-in backend they did long before; on
        Slurm the agents, and their standbys, start with the job's allocation, and a fault in the seconds after (the
        standbys importing torch beside the job's first steps) would measure the start-up, not the recovery."""
        deadline = time.monotonic() + self.timeout_s
        waited = time.monotonic()
        for node in self.client.nodes():
            url = self.stack.agent_url(node["node_id"]) + "/v1/status"  # asked without the platform's key
            while not all(s["ready"] for s in httpx.get(url, timeout=2.0).json().get("standbys", [])):
                if time.monotonic() > deadline:
                    raise DemoFailure(f"the standbys of {node['node_id']} were not ready within {self.timeout_s:g} s")
                time.sleep(POLL_S)
        if time.monotonic() - waited > 1.0:
            self.say(f"every node's warm standbys ready (waited {time.monotonic() - waited:.1f} s)")

    def _wait_for_new_checkpoint(self, *, past_step: int) -> None:
        """Until the registry validated a checkpoint past `past_step` and rank 0 is half an interval beyond it."""
        assert self.sampler is not None
        margin = max(1, self.training.checkpoint_every // 2)
        deadline = time.monotonic() + self.timeout_s
        announced = None
        while time.monotonic() < deadline:
            self._look_around()
            latest = self.client.latest_checkpoint(self.job["id"])
            step = int(latest.json()["step"]) if latest.status_code == 200 else None
            if step is not None and step > past_step:
                if announced != step:
                    self.say(f"checkpoint at step {step} validated by the registry")
                    announced = step
                sample = self.sampler.latest()
                if sample and sample.epoch == self.job["restart_epoch"] and (sample.step or 0) >= step + margin:
                    return
            time.sleep(0.1)
        raise DemoFailure(f"no checkpoint newer than step {past_step} was validated within {self.timeout_s:g} s")

    def _wait_for_the_end(self) -> str | None:
        """Rank 0's final digest, from its log in the job's current launch."""
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            self._look_around()
            rank0 = next(r for r in self.job["placement"] if r["rank"] == 0)
            agent_dir = self.stack.config.state_dir.resolve() / "agents" / rank0["node_id"]
            if self.kube is not None:  # a pod's agent keeps its state per job (compute/kubernetes/pods.py)
                agent_dir = agent_dir.parent / self.job["id"] / rank0["node_id"]
            log = rank_log(agent_dir, job_id=self.job["id"], restart_epoch=self.job["restart_epoch"], rank=0)
            digest = digest_in(log)
            if digest is not None:
                self.say(f"training finished: rank 0 printed params-sha256 {digest[:16]}… ({log})")
                return digest
            time.sleep(POLL_S)
        self.say(f"training did not finish within {self.timeout_s:g} s")
        return None

    def _look_around(self) -> None:
        """About once a second: tell recoveries no injected fault accounts for, and follow the job where it moved."""
        if time.monotonic() - self._looked_at < 1.0:
            return
        self._looked_at = time.monotonic()
        for recovery in self.client.recoveries(self.job["id"]):
            if recovery["id"] in self.claimed:
                continue
            if recovery["id"] not in self.narrated:
                incident = self._incident(recovery.get("incident_id")) or {}
                self.say(f"UNPLANNED recovery {recovery['id']}: incident {incident.get('root_cause', '?')}")
            origin = datetime.fromisoformat(recovery["steps"][0]["started_at"]) if recovery["steps"] else utcnow()
            for line in step_lines(recovery, origin, self.narrated.setdefault(recovery["id"], set())):
                self.say(line)
        self.job = self.client.job(self.job["id"])
        self._point_sampler()

    # --- faults -----------------------------------------------------------------------------------------------
    def _inject(self, plan: FaultPlan) -> FaultRun:
        self.job = self.client.job(self.job["id"])
        target = next((r for r in self.job["placement"] if r["rank"] == plan.rank), None)
        if target is None:
            raise DemoFailure(f"the job has no rank {plan.rank} to hit with a {plan.fault}")
        event = fault_event(plan, job_id=self.job["id"], gpu=target.get("gpu"))
        sample = self.sampler.latest() if self.sampler else None
        if plan.fault is Fault.NODE_LOSS:  # the agent kills itself; nothing brings it back (on Slurm: slurmd killed)
            self.stack.lose_node(target["node_id"])
        if plan.fault is Fault.CORRUPT_CHECKPOINT:
            self._flip_a_byte_of_the_latest_checkpoint()
        injected_at = utcnow()
        reply = self.client.inject(event, node_id=target["node_id"])
        if not reply.accepted:
            raise DemoFailure(f"{target['node_id']} refused the {plan.fault}: {reply.detail}")
        at_step = f" at step {sample.step}" if sample and sample.step else ""
        self.say(f"FAULT {plan.fault} on {target['node_id']} (rank {plan.rank}){at_step}: {reply.detail}")
        return FaultRun(plan, target["node_id"], self.job["restart_epoch"], injected_at, reply.detail)

    def _flip_a_byte_of_the_latest_checkpoint(self) -> None:
        """Flip one byte in the middle of rank 0's file (the one every rank reads) of the newest validated checkpoint:
        the size stays, so only a digest can tell."""
        latest = self.client.latest_checkpoint(self.job["id"]).json()
        target = Path(latest["path"]) / "rank-00000.pt"
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
        self.say(f"STORAGE a byte flipped in {target} (checkpoint step {latest['step']}, validated)")

    def _follow(self, fault: FaultRun, *, known_incidents: set[str]) -> None:
        """Narrate the incident and the recovery's steps as they happen, until the recovery ends."""
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if fault.incident is None:
                fault.incident = self._incident_after(fault, known_incidents)
                if fault.incident is not None:
                    self.say(incident_line(fault))
            recoveries = self.client.recoveries(self.job["id"])
            mine = fault.recovery["id"] if fault.recovery else None
            fault.recovery = next((r for r in recoveries if r["id"] == mine), None) or self._recovery_after(
                fault, recoveries
            )
            if fault.recovery is not None:
                self.claimed.add(fault.recovery["id"])
                printed = self.narrated.setdefault(fault.recovery["id"], set())
                for line in step_lines(fault.recovery, fault.injected_at, printed):
                    self.say(line)
                if fault.recovery["step"] in TERMINAL:
                    break
            time.sleep(POLL_S)
        if fault.recovery is None or fault.recovery["step"] not in TERMINAL:
            raise DemoFailure(f"no recovery of the {fault.plan.fault} ended within {self.timeout_s:g} s")
        fault.incident = self._incident(fault.recovery.get("incident_id")) or fault.incident  # as it ended up
        verdict = (fault.incident or {}).get("stacks_verdict")
        if verdict:
            self.say(f"  the ranks' stacks name {verdict}")
        self._after_recovery(fault)

    def _after_recovery(self, fault: FaultRun) -> None:
        recovery = fault.recovery or {}
        if not fault.recovered:
            self.say(f"recovery FAILED: {recovery.get('outcome')} {recovery.get('detail', '')}")
            return
        self.job = self.client.job(self.job["id"])
        self._point_sampler()
        verifying = fault.step("verifying") or {}
        steps = (verifying.get("data") or {}).get("steps") or {}
        resumed = min(steps.values()) if steps else "?"
        source = "a peer's state at step" if fault.resumed.get("via") == "peer" else "checkpoint step"
        self.say(
            f"training resumed at step {resumed} from {source} {fault.restored_step} "
            f"(restart epoch {self.job['restart_epoch']}, world size {len(self.job['placement'])}, "
            f"nodes {', '.join(nodes_of(self.job))})"
        )

    def _point_sampler(self) -> None:
        """Aim the sampler at the agent of the node that runs rank 0 now."""
        rank0 = next(r for r in self.job["placement"] if r["rank"] == 0)
        if self.sampler is not None:
            self.sampler.agent_url = self.stack.agent_url(rank0["node_id"])

    # --- Slurm's view -----------------------------------------------------------------------------------------
    def _slurm_drained(self, fault: FaultRun) -> None:
        """After an XID 79's recovery: the node is drained in Slurm, the incident named in its reason (sinfo -R)."""
        assert self.slurm is not None
        seen = self.slurm.wait_for(fault.node_id, drained, after=fault.injected_at, timeout_s=10)
        incident_id = (fault.incident or {}).get("id", "?")
        if seen is None or incident_id not in seen.reason:
            raise DemoFailure(f"Slurm does not show {fault.node_id} drained for incident {incident_id}: {seen}")
        fault.slurm["drained_s"] = (seen.at - fault.injected_at).total_seconds()
        fault.slurm["reason"] = seen.reason
        self.say(f"SLURM {fault.node_id} {seen.state} (sinfo -R): {seen.reason}")

    def _slurm_saw_the_loss(self, fault: FaultRun) -> None:
        """When Slurm found out about the lost node (its slurmd killed with its agent): not responding, then down."""
        assert self.slurm is not None
        late = self.slurm.wait_for(fault.node_id, down, after=fault.injected_at, timeout_s=45)
        early = self.slurm.first(fault.node_id, not_responding, after=fault.injected_at)
        for key, seen in (("not_responding_s", early), ("down_s", late)):
            if seen is not None:
                fault.slurm[key] = (seen.at - fault.injected_at).total_seconds()
        opened = (fault.incident or {}).get("opened_at")
        reprise = f"{(datetime.fromisoformat(opened) - fault.injected_at).total_seconds():.1f} s" if opened else "?"
        slurm = ", ".join(f"{key[:-2].replace('_', ' ')} +{value:.1f} s" for key, value in fault.slurm.items())
        slurm = slurm or "not within 45 s"
        self.say(f"SLURM saw the loss of {fault.node_id}: {slurm} (Reprise's incident: +{reprise})")

    # --- Kubernetes' view -------------------------------------------------------------------------------------
    def _kube_cordoned(self, fault: FaultRun) -> None:
        """After an XID 79's recovery: the API server has the node unschedulable, with Reprise's taint and the
        incident in its annotation."""
        assert self.kube is not None
        incident_id = (fault.incident or {}).get("id", "?")
        seen = self.kube.wait_for(fault.node_id, lambda s: s.cordoned_for(incident_id), timeout_s=10)
        if not seen.cordoned_for(incident_id):
            raise DemoFailure(f"the API server does not show {fault.node_id} cordoned for {incident_id}: {seen}")
        fault.kubernetes = {"cordoned_s": (seen.at - fault.injected_at).total_seconds(), "node": seen.describe()}
        self.say(f"KUBERNETES node {fault.node_id} (read from the API server): {seen.describe()}")

    def _kube_saw_the_loss(self, fault: FaultRun) -> None:
        """The lost node as the API server has it: NotReady (its kubelet double's doing), and when it was seen so."""
        assert self.kube is not None
        seen = self.kube.wait_for(fault.node_id, lambda s: s.ready == "False", timeout_s=10)
        fault.kubernetes = {"node": seen.describe()}
        self.say(f"KUBERNETES lost node {fault.node_id} (read from the API server): {seen.describe()}")

    def _incident_after(self, fault: FaultRun, known: set[str]) -> dict[str, Any] | None:
        opened = [
            i
            for i in self.client.incidents(self.job["id"])
            if i["id"] not in known
            and i["severity"] == "critical"
            and datetime.fromisoformat(i["opened_at"]) >= fault.injected_at - CLOCK_SLACK
        ]
        return min(opened, key=lambda i: i["opened_at"], default=None)

    def _incident(self, incident_id: str | None) -> dict[str, Any] | None:
        if incident_id is None:
            return None
        return next((i for i in self.client.incidents(self.job["id"]) if i["id"] == incident_id), None)

    def _recovery_after(self, fault: FaultRun, recoveries: list[dict[str, Any]]) -> dict[str, Any] | None:
        """The first recovery that started after the fault and that no earlier event accounts for."""
        fresh = [
            r
            for r in recoveries
            if r["id"] not in self.narrated
            and datetime.fromisoformat(r["started_at"]) >= fault.injected_at - CLOCK_SLACK
        ]
        return min(fresh, key=lambda r: r["started_at"], default=None)
