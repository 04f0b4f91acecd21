"""The decode's ``completion_tokens``, read from the engine's bytes without parsing them.

The relay never parses the events it passes on (docs/behaviour.md "Decode"), and a whole answer
is sent as received, so the count is found by a byte search from the end: vLLM writes ``usage``
last in a non-streaming body, and in a stream (only when the client asked for
``stream_options.include_usage``) in the last event before ``[DONE]``; with
``continuous_usage_stats`` every event carries it and the last one is the total. Anything that
does not look like a count gives None rather than a guess.

:class:`UsageTap` keeps the latest count among the spans written to the client, whichever way
they went (the direct relay's sink or the caller's writes, both in the order received), for
streams that asked for usage only: one byte search per span, nothing for the other streams.
"""

from __future__ import annotations

from narwhal.engines.relay import Sink

_KEY = b'"completion_tokens":'


_MAX_DIGITS = 15


def completion_tokens(data: bytes | None) -> int | None:
    """The last ``"completion_tokens": N`` in ``data``, or None."""
    if not data:
        return None
    at = data.rfind(_KEY)
    if at < 0:
        return None
    start = at + len(_KEY)
    while start < len(data) and data[start] == 0x20:
        start += 1
    end = start
    while end < len(data) and 0x30 <= data[end] <= 0x39 and end - start <= _MAX_DIGITS:
        end += 1
    if end == start or end - start > _MAX_DIGITS:
        return None  # no number, or one no engine could mean (int() refuses 4,300 digits and more)
    return int(data[start:end])


def wants_usage(body: dict[str, object]) -> bool:
    """The client asked for usage in its stream, so a :class:`UsageTap` is worth its byte searches."""
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


class UsageTap:
    """A sink that notes the latest ``completion_tokens`` in what it passes on (and in what the
    caller shows it with :meth:`see`)."""

    __slots__ = ("_inner", "tokens")

    def __init__(self, inner: Sink) -> None:
        self._inner = inner
        self.tokens: int | None = None

    def see(self, span: bytes) -> None:
        """Note a span the caller wrote itself; call in the order sent, so the last count wins."""
        found = completion_tokens(span)
        if found is not None:
            self.tokens = found

    def __call__(self, span: bytes) -> bool:
        self.see(span)
        return self._inner(span)
