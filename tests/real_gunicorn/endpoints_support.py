"""The three other P/D endpoints as the real-gunicorn tests speak them: request bodies, the
generated text of a reply, and the exact error shapes docs/behaviour.md "The other P/D endpoints" gives each
endpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from tests.real_gunicorn.support import MODEL, Reply

PREFILL_KV = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                   429: "rate_limit_error", 503: "overloaded_error"}


def sse_events(raw: bytes) -> list[tuple[str | None, Any]]:
    """(event name, parsed data) of every event; ``[DONE]`` stays the string it is."""
    out: list[tuple[str | None, Any]] = []
    for block in raw.split(b"\n\n"):
        if not block or block.startswith(b":"):
            continue
        name, data = None, None
        for line in block.split(b"\n"):
            if line.startswith(b"event: "):
                name = line[7:].decode()
            elif line.startswith(b"data: "):
                data = line[6:]
        out.append((name, "[DONE]" if data == b"[DONE]" else orjson.loads(data or b"null")))
    return out


@dataclass(frozen=True)
class Endpoint:
    path: str
    terminal: str  # the bare terminal event name

    def body(self, tag: str, *, stream: bool = True, max_tokens: int = 4, fake: Any = None, **extra: Any) -> dict:
        if self.path == "/v1/messages":
            body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "stream": stream,
                                    "system": "be brief", "messages": [{"role": "user", "content": tag + " hello"}]}
        elif self.path == "/v1/responses":
            body = {"model": MODEL, "max_output_tokens": max_tokens, "stream": stream,
                    "instructions": "be brief", "input": tag + " hello"}
        else:
            body = {"model": MODEL, "token_ids": [11, 12, 13], "stream": stream, "cache_salt": tag,
                    "sampling_params": {"max_tokens": max_tokens, "temperature": 0}}
        if fake is not None:
            body["narwhal_fake"] = fake
        body.update(extra)
        return body

    def prefill_of(self, body: dict, request_id: str) -> dict:
        """What docs/behaviour.md "The other P/D endpoints" says the producer receives for ``body``."""
        out = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        out["stream"] = False
        out["kv_transfer_params"] = PREFILL_KV
        if self.path == "/v1/messages":
            out.pop("stop_sequences", None)
            out["max_tokens"] = 1
        elif self.path == "/v1/responses":
            out.update(max_output_tokens=1, background=False, store=False, request_id="resp_" + request_id)
        else:
            out.pop("stream_options", None)
            params = {k: v for k, v in out["sampling_params"].items() if k not in ("min_tokens", "stop",
                                                                                     "stop_token_ids")}
            out["sampling_params"] = {**params, "max_tokens": 1}
        return out

    def text(self, raw: bytes) -> str:
        """The generated text of a stream (generate: token ``1000 + i`` stands for `` t{i}``)."""
        parts = []
        for name, data in sse_events(raw):
            if name == "content_block_delta":
                parts.append(data["delta"]["text"])
            elif name == "response.output_text.delta":
                parts.append(data["delta"])
            elif name is None and isinstance(data, dict) and "choices" in data:
                parts.extend(f" t{t - 1000}" for c in data["choices"] for t in c.get("token_ids") or ())
        return "".join(parts)

    def error(self, status: int, reason: str, message: str) -> dict:
        """The router's error body before the 200 on this endpoint."""
        if self.path == "/v1/messages":
            kind = ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
            return {"type": "error", "error": {"type": kind, "message": message}}
        return {"error": {"message": message, "type": reason, "param": None, "code": status}}

    def terminal_error(self, status: int, reason: str, message: str) -> tuple[str | None, dict]:
        """The one terminal event after the 200: (event name, data)."""
        if self.path == "/v1/messages":
            return "error", self.error(status, reason, message)
        if self.path == "/v1/responses":
            return "error", {"type": "error", "code": status, "message": message, "param": None}
        return None, self.error(status, reason, message)


MESSAGES = Endpoint("/v1/messages", "message_stop")
RESPONSES = Endpoint("/v1/responses", "response.completed")
GENERATE = Endpoint("/inference/v1/generate", "[DONE]")
ALL = [MESSAGES, RESPONSES, GENERATE]


def last_event(reply: Reply) -> tuple[str | None, Any]:
    events = sse_events(reply.raw)
    assert events, reply.raw
    return events[-1]


PASSTHROUGH_ROUTES = ["/tokenize", "/detokenize", "/v1/embeddings", "/pooling", "/score", "/v1/score", "/rerank",
                      "/v1/rerank"]


def body_for(route: str, tag: str, **extra: Any) -> dict[str, Any]:
    """A valid body for ``route`` that carries ``tag`` (the records are found by it)."""
    text = f"{tag} hello world"
    bodies: dict[str, dict[str, Any]] = {
        "/tokenize": {"prompt": text},
        "/detokenize": {"tokens": [1, 2, 3], "user": tag},
        "/v1/embeddings": {"input": [text, "second"]},
        "/pooling": {"input": text},
        "/score": {"text_1": text, "text_2": ["a", "b"]},
        "/rerank": {"query": text, "documents": ["a", "b", "c"]},
    }
    bodies["/v1/score"], bodies["/v1/rerank"] = bodies["/score"], bodies["/rerank"]
    return {"model": MODEL, **bodies[route], **extra}
