"""Why a preflight transfer failed, when the engines' own answers do not say: read from the
descriptor the producer handed over and from what preflight learned of each engine.

Two causes a real fleet meets and vLLM's answers leave unnamed: a NIXL side channel that
advertises ``localhost`` to a consumer on another host (the transfer then dials the consumer's
own loopback), and tensor-parallel sizes NixlConnector refuses. Each function returns the text
to add to the pair's reason or note, or "" when it does not explain the failure: a guess is
worded as one ("likely cause").

Pure: no I/O; the engines and sizes come in as arguments.
"""

from __future__ import annotations

import ipaddress
from typing import Any
from urllib.parse import urlsplit

from narwhal.engines.connector import tp_accepted
from narwhal.fleet import Engine


def _is_loopback(host: str) -> bool:
    host = host.strip("[]").lower()
    if host in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_of(url: str) -> str:
    host = (urlsplit(url).hostname or "").lower()
    return "loopback" if _is_loopback(host) else host


def localhost_note(p: Engine, d: Engine, descriptor: Any) -> str:
    """vLLM's side channel defaults to ``localhost``: fine on one host, a dead transfer across."""
    host = descriptor.get("remote_host") if isinstance(descriptor, dict) else None
    if not isinstance(host, str) or not _is_loopback(host) or _host_of(p.url) == _host_of(d.url):
        return ""
    return (
        f"descriptor remote_host is {host} but {p.name} and {d.name} are on different hosts "
        f"(set VLLM_NIXL_SIDE_CHANNEL_HOST on {p.name})"
    )


def tp_cause(producer: str, producer_tp: int | None, consumer: str, consumer_tp: int | None) -> str:
    """The tensor-parallel mismatch behind a failed transfer, when the TP sizes explain it.

    vLLM 0.11's consumer refuses the handoff in its NIXL handshake and its answer says nothing
    about TP (the reason is in its own log), so the cause is read from the sizes: the producer's
    from its descriptor's ``tp_size``, the consumer's from its own descriptor when it prefills
    too (phase 1), unknown otherwise.
    """
    if producer_tp is None or (consumer_tp is not None and tp_accepted(producer_tp, consumer_tp)):
        return ""
    if consumer_tp is not None:
        return (f"; tensor parallel mismatch: {producer} runs TP {producer_tp}, {consumer} TP {consumer_tp}: vLLM's "
                "NixlConnector needs the consumer's --tensor-parallel-size to be a multiple of the producer's")
    if producer_tp == 1:
        return ""  # every consumer TP is a multiple of 1
    return (f"; likely cause: {producer} runs TP {producer_tp} (its tp_size) and vLLM's NixlConnector refuses a "
            f"consumer whose --tensor-parallel-size is not a multiple of it: check {consumer}'s")
