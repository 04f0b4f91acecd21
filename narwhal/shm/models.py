"""Each engine's models in shared memory: what the supervisor read from its ``/v1/models``.

docs/behaviour.md "The request path": an engine's models come from its ``/v1/models`` at start and at every readmission.
The supervisor reads them (``supervisor.models``) and publishes one record per engine slot
(``shm.layout``), then bumps the models generation; workers only read (``worker.models_follow``):
when the generation moved, never per request. One writer, the supervisor, so no lock.

A record is ``seq u64 | version u64, identity hash u32, status u8, count u8, engine version length
u8, generate u8, max model len u32, root length u8, engine version, root, names | crc32`` under
the seqlock of ``shm.records`` (a torn or reordered copy is read again), each name a u8 length
and its UTF-8 bytes. The engine version is
the engine's ``/version`` (docs/decisions.md "vLLM releases": which engines may pair), read with its models, at most
:data:`MAX_VERSION_BYTES` bytes (a longer answer is no version); ``generate`` is whether it
answers 403 on ``/inference/v1/generate`` (``GENERATE_*``), which ``/admin/engines`` shows.
``max_model_len`` is the engine's context length and ``root`` its first model's ``root`` (its
path or repository id, at most :data:`MAX_ROOT_BYTES`), from the same ``/v1/models`` answer:
the router's own ``/v1/models`` lists them, as clients size requests from ``max_model_len``.
``version`` is the models generation it was published under: every round rewrites every
engine's record, so a worker that sees the bump before a record (aarch64) reads again until the
records carry it. The identity hash
says whose the record is: a record left at a slot by an engine a reload or discovery removed is
nobody's.

Bounded on purpose, each bound logged by the supervisor when it bites (never silently):

* a name over :data:`MAX_MODEL_BYTES` bytes of UTF-8 (vLLM's served names are repository ids
  or paths, far shorter) is left out, the rest of the list kept;
* at most :data:`MAX_MODELS` names, and no more than fit the 2 KiB record, kept in the
  engine's order (vLLM lists its base model first, then LoRA adapters): the rest left out.

A request for a model left out gets the same 404 ``model_not_found`` as any model no engine serves.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from narwhal.shm import layout as L
from narwhal.shm.records import read_framed, write_framed

READ_TIMEOUT_S = 5.0
"""One ``/v1/models`` read by the supervisor: an engine slower than this is asked again later. A
wire constant both sides need: the workers' first wait for the records allows for it
(``worker.models_follow``)."""

PENDING = 0  # published before its first read ended: a worker starting waits for the read
ANSWERED = 1  # the names are the engine's /v1/models answer
UNANSWERED = 2  # read, and no answer yet: no models until it answers
CONFIGURED = 3  # ``engines[].models`` set: never read; workers use their own settings

MAX_MODEL_BYTES = 255  # a name's length is one byte
MAX_MODELS = 64
MAX_VERSION_BYTES = 63  # "0.33.0+cu126.abcdef" fits many times over
MAX_ROOT_BYTES = 127  # a model's root: a repository id or a local path; a longer one is left out

# version, identity hash, status, count, engine version length, generate, max model len, root length
_HEAD = struct.Struct("<QIBBBBIB")

GENERATE_UNKNOWN = 0  # not asked, or no answer yet
GENERATE_SERVED = 1  # answered anything but 403
GENERATE_REFUSED = 2  # answered 403: vLLM runs without --enable-scale-out
BODY = L.MODELS_RECORD_SIZE - 8 - 4  # seq before, CRC after
ROOM = BODY - _HEAD.size - MAX_VERSION_BYTES - MAX_ROOT_BYTES  # for the names, each a length byte and its bytes


@dataclass(frozen=True, slots=True)
class ModelsRecord:
    """An engine's models as the supervisor published them; ``name_hash`` says whose they are."""

    version: int  # the models generation it was published under
    name_hash: int
    status: int  # PENDING, ANSWERED, UNANSWERED or CONFIGURED
    models: tuple[str, ...]
    engine_version: str | None = None  # the engine's /version; None: not read (yet)
    generate: int = GENERATE_UNKNOWN  # its answer on /inference/v1/generate (GENERATE_*)
    max_model_len: int | None = None  # its context length, from /v1/models; None: not said
    root: str | None = None  # its first model's root, from /v1/models; None: not said


