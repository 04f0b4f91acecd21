"""Engine descriptors: what an engine *is*, at its engine slot, for processes never told of it.

A worker forked before an engine was discovered has no settings entry for it; the descriptor
at the engine's slot (``shm.layout``) carries its ``[[engines]]`` entry as JSON — name, URL,
role, wave, caps, connector, kv_peers, models — and the source it came from (``static``,
``file``, ``dns:NAME``). One writer at a time, the writer of the engine table (under the
table lock, ``shm.table``): the master for the static engines at start and each reload, the
supervisor for discovered ones. The descriptor is written *before* its table entry turns
LIVE and the table epoch moves, so a reader that sees the entry finds its descriptor (read
under the seqlock and CRC like every record: a torn or not yet visible copy is read again).

Why JSON in a fixed slot: it is read only when the table epoch moves (engines came or went),
never per request, and it keeps the entry's own validation (``EngineSpec``) the one definition
of an engine. The slot (24 KiB, ``shm.layout.DESCRIPTOR_SIZE``) holds the largest entry the
settings accept (docs/behaviour.md: any entry they accept fits — their bounds, ``settings.engines``,
allow 64 ``kv_peers`` and 32 model names of 100 characters; ``tests/unit/shm/
test_table_runtime.py`` writes the largest). A memfd's pages are taken only when written: the
slots of engines that never came cost no memory. A description that still does not fit (a
bound raised without the slot) is refused by the writer with one line, never written torn.
"""

from __future__ import annotations

import struct
from typing import Any

import orjson

from narwhal.shm import layout as L
from narwhal.shm.records import RecordBusy, read_framed, write_framed

_LEN = struct.Struct("<H")
BODY = L.DESCRIPTOR_SIZE - 8 - 4  # seq before, CRC after
ROOM = BODY - _LEN.size
_BUSY_TRIES = 1000


class DescriptorTooLong(Exception):
    """An engine's description does not fit its descriptor."""


def encode(entry: dict[str, Any], source: str) -> bytes:
    """The descriptor's bytes for an ``[[engines]]`` entry; :class:`DescriptorTooLong` if they do not fit."""
    blob = orjson.dumps({"source": source, "engine": entry})
    if len(blob) > ROOM:
        raise DescriptorTooLong(f"engine {entry.get('name')!r}: its description is over {ROOM} bytes")
    return blob


def write(region: L.Region, slot: int, blob: bytes) -> None:
    """Table writers only (under the table lock)."""
    body = _LEN.pack(len(blob)) + blob
    write_framed(region, region.layout.descriptor_offset(slot), body + bytes(BODY - len(body)))


def read(region: L.Region, slot: int) -> tuple[dict[str, Any], str] | None:
    """The engine entry at ``slot`` and its source; None if none was ever written."""
    at = region.layout.descriptor_offset(slot)
    for _ in range(_BUSY_TRIES):
        try:
            body = read_framed(region, at, BODY)
        except RecordBusy:
            continue
        break
    else:
        body = read_framed(region, at, BODY, writer_gone=True)
    if body is None:
        return None
    size = _LEN.unpack_from(body)[0]
    doc = orjson.loads(body[_LEN.size : _LEN.size + size])
    return doc["engine"], doc["source"]
