"""The one adapter between the Kubernetes backend and the API server, on the official client's asyncio twin.

Every call has a timeout; every error the server answers comes back as one of Reprise's errors, naming what was asked
(the verb, the resource, the namespace): a 403 says which permission the backend's identity lacks, a 409 is a write
whose resourceVersion was stale (the caller reads again and retries), a 404 an unknown object, and an unreachable or
failing server is KubeUnavailableError (the request may be repeated once it is back).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from kubernetes.aio import client
from kubernetes.aio.client.exceptions import ApiException
from kubernetes.aio.watch import Watch

from reprise_common.errors import DependencyUnavailableError, RepriseError

MERGE_PATCH = "application/merge-patch+json"


class KubeError(RepriseError):
    """The API server refused or failed a request; `verb`, `resource` and `namespace` say which."""

    def __init__(self, message: str, *, verb: str, resource: str, namespace: str | None = None) -> None:
        super().__init__(message)
        self.verb = verb
        self.resource = resource
        self.namespace = namespace


class KubeForbiddenError(KubeError):
    """403: the backend's identity may not do this (its Role or ClusterRole does not grant the verb)."""


class KubeConflictError(KubeError):
    """409: the object changed since it was read (a stale resourceVersion), or it exists already."""


class KubeExpiredError(KubeError):
    """410: a watch's resourceVersion is older than the server keeps (compacted): list again, then watch from there."""


class KubeNotFoundError(KubeError):
    """404: no such object."""


class KubeUnavailableError(KubeError, DependencyUnavailableError):
    """The API server did not answer, or answered with a server error; the request may be repeated."""

    dependency = "the Kubernetes API server"


@dataclass(frozen=True)
class WatchEvent:
    """One change a watch saw: ADDED, MODIFIED, DELETED (with the object: a V1Node, a V1Pod), or BOOKMARK (a position
    only, no object)."""

    type: str
    object: Any
    resource_version: str


@dataclass(frozen=True)
class KubeAccess:
    """How the backend reaches the API server: its address, the CA that signed its certificate, a bearer token."""

    url: str
    token: str
    ca_file: str | None = None
    timeout_s: float = 10.0


def _where(namespace: str | None) -> str:
    return f"in namespace {namespace}" if namespace else "at the cluster scope"


def _server_message(exc: ApiException) -> str:
    try:
        body = json.loads(exc.body or "{}")
    except (TypeError, ValueError):
        return str(exc.reason or "")
    return str(body.get("message") or exc.reason or "") if isinstance(body, dict) else str(exc.reason or "")


_BY_STATUS: dict[int, tuple[type[KubeError], str]] = {
    409: (KubeConflictError, "conflicted"),
    410: (KubeExpiredError, "expired"),
    404: (KubeNotFoundError, "not found"),
    429: (KubeUnavailableError, "the API server is overloaded"),
}


def translate(exc: ApiException, *, verb: str, resource: str, namespace: str | None = None) -> KubeError:
    """The server's error as one of ours, naming the verb, the resource and the namespace."""
    said = _server_message(exc)
    where = _where(namespace)
    if exc.status == 403:
        message = (
            f"the Kubernetes backend may not {verb} {resource} {where}: its identity lacks this permission "
            f"(grant `{verb}` on `{resource}` in the backend's Role or ClusterRole); the API server said: {said}"
        )
        return KubeForbiddenError(message, verb=verb, resource=resource, namespace=namespace)
    status = exc.status or 0
    kind, what = _BY_STATUS.get(status, (KubeError, f"refused ({status})"))
    if status == 0 or status >= 500:
        kind, what = KubeUnavailableError, f"the API server failed ({status or 'no status'})"
    return kind(f"{verb} {resource} {where}: {what}: {said}", verb=verb, resource=resource, namespace=namespace)


