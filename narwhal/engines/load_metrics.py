"""What an engine says about its own load: the few series of vLLM's ``/metrics`` placement reads.

SPEC §3.2. The names, as vLLM's own ``vllm/v1/metrics/loggers.py`` declares them (checked
against the source; one gauge per engine index, labelled ``model_name`` and ``engine``):

* ``vllm:num_requests_running`` — requests in the model's execution batches;
* ``vllm:num_requests_waiting`` — requests queued for the scheduler;
* ``vllm:kv_cache_usage_perc`` — KV-cache usage, 0 to 1 (despite the name, not a percentage);
  older engines (before 0.10) call it ``vllm:gpu_cache_usage_perc``, which 0.9 still exports
  beside the new name as a deprecated copy. The new name wins when both are present.

For the holdings (SPEC §3.3), :func:`parse_capacity` reads ``vllm:cache_config_info`` and
:func:`parse_prefill` the engine's own prefill counters, as the same ``loggers.py`` declares them
(checked against the source): the histogram ``vllm:request_prefill_time_seconds`` (its ``_sum``
and ``_count``; a request's first token less its scheduling, observed when it finishes, the
queue's wait being ``vllm:request_queue_time_seconds``; buckets 0.3 s to 7,680 s, too coarse to
read) and the counters ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total``
(tokens, incremented as the scheduler looks requests up).

Invariant: :func:`parse_load` is pure and total. Whatever the body holds (another exporter's
text, truncated text, binary garbage, ``NaN`` or ``+Inf`` samples) it returns a reading or
None, never raises: a reading is published for placement, None leaves the last one to go
stale. Running and waiting are summed over label sets (a data-parallel engine exports one set
per engine index, and every one of them takes requests); a series that is absent counts 0.
KV usage is the **mean** over label sets: the ranks of a data-parallel engine share its
requests through vLLM's own balancer, so the engine is as full as its ranks are on average
(the max would call a whole engine saturated while most of its cache is free); with one set,
as almost always, it is that set's value. A body holding none of the three series is not a
vLLM reading: None.

Why ``str.find`` and a regular expression, not a Prometheus parser: a real engine's exposition
is tens of kilobytes of histograms, read every ``placement.load_interval_s`` per engine by the
supervisor. Finding each wanted name at a line start is a C scan; only the few lines found are
matched, and the rest of the body is never split or looked at in Python.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"

_NAMES = (RUNNING, WAITING, KV_USAGE, KV_USAGE_OLD)


def _sample_re(names: tuple[str, ...]) -> re.Pattern[str]:
    """A sample line of one of ``names`` from its start: name, optional {labels} (quoted values
    may hold braces and escapes), value; a timestamp may follow."""
    alternatives = "|".join(re.escape(n) for n in names)
    return re.compile(rf'({alternatives})(?:\{{(?:[^"}}\n]|"(?:[^"\\\n]|\\.)*")*\}})?[ \t]+(\S+)')


_SAMPLE = _sample_re(_NAMES)


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One reading: requests running and waiting, KV usage (0-1, None when not reported)."""

    running: float
    waiting: float
    kv_usage: float | None


