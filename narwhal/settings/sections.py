"""The settings' sections beside placement, engines and discovery: ``[server]``, ``[request]``,
``[engine]``, ``[handoff]``, ``[preflight]``, ``[log]``, ``[tracing]``, ``[recovery]``, ``[compat]``.

Each is a :class:`~narwhal.settings.section.Section` (unknown keys forbidden, frozen); a field's
docstring is its line in docs/settings.md (``narwhal.settings.reference`` renders it).
"""

from __future__ import annotations

import os
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from narwhal.settings.section import NonNegativeFloat, PositiveFloat, Section

MAX_WORKERS = 256
"""``server.workers``' limit. The shared layout always has twice as many worker slots
(``narwhal.shm.layout.WORKER_SLOTS``): a reload runs old and new workers side by side, and one
that raises the count (4 → 8: 12 workers at once) must find a slot for every new one."""


class ServerSettings(Section):
    """``[server]``: where and how the workers listen, how many, and their limits (bodies, headers, timeouts)."""
    bind: str = "127.0.0.1:8700"  # no engine's port: vLLM (and Triton, Ray Serve) default to 8000, the demo 8080
    """`HOST:PORT`, `unix:PATH` or `fd://N` (8700: no engine's default port; the image binds `0.0.0.0:8700`)"""
    workers: Annotated[int, Field(ge=1, le=MAX_WORKERS)] = 2
    """gunicorn worker processes"""
    admin_token: str = ""
    """admin API bearer token (empty: admin API off)"""
    api_keys: list[str] = []
    """client keys for `/v1/*` (empty: no client auth)"""
    max_body_bytes: Annotated[int, Field(ge=1024)] = 8 * 1024 * 1024
    """larger bodies get 413"""
    max_header_bytes: Annotated[int, Field(ge=1024)] = 16 * 1024
    """all headers together; larger get 431"""
    body_read_timeout_s: PositiveFloat = 10
    """slower bodies get 408"""
    client_write_timeout_s: PositiveFloat = 30
    """a client that does not read its stream this long is dropped"""
    max_buffered_mib: Annotated[int, Field(ge=1)] = 256
    """what the streams waiting for slow clients may hold together, per worker (each waiting stream counts its client's
    buffer and 256 KiB for the engine side); past it, the next slow client is cut (docs/behaviour.md "Slow clients")"""
    graceful_timeout_s: PositiveFloat = 30
    """gunicorn graceful timeout"""
    keepalive_s: PositiveFloat = 75
    """client keep-alive (above typical LB idle timeouts)"""
    max_engines: Annotated[int, Field(ge=1, le=4096)] = 64
    """room for engines added by a reload (without a discovery source)"""

    @field_validator("bind")
    @classmethod
    def _bind_has_port(cls, value: str) -> str:
        if value.startswith(("unix:", "fd://")):
            return value
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError("expected HOST:PORT (or unix:PATH, fd://N)")
        return value


class RequestSettings(Section):
    """``[request]``: the deadline a client request gets at admission, for all its attempts."""
    deadline_s: PositiveFloat = 600
    """per-request deadline from arrival (a client may ask for less with `x-narwhal-deadline-s`)"""


class EngineSettings(Section):
    """``[engine]``: the legs' timeouts and how the router reaches engines (their key, the CA file)."""
    prefill_timeout_s: PositiveFloat = 30
    """bound on the prefill leg"""
    first_token_timeout_s: PositiveFloat = 30
    """decode start (connect included) to first generated token"""
    decode_read_timeout_s: NonNegativeFloat = 20
    """silence allowed between chunks after the first token; 0 = deadline only"""
    api_key: str = ""
    """sent to engines as `Authorization: Bearer`"""
    ca_file: str = ""
    """CA bundle for `https://` engines (only it is trusted), on every engine connection: both legs, releases,
    discovery, preflight, health checks, probes"""

    @field_validator("ca_file")
    @classmethod
    def _ca_file_exists(cls, value: str) -> str:
        if value and not os.path.isfile(value):
            raise ValueError(f"file not found: {value}")
        return value


class HandoffSettings(Section):
    """``[handoff]``: how old a prefill's KV handoff may be when its decode or release is sent.

    ``lease_s`` states the producers' KV lease (vLLM's ``kv_lease_duration``, default 30 s):
    past it vLLM frees a finished prefill's blocks, and a late reader takes whatever they hold
    by then (docs/decisions.md "vLLM releases"). So ``max_age_s`` must stay below it; the margin is the time a decode or
    release needs to reach the consumer."""
    max_age_s: PositiveFloat = 20
    """older handoffs are neither decoded (504 `handoff_expired`) nor released; must be below `handoff.lease_s`"""
    lease_s: PositiveFloat = 30
    """the producers' `kv_lease_duration` (vLLM 0.33/0.34); for 0.20/0.21 engines, whose unread blocks wait
    `VLLM_NIXL_ABORT_REQUEST_TIMEOUT` (480 s), or 0.11 (120 s), set it to that"""

    @model_validator(mode="after")
    def _below_the_lease(self) -> HandoffSettings:
        if self.max_age_s >= self.lease_s:
            raise ValueError(
                f"handoff.max_age_s ({self.max_age_s:g}) must be below handoff.lease_s ({self.lease_s:g}): "
                "a handoff decoded or released after the producers' KV lease reads blocks that may "
                "already hold another request's KV")
        return self


