"""Imitation of NixlConnector's KV handoff: the producer's descriptor and the consumer's pull.

What vLLM does (vLLM's NixlConnector and scheduler, `vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py`):
a prefill sent with ``do_remote_decode: true`` finishes,
but its KV blocks stay allocated on the producer (``delay_free_blocks``) until a consumer READs
them through the NIXL side channel, or until the lease (``kv_lease_duration``, default 30 s)
expires. A read of blocks that are gone is only logged and the decode goes on ("late read"). A read
that cannot happen at all (producer unreachable, transfer error) with
``kv_load_failure_policy="fail"`` fails the decode.

How the fake does it:

* The held blocks are each producer's ``kvstore.KvStore`` (lease and sweep rules there). A
  descriptor holds its blocks unless no consumer could ever read it (``producer_descriptor``).
* The "side channel" is, first, the process-local registry of engines by ``engine_id``
  (``state.lookup``; no HTTP: a fleet of engines in one process hands off at memory speed), and
  otherwise ``POST http://{remote_host}:{remote_port}/fake/kv/read`` on the producer.

Late reads and reads are counted on the *producer* (vLLM logs them there); the consumer counts its
own pulls and pull failures (``consumer_pull``), but not the reads that only release the blocks of
a decode that never ran. Works on ``state.EngineState``, below the engine's app: nothing here
imports ``engine``, ``routes`` or ``generate``.
"""

from __future__ import annotations

from typing import Any

import aiohttp

from narwhal.fake_engine import release
from narwhal.fake_engine.state import EngineState, lookup

MISSING: Any = object()


