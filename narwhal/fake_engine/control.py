"""The fleet's control server: how tests look inside engines and inject engine-wide faults.

Why a separate server rather than more ``/fake/*`` routes on each engine: ``stop`` must make an
engine refuse connections, and a stopped engine cannot answer its own ``start``. One control port
per fleet process also lets a test reach every engine's state from a single URL.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web
from pydantic import ValidationError

from narwhal.fake_engine.engine import FakeEngine
from narwhal.fake_engine.faults import EngineFaults


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _error(status: int, message: str) -> web.Response:
    return _json(
        {"error": {"message": message, "type": "BadRequestError", "param": None, "code": status}}, status
    )


def _faults_view(engine: FakeEngine) -> dict[str, Any]:
    return {"name": engine.name, "faults": engine.faults.model_dump(mode="json", exclude_unset=True)}


def _serving_view(engine: FakeEngine) -> dict[str, Any]:
    return {"name": engine.name, "serving": engine.serving, "url": engine.url}


def build_control_app(engines: Mapping[str, FakeEngine]) -> web.Application:
    """Routes: see the package docstring (``narwhal.fake_engine``) for the JSON shapes."""
    app = web.Application()

    def engine_of(request: web.Request) -> FakeEngine:
        name = request.match_info["name"]
        engine = engines.get(name)
        if engine is None:
            error = {"message": f"no engine {name!r}", "type": "NotFoundError", "param": None, "code": 404}
            raise web.HTTPNotFound(
                text=orjson.dumps({"error": error}).decode(), content_type="application/json"
            )
        return engine

    async def all_stats(request: web.Request) -> web.Response:
        return _json({name: engine.stats() for name, engine in engines.items()})

    async def stats(request: web.Request) -> web.Response:
        return _json(engine_of(request).stats())

    async def get_requests(request: web.Request) -> web.Response:
        engine = engine_of(request)
        records = engine.get_records(request.query.get("contains"))
        return _json({"name": engine.name, "count": len(records), "requests": records})

    async def clear_requests(request: web.Request) -> web.Response:
        engine = engine_of(request)
        cleared = len(engine.records)
        engine.clear_records()
        return _json({"name": engine.name, "cleared": cleared})

    async def get_faults(request: web.Request) -> web.Response:
        return _json(_faults_view(engine_of(request)))

    async def put_faults(request: web.Request) -> web.Response:
        engine = engine_of(request)
        try:
            faults = EngineFaults.model_validate_json(await request.read())
        except ValidationError as exc:
            return _error(400, f"invalid faults: {exc}")
        engine.set_faults(faults)
        return _json(_faults_view(engine))

    async def clear_faults(request: web.Request) -> web.Response:
        engine = engine_of(request)
        engine.clear_faults()
        return _json(_faults_view(engine))

    async def stop(request: web.Request) -> web.Response:
        engine = engine_of(request)
        await engine.stop()
        return _json(_serving_view(engine))

    async def start(request: web.Request) -> web.Response:
        engine = engine_of(request)
        try:
            await engine.start(engine.listen_host)
        except OSError as exc:
            return _error(500, f"cannot listen again on port {engine.port}: {exc}")
        return _json(_serving_view(engine))

    async def reset(request: web.Request) -> web.Response:
        # Held blocks stay: they are the state under test, and leases clean them up anyway.
        for engine in engines.values():
            engine.clear_faults()
            engine.clear_records()
        return _json({"reset": list(engines)})

    app.router.add_get("/engines", all_stats)
    app.router.add_get("/engines/{name}/stats", stats)
    app.router.add_get("/engines/{name}/requests", get_requests)
    app.router.add_delete("/engines/{name}/requests", clear_requests)
    app.router.add_get("/engines/{name}/faults", get_faults)
    app.router.add_put("/engines/{name}/faults", put_faults)
    app.router.add_delete("/engines/{name}/faults", clear_faults)
    app.router.add_post("/engines/{name}/stop", stop)
    app.router.add_post("/engines/{name}/start", start)
    app.router.add_post("/reset", reset)
    return app
