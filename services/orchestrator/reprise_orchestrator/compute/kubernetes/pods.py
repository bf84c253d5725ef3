"""A job's pods: the manifest of the pod that runs one node's agent, and what a pod's state says went wrong.

Each pod is bound to its node by `nodeName` (the backend chose the node among those labelled for training and
schedulable), with the job's node selector too, so a kubelet admits it only on a node that matches. It runs the agent
with the settings an allocation's agents get (AgentLaunch, compute/allocation.py), never restarts (an agent that ends
is a fault Reprise handles), and carries the job id, its index and whether it is a spare in labels. A pod's fault is
read from its status as a kubelet writes it: evicted, OOM-killed, failed, preempted, or ended; a deletion by someone
else is the pod watch's to tell (podwatch.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kubernetes.aio import client

from reprise_common.events import ComputeSignal, ComputeSignalKind
from reprise_orchestrator.compute.allocation import AgentLaunch
from reprise_orchestrator.compute.backend import compute_signal

JOB_LABEL = "reprise.dev/job"
INDEX_LABEL = "reprise.dev/index"
SIZE_LABEL = "reprise.dev/size"  # how many pods the allocation holds: a requeue restores that many
SPARE_LABEL = "reprise.dev/spare"
RELEASED = "reprise.dev/released"  # annotation: Reprise deletes this pod itself (every replica's watch reads it)
MANAGED_BY = {"app.kubernetes.io/managed-by": "reprise"}
CONTAINER = "agent"
SEED_VOLUME = "node-seed"
DEFAULT_STATE_DIR = "/var/lib/reprise"
_NAME_BAD = re.compile(r"[^a-z0-9-]+")
ENDED_PHASES = ("Failed", "Succeeded")


@dataclass(frozen=True)
class PodTemplate:
    """What every pod of one job shares: where it runs, as whom, and how its agent starts."""

    namespace: str
    image: str
    launch: AgentLaunch
    node_selector: dict[str, str]
    service_account: str | None = None
    seeds_secret: str | None = None  # a Secret holding `<node>.nk`: each pod mounts its own node's seed alone


def pod_name(job_id: str, index: int) -> str:
    """The pod of the job's `index`-th node: a DNS-1123 name, the same on every replica (a repeat conflicts)."""
    return f"reprise-{_NAME_BAD.sub('-', job_id.lower()).strip('-')[:40]}-{index}"


def _env(template: PodTemplate, job_id: str, node: str, *, spare: bool) -> list[client.V1EnvVar]:
    launch = template.launch
    values = {
        **launch.shared_env(),
        "REPRISE_NODE_ID": node,
        "REPRISE_SPARE": "true" if spare else "false",
        "REPRISE_HTTP_PORT": str(launch.http_port),
        "REPRISE_STATE_DIR": f"{launch.env.get('REPRISE_STATE_DIR', DEFAULT_STATE_DIR)}/{job_id}/{node}",
    }
    seed = launch.seed_file(node)
    if seed is not None:
        values["REPRISE_NATS_NKEY_SEED_FILE"] = seed
    found = [client.V1EnvVar(name=name, value=value) for name, value in values.items()]
    if "REPRISE_ADVERTISE_ADDR" not in values:  # the node's address: the pod runs on the host's network
        host_ip = client.V1EnvVarSource(field_ref=client.V1ObjectFieldSelector(field_path="status.hostIP"))
        found.append(client.V1EnvVar(name="REPRISE_ADVERTISE_ADDR", value_from=host_ip))
    return found


def _seed_volume(template: PodTemplate, node: str) -> tuple[list[client.V1Volume], list[client.V1VolumeMount]]:
    if template.seeds_secret is None or template.launch.creds_dir is None:
        return [], []
    source = client.V1SecretVolumeSource(
        secret_name=template.seeds_secret, items=[client.V1KeyToPath(key=f"{node}.nk", path=f"{node}.nk")]
    )
    mount = client.V1VolumeMount(name=SEED_VOLUME, mount_path=str(template.launch.creds_dir), read_only=True)
    return [client.V1Volume(name=SEED_VOLUME, secret=source)], [mount]


