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

Why ``bytes.find`` and a regular expression, not a Prometheus parser: a real engine's exposition
is tens of kilobytes of histograms, read every ``placement.load_interval_s`` per engine by the
supervisor. Finding each wanted name at a line start is a C scan; only the few lines found are
matched, and the rest of the body is never split, decoded or looked at in Python. The body is
searched as the bytes it came as (a str is encoded first), and the load gauges no further than
needed: a gauge's samples are one group of lines, as the exposition format requires, so the
search for one ends at the first line after its group, and the deprecated KV name is not looked
for once the new one was found (a counter's or a histogram's samples of several label sets
interleave with their ``_created`` and bucket lines: those are searched to the end). Searched to
its end for every series, decoded per parse, with label sets matched a character at a time, a
40 KiB body cost 50-70 µs per read in ``parse_load`` and ``parse_capacity``; now 10-15 µs
(issue 24, on this 2-core VM; at 32 engines the supervisor reads 320 a second).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"

# As the body's bytes: it is searched undecoded.
_RUNNING, _WAITING, _KV, _KV_OLD = (name.encode() for name in (RUNNING, WAITING, KV_USAGE, KV_USAGE_OLD))
_NAMES = (_RUNNING, _WAITING, _KV, _KV_OLD)


def _sample_re(names: tuple[bytes, ...]) -> re.Pattern[bytes]:
    """A sample line of one of ``names`` from its start: name, optional {labels} (quoted values
    may hold braces and escapes), value; a timestamp may follow. Possessive runs: a label set
    parses one way only, so nothing is given back, and a run of characters is one step, not one
    per character (4x faster)."""
    alternatives = b"|".join(re.escape(n) for n in names)
    return re.compile(b"(" + alternatives + rb')(?:\{(?:[^"}\n]++|"(?:[^"\\\n]++|\\.)*+")*+\})?[ \t]+(\S+)')


_SAMPLE = _sample_re(_NAMES)


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One reading: requests running and waiting, KV usage (0-1, None when not reported)."""

    running: float
    waiting: float
    kv_usage: float | None


def parse_load(text: str | bytes) -> EngineLoad | None:
    """The reading in a Prometheus exposition body, or None when it holds none (see above)."""
    body = text.encode() if isinstance(text, str) else text
    sums = {_RUNNING: 0.0, _WAITING: 0.0}
    kv: dict[bytes, list[float]] = {_KV: [], _KV_OLD: []}
    seen = False
    for match in _samples(body, _NAMES, _SAMPLE, gauges=True):
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
    usage = kv[_KV] or kv[_KV_OLD]
    return EngineLoad(
        running=sums[_RUNNING],
        waiting=sums[_WAITING],
        kv_usage=min(sum(usage) / len(usage), 1.0) if usage else None,
    )


def _samples(body: bytes, names: tuple[bytes, ...], pattern: re.Pattern[bytes], *,
             gauges: bool = False) -> list[re.Match[bytes]]:
    """The sample lines of ``names`` (``pattern`` matches them), wherever they are in the body;
    ``gauges``: each name's search ends after its group of lines, and the deprecated KV name is
    not looked for once the new one was found (the module's text)."""
    found: list[re.Match[bytes]] = []
    for name in names:
        if gauges and name == _KV_OLD and any(m.group(1) == _KV for m in found):
            break  # the new name wins: its deprecated copy is not looked for
        needle = b"\n" + name
        pos = 0 if body.startswith(name) else body.find(needle)
        while pos >= 0:
            match = pattern.match(body, pos + (body[pos] == 10))  # 10: a newline before the name
            if match is None or match.group(1) != name:
                pos = body.find(needle, pos + 1)  # another series whose name begins with this one
                continue
            found.append(match)
            end = body.find(b"\n", match.end())
            if gauges:  # the first line after the gauge's group ends its search, not the body's end
                pos = end if end >= 0 and body.startswith(name, end + 1) else -1
            else:
                pos = body.find(needle, end) if end >= 0 else -1
    return found


CACHE_CONFIG = "vllm:cache_config_info"
_CONFIG = CACHE_CONFIG.encode() + b"{"


def parse_capacity(text: str | bytes) -> int | None:
    """The KV capacity in tokens, ``num_gpu_blocks`` × ``block_size`` of ``vllm:cache_config_info``
    (SPEC §3.3; vLLM's info gauge, its CacheConfig as labels); None when absent or not numbers
    (``num_gpu_blocks`` is ``None`` before the engine profiled its memory). Pure and total."""
    body = text.encode() if isinstance(text, str) else text
    pos = 0 if body.startswith(_CONFIG) else body.find(b"\n" + _CONFIG)
    if pos < 0:
        return None
    end = body.find(b"\n", pos + 1)
    line = body[pos : end if end >= 0 else len(body)]
    blocks, size = _label_int(line, b'num_gpu_blocks="'), _label_int(line, b'block_size="')
    if blocks is None or size is None:
        return None
    tokens = blocks * size
    return tokens if tokens > 0 else None


def _label_int(line: bytes, opening: bytes) -> int | None:
    """The label's value (the last one so named on the line) when it is a whole number."""
    at = line.rfind(opening)
    if at < 0:
        return None
    start = at + len(opening)
    end = line.find(b'"', start)
    value = line[start:end] if end >= 0 else b""
    return int(value) if value.isdigit() else None


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
_PREFILL_BYTES = tuple(name.encode() for name in _PREFILL_NAMES)
_PREFILL_SAMPLE = _sample_re(_PREFILL_BYTES)


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
    body = text.encode() if isinstance(text, str) else text
    sums: dict[bytes, float] = {}
    for match in _samples(body, _PREFILL_BYTES, _PREFILL_SAMPLE):
        try:
            value = float(match.group(2))
        except ValueError:
            continue
        if math.isfinite(value) and value >= 0:
            sums[match.group(1)] = sums.get(match.group(1), 0.0) + value
    if len(sums) < len(_PREFILL_BYTES):
        return None
    return PrefillCounters(*(sums[name] for name in _PREFILL_BYTES))
