"""Imitation of NixlConnector's KV handoff: held blocks, leases, and the consumer's pull.

What vLLM does (VLLM-PROTOCOL.md A.2–A.5): a prefill sent with ``do_remote_decode: true`` finishes,
but its KV blocks stay allocated on the producer (``delay_free_blocks``) until a consumer READs
them through the NIXL side channel, or until the lease (``kv_lease_duration``, default 30 s)
expires. A read of blocks that are gone is only logged and the decode goes on ("late read"). A read
that cannot happen at all (producer unreachable, transfer error) with
``kv_load_failure_policy="fail"`` fails the decode.

How the fake does it:

* ``KvStore`` is one producer's table of held entries, keyed by ``remote_request_id``. The lease is
  constant per engine, so expiry order equals insertion order: the sweeper pops from the front of
  an insertion-ordered dict and stops at the first live entry (cost proportional to what expires).
  Accesses also sweep, so a read racing the sweeper still sees an expired entry as expired.
* The "side channel" is, first, a process-local registry of engines by ``engine_id`` (no HTTP: a
  fleet of engines in one process hands off at memory speed), and otherwise
  ``POST http://{remote_host}:{remote_port}/fake/kv/read`` on the producer.

Late reads and reads are counted on the *producer* (vLLM logs them there); the consumer counts its
own pulls and pull failures.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp

if TYPE_CHECKING:
    from narwhal.fake_engine.engine import FakeEngine

# Process-local side channel: engine_id -> engine. Weak, so engines dropped by tests vanish.
_REGISTRY: weakref.WeakValueDictionary[str, FakeEngine] = weakref.WeakValueDictionary()


def register(engine: FakeEngine) -> None:
    _REGISTRY[engine.engine_id] = engine


def unregister(engine: FakeEngine) -> None:
    if _REGISTRY.get(engine.engine_id) is engine:
        del _REGISTRY[engine.engine_id]


def lookup(engine_id: str) -> FakeEngine | None:
    return _REGISTRY.get(engine_id)


@dataclass(slots=True)
class HeldEntry:
    blocks: list[int]
    expires_at: float


@dataclass(slots=True)
class KvStore:
    """One producer's held KV blocks and the counters around them."""

    lease_s: float
    block_size: int
    held: dict[str, HeldEntry] = field(default_factory=dict)
    next_block: int = 0
    held_blocks: int = 0
    kv_reads: int = 0
    late_reads: int = 0
    expired_blocks: int = 0
    expired_requests: int = 0

    def allocate(self, remote_request_id: str, prompt_tokens: int) -> list[int]:
        """Pin ``prompt_tokens // block_size`` fresh blocks until read or lease expiry."""
        n = prompt_tokens // self.block_size
        start = self.next_block
        self.next_block = start + n
        blocks = list(range(start, start + n))
        self.held[remote_request_id] = HeldEntry(blocks, time.monotonic() + self.lease_s)
        self.held_blocks += n
        return blocks

    def unique_request_id(self, candidate: str) -> str:
        """``candidate`` unless already held (a reused X-Request-Id must not clobber an entry)."""
        if candidate not in self.held:
            return candidate
        k = 1
        while f"{candidate}-{k}" in self.held:
            k += 1
        return f"{candidate}-{k}"

    def release(self, remote_request_id: str) -> int | None:
        """A consumer read the blocks: free them. None means unknown or expired (a late read)."""
        self.sweep()
        entry = self.held.pop(remote_request_id, None)
        if entry is None:
            self.late_reads += 1
            return None
        self.held_blocks -= len(entry.blocks)
        self.kv_reads += 1
        return len(entry.blocks)

    def sweep(self, now: float | None = None) -> None:
        if not self.held:
            return
        now = time.monotonic() if now is None else now
        expired: list[str] = []
        for key, entry in self.held.items():
            if entry.expires_at > now:
                break
            expired.append(key)
        for key in expired:
            entry = self.held.pop(key)
            self.held_blocks -= len(entry.blocks)
            self.expired_blocks += len(entry.blocks)
            self.expired_requests += 1


MISSING: Any = object()


def producer_descriptor(
    engine: FakeEngine, params: dict[str, Any] | None, rid: str, prompt_tokens: int, fault: str | None
) -> Any:
    """The producer's handoff (VLLM-PROTOCOL.md A.2, newest key set), corrupted on demand.

    Allocates and holds the blocks when a usable descriptor is returned; ``MISSING`` means "omit
    the key". A corrupted descriptor holds nothing: no consumer could ever read or free it, so a
    router is right to send it nowhere (SPEC §3 step 5), and held blocks must stay a measure of
    what a *router* strands.
    """
    if fault == "missing":
        return MISSING
    if fault == "null" or params is None or params.get("do_remote_decode") is not True:
        # vLLM frees the blocks at once when it returns no descriptor.
        return None
    store = engine.kv
    remote_request_id = store.unique_request_id(f"{rid}-0")
    if fault in (None, "localhost"):
        blocks = store.allocate(remote_request_id, prompt_tokens)
    else:
        blocks = list(range(max(0, prompt_tokens // store.block_size)))
    desc: dict[str, Any] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": blocks if engine.flat_block_ids else [blocks],
        "remote_engine_id": engine.engine_id,
        "remote_request_id": remote_request_id,
        "remote_host": engine.advertise_host,
        "remote_port": engine.port,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": prompt_tokens,
        "remote_blocks_expiry_time": None,
        "transfer_mode": "pull",
    }
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
    return desc


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


async def pull(consumer: FakeEngine, params: dict[str, Any]) -> bool:
    """Read the producer's KV for a decode. False means the transfer failed (fail the decode)."""
    target = pull_target(params)
    if target is None:
        return True
    engine_id, request_id, host, port = target
    producer = lookup(engine_id) if consumer.local_kv else None
    if producer is not None:
        if not producer.serving or producer.faults.kv_read_fails:
            return False
        producer.kv.release(request_id)
        return True
    return await _pull_http(consumer, engine_id, request_id, host, port, params.get("remote_block_ids"))


async def _pull_http(
    consumer: FakeEngine, engine_id: str, request_id: str, host: str, port: int, blocks: Any
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
    except (aiohttp.ClientError, OSError, TimeoutError):
        return False


def serve_read(producer: FakeEngine, body: Any) -> tuple[int, dict[str, Any]]:
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
