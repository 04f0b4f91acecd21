"""The engine table written at run time (discovery, docs/behaviour.md "Engines that come and go"): slots, epochs,
descriptors.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from narwhal.shm import descriptors
from narwhal.shm import layout as L
from narwhal.shm.shared import SharedFleet
from narwhal.shm.table import LIVE, RETIRED, TableFull, identity


@pytest.fixture
def shared() -> Iterator[SharedFleet]:
    fleet = SharedFleet.create(engines=2, slots=4, ring=8)
    yield fleet
    fleet.close()


def _join(shared: SharedFleet, name: str, oldest: int | None) -> int:
    ident = identity(name, f"http://{name}:1")
    slot = shared.table.spare_slot(ident, oldest)
    descriptors.write(shared.region, slot, descriptors.encode({"name": name, "url": f"http://{name}:1",
                                                               "role": "both"}, "file"))
    shared.table.make_live(slot, ident)
    return slot


def test_each_change_moves_the_epoch_and_a_retired_slot_waits_for_every_worker(shared: SharedFleet) -> None:
    assert _join(shared, "a", None) == 0 and _join(shared, "b", None) == 1
    assert shared.table.epoch == 2
    assert [(slot, e["name"], source) for slot, e, source in shared.described()] == [(0, "a", "file"), (1, "b", "file")]
    shared.table.retire(0)
    assert shared.table.epoch == 3 and shared.table.entry(0).state == RETIRED
    with pytest.raises(TableFull):  # a worker that noted epoch 2 may still hold a leg on a
        shared.table.spare_slot(identity("c", "http://c:1"), oldest_worker_epoch=2)
    assert _join(shared, "c", oldest=3) == 0  # every worker let go of a
    assert shared.table.entry(0) == shared.table.entry(0).__class__(identity("c", "http://c:1"), 4, LIVE)


def test_an_engine_coming_back_takes_its_own_retired_slot(shared: SharedFleet) -> None:
    _join(shared, "a", None)
    shared.table.retire(0)
    assert _join(shared, "a", oldest=0) == 0


def test_a_live_slot_whose_descriptor_is_another_engines_is_left_out(shared: SharedFleet) -> None:
    _join(shared, "a", None)
    shared.table.retire(0)
    shared.table.make_live(0, identity("x", "http://x:1"))  # its descriptor not written yet
    assert shared.described() == [] and shared.live_slots() == 1


def test_a_description_that_does_not_fit_is_refused() -> None:
    with pytest.raises(descriptors.DescriptorTooLong):
        descriptors.encode({"name": "a", "kv_peers": ["d" * 60] * 400}, "file")
    assert descriptors.ROOM == L.DESCRIPTOR_SIZE - 14


def test_the_largest_entry_the_settings_accept_fits_its_descriptor(shared: SharedFleet) -> None:
    """docs/behaviour.md: any entry the settings accept fits, whatever its characters (4 UTF-8 bytes, or a
    quote JSON escapes, at every place a field allows one)."""
    from narwhal.settings import engines as E

    wide = "\U0001f600"  # four bytes in UTF-8: the most a character costs in the JSON
    entry = E.EngineSpec.model_validate({
        "name": "n" * E.MAX_NAME, "url": "http://h:1/" + wide * (E.MAX_URL - 11), "role": "both",
        "wave": wide * E.MAX_WAVE, "kv_connector": wide * E.MAX_CONNECTOR,
        "max_inflight_prefill": 2**62, "max_inflight_decode": 2**62, "transfer_mode": "push",
        "kv_peers": ["p" * E.MAX_NAME] * E.MAX_PEERS, "models": [wide * E.MAX_MODEL] * E.MAX_MODELS,
    }).model_dump()  # as the master writes it (gunicorn_hooks), nulls and all
    blob = descriptors.encode(entry, "dns:" + "d" * 253)
    descriptors.write(shared.region, 0, blob)
    assert descriptors.read(shared.region, 0) == (entry, "dns:" + "d" * 253)
    quoted = {**entry, "models": ['"' * E.MAX_MODEL] * E.MAX_MODELS}  # escaped: two bytes each
    descriptors.encode(quoted, "file")
