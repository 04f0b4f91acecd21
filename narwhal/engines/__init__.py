"""Talking to vLLM engines: TLS, the engine key and control reads (``control``), the request
legs (``client`` over ``http1``) and the KV handoff (``connector``). Its modules:

- ``http1.py``: the pooled HTTP/1.1 client: origins, request heads, the pool
- ``http1_connection.py``: one connection: response parsing, back-pressure
- ``http1_errors.py``: what an exchange fails with
- ``client.py``: the request's legs, prefill, decode, release: each leg's policy
- ``prefill_result.py``: one prefill's result: the handoff a decode may carry
- ``connector.py``: NixlConnector: the prefill rewrite, the descriptor and its rules
- ``handoff_check.py``: the handoff's own step before any leg, ``checked_handoff``
- ``decode.py``: a decode leg's steps, open, next span, close, on a narrow ``DecodeContext``
- ``leg_state.py``: the leg's states, ``LegState``, and their one table of moves
- ``control_decode.py``: a probe's or preflight's decode under the request path's handoff rules
- ``failures.py``: the one place wire failures become reasons (``WireFailures``, ``leg_bound``)
- ``relay.py``: bytes to the client inside the data callback; ``Signal``
- ``sse.py``: SSE framing and classification
- ``endpoints.py``: the one registry of client routes: path, P/D or passthrough, dialect
- ``dialects/``: one description per P/D endpoint, its error shape included
- ``timers.py``: deadlines on the loop's clock
- ``control.py``: TLS, engine auth, ``/health``, ``/version``, ``/v1/models``; ``PooledReader``
"""
