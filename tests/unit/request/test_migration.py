"""The pure rules of a stream's continuation (narwhal.request.migration): what the client saw,
the continuation forms, the splice, and when a cut may continue."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from narwhal.engines.endpoints import CHAT, COMPLETIONS, GENERATE, MESSAGES, RESPONSES
from narwhal.errors import EngineClientError, EngineError
from narwhal.fake_engine.continuation import start_of
from narwhal.reasons import migrates
from narwhal.request.admission import ClientRequest
from narwhal.request.migration import Migration
from narwhal.request.migration.forms import NotContinued, continuation
from narwhal.request.migration.seen import Seen
from narwhal.request.migration.splice import MessagesSplice, Splice
from narwhal.request.migration.transcript import COMPACT_AT_BYTES, Transcript


def _data(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _chat_chunk(content: str | None = None, *, role: bool = False, finish: str | None = None, **extra: Any) -> bytes:
    delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
    if content is not None:
        delta["content"] = content
    return _data({"id": "chatcmpl-a", "object": "chat.completion.chunk", "created": 7, "model": "m",
                  "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra})


def _seen(kind: str, *spans: bytes) -> Seen:
    seen = Seen(kind)
    seen.absorb(list(spans))
    return seen


def test_seen_reads_the_identity_text_and_count_of_a_chat_stream() -> None:
    seen = _seen("chat", _chat_chunk(role=True) + _chat_chunk(" t0"), _chat_chunk(" t1") + b": keep-alive\n\n")
    assert (seen.id, seen.created, seen.output, seen.tokens, seen.why_not) == ("chatcmpl-a", 7, " t0 t1", 2, None)


@pytest.mark.parametrize("delta", [{"tool_calls": [{"index": 0}]}, {"reasoning": "hmm"}])
def test_tool_calls_and_reasoning_are_not_continued(delta: dict[str, Any]) -> None:
    chunk = _data({"id": "x", "choices": [{"index": 0, "delta": delta}]})
    assert _seen("chat", chunk).why_not is not None


def test_a_second_choice_or_an_unreadable_event_is_not_continued() -> None:
    assert _seen("completions", _data({"id": "x", "choices": [{"index": 1, "text": "a"}]})).why_not
    assert _seen("completions", b'data: {"id": "x", "choices": 3}\n\n').why_not


def test_the_chat_form_appends_the_text_so_far_and_what_is_left() -> None:
    seen = _seen("chat", _chat_chunk(" t0"), _chat_chunk(" t1"))
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": "m", "messages": b"<encoded>", "max_tokens": 5, "min_tokens": 3, "stop": ["x"], "seed": 1}
    endpoint, out = continuation(CHAT, body, {"messages": messages}, seen)
    assert endpoint is CHAT
    assert out == {"model": "m", "messages": [*messages, {"role": "assistant", "content": " t0 t1"}],
                   "max_tokens": 3, "min_tokens": 1, "stop": ["x"], "seed": 1, "continue_final_message": True,
                   "add_generation_prompt": False}


def test_a_client_continuing_its_own_message_gets_the_text_added_to_it() -> None:
    seen = _seen("chat", _chat_chunk(" t0"))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure,"}]
    _, out = continuation(CHAT, {"continue_final_message": True}, {"messages": messages}, seen)
    assert out["messages"] == [messages[0], {"role": "assistant", "content": "Sure, t0"}]


def test_completions_continue_the_prompt_with_vllms_default_limit() -> None:
    seen = _seen("completions", _data({"id": "c", "choices": [{"index": 0, "text": " t0"}]}))
    _, out = continuation(COMPLETIONS, {"prompt": "x"}, {"prompt": "Once"}, seen)
    assert out == {"prompt": "Once t0", "max_tokens": 15}
    with pytest.raises(NotContinued):
        continuation(COMPLETIONS, {"echo": True}, {"prompt": "Once"}, seen)
    with pytest.raises(NotContinued):  # ids in, but no ids out: nothing to continue them with
        continuation(COMPLETIONS, {}, {"prompt": [1, 2]}, seen)


def test_generate_continues_by_tokens() -> None:
    chunk = _data({"request_id": "g", "choices": [{"index": 0, "token_ids": [1000, 1001]}]})
    seen = _seen("generate", chunk)
    _, out = continuation(GENERATE, {"sampling_params": {"max_tokens": 6}}, {"token_ids": [5, 6]}, seen)
    assert out == {"token_ids": [5, 6, 1000, 1001], "sampling_params": {"max_tokens": 4}}


def test_messages_continue_in_the_chat_form() -> None:
    seen = _seen("messages", b'event: content_block_start\ndata: {"type":"content_block_start","content_block":'
                             b'{"type":"text","text":""},"index":0}\n\n', b'event: content_block_delta\ndata: '
                             b'{"type":"content_block_delta","delta":{"type":"text_delta","text":" t0"},"index":0}\n\n')
    body = {"model": "m", "max_tokens": 4, "stop_sequences": ["z"], "temperature": 0.5, "metadata": {"user_id": "u"}}
    prompt = {"system": "be brief", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    endpoint, out = continuation(MESSAGES, body, prompt, seen)
    assert endpoint is CHAT
    assert out == {"model": "m", "temperature": 0.5, "max_tokens": 3, "stop": ["z"], "stream": True,
                   "stream_options": {"include_usage": True}, "continue_final_message": True,
                   "add_generation_prompt": False,
                   "messages": [{"role": "system", "content": "be brief"},
                                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                                {"role": "assistant", "content": " t0"}]}
    with pytest.raises(NotContinued):
        continuation(MESSAGES, {**body, "tools": [{"name": "t"}]}, prompt, seen)


def test_responses_and_spent_limits_are_not_continued() -> None:
    seen = _seen("chat", _chat_chunk(" t0"), _chat_chunk(" t1"))
    with pytest.raises(NotContinued):
        continuation(RESPONSES, {}, {}, seen)
    with pytest.raises(NotContinued):
        continuation(CHAT, {"max_tokens": 2}, {"messages": []}, seen)


def test_the_splice_keeps_the_original_identity_and_counts_all_usage() -> None:
    seen = _seen("chat", _chat_chunk(" t0"), _chat_chunk(" t1"))
    splice = Splice("chat", seen, prompt_tokens=12)
    role = _data({"id": "chatcmpl-b", "created": 9, "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
        "prompt_token_ids": [1, 2]})
    theirs = _chat_chunk(" t2").replace(b"chatcmpl-a", b"chatcmpl-b").replace(b'"created":7', b'"created":9')
    out = splice(role + theirs)
    assert out == _chat_chunk(" t2")
    usage = _data({"id": "chatcmpl-b", "created": 9, "choices": [],
                   "usage": {"prompt_tokens": 14, "total_tokens": 17, "completion_tokens": 3}})
    assert orjson.loads(splice(usage + b"data: [DONE]\n\n").split(b"\n\n")[0][6:])["usage"] == {
        "prompt_tokens": 12, "total_tokens": 17, "completion_tokens": 5}


def test_a_messages_splice_writes_anthropics_events() -> None:
    seen = _seen("messages", b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":'
                             b'{"type":"text_delta","text":" t0"},"index":0}\n\n')
    splice = MessagesSplice(seen, prompt_tokens=4)
    out = splice(_chat_chunk(role=True) + _chat_chunk(" t1", finish="length")
                 + _data({"id": "x", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}})
                 + b"data: [DONE]\n\n")
    events = [e for e in out.split(b"\n\n") if e]
    assert [e.split(b"\n")[0] for e in events] == [b"event: content_block_delta", b"event: content_block_stop",
                                                   b"event: message_delta", b"event: message_stop"]
    assert orjson.loads(events[2].split(b"data: ")[1]) == {
        "type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
        "usage": {"input_tokens": 4, "output_tokens": 2}}


def test_a_long_transcript_is_compacted_and_read_whole_in_order() -> None:
    transcript = Transcript()
    chunks = [_data({"id": "c", "choices": [{"index": 0, "text": f" t{i}" + "x" * 200}]}) for i in range(300)]
    for chunk in chunks:
        transcript.keep(chunk)
    assert transcript.size <= COMPACT_AT_BYTES < sum(map(len, chunks))  # older spans left the raw list
    assert len(transcript.spans) < len(chunks)
    seen = transcript.read(Seen("completions"))
    assert seen.tokens == 300 and seen.output == "".join(f" t{i}" + "x" * 200 for i in range(300))
    assert transcript.read(Seen("completions")).tokens == 0  # each span is read once
    transcript.keep(chunks[0])
    assert seen is transcript.read(seen) and seen.tokens == 301  # and a later read adds to the last


@pytest.mark.parametrize(("reason", "status", "continues"), [
    ("engine_disconnect", 502, True), ("decode_silence", 504, True), ("engine_stream_error", 500, True),
    ("engine_unreachable", 502, True), ("first_token_timeout", 504, True), ("engine_stream_error", 400, False),
    ("engine_client_error", 429, False), ("deadline_exceeded", 504, False), ("client_disconnect", 499, False),
])
def test_which_faults_continue(reason: str, status: int, continues: bool) -> None:
    assert migrates(reason, status) is continues


def _request(deadline: float = 100.0) -> ClientRequest:
    return ClientRequest(endpoint=COMPLETIONS, body={"model": "m", "max_tokens": 4}, model="m", stream=True,
                         deadline=deadline, forward={}, prompt={"prompt": "Once"})


def test_a_cut_continues_while_the_count_and_deadline_allow() -> None:
    req = _request()
    migration = Migration.of(req, 1, lambda: 5.0)
    assert migration is not None
    migration.transcript.keep(_data({"id": "c", "choices": [{"index": 0, "text": " t0"}]}))
    cut = EngineError("gone", reason="engine_disconnect", engine="d0", phase="decode", status=502)
    assert migration.may_continue(cut, req.deadline, now=6.0)
    after = migration.after(cut, req, now=6.0, prompt_tokens=1)
    assert after is not None and after.body["prompt"] == "Once t0" and after.body["max_tokens"] == 3
    assert not migration.may_continue(cut, req.deadline, now=6.0)  # one migration only
    assert not Migration.of(req, 1, lambda: 5.0).may_continue(cut, 1.0, 6.0)  # type: ignore[union-attr]
    refused = EngineClientError("no", engine="d0", phase="decode", status=400)
    assert not Migration.of(req, 1, lambda: 5.0).may_continue(refused, req.deadline, 6.0)  # type: ignore[union-attr]
    assert Migration.of(req, 0, lambda: 5.0) is None


@pytest.mark.parametrize(("kind", "body", "start"), [
    ("chat", {"continue_final_message": True, "messages": [{"role": "assistant", "content": " t0 t1 t2"}]}, 3),
    ("chat", {"messages": [{"role": "assistant", "content": " t0 t1 t2"}]}, 0),
    ("completions", {"prompt": "w1 w2 t0 t1"}, 2),
    ("completions", {"prompt": "w1 t5"}, 0),
    ("generate", {"token_ids": [7, 1000, 1001]}, 2),
    ("messages", {"messages": [{"role": "assistant", "content": " t0"}]}, 0),
])
def test_the_fake_continues_where_the_output_stopped(kind: str, body: dict[str, Any], start: int) -> None:
    assert start_of(kind, body) == start


class _State:
    def __init__(self) -> None:
        self.migrating = 0

    def request_started(self) -> None: ...
    def request_finished(self) -> None: ...
    def retry_finished(self) -> None: ...
    def try_start_retry(self, ratio: float, minimum: int) -> bool:
        raise AssertionError("a migration never takes the retry budget")

    def try_start_migration(self, ratio: float, minimum: int) -> bool:
        self.migrating += 1
        return True

    def migration_finished(self) -> None:
        self.migrating -= 1


async def test_a_continuation_that_finds_no_pair_ends_with_the_cut() -> None:
    """The continuation's own refusal (no pair, no slot in time) is not what the client reads:
    the stream ends with the terminal event of the fault that cut it."""
    import asyncio
    from types import SimpleNamespace

    from narwhal.errors import NarwhalError
    from narwhal.request.accesslog import AccessRecord
    from narwhal.request.router import Router
    from narwhal.settings import Settings

    cut = EngineError("gone", reason="engine_disconnect", engine="d0", phase="decode", status=502)
    client = SimpleNamespace(committed=False)
    legs: list[ClientRequest] = []

    async def run(client_: Any, leg: ClientRequest, rec: Any, started: float, avoid: Any, migration: Any,
                  exclude: Any) -> None:
        legs.append(leg)
        if len(legs) == 1:
            client.committed = True
            migration.transcript.keep(_data({"id": "c", "choices": [{"index": 0, "text": " t0"}]}))
            raise cut
        raise NarwhalError("no engine", reason="no_engine")

    router = Router.__new__(Router)
    router.recovery = Settings.model_validate({"recovery": {"max_migrations": 1}}).recovery
    router.state = state = _State()  # type: ignore[assignment]
    router.attempts = SimpleNamespace(run=run)  # type: ignore[assignment]
    router.placement = SimpleNamespace(servable=lambda model, local, exclude: exclude == {"d0"})  # type: ignore
    router._loop = asyncio.get_running_loop()
    router.buffers = None  # type: ignore[assignment]
    req = _request(deadline=router._loop.time() + 30)
    rec = AccessRecord(request_id="r", endpoint="/v1/completions")
    with pytest.raises(EngineError) as ended:
        await router._serve(client, req, rec, 0.0)  # type: ignore[arg-type]
    assert ended.value is cut and rec.migrations == 1
    assert legs[1].body["prompt"] == "Once t0"
    assert state.migrating == 0  # the stream's share of the bound is given back


def _kept(req: ClientRequest, *spans: bytes) -> Migration:
    migration = Migration.of(req, 1, lambda: 5.0)
    assert migration is not None
    for span in spans:
        migration.transcript.keep(span)
    return migration


def _chat_request(**body: Any) -> ClientRequest:
    return ClientRequest(endpoint=CHAT, body={"model": "m", "max_tokens": 4, **body}, model="m", stream=True,
                         deadline=100.0, forward={}, prompt={"messages": [{"role": "user", "content": "hi"}]})


def test_a_stream_whose_finish_went_out_is_finished_and_completed_with_its_usage() -> None:
    spans = [_chat_chunk(role=True), _chat_chunk(" t0"), _chat_chunk(" t1", finish="stop")]
    migration = _kept(_chat_request(stream_options={"include_usage": True}), *spans)
    assert migration.finished()
    end = migration.completion(True, prompt_tokens=5)
    usage, done = end.split(b"\n\n")[:2]
    assert orjson.loads(usage.removeprefix(b"data: ")) == {
        "id": "chatcmpl-a", "object": "chat.completion.chunk", "created": 7, "model": "m", "choices": [],
        "usage": {"prompt_tokens": 5, "total_tokens": 7, "completion_tokens": 2}}
    assert done == b"data: [DONE]"
    assert migration.completion(False, prompt_tokens=5) == b"data: [DONE]\n\n"  # usage not asked for


def test_a_finished_stream_whose_usage_went_out_ends_with_done_alone() -> None:
    usage = _data({"id": "chatcmpl-a", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}})
    migration = _kept(_chat_request(), _chat_chunk(" t0", finish="length"), usage)
    assert migration.finished() and migration.completion(True, 1) == b"data: [DONE]\n\n"


def test_a_stream_not_finished_is_not_finished_and_a_long_one_keeps_its_tail_raw() -> None:
    assert not _kept(_chat_request(), _chat_chunk(" t0")).finished()
    many = [_chat_chunk(f" t{i}") for i in range(400)] + [_chat_chunk(" end", finish="stop")]
    migration = _kept(_chat_request(), *many)
    assert migration.transcript.tail() == many[-2:] and migration.finished()
    assert migration.read().tokens == 401


def test_a_messages_stream_is_finished_by_its_stop_reason() -> None:
    delta = b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"}}\n\n'
    req = ClientRequest(endpoint=MESSAGES, body={"model": "m", "max_tokens": 4}, model="m", stream=True,
                        deadline=100.0, forward={}, prompt={"messages": []})
    migration = _kept(req, delta)
    assert migration.finished()
    assert migration.completion(True, 3) == b'event: message_stop\ndata: {"type":"message_stop"}\n\n'


@pytest.mark.parametrize("body", [
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
    {"structured_outputs": {"json": {}}},
    {"guided_json": {"type": "object"}},
    {"guided_choice": ["a", "b"]},
    {"tool_choice": "required"},
    {"tool_choice": {"type": "function", "function": {"name": "f"}}},
    {"n": 2},
    {"best_of": 3},
    {"sampling_params": {"structured_outputs": {"regex": "a+"}}},
])
def test_constrained_output_and_forced_tools_are_never_continued(body: dict[str, Any]) -> None:
    migration = _kept(_chat_request(**body), _chat_chunk(" t0"))
    cut = EngineError("gone", reason="engine_disconnect", engine="d0", phase="decode", status=502)
    assert not migration.may_continue(cut, 100.0, 6.0)


@pytest.mark.parametrize("body", [{}, {"response_format": {"type": "text"}}, {"tool_choice": "auto"},
                                  {"tool_choice": "none"}, {"n": 1}])
def test_free_output_still_continues(body: dict[str, Any]) -> None:
    migration = _kept(_chat_request(**body), _chat_chunk(" t0"))
    cut = EngineError("gone", reason="engine_disconnect", engine="d0", phase="decode", status=502)
    assert migration.may_continue(cut, 100.0, 6.0)


def test_a_continuation_leg_never_asks_for_echo_or_prompt_logprobs() -> None:
    seen = _seen("chat", _chat_chunk(" t0"))
    body = {"model": "m", "echo": True, "prompt_logprobs": 2, "logprobs": True, "max_tokens": 4}
    _, out = continuation(CHAT, body, {"messages": [{"role": "user", "content": "hi"}]}, seen)
    assert "echo" not in out and "prompt_logprobs" not in out and out["logprobs"] is True
    completion_seen = _seen("completions", _data({"id": "c", "choices": [{"index": 0, "text": " t0"}]}))
    _, out = continuation(COMPLETIONS, {"prompt_logprobs": 1}, {"prompt": "Once"}, completion_seen)
    assert "prompt_logprobs" not in out
    gen_seen = _seen("generate", _data({"request_id": "g", "choices": [{"index": 0, "token_ids": [1000]}]}))
    _, out = continuation(GENERATE, {"sampling_params": {"max_tokens": 3, "prompt_logprobs": 1}},
                          {"token_ids": [5]}, gen_seen)
    assert out["sampling_params"] == {"max_tokens": 2}


def test_a_completions_continuation_never_shows_its_own_prompt_token_ids() -> None:
    seen = _seen("completions", _data({"id": "c", "created": 1, "choices": [{"index": 0, "text": " t0"}]}))
    splice = Splice("completions", seen, prompt_tokens=3)
    first = _data({"id": "other", "created": 2, "choices": [
        {"index": 0, "text": " t1", "prompt_token_ids": [9, 9, 9, 1000], "token_ids": [1001]}]})
    out = orjson.loads(splice(first).removeprefix(b"data: "))
    assert out["choices"][0]["prompt_token_ids"] is None and out["choices"][0]["token_ids"] == [1001]
    assert (out["id"], out["created"]) == ("c", 1)


@pytest.mark.parametrize(("event", "unreadable"), [
    (b'data: {"choices": {"x": 1}}\n\n', True),
    (b'data: {"choices": [{"delta": "text"}]}\n\n', True),
    (b'data: {"choices": [{"finish_reason": "stop", "delta": {"content": 5}}], "usage": 3}\n\n', False),
])
def test_an_odd_continuation_event_never_raises_in_the_relay(event: bytes, unreadable: bool) -> None:
    req = ClientRequest(endpoint=MESSAGES, body={"model": "m", "max_tokens": 4}, model="m", stream=True,
                        deadline=100.0, forward={}, prompt={"messages": [{"role": "user", "content": "hi"}]})
    migration = _kept(req, b'event: content_block_delta\ndata: {"type":"content_block_delta",'
                           b'"delta":{"type":"text_delta","text":" t0"},"index":0}\n\n')
    cut = EngineError("gone", reason="engine_disconnect", engine="d0", phase="decode", status=502)
    assert migration.after(cut, req, 6.0, 1) is not None
    written: list[bytes] = []
    sink = migration.sink(lambda span: written.append(span) is None)
    outcome = sink(event)  # never raises: an event it cannot rewrite stops the relay, the engine's fault
    assert migration.unreadable is unreadable and outcome is not unreadable


def test_a_transcript_is_bounded_and_held_against_the_workers_budget() -> None:
    from narwhal.request.stream_buffers import StreamBuffers

    buffers = StreamBuffers(1 << 20)
    transcript = Transcript(buffers)
    for i in range(2000):  # incompressible-ish spans: each compaction holds a real block
        transcript.keep(_data({"id": "c", "choices": [{"index": 0, "text": f" {i:08x}{'x' * (i % 97)}",
                                                       "logprobs": {"x": [i * 7919 % 104729] * 40}}]}))
    assert not transcript.full and buffers.total > 0
    transcript.close()
    assert buffers.total == 0  # given back when the stream ends
    small = StreamBuffers(1024)
    capped = Transcript(small)
    for i in range(200):
        capped.keep(_data({"id": "c", "choices": [{"index": 0, "text": f" t{i}" * 50}]}))
    assert capped.full and small.total == 0  # the budget could not take a block: it stopped keeping
    assert len(capped.tail()) == 2  # the finish probe still reads the last spans


def test_a_stream_whose_transcript_is_full_is_not_continued() -> None:
    migration = _kept(_chat_request(), _chat_chunk(" t0"))
    migration.transcript.full = True
    cut = EngineError("gone", reason="engine_disconnect", engine="d0", phase="decode", status=502)
    assert not migration.may_continue(cut, 100.0, 6.0)
