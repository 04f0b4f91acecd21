"""What an engine says about its own load: the few series of vLLM's ``/metrics`` placement reads.

docs/behaviour.md "Placement". The names, as vLLM's own ``vllm/v1/metrics/loggers.py`` declares them (checked
against the source; one gauge per engine index, labelled ``model_name`` and ``engine``):

* ``vllm:num_requests_running`` — requests in the model's execution batches;
* ``vllm:num_requests_waiting`` — requests queued for the scheduler;
* ``vllm:kv_cache_usage_perc`` — KV-cache usage, 0 to 1 (despite the name, not a percentage);
  older engines (before 0.10) call it ``vllm:gpu_cache_usage_perc``, which 0.9 still exports
  beside the new name as a deprecated copy. The new name wins when both are present.

For the holdings (docs/behaviour.md "Placement"), :func:`parse_capacity` reads ``vllm:cache_config_info`` and
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
interleave with their ``_created`` and bucket lines: those are searched to the end). It matters
because the reads add up: at 32 engines and the default interval the supervisor parses 320
bodies a second.
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
    per character (several times faster: perf/RESULTS.md "Figures behind the code's choices")."""
    alternatives = b"|".join(re.escape(n) for n in names)
    return re.compile(b"(" + alternatives + rb')(?:\{(?:[^"}\n]++|"(?:[^"\\\n]++|\\.)*+")*+\})?[ \t]+(\S+)')


_SAMPLE = _sample_re(_NAMES)
_KV_MAX = 1.001  # vLLM's usage is 1 - free/total: 1 at most, give or take a float's rounding


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
        if name not in sums and value > _KV_MAX:
            continue  # a usage share past 1 is no share: unknown, not "full"
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
    """The KV capacity in tokens from ``vllm:cache_config_info`` (docs/behaviour.md "Placement"
    source 3, docs/decisions.md "vLLM releases"), or None when unknown. Pure and total: whatever an
    engine sends, a number or None.

    One series per data-parallel engine (label ``engine``); labels are read by their whole
    names (0.33 has five more that end in ``block_size``, one of them ``hash_block_size="None"``).
    The ``kv_cache_size_tokens`` label summed over the series when every series has it as a
    positive integer (it is per engine, and right for hybrid models); otherwise
    ``num_gpu_blocks`` (already the total over data-parallel engines) × ``block_size`` of any
    one series. A value that is not a positive integer of at most :data:`_MAX_DIGITS` digits is
    unknown (``num_gpu_blocks`` is ``None`` before the engine profiled its memory)."""
    body = text.encode() if isinstance(text, str) else text
    series = [_labels(line) for line in _config_lines(body)]
    if not series:
        return None
    sizes = [_positive(labels.get(b"kv_cache_size_tokens")) for labels in series]
    if all(size is not None for size in sizes):
        return sum(size for size in sizes if size is not None)
    for labels in series:
        blocks, size = _positive(labels.get(b"num_gpu_blocks")), _positive(labels.get(b"block_size"))
        if blocks is not None and size is not None:
            return blocks * size
    return None


_MAX_DIGITS = 15  # a capacity of 10^15 tokens is beyond any engine; longer digit runs are not numbers
_LABEL = re.compile(rb'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\\n]|\\.)*)"')


def _config_lines(body: bytes) -> list[bytes]:
    """Every ``vllm:cache_config_info{...}`` sample line of the exposition."""
    lines = []
    at = 0 if body.startswith(_CONFIG) else body.find(b"\n" + _CONFIG)
    while at >= 0:
        end = body.find(b"\n", at + 1)
        lines.append(body[at : end if end >= 0 else len(body)])
        at = body.find(b"\n" + _CONFIG, at + 1) if end >= 0 else -1
    return lines


def _labels(line: bytes) -> dict[bytes, bytes]:
    """A sample line's labels by their whole names (the first of a repeated name wins)."""
    start, end = line.find(b"{"), line.rfind(b"}")
    found: dict[bytes, bytes] = {}
    for match in _LABEL.finditer(line, start + 1, end if end > start else len(line)):
        found.setdefault(match.group(1), match.group(2))
    return found


def _positive(value: bytes | None) -> int | None:
    """A label value that is a positive whole number of at most :data:`_MAX_DIGITS` digits, else None."""
    if value is None or not value.isdigit() or len(value) > _MAX_DIGITS:
        return None
    number = int(value)
    return number if number > 0 else None


# The engine's own prefill rate (docs/behaviour.md "Placement", ``supervisor.holdings.engine_rate``): vLLM's
# prefill-time
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