class PreflightSettings(Section):
    """``[preflight]``: whether the master runs preflight at start (failed engines start ejected)."""
    on_start: bool = True
    """run preflight at start: failing engines start ejected"""


class LogSettings(Section):
    """``[log]``: level, JSON or text lines, and the access log's target (``-``: stderr, empty: none)."""
    level: Literal["debug", "info", "warning", "error", "critical"] = "info"
    """the level of the router's own log lines"""
    format: Literal["json", "text"] = "json"
    """the form of the router's own log lines: `json` (one object a line) or `text`"""
    access_log: str = "-"
    """one JSON line per request: `-` stderr, a path, or `""` for none"""


class TracingSettings(Section):
    """OpenTelemetry spans over OTLP/HTTP (README "Tracing"); needs the ``tracing`` extra.

    A value left unset (None) is the standard ``OTEL_*`` variable's, else the default
    (``narwhal.request.tracing`` resolves them, in the worker): set here, Narwhal's value wins."""

    enabled: bool = False
    """OpenTelemetry spans (docs/operations.md "Tracing"); needs the `tracing` extra"""
    endpoint: Annotated[str, Field(pattern=r"^https?://[^\s/]+(/\S*)?$")] | None = None
    """the OTLP/HTTP traces URL, used as given (`http://` or `https://`); unset: `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`,
    else `OTEL_EXPORTER_OTLP_ENDPOINT` + `/v1/traces`, else `http://127.0.0.1:4318/v1/traces`"""
    service_name: Annotated[str, Field(min_length=1)] | None = None
    """the resource's `service.name`; unset: `OTEL_SERVICE_NAME` (or `service.name` in `OTEL_RESOURCE_ATTRIBUTES`), else
    `narwhal`"""
    sample_ratio: Annotated[float, Field(ge=0, le=1)] | None = None
    """share of new traces kept (a client's sampled flag wins); unset: the sampler `OTEL_TRACES_SAMPLER` (`_ARG`) names,
    else parent-based at `OTEL_TRACES_SAMPLER_ARG` or 1.0"""

    @model_validator(mode="after")
    def _extra_installed(self) -> TracingSettings:
        if self.enabled and not _tracing_installed():
            raise ValueError("enabled = true needs the tracing extra: install Narwhal with [tracing], e.g. pip install "
                             "'.[tracing]' in a clone (opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http)")
        return self


def _tracing_installed() -> bool:
    import importlib.util

    try:
        return all(importlib.util.find_spec(name) is not None for name in (
            "opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter"))
    except ModuleNotFoundError:  # a parent package is missing
        return False


class RecoverySettings(Section):
    """``[recovery]``: breakers, quarantine, retries and their budget, readmission, waves
    (docs/behaviour.md "Recovery").
    """
    eject_after: Annotated[int, Field(ge=1)] = 3
    """consecutive failures that eject an engine"""
    failure_quarantine_s: NonNegativeFloat = 0
    """seconds placement steers around an engine that just failed, while others can serve (0: off)"""
    max_retries: Annotated[int, Field(ge=0, le=10)] = 0
    """extra attempts before visible output"""
    # Continuations of a stream cut after visible output (docs/behaviour.md "Migration"); 0: none.
    max_migrations: Annotated[int, Field(ge=0, le=10)] = 1
    """continuations of a stream cut after visible output, on another pair (docs/behaviour.md "Migration"); 0: the
    terminal event"""
    migration_budget_ratio: Annotated[float, Field(ge=0, le=1)] = 0.5
    """share of in-flight requests that may be migrated streams at once, fleet-wide: the bound of a
    storm of cuts (docs/decisions.md "Migration"); migrations never take the retry budget"""
    migration_budget_min: Annotated[int, Field(ge=0)] = 32
    """migrated streams always allowed at once, whatever the share (the bound's floor)"""
    retry_budget_ratio: Annotated[float, Field(ge=0, le=1)] = 0.2
    """share of in-flight requests that may be retries, fleet-wide"""
    retry_budget_min: Annotated[int, Field(ge=0)] = 3
    """retries always allowed in flight, whatever the share (the budget's floor)"""
    readmit_interval_s: PositiveFloat = 5
    """probe cadence after an ejection, doubling per ejection up to `readmit_interval_max_s`"""
    readmit_interval_max_s: PositiveFloat = 60
    """the longest probe cadence after repeated ejections"""
    health_interval_s: PositiveFloat = 5
    """health checks of admitted engines"""
    max_ejected_fraction: Annotated[float, Field(ge=0, le=1)] = 1.0
    """share of a role that may be ejected; beyond it engines stay `degraded`"""
    whole_wave_restart: bool = True
    """readmit a fully ejected wave together"""
    wave_hold_s: NonNegativeFloat = 120
    """how long a fully ejected wave waits for all its engines; after it, whoever passed is readmitted"""
    readmission: Literal["auto", "probe", "health"] = "auto"
    """`auto` (probe with a contract, health without), `probe`, `health`"""


class CompatSettings(Section):
    """``[compat]``: which engines may pair across vLLM releases."""
    # False pairs engines of different vLLM versions: for fleets that run vLLM's own
    # ``kv_connector_extra_config.enforce_handshake_compat: false`` (a rolling upgrade across
    # releases whose KV layout did not change). Transfer modes must still agree.
    enforce_versions: bool = True
    """pair only engines of one vLLM version; false for fleets that run vLLM's
    `kv_connector_extra_config.enforce_handshake_compat: false` (transfer modes must still agree)"""