def agent_pod(template: PodTemplate, *, job_id: str, index: int, size: int, node: str, spare: bool) -> client.V1Pod:
    """The pod that runs the agent of the job's `index`-th node (of `size`) on `node`."""
    volumes, mounts = _seed_volume(template, node)
    container = client.V1Container(
        name=CONTAINER,
        image=template.image,
        command=template.launch.argv(),
        env=_env(template, job_id, node, spare=spare),
        volume_mounts=mounts or None,
        security_context=client.V1SecurityContext(  # py-spy reads a hung rank's stack with ptrace: that alone
            allow_privilege_escalation=False,
            capabilities=client.V1Capabilities(add=["SYS_PTRACE"], drop=["ALL"]),
        ),
    )
    labels = {**MANAGED_BY, JOB_LABEL: job_id, INDEX_LABEL: str(index), SIZE_LABEL: str(size)}
    labels[SPARE_LABEL] = "true" if spare else "false"
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=pod_name(job_id, index), namespace=template.namespace, labels=labels),
        spec=client.V1PodSpec(
            node_name=node,
            node_selector=template.node_selector or None,
            restart_policy="Never",
            host_network=True,
            service_account_name=template.service_account,
            automount_service_account_token=False,
            containers=[container],
            volumes=volumes or None,
        ),
    )


@dataclass(frozen=True)
class PodView:
    """What the backend reads of one of its pods, typed at the edge."""

    namespace: str
    name: str
    uid: str
    job_id: str | None  # None: not Reprise's
    index: int  # its place in its job's allocation
    size: int  # how many pods the allocation holds (0: not said)
    node: str  # "" while not bound
    deleting: bool  # a deletionTimestamp is set
    released: bool  # Reprise marked it before deleting it: its end is no fault
    ended: bool  # Failed or Succeeded
    node_selector: dict[str, str]
    service_account: str | None

    @property
    def live(self) -> bool:
        """Neither ended nor being deleted: the pod runs (or is starting) its agent."""
        return not self.ended and not self.deleting


def view(pod: client.V1Pod) -> PodView:
    """The pod as the backend reads it."""
    meta, spec, status = pod.metadata or client.V1ObjectMeta(), pod.spec, pod.status
    labels = meta.labels or {}
    index, size = labels.get(INDEX_LABEL, ""), labels.get(SIZE_LABEL, "")
    return PodView(
        namespace=meta.namespace or "",
        name=meta.name or "",
        uid=meta.uid or "",
        job_id=labels.get(JOB_LABEL),
        index=int(index) if index.isdigit() else 0,
        size=int(size) if size.isdigit() else 0,
        node=(spec.node_name if spec is not None else None) or "",
        deleting=meta.deletion_timestamp is not None,
        released=RELEASED in (meta.annotations or {}),
        ended=status is not None and status.phase in ENDED_PHASES,
        node_selector=dict((spec.node_selector if spec is not None else None) or {}),
        service_account=spec.service_account_name if spec is not None else None,
    )


def fault(pod: client.V1Pod) -> tuple[ComputeSignalKind, str] | None:
    """What the pod's status says went wrong, as a signal's kind and words; None while it runs (or starts)."""
    status = pod.status
    if status is None:
        return None
    for condition in status.conditions or []:  # written by the scheduler on its victims (Kubernetes 1.26 on)
        if condition.type == "DisruptionTarget" and "Preemption" in (condition.reason or ""):
            return ComputeSignalKind.PREEMPTED, f"preempted: {condition.message or condition.reason}"
    if status.phase == "Succeeded":
        return ComputeSignalKind.NODE_FAIL, "the agent's pod ended"
    return (ComputeSignalKind.NODE_FAIL, _failure(status)) if status.phase == "Failed" else None


def _failure(status: client.V1PodStatus) -> str:
    """Why a failed pod failed: evicted, its agent OOM-killed, or its agent's exit."""
    if status.reason == "Evicted":
        return f"evicted: {status.message or 'by the kubelet'}"
    for container in status.container_statuses or []:
        ended = container.state.terminated if container.state is not None else None
        if ended is not None and ended.reason == "OOMKilled":
            return f"the agent was OOM-killed (exit code {ended.exit_code})"
        if ended is not None:
            return f"the agent failed: {ended.reason or 'exit code'} {ended.exit_code}"
    return f"failed: {status.reason or ''} {status.message or ''}".rstrip()


def pod_signal(pod: PodView, kind: ComputeSignalKind, what: str, *, backend: str) -> ComputeSignal:
    """The signal of the pod's fault: its node, its job, and an event id from the pod's uid (one per pod: replicas
    that see it publish it under one message id)."""
    node, job_id, name = pod.node or None, pod.job_id, f"{pod.namespace}/{pod.name}"
    detail = f"Kubernetes pod {name} of job {job_id} on node {node}: {what}"
    return compute_signal(backend, kind, (pod.uid,), node_id=node, job_id=job_id, detail=detail, label="pod")
