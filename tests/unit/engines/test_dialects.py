"""Each endpoint's stream description on real vLLM event text (docs/behaviour.md "The other P/D endpoints"):
classification of
events, terminal detection, in-stream errors and their statuses, the bodies and error shapes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest

from narwhal.engines import endpoints
from narwhal.engines.sse import DONE_EVENT, Kind, split_events
from narwhal.errors import NarwhalError, RequestError

MSG = endpoints.MESSAGES.dialect
RESP = endpoints.RESPONSES.dialect
GEN = endpoints.GENERATE.dialect
CHAT = endpoints.CHAT.dialect


def recorded_events(path: Path) -> SimpleNamespace:
    """The entries of a recording: ``== NAME`` opens one, its lines up to the next are the event."""
    events: dict[str, bytes] = {}
    for entry in path.read_text().split("\n== ")[1:]:
        name, _, text = entry.partition("\n")
        events[name] = text.strip("\n").encode()
    return SimpleNamespace(**events)


# Event text as real vLLM engines send it (sources named in the recording).
E = recorded_events(Path(__file__).with_name("vllm_events.txt"))


def ev(*events: bytes) -> bytes:
    return b"".join(e + b"\n\n" for e in events)


@pytest.mark.parametrize(("event", "kind"), [
    (E.M_START, Kind.METADATA), (E.M_BLOCK, Kind.METADATA), (E.M_TEXT, Kind.TOKEN), (E.M_THINK, Kind.TOKEN),
    (E.M_SIG, Kind.METADATA), (E.M_TOOL, Kind.TOKEN), (E.M_JSON, Kind.TOKEN), (E.M_STOP_BLOCK, Kind.METADATA),
    (E.M_DELTA, Kind.TOKEN), (E.M_END, Kind.DONE), (b"data: [DONE]", Kind.METADATA), (b": comment", Kind.METADATA),
])
def test_messages_events_are_classified(event: bytes, kind: Kind) -> None:
    assert MSG.classify(event)[0] is kind


def test_a_message_delta_without_stop_reason_is_metadata() -> None:
    assert MSG.classify(b'event: message_delta\ndata: {"type":"message_delta","delta":{}}')[0] is Kind.METADATA


@pytest.mark.parametrize(("kind", "status"), [
    ("overloaded_error", 503), ("rate_limit_error", 429), ("invalid_request_error", 400), ("internal_error", None),
])
def test_messages_error_types_give_their_status(kind: str, status: int | None) -> None:
    event = b'event: error\ndata: {"type":"error","error":{"type":"' + kind.encode() + b'","message":"m"}}'
    assert MSG.classify(event) == (Kind.ERROR, {"code": status, "message": "m"})


def test_messages_understand_openai_shaped_errors() -> None:
    event = (b'data: {"error": {"message": "Internal server error", "type": "InternalServerError",'
             b' "param": null, "code": 500}}')
    assert MSG.classify(event) == (Kind.ERROR, {"code": 500, "message": "Internal server error"})
    assert MSG.classify(E.M_ERROR) == (Kind.ERROR, {"code": None, "message": "Invalid data format received"})


def test_messages_clean_end_cuts_the_done_vllm_sends_after_message_stop() -> None:
    span = ev(E.M_TEXT, E.M_STOP_BLOCK, E.M_DELTA, E.M_END) + DONE_EVENT
    assert span[: MSG.clean_end(span)] == ev(E.M_TEXT, E.M_STOP_BLOCK, E.M_DELTA, E.M_END)
    assert MSG.clean_end(ev(E.M_TEXT, E.M_END)) == len(ev(E.M_TEXT, E.M_END))
    assert MSG.clean_end(ev(E.M_TEXT, E.M_ERROR) + DONE_EVENT) == -1  # an error: judged event by event
    assert MSG.clean_end(ev(E.M_TEXT)) == -1
    assert MSG.may_end(ev(E.M_TEXT)) is False
    assert MSG.may_end(ev(E.M_END)) and MSG.may_end(ev(E.M_ERROR))


@pytest.mark.parametrize(("event", "kind"), [
    (E.R_CREATED, Kind.METADATA), (E.R_ITEM, Kind.METADATA), (E.R_TEXT, Kind.TOKEN), (E.R_CALL, Kind.TOKEN),
    (E.R_DONE_ITEM, Kind.TOKEN), (E.R_END, Kind.DONE), (E.R_INCOMPLETE, Kind.DONE),
    (b'event: response.reasoning_text.delta\ndata: {"type":"response.reasoning_text.delta","delta":"x"}', Kind.TOKEN),
    (b'event: response.function_call_arguments.delta\ndata: {"type":"response.function_call_arguments.delta"}',
     Kind.TOKEN),
])
def test_responses_events_are_classified(event: bytes, kind: Kind) -> None:
    assert RESP.classify(event)[0] is kind


def test_responses_errors_take_their_code_or_502() -> None:
    assert RESP.classify(E.R_ERROR) == (Kind.ERROR, {"code": 503, "message": "busy"})
    assert RESP.classify(E.R_FAILED) == (Kind.ERROR, {"code": None, "message": "boom"})  # "server_error": 502


def test_responses_clean_end_and_probe() -> None:
    span = ev(E.R_TEXT, E.R_DONE_ITEM, E.R_END)
    assert RESP.clean_end(span) == len(span)
    assert RESP.clean_end(ev(E.R_TEXT, E.R_ERROR, E.R_END)) == -1
    assert RESP.clean_end(ev(E.R_TEXT, E.R_INCOMPLETE)) == -1  # the rarer terminal: judged event by event
    assert RESP.may_end(ev(E.R_TEXT)) is False
    assert all(RESP.may_end(ev(e)) for e in (E.R_END, E.R_INCOMPLETE, E.R_ERROR, E.R_FAILED))


def test_responses_whole_body_failed_is_an_error() -> None:
    assert RESP.whole_error(b'{"status":"incomplete","incomplete_details":{"reason":"max_output_tokens"}}') is None
    failed = b'{"status":"failed","error":{"code":500,"message":"oops"}}'
    assert RESP.whole_error(failed) == {"code": 500, "message": "oops"}


@pytest.mark.parametrize(("event", "kind"), [
    (E.G_TOKEN, Kind.TOKEN), (E.G_EMPTY, Kind.METADATA), (E.G_LAST, Kind.TOKEN), (b"data: [DONE]", Kind.DONE),
    (b'data: {"error": {"message": "x", "code": 500}}', Kind.ERROR),
])
def test_generate_events_are_classified(event: bytes, kind: Kind) -> None:
    assert GEN.classify(event)[0] is kind


def test_chat_is_unchanged_by_the_descriptions() -> None:
    span = b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n' + DONE_EVENT
    assert CHAT.clean_end(span) == len(span) and CHAT.terminal == "[DONE]"
    assert [CHAT.classify(e)[0] for e in split_events(span)] == [Kind.TOKEN, Kind.DONE]


def test_prefill_bodies_follow_the_table() -> None:
    body = {"model": "m", "max_tokens": 9, "stream": True, "stop_sequences": ["x"], "messages": []}
    out = MSG.prefill_body(body, "rid", True)
    assert out["max_tokens"] == 1 and out["stream"] is False and "stop_sequences" not in out
    assert out["kv_transfer_params"]["do_remote_decode"] is True
    assert "kv_transfer_params" not in MSG.prefill_body(body, "rid", False)
    out = RESP.prefill_body({"input": "x", "request_id": "client", "background": True}, "rid", True)
    # The backend id as a Response id: vLLM's resp_ prefix, which vLLM then uses as the id as given.
    assert (out["max_output_tokens"], out["background"], out["store"], out["request_id"]) == (
        1, False, False, "resp_rid")
    assert RESP.decode_body({"request_id": "client"}, "rid", None)["request_id"] == "resp_rid"
    gen = {"token_ids": [1], "sampling_params": {"max_tokens": 5, "min_tokens": 2, "stop": ["a"], "seed": 3}}
    out = GEN.prefill_body(gen, "rid", True)
    assert out["sampling_params"] == {"max_tokens": 1, "seed": 3}
    assert gen["sampling_params"]["max_tokens"] == 5  # the client's body is not touched


def test_error_shapes_per_endpoint() -> None:
    exc = NarwhalError("no pair", reason="no_engine")
    assert orjson.loads(MSG.error_body(exc)) == {"type": "error", "error": {"type": "overloaded_error",
                                                                           "message": "no pair"}}
    assert MSG.error_event(exc).startswith(b"event: error\ndata: ")
    assert RESP.error_event(exc) == (b'event: error\ndata: {"type":"error","code":503,"message":"no pair",'
                                     b'"param":null}\n\n')
    assert orjson.loads(GEN.error_body(exc))["error"]["type"] == "no_engine"


def test_responses_refusals_say_why() -> None:
    with pytest.raises(RequestError, match="lives inside one engine process"):
        RESP.check({"input": "x", "previous_response_id": "resp_1"})
    with pytest.raises(RequestError, match="no stream to relay"):
        RESP.check({"input": "x", "background": True})
    RESP.check({"input": "x", "previous_response_id": None, "background": False})


def test_affinity_texts() -> None:
    assert RESP.affinity_text({"instructions": "sys", "input": "hello"}, 1024) == "sys\nhello"
    items = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]}
    assert RESP.affinity_text(items, 1024) == "user: hi"
    body = {"system": [{"type": "text", "text": "sys"}], "messages": [{"role": "user", "content": "hey"}]}
    assert MSG.affinity_text(body, 1024) == "sys\nuser: hey"
    assert GEN.affinity_text({"token_ids": [1, 22, 333]}, 1024) == "1 22 333"
    assert len(GEN.affinity_text({"token_ids": list(range(10_000))}, 100)) >= 100


def test_a_dialect_declares_its_endpoint_and_prompt_fields_in_its_class_line() -> None:
    """What a subclass leaves out it inherits; without an endpoint it fails when it is defined."""
    from narwhal.engines.dialects.base import Dialect

    class Echo(Dialect, endpoint="/v1/echo", prompt_fields=("text",), terminal="echo.done"):
        __slots__ = ()

    class Louder(Echo, endpoint="/v1/louder", prompt_fields=("text",)):
        __slots__ = ()

    assert (Louder.endpoint, Louder.terminal, Louder.terminal_bytes) == ("/v1/louder", "echo.done", DONE_EVENT)
    assert (MSG.terminal, MSG.terminal_bytes, CHAT.prompt_fields) == ("message_stop", None, ("messages",))
    with pytest.raises(TypeError, match="dialect Nameless: an endpoint and its prompt fields are required"):
        class Nameless(Dialect, endpoint="", prompt_fields=("text",)):
            __slots__ = ()
