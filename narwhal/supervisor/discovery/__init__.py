"""Engines that come and go (docs/behaviour.md "Engines that come and go"), in the supervisor. Its modules:

- ``decisions.py``: ``Discovery``: the sources read off the loop, the last good set per source,
  and the decisions from it against the running fleet (join probing, drain, readmit, forget)
- ``sources.py``: the watched file and DNS names, read and refused as untrusted input
- ``kubernetes.py``: the engines' EndpointSlices, listed and watched through the API server
- ``wanted.py``: the wanted fleet, pure: static wins, a taken name or no slot refused
"""

from narwhal.supervisor.discovery.decisions import Discovery

__all__ = ["Discovery"]
