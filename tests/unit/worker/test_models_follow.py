"""A worker following the engines' models in shared memory (``worker.models_follow``): taken up
when the generation moves and only then, read again while a record lags its generation (aarch64),
another engine's record never taken, and the bounded wait for the supervisor's first read."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from narwhal.fleet import Fleet
from narwhal.settings import Settings
from narwhal.shm import models as M
from narwhal.shm.shared import SharedFleet
from narwhal.shm.table import record_hash
from narwhal.worker.models_follow import ModelsFollower

P0, D0 = ("p0", "http://127.0.0.1:1"), ("d0", "http://127.0.0.1:2")


@pytest.fixture
def settings() -> Settings:
    return Settings.model_validate({"engines": [{"name": "p0", "url": P0[1], "role": "producer"},
                                                {"name": "d0", "url": D0[1], "role": "consumer"}]})


@pytest.fixture
def shared() -> Iterator[SharedFleet]:
    region = SharedFleet.create(engines=4, slots=2)
    region.assign_engines([P0, D0])
    yield region
    region.close()


@pytest.fixture
def follower(shared: SharedFleet, settings: Settings) -> ModelsFollower:
    """A worker's follower of ``shared``'s models, for the engines of ``settings`` by name."""
    return ModelsFollower(shared, Fleet(settings), by_slot=False)


def publish(shared: SharedFleet, models: dict[tuple[str, str], tuple[str, ...]], *, bump: bool = True,
            version: int | None = None, owners: dict[tuple[str, str], tuple[str, str]] | None = None) -> None:
    """What the supervisor does: every record under the next generation, then the bump."""
    stamp = M.generation(shared.region) + 1 if version is None else version
    for engine, names in models.items():
        slot = shared.engine_slot(*engine)
        assert slot is not None
        ident = record_hash(*(owners or {}).get(engine, engine))
        M.write_models(shared.region, slot, M.ModelsRecord(stamp, ident, M.ANSWERED, names))
    if bump:
        M.bump_generation(shared.region)


def served(follower: ModelsFollower) -> dict[str, set[str]]:
    return {e.name: set(e.models) for e in follower.fleet.engines}


def test_models_are_taken_up_when_the_generation_moves_and_not_read_again_before(
    shared: SharedFleet, follower: ModelsFollower
) -> None:
    publish(shared, {P0: ("m-one",), D0: ("m-one",)})
    follower.check()
    assert served(follower) == {"p0": {"m-one"}, "d0": {"m-one"}}
    version = follower.fleet.version
    publish(shared, {P0: ("m-two",), D0: ("m-one",)}, bump=False)  # written, not bumped yet
    follower.check()
    assert served(follower)["p0"] == {"m-one"} and follower.fleet.version == version  # one compare, no read
    M.bump_generation(shared.region)
    follower.check()
    assert served(follower) == {"p0": {"m-two"}, "d0": {"m-one"}} and follower.fleet.served_models == {"m-one", "m-two"}


def test_a_record_that_lags_its_generation_is_read_again_at_the_next_check(
    shared: SharedFleet, follower: ModelsFollower
) -> None:
    publish(shared, {P0: ("m-one",), D0: ("m-one",)})
    follower.check()
    publish(shared, {P0: ("m-one",), D0: ("m-one",)}, version=1)  # the bump to 2 seen before the records
    M.bump_generation(shared.region)
    follower.check()
    publish(shared, {P0: ("m-one",), D0: ("m-new",)}, bump=False, version=2)  # now they arrive
    follower.check()
    assert served(follower)["d0"] == {"m-new"}


def test_another_engine_s_record_at_the_slot_is_never_taken(shared: SharedFleet, follower: ModelsFollower) -> None:
    publish(shared, {P0: ("m-one",), D0: ("m-one",)})
    follower.check()
    publish(shared, {P0: ("m-one",), D0: ("theirs",)}, owners={D0: ("d0", "http://127.0.0.1:9")})
    follower.check()
    assert served(follower) == {"p0": {"m-one"}, "d0": set()}  # published, and not for this d0


async def test_the_start_waits_for_the_first_read_within_its_bound_and_says_what_it_lacks(
    shared: SharedFleet, follower: ModelsFollower, caplog: pytest.LogCaptureFixture
) -> None:
    publish(shared, {P0: ("m-one",)})  # no supervisor read d0 yet
    await follower.first(bound_s=0.05)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        "the supervisor has not read the models of d0 yet: serving without them until it does"]
    assert served(follower) == {"p0": {"m-one"}, "d0": set()}
    caplog.clear()
    publish(shared, {P0: ("m-one",), D0: ("m-one",)})
    await follower.first(bound_s=5.0)  # nothing left to wait for: at once
    assert caplog.records == [] and served(follower)["d0"] == {"m-one"}
