"""What runs in each gunicorn worker: its start and stop (``lifecycle``), the aiohttp app and its
routes (``app``), the admin API, the server and its accept loop, and following the engine table
(``roster_follow``).

May import every layer below it; only the master's hooks (``narwhal.master``) import it."""
