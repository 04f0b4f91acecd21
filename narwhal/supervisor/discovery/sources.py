"""Reading the discovery sources (docs/behaviour.md "Engines that come and go"): a watched engines file, DNS names.

Each read answers the engines a source names now, or raises :class:`SourceUnreadable` (the
file is gone or does not parse, the DNS server does not answer: keep the last good set, warn)
or :class:`SourceInvalid` (the file parses but an entry is wrong: refuse the whole file, with a
line naming the entry and key — half a file applied would drain engines the operator kept).

Why dnspython (a well-kept resolver) rather than ``getaddrinfo``: SRV records, a per-source
timeout that never blocks the supervisor's loop (``getaddrinfo`` runs in a thread that cannot
be cancelled), and a resolver address of the operator's choosing (``discovery.resolver``).
An empty answer (NXDOMAIN, no records) is an answer: a headless Service scaled to zero has no
engines. A timeout or SERVFAIL is not: nothing is learned from it.

A FIFO (or any file that is not a regular one) is refused without waiting for a writer. The
file is read in a daemon thread of its own (:class:`FileReader`), its wait bounded: a read that
hangs (a hung network mount) is unreadable this time, the other sources go on, and no second
thread is started while the first still hangs; once it finishes, reads go on as before. A daemon thread, not
the loop's executor, because a thread stuck in ``open()`` cannot be cancelled and the executor's
threads are joined at exit: the supervisor could then never stop.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import stat
import threading
import tomllib
from typing import Any

import dns.asyncresolver
import dns.exception
import dns.resolver
from pydantic import ValidationError

from narwhal.settings.discovery import DiscoverySettings, DnsSource
from narwhal.settings.engines import EngineSpec
from narwhal.supervisor.discovery.wanted import engine_name

MAX_FILE_BYTES = 4 << 20  # an engines file is a few KiB; more is a mistake, not a fleet


class SourceUnreadable(Exception):
    """Nothing could be learned from the source this time (its last good set stands)."""


class SourceInvalid(Exception):
    """The source answered, wrongly: refused as a whole (one line naming the entry and key)."""


def read_engines_file(path: str) -> list[EngineSpec]:
    """The ``[[engines]]`` entries of a TOML file (a ``.json`` one: ``{"engines": [...]}``)."""
    try:
        # O_NONBLOCK: a FIFO put there by mistake opens at once (and is refused below) instead of
        # waiting for a writer; a regular file reads as always.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise SourceUnreadable(f"cannot read {path}: {exc.strerror}") from None
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SourceInvalid(f"{path}: not a regular file")
        try:
            raw = f.read(MAX_FILE_BYTES + 1)
        except OSError as exc:
            raise SourceUnreadable(f"cannot read {path}: {exc.strerror}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise SourceInvalid(f"{path}: over {MAX_FILE_BYTES} bytes")
    try:
        document = json.loads(raw) if path.endswith(".json") else tomllib.loads(raw.decode())
    except (ValueError, UnicodeDecodeError) as exc:  # TOMLDecodeError and JSONDecodeError are ValueErrors
        raise SourceUnreadable(f"{path} does not parse: {exc}") from None
    except RecursionError:  # both parsers recurse per level of nesting
        raise SourceInvalid(f"{path}: nested too deeply to be an engines file") from None
    return _entries(path, document)


def _entries(path: str, document: Any) -> list[EngineSpec]:
    if not isinstance(document, dict) or set(document) - {"engines"}:
        raise SourceInvalid(f"{path}: expected only [[engines]] entries")
    entries = document.get("engines", [])
    if not isinstance(entries, list):
        raise SourceInvalid(f"{path}: engines: expected a list of entries ([[engines]])")
    specs: list[EngineSpec] = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise SourceInvalid(f"{path}: engines.{i}: expected a table of settings")
        if "name" not in entry and isinstance(entry.get("url"), str) and isinstance(entry.get("role"), str):
            try:
                entry = {**entry, "name": engine_name(entry["role"], entry["url"].rstrip("/"))}
            except ValueError as exc:  # urlsplit: a port out of range or not a number
                raise SourceInvalid(f"{path}: engines.{i}.url: {exc}") from None
        try:
            specs.append(EngineSpec(**entry))
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err["loc"])
            msg = "unknown setting" if err["type"] == "extra_forbidden" else err["msg"]
            raise SourceInvalid(f"{path}: engines.{i}.{loc}: {msg.removeprefix('Value error, ')}") from None
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        dupe = next(n for n in names if names.count(n) > 1)
        raise SourceInvalid(f"{path}: duplicate engine name {dupe!r}")
    return specs


class FileReader:
    """:func:`read_engines_file` in a daemon thread, its wait bounded by ``timeout_s`` (module text)."""

    def __init__(self, path: str, timeout_s: float) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self._pending: asyncio.Future[list[EngineSpec]] | None = None  # a read still under way

    async def read(self) -> list[EngineSpec]:
        """The file's engines; :class:`SourceUnreadable` when the read has not finished in time."""
        if self._pending is None:
            self._pending = self._start()
        try:
            return await asyncio.wait_for(asyncio.shield(self._pending), self.timeout_s)
        except TimeoutError:
            raise SourceUnreadable(f"reading {self.path} has not finished after {self.timeout_s:g}s "
                                   "(a FIFO, or a hung mount?)") from None
        finally:
            if self._pending is not None and self._pending.done():
                self._pending = None

    def _start(self) -> asyncio.Future[list[EngineSpec]]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[EngineSpec]] = loop.create_future()

        def settle(result: list[EngineSpec] | None, error: BaseException | None) -> None:
            if future.done():
                return
            if error is None:
                future.set_result(result or [])
            else:
                future.set_exception(error)

        def run() -> None:
            try:
                found = read_engines_file(self.path)
            except BaseException as exc:  # noqa: BLE001  (handed to the loop, raised there)
                loop.call_soon_threadsafe(settle, None, exc)
            else:
                loop.call_soon_threadsafe(settle, found, None)

        threading.Thread(target=run, name="narwhal-discovery-file", daemon=True).start()
        future.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: never "never retrieved"
        return future


