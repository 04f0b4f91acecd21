"""The decode leg's states (engines.leg_state.LegState): the table in its text is NEXT, every
move the code makes is guarded by it, real legs walk it as written, and an illegal move (a caller
out of order) is an AssertionError, a programming error, not an engine's fault."""

from __future__ import annotations

import ast
import asyncio
import inspect
import re
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from narwhal.engines import decode, endpoints, leg_state
from narwhal.engines.client import EngineClient
from narwhal.engines.leg_state import NEXT, LegState
from narwhal.engines.prefill_result import PrefillResult
from narwhal.engines.relay import Signal
from narwhal.errors import EngineError
from narwhal.settings import EngineSettings

TOKEN = b'data: {"choices":[{"index":0,"text":"a"}]}\n\n'
DONE = b"data: [DONE]\n\n"
ERROR = b'data: {"error": {"message": "boom", "code": 500}}\n\n'
GATE = b"GATE"  # in a script: wait for the test to open the gate before the next chunk


class Ref:
    def __init__(self, url: str) -> None:
        self.name, self.url = "d0", url


class Script:
    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.gate = asyncio.Event()


@pytest.fixture
async def engine() -> AsyncIterator[tuple[str, Script]]:
    script = Script()

    async def answer(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "whole"}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in script.chunks:
            if chunk == GATE:
                await script.gate.wait()
            else:
                await resp.write(chunk)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", answer)
    server = TestServer(app)
    await server.start_server()
    yield str(server.make_url("")).rstrip("/"), script
    await server.close()


@pytest.fixture
async def client() -> AsyncIterator[EngineClient]:
    engines = EngineClient.for_settings(EngineSettings(first_token_timeout_s=2, decode_read_timeout_s=2))
    yield engines
    await engines.close()


def _leg(client: EngineClient, url: str, *, stream: bool = True) -> decode.DecodeLeg:
    result = PrefillResult(producer="p0", producer_url=url, endpoint=endpoints.BY_PATH["/v1/completions"],
                           request_id="r1", descriptor=None, crossed=False)
    return client.decode_leg(result, Ref(url), {"model": "m", "prompt": "x", "stream": stream}, None,
                            stream=stream)


def test_the_table_in_the_modules_text_is_next() -> None:
    assert leg_state.__doc__ is not None
    rows = re.findall(r"^    ([A-Z]+) +([A-Z, ]+[A-Z]|-)  ", leg_state.__doc__, re.MULTILINE)
    table = {state: set() if moves == "-" else set(moves.split(", ")) for state, moves in rows}
    assert table == {state.name: {s.name for s in NEXT[state]} for state in LegState}


def test_every_state_is_reachable_from_new_and_every_state_can_close() -> None:
    seen, todo = {LegState.NEW}, [LegState.NEW]
    while todo:
        for nxt in NEXT[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    assert seen == set(LegState)
    assert all(LegState.CLOSED in NEXT[s] for s in LegState if s is not LegState.CLOSED)


def test_every_move_in_the_code_is_guarded_by_next() -> None:
    tree = ast.parse(inspect.getsource(decode.DecodeLeg))
    unguarded = []
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef) or func.name == "__init__":
            continue
        for block in ast.walk(func):
            body = getattr(block, "body", None)
            if not isinstance(body, list):
                continue
            for i, stmt in enumerate(body):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else []
                names = [ast.unparse(t) for t in targets]
                if any("self._state" in n for n in names):
                    guard = body[i - 1] if i else None
                    if not (isinstance(guard, ast.Assert) and "NEXT[self._state]" in ast.unparse(guard)):
                        unguarded.append(f"{func.name}: {ast.unparse(stmt)}")
    assert unguarded == []


async def test_a_stream_walks_new_sent_awaiting_streaming_ended_closed(
    engine: tuple[str, Script], client: EngineClient
) -> None:
    url, script = engine
    script.chunks += [TOKEN, GATE, TOKEN + DONE]
    leg = _leg(client, url)
    assert leg.state is LegState.NEW and not leg.sent
    assert await leg.open() is None
    assert leg.state is LegState.AWAITING and leg.sent
    assert await leg.next_span() == TOKEN
    assert leg.state is LegState.STREAMING and not leg.ended
    script.gate.set()
    assert await leg.next_span() == TOKEN + DONE
    assert leg.state is LegState.ENDED and leg.ended
    assert await leg.next_span() is Signal.END
    conn = leg._conn
    assert conn is not None
    leg.close()
    assert leg.state is LegState.CLOSED and conn.reusable  # pooled, not closed
    leg.close()  # again: nothing
    assert leg.state is LegState.CLOSED and conn.reusable


async def test_a_whole_answer_goes_from_sent_to_ended(engine: tuple[str, Script], client: EngineClient) -> None:
    url, _ = engine
    leg = _leg(client, url, stream=False)
    assert b"whole" in (await leg.open() or b"")
    assert leg.state is LegState.ENDED
    leg.close()
    assert leg.state is LegState.CLOSED


async def test_an_error_after_output_is_failed_then_raised_and_the_connection_closed(
    engine: tuple[str, Script], client: EngineClient
) -> None:
    url, script = engine
    script.chunks += [TOKEN, GATE, TOKEN + ERROR]
    leg = _leg(client, url)
    await leg.open()
    assert await leg.next_span() == TOKEN
    script.gate.set()
    assert await leg.next_span() == TOKEN  # what came before the error goes out first
    assert leg.state is LegState.FAILED and not leg.ended
    with pytest.raises(EngineError) as failed:
        await leg.next_span()
    assert failed.value.reason == "engine_stream_error" and leg.state is LegState.FAILED
    conn = leg._conn
    assert conn is not None
    leg.close()
    assert leg.state is LegState.CLOSED and not conn.reusable  # closed: the engine aborts


async def test_a_refused_connect_stays_new_unsent(client: EngineClient) -> None:
    leg = _leg(client, "http://127.0.0.1:9")
    with pytest.raises(EngineError) as failed:
        await leg.open()
    assert failed.value.reason == "engine_unreachable"
    assert leg.state is LegState.NEW and not leg.sent  # the handoff reached nobody
    leg.close()
    assert leg.state is LegState.CLOSED


async def test_a_caller_out_of_order_is_a_programming_error(engine: tuple[str, Script], client: EngineClient) -> None:
    url, script = engine
    script.chunks += [TOKEN + DONE]
    leg = _leg(client, url)
    with pytest.raises(AssertionError, match="next_span\\(\\) in NEW"):
        await leg.next_span()
    await leg.open()
    with pytest.raises(AssertionError, match="open\\(\\) in AWAITING"):
        await leg.open()
    leg.close()
    with pytest.raises(AssertionError, match="next_span\\(\\) in CLOSED"):
        await leg.next_span()


def test_an_illegal_move_names_both_states() -> None:
    message = leg_state.illegal(LegState.ENDED, LegState.STREAMING)
    assert message == "decode leg: ENDED -> STREAMING is not a move (leg_state.NEXT)"
    assert LegState.STREAMING not in NEXT[LegState.ENDED]


def test_the_leg_sees_a_narrow_context_and_imports_nothing_from_the_client() -> None:
    # The client makes legs; a leg needs five things of it (DecodeContext), not the client.
    tree = ast.parse(inspect.getsource(decode))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "narwhal.engines.client" not in imported
    assert [f.name for f in decode.DecodeContext.__dataclass_fields__.values()] == [
        "post", "engine_headers", "first_token_timeout_s", "decode_read_timeout_s", "budget"]
