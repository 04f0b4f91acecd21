"""Talking to vLLM engines: the HTTP client (``client``) and the KV handoff (``connector``)."""
