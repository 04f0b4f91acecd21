"""The decode's completion_tokens found by a byte search, and the backend id's shape."""

from __future__ import annotations

import re

from narwhal.request.ids import backend_id
from narwhal.request.usage import UsageTap, completion_tokens, wants_usage


def test_completion_tokens_is_the_last_count_in_the_bytes() -> None:
    body = b'{"id":"cmpl-1","usage":{"prompt_tokens":7,"total_tokens":12,"completion_tokens":5}}'
    assert completion_tokens(body) == 5
    span = b'data: {"usage":{"completion_tokens": 2}}\n\ndata: {"usage":{"completion_tokens": 9}}\n\ndata: [DONE]\n\n'
    assert completion_tokens(span) == 9


def test_no_count_is_none_never_a_guess() -> None:
    assert completion_tokens(None) is None
    assert completion_tokens(b"") is None
    assert completion_tokens(b'{"usage":null}') is None
    assert completion_tokens(b'{"usage":{"completion_tokens":null}}') is None


def test_only_include_usage_true_asks_for_usage() -> None:
    assert wants_usage({"stream_options": {"include_usage": True}})
    assert not wants_usage({"stream_options": {"include_usage": 1}})
    assert not wants_usage({"stream_options": None})
    assert not wants_usage({})


def test_the_tap_passes_spans_on_and_keeps_the_latest_count_whichever_way_it_went() -> None:
    seen: list[bytes] = []
    tap = UsageTap(lambda span: seen.append(span) is None)
    assert tap(b'data: {"usage":{"completion_tokens":1}}\n\n') and tap(b"data: {}\n\n")
    assert seen == [b'data: {"usage":{"completion_tokens":1}}\n\n', b"data: {}\n\n"] and tap.tokens == 1
    tap.see(b'data: {"usage":{"completion_tokens":3}}\n\n')  # a span the caller wrote itself
    tap.see(b"data: [DONE]\n\n")
    assert tap.tokens == 3


def test_backend_ids_are_derived_unique_and_safe() -> None:
    a, b = backend_id("client-abc", 1), backend_id("client-abc", 1)
    assert a != b
    assert re.fullmatch(r"client-abc-[0-9a-f]{16}-a1", a)
    odd = backend_id("é \"/;" + "y" * 80, 3)
    assert re.fullmatch(r"_{5}y{59}-[0-9a-f]{16}-a3", odd), odd
    assert odd.isascii()
