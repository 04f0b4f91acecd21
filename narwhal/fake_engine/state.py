"""What one fake engine is, without its HTTP app: configuration, faults, counters, records, KV.

Invariant: this module sits at the bottom of the engine's import stack. It imports only the leaf
modules (``chunks``, ``faults``, ``kvstore``), never ``kv``, ``generate``, ``routes`` or ``engine``,
and everything a request handler touches on an engine lives here. That is why the handoff
(``kv``), the completions (``generate``) and the small routes (``routes``) are typed against
``EngineState`` and import it, while ``engine.FakeEngine`` (an ``EngineState`` that can listen,
stop and restart) sits on top and assembles the aiohttp app: arrows only point down.

The process-wide registry of engines by ``engine_id`` lives here too, for the same reason: it is
the in-process half of the KV side channel (``kv.pull`` looks producers up in it, the engine's
lifecycle keeps it current), and both ends must reach it without importing each other.
"""

from __future__ import annotations

import asyncio
import secrets
import ssl
import time
import uuid
import weakref
from collections import deque
from collections.abc import Coroutine
from typing import Any

import aiohttp
import orjson
from pydantic import BaseModel, ConfigDict, Field

from narwhal.fake_engine.batch import Background, Scheduler
from narwhal.fake_engine.chunks import ModelTemplates
from narwhal.fake_engine.faults import NO_FAULTS, EngineFaults
from narwhal.fake_engine.histogram import Histogram
from narwhal.fake_engine.kv_events import KvEventPublisher, none_hash
from narwhal.fake_engine.kvstore import KvStore
from narwhal.fake_engine.prefix import PrefixCache
from narwhal.fake_engine.release import DEFAULT_VERSION, release_of

# Process-local side channel: engine_id -> engine. Weak, so engines dropped by tests vanish.
_REGISTRY: weakref.WeakValueDictionary[str, EngineState] = weakref.WeakValueDictionary()


def register(engine: EngineState) -> None:
    """Make ``engine`` reachable by ``engine_id`` for in-process KV pulls."""
    _REGISTRY[engine.engine_id] = engine


def unregister(engine: EngineState) -> None:
    """Forget ``engine``: no KV pull finds it by id any more (only its own entry goes)."""
    if _REGISTRY.get(engine.engine_id) is engine:
        del _REGISTRY[engine.engine_id]


def lookup(engine_id: str) -> EngineState | None:
    """The live engine with ``engine_id`` in this process, None if there is none."""
    return _REGISTRY.get(engine_id)


