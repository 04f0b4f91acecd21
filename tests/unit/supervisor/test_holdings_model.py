"""The supervisor's holdings model (docs/behaviour.md "Placement"): what was sent, corrected by cached tokens
(``over`` / ``under`` / ``exact``), bounded by capacity and by the room, dropped on restart;
the learned prefill rate; and ``vllm:cache_config_info`` read as a capacity."""

from __future__ import annotations

from narwhal.shm.holdings import Holdings, HoldingsLayout, PrefillReport, section_stamp
from narwhal.supervisor.holdings import HoldingsModel
from narwhal.supervisor.load_metrics import parse_capacity

P0 = section_stamp("p0", "http://p0")
P1 = section_stamp("p1", "http://p1")


def _model(room: int = 64) -> HoldingsModel:
    return HoldingsModel([P0, P1, None], room, 256)


def _rep(keys: list[int], cached: int | None, *, producer: int = 0, stamp: int = P0, engine_id: int = 11,
         chars: int = 0, tokens: int | None = None, duration: float = 0.01) -> PrefillReport:
    chars = chars or len(keys) * 256 + 40
    tokens = tokens if tokens is not None else chars // 4
    return PrefillReport(producer, stamp, engine_id, chars, tokens, cached, duration, tuple(keys))


def _held(model: HoldingsModel, index: int = 0) -> list[int]:
    p = model.producers[index]
    assert p is not None
    return list(p.keys)


def test_what_was_sent_is_held_and_a_repeat_that_hits_is_exact() -> None:
    m = _model()
    assert m.apply(_rep([1, 2, 3], cached=0)) == "exact"  # predicted 0, held 0
    assert _held(m) == [3, 2, 1]  # least recently used first: the head is the most recent (vLLM frees tails first)
    assert m.apply(_rep([1, 2, 3, 4], cached=3 * 64)) == "exact"  # 3 blocks of 64 tokens at 4 chars
    assert _held(m) == [4, 3, 2, 1]


def test_fewer_cached_than_predicted_is_over_and_forgets_what_lru_evicted_first() -> None:
    m = _model()
    m.apply(_rep([10, 11], cached=0))  # the oldest
    m.apply(_rep([1, 2, 3, 4], cached=0))
    assert m.apply(_rep([1, 2, 3, 4], cached=64)) == "over"  # held 1 of 4 predicted
    # Block 2 was evicted: so was everything less recently used than it (11, 10, 4, 3), and the
    # prefill put 1-4 back as the most recent.
    assert _held(m) == [4, 3, 2, 1]


def test_more_cached_than_predicted_is_under_and_adds_what_another_replica_put_there() -> None:
    m = _model()
    assert m.apply(_rep([1, 2, 3, 4], cached=4 * 64 - 16)) == "under"  # 3 blocks held unknown to us
    assert _held(m) == [4, 3, 2, 1]


def test_a_new_engine_id_drops_the_holdings() -> None:
    m = _model()
    m.apply(_rep([1, 2], cached=0, engine_id=11))
    m.apply(_rep([5], cached=0, engine_id=22))  # restarted: a new engine
    assert _held(m) == [5]
    m.forget(0)  # ejected
    assert _held(m) == []


def test_a_full_table_forgets_the_oldest_keys_without_an_error() -> None:
    m = _model(room=4)
    m.apply(_rep([1, 2, 3], cached=0))
    m.apply(_rep([7, 8, 9], cached=0))
    assert _held(m) == [1, 9, 8, 7]


def test_capacity_bounds_the_holdings_in_our_blocks() -> None:
    m = _model()
    m.apply(_rep(list(range(1, 11)), cached=0))  # 10 blocks at 4 characters a token
    m.set_capacity(0, 16 * 24)  # 384 tokens = 1536 characters = 6 blocks of 256
    assert _held(m) == [6, 5, 4, 3, 2, 1]  # the prompt's tail forgotten first, as vLLM evicts it
    p = m.producers[0]
    assert p is not None and m.capacity_blocks(p) == 6
    m.set_capacity(0, None)  # no longer said: bounded by the room alone
    m.apply(_rep(list(range(20, 30)), cached=0))
    assert len(_held(m)) == 16


def test_reports_for_another_engine_or_no_producer_are_ignored() -> None:
    m = _model()
    assert m.apply(_rep([1], cached=0, stamp=P1)) is None  # index 0 is p0, not p1
    assert m.apply(_rep([1], cached=0, producer=2, stamp=0)) is None  # a consumer: no section
    assert m.apply(_rep([1], cached=0, producer=9)) is None
    assert _held(m) == []


def test_the_prefill_rate_is_learned_from_long_uncached_prefills_and_durations() -> None:
    m = _model()
    keys = list(range(1, 9))
    m.apply(_rep(keys, cached=0, chars=2048, tokens=512, duration=0.02))
    p = m.producers[0]
    assert p is not None and p.rate == 102_400.0 and p.chars_per_token == 4.0
    # Under RATE_MIN_BLOCKS uncached: mostly the round trip, no sample of the engine's speed.
    m.apply(_rep(keys, cached=4 * 64, chars=2048, tokens=512, duration=0.005))
    assert p.rate == 102_400.0
    # Placed behind queued work: its wait was the queue's, not the engine's speed.
    m.apply(PrefillReport(0, P0, 11, 2048, 512, 0, 0.5, tuple(keys), queued_chars=2048))
    assert p.rate == 102_400.0
    # A ratio of means: a long prefill weighs more than a short one (these lie on a line through
    # 0, so no fixed cost is taken off).
    m.apply(_rep(list(range(1, 17)), cached=0, chars=4096, tokens=1024, duration=0.08))
    assert m.fit.intercept(4 * 256) == 0.0
    assert p.rate == (2048 + 0.2 * 2048) / (0.02 + 0.2 * 0.06)


