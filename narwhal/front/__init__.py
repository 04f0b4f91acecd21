"""The front: what clients and gunicorn talk to — the aiohttp app and its routes, the admin API,
the server and accept loop in each worker, and the hooks the gunicorn master runs.

May import every layer below; nothing below imports it."""
