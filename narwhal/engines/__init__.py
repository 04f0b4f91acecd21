"""Talking to vLLM engines: TLS, the engine key and control reads (``control``), the request
legs (``client`` over ``http1``) and the KV handoff (``connector``)."""
