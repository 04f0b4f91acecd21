"""``Settings``: every section, validated as a whole and frozen (a ``NARWHAL_`` variable wins over the TOML file).

Rules that span sections live here: engine names unique, at most the layout's engine slots,
``kv_peers`` naming known producers.
"""

from __future__ import annotations

from pydantic import model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from narwhal.settings.discovery import DiscoverySettings
from narwhal.settings.engines import EngineContract, EngineSpec
from narwhal.settings.env import ENV_PREFIX
from narwhal.settings.placement import PlacementSettings
from narwhal.settings.sections import (
    CompatSettings,
    EngineSettings,
    HandoffSettings,
    LogSettings,
    PreflightSettings,
    RecoverySettings,
    RequestSettings,
    ServerSettings,
    TracingSettings,
)


class Settings(BaseSettings):
    """Every section, validated as a whole and frozen; a ``NARWHAL_`` variable wins over the TOML file."""
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid", frozen=True,
                                      use_attribute_docstrings=True)

    server: ServerSettings = ServerSettings()
    request: RequestSettings = RequestSettings()
    engine: EngineSettings = EngineSettings()
    handoff: HandoffSettings = HandoffSettings()
    placement: PlacementSettings = PlacementSettings()
    preflight: PreflightSettings = PreflightSettings()
    log: LogSettings = LogSettings()
    recovery: RecoverySettings = RecoverySettings()
    tracing: TracingSettings = TracingSettings()
    discovery: DiscoverySettings = DiscoverySettings()
    compat: CompatSettings = CompatSettings()
    engine_contract: EngineContract | None = None
    """`model`, `engine_version` (a PEP 440 version `V`, which means `==V`, or a specifier set;
    anything else stops the start; see below), `kv_connector`"""
    engines: list[EngineSpec] = []
    """`name`, `url`, `role` (`producer`/`consumer`/`both`), optional `wave`, `max_inflight_prefill`,
    `max_inflight_decode`, `kv_connector`, `kv_peers`, `models`, `transfer_mode`; bounded so every entry fits the
    shared tables: `name` and each of `kv_peers` 64 characters (letters, digits, `_.-`), `url` 1,024, `wave` 64,
    `kv_connector` 128, at most 64 `kv_peers` and 32 `models` of 100 characters each"""

    @model_validator(mode="after")
    def _fleet_is_consistent(self) -> Settings:
        names = [e.name for e in self.engines]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"engines: duplicate engine name {dupes[0]!r}")
        if len(self.engines) > self.engine_slots:
            raise ValueError(f"engines: {len(self.engines)} engines exceed {self.discovery.slots_key}")
        for i, spec in enumerate(self.engines):
            for peer in spec.kv_peers or ():
                if peer not in names:
                    raise ValueError(f"engines.{i}.kv_peers: unknown engine {peer!r}")
            if spec.kv_peers is not None and not spec.can_prefill:
                raise ValueError(f"engines.{i}.kv_peers: only producers hand off")
        return self

    @property
    def engine_slots(self) -> int:
        """The shared layout's engine slots (``discovery.max_engines`` once a source is set)."""
        return self.discovery.slots(self.server.max_engines)

    def connector_of(self, spec: EngineSpec) -> str:
        """The engine's KV connector: its own, else the contract's, else NixlConnector (a pair needs one)."""
        if spec.kv_connector:
            return spec.kv_connector
        if self.engine_contract is not None:
            return self.engine_contract.kv_connector
        return "NixlConnector"

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """pydantic-settings' hook: the environment first (it wins), then the TOML document as init kwargs."""
        return (env_settings, init_settings)
