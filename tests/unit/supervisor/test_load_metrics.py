"""The ``/metrics`` reader (docs/behaviour.md "Placement") on vLLM's own exposition text: the three series placement
reads, summed over label sets (KV usage: their mean), the old name, and bodies that are not
what they should be."""

from __future__ import annotations

import pytest

from narwhal.supervisor.load_metrics import EngineLoad, PrefillCounters, parse_capacity, parse_load, parse_prefill

# As vLLM 0.11 (V1 engine, prometheus_client) writes it, abridged: histograms, counters with
# _total and _created, the deprecated gpu_* copies beside the new names, one label set.
VLLM_0_11 = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12345.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.4231
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 90112.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 81920.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 512.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 512.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 33.2
"""

# Data parallel (two engine indexes behind one API server): one set of gauges per index.
DATA_PARALLEL = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 4.0
vllm:num_requests_running{engine="1",model_name="m"} 6.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.6
"""

# vLLM 0.8-0.9 (and V0): the KV gauge is gpu_cache_usage_perc; no labels on some builds.
OLD_NAME = """\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 2.0
# HELP vllm:num_requests_swapped Number of requests swapped to CPU.
# TYPE vllm:num_requests_swapped gauge
vllm:num_requests_swapped{model_name="m"} 9.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 5.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.97
"""


def test_vllm_exposition_yields_the_three_series() -> None:
    assert parse_load(VLLM_0_11) == EngineLoad(running=7.0, waiting=3.0, kv_usage=0.4231)
    assert parse_load(VLLM_0_11.encode()) == EngineLoad(running=7.0, waiting=3.0, kv_usage=0.4231)


def test_a_body_is_read_as_its_bytes_whatever_else_it_holds() -> None:
    # Searched undecoded: bytes that are not UTF-8 elsewhere in the body change nothing.
    body = b"# HELP other \xff\xfe not text\n" + VLLM_0_11.encode() + b"other_metric{a=\"\xc3\"} 1\n"
    assert parse_load(body) == EngineLoad(running=7.0, waiting=3.0, kv_usage=0.4231)


def test_a_longer_name_before_the_series_does_not_hide_it() -> None:
    body = ('vllm:num_requests_running_total{engine="0"} 9.0\nvllm:num_requests_running_x 8.0\n'
            'other 1\n' + DATA_PARALLEL)
    reading = parse_load(body)
    assert reading is not None and (reading.running, reading.waiting) == (10.0, 3.0)


def test_several_label_sets_are_summed_and_kv_usage_is_their_mean() -> None:
    reading = parse_load(DATA_PARALLEL)
    assert reading is not None
    assert (reading.running, reading.waiting) == (10.0, 3.0)
    assert reading.kv_usage == pytest.approx(0.4)


def test_the_old_gpu_cache_usage_name_is_read() -> None:
    assert parse_load(OLD_NAME) == EngineLoad(running=2.0, waiting=5.0, kv_usage=0.97)


def test_the_new_kv_name_wins_over_its_deprecated_copy() -> None:
    both = VLLM_0_11 + 'vllm:gpu_cache_usage_perc{engine="0",model_name="x"} 0.99\n'
    reading = parse_load(both)
    assert reading is not None and reading.kv_usage == 0.4231


def test_missing_series_count_zero_and_kv_usage_is_none() -> None:
    only_running = 'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n'
    assert parse_load(only_running) == EngineLoad(running=1.0, waiting=0.0, kv_usage=None)
    no_kv = VLLM_0_11.replace("vllm:kv_cache_usage_perc{", "vllm:something_else{")
    assert parse_load(no_kv) == EngineLoad(running=7.0, waiting=3.0, kv_usage=None)


@pytest.mark.parametrize(
    "body",
    [
        "",
        "not prometheus at all",
        b"\xff\xfe\x00\x01binary",
        '{"server_load": 3}',
        "# HELP vllm:num_requests_running only comments\n# TYPE vllm:num_requests_running gauge\n",
        "vllm:num_requests_running_total 5\nvllm:num_requests_waiting_seconds 2\n",  # other names, same prefix
        "vllm:num_requests_running{engine=\"0\"} not-a-number\n",
        "vllm:num_requests_running{engine=\"0\" 3.0\n",  # truncated label set
    ],
)
def test_garbage_is_no_reading(body: str | bytes) -> None:
    assert parse_load(body) is None


def test_nan_and_infinite_samples_are_skipped() -> None:
    text = (
        'vllm:num_requests_running{engine="0"} NaN\n'
        'vllm:num_requests_running{engine="1"} 2.0\n'
        'vllm:num_requests_waiting{engine="0"} +Inf\n'
        'vllm:kv_cache_usage_perc{engine="0"} NaN\n'
    )
    assert parse_load(text) == EngineLoad(running=2.0, waiting=0.0, kv_usage=None)
    assert parse_load('vllm:kv_cache_usage_perc{engine="0"} NaN\n') is None


