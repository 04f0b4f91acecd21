"""Hostile bodies against the real router (gunicorn, 2 workers): garbage bodies and a body in no
encoding (random headers on every route: ``security/test_client_headers.py``).

The property for every request: a 4xx in OpenAI's error shape (with ``x-narwhal-error``) or a
correct 200 — never a 5xx made by the router, never a traceback, and the workers stay alive.
Everything talks to 127.0.0.1; every wait is bounded.
"""

from __future__ import annotations

import json
import string
from typing import Any

import orjson
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from narwhal.testing.harness import RouterProcess
from tests.real_gunicorn.hostile_support import (
    CHAT,
    COMPLETIONS,
    assert_alive,
    assert_sane,
    worker_pids,
)
from tests.real_gunicorn.support import (
    MODEL,
    assert_openai_error,
    http_request,
)

# -- hypothesis: random bodies ---------------------------------------------------------------

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
JSON = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
WEIRD_NUMBERS = st.sampled_from(
    [-1, -(2**63), 2**63, 2**64 + 1, 10**30, -(10**30), 1.5, -0.0, 1e308, -1e308, 2.0, 3, 1e-300]
)
# Every field the router reads, each with values of the wrong type (or out of range).
WRONG = {
    "model": JSON | WEIRD_NUMBERS,
    "stream": st.sampled_from([0, 1, "true", "false", [], {}, 1.0]) | JSON,
    "max_tokens": WEIRD_NUMBERS | st.sampled_from(["5", True, False, [], {}]),
    "max_completion_tokens": WEIRD_NUMBERS | st.sampled_from(["5", True, [], {}]),
    "messages": st.sampled_from(["hi", 1, None, {}, [1], ["x"], [[]], [None]]) | JSON,
    "prompt": st.sampled_from([None, 1, {}, [], [1, "a"], [[1], "a"], [[1.5]], [True], [[True]], 1.5]) | JSON,
    "stream_options": st.sampled_from(["x", 1, [], True]) | JSON,
    "n": WEIRD_NUMBERS | st.sampled_from(["2", [], {}, None, True]),
    "best_of": WEIRD_NUMBERS | st.sampled_from(["2", [], {}, None, True]),
    "prompt_logprobs": WEIRD_NUMBERS | st.sampled_from(["1", [], {}, True, 1]),
}
SAFE_KEY = st.text(alphabet=string.ascii_lowercase, min_size=1, max_size=8).map(lambda s: "x_" + s)


def _nested(depth: int) -> Any:
    value: Any = "leaf"
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def _dumps(value: Any, ascii_only: bool) -> bytes:
    # The stdlib encoder: orjson refuses integers beyond 64 bits, clients need not.
    return json.dumps(value, ensure_ascii=ascii_only).encode()


@st.composite
def hostile_request(draw: st.DrawFn) -> tuple[str, bytes]:
    endpoint = draw(st.sampled_from([COMPLETIONS, CHAT]))
    kind = draw(st.sampled_from(["mutated", "mutated", "mutated", "any_json", "raw"]))
    if kind == "any_json":
        return endpoint, _dumps(draw(JSON), draw(st.booleans()))
    if kind == "raw":
        raw = draw(
            st.sampled_from(
                [
                    b"\xff\xfe\xfd",
                    b'{"model": "\xc3\x28"}',
                    b'{"prompt": "\xed\xa0\x80", "model": "fake-model"}',
                    b'{"model":"fake-model","model":"fake-model","prompt":"a","prompt":"b","max_tokens":2}',
                    b'{"model":"fake-model","prompt":"a","stream":true,"stream":"no","max_tokens":2}',
                    b'{"model":"fake-model","messages":[],"messages":5,"max_tokens":2}',
                    b'{"model":"fake-model","prompt":"a","max_tokens":2,"max_tokens":-1}',
                    b"[" * 5000 + b"]" * 5000,
                    b"{" * 3000,
                    b"",
                    b"null",
                    b'"string"',
                    b"{}",
                    b'{"a":1e400}',
                    b"\x00" * 64,
                ]
            )
            | st.binary(max_size=64)
        )
        return endpoint, raw
    # A valid body, then some fields replaced with wrong types; maybe huge or deep extras.
    stream = draw(st.booleans())
    body: dict[str, Any] = {"model": MODEL, "stream": stream, "max_tokens": draw(st.integers(1, 6))}
    if endpoint == CHAT:
        body["messages"] = [{"role": "user", "content": "hostile " + draw(st.text(max_size=20))}]
    else:
        body["prompt"] = "hostile " + draw(st.text(max_size=20))
    for field in draw(st.sets(st.sampled_from(sorted(WRONG)), max_size=3)):
        body[field] = draw(WRONG[field])
    extras = draw(st.dictionaries(SAFE_KEY, JSON, max_size=3))
    body.update(extras)
    if draw(st.integers(0, 9)) == 0:
        body["x_huge"] = "z" * (1024 * 1024)
    if draw(st.integers(0, 9)) == 0:
        body["x_deep"] = _nested(draw(st.integers(10, 200)))
    # A body with a huge, valid token budget would make the engine stream for minutes.
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if type(value) is int and 6 < value:
            body[key] = 6
    return endpoint, _dumps(body, draw(st.booleans()))


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(req=hostile_request())
def test_random_bodies_get_a_4xx_or_a_correct_200(hostile: RouterProcess, req: tuple[str, bytes]) -> None:
    endpoint, raw = req
    answer = http_request(hostile, "POST", endpoint, raw, timeout=30)
    event(f"status {answer.status}")
    assert_sane(answer)


def test_workers_survive_the_random_bodies(hostile: RouterProcess) -> None:
    pids = hostile.initial_children  # type: ignore[attr-defined]
    assert len(pids) >= 3  # 2 workers + the supervisor
    # Same property for a fixed set of the nastiest inputs, then the workers are the same.
    for raw in (b"\xff" * 10, b"[" * 100000, b'{"prompt":' * 2000, orjson.dumps({"prompt": "x" * 4_000_000})):
        assert_sane(http_request(hostile, "POST", COMPLETIONS, raw))
    assert_alive(hostile, pids)


# -- headers: random headers on every route are tests/real_gunicorn/security/test_client_headers.py -----


def test_undecodable_content_encoding_is_a_400(hostile: RouterProcess) -> None:
    # A body that is not in its declared Content-Encoding is the client's error: 400 bad_request
    # (it once escaped read_body as RequestPayloadError and became a 500).
    pids = worker_pids(hostile)
    body = orjson.dumps({"model": MODEL, "prompt": "not gzip", "max_tokens": 2})
    for encoding in ("gzip", "deflate"):
        answer = http_request(hostile, "POST", COMPLETIONS, body, headers=[("Content-Encoding", encoding)])
        assert b"Traceback" not in answer.body
        assert answer.status == 400, (encoding, answer.status, answer.body)
        err = assert_openai_error(answer.status, answer.headers, answer.body)
        assert err["type"] == "bad_request" and answer.headers.get("x-narwhal-error") == "bad_request"
    assert_alive(hostile, pids)
