"""Each engine's models in shared memory (``shm.models``): the record round trip, its bounds, and
its place in the region (nothing else overwritten)."""

from __future__ import annotations

import pytest

from narwhal.shm import descriptors
from narwhal.shm import models as M
from narwhal.shm.records import LoadRecord, RecordBusy, read_load, write_load
from narwhal.shm.shared import SharedFleet


def test_round_trip_absence_and_generation(shared: SharedFleet) -> None:
    assert M.read_models(shared.region, 0) is None
    assert M.generation(shared.region) == 0
    rec = M.ModelsRecord(version=1, name_hash=7, status=M.ANSWERED, models=("m-one", "org/m-two", "lora-é"))
    M.write_models(shared.region, 2, rec)
    assert M.bump_generation(shared.region) == 1 and M.generation(shared.region) == 1
    assert M.read_models(shared.region, 2) == rec
    assert M.read_models(shared.region, 1) is None and M.read_models(shared.region, 3) is None
    empty = M.ModelsRecord(version=2, name_hash=7, status=M.UNANSWERED, models=())
    M.write_models(shared.region, 2, empty)
    assert M.read_models(shared.region, 2) == empty


def test_the_last_engine_slot_s_record_leaves_every_worker_slot_alone(shared: SharedFleet) -> None:
    full = M.fit([f"model-{i:03d}-" + "x" * 20 for i in range(M.MAX_MODELS)]).models
    for engine in range(4):
        write_load(shared.region, engine, LoadRecord(1.0, 2.0, 3.0, 0.5, 9), version=1)
        descriptors.write(shared.region, engine, descriptors.encode({"name": f"e{engine}"}, "static"))
        M.write_models(shared.region, engine, M.ModelsRecord(3, 9, M.ANSWERED, full))
    slot = shared.claim_slot(12345)
    assert slot is not None and shared.slot_counts(slot) == (0,) * 8
    assert shared.layout.models_offset(4) <= shared.layout.slot_offset(0)
    for engine in range(4):
        assert read_load(shared.region, engine) == LoadRecord(1.0, 2.0, 3.0, 0.5, 9)
        assert descriptors.read(shared.region, engine) == ({"name": f"e{engine}"}, "static")
        assert M.read_models(shared.region, engine) == M.ModelsRecord(3, 9, M.ANSWERED, full)


def test_a_name_over_the_bound_is_left_out_and_the_rest_kept_in_the_engine_s_order() -> None:
    long = "org/" + "a" * M.MAX_MODEL_BYTES
    fitted = M.fit(["base", long, "lora-1", "base", "x" * M.MAX_MODEL_BYTES])
    assert fitted.models == ("base", "lora-1", "x" * M.MAX_MODEL_BYTES)  # each once; 255 bytes is in
    assert fitted.too_long == (long,) and fitted.left_out == 0
    assert fitted.refusal("e0") == (
        f"engine e0: 1 model name(s) over {M.MAX_MODEL_BYTES} bytes left out ('org/{'a' * 36}...')")
    assert M.fit(["é" * 128]).too_long == ("é" * 128,)  # bytes of UTF-8 count, not characters
    assert M.fit(["a", "b"]).refusal("e0") is None


def test_more_models_than_the_bound_keep_the_first_ones() -> None:
    fitted = M.fit([f"m{i}" for i in range(M.MAX_MODELS + 6)])
    assert fitted.models == tuple(f"m{i}" for i in range(M.MAX_MODELS)) and fitted.left_out == 6
    assert fitted.refusal("e1") == (f"engine e1: 6 model(s) beyond the first {M.MAX_MODELS} left out "
                                    f"(at most {M.MAX_MODELS} per engine, {M.ROOM} bytes of names)")


def test_names_beyond_the_record_s_room_are_left_out_and_what_is_kept_round_trips(shared: SharedFleet) -> None:
    names = [f"{i:02d}" + "n" * 200 for i in range(12)]  # 202 bytes each: 8 fit in the record's room
    fitted = M.fit(names)
    assert fitted.models == tuple(names[:8]) and fitted.left_out == 4 and 8 * 203 <= M.ROOM < 9 * 203
    # With the engine's card at its longest beside them: max_model_len and a root of MAX_ROOT_BYTES.
    rec = M.ModelsRecord(1, 5, M.ANSWERED, fitted.models, "0.33.0", M.GENERATE_SERVED, 131072,
                         "/models/" + "r" * (M.MAX_ROOT_BYTES - 8))
    M.write_models(shared.region, 0, rec)
    assert M.read_models(shared.region, 0) == rec


def test_a_card_the_record_cannot_hold_is_left_out() -> None:
    for root in ("r" * (M.MAX_ROOT_BYTES + 1), "caf\u00e9", "a\nb", ""):
        rec = M.decode(M.encode(M.ModelsRecord(1, 5, M.ANSWERED, ("m",), root=root, max_model_len=0)))
        assert (rec.root, rec.max_model_len) == (None, None)


def test_a_record_outside_the_bounds_is_refused_by_the_encoder() -> None:
    with pytest.raises(ValueError, match="fit"):
        M.encode(M.ModelsRecord(1, 5, M.ANSWERED, ("a" * (M.MAX_MODEL_BYTES + 1),)))
    with pytest.raises(ValueError, match="fit"):
        M.encode(M.ModelsRecord(1, 5, M.ANSWERED, tuple(f"m{i}" for i in range(M.MAX_MODELS + 1))))


def test_a_record_left_mid_write_is_busy_for_a_reader_and_whole_for_a_restarted_writer(shared: SharedFleet) -> None:
    rec = M.ModelsRecord(1, 5, M.ANSWERED, ("m",))
    M.write_models(shared.region, 1, rec)
    at = shared.layout.models_offset(1)
    seq = int.from_bytes(shared.mm[at : at + 8], "little")
    shared.mm[at : at + 8] = (seq + 1).to_bytes(8, "little")  # a writer stopped before its body
    with pytest.raises(RecordBusy):
        M.read_models(shared.region, 1)
    assert M.read_models(shared.region, 1, writer_gone=True) == rec
