"""The jobs' pods in one namespace, kept current by a list and a watch (watch.py), and their failure signals.

A pod that fails (evicted, OOM-killed, its agent ended), is preempted, or is deleted by someone else is signalled
once: one signal per pod, whichever of these comes first, with an event id from the pod's uid. Pods Reprise itself
deletes (the job is over, or a requeue replaces them) are annotated `reprise.dev/released` first and give no signal,
on whichever replica watches them. The first list is the
baseline: a pod already failed then is not signalled (its agent's silence is what the detector already saw).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from reprise_common.events import ComputeSignalKind
from reprise_common.logging import get_logger
from reprise_orchestrator.compute.backend import SignalSink
from reprise_orchestrator.compute.kubernetes.api import KubeApi, WatchEvent
from reprise_orchestrator.compute.kubernetes.pods import JOB_LABEL, PodView, fault, pod_signal, view
from reprise_orchestrator.compute.kubernetes.watch import ListWatch

log = get_logger("reprise.orchestrator.compute.kubernetes")


class PodWatch(ListWatch):
    """Reprise's pods of one namespace as last seen (by name), and which of them were signalled or released."""

    resource = "pods"

    def __init__(
        self, api: KubeApi, namespace: str, *, backend: str, watch_timeout_s: int = 60, retry_s: float = 1.0
    ) -> None:
        super().__init__(watch_timeout_s=watch_timeout_s, retry_s=retry_s)
        self.api = api
        self.namespace = namespace
        self.backend = backend
        self.released: set[str] = set()  # pods Reprise deletes itself: no signal
        self.signalled: set[str] = set()  # the uids of the pods signalled (or failed before the baseline)

    def pods(self) -> list[PodView]:
        """Reprise's pods of the namespace as last seen."""
        return [view(pod) for pod in self.objects.values()]

    async def list(self) -> tuple[list[Any], str | None]:
        """Every pod of a job, and the list's resourceVersion."""
        found = await self.api.list_pods(self.namespace, label_selector=JOB_LABEL)
        return list(found.items), found.metadata.resource_version if found.metadata is not None else None

    def stream(self, resource_version: str) -> AsyncIterator[WatchEvent]:
        """The changes to the jobs' pods after `resource_version`."""
        return self.api.watch_pods(
            self.namespace, resource_version=resource_version, label_selector=JOB_LABEL, timeout_s=self.watch_timeout_s
        )

    async def seen(self, name: str, before: Any | None, after: Any, emit: SignalSink) -> None:
        """Signal the pod's fault once; a deletion someone else began (a deletionTimestamp) is one."""
        pod = view(after)
        found = fault(after)
        if found is None and pod.deleting:
            found = ComputeSignalKind.NODE_FAIL, "deleted by someone else"
        if found is None:
            return
        if self.resource_version is None:  # the baseline: failed before this replica looked
            self.signalled.add(pod.uid)
            return
        await self._signal(pod, *found, emit=emit)

    async def gone(self, name: str, before: Any, emit: SignalSink) -> None:
        """A pod deleted: a signal when neither Reprise deleted it nor it was signalled already."""
        pod = view(before)
        await self._signal(pod, ComputeSignalKind.NODE_FAIL, "deleted by someone else", emit=emit)
        self.released.discard(name)
        self.signalled.discard(pod.uid)

    async def _signal(self, pod: PodView, kind: ComputeSignalKind, what: str, *, emit: SignalSink) -> None:
        if pod.released or pod.name in self.released or pod.uid in self.signalled:
            return
        self.signalled.add(pod.uid)
        signal = pod_signal(pod, kind, what, backend=self.backend)
        log.warning(
            "Kubernetes pod fault",
            extra={
                "pod": pod.name,
                "job_id": signal.job_id,
                "node_id": signal.node_id,
                "kind": kind.value,
                "what": what,
            },
        )
        await emit(signal)
