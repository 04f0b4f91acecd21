"""The holdings model's round-3 learning, on the test's clock (each report's ``at``, each
publish's ``now``): hot blocks and their ageing, an ``under`` published at once, homes for the
live prefixes, a prefix's size, the fleet's fixed cost per prefill, and the room an engine that
does not say its capacity shows by its evictions."""

from __future__ import annotations

from types import SimpleNamespace

from narwhal.fleet.placement import homes
from narwhal.fleet.placement.affinity import key_hash, rank
from narwhal.shm.holdings import Holdings, HoldingsLayout, PrefillReport, section_stamp
from narwhal.supervisor.holdings import HOT_S, PUBLISH_S, HoldingsModel
from narwhal.supervisor.holdings.fit import Fit

NAMES = ["p0", "p1", "d0"]
P0, P1 = section_stamp("p0", "http://p0"), section_stamp("p1", "http://p1")


def _model(room: int = 256) -> HoldingsModel:
    return HoldingsModel([P0, P1, None], room, 256, [SimpleNamespace(name=n, index=i) for i, n in enumerate(NAMES)])


def _rep(keys: list[int], cached: int | None, at: float, *, producer: int = 0) -> PrefillReport:
    stamp = P0 if producer == 0 else P1
    chars = len(keys) * 256 + 40
    return PrefillReport(producer, stamp, 11, chars, chars // 4, cached, 0.01, tuple(keys), 0, at)


def _region() -> Holdings:
    return Holdings.create(HoldingsLayout(sections=3, keys=128, slots=1))


def test_blocks_a_prefill_hit_are_hot_until_hot_s_passes_and_the_count_is_republished() -> None:
    m = _model()
    region = _region()
    m.apply(_rep([1, 2, 3], cached=0, at=10.0))  # computed, not reused: nothing hot
    p = m.producers[0]
    assert p is not None and p.hot_blocks(10.0) == 0
    m.apply(_rep([1, 2, 3, 4], cached=3 * 64, at=10.5))  # three blocks reused
    assert p.hot_blocks(10.5) == 3
    m.publish(region, 10.5)
    assert region.read(0, P0).hot_blocks == 3  # type: ignore[union-attr]
    # Nothing reported since: the count ages out by time alone and the section follows it.
    m.publish(region, 10.5 + HOT_S + 0.01)
    assert region.read(0, P0).hot_blocks == 0  # type: ignore[union-attr]


def test_an_evicted_block_is_no_longer_hot() -> None:
    m = _model()
    m.apply(_rep([1, 2], cached=0, at=1.0))
    m.apply(_rep([1, 2], cached=2 * 64, at=1.1))
    assert m.apply(_rep([1, 2], cached=0, at=1.2)) == "over"  # gone from the engine
    p = m.producers[0]
    assert p is not None and p.hot_blocks(1.2) == 0


def test_an_under_is_published_at_the_next_pass_not_after_publish_s() -> None:
    m = _model()
    region = _region()
    m.apply(_rep([1, 2], cached=0, at=1.0))
    m.publish(region, 1.0)
    seq = region.section_seq(0)
    assert m.apply(_rep([5, 6, 7, 8], cached=4 * 64, at=1.01)) == "under"  # another replica put them there
    m.publish(region, 1.02)  # well within PUBLISH_S of the last
    assert region.section_seq(0) != seq and {5, 6, 7, 8} <= region.read(0, P0).keys  # type: ignore[union-attr]
    m.apply(_rep([9], cached=0, at=1.03))
    seq = region.section_seq(0)
    m.publish(region, 1.04)  # an ordinary change waits for PUBLISH_S
    assert region.section_seq(0) == seq
    m.publish(region, 1.02 + PUBLISH_S)
    assert region.section_seq(0) != seq


def test_a_prefix_used_twice_within_hot_s_gets_a_home_and_loses_it_once_unused() -> None:
    m = _model()
    region = _region()
    m.set_capacity(0, 40 * 64)  # tokens: 40 blocks of 256 characters at 4 a token
    m.set_capacity(1, 40 * 64)
    prefix = list(range(100, 115))
    m.apply(_rep(prefix, cached=0, at=1.0))
    m.publish(region, 1.0)
    assert all(not (region.read(i, s).homes or {}) for i, s in ((0, P0), (1, P1)))  # once is not live
    m.apply(_rep(prefix + [7], cached=15 * 64, at=1.2))
    m.publish(region, 1.2)
    favourite = rank(["p0", "p1"], prefix[0], key_hash)[0]
    index, stamp = (0, P0) if favourite == "p0" else (1, P1)
    assert region.read(index, stamp).homes == {prefix[0]: 15}  # type: ignore[union-attr]
    m.publish(region, 1.2 + HOT_S + 0.2)
    assert not region.read(index, stamp).homes  # type: ignore[union-attr]


def test_a_producer_out_of_placement_takes_no_homes_and_gives_back_its_own() -> None:
    """A prefix's home on an ejected, probing or draining producer sent every
    replica's requests for it to the estimate alone; now its home moves to the next producer in
    its rank, and back when the producer serves again."""
    m = _model()
    m.set_capacity(0, 40 * 64)
    m.set_capacity(1, 40 * 64)
    prefix = list(range(100, 115))
    m.apply(_rep(prefix, cached=0, at=1.0))
    m.apply(_rep(prefix + [7], cached=15 * 64, at=1.2))
    favourite, other = rank(["p0", "p1"], prefix[0], key_hash)
    at, away = (0, 1) if favourite == "p0" else (1, 0)
    m.assign_homes(1.2)
    assert m.producers[at].homes == {prefix[0]: 15}  # type: ignore[union-attr]
    m.out = frozenset({at})  # ejected, probing or draining: the supervisor says so at publish
    m.assign_homes(1.3)
    assert m.producers[at].homes == {} and m.producers[away].homes == {prefix[0]: 15}  # type: ignore[union-attr]
    m.out = frozenset()
    m.assign_homes(1.4)
    assert m.producers[at].homes == {prefix[0]: 15} and m.producers[away].homes == {}  # type: ignore[union-attr]


def test_no_homes_on_producers_of_unknown_capacity() -> None:
    m = _model()
    prefix = list(range(100, 115))
    m.apply(_rep(prefix, cached=0, at=1.0))
    m.apply(_rep(prefix, cached=15 * 64, at=1.1))
    m.assign_homes(1.1)
    assert all(not p.homes for p in m.producers if p is not None)
    assert homes.room_blocks(None) == 0


def test_a_prefix_is_as_long_as_the_median_of_its_hits_not_a_long_chats_history() -> None:
    m = _model()
    prefix = list(range(100, 115))
    m.apply(_rep(prefix + [1], cached=0, at=1.0))
    for n, extra in enumerate(([2], [3], [3, 4, 5, 6, 7])):  # the last: a later turn hitting its own history
        m.apply(_rep(prefix + extra, cached=(15 + (4 if n == 2 else 0)) * 64, at=1.1 + n / 10))
    assert m.prefixes[prefix[0]].size() == 15


def test_the_rate_leaves_out_the_fleets_fixed_cost_per_prefill() -> None:
    fit = Fit()
    for x in (256.0, 4096.0) * 50:  # 10 ms of round trip, then 200,000 characters a second
        fit.add(x, 0.01 + x / 200_000)
    assert abs(fit.intercept(1024) - 0.01) < 1e-9
    assert Fit().intercept(1024) == 0.0  # nothing learned: nothing taken off
    m = _model()
    m.fit = fit
    keys = list(range(1, 17))
    m.apply(PrefillReport(0, P0, 11, 4096, 1024, 0, 0.01 + 4096 / 200_000, tuple(keys), 0, 1.0))
    assert abs(m.producers[0].rate - 200_000) < 1.0  # type: ignore[union-attr,operator]


def test_without_a_known_capacity_an_eviction_bounds_the_holdings_to_what_outlived_it() -> None:
    m = _model()
    a, b = list(range(100, 116)), list(range(200, 216))
    m.apply(_rep(a, cached=0, at=1.0))
    m.apply(_rep(b, cached=0, at=1.1))
    assert m.apply(_rep(a, cached=0, at=1.2)) == "over"  # a was evicted: b alone outlived it
    p = m.producers[0]
    assert p is not None and p.learned_blocks == 16 and m.capacity_blocks(p) == 16
    assert list(p.keys) == list(reversed(a))  # a computed again, b pushed out to stay within 16
    assert m.apply(_rep(a, cached=16 * 64, at=1.3)) == "exact"  # at the bound: perhaps more room
    assert p.learned_blocks == 17
    m.set_capacity(0, 100 * 64)  # said at last: the capacity is what the engine says
    assert m.capacity_blocks(p) == 100
    m.forget(0)
    assert p.learned_blocks is None


def _engine_rate(m: HoldingsModel, engine: int, tokens_per_s: float) -> None:
    """Enough ``/metrics`` reads of ``engine`` for its engine-reported rate to be ``tokens_per_s``."""
    from narwhal.supervisor.holdings.engine_rate import MIN_SAMPLES, SAMPLE_PREFILLS
    from narwhal.supervisor.load_metrics import PrefillCounters

    for i in range(MIN_SAMPLES + 1):
        counters = PrefillCounters(float(i), float(i * SAMPLE_PREFILLS), i * tokens_per_s, 0.0)
        m.engine_read(engine, 40 * 64, counters, float(i))


def test_homes_room_is_scaled_by_the_engine_reported_rate_class() -> None:
    m = _model()
    m.set_capacity(0, 40 * 64)
    m.set_capacity(1, 40 * 64)
    full = homes.room_blocks(40)
    assert (m.home_room(0), m.home_room(1)) == (full, full)  # no rate reported yet: unscaled
    _engine_rate(m, 0, 2000.0)
    assert (m.home_room(0), m.home_room(1)) == (full, full)  # the other's still unknown: unscaled
    _engine_rate(m, 1, 900.0)
    assert (m.home_room(0), m.home_room(1)) == (full, homes.room_blocks(40, 0.5))
    two = [list(range(200, 215)), list(range(300, 315))]
    assert all(rank(["p0", "p1"], prefix[0], key_hash)[0] == "p1" for prefix in two)  # both p1's first
    at = 1.0
    for prefix in two:  # both live
        m.apply(_rep(prefix, cached=0, at=at, producer=1))
        m.apply(_rep(prefix + [7], cached=15 * 64, at=at + 0.1, producer=1))
        at += 0.2
    m.assign_homes(at)
    p0, p1 = m.producers[0], m.producers[1]
    assert p0 is not None and p1 is not None
    # p1's 18 blocks take one prefix of 15 (its full room would take both): the other goes to p0.
    assert (p0.homes, p1.homes) == ({300: 15}, {200: 15})


def test_the_engine_reported_rate_stands_in_for_a_learned_rate_in_the_estimate() -> None:
    m = _model()
    p = m.producers[1]
    assert p is not None and m.placing_rates()[1] is None
    _engine_rate(m, 1, 900.0)
    assert m.placing_rates()[1] == 900.0 * 4  # tokens/s at 4 characters a token (until learned)
    p.rate = 12345.0  # learned: this replica's own measure wins
    assert m.placing_rates()[1] == 12345.0


def test_a_rate_class_reported_later_moves_no_home_when_no_other_producer_has_room() -> None:
    m = _model()
    m.set_capacity(0, 40 * 64)
    m.set_capacity(1, 40 * 64)
    four = [list(range(100 * k, 100 * k + 15)) for k in range(1, 5)]  # 4 × 15 blocks in two rooms of 36
    at = 1.0
    for prefix in four:  # all live, reported on the test's clock
        m.apply(_rep(prefix, cached=0, at=at))
        m.apply(_rep(prefix + [7], cached=15 * 64, at=at + 0.1))
        at += 0.2
    m.assign_homes(at)
    p0, p1 = m.producers[0], m.producers[1]
    assert p0 is not None and p1 is not None
    before = (dict(p0.homes), dict(p1.homes))
    assert len(before[0]) == len(before[1]) == 2  # no rate yet: both rooms whole, two prefixes each
    _engine_rate(m, 0, 2000.0)
    _engine_rate(m, 1, 900.0)  # p1 reads half: its class room (18) takes one prefix of 15
    assert m.home_room(1) == homes.room_blocks(40, 0.5)
    m.assign_homes(at + 0.5)
    # p0's room has no space for a third: p1 keeps both (its KV holds them), none is left without
    # a home, and a replica that has not read the rate yet computes the same homes.
    assert (p0.homes, p1.homes) == before
