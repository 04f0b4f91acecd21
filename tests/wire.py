"""Wire literals the tests hold the router and the fake engine to, written out once.

Why literals and not the product's own constants: a test that compared the router's bodies with
``narwhal.engines.connector.PREFILL_KV_PARAMS`` would pass whatever that constant became. These
are what vLLM's own P/D proxy sends (vLLM's sources), typed in by hand."""

from __future__ import annotations

# A prefill's ``kv_transfer_params``, as vLLM's toy proxy and NixlConnector expect it.
PREFILL_KV = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
