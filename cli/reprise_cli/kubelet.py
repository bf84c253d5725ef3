"""The kubelet's part for a cluster without one (the local Kubernetes stack, docs/kubernetes.md): for the pods bound
to its nodes in one namespace, start the pod's command as a local process with the pod's environment, write the pod's
status through the status subresource as a kubelet does (Running, then Succeeded or Failed with the exit code), and
end the process when the pod is deleted (a deletion of a running pod waits for its kubelet, which then removes it with
no grace). A lost node (`lose`) is what a host that dies looks like from the API server: its pods' processes end, the
node's kubelet writes nothing more about them, and the Node's Ready condition turns False. It can also do what a node
or the scheduler does to a pod: evict it, OOM-kill its process, mark it preempted. The orchestrator's kubernetes tests
run it too (services/orchestrator/tests/kubernetes/), as a `Kubelet` on their own loop or as a `KubeletThread`.

It speaks plain HTTP to the API server (httpx, which the CLI has already), on an event loop of its own in a thread
(`KubeletThread`): the stack calls into it (a lost node, the port an agent listens on) and the pods' processes are
its children, so they end with the stack, never orphaned by a kubelet process that died on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import ssl
import threading
from collections.abc import AsyncIterator, Coroutine
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import httpx

from reprise_common.errors import ConfigError

HOST_IP = "127.0.0.1"
MERGE_PATCH = "application/merge-patch+json"
WATCH_TIMEOUT_S = 60
T = TypeVar("T")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class KubeHttp:
    """A client of the API server with a bearer token (the admin's, here), for what a kubelet and its admin write."""

    def __init__(self, url: str, token: str, ca_file: Path) -> None:
        verify = ssl.create_default_context(cafile=str(ca_file))
        self.http = httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {token}"}, verify=verify, timeout=10.0
        )

    async def call(self, method: str, path: str, body: Any = None, **params: str) -> dict[str, Any]:
        """One request; the answer's JSON. ConfigError names what the server refused."""
        headers = {"Content-Type": MERGE_PATCH if method == "PATCH" else "application/json"}
        content = json.dumps(body).encode() if body is not None else None
        answer = await self.http.request(method, path, content=content, headers=headers, params=params)
        if answer.status_code >= 400:
            raise KubeRefused(answer.status_code, f"{method} {path}: {answer.status_code} {answer.text[:300]}")
        found = answer.json()
        return found if isinstance(found, dict) else {}

    async def watch(self, path: str, resource_version: str) -> AsyncIterator[dict[str, Any]]:
        """The changes after `resource_version`, one event at a time, until the server ends the watch."""
        params = {"watch": "1", "resourceVersion": resource_version, "timeoutSeconds": str(WATCH_TIMEOUT_S)}
        timeout = httpx.Timeout(10.0, read=WATCH_TIMEOUT_S + 10.0)
        async with self.http.stream("GET", path, params=params, timeout=timeout) as answer:
            if answer.status_code >= 400:
                raise KubeRefused(answer.status_code, f"watch {path}: {answer.status_code}")
            async for line in answer.aiter_lines():
                if line.strip():
                    yield json.loads(line)

    async def close(self) -> None:
        """Close the connections."""
        await self.http.aclose()


