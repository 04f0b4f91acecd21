"""How Narwhal reaches an engine: TLS, the engine key, and the control-plane reads.

Invariant: every connection to an engine — both legs and releases (``client`` over
``http1``), preflight, and the supervisor's health checks, lifecycle validation, probes,
load reads and model discovery — verifies the engine with the context :func:`ssl_context`
builds from ``engine.ca_file``, sends the ``Authorization`` of :func:`auth_headers`, and
every ``/v1/models`` and ``/version`` answer is read by :func:`parse_models` and
:func:`parse_version`. docs/behaviour.md "The request path" asks for the CA "on every connection to an engine".

Why one module: each caller used to build its own context and header. The supervisor's
session forgot the CA, so an ``https://`` fleet behind a private CA was ejected by its own
health checks while the request path served it fine. A fix made to one copy is
not a fix; a caller that does not come through here has no TLS and no key, which shows.

The control reads (``GET /health``, ``/version``, ``/v1/models``, and whether
``/inference/v1/generate`` answers 403: one ``POST`` of an empty object) go through
:class:`ControlClient`: one timeout bounds the whole exchange (connect, handshake, headers,
body), so a hung engine costs one check, never a loop; every transport failure, a
certificate the CA did not sign included, is one :class:`ControlError` with a short reason
for reports. The version pin (:class:`VersionPin`) lives here too: it is how a ``/version``
answer is judged. Deliberately not here: the hot path's wire and its error mapping.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any, Protocol

import aiohttp
import orjson
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from narwhal.engines.http1 import Connection, UpstreamError, UpstreamPool
from narwhal.settings import EngineSettings
from narwhal.settings.engines import EngineContract, parse_version_pin

__all__ = [
    "ControlClient",
    "ControlError",
    "PooledReader",
    "EngineRef",
    "VersionPin",
    "auth_headers",
    "auth_line",
    "open_session",
    "parse_models",
    "parse_version",
    "ssl_context",
]


class EngineRef(Protocol):
    """Anything with a ``name`` and a base ``url`` (a fleet Engine, an EngineSpec …)."""

    name: str
    url: str


# ---------------------------------------------------------------------- TLS and the key


def ssl_context(ca_file: str = "") -> ssl.SSLContext:
    """The context that verifies ``https://`` engines.

    With ``ca_file`` only that bundle is trusted (a private CA, as docs/settings.md means it), else the
    system store. Hostname checks stay on either way: a CA-signed certificate for another
    host is refused too. A new context per call: a reload may point at a new bundle.
    """
    return ssl.create_default_context(cafile=ca_file or None)


def auth_headers(settings: EngineSettings) -> dict[str, str]:
    """``Authorization: Bearer <engine.api_key>`` when a key is set (docs/behaviour.md "The request path"), else
    nothing.

    The client's own Authorization never gets here: engines see only the engine key.
    """
    return {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}


def auth_line(settings: EngineSettings) -> bytes:
    """The same header as a raw HTTP/1.1 line, for the hand-written data-plane client."""
    return b"".join(f"{name}: {value}\r\n".encode() for name, value in auth_headers(settings).items())


def open_session(settings: EngineSettings) -> aiohttp.ClientSession:
    """An aiohttp session for control reads, verifying engines with :func:`ssl_context`.

    No connection cap (a 64-engine fleet is health-checked at once), no cookies and no
    decompression (engines set none and compress nothing). No session-wide timeout: each
    read carries its own bound (:class:`ControlClient`). Call inside a running loop.
    """
    connector = aiohttp.TCPConnector(limit=0, ssl=ssl_context(settings.ca_file), keepalive_timeout=60)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None),
        cookie_jar=aiohttp.DummyCookieJar(),
        auto_decompress=False,
    )


# ---------------------------------------------------------------------- reading answers


def _json_object(body: bytes) -> dict[str, Any] | None:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def parse_models(body: bytes) -> list[str] | None:
    """The model ids of an OpenAI model list (``{"data": [{"id": ...}, ...]}``).

    None when the body is not such a list (not JSON, no ``data`` list): the engine said
    nothing about its models, which differs from saying "none". Entries without a string
    ``id`` are skipped; ids keep the engine's order, each once.
    """
    obj = _json_object(body)
    listing = obj.get("data") if obj is not None else None
    if not isinstance(listing, list):
        return None
    ids = [m["id"] for m in listing if isinstance(m, dict) and isinstance(m.get("id"), str)]
    return list(dict.fromkeys(ids))


def parse_model_card(body: bytes) -> tuple[int | None, str | None]:
    """(``max_model_len``, ``root``) of the first model of an OpenAI model list, each None when
    absent or not of its type (a positive integer, a string): whatever the engine sends."""
    obj = _json_object(body)
    listing = obj.get("data") if obj is not None else None
    first = listing[0] if isinstance(listing, list) and listing and isinstance(listing[0], dict) else {}
    context, root = first.get("max_model_len"), first.get("root")
    return (context if type(context) is int and context > 0 else None,
            root if isinstance(root, str) else None)


def parse_version(body: bytes) -> str | None:
    """vLLM's ``/version`` answer, ``{"version": "0.11.0"}``; None for anything else."""
    obj = _json_object(body)
    version = obj.get("version") if obj is not None else None
    return version if isinstance(version, str) else None