class DnsReader:
    """Resolves the ``[[discovery.dns]]`` names, each read bounded by ``timeout_s``."""

    def __init__(self, settings: DiscoverySettings, timeout_s: float) -> None:
        address = settings.resolver_address()
        if address is None:
            self._resolver = dns.asyncresolver.Resolver()  # the host's /etc/resolv.conf
        else:
            self._resolver = dns.asyncresolver.Resolver(configure=False)
            self._resolver.nameservers = [address[0]]
            self._resolver.port = address[1]
        self._resolver.lifetime = timeout_s
        self._resolver.timeout = timeout_s

    async def read(self, source: DnsSource) -> list[EngineSpec]:
        """The engines a DNS source names now (A/AAAA, or SRV targets), sorted; :class:`SourceUnreadable` on failure."""
        if source.srv:
            targets = await self._srv(source.name)
        else:
            assert source.port is not None  # DnsSource's validator: a port unless srv
            targets = [(addr, source.port) for addr in await self._addresses(source.name)]
        specs = []
        for addr, port in sorted(set(targets)):
            host = f"[{addr}]" if ipaddress.ip_address(addr).version == 6 else addr
            url = f"{source.scheme}://{host}:{port}"
            specs.append(EngineSpec(name=engine_name(source.role, url), url=url, role=source.role,
                                    max_inflight_prefill=source.max_inflight_prefill,
                                    max_inflight_decode=source.max_inflight_decode))
        return specs

    async def _srv(self, name: str) -> list[tuple[str, int]]:
        records = await self._query(name, "SRV")
        found: list[tuple[str, int]] = []
        for rec in records:
            target = rec.target.to_text()
            for addr in await self._addresses(target):
                found.append((addr, int(rec.port)))
        return found

    async def _addresses(self, name: str) -> list[str]:
        return [r.to_text() for kind in ("A", "AAAA") for r in await self._query(name, kind)]

    async def _query(self, name: str, kind: str) -> list[Any]:
        try:
            answer = await self._resolver.resolve(name, kind, search=False)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return []  # an answer: nothing there (a Service scaled to zero)
        except dns.exception.DNSException as exc:  # timeout, SERVFAIL, no server answering
            raise SourceUnreadable(f"DNS {kind} {name}: {exc.__class__.__name__}: {exc}") from None
        return list(answer)
