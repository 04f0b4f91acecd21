"""One client request: admission, the attempts and their retries, outcomes, the access log.

Imports the fleet (placement) and the engines (legs); never the front. Its modules:

- ``admission.py``: the one door, ``Admission.admit``: body parsed once, 4xx, a request ready to place
- ``affinity.py``: a local decode from the prompt text, and the placement policy's note of it
- ``prompt_tokens.py``: the prompt's token ids for the policy (from the body, or one ``/tokenize``)
- ``router.py``: the request: admission, attempts, retries and migrations, drain
- ``attempt.py``: one attempt by the request path's named steps, Placement to Cleanup
- ``attempt_state.py``: the attempt's states, the one table of their moves, their slot effects
- ``handoff_release.py``: every way an undecoded handoff ends (``Ending``) and where it is released
- ``migration/``: a stream cut after visible output, continued on another pair
- ``client_failures.py``: what the client sees of every failure, decided once
- ``client_stream.py``: the client's side: the response, flow control, ``committed``
- ``stream_buffers.py``: what streams behind slow clients may hold of a worker's memory
- ``ids.py``: client and backend request ids
- ``outcomes.py``: what an attempt reports to the breakers
- ``accesslog.py``: the access-log records and their writer (decides nothing)
- ``usage.py``: the decode's ``completion_tokens``, by a byte search
- ``tracing.py``: opt-in OpenTelemetry spans (imported only with ``[tracing] enabled``)
- ``passthrough.py``: one engine serves the request, its answer relayed whole
- ``slot_wait.py``: the bounded wait for a slot, shared by pairs and passthrough
"""