class VersionPin:
    """``engine_contract.engine_version`` (docs/behaviour.md "Recovery"): a PEP 440 version or specifier set.

    Settings already refused anything else, so building one never fails. A version pin ``V``
    is the specifier ``==V`` (:func:`narwhal.settings.engines.parse_version_pin`): ``0.11`` equals
    ``0.11.0``, and the engine's local label (``+cu126``, as CUDA builds of vLLM carry) counts
    only when the pin names one. Pre-release and dev builds are admitted
    (``0.11.1.dev3+gabc``): operators run those on purpose.
    """

    __slots__ = ("text", "_pin")

    def __init__(self, text: str) -> None:
        self.text = text.strip()
        self._pin: SpecifierSet = parse_version_pin(self.text)

    @classmethod
    def of(cls, contract: EngineContract | None) -> VersionPin | None:
        """The contract's pin, or None when there is no contract or no pin in it."""
        if contract is None or not contract.engine_version.strip():
            return None
        return cls(contract.engine_version)

    def matches(self, version: str) -> bool:
        """Does ``version`` meet the pin? An unparsable version never does."""
        try:
            found = Version(version)
        except InvalidVersion:
            return False  # an engine that cannot name its version meets no pin
        return self._pin.contains(found, prereleases=True)


# ---------------------------------------------------------------------- the client


# a ControlError's reason when no connection was made (docs/behaviour.md "Recovery"'s unreachable)
UNREACHABLE = "unreachable"


GENERATE_PATH = "/inference/v1/generate"
# docs/decisions.md "vLLM releases": what preflight and /admin/engines say of an engine that answers 403 there.
SCALE_OUT_REFUSAL = "answers 403 on /inference/v1/generate: vLLM runs without --enable-scale-out"


