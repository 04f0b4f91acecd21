"""Talking to vLLM engines: TLS, the engine key and control reads (``control``), the request
legs (``client`` over ``http1``) and the KV handoff (``connector``).

Its modules: the wire to vLLM: ``http1.py`` (pooled HTTP/1.1 client: origins, request heads, the
pool) + ``http1_connection.py`` (one connection, reporting to its pool through the ``Pool``
protocol: response parsing, back-pressure) + ``http1_errors.py`` (what an exchange fails with),
``client.py`` (prefill, decode, release: each leg's policy), ``control_decode.py`` (a probe's or
preflight's decode under the request path's handoff rules: decoded in time, given back, or
abandoned), ``handoff_check.py`` (the handoff's own step before any leg, ``checked_handoff``),
``decode.py`` (a decode leg's steps, open, next span, close, on a narrow ``DecodeContext``) +
``leg_state.py`` (the leg's states, ``LegState``, and their one table of moves, ``NEXT``),
``failures.py`` (the one place wire failures become reasons: ``WireFailures`` around every leg's
waits; ``leg_bound``, the one rule for a leg's deadline), ``relay.py`` (bytes to the client inside
the data callback; ``Signal``, what a read says when it brings no bytes), ``sse.py`` (framing and
classification), ``endpoints.py`` (the one registry of client routes: path, P/D or passthrough,
dialect; what routes, admission, affinity, probes and preflight read), ``dialects/`` (one
description per P/D endpoint: admission checks, affinity text, usage fields, bodies, output events,
terminal event, in-stream errors, the router's error shape, byte probes, probe body), ``timers.py``,
``connector.py`` (NixlConnector descriptors), ``prefill_result.py`` (one prefill's result: the
handoff a decode may carry), ``control.py`` (TLS, engine auth, ``/health`` ``/version``
``/v1/models``; ``PooledReader``, the supervisor's ``/metrics`` reads over ``http1``),
``load_metrics.py`` (the vLLM ``/metrics`` series placement reads)
"""
