"""The kubelet's part, played by the tests (the API server runs without one): for the pods bound to its nodes, start
the pod's command as a local process with the pod's environment, write the pod's status through the status
subresource as a kubelet does (Running, then Succeeded or Failed with the exit code), and end the process when the pod
is deleted (a deletion of a running pod waits for its kubelet, which then deletes it with no grace). It can also do
what a real node does to a pod: evict it, or OOM-kill its process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections.abc import Coroutine
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
from kubernetes.aio import client
from kubernetes.aio.client.exceptions import ApiException
from kubernetes.aio.watch import Watch

from reprise_cli.kube_server import KubeApiServer
from reprise_orchestrator.compute.kubernetes.api import MERGE_PATCH

from .cluster import Admin

HOST_IP = "127.0.0.1"
T = TypeVar("T")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _value(env: client.V1EnvVar, pod: client.V1Pod) -> str:
    """An env var's value: given, or from the pod's own fields as the kubelet resolves them (those the tests use)."""
    if env.value_from is None:
        return env.value or ""
    path = env.value_from.field_ref.field_path
    fields = {"spec.nodeName": pod.spec.node_name, "status.hostIP": HOST_IP, "metadata.name": pod.metadata.name}
    return fields[path]


class Kubelet:
    """The kubelet of `nodes`, for the pods of one namespace: each running pod is a local process."""

    def __init__(self, admin: Admin, namespace: str, nodes: set[str], *, logs: Path) -> None:
        self.admin = admin
        self.namespace = namespace
        self.nodes = nodes
        self.logs = logs
        self.processes: dict[str, asyncio.subprocess.Process] = {}
        self.ended_by_node: set[str] = set()  # pods whose end the node wrote (evicted, OOM-killed): no exit status
        self._tasks: set[asyncio.Task[None]] = set()
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Follow the namespace's pods from now on (and the ones there already)."""
        found = await self.admin.core.list_namespaced_pod(self.namespace)
        for pod in found.items:
            await self._on(pod)
        self._watch = asyncio.create_task(self._follow(found.metadata.resource_version))

    async def stop(self) -> None:
        """Stop following and end every process (as a node going away would)."""
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        for name in list(self.processes):
            await self._end(name)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _follow(self, version: str) -> None:
        """Watch from `version`; when the API server goes away (or the watch expires), list again once it answers, as
        a kubelet does."""
        while True:
            try:
                await self._watch_from(version)
            except (ApiException, aiohttp.ClientError, OSError, TimeoutError):
                await asyncio.sleep(0.5)
                try:
                    found = await self.admin.core.list_namespaced_pod(self.namespace)
                except (ApiException, aiohttp.ClientError, OSError, TimeoutError):
                    continue
                for pod in found.items:
                    await self._on(pod)
                version = found.metadata.resource_version

    async def _watch_from(self, version: str) -> None:
        watch = Watch()
        try:
            async for event in watch.stream(
                self.admin.core.list_namespaced_pod, self.namespace, resource_version=version, timeout_seconds=60
            ):
                version = watch.resource_version
                if event["type"] in ("ADDED", "MODIFIED"):
                    await self._on(event["object"])
                elif event["type"] == "DELETED":
                    await self._end(event["object"].metadata.name)
        finally:
            await watch.close()
        raise TimeoutError("the watch ended: list again")  # simpler than going on from the last version

    async def _on(self, pod: client.V1Pod) -> None:
        name = pod.metadata.name
        if pod.spec.node_name not in self.nodes:
            return
        if pod.metadata.deletion_timestamp is not None:  # deleted: end the process, then remove the pod for good
            await self._end(name)
            with contextlib.suppress(ApiException):
                await self.admin.core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=0)
            return
        if name not in self.processes and (pod.status is None or pod.status.phase in (None, "Pending")):
            await self._run(pod)

    async def _run(self, pod: client.V1Pod) -> None:
        container = pod.spec.containers[0]
        env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root")}
        env |= {var.name: _value(var, pod) for var in container.env or []}
        name = pod.metadata.name
        with (self.logs / f"{name}.log").open("ab") as out:
            process = await asyncio.create_subprocess_exec(
                *(container.command or []),
                *(container.args or []),
                env=env,
                stdout=out,
                stderr=out,
                start_new_session=True,
            )
        self.processes[name] = process
        await self.write_status(name, "Running", {"running": {"startedAt": _now()}})
        task = asyncio.create_task(self._exited(name, process))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _exited(self, name: str, process: asyncio.subprocess.Process) -> None:
        code = await process.wait()
        if self.processes.get(name) is not process or name in self.ended_by_node:
            return  # ended by a deletion (nothing to write) or by the node (written already)
        self.processes.pop(name, None)
        phase = "Succeeded" if code == 0 else "Failed"
        ended = {
            "terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error", "finishedAt": _now()}
        }
        with contextlib.suppress(ApiException):
            await self.write_status(name, phase, ended)

    async def _end(self, name: str) -> None:
        process = self.processes.pop(name, None)
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), timeout=5)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()

    async def write_status(self, name: str, phase: str, state: dict[str, Any], **more: Any) -> None:
        """The pod's status as the kubelet writes it (through the status subresource)."""
        container = {
            "name": "agent",
            "ready": phase == "Running",
            "restartCount": 0,
            "image": "reprise-agent",
            "imageID": "",
            "state": state,
        }
        status = {"phase": phase, "hostIP": HOST_IP, "podIP": HOST_IP, "containerStatuses": [container], **more}
        await self.admin.core.patch_namespaced_pod_status(
            name, self.namespace, {"status": status}, _content_type=MERGE_PATCH
        )

    async def evict(self, name: str) -> None:
        """What a node under pressure does: end the pod's process and mark the pod Failed, Evicted."""
        self.ended_by_node.add(name)
        await self._end(name)
        ended = {"terminated": {"exitCode": 137, "reason": "Error", "finishedAt": _now()}}
        await self.write_status(
            name, "Failed", ended, reason="Evicted", message="The node was low on resource: memory."
        )

    async def oom_kill(self, name: str) -> None:
        """What the kernel does to a container over its memory limit: the process killed, the pod Failed."""
        self.ended_by_node.add(name)
        process = self.processes.pop(name)
        os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
        ended = {"terminated": {"exitCode": 137, "reason": "OOMKilled", "finishedAt": _now()}}
        await self.write_status(name, "Failed", ended)

    async def mark_preempted(self, name: str) -> None:
        """What the scheduler writes on a victim before it deletes it (Kubernetes 1.26 on): DisruptionTarget."""
        condition = {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByKubeScheduler",
                     "message": "preempted by a higher-priority pod", "lastTransitionTime": _now()}  # fmt: skip
        await self.write_status(name, "Running", {"running": {"startedAt": _now()}}, conditions=[condition])