def producer_descriptor(
    engine: EngineState, params: dict[str, Any] | None, rid: str, prompt_tokens: int, fault: str | None,
    cached_tokens: int = 0,
) -> Any:
    """The producer's handoff in the key set of the engine's release (``fake_engine.release``,
    vLLM's NixlConnector, `nixl_connector.py`, in each release), corrupted on demand.

    Allocates and holds the blocks when a usable descriptor is returned; ``MISSING`` means "omit the
    key". A corrupted descriptor holds nothing: no consumer could ever read or free it, so a router
    is right to send it nowhere (docs/behaviour.md "Cleanup"), and held blocks must stay a measure
    of what a *router* strands.
    """
    if fault == "missing":
        return MISSING
    if fault == "null" or params is None or params.get("do_remote_decode") is not True:
        # vLLM frees the blocks at once when it returns no descriptor.
        return None
    store = engine.kv
    remote_request_id = store.unique_request_id(f"{rid}-0")
    if fault in (None, "localhost", "empty_groups", "hybrid_groups"):
        blocks = store.allocate(remote_request_id, prompt_tokens)
    else:
        blocks = list(range(max(0, -(-prompt_tokens // store.block_size))))
    desc: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": blocks if engine.flat_block_ids else [blocks],
        "remote_engine_id": engine.engine_id,
        "remote_request_id": remote_request_id,
        "remote_host": engine.advertise_host,
        "remote_port": engine.port,
        "tp_size": engine.load_model.tensor_parallel_size,
    }
    _release_keys(engine, desc, prompt_tokens, cached_tokens)
    if fault == "no_engine_id":
        del desc["remote_engine_id"]
    elif fault == "bad_blocks":
        desc["remote_block_ids"] = [["x"]]
    elif fault == "mooncake":
        desc["transfer_id"] = f"xfer-{rid}"
        desc["remote_bootstrap_addr"] = f"http://{engine.advertise_host}:8998"
    elif fault == "lmcache":
        desc["first_tok"] = 1
    elif fault == "bad_port":
        desc["remote_port"] = 0
    elif fault == "localhost":
        desc["remote_host"] = "localhost"
    elif fault == "empty_groups":  # held all the same: the read (by request id) frees them
        desc["remote_block_ids"] = [] if engine.flat_block_ids else [[]]
    elif fault == "hybrid_groups":
        desc["remote_block_ids"] = blocks if engine.flat_block_ids else [[], blocks]
    return desc


def _release_keys(engine: EngineState, desc: dict[str, Any], prompt_tokens: int, cached_tokens: int) -> None:
    """The keys the engine's release adds to (or leaves out of) the common ones (``fake_engine.release``)."""
    if engine.release.release_0_2x:  # 0.21.0 nixl/scheduler.py: the common keys and the token count
        desc["remote_num_tokens"] = prompt_tokens
    elif engine.release.current:  # nixl/pull_scheduler.py request_finished, then the scheduler's key
        desc.update({
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": prompt_tokens,
            "remote_blocks_expiry_time": None,
            "remote_registration_generation": 1,
            "transfer_mode": engine.transfer_mode,
            "remote_prefill_cached_tokens": cached_tokens,
        })
        if engine.transfer_mode == "push":  # push_scheduler: neither of these (vLLM 0.33's `nixl_connector.py`)
            del desc["remote_blocks_expiry_time"], desc["remote_registration_generation"]
        elif not engine.release.since_033:  # a real 0.32 engine's fourteen keys (the real tier)
            del desc["remote_registration_generation"]
    else:  # 0.11's seven keys: its scheduler knew no request id of its own to hand over
        del desc["remote_request_id"]


def pull_target(params: dict[str, Any]) -> tuple[str, str, str, int] | None:
    """(engine_id, request_id, host, port) if the descriptor names a readable producer.

    vLLM's consumer skips the transfer and prefills locally, without an error, when an identity
    field is missing ("Got invalid KVTransferParams"): so does the fake.
    """
    engine_id = params.get("remote_engine_id")
    request_id = params.get("remote_request_id")
    host = params.get("remote_host")
    port = params.get("remote_port")
    if not (isinstance(engine_id, str) and engine_id and isinstance(request_id, str) and request_id):
        return None
    if not isinstance(host, str) or not isinstance(port, int) or isinstance(port, bool):
        return None
    return engine_id, request_id, host, port


async def pull(consumer: EngineState, params: dict[str, Any]) -> bool:
    """Read the producer's KV for a decode. False means the transfer failed (fail the decode)."""
    target = pull_target(params)
    if target is None:
        return True
    engine_id, request_id, host, port = target
    producer = lookup(engine_id) if consumer.local_kv else None
    if producer is not None:
        # The releases the processes run (a "version" fault only changes what /version says).
        if not release.compatible(producer.base_version, producer.transfer_mode,
                                  consumer.base_version, consumer.transfer_mode):
            consumer.incompatible_decodes += 1  # the NIXL handshake's compatibility hash differs
            return False
        if not producer.serving or producer.faults.kv_read_fails:
            return False
        producer.kv.release(request_id)
        return True
    return await _pull_http(consumer, engine_id, request_id, host, port, params.get("remote_block_ids"))


def tp_refused(consumer: EngineState, params: dict[str, Any]) -> bool:
    """vLLM 0.11's NIXL handshake: a consumer whose TP is not a multiple of the producer's
    ``tp_size`` fails it (``Decode TP cannot be smaller than prefill TP`` in the consumer's log
    only). The decode then fails like any failed pull: the answer says nothing about TP."""
    if not consumer.release.tp_multiple_rule:
        return False  # later releases accept heterogeneous TP (nixl/base_worker.py)
    producer_tp = params.get("tp_size")
    if not isinstance(producer_tp, int) or isinstance(producer_tp, bool) or producer_tp < 1:
        return False
    return consumer.load_model.tensor_parallel_size % producer_tp != 0


async def consumer_pull(consumer: EngineState, params: dict[str, Any]) -> bool:
    """``pull`` for a decode about to run, counted on the consumer (a pull or a pull failure)."""
    ok = pull_target(params) is None or not tp_refused(consumer, params)
    ok = ok and await pull(consumer, params)
    if ok:
        consumer.kv_pulls += 1
    else:
        consumer.kv_pull_failures += 1
    return ok


async def _pull_http(
    consumer: EngineState, engine_id: str, request_id: str, host: str, port: int, blocks: Any
) -> bool:
    if not 0 < port < 65536:
        return False
    session = consumer.client_session()
    payload = {"remote_engine_id": engine_id, "remote_request_id": request_id, "remote_block_ids": blocks}
    try:
        async with session.post(f"http://{host}:{port}/fake/kv/read", json=payload) as resp:
            await resp.read()
            # 404 = unknown or expired request: a late read, which vLLM only logs.
            return resp.status in (200, 404)
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
        return False  # ValueError: a host no resolver takes (a label over 63 bytes): the handshake fails


def serve_read(producer: EngineState, body: Any) -> tuple[int, dict[str, Any]]:
    """The producer's side of ``POST /fake/kv/read``: (status, JSON body)."""
    if not isinstance(body, dict) or not isinstance(body.get("remote_request_id"), str):
        return 400, {"ok": False, "reason": "remote_request_id required"}
    if body.get("remote_engine_id") != producer.engine_id:
        # Handshake mismatch: the descriptor names another engine instance.
        return 409, {"ok": False, "reason": "engine id mismatch"}
    if producer.faults.kv_read_fails:
        return 503, {"ok": False, "reason": "kv read fails (fault)"}
    released = producer.kv.release(body["remote_request_id"])
    if released is None:
        return 404, {"ok": False, "reason": "unknown or expired remote_request_id"}
    return 200, {"ok": True, "released_blocks": released}
