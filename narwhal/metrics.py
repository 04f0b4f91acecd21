"""Prometheus metrics (docs/operations.md "Following a request"), in multiprocess mode so every worker's samples are
scraped.

``PROMETHEUS_MULTIPROC_DIR`` must be in the environment before ``prometheus_client`` is
first imported in a process: the gunicorn master sets it (``narwhal.master.gunicorn_hooks``) before
any worker imports this module. Without it (unit tests, the Python API) the metrics work in
ordinary single-process mode.

Buckets are LLM-shaped: from 5 ms (a cached prefill on a small model) to 60 s (a long prompt
on a loaded engine). Labels are bounded: endpoints, reasons and engine names are all finite.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

from narwhal.metric_tally import Tally
from narwhal.reasons import Reason

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)

REQUESTS = Counter(
    "narwhal_requests_total",
    "Client requests by endpoint, HTTP status and model (empty when no served model was named)",
    ["endpoint", "code", "model"],
)
TTFT = Histogram(
    "narwhal_ttft_seconds", "Arrival to the producer's prefill completion (handoff ready)", buckets=LATENCY_BUCKETS
)
FIRST_BYTE = Histogram(
    "narwhal_first_byte_seconds",
    "Arrival to the first generated output sent to the client (what a user feels as TTFT)",
    buckets=LATENCY_BUCKETS,
)
# Per stream, not per token: the mean gap between the spans written to the client (a span is
# what one socket read brought, usually one token on a paced engine), from one clock read at
# the first token and one at [DONE] — no clock read per token.
INTER_TOKEN = Histogram(
    "narwhal_inter_token_seconds",
    "Mean gap between output spans of a completed stream, first token to [DONE] (one sample per stream)",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5),
)
REQUESTS_INFLIGHT = Gauge(
    "narwhal_requests_inflight",
    "Admitted client requests in flight in this host's workers (exported by the supervisor from shared memory)",
    multiprocess_mode="livemax",
)
REQUESTS_QUEUED = Gauge(
    "narwhal_requests_queued", "Client requests waiting for a pair (placement.max_queue bounds them)",
    multiprocess_mode="livesum",
)
HANDOFF_AGE = Histogram(
    "narwhal_handoff_age_seconds", "Age of a handoff when its decode starts", buckets=LATENCY_BUCKETS
)
ATTEMPTS = Counter("narwhal_attempts_total", "Prefill+decode attempts by outcome", ["outcome"])
RETRIES = Counter("narwhal_retries_total", "Retries started")
MIGRATIONS = Counter(
    "narwhal_migrations_total", "Streams continued on another pair after a fault past visible output, by the fault",
    ["reason"],
)
MIGRATION_STALL = Histogram(
    "narwhal_migration_stall_seconds",
    "A migrated stream's pause: the last output before the cut to the first output after it",
    buckets=LATENCY_BUCKETS,
)
MIGRATION_BUDGET_EXHAUSTED = Counter(
    "narwhal_migration_budget_exhausted_total",
    "Streams not continued because the fleet-wide bound on streams migrating at once was reached",
)
RETRY_BUDGET_EXHAUSTED = Counter(
    "narwhal_retry_budget_exhausted_total", "Retries refused because the fleet-wide budget was spent"
)
ENGINE_FAILURES = Counter(
    "narwhal_engine_failures_total", "Engine faults by engine, leg and reason", ["engine", "phase", "reason"]
)
ENGINE_INFLIGHT = Gauge(
    "narwhal_engine_inflight",
    "Legs in flight per engine and phase, fleet-wide (exported by the supervisor from shared memory)",
    ["engine", "phase"],
    multiprocess_mode="livemax",
)
HANDOFFS_RELEASED = Counter(
    "narwhal_handoffs_released_total", "Undecoded handoffs handed to a consumer so the producer frees its blocks"
)
HANDOFFS_ABANDONED = Counter(
    "narwhal_handoffs_abandoned_total", "Handoffs that were rejected or could not be released"
)
STREAM_ABORTED = Counter(
    "narwhal_stream_aborted_total", "Client streams ended after HTTP 200 without [DONE]", ["reason"]
)
SLOW_CLIENTS_CUT = Counter(
    "narwhal_slow_clients_cut_total",
    "Clients cut for reading too slowly: write_timeout (nothing read for server.client_write_timeout_s) or "
    "buffers_full (the worker's server.max_buffered_mib held for clients behind)",
    ["why"],
)
CLIENT_DISCONNECTS = Counter("narwhal_client_disconnects_total", "Clients that went away before the end")
# docs/behaviour.md "Placement": how pairs were chosen, and what the producers' prefix caches saved.
LOCAL_DECODES = Counter(
    "narwhal_local_decodes_total", "Attempts decoded on a consumer alone, without a remote prefill (short prompts)"
)
PREFILL_TOKENS = Counter(
    "narwhal_prefill_tokens_total",
    "Prompt tokens of prefills: served from the producer's prefix cache (cached) or computed",
    ["kind"],
)
PLACEMENTS = Counter(
    "narwhal_placements_total",
    "Producers chosen, by why: held, rendezvous, affinity, affinity_overflow, least_loaded, saturated; "
    "consumer_holds: none, a consumer held the prompt and decoded it alone",
    ["producer_choice"],
)
# Written by the supervisor, which judges each prefill's reported cached tokens (docs/behaviour.md "Placement").
HOLDINGS_PREDICTIONS = Counter(
    "narwhal_holdings_predictions_total",
    "Prefills whose reported cached tokens matched the holdings' prediction within one block (exact), "
    "fell short of it (over) or exceeded it (under)",
    ["result"],
)

# Written by the supervisor (the only process that knows breaker state).
ENGINE_INFO = Gauge(
    "narwhal_engine_info",
    "1 for each engine with the vLLM version its /version reports; 0 for a version it no longer runs",
    ["engine", "role", "version"],
    multiprocess_mode="livemax",
)
ENGINE_STATE = Gauge(
    "narwhal_engine_state",
    "Breaker state: 0 admitted, 1 quarantined, 2 ejected, 3 probing, 4 draining, 5 degraded",
    ["engine", "role"],
    multiprocess_mode="livemax",
)
# Written by every worker at start: one series per (Narwhal version, engine pin) being served.
BUILD_INFO = Gauge(
    "narwhal_build_info",
    "Always 1: the Narwhal version serving, and the pinned engine version (engine_contract.engine_version, "
    "empty without a contract)",
    ["version", "engine_version"],
    multiprocess_mode="livemax",
)
# Written by the supervisor (docs/behaviour.md "Engines that come and go"): discovered engines by source (file, dns)
# and state
# (active, probing, draining, refused: narwhal.supervisor.discovery).
DISCOVERY_ENGINES = Gauge(
    "narwhal_discovery_engines",
    "Engines found by a discovery source, by source (file, dns, kubernetes) and state (active, probing, draining, "
    "refused)",
    ["source", "state"],
    multiprocess_mode="livemax",
)
PROBES = Counter("narwhal_probes_total", "Readmission probes by engine and result", ["engine", "result"])
KV_EVENTS = Counter(
    "narwhal_kv_events_total", "KV-event batches received from an engine's publisher, by what was made of them",
    ["engine", "verdict"],
)
KV_EVENT_GAPS = Counter("narwhal_kv_event_gaps_total", "Sequence gaps in an engine's KV-event stream", ["engine"])
KV_EVENT_REPLAYS = Counter(
    "narwhal_kv_event_replays_total", "Replays asked of an engine's publisher, by result", ["engine", "result"]
)
KV_EVENT_RESETS = Counter(
    "narwhal_kv_event_resets_total",
    "An engine's holdings dropped: a restart, a gap its replay could not fill, a cleared cache", ["engine"],
)
KV_EVENT_LAG = Gauge(
    "narwhal_kv_event_lag_seconds", "Age of an engine's last KV-event batch when it arrived", ["engine"],
    multiprocess_mode="livemax",
)
KV_EVENT_BLOCKS = Gauge(
    "narwhal_kv_event_blocks", "Blocks an engine holds as its KV events say, after its last batch", ["engine"],
    multiprocess_mode="livemax",
)
PROMPT_TOKEN_IDS = Counter(
    "narwhal_prompt_token_ids_total",
    "Requests placed while KV events are followed, by where their prompt's token ids came from (body, tokenize) or "
    "why there were none (unsupported, failed)",
    ["source"],
)
SUPERVISOR_RESTARTS = Counter("narwhal_supervisor_restarts_total", "Supervisor processes started after the first")

# Series that exist from the first scrape, at zero (docs/operations.md "Following a request"):
# the shipped alerts and dashboard read them, and a counter whose series appears only with its
# first event shows "No data" on a healthy fleet. Engine-labelled ones per engine (engine_series).
_OWN_CHECKS = frozenset({Reason.HEALTH_CHECK, Reason.PROBE, Reason.PREFLIGHT})
_LEG_REASONS = tuple(r for r in Reason if r.rule.counts and r not in _OWN_CHECKS)
_ROLE_PHASES = {"producer": ("prefill",), "consumer": ("decode",), "both": ("prefill", "decode")}


def fleet_series() -> None:
    """The counters labelled by reason alone, every label at zero (the supervisor, at start)."""
    for reason in Reason:
        if reason.rule.status is None or reason.rule.status >= 500:  # what can end a committed stream
            STREAM_ABORTED.labels(reason)
    for why in ("write_timeout", "buffers_full"):
        SLOW_CLIENTS_CUT.labels(why)


@functools.lru_cache(maxsize=4096)
def engine_series(name: str, role: str) -> None:
    """An engine's counters at zero: its failures by each leg its role runs and each reason that
    may count (and its health checks'), its probes by result."""
    for phase in _ROLE_PHASES.get(role, ()):
        for reason in _LEG_REASONS:
            ENGINE_FAILURES.labels(name, phase, reason)
    ENGINE_FAILURES.labels(name, "health", Reason.HEALTH_CHECK)
    for result in ("pass", "fail", "inconclusive"):
        PROBES.labels(name, result)


@functools.lru_cache(maxsize=2048)
def requests_child(endpoint: str, code: int, model: str = "") -> Any:
    """``REQUESTS.labels(...)`` resolved once per label set, not on every request. ``model`` is
    a model the fleet serves (admission refused any other) or ``""``: bounded by the fleet."""
    return REQUESTS.labels(endpoint, str(code), model)


@functools.lru_cache(maxsize=128)
def attempts_child(outcome: str) -> Any:
    """``ATTEMPTS.labels(outcome)`` resolved once per outcome, not on every attempt."""
    return ATTEMPTS.labels(outcome)


@functools.lru_cache(maxsize=16)
def placements_child(choice: str) -> Any:
    """``PLACEMENTS.labels(choice)`` resolved once per choice, not on every placement."""
    return PLACEMENTS.labels(choice)


# The request path's updates go through the tally (narwhal.metric_tally): plain additions,
# written to these series in bulk.
TALLY = Tally()
TTFT_SAMPLES = TALLY.histogram(TTFT)
FIRST_BYTE_SAMPLES = TALLY.histogram(FIRST_BYTE)
HANDOFF_AGE_SAMPLES = TALLY.histogram(HANDOFF_AGE)
INTER_TOKEN_SAMPLES = TALLY.histogram(INTER_TOKEN)
MIGRATION_STALL_SAMPLES = TALLY.histogram(MIGRATION_STALL)


def count_prefill_tokens(prompt_tokens: int | None, cached_tokens: int | None) -> None:
    """A prefill's tokens into ``narwhal_prefill_tokens_total``. Absent ``cached_tokens`` counts
    as none cached: vLLM (with ``--enable-prompt-tokens-details``) leaves the details out of a
    prefill that hit nothing, so skipping those would hide every miss. Without that flag every
    token counts as computed: the panel's hit rate of 0 says "turn it on", not "no hits"."""
    if prompt_tokens is None:
        return
    cached = cached_tokens or 0
    counts = TALLY.counts
    if cached:
        counts[_PREFILL_CACHED] += cached
    counts[_PREFILL_COMPUTED] += prompt_tokens - cached if prompt_tokens > cached else 0


_PREFILL_CACHED = PREFILL_TOKENS.labels("cached")
_PREFILL_COMPUTED = PREFILL_TOKENS.labels("computed")


def count_handoff_fate(fate: str) -> None:
    """A probe's or preflight's handoff that nobody decoded (``engines.control_decode``): given
    back to a consumer (released) or left to the lease (abandoned); other fates count nothing."""
    if fate == "released":
        HANDOFFS_RELEASED.inc()
    elif fate == "abandoned":
        HANDOFFS_ABANDONED.inc()


def publish_build_info(version: str, engine_version: str) -> None:
    """Set ``narwhal_build_info`` for this process (a worker, at start; never on a request)."""
    BUILD_INFO.labels(version, engine_version).set(1)


def multiprocess_dir() -> str | None:
    """prometheus_client's multiprocess directory; None when each process counts alone."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


# Series labelled with an engine: a forgotten engine's go with it (docs/behaviour.md "Engines that come and go").
_BY_ENGINE = ((ENGINE_STATE, ("role",)), (ENGINE_INFLIGHT, ("phase",)))


def forget_engine(name: str, role: str) -> None:
    """The supervisor's own series of an engine that discovery forgot. In multiprocess mode a
    sample once written stays in its process's file, so the scrape also leaves out every series
    of an engine no longer in the fleet (:func:`render`'s ``engines``), and prometheus_client
    has no removal there."""
    if multiprocess_dir():
        return
    for labels in ((name, role), (name, "prefill"), (name, "decode")):
        for gauge, _ in _BY_ENGINE:
            try:
                gauge.remove(*labels)
            except KeyError:
                continue


class _OnlyEngines:
    """A collector: what ``inner`` collects, without the samples of engines not in ``engines``."""

    def __init__(self, inner: Any, engines: frozenset[str]) -> None:
        self.inner, self.engines = inner, engines

    def collect(self) -> Any:
        for family in self.inner.collect():
            family.samples = [s for s in family.samples
                              if "engine" not in s.labels or s.labels["engine"] in self.engines]
            yield family


def render(engines: frozenset[str] | None = None) -> tuple[bytes, str]:
    """The scrape body: every process's samples when in multiprocess mode. Call
    ``TALLY.flush()`` first, on the event loop's thread (this may run in another). ``engines``
    (a fleet that changes at run time): only these engines' series, forgotten ones left out."""
    if multiprocess_dir():
        registry = CollectorRegistry()
        if engines is None:
            multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        else:
            inner = multiprocess.MultiProcessCollector(None)  # type: ignore[no-untyped-call]
            registry.register(_OnlyEngines(inner, engines))
        return generate_latest(registry), CONTENT_TYPE_LATEST
    from prometheus_client import REGISTRY

    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
