"""What a perf run drives: the processes under test (``stack``: fleets, routers, the peer, the aiohttp
floor), the load generators (``generator`` closed-loop rounds, ``chat`` multi-turn users), the
scenarios and their interleaved rounds (``scenarios``, ``placement``, ``scarce``, ``memory``), the
other P/D endpoints' bodies, CPU from /proc (``procs``) and the signals that stop a run."""
