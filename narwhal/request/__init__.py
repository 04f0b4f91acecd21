"""One client request: admission, the attempts and their retries, outcomes, the access log.

Imports the fleet (placement) and the engines (legs); never the front.

Its modules: one client request: ``admission.py`` (parse once, 4xx; the client's headers:
credentials, W3C trace context only when valid), ``affinity.py`` (local decode from the endpoint's
prompt text, and the placement policy asked for its note), ``prompt_tokens.py`` (the prompt's token
ids for placement by the engines' KV-cache events: from the body, or one ``/tokenize``),
``router.py`` (the request: attempts, retries and migrations, drain), ``migration/`` (a stream cut
after visible output continued on another pair: ``__init__.py`` ``Migration``, whether a cut
continues, and a continuation's rewrite in front of the client's sink; ``transcript.py`` what the
client was sent, kept unparsed by the client's sink, older spans in zlib blocks; ``seen.py`` what
the client saw, read from the transcript; ``forms.py`` each endpoint's continuation body;
``splice.py`` the continuation's events rewritten into the original stream), ``attempt.py`` (one
attempt top to bottom: reserve, prefill, decode, relay, outcome), ``attempt_state.py`` (the
attempt's states and the one table of their moves, ``AttemptLife``, what entering each does to the
reservation's slots, and the ``AttemptObserver`` protocol tracing watches it through),
``handoff_release.py`` (every way a handoff that will not be decoded ends, ``Ending``, and what
becomes of it, ``RULES``: released to whom first, or abandoned; ``HandoffReleases`` applies it in
background tasks), ``client_failures.py`` (what the client sees of every failure, decided once: the
HTTP error in the endpoint's shape, the terminal event after the 200, 499 for a client gone, the
guard's 404/405/413/500), ``client_stream.py`` (the client's side: the response, flow control, the
``committed`` flag), ``stream_buffers.py`` (what the streams waiting for slow clients may hold of a
worker's memory, in total), ``ids.py`` (client and backend ids; a client id only when printable
ASCII), ``outcomes.py`` (what an attempt reports), ``accesslog.py`` (records, decides nothing),
``usage.py`` (the decode's ``completion_tokens`` by a byte search), ``tracing.py`` (opt-in
OpenTelemetry: a traced router, an attempt observer spanning each leg, a traced placement; imported
only when ``[tracing] enabled``), ``passthrough.py`` (``/tokenize``, ``/v1/embeddings``, ``/score``
…: one engine, answer relayed), ``slot_wait.py`` (the bounded wait for a slot, shared by pairs and
passthrough: ``WaitingPlacement`` and ``WaitingEngine`` add the awaiting ``reserve`` to fleet's pure
choices)
"""
