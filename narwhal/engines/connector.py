"""The KV handoff: the prefill rewrite, the descriptor, and its validation (docs/behaviour.md
"Prefill", "Handoff validation").

The descriptor is the producer's ``kv_transfer_params``. Proxies copy it *verbatim* into the
decode request: vLLM adds fields with every NIXL connector version (``tp_size``, ``dcp_size``,
``remote_num_tokens``, ``transfer_mode`` …), and a router that rebuilt the object from the
fields it knows would silently drop what a newer consumer needs (without ``tp_size`` the
consumer sends no lease heartbeats and the producer's blocks expire). So validation checks
only what would make the decode useless or dangerous, and keeps every other key untouched.

Rule order matters: the first failing rule decides the detail (docs/behaviour.md "Handoff validation").
"""

from __future__ import annotations

from typing import Any, NewType

from narwhal.errors import EngineError
from narwhal.reasons import Reason

NIXL = "NixlConnector"

CheckedHandoff = NewType("CheckedHandoff", dict[str, Any])
"""A descriptor that passed :func:`validate_descriptor`: the only kind a decode leg takes
(``engines.decode.DecodeLeg``), so an unchecked dict cannot reach a consumer (the type checker
refuses it; at run time it is the same dict, unchanged)."""

# Keys that belong to other connectors' descriptors: seeing one means the producer is not
# running the connector this router was configured for.
FOREIGN_KEYS: frozenset[str] = frozenset(
    {"transfer_id", "remote_bootstrap_addr", "first_tok", "disagg_spec", "ret_first_tok"}
)

# What a producer is asked to do: prefill, keep the blocks for a remote decoder.
PREFILL_KV_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# Removed from the prefill body so the single token never ends the request early and the
# engine always returns a descriptor; stream_options is refused by vLLM when stream=false.
_PREFILL_DROPPED = frozenset(("stream_options", "min_tokens", "stop", "stop_token_ids"))


def ask_for_handoff(out: dict[str, Any], crossed: bool) -> None:
    """Set a prefill body's ``kv_transfer_params``: the descriptor request when another engine
    decodes; none for a same-worker decode, whose prefill only warms the prefix cache (asking
    for a remote decode would pin KV blocks waiting for a reader that never comes)."""
    if crossed:
        out["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    else:
        out.pop("kv_transfer_params", None)


def prefill_body(body: dict[str, Any], *, crossed: bool) -> dict[str, Any]:
    """The body sent to the producer, built from the parsed client body (shallow copy)."""
    out = dict(body)
    for key in _PREFILL_DROPPED.intersection(body):  # only the keys present: one call, not four
        del out[key]
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    out["ignore_eos"] = True
    ask_for_handoff(out, crossed)
    return out


def release_body(body: dict[str, Any], descriptor: dict[str, Any]) -> dict[str, Any]:
    """A one-token, non-streaming decode whose only purpose is to free the producer's blocks."""
    out = dict(body)
    for key in _PREFILL_DROPPED.intersection(body):  # a release the consumer refuses frees nothing
        del out[key]
    out["stream"] = False
    out["max_tokens"] = 1
    if "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    out["kv_transfer_params"] = descriptor
    return out


class InvalidHandoff(EngineError):
    """The descriptor failed validation: a producer fault (502, retryable)."""

    def __init__(self, detail: str, *, engine: str) -> None:
        super().__init__(f"invalid handoff: {detail}", reason=Reason.INVALID_HANDOFF, engine=engine, phase="prefill")


def _ids_ok(ids: list[Any]) -> bool:
    # Element types and the minimum in C: a long prompt's descriptor holds hundreds of block
    # ids, and a Python call per id was the costliest part of validation. ``type`` is exact,
    # so a bool is refused as an id.
    return not ids or (list(map(type, ids)).count(int) == len(ids) and min(ids) >= 0)


def _block_ids_ok(ids: Any) -> bool:
    # Flat (older builds), empty (prompt shorter than a block), or one list per KV cache group;
    # the first element says which, so the ids are checked once, in the form they have.
    if type(ids) is not list:
        return False
    if not ids or type(ids[0]) is not list:
        return _ids_ok(ids)
    return list(map(type, ids)).count(list) == len(ids) and all(map(_ids_ok, ids))


# The fields validation reads, in the order of the rules below.
_CHECKED = ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port", "remote_request_id")


def validate_descriptor(
    descriptor: Any, *, producer: str, prefill_endpoint: str, decode_endpoint: str
) -> CheckedHandoff:
    """Check a NixlConnector descriptor; return it unchanged or raise :class:`InvalidHandoff`.

    A descriptor is decoded JSON, once per request on the request path: its values are tested
    by exact type (``type(v) is str``: JSON's are never subclasses), and the fields are read
    in one pass (``map``), not a call each."""
    if not isinstance(descriptor, dict):
        raise InvalidHandoff("missing engine identity", engine=producer)
    if not FOREIGN_KEYS.isdisjoint(descriptor):
        raise InvalidHandoff("connector mismatch", engine=producer)
    engine_id, block_ids, host, port, rid = map(descriptor.get, _CHECKED)
    if type(engine_id) is not str or not engine_id:
        raise InvalidHandoff("missing engine identity", engine=producer)
    if not _block_ids_ok(block_ids):
        raise InvalidHandoff("malformed block IDs", engine=producer)
    if type(host) is not str or not host:
        raise InvalidHandoff("malformed field remote_host", engine=producer)
    if type(port) is not int or not 1 <= port <= 65535:
        raise InvalidHandoff("malformed field remote_port", engine=producer)
    if rid is not None and (type(rid) is not str or not rid):
        raise InvalidHandoff("malformed field remote_request_id", engine=producer)
    if prefill_endpoint != decode_endpoint:
        raise InvalidHandoff("endpoint mismatch", engine=producer)
    return CheckedHandoff(descriptor)


def tp_size_of(descriptor: Any) -> int | None:
    """The producer's tensor-parallel size as its descriptor states it (``tp_size``), if it does."""
    tp = descriptor.get("tp_size") if isinstance(descriptor, dict) else None
    return tp if type(tp) is int and tp >= 1 else None


def tp_accepted(producer_tp: int, consumer_tp: int) -> bool:
    """vLLM 0.11's NixlConnector rule: each consumer rank reads one producer rank's share of the KV
    heads, so the consumer's TP must be a multiple of the producer's (decode TP >= prefill TP).
    A consumer that breaks it fails the NIXL handshake at its first handoff, and says so only in
    its own log (ai-dynamo/dynamo#2295)."""
    return consumer_tp % producer_tp == 0
