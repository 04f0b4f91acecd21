"""What admission takes from a client's headers (docs/behaviour.md "The request path"): W3C trace context only when
valid,
the client's request id only when printable ASCII of at most 128 characters, a credential as
the bytes sent. None of it can raise, whatever the header holds.

aiohttp's server decodes header bytes as UTF-8 with surrogate escapes: ``"\\udcff"`` below is
how a byte 0xff in no encoding reaches the router."""

from __future__ import annotations

from typing import Any

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from narwhal.request.admission import presented_token, trace_context
from narwhal.request.ids import client_request_id

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class _Request:
    """What the rules read of a request: its headers, as aiohttp's server hands them over
    (``make_mocked_request`` cannot carry the surrogate escapes: it encodes its headers)."""

    def __init__(self, headers: dict[str, str]) -> None:
        self.headers = CIMultiDictProxy(CIMultiDict(headers))


def request(**headers: str) -> Any:
    return _Request({k.replace("_", "-"): v for k, v in headers.items()})


def forwarded(req: Any) -> dict[str, str]:
    """``trace_context`` with the ``traceparent`` read as the router reads it, before admission."""
    return trace_context(req, req.headers.get("traceparent"))


@pytest.mark.parametrize(
    "value",
    [TRACEPARENT, "00-abc-def-01", "x" * 55],
    ids=["w3c", "short", "55_chars"],
)
def test_a_printable_ascii_traceparent_within_55_characters_is_forwarded(value: str) -> None:
    assert forwarded(request(traceparent=value)) == {"traceparent": value}


@pytest.mark.parametrize(
    "value", ["", TRACEPARENT + "0", "00-€", "00-\udcff", "00-a\tb", "00-\x7f"],
    ids=["empty", "56_chars", "utf8", "no_encoding", "tab", "del"],
)
def test_any_other_traceparent_is_dropped(value: str) -> None:
    assert forwarded(request(traceparent=value, tracestate="a=1")) == {"tracestate": "a=1"}


@pytest.mark.parametrize(
    "value",
    ["a=1", "a=1,b=2", ",".join(f"k{i}=v" for i in range(32)), "k" * 256 + "=" + "v" * 256, "a=1, ,b=2"],
    ids=["one", "two", "32_members", "longest_member", "empty_member"],
)
def test_a_tracestate_within_w3c_lengths_is_forwarded(value: str) -> None:
    assert forwarded(request(tracestate=value)) == {"tracestate": value}


@pytest.mark.parametrize(
    "value",
    ["", "v=€", "v=\udcff", ",".join(f"k{i}=v" for i in range(33)), "k" * 256 + "=" + "v" * 257],
    ids=["empty", "utf8", "no_encoding", "33_members", "member_too_long"],
)
def test_any_other_tracestate_is_dropped(value: str) -> None:
    got = forwarded(request(traceparent=TRACEPARENT, tracestate=value))
    assert got == {"traceparent": TRACEPARENT}


def test_no_trace_context_forwards_nothing() -> None:
    assert forwarded(request(x_request_id="r")) == {}


@pytest.mark.parametrize("value", ["r", "r" * 128, "a b ~!"])
def test_a_printable_ascii_request_id_is_kept(value: str) -> None:
    assert client_request_id(request(x_request_id=value)) == value


@pytest.mark.parametrize("value", ["", "r" * 129, "é€", "\udcff", "a\tb"])
def test_any_other_request_id_is_replaced(value: str) -> None:
    got = client_request_id(request(x_request_id=value))
    assert got != value and len(got) == 32 and int(got, 16) >= 0


@pytest.mark.parametrize(
    ("headers", "x_api_key", "token"),
    [
        ({"Authorization": "Bearer k1"}, False, b"k1"),
        ({"Authorization": "bearer k1"}, False, b"k1"),
        ({"Authorization": "Basic k1"}, False, b""),
        ({"Authorization": "Bearer €"}, False, "€".encode()),
        ({"Authorization": "Bearer \udcff\udcfe"}, False, b"\xff\xfe"),  # the bytes sent, back
        ({"x-api-key": "\udcff"}, True, b"\xff"),
        ({"x-api-key": "k2"}, False, b""),
        ({"Authorization": "Bearer k1", "x-api-key": "k2"}, True, b"k1"),
    ],
)
def test_the_presented_token_is_the_bytes_the_client_sent(
    headers: dict[str, str], x_api_key: bool, token: bytes
) -> None:
    assert presented_token(_Request(headers), x_api_key=x_api_key) == token
