"""A small Kubernetes API server for the discovery tests: EndpointSlices of one namespace, listed
and watched over real HTTP on 127.0.0.1, as ``discovery.k8s.io/v1`` serves them.

* ``GET /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices?labelSelector=k=v,…``: an
  ``EndpointSliceList`` with ``metadata.resourceVersion``;
* the same with ``watch=1&resourceVersion=N``: newline-delimited ``{"type", "object"}`` events
  after version N (``ADDED``/``MODIFIED``/``DELETED``, a ``BOOKMARK`` when asked with
  ``allowWatchBookmarks``), kept open; a version older than the compaction point answers an
  ``ERROR`` event with a ``Status`` of code 410, as the API server does.

It serves from a thread of its own (its own event loop), so a test that blocks its loop while a
router starts still gets answers. The test drives it from its thread: :meth:`put` and
:meth:`delete` change slices (every open watch hears), :meth:`bookmark` sends one,
:meth:`compact` makes every version so far too old (the next watch gets 410),
:meth:`drop_watches` ends the open watches, :meth:`stop`/:meth:`start` take the server away and
back on the same port. A kubeconfig pointing at it: :meth:`kubeconfig`.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

T = TypeVar("T")
PATH = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"


def endpoint_slice(name: str, labels: dict[str, str], url: str, pod: str, *, ready: bool | None = True,
                   terminating: bool = False) -> dict[str, Any]:
    """One slice of one endpoint at ``url``'s address and port (the fakes listen on 127.0.0.1)."""
    host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
    conditions: dict[str, Any] = {"serving": ready is not False, "terminating": terminating}
    if ready is not None:
        conditions["ready"] = ready
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "llm", "labels": labels},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [host], "conditions": conditions,
                       "targetRef": {"kind": "Pod", "name": pod, "namespace": "llm"}}],
        "ports": [{"name": "http", "port": int(port), "protocol": "TCP"}],
    }


class KubeApi:
    """The fake API server (the module's text)."""

    def __init__(self, namespace: str = "llm") -> None:
        self.namespace = namespace
        self.slices: dict[str, dict[str, Any]] = {}
        self.version = 1
        self.compacted = 0  # a watch from a version at or below this gets 410
        self.events: list[tuple[int, str, dict[str, Any]]] = []
        self.requests: list[str] = []  # "list" or "watch", in order
        self.watched_from: list[int] = []  # each watch's resourceVersion, in order
        self.bookmarks_sent = 0  # BOOKMARK events written to open watches
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kube-api", daemon=True)
        self._thread.start()
        self._wake = self._call(lambda: asyncio.Event())
        self._watches: set[asyncio.Task[Any]] = set()  # the open watches' handlers
        self._runner: web.AppRunner | None = None
        self.port = 0

    def _call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the server's loop and wait for it."""
        async def run() -> T:
            return fn()
        return self._run(run())

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    def start(self) -> None:
        self._run(self._start())

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get(PATH, self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        if not self.port:
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def stop(self) -> None:
        """Take the server away (its port refuses connections until :meth:`start`)."""
        self._run(self._stop())

    async def _stop(self) -> None:
        self._drop()
        await asyncio.sleep(0)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def close(self) -> None:
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def kubeconfig(self, path: Path) -> str:
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{self.port}"}}],
            "users": [{"name": "router", "user": {"token": "narwhal-test"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "router"}}],
        }))
        return str(path)

    # -- the test's moves --------------------------------------------------------------------------

    def put(self, item: dict[str, Any]) -> None:
        def apply() -> None:
            name = item["metadata"]["name"]
            self._record("MODIFIED" if name in self.slices else "ADDED", item)
            self.slices[name] = item
        self._call(apply)

    def delete(self, name: str) -> None:
        self._call(lambda: self._record("DELETED", self.slices.pop(name)))

    def bookmark(self) -> None:
        def apply() -> None:
            self.version += 1
            self.events.append((self.version, "BOOKMARK", {"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
                                                           "metadata": {"resourceVersion": str(self.version)}}))
            self._notify()
        self._call(apply)

    def compact(self, through: int | None = None) -> None:
        """Every version through ``through`` (default: every one so far) is too old: a watch
        resumed from one gets 410."""
        self._call(lambda: setattr(self, "compacted", self.version if through is None else through))

    def drop_watches(self) -> None:
        """End every open watch (the client resumes from its last version)."""
        self._call(self._drop)

    def _drop(self) -> None:
        for task in list(self._watches):
            task.cancel()
        self._watches.clear()

    def _record(self, kind: str, item: dict[str, Any]) -> None:
        self.version += 1
        item = json.loads(json.dumps(item))
        item["metadata"]["resourceVersion"] = str(self.version)
        self.events.append((self.version, kind, item))
        self._notify()

    def _notify(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()

    # -- the API -----------------------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.match_info["namespace"] != self.namespace:
            return web.json_response({"kind": "Status", "code": 403}, status=403)
        wanted = dict(kv.split("=", 1) for kv in request.query.get("labelSelector", "").split(",") if "=" in kv)

        def matches(item: dict[str, Any]) -> bool:
            labels = item["metadata"].get("labels") or {}
            return all(labels.get(k) == v for k, v in wanted.items())

        if request.query.get("watch") not in ("1", "true", "True"):
            self.requests.append("list")
            return web.json_response({
                "kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                "metadata": {"resourceVersion": str(self.version)},
                "items": [item for item in self.slices.values() if matches(item)]})
        self.requests.append("watch")
        since = int(request.query.get("resourceVersion") or 0)
        self.watched_from.append(since)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        if since <= self.compacted:
            status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410, "reason": "Expired",
                      "message": f"too old resource version: {since} ({self.compacted})"}
            await resp.write(json.dumps({"type": "ERROR", "object": status}).encode() + b"\n")
            return resp
        bookmarks = request.query.get("allowWatchBookmarks") in ("1", "true", "True")
        task = asyncio.current_task()
        assert task is not None
        self._watches.add(task)
        try:
            while True:
                wake = self._wake
                for version, kind, item in [e for e in self.events if e[0] > since]:
                    since = version
                    if kind == "BOOKMARK" and not bookmarks:
                        continue
                    if kind == "BOOKMARK" or matches(item):
                        await resp.write(json.dumps({"type": kind, "object": item}).encode() + b"\n")
                        self.bookmarks_sent += kind == "BOOKMARK"
                await wake.wait()
        finally:
            self._watches.discard(task)
