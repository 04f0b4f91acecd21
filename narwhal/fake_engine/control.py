"""The fleet's control server: how tests look inside engines and inject engine-wide faults.

Why a separate server rather than more ``/fake/*`` routes on each engine: ``stop`` must make an
engine refuse connections, and a stopped engine cannot answer its own ``start``. One control port
per fleet process also lets a test reach every engine's state from a single URL.

Invariant: the control server only reads and sets engine state through ``FakeEngine``'s own
methods (stats, records, faults, stop/start) and never serves a completion, so what a test sees
here is exactly what the engine's requests see, and a control call cannot disturb the wire format
a router is tested against. It sits above ``engine`` and below ``fleet``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import orjson
from aiohttp import web

from narwhal.fake_engine.engine import FakeEngine
from narwhal.fake_engine.faults import EngineFaults
from narwhal.fake_engine.state import BackgroundLoad, EngineModel

T = TypeVar("T")


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _error_body(status: int, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "BadRequestError", "param": None, "code": status}}


def _error(status: int, message: str) -> web.Response:
    return _json(_error_body(status, message), status)


async def _body_as(request: web.Request, parse: Callable[[bytes], T], what: str) -> T:
    """The request's body as ``parse`` reads it; a 400 ``invalid <what>: ...`` when it raises
    ``ValueError`` (pydantic's ValidationError and orjson's JSONDecodeError are ones)."""
    data = await request.read()
    try:
        return parse(data)
    except ValueError as exc:
        text = orjson.dumps(_error_body(400, f"invalid {what}: {exc}")).decode()
        raise web.HTTPBadRequest(text=text, content_type="application/json") from None


def _faults_view(engine: FakeEngine) -> dict[str, Any]:
    return {"name": engine.name, "faults": engine.faults.model_dump(mode="json", exclude_unset=True)}


def _model_view(engine: FakeEngine) -> dict[str, Any]:
    return {"name": engine.name, "model": engine.load_model.model_dump()}


def _background_view(engine: FakeEngine) -> dict[str, Any]:
    bg = engine.background
    return {"name": engine.name, "requests": bg.requests, "hold_s": bg.hold_s if bg.requests else None}


def _serving_view(engine: FakeEngine) -> dict[str, Any]:
    return {"name": engine.name, "serving": engine.serving, "url": engine.url}


class _Control:
    """The control routes over one fleet's engines (by name)."""

    def __init__(self, engines: Mapping[str, FakeEngine]) -> None:
        self.engines = engines

    def engine_of(self, request: web.Request) -> FakeEngine:
        name = request.match_info["name"]
        engine = self.engines.get(name)
        if engine is None:
            error = {"message": f"no engine {name!r}", "type": "NotFoundError", "param": None, "code": 404}
            raise web.HTTPNotFound(text=orjson.dumps({"error": error}).decode(), content_type="application/json")
        return engine

    async def all_stats(self, request: web.Request) -> web.Response:
        return _json({name: engine.stats() for name, engine in self.engines.items()})

    async def stats(self, request: web.Request) -> web.Response:
        return _json(self.engine_of(request).stats())

    async def get_requests(self, request: web.Request) -> web.Response:
        engine = self.engine_of(request)
        records = engine.get_records(request.query.get("contains"))
        return _json({"name": engine.name, "count": len(records), "requests": records})

    async def clear_requests(self, request: web.Request) -> web.Response:
        engine = self.engine_of(request)
        cleared = len(engine.records)
        engine.clear_records()
        return _json({"name": engine.name, "cleared": cleared})

    async def get_faults(self, request: web.Request) -> web.Response:
        return _json(_faults_view(self.engine_of(request)))

    async def put_faults(self, request: web.Request) -> web.Response:
        engine = self.engine_of(request)
        engine.set_faults(await _body_as(request, EngineFaults.model_validate_json, "faults"))
        return _json(_faults_view(engine))

    async def clear_faults(self, request: web.Request) -> web.Response:
        engine = self.engine_of(request)
        engine.clear_faults()
        return _json(_faults_view(engine))

    async def get_model(self, request: web.Request) -> web.Response:
        return _json(_model_view(self.engine_of(request)))

    async def put_model(self, request: web.Request) -> web.Response:
        """Change some of the load and cache models; keys left out keep their values."""
        engine = self.engine_of(request)

        def merged(data: bytes) -> EngineModel:
            changes = orjson.loads(data)
            if not isinstance(changes, dict):
                raise ValueError("a JSON object is required")
            return EngineModel.model_validate({**engine.load_model.model_dump(), **changes})

        engine.set_load_model(await _body_as(request, merged, "model"))
        return _json(_model_view(engine))

    async def get_background(self, request: web.Request) -> web.Response:
        return _json(_background_view(self.engine_of(request)))

    async def put_background(self, request: web.Request) -> web.Response:
        engine = self.engine_of(request)
        load = await _body_as(request, BackgroundLoad.model_validate_json, "background load")
        await engine.background.set(load.requests, load.hold_s)
        return _json(_background_view(engine))

    async def clear_background(self, request: web.Request) -> web.Response:
        engine = self.engine_of(request)
        await engine.background.stop()
        return _json(_background_view(engine))

    async def stop(self, request: web.Request) -> web.Response:
        engine = self.engine_of(request)
        await engine.stop()
        return _json(_serving_view(engine))

    async def start(self, request: web.Request) -> web.Response:
        engine = self.engine_of(request)
        if request.query.get("restart"):  # ?restart=1: a new process, not the same one listening again
            # &version=V: a new release (an upgrade); &scale_out=0|1: --enable-scale-out off or on
            scale_out = request.query.get("scale_out")
            engine.restarted(request.query.get("version"), None if scale_out is None else scale_out == "1")
        try:
            await engine.start(engine.listen_host)
        except OSError as exc:
            return _error(500, f"cannot listen again on port {engine.port}: {exc}")
        return _json(_serving_view(engine))

    async def reset(self, request: web.Request) -> web.Response:
        # Held blocks stay: they are the state under test, and leases clean them up anyway.
        for engine in self.engines.values():
            engine.clear_faults()
            engine.clear_records()
            await engine.background.stop()  # load injected behind the router's back is a fault too
        return _json({"reset": list(self.engines)})


def build_control_app(engines: Mapping[str, FakeEngine]) -> web.Application:
    """Routes: see the package docstring (``narwhal.fake_engine``) for the JSON shapes."""
    app = web.Application()
    control = _Control(engines)
    app.router.add_get("/engines", control.all_stats)
    app.router.add_get("/engines/{name}/stats", control.stats)
    app.router.add_get("/engines/{name}/requests", control.get_requests)
    app.router.add_delete("/engines/{name}/requests", control.clear_requests)
    app.router.add_get("/engines/{name}/faults", control.get_faults)
    app.router.add_put("/engines/{name}/faults", control.put_faults)
    app.router.add_delete("/engines/{name}/faults", control.clear_faults)
    app.router.add_get("/engines/{name}/model", control.get_model)
    app.router.add_put("/engines/{name}/model", control.put_model)
    app.router.add_get("/engines/{name}/background", control.get_background)
    app.router.add_put("/engines/{name}/background", control.put_background)
    app.router.add_delete("/engines/{name}/background", control.clear_background)
    app.router.add_post("/engines/{name}/stop", control.stop)
    app.router.add_post("/engines/{name}/start", control.start)
    app.router.add_post("/reset", control.reset)
    return app
