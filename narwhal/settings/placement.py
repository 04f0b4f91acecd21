"""``[placement]`` and the ``held`` policy's own table, ``[placement.held]`` (docs/behaviour.md "Placement").

A policy's own settings are a table of their own under ``[placement]``, read by that policy
alone (``fleet.placement.held`` takes ``settings.held``; the supervisor's holdings model its
``block_chars``): a reader of ``[placement]`` sees what every policy shares, and a policy's knobs
sit together. The table's model lives here, with the others, so that a bad value stops the start
with one line naming ``placement.held.<key>`` and ``docs/settings.md`` is rendered from it like
every section. The keys it took from ``[placement]`` (``block_chars``, ``max_prefix_chars``,
``holdings_slots``, ``affinity_slack``) are still read there, said once at start.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator

from narwhal.settings.section import NonNegativeFloat, PositiveFloat, Section

HELD_KEYS = frozenset({"block_chars", "max_prefix_chars", "holdings_slots", "affinity_slack"})
_MOVED_SAID: list[bool] = []


class HeldSettings(Section):
    """``[placement.held]``: the ``held`` policy's own settings (docs/behaviour.md "Placement")."""

    block_chars: Annotated[int, Field(ge=16, le=1 << 16)] = 256
    """prefix block size for holdings' block keys (16–65536)"""
    max_prefix_chars: Annotated[int, Field(ge=16, le=1 << 24)] = 65536
    """the prompt text beyond this is not keyed (≥ `block_chars`)"""
    holdings_slots: Annotated[int, Field(ge=1, le=1 << 24)] = 65536
    """shared-memory entries for the configured producers' holdings together (each producer added later by discovery or
    a reload gets a section as large)"""
    affinity_slack: Annotated[float, Field(ge=0, le=10)] = 0.1
    """candidates within this fraction of the best estimated time to handoff are ordered by rendezvous rank"""

    @model_validator(mode="after")
    def _prefix_fits(self) -> HeldSettings:
        if self.max_prefix_chars < self.block_chars:
            raise ValueError("max_prefix_chars must be at least block_chars")
        return self


_DEPRECATION_SAID: list[bool] = []


class PlacementSettings(Section):
    """``[placement]``: the wait for a slot, engine load readings, affinity, the producer policy
    (docs/behaviour.md "Placement").
    """
    # Keys now in [placement.held]: a TOML file's are taken there (below), a variable is refused
    # with the one to set (settings.env).
    MOVED: ClassVar[dict[str, str]] = {key: f"held.{key}" for key in HELD_KEYS}
    queue_timeout_s: NonNegativeFloat = 5
    """wait for a free pair before 503"""
    max_queue: Annotated[int, Field(ge=0)] = 1024
    """requests waiting per worker before an immediate 503"""
    retry_after_s: Annotated[int, Field(ge=0)] = 1
    """`Retry-After` on 503"""
    # docs/behaviour.md "Placement": engine-reported load, prefix affinity, local decode.
    load_interval_s: NonNegativeFloat = 0.1  # 0: engines' /metrics are never read
    """engines' `/metrics` read this often by the supervisor (0: never)"""
    load_stale_s: PositiveFloat = 2
    """older readings are not used (at least `load_interval_s`)"""
    kv_saturated: Annotated[float, Field(gt=0, le=1)] = 0.95
    """KV usage at which an engine is chosen only if every candidate is (0–1]"""
    prefix_affinity: bool = True  # deprecated: ``policy`` says it (false: "least_loaded"); one warning
    """deprecated (one warning at start): `policy` chooses the rule; `false` still means `policy = "least_loaded"`"""
    affinity_chars: Annotated[int, Field(ge=1, le=1 << 20)] = 1024
    """how much of the prompt text forms the key"""
    affinity_min_chars: Annotated[int, Field(ge=0)] = 64
    """shorter prompts have no key (at most `affinity_chars`)"""
    affinity_load_factor: Annotated[float, Field(ge=1)] = 1.25
    """a prefix's producer is passed over above this × mean prefill load + 1 (≥ 1)"""
    local_prefill_chars: Annotated[int, Field(ge=0)] = 0  # 0: never skip the remote prefill
    """prompts shorter than this skip the remote prefill (0: never)"""
    # docs/behaviour.md "Placement": placement that knows what each producer holds.
    policy: Literal["held", "affinity", "least_loaded"] = "held"
    """the producer rule: `held` (what each producer holds, the least estimated time to handoff), `affinity`
    (bounded-load rendezvous), `least_loaded` (prefixes ignored; also what `prefix_affinity = false` means)"""
    held: HeldSettings = HeldSettings()
    """`[placement.held]`: the `held` policy's own settings (below)"""
    kv_events: bool = True
    """follow each engine's KV-cache events (its `/kv_event_sources`; vLLM 0.31+ with `--kv-events-config`): a
    restarted engine, one that cleared its cache or whose stream has a gap its replay cannot fill has its holdings
    dropped at once, and a prompt is placed by the blocks each producer's events say it holds (false: learned from
    traffic alone)"""
    skip_prefill_share: Annotated[float, Field(ge=0, le=1)] = 0.9
    """a prompt whose leading blocks a consumer's KV-cache events say it holds, to this share of the prompt's blocks
    or more, is decoded on that consumer alone, its prefill skipped (a follow-up turn; `0`: never)"""
    tokenize_timeout_s: Annotated[float, Field(gt=0, le=60)] = 1.0
    """with `kv_events`, the prompt's token ids are asked of a producer's `/tokenize` before placement; past this
    bound (or on any error) the request is placed by learned holdings"""

    @model_validator(mode="before")
    @classmethod
    def _held_keys_moved(cls, data: Any) -> Any:
        """``[placement]``'s held keys of before (``block_chars`` …) are ``[placement.held]``'s:
        taken there, said once; set in both places, refused."""
        if not isinstance(data, dict) or not HELD_KEYS & data.keys():
            return data
        data, held = dict(data), data.get("held")
        held = dict(held) if isinstance(held, dict) else {}
        moved = sorted(HELD_KEYS & data.keys())
        for key in moved:
            if key in held:
                raise ValueError(f"{key} is set both in [placement] and in [placement.held]: keep the second")
            held[key] = data.pop(key)
        data["held"] = held
        if not _MOVED_SAID:
            _MOVED_SAID.append(True)  # once per process, whatever reads the settings again
            logging.getLogger("narwhal.settings").warning(
                "placement.%s moved to [placement.held]: read from there", ", placement.".join(moved))
        return data

    @model_validator(mode="after")
    def _affinity_fits(self) -> PlacementSettings:
        if self.affinity_min_chars > self.affinity_chars:
            raise ValueError("affinity_min_chars must not exceed affinity_chars")
        if 0 < self.load_stale_s < self.load_interval_s:
            raise ValueError("load_stale_s must be at least load_interval_s")
        if "prefix_affinity" in self.model_fields_set and not _DEPRECATION_SAID:
            _DEPRECATION_SAID.append(True)  # once per process, whatever reads the settings again
            logging.getLogger("narwhal.settings").warning(
                "placement.prefix_affinity is deprecated: placement.policy chooses the producer rule (%s)",
                "it stands as set" if self.prefix_affinity else 'false means policy = "least_loaded"')
        return self

    @property
    def placement_policy(self) -> str:
        """The producer rule in force: ``policy``, except that ``prefix_affinity = false`` means
        ``least_loaded`` whatever ``policy`` says (docs/behaviour.md "Placement")."""
        return self.policy if self.prefix_affinity else "least_loaded"
