"""The supervisor process: the one writer of breaker, load and model records. Its deciding parts
(breakers, discovery, the model reader, the placement policy's part) return what they decided;
its loop (``loop``) calls them a pass at a time and its edge (``edge``) applies it. Its modules:

- ``process.py``: the supervisor process's body, what the master's keeper forks
- ``loop.py``: the loop, a pass per timer callback: reports, breakers, rounds, decisions applied, publish
- ``edge.py``: ``Supervisor``, its fleet, slots and breakers, and the one place that writes their records
- ``engine_records.py``: the breakers' statuses as engine records and back, pure
- ``checks.py``: readmission probes and health checks, run in tasks of their own
- ``probes.py``: one inference probe of an engine: a prefill and a decode on a partner
- ``breaker.py``: the fleet's breakers: who a report charges, the ejection cap, waves; pure
- ``breaker_record.py``: one engine's record and the moves of its state machine
- ``readmission.py``: the probe schedule, whole-wave restart
- ``membership.py``: engines joining and leaving at run time (``Join``, ``Drain``, ``Readmit``, ``Forget``)
- ``reachability.py``: whose last connection attempt failed, from reports and control reads
- ``reports.py``: the workers' rings drained in completion order into the breakers
- ``transitions.py``: one log line per breaker transition, reachability change and charge
- ``load.py``: the engines' ``/metrics`` read off the loop into load records
- ``load_metrics.py``: the vLLM ``/metrics`` series those reads parse
- ``models.py``: each engine's ``/version`` and ``/v1/models``, read and decided on
- ``rounds.py``: a round of per-engine checks started a batch per pass
- ``policy_part.py``: the placement policy's supervisor part, built from what its region names
- ``holdings/``: policy ``held``'s part: what each producer holds
- ``kv_events/``: the engines' KV-cache events, a ZMQ subscription per engine
- ``discovery/``: engines that come and go (a file, DNS, Kubernetes EndpointSlices)
"""
