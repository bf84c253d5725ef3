"""A job's `kubernetes` section (where its pods may run: a namespace, a node selector, a service account) and the
operator's allow-list it must stay inside. The section's syntax is checked when the body is read (unknown fields
refused, every value in Kubernetes' own spelling and bounds); whether the operator allows it is checked against the
replica's settings (`confine`), so that a job cannot place its pods in another team's namespace, on nodes it was not
given, or under an identity with more rights than the operator meant.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from reprise_common.labels import MAX_LABELS, Labels

MAX_NAMESPACE = 63  # a namespace is a DNS-1123 label
MAX_SERVICE_ACCOUNT = 253  # a service account's name is a DNS-1123 subdomain
ANY_VALUE = "*"  # in the operator's allow-list: any value of that node-selector key
_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_LABEL = re.compile(_LABEL)
_DNS_SUBDOMAIN = re.compile(rf"{_LABEL}(\.{_LABEL})*")


def namespace_name(value: str) -> str:
    """A namespace's name (a DNS-1123 label), or ValueError."""
    if len(value) > MAX_NAMESPACE or not _DNS_LABEL.fullmatch(value):
        raise ValueError(f"not a namespace name (at most {MAX_NAMESPACE} of a-z, 0-9 and '-'): {value!r}")
    return value


def service_account_name(value: str) -> str:
    """A service account's name (a DNS-1123 subdomain), or ValueError."""
    if len(value) > MAX_SERVICE_ACCOUNT or not _DNS_SUBDOMAIN.fullmatch(value):
        raise ValueError(f"not a service account name (a DNS subdomain of at most {MAX_SERVICE_ACCOUNT}): {value!r}")
    return value


Namespace = Annotated[str, AfterValidator(namespace_name)]
ServiceAccountName = Annotated[str, AfterValidator(service_account_name)]


class KubernetesSpec(BaseModel):
    """Where a job's pods run (the kubernetes backend only); each value left out is the operator's default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    namespace: Namespace | None = Field(default=None, description="the namespace of the job's pods")
    node_selector: Labels = Field(
        default_factory=dict, max_length=MAX_LABELS, description="node labels the job's pods require (nodeSelector)"
    )
    service_account: ServiceAccountName | None = Field(default=None, description="the identity the job's pods run as")
    spares: int = Field(default=1, ge=0, le=64, description="pods placed beyond the job's nodes, as its spares")


class NotAllowedError(ValueError):
    """A value of the section the operator did not allow; `field` is its place in the section."""

    def __init__(self, field: tuple[str, ...], message: str) -> None:
        super().__init__(message)
        self.field = field


def confine(
    spec: KubernetesSpec,
    *,
    namespaces: list[str],
    node_selectors: dict[str, list[str]],
    service_accounts: list[str],
) -> None:
    """Refuse (NotAllowedError naming the field) a namespace, node selector or service account outside what the
    operator allows: `node_selectors` maps each allowed key to its allowed values (`*`: any value)."""
    if spec.namespace is not None and spec.namespace not in namespaces:
        raise NotAllowedError(("namespace",), f"namespace {spec.namespace!r} is not allowed ({_listed(namespaces)})")
    for key, value in spec.node_selector.items():
        values = node_selectors.get(key)
        if values is None:
            allowed = _listed(list(node_selectors))
            raise NotAllowedError(("node_selector", key), f"node selector key {key!r} is not allowed ({allowed})")
        if ANY_VALUE not in values and value not in values:
            raise NotAllowedError(
                ("node_selector", key), f"node selector {key}={value!r} is not allowed ({_listed(values)})"
            )
    if spec.service_account is not None and spec.service_account not in service_accounts:
        allowed = _listed(service_accounts)
        raise NotAllowedError(
            ("service_account",), f"service account {spec.service_account!r} is not allowed ({allowed})"
        )


def _listed(names: list[str]) -> str:
    return f"allowed: {', '.join(names)}" if names else "the operator allows none"
