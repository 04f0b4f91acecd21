"""Prefix block keys (docs/behaviour.md "Placement"), pure: chained over fixed blocks, lazy, the same in every process;
and the docs/settings.md settings that drive them and the choice of policy."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
from collections import Counter
from typing import Any

import pytest

from narwhal.fleet.placement.blocks import PrefixBlocks
from narwhal.settings import PlacementSettings, Settings, SettingsError, load_settings
from narwhal.settings import placement as placement_settings
from tests.unit.fleet.placement_support import KEY, PRODUCERS, fleet_of, place

TEXT = "narwhal block keys, version 1. " * 20  # 620 characters: 2 full blocks of 256
KNOWN_0, KNOWN_1 = 16089810404084641342, 14524211667425308471  # TEXT's keys, pinned


def test_keys_chain_over_whole_blocks_only() -> None:
    blocks = PrefixBlocks(TEXT, 256, 65536)
    assert (blocks.count, blocks.chars) == (2, 512)
    same_start = PrefixBlocks(TEXT[:256] + "x" * 300, 256, 65536)
    assert same_start.key(0) == blocks.key(0) and same_start.key(1) != blocks.key(1)
    # Block 1's text alone after another block 0 is another key: the chain covers blocks 0..k.
    shifted = PrefixBlocks("y" * 256 + TEXT[256:512], 256, 65536)
    assert shifted.key(1) != blocks.key(1)
    assert PrefixBlocks(TEXT, 256, 300).count == 1  # max_prefix_chars bounds what is keyed
    assert PrefixBlocks(TEXT[:255], 256, 65536).keys() == []


def test_keys_are_blake2b_chained_through_the_salt() -> None:
    salt = b""
    expected = []
    for k in range(2):
        salt = hashlib.blake2b(TEXT[k * 256 : (k + 1) * 256].encode(), digest_size=8, salt=salt).digest()
        expected.append(int.from_bytes(salt, "little"))
    assert PrefixBlocks(TEXT, 256, 65536).keys() == expected
    # Pinned: a replica running another release must compute the same keys.
    assert expected == [KNOWN_0, KNOWN_1]


def test_keys_are_computed_lazily_and_once() -> None:
    lazy = PrefixBlocks(TEXT * 4, 256, 65536)
    assert lazy.key(0) == PrefixBlocks(TEXT * 4, 256, 65536).keys()[0]
    assert len(lazy.keys(1)) == 4  # a batch of 4 (TEXT * 4 has 9 blocks), not every block
    assert len(lazy.keys(5)) == 5  # keys(n): exactly as far as asked
    assert lazy.keys() == PrefixBlocks(TEXT * 4, 256, 65536).keys()
    assert lazy.key(5) is lazy.keys()[5]


def test_non_ascii_text_is_keyed_by_its_utf8_blocks() -> None:
    text = "é∂" * 300
    keys = PrefixBlocks(text, 256, 65536).keys()
    salt = hashlib.blake2b(text[:256].encode(), digest_size=8, salt=b"").digest()
    assert len(keys) == 2 and keys[0] == int.from_bytes(salt, "little")
    assert PrefixBlocks("\ud800" * 256, 256, 65536).keys()  # a lone surrogate does not raise


def test_keys_do_not_depend_on_pythonhashseed() -> None:
    code = ("from narwhal.fleet.placement.blocks import PrefixBlocks; "
            f"print(PrefixBlocks({TEXT!r} * 3, 256, 65536).keys())")
    outputs = set()
    for seed in ("1", "2", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outputs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                   check=True, timeout=60).stdout)
    assert len(outputs) == 1 and str(PrefixBlocks(TEXT * 3, 256, 65536).keys()) + "\n" in outputs


# -- the docs/settings.md settings ------------------------------------------------------------------------------


def test_placement_settings_defaults() -> None:
    held = PlacementSettings().held
    assert (held.block_chars, held.max_prefix_chars, held.holdings_slots, held.affinity_slack) == (
        256, 65536, 65536, 0.1)


@pytest.mark.parametrize(("values", "key"), [
    ({"policy": "hold"}, "policy"),
    ({"held": {"block_chars": 0}}, "block_chars"),
    ({"held": {"holdings_slots": 0}}, "holdings_slots"),
    ({"held": {"affinity_slack": -0.1}}, "affinity_slack"),
    ({"held": {"block_chars": 512, "max_prefix_chars": 300}}, "max_prefix_chars"),
    ({"held": {"blocks": 4}}, "blocks"),
])
def test_invalid_placement_settings_name_the_key(values: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        PlacementSettings(**values)


def test_the_held_keys_of_before_are_taken_into_their_table_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(placement_settings, "_MOVED_SAID", [])
    with caplog.at_level(logging.WARNING, logger="narwhal.settings"):
        moved = PlacementSettings.model_validate({"block_chars": 512, "held": {"max_prefix_chars": 1024}})
        again = PlacementSettings.model_validate({"affinity_slack": 0.5})
    assert (moved.held.block_chars, moved.held.max_prefix_chars, again.held.affinity_slack) == (512, 1024, 0.5)
    assert [r.getMessage() for r in caplog.records] == [
        "placement.block_chars moved to [placement.held]: read from there"]
    with pytest.raises(ValueError, match=r"block_chars is set both in \[placement\] and in \[placement.held\]"):
        PlacementSettings.model_validate({"block_chars": 512, "held": {"block_chars": 1024}})


def test_a_variable_of_a_moved_key_is_refused_naming_the_one_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NARWHAL_PLACEMENT__BLOCK_CHARS", "512")
    with pytest.raises(SettingsError) as refused:
        load_settings(None)
    assert str(refused.value) == ("NARWHAL_PLACEMENT__BLOCK_CHARS: placement.block_chars moved to "
                                  "placement.held.block_chars: set NARWHAL_PLACEMENT__HELD__BLOCK_CHARS")
    monkeypatch.delenv("NARWHAL_PLACEMENT__BLOCK_CHARS")
    monkeypatch.setenv("NARWHAL_PLACEMENT__HELD__BLOCK_CHARS", "512")
    assert load_settings(None).placement.held.block_chars == 512


@pytest.mark.parametrize(("values", "policy"), [
    ({}, "held"),  # the default (docs/settings.md)
    ({"prefix_affinity": False}, "least_loaded"),
    ({"policy": "affinity"}, "affinity"),
    ({"policy": "least_loaded"}, "least_loaded"),
    ({"policy": "affinity", "prefix_affinity": False}, "least_loaded"),
])
def test_prefix_affinity_false_means_least_loaded(values: dict[str, Any], policy: str) -> None:
    assert PlacementSettings(**values).placement_policy == policy


@pytest.mark.parametrize(("values", "choice", "producers"), [
    ({"policy": "least_loaded"}, "least_loaded", len(PRODUCERS)),  # the key ignored: every producer
    ({"prefix_affinity": False}, "least_loaded", len(PRODUCERS)),
    ({"policy": "affinity"}, "affinity", 1),  # the rendezvous rule: the key's one favourite
])
def test_each_policy_places_as_spec_says(values: dict[str, Any], choice: str, producers: int) -> None:
    placement, *_ = fleet_of(**values)
    chosen: Counter[str] = Counter()
    for _ in range(60):
        found = place(placement, KEY)
        chosen[found.producer.name] += 1
        assert found.choice == choice
        found.release()
    assert len(chosen) == producers


def test_settings_from_the_environment_name_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NARWHAL_PLACEMENT__POLICY", "nearest")
    with pytest.raises(ValueError, match="policy"):
        Settings(engines=[{"name": "p0", "url": "http://127.0.0.1:9000", "role": "both"}])
