"""The ``[discovery]`` settings (docs/behaviour.md "Engines that come and go"): where engines that come and go are read
from.

Why a module of its own: the sources are a small language (a watched file, DNS names with their
role and port) whose rules — an SRV name carries its own ports, a plain one needs ``port`` — are
checked here, at start, in one line naming the key, so the supervisor's loop never meets a
source it cannot read for a reason the operator could have been told at start.

Chosen where docs/behaviour.md "Engines that come and go" is silent (README "Engines that come and go"):

* ``resolver`` — ``HOST:PORT`` of the DNS server to ask (empty: the host's ``/etc/resolv.conf``).
  An operator needs it where the cluster DNS is not the host's (a router outside the cluster),
  and the tests use it to ask a real server on 127.0.0.1 instead of patching a resolver.
* ``max_inflight_prefill`` / ``max_inflight_decode`` on a DNS name — the caps of every engine
  its records list (the pods of one StatefulSet are alike), as an ``[[engines]]`` entry has them.
* ``max_engines`` — the engine slots of the shared-memory layout once a source is set (default
  256); with no source, ``server.max_engines`` sizes them as before.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEFAULT_DISCOVERED_SLOTS = 256


class DnsSource(BaseModel):
    """One DNS name whose records are engines (a headless Service)."""

    model_config = ConfigDict(extra="forbid")

    name: Annotated[str, Field(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9_.\-]+\.?$")]
    port: Annotated[int, Field(ge=1, le=65535)] | None = None
    srv: bool = False  # take host and port from SRV records (then ``port`` is not used)
    role: Literal["producer", "consumer", "both"]
    scheme: Literal["http", "https"] = "http"
    # Given to every engine the name's records list (a StatefulSet's pods are alike).
    max_inflight_prefill: Annotated[int, Field(ge=1)] | None = None
    max_inflight_decode: Annotated[int, Field(ge=1)] | None = None

    @model_validator(mode="after")
    def _port_or_srv(self) -> DnsSource:
        if not self.srv and self.port is None:
            raise ValueError("a port is needed unless srv = true (SRV records carry the port)")
        return self


class KubernetesSource(BaseModel):
    """``[discovery.kubernetes]``: the engines of one namespace, from its EndpointSlices (docs/behaviour.md
    "Engines that come and go")."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    namespace: Annotated[str, Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")]
    """the namespace whose EndpointSlices are watched (list and watch there: deploy/kubernetes/rbac.yaml)"""
    producer_selector: str = ""
    """label selector of the producers' EndpointSlices, e.g. `kubernetes.io/service-name=vllm-prefill` (`""`: none)"""
    consumer_selector: str = ""
    """label selector of the consumers' EndpointSlices (`""`: none)"""
    both_selector: str = ""
    """label selector of the EndpointSlices of engines that both prefill and decode (`""`: none)"""
    port: Annotated[int, Field(ge=1, le=65535)] | None = None
    """the engines' port (unset: the slice's port named `port_name`, else its only port)"""
    port_name: str = "http"
    """the slice port to take when `port` is unset"""
    scheme: Literal["http", "https"] = "http"
    """how the engines are spoken to"""
    kubeconfig: str = ""
    """a kubeconfig file (`""`: the pod's service account, in-cluster)"""

    @model_validator(mode="after")
    def _a_selector(self) -> KubernetesSource:
        if not (self.producer_selector or self.consumer_selector or self.both_selector):
            raise ValueError("set producer_selector, consumer_selector or both_selector")
        return self

    def selectors(self) -> list[tuple[Literal["producer", "consumer", "both"], str]]:
        """(role, label selector) for each role that has one."""
        roles: tuple[tuple[Literal["producer", "consumer", "both"], str], ...] = (
            ("producer", self.producer_selector), ("consumer", self.consumer_selector), ("both", self.both_selector))
        return [(role, sel) for role, sel in roles if sel]


class DiscoverySettings(BaseModel):
    """``[discovery]``: engines beside the static ``[[engines]]``, re-read every ``interval_s``."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    interval_s: Annotated[float, Field(gt=0, le=3600)] = 5
    """each discovery source is re-read this often; changes apply within it"""
    file: str = ""
    """a watched TOML (or `.json`) file of `[[engines]]` entries (`""`: none)"""
    dns: list[DnsSource] = []
    """`[[discovery.dns]]` entries: `name` (A/AAAA records are engines), `port` or `srv = true`, `role`, `scheme`,
    optional `max_inflight_prefill` / `max_inflight_decode` for every engine it lists"""
    resolver: str = ""
    """`HOST:PORT` of the DNS server to ask (`""`: the host's `/etc/resolv.conf`)"""
    kubernetes: KubernetesSource | None = None
    """`[discovery.kubernetes]`: engines from a namespace's EndpointSlices, watched: `namespace`,
    `producer_selector` / `consumer_selector` / `both_selector`, `port` or `port_name`, `scheme`, `kubeconfig`
    (docs/deploy.md "Kubernetes discovery")"""
    max_engines: Annotated[int, Field(ge=1, le=4096)] = DEFAULT_DISCOVERED_SLOTS
    """the shared layout's engine slots once a source is set (static and discovered together)"""

    @field_validator("resolver")
    @classmethod
    def _host_port(cls, value: str) -> str:
        if value:
            host, sep, port = value.rpartition(":")
            if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
                raise ValueError("expected HOST:PORT of a DNS server (empty: the host's resolv.conf)")
        return value

    @property
    def enabled(self) -> bool:
        """Is any source set? Without one the fleet is exactly ``[[engines]]``."""
        return bool(self.file or self.dns or self.kubernetes)

    def slots(self, static_slots: int) -> int:
        """The shared layout's engine slots: ``max_engines`` once a source is set (engines come
        and go at run time), else ``static_slots`` (``server.max_engines``: room for reloads)."""
        return self.max_engines if self.enabled else static_slots

    @property
    def slots_key(self) -> str:
        """The setting that bounds the engine slots now, for the error line that names it."""
        return "discovery.max_engines" if self.enabled else "server.max_engines"

    def refusal(self, static_engines: int) -> str | None:
        """Why ``narwhal serve`` cannot start (None: it can): with no static engine and no source
        a router could never serve anything."""
        if static_engines or self.enabled:
            return None
        return "engines: no engine to route to: add [[engines]] entries or a [discovery] source (file or dns)"

    def resolver_address(self) -> tuple[str, int] | None:
        """The ``resolver`` setting as (host, port), brackets off an IPv6 host; None: the host's resolv.conf."""
        if not self.resolver:
            return None
        host, _, port = self.resolver.rpartition(":")
        return host.strip("[]"), int(port)