class KubeRefused(ConfigError):
    """The API server answered with an error status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _env_value(var: dict[str, Any], pod: dict[str, Any]) -> str:
    """An env var's value: given, or from the pod's own fields as the kubelet resolves them."""
    if "valueFrom" not in var:
        return str(var.get("value", ""))
    path = var["valueFrom"].get("fieldRef", {}).get("fieldPath", "")
    fields = {
        "spec.nodeName": pod["spec"].get("nodeName", ""),
        "status.hostIP": HOST_IP,
        "status.podIP": HOST_IP,
        "metadata.name": pod["metadata"]["name"],
        "metadata.namespace": pod["metadata"].get("namespace", ""),
    }
    return str(fields.get(path) or "")


class Kubelet:
    """The kubelet of `nodes`, for the pods of one namespace: each running pod is a local process."""

    def __init__(self, api: KubeHttp, namespace: str, nodes: set[str], *, logs: Path) -> None:
        self.api = api
        self.namespace = namespace
        self.nodes = nodes
        self.logs = logs
        self.processes: dict[str, asyncio.subprocess.Process] = {}
        self.node_of: dict[str, str] = {}  # pod name -> the node it runs on
        self.lost: set[str] = set()  # nodes gone: nothing of theirs is run or written any more
        self.ended_by_node: set[str] = set()  # pods whose end the node wrote (evicted, OOM-killed): no exit status
        self._tasks: set[asyncio.Task[None]] = set()
        self._watch: asyncio.Task[None] | None = None

    @property
    def pods_path(self) -> str:
        """The namespace's pods in the API."""
        return f"/api/v1/namespaces/{self.namespace}/pods"

    async def start(self) -> None:
        """Follow the namespace's pods from now on (and the ones there already)."""
        version = await self._list()
        self._watch = asyncio.create_task(self._follow(version))

    async def stop(self) -> None:
        """Stop following and end every process (as a node going away would)."""
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        await asyncio.gather(*(self._end(name) for name in list(self.processes)))
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _list(self) -> str:
        found = await self.api.call("GET", self.pods_path)
        for pod in found.get("items", []):
            await self._on(pod)
        return str(found["metadata"]["resourceVersion"])

    async def _follow(self, version: str | None) -> None:
        """Watch the pods, resuming where the last watch ended; a watch that expired (410) lists again."""
        while True:
            try:
                if version is None:
                    version = await self._list()
                async for event in self.api.watch(self.pods_path, version):
                    if event["type"] == "ERROR":
                        raise KubeRefused(int(event["object"].get("code", 500)), str(event["object"]))
                    pod = event["object"]
                    version = pod["metadata"]["resourceVersion"]
                    if event["type"] in ("ADDED", "MODIFIED"):
                        await self._on(pod)
                    elif event["type"] == "DELETED":
                        await self._end(pod["metadata"]["name"])
            except KubeRefused as exc:
                if exc.status == 410:
                    version = None
                    continue
                await asyncio.sleep(0.5)
            except httpx.HTTPError:
                await asyncio.sleep(0.5)  # the server restarts, or the connection broke: go on from the last version

    async def _on(self, pod: dict[str, Any]) -> None:
        name, node = pod["metadata"]["name"], pod["spec"].get("nodeName")
        if node not in self.nodes or node in self.lost:
            return
        if pod["metadata"].get("deletionTimestamp"):  # deleted: end the process, then remove the pod for good
            await self._end(name)
            with contextlib.suppress(KubeRefused, httpx.HTTPError):
                await self.api.call("DELETE", f"{self.pods_path}/{name}", {"gracePeriodSeconds": 0})
            return
        if name not in self.processes and pod.get("status", {}).get("phase") in (None, "Pending"):
            await self._run(pod, node)

    async def _run(self, pod: dict[str, Any], node: str) -> None:
        container = pod["spec"]["containers"][0]
        env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root")}
        env |= {var["name"]: _env_value(var, pod) for var in container.get("env", [])}
        name = pod["metadata"]["name"]
        with (self.logs / f"{name}.log").open("ab") as out:
            process = await asyncio.create_subprocess_exec(
                *container.get("command", []),
                *container.get("args", []),
                env=env,
                stdout=out,
                stderr=out,
                start_new_session=True,
            )
        self.processes[name], self.node_of[name] = process, node
        await self.write_status(name, "Running", {"running": {"startedAt": _now()}})
        task = asyncio.create_task(self._exited(name, process))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _exited(self, name: str, process: asyncio.subprocess.Process) -> None:
        code = await process.wait()
        if self.processes.get(name) is not process or name in self.ended_by_node:
            return  # ended by a deletion (nothing to write) or by the node (written already)
        self.processes.pop(name, None)
        if self.node_of.get(name) in self.lost:
            return  # a lost node's kubelet writes nothing
        phase = "Succeeded" if code == 0 else "Failed"
        ended = {
            "terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error", "finishedAt": _now()}
        }
        with contextlib.suppress(KubeRefused, httpx.HTTPError):
            await self.write_status(name, phase, ended)

    async def _end(self, name: str, *, grace_s: float = 5.0) -> None:
        process = self.processes.pop(name, None)
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
        try:
            await asyncio.wait_for(process.wait(), timeout=max(grace_s, 0.1))
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()

    async def write_status(self, name: str, phase: str, state: dict[str, Any], **more: Any) -> None:
        """The pod's status as the kubelet writes it (through the status subresource)."""
        container = {"name": "agent", "ready": phase == "Running", "restartCount": 0, "image": "reprise-agent"}
        container |= {"imageID": "", "state": state}
        status = {"phase": phase, "hostIP": HOST_IP, "podIP": HOST_IP, "containerStatuses": [container], **more}
        await self.api.call("PATCH", f"{self.pods_path}/{name}/status", {"status": status})

    async def lose(self, node: str, *, grace_s: float = 3.0) -> None:
        """The node is lost: its kubelet writes nothing more, its pods' processes end (given `grace_s` to end on
        their own, as an injected node loss ends its agent), and the Node's Ready condition turns False."""
        self.lost.add(node)
        mine = [name for name, on in self.node_of.items() if on == node and name in self.processes]
        waits = [self.processes[name].wait() for name in mine]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*waits), timeout=grace_s)
        await asyncio.gather(*(self._end(name, grace_s=0) for name in mine))
        await set_node_condition(self.api, node, "Ready", "False", reason="NodeLost", message="the host is gone")

    async def evict(self, name: str) -> None:
        """What a node under pressure does: end the pod's process and mark the pod Failed, Evicted."""
        self.ended_by_node.add(name)
        await self._end(name)
        ended = {"terminated": {"exitCode": 137, "reason": "Error", "finishedAt": _now()}}
        message = "The node was low on resource: memory."
        await self.write_status(name, "Failed", ended, reason="Evicted", message=message)

    async def oom_kill(self, name: str) -> None:
        """What the kernel does to a container over its memory limit: the process killed, the pod Failed."""
        self.ended_by_node.add(name)
        await self._end(name, grace_s=0)
        ended = {"terminated": {"exitCode": 137, "reason": "OOMKilled", "finishedAt": _now()}}
        await self.write_status(name, "Failed", ended)

    async def mark_preempted(self, name: str) -> None:
        """What the scheduler writes on a victim before it deletes it (Kubernetes 1.26 on): DisruptionTarget."""
        condition = {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByKubeScheduler",
                     "message": "preempted by a higher-priority pod", "lastTransitionTime": _now()}  # fmt: skip
        await self.write_status(name, "Running", {"running": {"startedAt": _now()}}, conditions=[condition])

    def pids_on(self, node: str) -> list[int]:
        """The processes of the live pods bound to `node`."""
        return [p.pid for name, p in self.processes.items() if self.node_of.get(name) == node and p.returncode is None]


