"""What differs between the vLLM releases the fake imitates (docs/decisions.md "vLLM releases", vLLM 0.33's sources).

One profile per imitated release, chosen by ``--vllm-version`` (default ``0.33.0``). Every shape
here comes from the release's own sources, never from what the router accepts:

=====================  ===========================================  ==================================
behaviour              0.11 (``nixl_connector.py``)                 0.33 (``nixl/``)
=====================  ===========================================  ==================================
descriptor keys        seven: no ``remote_request_id`` …            fourteen, and the scheduler's
                                                                    ``remote_prefill_cached_tokens``
``remote_block_ids``   a flat list                                  one list per KV cache group
a refused decode       nothing tells the producer: blocks wait      ``_with_kv_transfer_rejection_
                       for its timeout                              cleanup`` frees them (from 0.21.0)
heterogeneous TP       refused unless D's TP is a multiple of P's   accepted
``/inference/v1/       served                                       403 without ``--enable-scale-out``
generate``
``cache_config_info``  0.11's CacheConfig fields, in their order    0.33's, in theirs (four more
                                                                    labels ending in ``block_size``)
stream chunks          completions dumped whole (``"usage":null``)  only the keys set: every chunk
                                                                    ``"kv_transfer_params":null``, the
                                                                    last choice ``weight_versions``
=====================  ===========================================  ==================================

A real 0.32 engine (the real tier, ``tests/real_vllm``) showed what 0.33 added: the
descriptor's ``remote_registration_generation`` and the chunks' ``weight_versions`` and
``kv_transfer_params`` come from 0.33.0 on (:attr:`Release.since_033`).

Releases in between take the nearest rule the sources above date: the refusal cleanup is in
every release from 0.21.0 on (vllm PR #41269; 0.20.2 lacks it, 0.21.0 has it, read from the
wheels), the rest follows 0.33 from 0.12 on. The compatibility hash (``nixl/metadata.py``)
includes the exact version string and the transfer mode in every release: a decode across
either fails its handshake (:func:`compatible`).
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

DEFAULT_VERSION = "0.33.0"
FIRST_REJECTION_CLEANUP = Version("0.21.0")
_CURRENT = Version("0.12.0")
_FIRST_033 = Version("0.33.0")
_FIRST_020, _FIRST_022 = Version("0.20.0"), Version("0.22.0")
_ALL_KINDS = frozenset({"completions", "chat", "responses", "messages", "generate"})
_KINDS_0_11 = frozenset({"completions", "chat", "responses"})  # what a real 0.32 engine showed it lacks (the real tier)


@dataclass(frozen=True)
class Release:
    """The behaviours of one imitated vLLM release (the module's table)."""

    version: str
    current: bool  # 0.12 and later: the 0.33 column, but for the refusal cleanup
    frees_refused: bool  # a decode refused by the serving layer frees the producer's blocks
    # 0.33 on: the descriptor's ``remote_registration_generation``, the chunks'
    # ``weight_versions`` and ``kv_transfer_params``. A real 0.32 engine sends none of them.
    since_033: bool = True
    # 0.20 and 0.21 (``nixl/scheduler.py``): nine descriptor keys (none of ``dcp_size``,
    # ``pp_size``, the expiry, the generation, ``transfer_mode``; no cached-token count), and
    # ``/inference/v1/generate`` served with no flag.
    release_0_2x: bool = False

    @property
    def nested_block_ids(self) -> bool:
        """``remote_block_ids`` as one list per KV cache group."""
        return self.current

    @property
    def minor(self) -> tuple[int, int]:
        """(major, minor) of the release: what the KV-event shapes change by (``kv_events``)."""
        try:
            parsed = Version(self.version)
        except InvalidVersion:
            parsed = Version(DEFAULT_VERSION)
        return parsed.major, parsed.minor

    @property
    def tp_multiple_rule(self) -> bool:
        """0.11's handshake: the consumer's TP must be a multiple of the producer's."""
        return not self.current

    @property
    def has_route(self) -> frozenset[str]:
        """The P/D kinds this release serves: 0.11 has no Messages or generate route."""
        return _ALL_KINDS if self.current else _KINDS_0_11

    @property
    def hands_off_on_responses(self) -> bool:
        """0.11's ``ResponsesRequest`` ignores ``kv_transfer_params`` (no handoff, none read)."""
        return self.current

    @property
    def generate_needs_scale_out(self) -> bool:
        """``/inference/v1/generate`` answers 403 unless the engine runs ``--enable-scale-out``."""
        return self.current and not self.release_0_2x


def release_of(version: str) -> Release:
    """The profile of ``version``; one that does not parse is imitated as the newest."""
    try:
        parsed = Version(version)
    except InvalidVersion:
        parsed = Version(DEFAULT_VERSION)
    return Release(version, parsed >= _CURRENT, parsed >= FIRST_REJECTION_CLEANUP, parsed >= _FIRST_033,
                   _FIRST_020 <= parsed < _FIRST_022)


def compatible(producer_version: str, producer_mode: str, consumer_version: str, consumer_mode: str) -> bool:
    """NIXL's handshake: the compatibility hash holds the exact version and the transfer mode."""
    return producer_version == consumer_version and producer_mode == consumer_mode