class ControlError(Exception):
    """A control read got no HTTP answer; ``reason`` says why in a few words."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ControlClient:
    """``GET /health``, ``/version`` and ``/v1/models`` of engines, TLS and key included, and
    whether ``/inference/v1/generate`` is served.

    ``get`` returns ``(status, body)`` or raises :class:`ControlError` (unreachable,
    refused certificate, timed out); the typed reads fold every failure into a falsy
    answer, for callers that only need the verdict.
    """

    __slots__ = ("session", "timeout_s", "_headers")

    def __init__(self, session: aiohttp.ClientSession, settings: EngineSettings, timeout_s: float) -> None:
        self.session = session
        self.timeout_s = timeout_s
        self._headers = auth_headers(settings)

    async def get(self, engine: EngineRef, path: str) -> tuple[int, bytes]:
        """``(status, body)`` of ``GET path`` within the bound; :class:`ControlError` when there is no answer."""
        return await self._exchange("GET", engine.url + path, None, self._headers)

    async def post(self, engine: EngineRef, path: str, body: bytes) -> tuple[int, bytes]:
        """``(status, body)`` of ``POST path`` with a JSON ``body``, as :meth:`get` answers."""
        headers = {**self._headers, "Content-Type": "application/json"}
        return await self._exchange("POST", engine.url + path, body, headers)

    async def _exchange(self, method: str, url: str, body: bytes | None, headers: dict[str, str]) -> tuple[int, bytes]:
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self.session.request(method, url, data=body, headers=headers) as resp:
                    return resp.status, await resp.read()
        except TimeoutError:
            raise ControlError(f"timed out after {self.timeout_s:g}s") from None
        except (aiohttp.ClientError, OSError):  # a refused certificate is a ClientError too
            raise ControlError(UNREACHABLE) from None

    async def generate_refused(self, engine: EngineRef) -> bool | None:
        """Whether ``engine`` refuses ``/inference/v1/generate`` with 403, as vLLM 0.33 does without
        ``--enable-scale-out`` (``entrypoints/scale_out/factories.py``: the stand-in route takes no
        body and always answers 403). Asked with an empty object, which a serving engine refuses
        as invalid (400/422) before any generation, so the question costs no inference. None: no
        answer (unreachable, timed out)."""
        try:
            status, _ = await self.post(engine, GENERATE_PATH, b"{}")
        except ControlError:
            return None
        return status == 403

    async def _answer(self, engine: EngineRef, path: str) -> bytes | None:
        try:
            status, body = await self.get(engine, path)
        except ControlError:
            return None
        return body if status == 200 else None

    async def health(self, engine: EngineRef) -> bool:
        """200 within the bound; a 503 is vLLM's dead-engine answer."""
        return await self._answer(engine, "/health") is not None

    async def version(self, engine: EngineRef) -> str | None:
        """The engine's ``/version``, None on any failure."""
        body = await self._answer(engine, "/version")
        return None if body is None else parse_version(body)

    async def models(self, engine: EngineRef) -> list[str] | None:
        """The model ids of the engine's ``/v1/models``, None on any failure."""
        body = await self._answer(engine, "/v1/models")
        return None if body is None else parse_models(body)


class PooledReader:
    """``get`` as :class:`ControlClient` answers it, over the data plane's pooled HTTP/1.1 client.

    For the one control read made many times a second: the supervisor's ``/metrics`` of every
    engine each ``placement.load_interval_s`` (docs/behaviour.md "Placement"). Through this a read
    costs about half the CPU it did through aiohttp's client (perf/RESULTS.md "Figures behind the
    code's choices"): at 10 Hz per engine that is the supervisor's largest steady cost. The same
    TLS context, the same key, the same whole-exchange bound and the same :class:`ControlError`.
    """

    __slots__ = ("pool", "timeout_s", "_auth")

    def __init__(self, settings: EngineSettings, timeout_s: float) -> None:
        self.pool = UpstreamPool(ssl_context(settings.ca_file))
        self.timeout_s = timeout_s
        self._auth = auth_line(settings)

    async def get(self, engine: EngineRef, path: str) -> tuple[int, bytes]:
        """``(status, body)`` within the bound, the connection pooled only after a whole answer."""
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        conn: Connection | None = None
        try:
            conn = await self.pool.get(engine.url, path, self._auth, deadline=deadline)
            status = await conn.response()
            body = await conn.read_all()
        except BaseException as exc:  # cancelled too: nothing may be read behind this answer
            if conn is not None:
                conn.close()
            if isinstance(exc, TimeoutError):
                raise ControlError(f"timed out after {self.timeout_s:g}s") from None
            if isinstance(exc, UpstreamError | OSError):
                raise ControlError(UNREACHABLE) from None
            raise
        conn.release()
        return status, body

    async def close(self) -> None:
        """Close the reader's pool."""
        await self.pool.close()