class EngineModel(BaseModel):
    """The load and cache models of one engine (docs/behaviour.md "Fake engines"), each off by default.

    ``kv_blocks`` is the KV capacity in blocks: the prefix cache's LRU bound, and the
    denominator of ``kv_cache_usage_perc`` (running requests' prompt blocks plus held handoff
    blocks, as vLLM counts blocks in use: cached blocks nobody uses are free to it).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_num_seqs: int = Field(default=0, ge=0)  # 0: no batch limit
    prefill_s_per_token: float = Field(default=0.0, ge=0.0, le=1.0)  # per uncached prompt token
    prefix_cache: bool = False  # also: tokens are 4-character pieces of the prompt text
    kv_blocks: int = Field(default=10000, ge=1)
    # False: ``/metrics`` leaves out ``vllm:cache_config_info``, as vLLM before 0.6 and some builds
    # do (the router then knows no KV capacity, docs/behaviour.md "Placement" source 3).
    cache_config_info: bool = True
    # The descriptor's ``tp_size``; as a consumer, vLLM 0.11's NixlConnector rule: its own TP must
    # be a multiple of the producer's, or the KV pull fails (``kv.consumer_pull``).
    tensor_parallel_size: int = Field(default=1, ge=1, le=64)


class BackgroundLoad(BaseModel):
    """``PUT /engines/{name}/background``: requests served for someone else."""

    model_config = ConfigDict(extra="forbid")

    requests: int = Field(ge=0, le=100000)
    hold_s: float = Field(default=1.0, gt=0.0, le=3600.0)  # how long each one runs


class EngineState:
    """State of one fake engine (acts as producer and consumer, like vLLM with ``kv_both``)."""

    def __init__(
        self,
        name: str = "e0",
        *,
        model: str = "fake-model",
        version: str = DEFAULT_VERSION,
        lease_s: float = 30.0,
        block_size: int = 16,
        default_tokens: int = 16,
        token_delay_s: float = 0.0,
        coalesce: bool = False,
        flat_block_ids: bool = False,
        transfer_mode: str = "pull",
        enable_scale_out: bool = False,
        advertise_host: str = "127.0.0.1",
        max_model_len: int = 8192,
        local_kv: bool = True,
        records_max: int = 2000,
        ssl_context: ssl.SSLContext | None = None,
        load_model: EngineModel | None = None,
        kv_events: bool = False,
        kv_buffer_steps: int = 10_000,
    ) -> None:
        self.name = name
        self.kv_events = kv_events  # publish KV-cache events (fake_engine.kv_events), prefix cache on
        self.kv_publisher: KvEventPublisher | None = None  # made once the engine serves (its loop runs)
        self.kv_buffer_steps = kv_buffer_steps  # batches its replay keeps (vLLM's buffer_steps)
        self.engine_id = str(uuid.uuid4())
        self.model = model
        self.base_version = version
        self.release = release_of(version)  # what this vLLM release does (fake_engine.release)
        self.transfer_mode = transfer_mode  # NIXL's pull or push: part of the compatibility hash
        self.enable_scale_out = enable_scale_out  # /inference/v1/generate served on a current release
        self.default_tokens = default_tokens
        self.token_delay_s = token_delay_s
        self.coalesce = coalesce
        self.flat_block_ids = flat_block_ids or not self.release.nested_block_ids
        self.advertise_host = advertise_host
        self.max_model_len = max_model_len
        # False forces consumers to use the HTTP side channel even for producers in this process.
        self.local_kv = local_kv
        self.port: int | None = None
        self.serving = False
        self.faults: EngineFaults = NO_FAULTS
        self.kv = KvStore(lease_s=lease_s, block_size=block_size)
        self.records: deque[dict[str, Any]] = deque(maxlen=records_max)
        self.records_dropped = 0  # pushed out of the bounded list: a reader needing all must know
        self._init_counters()
        self._id_prefix = secrets.token_hex(4)
        self._seq = 0
        self._templates: dict[str, ModelTemplates] = {}
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.listen_host = "127.0.0.1"
        self.ssl_context = ssl_context  # serve https, as an engine behind a TLS terminator would
        self.created = int(time.time())
        self._init_models(load_model or EngineModel())
        register(self)

    def _init_counters(self) -> None:
        """What the fake counts of the requests it served (``/fake/stats``: tests read them)."""
        self.requests_prefill = 0
        self.requests_decode = 0
        self.active_requests = 0
        self.active_streams = 0
        self.aborted_streams = 0
        self.completed_streams = 0
        self.completed_requests = 0
        self.kv_pulls = 0
        self.kv_pull_failures = 0
        self.incompatible_decodes = 0  # decodes whose producer runs another version or transfer mode
        # GETs of /health, /version and /v1/models answered: lets a test wait for N health
        # checks (or a lifecycle validation) instead of sleeping and hoping they happened.
        self.control_reads = {"health": 0, "version": 0, "models": 0, "metrics": 0}

    def _init_models(self, load_model: EngineModel) -> None:
        self.scheduler = Scheduler()
        self.background = Background(self.scheduler)
        self.cache: PrefixCache | None = None
        self._hash_seed = none_hash(self.release.minor)  # the first block's parent (random before 0.29)
        self.prefix_queries = 0  # tokens looked up in the prefix cache (vLLM's counter unit)
        self.prefix_hits = 0  # of those, tokens found cached
        # vLLM's request phases: queued for a batch slot, then scheduled until the prefill is done.
        self.queue_time = Histogram()
        self.prefill_time = Histogram()
        self.load_model = load_model
        self.set_load_model(load_model)

    # -- configuration seen by requests -------------------------------------------------------

    @property
    def models(self) -> list[str]:
        """The models served: a fault's override, else the one configured."""
        return self.faults.models if self.faults.models else [self.model]

    @property
    def version(self) -> str:
        """What ``/version`` says: a fault's override, else the configured version."""
        return self.faults.version or self.base_version

    @property
    def url(self) -> str | None:
        """Where the engine listens (https with TLS); None before it has a port."""
        scheme = "https" if self.ssl_context is not None else "http"
        return None if self.port is None else f"{scheme}://{self.advertise_host}:{self.port}"

    def set_faults(self, faults: EngineFaults | dict[str, Any]) -> EngineFaults:
        """Replace the engine-wide faults (validated); returns them."""
        self.faults = faults if isinstance(faults, EngineFaults) else EngineFaults.model_validate(faults)
        return self.faults

    def clear_faults(self) -> None:
        """Back to no faults at all."""
        self.faults = NO_FAULTS

    def restarted(self, version: str | None = None, enable_scale_out: bool | None = None) -> None:
        """As a vLLM process started again: a new engine id, an empty prefix cache; with
        ``version``, a process of that release (a rolling upgrade's step: its /version, its shapes
        and the compatibility its handoffs are judged by); with ``enable_scale_out``, one started
        with (True) or without (False) ``--enable-scale-out``."""
        if enable_scale_out is not None:
            self.enable_scale_out = enable_scale_out
        if version:
            self.base_version = version
            self.release = release_of(version)
            self.flat_block_ids = not self.release.nested_block_ids
        unregister(self)
        self.engine_id = str(uuid.uuid4())
        register(self)
        self._hash_seed = none_hash(self.release.minor)
        if self.kv_publisher is not None:  # a new process: a new publisher on the same ports, seq from 0
            self.kv_publisher = self.kv_publisher.restarted(self.release.minor)
        if self.cache is not None:
            self.cache = self._new_cache(self.load_model.kv_blocks)

    def start_kv_events(self) -> None:
        """Publish KV-cache events from now on (the serving loop runs): PUB and replay bound."""
        if self.kv_events and self.kv_publisher is None:
            self.kv_publisher = KvEventPublisher(self.release.minor, f"kv@{self.listen_host}:{self.port}@{self.model}",
                                                 self.kv.block_size, buffer_steps=self.kv_buffer_steps)
            self.kv_publisher.start()
            if self.cache is not None:
                self.cache.publisher = self.kv_publisher

    def _new_cache(self, capacity: int) -> PrefixCache:
        return PrefixCache(capacity, self.kv.block_size, self._hash_seed, self.kv_publisher)

    def set_load_model(self, model: EngineModel) -> EngineModel:
        """Apply new model settings at once; a kept prefix cache keeps its blocks (trimmed)."""
        self.load_model = model
        self.scheduler.set_limit(model.max_num_seqs)
        if not model.prefix_cache:
            self.cache = None
        elif self.cache is None:
            self.cache = self._new_cache(model.kv_blocks)
        else:
            self.cache.capacity = model.kv_blocks
            self.cache.trim(self.scheduler.running_blocks)
        return model

    def blocks_in_use(self) -> int:
        """Blocks in use: running prompts (a shared prefix block once) and held handoffs."""
        hashed = self.cache.in_use if self.cache is not None else 0
        return self.kv.held_blocks + self.scheduler.running_blocks + hashed

    def kv_usage(self) -> float:
        """``vllm:kv_cache_usage_perc``: blocks in use / capacity (cached blocks nobody uses are free)."""
        return min(1.0, self.blocks_in_use() / self.load_model.kv_blocks)

    def templates(self, model: str) -> ModelTemplates:
        """The frame templates of ``model``, built once per engine and model."""
        tpl = self._templates.get(model)
        if tpl is None:
            tpl = self._templates[model] = ModelTemplates(model)
        return tpl

    def next_id(self) -> str:
        """A request id unique to this engine (the default when the request sends none)."""
        self._seq += 1
        return f"{self._id_prefix}{self._seq:08x}"

    # -- bookkeeping ---------------------------------------------------------------------------

    def count_request(self, phase: str) -> None:
        """Count a request in its phase's counter, what ``/fake/stats`` reports."""
        if phase == "prefill":
            self.requests_prefill += 1
        else:
            self.requests_decode += 1

    def record(self, phase: str, path: str, headers: dict[str, str], body: Any) -> dict[str, Any]:
        """Append a request record (outcome pending) to the bounded list; counts what it pushes out."""
        rec: dict[str, Any] = {
            "phase": phase,
            "path": path,
            "headers": headers,
            "body": body,
            "t": time.time(),
            "outcome": "pending",
            "status": None,
        }
        if len(self.records) == self.records.maxlen:
            self.records_dropped += 1
        self.records.append(rec)
        return rec

    def get_records(self, contains: str | None = None) -> list[dict[str, Any]]:
        """The records, only those whose body contains ``contains`` if given."""
        records = list(self.records)
        if contains:
            needle = contains.encode()
            records = [r for r in records if needle in orjson.dumps(r["body"])]
        return records

    def clear_records(self) -> None:
        """Forget every record (``records_dropped`` stays)."""
        self.records.clear()

    def stats(self) -> dict[str, Any]:
        """The engine's counters as ``/fake/stats`` answers them; sweeps expired leases first."""
        self.kv.sweep()
        store = self.kv
        return {
            "name": self.name,
            "engine_id": self.engine_id,
            "url": self.url,
            "serving": self.serving,
            "held_blocks": store.held_blocks,
            "held_requests": len(store.held),
            "records_dropped": self.records_dropped,
            "requests": {
                "prefill": self.requests_prefill,
                "decode": self.requests_decode,
                "total": self.requests_prefill + self.requests_decode,
            },
            "kv_reads": store.kv_reads,
            "late_reads": store.late_reads,
            # docs/decisions.md "vLLM releases"'s name: reads of a handoff whose lease ran out
            "expired_reads": store.late_reads,
            "incompatible_decodes": self.incompatible_decodes,
            "version": self.base_version,
            "transfer_mode": self.transfer_mode,
            "expired_blocks": store.expired_blocks,
            "expired_requests": store.expired_requests,
            "kv_pulls": self.kv_pulls,
            "kv_pull_failures": self.kv_pull_failures,
            "active_requests": self.active_requests,
            "active_streams": self.active_streams,
            "aborted_streams": self.aborted_streams,
            "completed_streams": self.completed_streams,
            "completed_requests": self.completed_requests,
            "control_reads": dict(self.control_reads),
            "model": self.load_model.model_dump(),
            "scheduler": {
                "running": self.scheduler.running,
                "waiting": self.scheduler.waiting,
                "background": self.background.requests,
                "background_served": self.background.served,
            },
            "prefix_cache": {
                "blocks": len(self.cache) if self.cache is not None else 0,
                "queries": self.prefix_queries,
                "hits": self.prefix_hits,
            },
        }

    # -- background work and the side channel's HTTP client ----------------------------------

    def client_session(self) -> aiohttp.ClientSession:
        """The engine's one HTTP session (the KV side channel), made again if closed."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5, sock_connect=2))
        return self._session

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run background work (e.g. releasing a producer's blocks after an abort) tied to us."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def end_background(self, *others: asyncio.Task[Any]) -> None:
        """Cancel spawned work, wait for it and for ``others`` (already cancelled), close the client."""
        for task in list(self._tasks):
            task.cancel()
        await self.background.stop()
        await asyncio.gather(*others, *self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None
