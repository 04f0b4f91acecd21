"""Narwhal's perf suite: the router under real gunicorn against fake vLLM engines, next to "direct".

Run it with ``python -m perf`` (see ``perf/README.md``). It lives outside the ``narwhal`` package
on purpose: it is a development tool with its own optional dependency (matplotlib, the ``perf``
extra) and must never be imported by the router.
"""
