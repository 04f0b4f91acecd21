"""Engines from Kubernetes EndpointSlices (docs/behaviour.md "Engines that come and go", docs/deploy.md
"Kubernetes discovery").

Per role with a label selector (``[discovery.kubernetes]``), one task lists the namespace's
EndpointSlices that match and then watches them from the list's ``resourceVersion`` (bookmarks
asked for, so a quiet watch still moves its version), through ``kubernetes_asyncio``'s API
client (aiohttp: in-cluster service account or a kubeconfig). The membership is every
endpoint that is ready (``conditions.ready`` true, or unset: the API says to read unknown as
ready) and not terminating, at the slice's port (``port``, else the port named ``port_name``,
else its only one), named by its Pod (``targetRef.name``). An endpoint that turns not-ready or
terminating, or whose slice is deleted, leaves the membership: discovery drains it (no new
placements, its streams finish).

Invariants, and why:

* **EndpointSlices, not Pods**: readiness as the Service sees it (the same signal every load
  balancer in the cluster acts on), the port by name without reading Pod specs, and an RBAC of
  one resource; docs/decisions.md "Kubernetes discovery" says more.
* **Never forget on an outage.** A watch that ends (or is dropped) is resumed from its last version; a ``410
  Gone`` (the version compacted away) relists; an API server that cannot be reached keeps the
  last membership, is said once per outage, and is retried with exponential backoff (0.5 s to
  30 s) with jitter. A source never listed is unreadable (discovery keeps what it had).
* **Untrusted answers.** A slice or event that is not the shape the API documents is skipped
  with one line (once per reason); nothing it holds raises out of the task, and a task that
  fails anyway is restarted after its backoff.
* **Event-driven.** Each change calls ``on_change`` (the discovery reads at its next pass,
  within the supervisor's 20 ms loop), so a pod that becomes ready joins within one watch event
  plus its first checks, not within ``discovery.interval_s``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
from collections.abc import Callable
from typing import Any, Literal, cast

import aiohttp
import orjson
from kubernetes_asyncio import client as k8s_client
from kubernetes_asyncio import config as k8s_config
from kubernetes_asyncio.client.exceptions import ApiException
from pydantic import ValidationError

from narwhal.settings.discovery import KubernetesSource
from narwhal.settings.engines import EngineSpec
from narwhal.supervisor.discovery.wanted import engine_name

log = logging.getLogger("narwhal.discovery")

BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 30.0
WATCH_TIMEOUT_S = 300  # the API server ends the watch after this; it is resumed from its version
RESUME_S = 0.1  # a watch that ended is resumed after this: never a hot loop against a server that drops each one
MAX_LINE_BYTES = 16 << 20  # one watch event: a slice holds at most 1,000 endpoints


class Unshaped(ValueError):
    """An API answer that is not the shape the API documents."""


def _client_config(source: KubernetesSource) -> k8s_client.Configuration:
    """The API server's address and credentials: the kubeconfig named, else the pod's service account."""
    conf = k8s_client.Configuration()
    if source.kubeconfig:
        return conf  # filled by load_kube_config (async) in KubernetesWatch._api
    k8s_config.load_incluster_config(client_configuration=conf)  # type: ignore[no-untyped-call]
    return conf


Role = Literal["producer", "consumer", "both"]


def endpoints_of(raw: Any, role: Role, source: KubernetesSource) -> list[EngineSpec]:
    """The ready engines of one EndpointSlice (its raw JSON); :class:`Unshaped` when it is not one."""
    if not isinstance(raw, dict):
        raise Unshaped("an EndpointSlice that is not an object")
    kind = raw.get("addressType")
    if kind not in ("IPv4", "IPv6", "FQDN"):
        raise Unshaped(f"addressType {kind!r}")
    port = source.port if source.port is not None else _slice_port(raw.get("ports"), source.port_name)
    if port is None:
        raise Unshaped(f"no port named {source.port_name!r}, and not exactly one port (set port)")
    endpoints = raw.get("endpoints") or []
    if not isinstance(endpoints, list):
        raise Unshaped("endpoints that are not a list")
    found: list[EngineSpec] = []
    for endpoint in endpoints:
        if not isinstance(endpoint, dict):
            raise Unshaped("an endpoint that is not an object")
        conditions = endpoint.get("conditions") or {}
        if not isinstance(conditions, dict):
            raise Unshaped("conditions that are not an object")
        if conditions.get("ready") is False or conditions.get("terminating") is True:
            continue
        addresses = endpoint.get("addresses")
        if not isinstance(addresses, list) or not addresses or not isinstance(addresses[0], str):
            raise Unshaped("an endpoint without addresses")
        url = f"{source.scheme}://{_host(addresses[0], kind)}:{port}"
        ref = endpoint.get("targetRef")
        pod = ref.get("name") if isinstance(ref, dict) else None
        try:
            found.append(EngineSpec(name=pod if isinstance(pod, str) and pod else engine_name(role, url),
                                    url=url, role=role))
        except ValidationError as exc:
            raise Unshaped(f"endpoint {addresses[0]!r}: {exc.errors()[0]['msg']}") from None
    return found


def _slice_port(ports: Any, name: str) -> int | None:
    if not isinstance(ports, list):
        return None
    valid = [p for p in ports if isinstance(p, dict) and type(p.get("port")) is int and 0 < p["port"] < 65536]
    named = [p["port"] for p in valid if p.get("name") == name]
    if named:
        return int(named[0])
    return int(valid[0]["port"]) if len(valid) == 1 else None


def _host(address: str, kind: str) -> str:
    if kind == "FQDN":
        return address
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        raise Unshaped(f"address {address!r} is not an IP address") from None
    return f"[{parsed}]" if parsed.version == 6 else str(parsed)


def _metadata(raw: Any, key: str) -> str:
    """``metadata.<key>`` of an API object, a non-empty string; :class:`Unshaped` otherwise."""
    meta = raw.get("metadata") if isinstance(raw, dict) else None
    value = meta.get(key) if isinstance(meta, dict) else None
    if not isinstance(value, str) or not value:
        raise Unshaped(f"no metadata.{key}")
    return value


def _slice_key(raw: Any) -> str:
    return _metadata(raw, "name")


def _version(raw: Any) -> str:
    return _metadata(raw, "resourceVersion")


class KubernetesWatch:
    """The ``[discovery.kubernetes]`` source: one list-and-watch task per role (the module's text)."""

    def __init__(self, source: KubernetesSource, on_change: Callable[[], None]) -> None:
        self.source = source
        self.on_change = on_change
        self.slices: dict[str, dict[str, list[EngineSpec]]] = {role: {} for role, _ in source.selectors()}
        self.listed: set[str] = set()  # roles listed at least once: their membership is known
        self._tasks: list[asyncio.Task[None]] = []
        self._api: k8s_client.ApiClient | None = None
        self._down: str | None = None  # the outage said, until the API server answers again
        self._said: set[str] = set()

    def start(self) -> None:
        """Start the tasks (once, from the supervisor's loop)."""
        if not self._tasks:
            self._tasks = [asyncio.ensure_future(self._follow(role, sel)) for role, sel in self.source.selectors()]

    def close(self) -> None:
        """Stop the tasks (the supervisor stops)."""
        for task in self._tasks:
            task.cancel()
        self._tasks = []

    def engines(self) -> list[EngineSpec] | None:
        """The ready engines of every role, sorted by URL; None until every role was listed once."""
        if len(self.listed) < len(self.slices):
            return None
        found = {spec.url: spec for by_slice in self.slices.values() for specs in by_slice.values() for spec in specs}
        return [found[url] for url in sorted(found)]

    async def _client(self) -> k8s_client.ApiClient:
        if self._api is None:
            conf = _client_config(self.source)
            if self.source.kubeconfig:
                await k8s_config.load_kube_config(config_file=self.source.kubeconfig, client_configuration=conf)
            self._api = k8s_client.ApiClient(configuration=conf)
        return self._api

    async def _follow(self, role: Role, selector: str) -> None:
        backoff = BACKOFF_MIN_S
        while True:
            try:
                api = k8s_client.DiscoveryV1Api(await self._client())
                version: str | None = await self._list(api, role, selector)
                backoff = BACKOFF_MIN_S
                while version is not None:
                    version = await self._watch(api, role, selector, version)
                log.info("discovery: kubernetes: the watch of %s engines is too old (410 Gone): listing again", role)
                continue
            except asyncio.CancelledError:
                raise
            except (ApiException, aiohttp.ClientError, OSError, TimeoutError, Unshaped,
                    k8s_config.ConfigException) as exc:
                self._outage(role, exc)
            except Exception as exc:  # whatever the API server sends, the task goes on
                self._outage(role, exc)
            await asyncio.sleep(backoff * random.uniform(0.5, 1.5))
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    def _outage(self, role: str, exc: BaseException) -> None:
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        if self._down is None:
            kept = len(self.engines() or [])
            log.warning("discovery: kubernetes API server not answering for %s engines (%s): keeping the last "
                        "membership (%d engines), retrying with backoff", role, why, kept)
        self._down = why

    async def _list(self, api: k8s_client.DiscoveryV1Api, role: Role, selector: str) -> str:
        resp = cast(aiohttp.ClientResponse, await api.list_namespaced_endpoint_slice(
            self.source.namespace, label_selector=selector, _preload_content=False, _request_timeout=30))
        try:
            if resp.status != 200:
                raise ApiException(status=resp.status, reason=resp.reason)
            body = orjson.loads(await resp.read())
        finally:
            resp.release()
        items = body.get("items") if isinstance(body, dict) else None
        if not isinstance(items, list):
            raise Unshaped("a list without items")
        slices: dict[str, list[EngineSpec]] = {}
        for raw in items:
            self._take(slices, role, raw)
        self.slices[role] = slices
        self.listed.add(role)
        if self._down is not None:
            log.info("discovery: kubernetes API server answering again (%s engines listed)", role)
            self._down = None
        self.on_change()
        return _version(body)

    async def _watch(self, api: k8s_client.DiscoveryV1Api, role: Role, selector: str, version: str) -> str | None:
        """Follow the watch from ``version`` until it ends; the version to resume from (None: 410, relist)."""
        resp = cast(aiohttp.ClientResponse, await api.list_namespaced_endpoint_slice(
            self.source.namespace, label_selector=selector, watch=True, allow_watch_bookmarks=True,
            resource_version=version, timeout_seconds=WATCH_TIMEOUT_S, _preload_content=False,
            _request_timeout=aiohttp.ClientTimeout(sock_connect=30, sock_read=WATCH_TIMEOUT_S + 30)))
        try:
            if resp.status == 410:
                return None
            if resp.status != 200:
                raise ApiException(status=resp.status, reason=resp.reason)
            while True:
                try:
                    line = await resp.content.readline()
                except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, ConnectionError):
                    line = b""  # dropped mid-stream (a proxy, an API server restart): routine for a watch
                if not line:  # the watch ended: resume from the last version, a moment later
                    await asyncio.sleep(RESUME_S)
                    return version
                if len(line) > MAX_LINE_BYTES:
                    raise Unshaped("a watch event over 16 MiB")
                moved = self._event(role, line)
                if moved is None:
                    return None
                version = moved
        finally:
            resp.release()

    def _event(self, role: Role, line: bytes) -> str | None:
        """Apply one watch event; the version it brings (None: a 410, relist)."""
        try:
            event = orjson.loads(line)
        except orjson.JSONDecodeError:
            raise Unshaped("a watch line that is not JSON") from None
        kind = event.get("type") if isinstance(event, dict) else None
        raw = event.get("object") if isinstance(event, dict) else None
        if kind == "ERROR":
            code = raw.get("code") if isinstance(raw, dict) else None
            if code == 410:
                return None
            raise ApiException(status=code if type(code) is int else 500, reason=str(raw)[:200])
        version = _version(raw)
        if kind == "BOOKMARK":
            return version
        slices = self.slices[role]
        if kind in ("ADDED", "MODIFIED"):
            self._take(slices, role, raw)
        elif kind == "DELETED":
            slices.pop(_slice_key(raw), None)
        else:
            raise Unshaped(f"a watch event of type {kind!r}")
        self.on_change()
        return version

    def _take(self, slices: dict[str, list[EngineSpec]], role: Role, raw: Any) -> None:
        """One slice's ready engines into ``slices``; a slice not of the documented shape is
        skipped (what it held before is dropped), said once per reason."""
        key = _slice_key(raw)
        try:
            slices[key] = endpoints_of(raw, role, self.source)
        except (Unshaped, TypeError, ValueError, AttributeError) as exc:  # whatever shape it has, it is one slice
            slices.pop(key, None)
            line = f"discovery: kubernetes: EndpointSlice {key!r} ({role}) refused: {exc}"
            if line not in self._said:
                self._said.add(line)
                log.warning("%s", line)