@dataclass(frozen=True, slots=True)
class Fitted:
    """An answer cut to the record's bounds: what is kept, and what was left out and why."""

    models: tuple[str, ...]
    too_long: tuple[str, ...] = ()  # names over MAX_MODEL_BYTES
    left_out: int = 0  # names beyond MAX_MODELS or the record's room

    def refusal(self, engine: str) -> str | None:
        """The log line naming what was left out of ``engine``'s models; None when nothing was."""
        parts = []
        if self.too_long:
            shown = ", ".join(repr(name[:40] + "...") for name in self.too_long[:3])
            parts.append(f"{len(self.too_long)} model name(s) over {MAX_MODEL_BYTES} bytes left out ({shown})")
        if self.left_out:
            parts.append(f"{self.left_out} model(s) beyond the first {len(self.models)} left out "
                         f"(at most {MAX_MODELS} per engine, {ROOM} bytes of names)")
        return f"engine {engine}: " + "; ".join(parts) if parts else None


def fit(models: Sequence[str]) -> Fitted:
    """The names of an answer that the record holds, in the engine's order, each once."""
    kept: list[str] = []
    too_long: list[str] = []
    left_out = 0
    room = ROOM
    for name in dict.fromkeys(models):
        size = len(name.encode("utf-8", "surrogatepass"))
        if size > MAX_MODEL_BYTES:
            too_long.append(name)
            continue
        if len(kept) == MAX_MODELS or size + 1 > room:
            left_out += 1
            continue
        kept.append(name)
        room -= size + 1
    return Fitted(tuple(kept), tuple(too_long), left_out)


def encode(rec: ModelsRecord) -> bytes:
    """The record's body, padded to :data:`BODY`; ``ValueError`` for names :func:`fit` would not keep."""
    if fit(rec.models).models != rec.models:
        raise ValueError("models outside the record's bounds: fit() them first")
    raws = [m.encode("utf-8", "surrogatepass") for m in rec.models]
    names = b"".join(len(raw).to_bytes(1, "little") + raw for raw in raws)
    engine_version = fit_version(rec.engine_version)
    raw_version = b"" if engine_version is None else engine_version.encode()
    root = fit_root(rec.root)
    raw_root = b"" if root is None else root.encode()
    context = rec.max_model_len if rec.max_model_len is not None and 0 < rec.max_model_len < 1 << 32 else 0
    body = _HEAD.pack(rec.version, rec.name_hash, rec.status, len(rec.models),
                      len(raw_version) if engine_version is not None else 0xFF, rec.generate, context,
                      len(raw_root) if root is not None else 0xFF) + raw_version + raw_root + names
    return body + bytes(BODY - len(body))


def decode(body: bytes) -> ModelsRecord:
    """The record in ``body`` (whole and CRC-checked: ``read_framed`` gave it)."""
    version, name_hash, status, count, version_len, generate, context, root_len = _HEAD.unpack_from(body)
    at = _HEAD.size
    engine_version = root = None
    if version_len != 0xFF:
        engine_version = body[at : at + version_len].decode("ascii", "replace")
        at += version_len
    if root_len != 0xFF:
        root = body[at : at + root_len].decode("ascii", "replace")
        at += root_len
    names = []
    for _ in range(count):
        size = body[at]
        names.append(body[at + 1 : at + 1 + size].decode("utf-8", "surrogatepass"))
        at += 1 + size
    return ModelsRecord(version, name_hash, status, tuple(names), engine_version, generate, context or None, root)


def fit_version(version: str | None) -> str | None:
    """A version the record holds: printable ASCII of at most :data:`MAX_VERSION_BYTES` bytes, else None."""
    if version is None or not version or len(version) > MAX_VERSION_BYTES:
        return None
    if not version.isascii() or not version.isprintable():
        return None
    return version


def fit_root(root: str | None) -> str | None:
    """A root the record holds: printable ASCII of at most :data:`MAX_ROOT_BYTES` bytes, else None."""
    if root is None or not root or len(root) > MAX_ROOT_BYTES or not root.isascii() or not root.isprintable():
        return None
    return root


def write_models(region: L.Region, engine: int, rec: ModelsRecord) -> None:
    """Supervisor only: publish ``rec`` at engine slot ``engine`` under its seqlock."""
    write_framed(region, region.layout.models_offset(engine), encode(rec))


def read_models(region: L.Region, engine: int, *, writer_gone: bool = False) -> ModelsRecord | None:
    """The record at engine slot ``engine``, None if none was ever written (``RecordBusy``: try later)."""
    body = read_framed(region, region.layout.models_offset(engine), BODY, writer_gone=writer_gone)
    return None if body is None else decode(body)


def generation(region: L.Region) -> int:
    """The models generation: moved by the supervisor after each round of records."""
    return region.u64(region.layout.models_generation_offset)


def bump_generation(region: L.Region) -> int:
    """Supervisor only, after the round's records were written; the new generation."""
    value = generation(region) + 1
    region.set_u64(region.layout.models_generation_offset, value)
    return value
