"""The engines in the settings: an ``[[engines]]`` entry and the optional ``[engine_contract]``.

An entry is the one place an engine's role is read (:attr:`EngineSpec.can_prefill`,
:attr:`EngineSpec.can_decode`); the contract's version pin is parsed when the settings load, so
a pin nothing can meet stops the start instead of failing every probe later (docs/behaviour.md "Recovery"). The
fleet-wide rules over entries (unique names and URLs, permitted pairs) are
``narwhal.settings.Settings``'s, which sees them all.
"""

from __future__ import annotations

from typing import Annotated, Literal

import yarl
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version
from pydantic import Field, field_validator

from narwhal.settings.section import Section


class EngineContract(Section):
    """``[engine_contract]``, optional: the model, version pin and connector every engine must meet
    (docs/behaviour.md "Recovery").
    """
    model: str = ""
    engine_version: str = ""  # a PEP 440 version ("0.11.0") or specifier set (">=0.10,<0.12")
    kv_connector: str = "NixlConnector"

    @field_validator("engine_version")
    @classmethod
    def _pin_parses(cls, value: str) -> str:
        # Checked here, not when the first probe runs: a pin nothing can meet would pass the
        # start and then fail every probe and preflight forever.
        if value.strip():
            parse_version_pin(value)
        return value


def parse_version_pin(text: str) -> SpecifierSet:
    """``engine_contract.engine_version`` parsed (docs/behaviour.md "Recovery") as a PEP 440 specifier set; ValueError
    names what is wrong.

    A pin that starts with an operator or holds a comma is a specifier set, anything else a
    single version: so ``>=zero`` is reported as a bad specifier, not as a bad version. A
    version ``V`` means ``==V``, PEP 440's own equality, in which a pin without a local label
    ignores the engine's (``0.11.0`` is met by the CUDA build ``0.11.0+cu126``) and a pin with
    one (``0.11.0+cu126``) is met by that build alone. ``packaging`` decides, not rules of ours.
    """
    text = text.strip()
    if text[:1] in ("<", ">", "=", "!", "~") or "," in text:
        try:
            return SpecifierSet(text)
        except InvalidSpecifier:
            raise ValueError(f"invalid PEP 440 specifier {text!r}") from None
    try:
        return SpecifierSet(f"=={Version(text)}")
    except InvalidVersion:
        raise ValueError(f"invalid PEP 440 version {text!r} (expected a version such as 0.11.0 "
                         "or a specifier set such as >=0.11,<0.12)") from None


Role = Literal["producer", "consumer", "both"]

# The longest an entry's fields may be, in characters (docs/behaviour.md: any entry the settings accept
# fits the shared tables; shm.descriptors sizes its slots from these, and a test builds the
# largest entry they allow and writes it).
NAME_PATTERN = r"^[A-Za-z0-9_.\-]+$"  # an engine's name, and each of kv_peers (engine names)
MAX_NAME = 64
MAX_URL = 1024
MAX_WAVE = 64
MAX_CONNECTOR = 128
MAX_PEERS = 64
MAX_MODELS = 32
MAX_MODEL = 100


class EngineSpec(Section):
    """One ``[[engines]]`` entry; the one place an engine's role is read (:attr:`can_prefill`, :attr:`can_decode`)."""
    name: Annotated[str, Field(min_length=1, max_length=MAX_NAME, pattern=NAME_PATTERN)]
    url: Annotated[str, Field(max_length=MAX_URL)]
    role: Role
    wave: Annotated[str, Field(max_length=MAX_WAVE)] | None = None
    max_inflight_prefill: Annotated[int, Field(ge=1)] | None = None
    max_inflight_decode: Annotated[int, Field(ge=1)] | None = None
    kv_connector: Annotated[str, Field(max_length=MAX_CONNECTOR)] | None = None
    # Bounded so that every entry these accept fits its shared-memory descriptor (shm.descriptors,
    # sized from these bounds): 64 peers, 32 model names of 100 characters.
    kv_peers: Annotated[list[Annotated[str, Field(max_length=MAX_NAME, pattern=NAME_PATTERN)]],
                        Field(max_length=MAX_PEERS)] | None = None
    models: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_MODEL)]],
                      Field(max_length=MAX_MODELS)] | None = None
    transfer_mode: Literal["pull", "push"] = "pull"  # NIXL's; a pair needs the same (docs/decisions.md "vLLM releases")

    @field_validator("url", "wave", "kv_connector", "kv_peers", "models")
    @classmethod
    def _plain_text(cls, value: str | list[str] | None) -> str | list[str] | None:
        # Every string of an entry ends up in shared memory as UTF-8 JSON, in log lines and in
        # metric labels: a lone surrogate (valid in a JSON escape, not encodable) or a control
        # character is refused here, where the error names the key, not later in a writer.
        for text in [value] if isinstance(value, str) else value or []:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("expected text (a lone surrogate escape is not)") from None
            if any(ch < " " or ch == "\x7f" for ch in text):
                raise ValueError("expected text without control characters (NUL, newlines, escapes)")
        return value

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        # Checked as every later reader parses it (yarl, the connection pool, the load reader): a
        # URL that passed here and failed there kept a discovered engine probing forever, and an
        # admitted one logged a traceback per load read.
        if not value.startswith(("http://", "https://")) or len(value.split("://", 1)[1]) == 0:
            raise ValueError("expected an http:// or https:// URL")
        try:
            url = yarl.URL(value)
            port = url.port
        except ValueError as exc:
            raise ValueError(f"expected an http:// or https:// URL with a host and a port 1-65535 ({exc})") from None
        if not url.host or port is None or not 1 <= port <= 65535:
            raise ValueError("expected an http:// or https:// URL with a host and a port 1-65535")
        if url.user is not None or url.query_string or url.fragment:
            raise ValueError("expected an http:// or https:// URL without credentials, query or fragment")
        return value.rstrip("/")

    @property
    def can_prefill(self) -> bool:
        """A producer or ``both``: may take prefills."""
        return self.role in ("producer", "both")

    @property
    def can_decode(self) -> bool:
        """A consumer or ``both``: may take decodes."""
        return self.role in ("consumer", "both")
