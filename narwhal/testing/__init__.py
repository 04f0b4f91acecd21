"""Process harness for the demo, the tests and the perf suite: fake fleets and routers under
real gunicorn on 127.0.0.1. Not imported by the router itself.

Its modules: ``harness.py``: fake fleets and routers under real gunicorn (and ``DeadEngine``, an
address nothing answers at), for the demo, tests and perf; ``asking.py``: asking a router or engine
over HTTP, the conditions the harness's waits poll; the router never imports it
"""