class KubeApi:
    """The calls the backend makes, each typed, timed out and translated (see the module's docstring)."""

    def __init__(self, access: KubeAccess) -> None:
        configuration = client.Configuration(
            host=access.url, api_key={"BearerToken": access.token}, api_key_prefix={"BearerToken": "Bearer"}
        )
        configuration.ssl_ca_cert = access.ca_file
        self.timeout_s = access.timeout_s
        self.api_client = client.ApiClient(configuration)
        self.core = client.CoreV1Api(self.api_client)

    async def close(self) -> None:
        """Close the client's connections."""
        await self.api_client.close()

    async def _call(self, call: Any, *, verb: str, resource: str, namespace: str | None = None) -> Any:
        try:
            return await asyncio.wait_for(call, timeout=self.timeout_s + 1.0)
        except ApiException as exc:
            raise translate(exc, verb=verb, resource=resource, namespace=namespace) from exc
        except (TimeoutError, OSError, aiohttp.ClientError) as exc:
            raise KubeUnavailableError(
                f"{verb} {resource} {_where(namespace)}: the API server did not answer: {exc!r}",
                verb=verb,
                resource=resource,
                namespace=namespace,
            ) from exc

    async def get_node(self, name: str) -> client.V1Node:
        """The node as the server has it now (its resourceVersion included)."""
        found = await self._call(
            self.core.read_node(name, _request_timeout=self.timeout_s), verb="get", resource="nodes"
        )
        assert isinstance(found, client.V1Node)
        return found

    async def patch_node(self, name: str, patch: dict[str, Any]) -> client.V1Node:
        """A JSON merge patch of the node; one carrying `metadata.resourceVersion` is refused (409) when stale."""
        changed = await self._call(
            self.core.patch_node(name, patch, _content_type=MERGE_PATCH, _request_timeout=self.timeout_s),
            verb="patch",
            resource="nodes",
        )
        assert isinstance(changed, client.V1Node)
        return changed

    async def list_nodes(self, *, label_selector: str | None = None) -> client.V1NodeList:
        """The nodes (matching `label_selector`) and the list's resourceVersion, where a watch resumes."""
        found = await self._call(
            self.core.list_node(label_selector=label_selector, _request_timeout=self.timeout_s),
            verb="list",
            resource="nodes",
        )
        assert isinstance(found, client.V1NodeList)
        return found

    async def list_pods(self, namespace: str, *, label_selector: str | None = None) -> client.V1PodList:
        """The pods of a namespace (matching `label_selector`)."""
        found = await self._call(
            self.core.list_namespaced_pod(namespace, label_selector=label_selector, _request_timeout=self.timeout_s),
            verb="list",
            resource="pods",
            namespace=namespace,
        )
        assert isinstance(found, client.V1PodList)
        return found

    async def delete_pod(self, namespace: str, name: str) -> None:
        """Delete one pod."""
        await self._call(
            self.core.delete_namespaced_pod(name, namespace, _request_timeout=self.timeout_s),
            verb="delete",
            resource="pods",
            namespace=namespace,
        )

    async def annotate_pod(self, namespace: str, name: str, annotations: dict[str, str]) -> None:
        """Add annotations to one pod (a JSON merge patch)."""
        await self._call(
            self.core.patch_namespaced_pod(
                name,
                namespace,
                {"metadata": {"annotations": annotations}},
                _content_type=MERGE_PATCH,
                _request_timeout=self.timeout_s,
            ),
            verb="patch",
            resource="pods",
            namespace=namespace,
        )

    async def create_pod(self, namespace: str, pod: client.V1Pod) -> client.V1Pod:
        """Create a pod; KubeConflictError when one of that name exists."""
        created = await self._call(
            self.core.create_namespaced_pod(namespace, pod, _request_timeout=self.timeout_s),
            verb="create",
            resource="pods",
            namespace=namespace,
        )
        assert isinstance(created, client.V1Pod)
        return created

    async def watch_nodes(
        self, *, resource_version: str, label_selector: str | None = None, timeout_s: int = 60
    ) -> AsyncIterator[WatchEvent]:
        """The changes to nodes after `resource_version`, for up to `timeout_s` (the server ends the watch then);
        KubeExpiredError when that version is older than the server keeps."""
        async for event in self._watch(
            self.core.list_node,
            client.V1Node,
            resource="nodes",
            resource_version=resource_version,
            label_selector=label_selector,
            timeout_s=timeout_s,
        ):
            yield event

    async def watch_pods(
        self, namespace: str, *, resource_version: str, label_selector: str | None = None, timeout_s: int = 60
    ) -> AsyncIterator[WatchEvent]:
        """The changes to a namespace's pods after `resource_version`, as `watch_nodes` does for nodes."""
        async for event in self._watch(
            self.core.list_namespaced_pod,
            client.V1Pod,
            namespace,
            resource="pods",
            resource_version=resource_version,
            label_selector=label_selector,
            timeout_s=timeout_s,
        ):
            yield event

    async def _watch(
        self,
        lister: Any,
        kind: type,
        *args: str,
        resource: str,
        resource_version: str,
        label_selector: str | None,
        timeout_s: int,
    ) -> AsyncIterator[WatchEvent]:
        namespace = args[0] if args else None
        watch = Watch()
        try:
            stream = watch.stream(
                lister,
                *args,
                resource_version=resource_version,
                label_selector=label_selector,
                allow_watch_bookmarks=True,
                timeout_seconds=timeout_s,
                _request_timeout=timeout_s + self.timeout_s,
            )
            async for event in stream:
                found = event["object"] if isinstance(event["object"], kind) else None
                yield WatchEvent(type=str(event["type"]), object=found, resource_version=str(watch.resource_version))
        except ApiException as exc:
            raise translate(exc, verb="watch", resource=resource, namespace=namespace) from exc
        except (TimeoutError, OSError, aiohttp.ClientError) as exc:
            raise KubeUnavailableError(
                f"watch {resource} {_where(namespace)}: the API server did not answer: {exc!r}",
                verb="watch",
                resource=resource,
                namespace=namespace,
            ) from exc
        finally:
            await watch.close()