def test_labels_holding_braces_quotes_and_a_timestamp() -> None:
    text = 'vllm:num_requests_waiting{model_name="a}b\\"c",engine="0"} 4 1733091000000\n'
    assert parse_load(text) == EngineLoad(running=0.0, waiting=4.0, kv_usage=None)


def test_a_body_that_starts_with_a_sample() -> None:
    assert parse_load("vllm:num_requests_running 3\n") == EngineLoad(running=3.0, waiting=0.0, kv_usage=None)


# -- the prefill counters (docs/behaviour.md "Placement": the engine-reported prefill rate) ----------------------

PREFILL = """\
# HELP vllm:request_prefill_time_seconds Histogram of time spent in PREFILL phase for request.
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_bucket{engine="0",le="0.3",model_name="m"} 500.0
vllm:request_prefill_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 512.0
vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 512.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 41.5
# HELP vllm:request_prefill_time_seconds_created Histogram of time spent in PREFILL phase for request.
# TYPE vllm:request_prefill_time_seconds_created gauge
vllm:request_prefill_time_seconds_created{engine="0",model_name="m"} 1.7e9
"""


def test_prefill_counters_in_vllm_exposition() -> None:
    assert parse_prefill(VLLM_0_11 + PREFILL) == PrefillCounters(41.5, 512.0, 90112.0, 81920.0)
    assert parse_load(VLLM_0_11 + PREFILL) == parse_load(VLLM_0_11)  # the load reading is unchanged by them


def test_prefill_counters_are_summed_over_label_sets() -> None:
    text = PREFILL + PREFILL.replace('engine="0"', 'engine="1"') + (
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0\n'
        'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 50.0\n'
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 10.0\n'
        'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 5.0\n'
    )
    assert parse_prefill(text) == PrefillCounters(83.0, 1024.0, 150.0, 15.0)


@pytest.mark.parametrize(
    "body",
    [
        "",
        b"\xff\xfe\x00\x01binary",
        VLLM_0_11,  # no prefill histogram (an engine that does not export it)
        PREFILL,  # no prefix cache counters (an engine run without the prefix cache's stats)
        PREFILL.replace("_sum{", "_summary{"),  # another name with the same start
        (VLLM_0_11 + PREFILL).replace("} 41.5", "} NaN"),  # the sum not a number: not all four
        (VLLM_0_11 + PREFILL).replace("} 512.0\nvllm:request_prefill_time_seconds_sum", "} -1\nvllm:x"),
    ],
)
def test_prefill_counters_need_all_four_finite_series(body: str | bytes) -> None:
    assert parse_prefill(body) is None


# vLLM 0.33's label line (vllm/config/cache.py, declaration order): five labels end in block_size,
# hash_block_size reads "None" in the API server, kv_cache_size_tokens is per data-parallel engine.
LINE_033 = ('vllm:cache_config_info{{block_size="16",user_specified_block_size="False",mamba_block_size="None",'
            'num_gpu_blocks="{blocks}",effective_attention_block_size="16",kv_cache_size_tokens="{tokens}",'
            'hash_block_size="None",_block_size_resolved="True",engine="{engine}"}} 1.0\n')


def test_capacity_from_0_33_labels_by_their_whole_names() -> None:
    one = LINE_033.format(blocks=200, tokens=3200, engine=0)
    assert parse_capacity(one) == 3200
    # Two data-parallel engines: num_gpu_blocks is already their total, kv_cache_size_tokens is each one's.
    two = LINE_033.format(blocks=400, tokens=3200, engine=0) + LINE_033.format(blocks=400, tokens=3100, engine=1)
    assert parse_capacity(two) == 6300
    # Without kv_cache_size_tokens (or not a number): num_gpu_blocks x block_size, never hash_block_size.
    assert parse_capacity(one.replace('kv_cache_size_tokens="3200"', 'kv_cache_size_tokens="None"')) == 3200
    assert parse_capacity(one.replace('kv_cache_size_tokens="3200",', "")) == 3200
    assert parse_capacity(one.replace('num_gpu_blocks="200"', 'num_gpu_blocks="None"')
                          .replace('kv_cache_size_tokens="3200"', 'kv_cache_size_tokens="None"')) is None


def test_a_kv_usage_past_one_is_unknown_not_full() -> None:
    """vLLM's ``kv_cache_usage_perc`` is 1 - free/total: 7 is no reading (out of
    range is unknown), where clamping it made a broken engine look saturated for good."""
    body = b'vllm:num_requests_running{engine="0"} 1\nvllm:kv_cache_usage_perc{engine="0"} 7\n'
    assert parse_load(body) == EngineLoad(running=1.0, waiting=0.0, kv_usage=None)
    assert parse_load(body.replace(b"} 7", b"} 1.0000001")) == EngineLoad(1.0, 0.0, 1.0)
