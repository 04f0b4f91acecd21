"""Streams that survive their consumer (docs/behaviour.md "Migration"): a stream cut after visible
output continues on another pair. Its modules:

- ``stream.py``: ``Migration``, one per stream: whether a cut continues, the continuation, its rewrite
- ``transcript.py``: what the client was sent, kept unparsed by the client's own writes
- ``seen.py``: what the client saw, read from the transcript only at a cut
- ``forms.py``: each endpoint's continuation body, and what is never continued
- ``splice.py``: a continuation's events rewritten into the stream the client reads
"""

from narwhal.request.migration.stream import Migration

__all__ = ["Migration"]
