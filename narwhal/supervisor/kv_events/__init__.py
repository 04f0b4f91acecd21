"""The engines' KV-cache events, followed by the supervisor (one subscription per engine per host).

Its modules: ``hub.py`` (the subscriptions: sources, SUB and DEALER sockets, gaps replayed, resets
told to the supervisor), ``stream.py`` (one publisher's sequence and block set, pure),
``decode.py`` (a batch's payload, both of vLLM's shapes, nothing trusted).
"""