async def set_node_condition(
    api: KubeHttp, node: str, kind: str, status: str, *, reason: str, message: str = ""
) -> None:
    """Write one condition through the node's status subresource, as the kubelet or the node controller does."""
    found = await api.call("GET", f"/api/v1/nodes/{node}")
    kept = [c for c in found.get("status", {}).get("conditions", []) if c["type"] != kind]
    now = _now()
    changed = {"type": kind, "status": status, "reason": reason, "message": message or reason}
    conditions = [*kept, changed | {"lastTransitionTime": now, "lastHeartbeatTime": now}]
    await api.call("PATCH", f"/api/v1/nodes/{node}/status", {"status": {"conditions": conditions}})


async def register_node(api: KubeHttp, node: str, *, labels: dict[str, str]) -> None:
    """Create the Node with `labels` and report it Ready, as a kubelet registers its node."""
    await api.call("POST", "/api/v1/nodes", {"metadata": {"name": node, "labels": labels}})
    await set_node_condition(api, node, "Ready", "True", reason="KubeletReady", message="kubelet is ready")


class KubeletThread:
    """A Kubelet and its client of the API server on an event loop of their own, in a thread; `call` runs a
    coroutine there from any other thread (the admin's writes too: `api` lives on that loop)."""

    def __init__(self, url: str, token: str, ca_file: Path, namespace: str, nodes: set[str], *, logs: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="kubelet", daemon=True)
        self.url, self.token, self.ca_file = url, token, ca_file
        self.namespace, self.nodes, self.logs = namespace, nodes, logs
        self.api: KubeHttp | None = None
        self.kubelet: Kubelet | None = None

    def call(self, work: Coroutine[Any, Any, T], *, timeout_s: float = 30.0) -> T:
        """Run `work` on the kubelet's loop; its result."""
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout_s)

    def open(self) -> KubeHttp:
        """Start the loop and open the client on it (the admin's writes can go through it from now on)."""
        self.thread.start()
        self.api = self.call(self._open())
        return self.api

    def start(self) -> None:
        """Start the kubelet: from now on it runs the pods bound to its nodes."""
        self.call(self._start())

    def stop(self) -> None:
        """End every pod's process, close the client and the loop."""
        if not self.thread.is_alive():
            return
        with contextlib.suppress(Exception):  # the pods' processes end whatever the server says
            self.call(self._stop(), timeout_s=60.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()

    async def _open(self) -> KubeHttp:
        return KubeHttp(self.url, self.token, self.ca_file)

    async def _start(self) -> None:
        assert self.api is not None
        self.logs.mkdir(parents=True, exist_ok=True)
        self.kubelet = Kubelet(self.api, self.namespace, self.nodes, logs=self.logs)
        await self.kubelet.start()

    async def _stop(self) -> None:
        if self.kubelet is not None:
            await self.kubelet.stop()
        if self.api is not None:
            await self.api.close()