def test_publish_writes_changed_sections_most_recent_first() -> None:
    m = _model()
    region = Holdings.create(HoldingsLayout(sections=3, keys=8, slots=1))
    m.apply(_rep([1, 2, 3], cached=0))
    m.publish(region, 10.0)
    held = region.read(0, P0)
    assert held is not None and held.keys == frozenset({1, 2, 3}) and held.engine_id == 11
    assert region.read(1, P1) is None or region.read(1, P1).blocks == 0  # type: ignore[union-attr]
    seq = region.section_seq(0)
    m.publish(region, 10.0)  # nothing changed: nothing written
    assert region.section_seq(0) == seq
    m.apply(_rep([4], cached=0))
    m.publish(region, 10.05)  # changed, but published less than PUBLISH_S ago: later
    assert region.section_seq(0) == seq
    m.publish(region, 10.2)
    assert region.section_seq(0) != seq and region.read(0, P0).keys == frozenset({1, 2, 3, 4})  # type: ignore[union-attr]


def test_cache_config_info_gives_the_capacity_in_tokens() -> None:
    body = ('vllm:num_requests_running{engine="0"} 0.0\n'
            'vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="2048"} 1.0\n')
    assert parse_capacity(body) == 32768
    assert parse_capacity(body.encode()) == 32768
    assert parse_capacity('vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n') is None
    assert parse_capacity("vllm:num_requests_running 1\n") is None
    assert parse_capacity('vllm:cache_config_info{block_size="16"} 1.0\n') is None  # no blocks said
    assert parse_capacity('vllm:cache_config_info{block_size="16",num_gpu_blocks="20') is None  # cut short
    assert parse_capacity('vllm:cache_config_info{block_size="0",num_gpu_blocks="2048"} 1.0\n') is None


def test_silence_means_nothing_cached_once_the_producer_has_reported_cached_tokens() -> None:
    m = _model()
    assert m.apply(_rep([1, 2], cached=None)) is None  # never reported: maybe not enabled, not judged
    assert m.apply(_rep([1, 2], cached=2 * 64)) == "exact"
    assert m.apply(_rep([1, 2], cached=None)) == "over"  # it reports: no details is 0 cached


def test_a_restarted_supervisor_starts_from_the_published_holdings() -> None:
    region = Holdings.create(HoldingsLayout(sections=3, keys=8, slots=1))
    first = _model()
    first.apply(_rep([1, 2, 3], cached=0))
    first.publish(region, 1.0)
    seq = region.section_seq(0)
    second = _model()
    second.restore(region)
    assert _held(second) == [3, 2, 1] and second.producers[0].engine_id == 11  # type: ignore[union-attr]
    second.publish(region, 2.0)  # nothing changed: the section is not rewritten empty
    assert region.section_seq(0) == seq
    assert second.apply(_rep([1, 2, 3, 4], cached=3 * 64)) == "exact"


def test_a_prefill_that_started_before_the_prefix_was_computed_is_no_eviction() -> None:
    m = _model()
    m.apply(PrefillReport(0, P0, 11, 808, 202, 0, 0.05, (1, 2, 3), 0, at=10.0))  # computed 9.95-10.0
    # Placed together with it (started at 9.96): it could not hit blocks still being computed.
    assert m.apply(PrefillReport(0, P0, 11, 808, 202, 0, 0.05, (1, 2, 3), 0, at=10.01)) == "exact"
    assert _held(m) == [3, 2, 1]
    # Started after they were done: they should have hit; none did, so they were evicted.
    assert m.apply(PrefillReport(0, P0, 11, 808, 202, 0, 0.05, (1, 2, 3), 0, at=10.2)) == "over"


D0 = section_stamp("d0", "http://d0")


def test_a_consumers_decodes_teach_what_it_holds_most_recent_last_bounded_and_forgotten() -> None:
    # docs/behaviour.md "Placement": without events, a consumer holds the prompts it decoded.
    m = HoldingsModel([P0, P1, None], 4, 256)
    m.consumer_stamps = {2: D0}
    assert m.apply(_rep([1, 2], cached=None, producer=2, stamp=D0)) is None  # no prediction to judge
    assert list(m.consumer_keys[2]) == [1, 2]
    m.apply(_rep([3, 1, 4], cached=None, producer=2, stamp=D0))
    assert list(m.consumer_keys[2]) == [2, 3, 1, 4]  # 1 again: the most recent
    m.apply(_rep([5], cached=None, producer=2, stamp=P1))  # another engine's stamp: not this consumer
    m.apply(_rep([6], cached=None, producer=2, stamp=D0))
    assert list(m.consumer_keys[2]) == [3, 1, 4, 6]  # bounded by the room: the oldest go
    assert _held(m) == []  # no producer learned anything
    m.forget(2)  # ejected, or its events say it restarted
    assert 2 not in m.consumer_keys