class KubeletThread:
    """A Kubelet and the admin's client on an event loop of their own, for tests whose orchestrator runs in another
    (the TestClient's): `call` runs a coroutine there."""

    def __init__(self, server: KubeApiServer, namespace: str, nodes: dict[str, dict[str, str]], *, logs: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="kubelet", daemon=True)
        self.server, self.namespace, self.nodes, self.logs = server, namespace, nodes, logs
        self.admin: Admin | None = None
        self.kubelet: Kubelet | None = None

    def call(self, work: Coroutine[Any, Any, T], *, timeout_s: float = 30.0) -> T:
        """Run `work` on the kubelet's loop; its result."""
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout_s)

    def __enter__(self) -> KubeletThread:
        self.thread.start()
        self.call(self._start())
        return self

    def __exit__(self, *_: object) -> None:
        self.call(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()

    async def _start(self) -> None:
        self.admin = Admin(self.server)
        for name, labels in self.nodes.items():
            await self.admin.create_node(name, labels=labels)
        self.kubelet = Kubelet(self.admin, self.namespace, set(self.nodes), logs=self.logs)
        await self.kubelet.start()

    async def _stop(self) -> None:
        if self.kubelet is not None:
            await self.kubelet.stop()
        if self.admin is not None:
            await self.admin.close()