def parse_load(text: str | bytes) -> EngineLoad | None:
    """The reading in a Prometheus exposition body, or None when it holds none (see above)."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    sums = {RUNNING: 0.0, WAITING: 0.0}
    kv: dict[str, list[float]] = {KV_USAGE: [], KV_USAGE_OLD: []}
    seen = False
    for match in _samples(text, _NAMES, _SAMPLE):
        try:
            value = float(match.group(2))
        except ValueError:
            continue
        if not math.isfinite(value) or value < 0:
            continue  # NaN (a gauge never set), Inf, or nonsense: not a figure to place by
        name = match.group(1)
        seen = True
        if name in sums:
            sums[name] += value
        else:
            kv[name].append(value)
    if not seen:
        return None
    usage = kv[KV_USAGE] or kv[KV_USAGE_OLD]
    return EngineLoad(
        running=sums[RUNNING],
        waiting=sums[WAITING],
        kv_usage=min(sum(usage) / len(usage), 1.0) if usage else None,
    )


def _samples(text: str, names: tuple[str, ...], pattern: re.Pattern[str]) -> list[re.Match[str]]:
    """The sample lines of ``names`` (``pattern`` matches them), wherever they are in the body."""
    found: list[re.Match[str]] = []
    for name in names:
        needle = "\n" + name
        pos = 0 if text.startswith(name) else text.find(needle)
        while pos >= 0:
            match = pattern.match(text, pos + (text[pos] == "\n"))
            if match is not None and match.group(1) == name:
                found.append(match)
            pos = text.find(needle, pos + 1)
    return found


CACHE_CONFIG = "vllm:cache_config_info"
_CONFIG_LABEL = re.compile(r'(num_gpu_blocks|block_size)="(\d+)"')


def parse_capacity(text: str | bytes) -> int | None:
    """The KV capacity in tokens, ``num_gpu_blocks`` × ``block_size`` of ``vllm:cache_config_info``
    (SPEC §3.3; vLLM's info gauge, its CacheConfig as labels); None when absent or not numbers
    (``num_gpu_blocks`` is ``None`` before the engine profiled its memory). Pure and total."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    pos = 0 if text.startswith(CACHE_CONFIG + "{") else text.find("\n" + CACHE_CONFIG + "{")
    if pos < 0:
        return None
    end = text.find("\n", pos + 1)
    line = text[pos : end if end >= 0 else len(text)]
    found = dict(_CONFIG_LABEL.findall(line))
    if "num_gpu_blocks" not in found or "block_size" not in found:
        return None
    tokens = int(found["num_gpu_blocks"]) * int(found["block_size"])
    return tokens if tokens > 0 else None


# The engine's own prefill rate (SPEC §3.3, ``supervisor.engine_rate``): vLLM's prefill-time
# histogram (``RequestStateStats``: first token less scheduled, observed when a request finishes;
# the batch queue's wait is ``vllm:request_queue_time_seconds``, not this) and its prefix-cache
# counters in tokens (counted as the scheduler looks a request up), declared in the same
# ``loggers.py`` with the same ``model_name``/``engine`` labels.
PREFILL_TIME_SUM = "vllm:request_prefill_time_seconds_sum"
PREFILL_TIME_COUNT = "vllm:request_prefill_time_seconds_count"
CACHE_QUERIES = "vllm:prefix_cache_queries_total"
CACHE_HITS = "vllm:prefix_cache_hits_total"
_PREFILL_NAMES = (PREFILL_TIME_SUM, PREFILL_TIME_COUNT, CACHE_QUERIES, CACHE_HITS)
_PREFILL_SAMPLE = _sample_re(_PREFILL_NAMES)


@dataclass(frozen=True, slots=True)
class PrefillCounters:
    """The engine's cumulative prefill counters at one read: seconds of prefill, prefills, and the
    prompt tokens looked up in and found in its prefix cache (all counters: they only grow, until
    the engine restarts)."""

    prefill_s: float
    prefills: float
    queried_tokens: float
    hit_tokens: float


def parse_prefill(text: str | bytes) -> PrefillCounters | None:
    """The prefill counters in a ``/metrics`` body, each summed over its label sets (a
    data-parallel engine's ranks); None unless all four series are there (an engine without the
    prefix cache's counters cannot say which tokens it computed). Pure and total, as
    :func:`parse_load`: a sample that is not a finite number ≥ 0 is skipped."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    sums: dict[str, float] = {}
    for match in _samples(text, _PREFILL_NAMES, _PREFILL_SAMPLE):
        try:
            value = float(match.group(2))
        except ValueError:
            continue
        if math.isfinite(value) and value >= 0:
            sums[match.group(1)] = sums.get(match.group(1), 0.0) + value
    if len(sums) < len(_PREFILL_NAMES):
        return None
    return PrefillCounters(sums[PREFILL_TIME_SUM], sums[PREFILL_TIME_COUNT], sums[CACHE_QUERIES], sums[CACHE_HITS])
