"""SSE framing and the stream facts of docs/behaviour.md "Failure semantics" (narwhal/engines/sse.py)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from narwhal.engines.sse import (
    DONE_EVENT,
    Kind,
    SSEFramer,
    classify,
    ends_with_done,
    error_object,
    event_data,
    may_end_stream,
    split_events,
)

# One realistic chat stream: comment, role-only delta, tokens, a multi-line data event, finish,
# usage-only chunk, [DONE]. Events are written without their separator.
EVENTS: list[bytes] = [
    b": ping",
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"role":"assistant","content":""},"finish_reason":null}]}',
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{"content":"Hel"},"finish_reason":null}]}',
    b'event: message\nid: 7\ndata: {"id":"c1","object":"chat.completion.chunk",\n'
    b'data: "choices":[{"index":0,"delta":{"content":"lo"},"finish_reason":null}]}',
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,'
    b'"delta":{},"finish_reason":"stop"}]}',
    b'data: {"id":"c1","object":"chat.completion.chunk","choices":[],'
    b'"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}',
    b"data: [DONE]",
]
KINDS: list[Kind] = [
    Kind.METADATA,
    Kind.METADATA,
    Kind.TOKEN,
    Kind.TOKEN,
    Kind.TOKEN,
    Kind.METADATA,
    Kind.DONE,
]
LF_STREAM: bytes = b"".join(e + b"\n\n" for e in EVENTS)
CRLF_STREAM: bytes = LF_STREAM.replace(b"\n", b"\r\n")


def feed_chunks(chunks: list[bytes]) -> tuple[list[bytes], SSEFramer]:
    framer = SSEFramer()
    return [framer.feed(c) for c in chunks], framer


def assert_spans_are_whole_events(spans: list[bytes]) -> None:
    for span in spans:
        assert span == b"" or span.endswith(b"\n\n"), span


# --------------------------------------------------------------------------- framing


def test_whole_stream_in_one_chunk() -> None:
    spans, framer = feed_chunks([LF_STREAM])
    assert spans == [LF_STREAM]
    assert split_events(spans[0]) == EVENTS
    assert framer.pending == 0


def test_classification_of_sample_stream() -> None:
    assert [classify(e)[0] for e in EVENTS] == KINDS


@pytest.mark.parametrize("stream", [LF_STREAM, CRLF_STREAM], ids=["lf", "crlf"])
def test_split_at_every_byte_boundary_gives_same_events(stream: bytes) -> None:
    for cut in range(1, len(stream)):
        spans, framer = feed_chunks([stream[:cut], stream[cut:]])
        assert_spans_are_whole_events(spans)
        out = b"".join(spans)
        assert out == LF_STREAM, cut
        assert split_events(out) == EVENTS, cut
        assert framer.pending == 0, cut


@pytest.mark.parametrize("stream", [LF_STREAM, CRLF_STREAM], ids=["lf", "crlf"])
def test_one_byte_at_a_time_gives_same_events(stream: bytes) -> None:
    spans, framer = feed_chunks([stream[i : i + 1] for i in range(len(stream))])
    assert_spans_are_whole_events(spans)
    events = [e for span in spans for e in split_events(span)]
    assert events == EVENTS
    assert b"".join(spans) == LF_STREAM
    assert framer.pending == 0


@pytest.mark.parametrize("stream", [LF_STREAM, CRLF_STREAM], ids=["lf", "crlf"])
def test_each_event_is_returned_by_the_chunk_that_completes_it(stream: bytes) -> None:
    sep = b"\r\n\r\n" if stream is CRLF_STREAM else b"\n\n"
    framer = SSEFramer()
    for event in EVENTS:
        raw = event.replace(b"\n", b"\r\n") if sep == b"\r\n\r\n" else event
        assert framer.feed(raw) == b""
        assert framer.feed(sep) == event + b"\n\n"
    assert framer.pending == 0


def test_partial_event_is_held_until_separator() -> None:
    framer = SSEFramer()
    assert framer.feed(b'data: {"a":') == b""
    assert framer.pending == len(b'data: {"a":')
    assert framer.feed(b"1}\n") == b""
    assert framer.feed(b"\ndata: [DO") == b'data: {"a":1}\n\n'
    assert framer.pending == len(b"data: [DO")
    assert framer.feed(b"NE]\n\n") == DONE_EVENT
    assert framer.pending == 0


# Chunks fed in turn and what each returns: line endings of every kind, split anywhere.
FRAMINGS = {
    # once CRLF was seen, later LF-only chunks still frame correctly
    "crlf normalised to lf": [(b"data: a\r\n\r\ndata: b\r\n\r\n", b"data: a\n\ndata: b\n\n"),
                              (b"data: c\n\n", b"data: c\n\n")],
    # a CR ends its line at once (it may be a lone-CR stream); the LF that pairs with it in the
    # next chunk is dropped rather than read as a second, blank line
    "cr split from its lf": [(b"data: a\r", b""), (b"\n\r", b"data: a\n\n"), (b"\n", b"")],
    "cr/lf split is one line ending": [(b"data: a\r", b""), (b"\ndata: b\r\n\r\n", b"data: a\ndata: b\n\n")],
    # lone-CR endings: every event ends in "\r\r", complete whatever follows (once a bug: the
    # last event was never returned)
    "lone cr stream fed whole": [(b"data: a\r\rdata: [DONE]\r\r", b"data: a\n\ndata: [DONE]\n\n")],
    # a chunk ending in CR (maybe half a CRLF) withholds only what may still continue (once a bug:
    # the complete event before it was withheld too)
    "trailing cr withholds only the open event": [(b"data: a\r\n\r\ndata: b\r", b"data: a\n\n"),
                                                  (b"\n\r\n", b"data: b\n\n")],
}


@pytest.mark.parametrize("feeds", FRAMINGS.values(), ids=FRAMINGS.keys())
def test_framing_across_chunks(feeds: list[tuple[bytes, bytes]]) -> None:
    framer = SSEFramer()
    assert [framer.feed(chunk) for chunk, _ in feeds] == [out for _, out in feeds]
    assert framer.pending == 0


def test_lone_cr_line_endings_inside_a_stream() -> None:
    framer = SSEFramer()
    assert framer.feed(b"data: a\rdata: b\r\rdata: c") == b"data: a\ndata: b\n\n"
    assert framer.pending == len(b"data: c")
    assert split_events(b"data: a\ndata: b\n\n") == [b"data: a\ndata: b"]
    assert event_data(b"data: a\ndata: b") == b"a\nb"


def test_comment_event_is_metadata() -> None:
    framer = SSEFramer()
    span = framer.feed(b": ping\n\n")
    assert span == b": ping\n\n"
    assert split_events(span) == [b": ping"]
    assert event_data(b": ping") is None
    assert classify(b": ping") == (Kind.METADATA, None)


def test_event_larger_than_128_kib() -> None:
    content = "x" * (200 * 1024)
    event = b"data: " + orjson.dumps(
        {"id": "c1", "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]}
    )
    stream = event + b"\n\n" + DONE_EVENT
    framer = SSEFramer()
    spans = [framer.feed(stream[i : i + 4096]) for i in range(0, len(stream), 4096)]
    assert_spans_are_whole_events(spans)
    events = [e for span in spans for e in split_events(span)]
    assert events == [event, b"data: [DONE]"]
    assert len(events[0]) > 128 * 1024
    assert classify(events[0]) == (Kind.TOKEN, None)
    assert framer.pending == 0


def test_event_larger_than_128_kib_with_crlf() -> None:
    content = "y" * (150 * 1024)
    event = b"data: " + orjson.dumps({"choices": [{"index": 0, "text": content, "finish_reason": None}]})
    stream = event + b"\r\n\r\n"
    framer = SSEFramer()
    out = b"".join(framer.feed(stream[i : i + 1000]) for i in range(0, len(stream), 1000))
    assert out == event + b"\n\n"
    assert classify(event) == (Kind.TOKEN, None)


def test_split_events() -> None:
    assert split_events(b"") == []
    assert split_events(b"data: a\n\n") == [b"data: a"]
    assert split_events(b"data: a\n\n: c\n\ndata: [DONE]\n\n") == [b"data: a", b": c", b"data: [DONE]"]


# --------------------------------------------------------------------------- event data


@pytest.mark.parametrize(
    ("event", "data"),
    [
        (b"data: hello", b"hello"),
        (b"data:hello", b"hello"),
        (b"data:  two spaces", b" two spaces"),
        (b"data: line1\ndata: line2\ndata: line3", b"line1\nline2\nline3"),
        (b"event: message\nid: 3\ndata: x\nretry: 10", b"x"),
        (b": comment\ndata: x", b"x"),
        (b": ping", None),
        (b"event: ping", None),
        (b"data:", b""),
    ],
)
def test_event_data(event: bytes, data: bytes | None) -> None:
    assert event_data(event) == data


def test_multi_line_data_is_parsed_as_one_json_document() -> None:
    event = b'data: {"choices":\ndata: [{"index":0,"text":"hi","finish_reason":null}]}'
    assert event_data(event) == b'{"choices":\n[{"index":0,"text":"hi","finish_reason":null}]}'
    assert classify(event) == (Kind.TOKEN, None)


# --------------------------------------------------------------------------- classification


def chunk(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj)


def completion(text: str, finish: str | None = None) -> bytes:
    return chunk({"id": "cmpl-1", "object": "text_completion", "choices": [
        {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    ]})


def chat(delta: dict[str, Any], finish: str | None = None) -> bytes:
    return chunk({"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    ]})


TOOL_CALL = [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}]


@pytest.mark.parametrize(
    ("event", "kind"),
    [
        # generated output
        (completion("Hello"), Kind.TOKEN),
        (completion(" "), Kind.TOKEN),
        (completion("", "stop"), Kind.TOKEN),  # immediate EOS: a valid, empty completion
        (completion("", "length"), Kind.TOKEN),
        (completion("end", "stop"), Kind.TOKEN),
        (chat({"content": "Hi"}), Kind.TOKEN),
        (chat({"reasoning_content": "thinking"}), Kind.TOKEN),
        (chat({"reasoning": "thinking"}), Kind.TOKEN),  # vLLM 0.2x on
        (chat({"tool_calls": TOOL_CALL}), Kind.TOKEN),
        (chat({}, "stop"), Kind.TOKEN),
        (chat({"content": ""}, "stop"), Kind.TOKEN),
        (chat({"content": ""}, "tool_calls"), Kind.TOKEN),
        (
            chunk({"choices": [
                {"index": 0, "delta": {"role": "assistant"}, "finish_reason": None},
                {"index": 1, "delta": {"content": "x"}, "finish_reason": None},
            ]}),
            Kind.TOKEN,
        ),
        # metadata
        (chat({"role": "assistant"}), Kind.METADATA),
        (chat({"role": "assistant", "content": ""}), Kind.METADATA),
        (chat({"content": ""}), Kind.METADATA),
        (chat({"content": None}), Kind.METADATA),
        (chat({"reasoning_content": ""}), Kind.METADATA),
        (chat({"reasoning": ""}), Kind.METADATA),
        (chat({"tool_calls": []}), Kind.METADATA),
        (chat({}), Kind.METADATA),
        (completion(""), Kind.METADATA),
        (
            chunk({"id": "c", "object": "chat.completion.chunk", "choices": [],
                   "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}),
            Kind.METADATA,
        ),
        (chunk({"id": "c", "choices": [], "usage": None}), Kind.METADATA),
        (b": ping", Kind.METADATA),
        (b": keep-alive\n: again", Kind.METADATA),
        (b"event: ping", Kind.METADATA),
        # end of stream
        (b"data: [DONE]", Kind.DONE),
        (b"data:[DONE]", Kind.DONE),
    ],
)
def test_classify(event: bytes, kind: Kind) -> None:
    assert classify(event) == (kind, None)


def test_classify_nested_error_object() -> None:
    err = {"message": "CUDA out of memory", "type": "InternalServerError", "param": None, "code": 500}
    assert classify(chunk({"error": err})) == (Kind.ERROR, err)


def test_classify_nested_error_without_code() -> None:
    err = {"message": "boom"}
    assert classify(chunk({"error": err})) == (Kind.ERROR, {"message": "boom"})


def test_classify_flat_error_object() -> None:
    obj = {"object": "error", "message": "bad thing", "type": "BadRequestError", "param": None, "code": 400}
    assert classify(chunk(obj)) == (Kind.ERROR, obj)


def test_classify_error_wins_over_choices() -> None:
    err = {"message": "m", "code": 503}
    event = chunk({"choices": [{"index": 0, "text": "x", "finish_reason": None}], "error": err})
    assert classify(event) == (Kind.ERROR, err)


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        ({"error": {"message": "m", "code": 502}}, {"message": "m", "code": 502}),
        ({"object": "error", "message": "m", "code": 400}, {"object": "error", "message": "m", "code": 400}),
        ({"error": "oops"}, {"message": "oops"}),
        ({"error": None, "choices": []}, None),
        ({"object": "chat.completion.chunk", "choices": []}, None),
    ],
)
def test_error_object(obj: dict[str, Any], expected: dict[str, Any] | None) -> None:
    assert error_object(obj) == expected


def test_error_object_returns_the_objects_themselves() -> None:
    inner = {"message": "m", "code": 500}
    assert error_object({"error": inner}) is inner
    flat = {"object": "error", "message": "m"}
    assert error_object(flat) is flat


@pytest.mark.parametrize(
    "event",
    [b"data: not json", b"data: [1, 2]", b'data: "text"', b"data: 42", b"data: null"],
)
def test_non_object_data_is_metadata(event: bytes) -> None:
    assert classify(event) == (Kind.METADATA, None)


@pytest.mark.parametrize(
    ("span", "expected"),
    [
        (DONE_EVENT, True),
        (b"data: a\n\ndata: [DONE]\n\n", True),
        (chunk({"error": {"message": "m", "code": 500}}) + b"\n\n", True),
        (chunk({"object": "error", "message": "m"}) + b"\n\n", True),
        (chat({"content": "x"}) + b"\n\n", False),
        (b": ping\n\n", False),
        (b"", False),
    ],
)
def test_may_end_stream(span: bytes, expected: bool) -> None:
    assert may_end_stream(span) is expected


@pytest.mark.parametrize(
    ("span", "expected"),
    [
        (b"data: [DONE]\n\n", True),
        (b'data: {"choices":[{"text":" a"}]}\n\ndata: [DONE]\n\n', True),
        (b'data: {"choices":[{"text":" a"}]}\ndata: [DONE]\n\n', False),  # one event, two data lines
        (b'data: {"error":{"code":500}}\n\ndata: [DONE]\n\n', False),
        (b"data: [DONE]\n\ndata: [DONE]\n\n", False),
        (b'data: [DONE]\n\ndata: {"choices":[]}\n\n', False),
        (b'data: {"choices":[{"text":" a"}]}\n\n', False),
    ],
)
def test_ends_with_done_only_for_a_clean_final_span(span: bytes, expected: bool) -> None:
    assert ends_with_done(span) is expected
