"""docs/decisions.md "vLLM releases"'s rules about vLLM releases (``narwhal.fleet.compat``) and placement's pair filter:
NIXL hands off only between engines of one version and one transfer mode."""

from __future__ import annotations

from narwhal.fleet import compat
from tests.unit.fleet.placement_support import MODEL, build, place


def test_compatible_pairs_need_one_mode_and_one_known_version() -> None:
    placement, *_ = build([{"name": "p0", "role": "producer"}, {"name": "d0", "role": "consumer"}])
    p0, d0 = placement.fleet.by_name["p0"], placement.fleet.by_name["d0"]
    assert compat.compatible(p0, d0)  # neither version known yet: not refused
    placement.fleet.set_version(p0, "0.33.0")
    assert compat.compatible(p0, d0)  # one known
    placement.fleet.set_version(d0, "0.32.0")
    assert not compat.compatible(p0, d0) and compat.why_incompatible(p0, d0) == "vLLM 0.33.0 and 0.32.0"
    placement.fleet.set_version(d0, "0.33.0+cu126")
    assert not compat.compatible(p0, d0)  # the hash takes the exact version string
    placement.fleet.set_version(d0, "0.33.0")
    assert compat.compatible(p0, d0)
    d0.transfer_mode = "push"
    assert not compat.compatible(p0, d0) and compat.why_incompatible(p0, d0) == "transfer modes pull and push"


def test_which_releases_free_a_refused_decode_and_which_keep_the_tp_rule() -> None:
    assert [compat.frees_refused_decode(v) for v in ("0.11.0", "0.20.2", "0.21.0", "0.33.0", None, "weird")] == [
        False, False, True, True, False, False]
    # Not on generate, nor for a request-validation 400: vLLM's cleanup wraps neither.
    assert not compat.frees_refused_decode("0.33.0", generate=True)
    assert not compat.frees_refused_decode("0.33.0", error_type="Bad Request")
    assert compat.frees_refused_decode("0.33.0", error_type="BadRequestError")
    assert [compat.tp_multiple_rule(v) for v in ("0.11.0", "0.11.2+cu126", "0.12.0", "0.33.0", None)] == [
        True, True, False, False, False]


def test_placement_pairs_only_compatible_engines_during_a_rolling_upgrade() -> None:
    placement, *_ = build([{"name": "p0", "role": "producer"}, {"name": "d0", "role": "consumer"},
                           {"name": "d1", "role": "consumer"}])
    fleet = placement.fleet
    for name, version in (("p0", "0.33.0"), ("d0", "0.32.0"), ("d1", "0.33.0")):
        fleet.set_version(fleet.by_name[name], version)
    for _ in range(10):  # d0 is idle and d1 busier each time: only compatibility can explain d1
        assert place(placement).consumer.name == "d1"
    assert placement.incompatibility(MODEL) is None  # a compatible pair exists


def test_with_no_compatible_consumer_the_model_has_no_pair_and_the_detail_says_why() -> None:
    placement, *_ = build([{"name": "p0", "role": "producer", "transfer_mode": "pull"},
                           {"name": "d0", "role": "consumer", "transfer_mode": "push"}])
    assert placement.try_place(MODEL) is None and not placement.has_pair(MODEL)
    assert placement.incompatibility(MODEL) == (
        "no consumer compatible with a producer: NIXL hands off only between engines of one vLLM version and "
        "transfer mode (transfer modes pull and push)")


def test_an_undecoded_handoff_is_released_only_through_a_compatible_consumer() -> None:
    """docs/behaviour.md "Cleanup" with docs/decisions.md "vLLM releases": a release is a decode too;
    an incompatible consumer's handshake
    fails and the blocks stay pinned, so releases never go there."""
    placement, *_ = build([{"name": "p0", "role": "producer"}, {"name": "d0", "role": "consumer"},
                           {"name": "d1", "role": "consumer"}, {"name": "d2", "role": "consumer",
                                                                 "transfer_mode": "push"}])
    fleet = placement.fleet
    for name, version in (("p0", "0.33.0"), ("d0", "0.33.0"), ("d1", "0.32.0"), ("d2", "0.33.0")):
        fleet.set_version(fleet.by_name[name], version)
    p0, d0 = fleet.by_name["p0"], fleet.by_name["d0"]
    assert placement.release_consumers(p0, d0, MODEL, chosen_first=True) == [d0]
    fleet.set_version(fleet.by_name["d1"], "0.33.0")  # upgraded: a release may go there again
    assert [d.name for d in placement.release_consumers(p0, d0, MODEL, chosen_first=False)] == ["d1", "d0"]


def test_compat_enforce_versions_false_pairs_across_versions() -> None:
    # vLLM's own enforce_handshake_compat: false lets a rolling upgrade hand off across releases.
    placement, *_ = build([{"name": "p0", "role": "producer"}, {"name": "d0", "role": "consumer"}],
                          compat={"enforce_versions": False})
    p0, d0 = placement.fleet.engines
    placement.fleet.set_version(p0, "0.33.0")
    placement.fleet.set_version(d0, "0.34.0")
    assert compat.compatible(p0, d0)
    found = placement.try_place(MODEL)
    assert found is not None and (found.producer.name, found.consumer.name) == ("p0", "d0")
    d0.transfer_mode = "push"
    assert not compat.compatible(p0, d0)  # the transfer mode still decides
