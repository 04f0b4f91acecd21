"""Process harness for the demo, the tests and the perf suite: fake fleets and routers under
real gunicorn on 127.0.0.1. Not imported by the router itself."""
