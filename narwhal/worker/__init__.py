"""What runs in each gunicorn worker: its start and stop (``lifecycle``), the aiohttp app and its
routes (``app``), the admin API, the server and its accept loop, and following the engine table
(``roster_follow``).

May import every layer below it; only the master's hooks (``narwhal.master``) import it.

Its modules: what each gunicorn worker runs: ``lifecycle.py`` (``post_worker_init``: the listening
sockets taken over, the stop signals taken once the loop runs, a SIGTERM that wakes aiohttp's loop),
``app.py`` (routes, the worker's app factory), ``guard.py`` (every route's errors in the endpoint's
shape, by the route's own wrapper and a catch-all registered last: no aiohttp middleware),
``compose.py`` (the composition root: fleet state, placement, outcomes and the router, built once
from the settings and handed over by name, ``RouterParts``), ``admin.py``, ``server.py`` (aiohttp
runner), ``accept.py`` (each worker accepts by itself), ``roster_follow.py`` (with ``[discovery]``:
the worker's engines are the engine table's, followed every 0.25 s by one u32 compare),
``models_follow.py`` (the engines' models as the supervisor read them, followed every 0.25 s by one
u64 compare; a worker never reads ``/v1/models``), ``following.py`` (how both follow: a check every
0.25 s, a failing one logged, never the end of it)
"""
