"""The supervisor process: the one writer of breaker, load and model records. Its deciding parts
(breakers, discovery, the model reader, the holdings' model) return what they decided; its loop
(``loop``) calls them a pass at a time and its edge (``main``) applies it.

Its modules: ``process.py`` (the supervisor process's body, what the master's keeper forks),
``loop.py`` (the loop, a pass per timer callback: merge reports, breakers, start the rounds, apply
what the deciding parts returned, publish), ``main.py`` (``Supervisor``: its fleet, slots and
breakers, and the edge: the one place that writes shared memory, applying discovery's and the model
reader's decisions), ``engine_records.py`` (the breakers' statuses as engine records and back,
pure), ``checks.py`` (readmission probes and health checks, started by a pass and run in tasks of
their own; what a control read says of reaching an engine), ``breaker.py`` (the fleet's breakers:
who a report charges, the ejection cap, waves, the published version; time as an argument; pure) +
``breaker_record.py`` (one engine's record and the moves of its state machine, its invariants) +
``readmission.py`` (the probe schedule, whole-wave restart) + ``membership.py`` (engines joining
PROBING and leaving at run time; discovery's decisions, ``Join`` ``Drain`` ``Readmit`` ``Forget``),
``reports.py`` (only the rings written since are drained, one look at every slot's indexes; the
reports into the breakers in completion order, a success they already took skipped), ``holdings/``
(``__init__.py``: what each producer holds, from the prefills' reports, their cached tokens,
capacity and restarts; the live prefixes' homes; docs/behaviour.md "Placement"; ``producer.py`` the
record kept per producer, its hot blocks; ``fit.py`` the fleet's fixed cost per prefill, a live
prefix's size; ``lru.py`` a report's LRU steps: the run of blocks the last prefill hit kept whole,
so a repeated prefix costs no step per block; ``engine_rate.py`` a producer's prefill rate as its
own ``/metrics`` say, the same for every replica: what scales its homes' room; ``rate.py`` the rate
the estimate places each producer by: the learned rates' mean at its engine-reported class),
``load.py`` (engines' ``/metrics``, read off the loop, into load records; capacity and prefill
counters to the holdings), ``models.py`` (model discovery, deciding only: ``ModelReader.tick``
returns ``ModelsRead`` and ``ModelsPublished``, the loop applies them: each engine's ``/v1/models``
and ``/version`` (docs/decisions.md "vLLM releases": which engines may pair) at start, at
readmission, when it joins, when it answers again after refusing connections (reachable at once; its
version unknown if ``/version`` cannot be read), retried while unanswered and refreshed every 30 s,
at most a round per engine per ``health_interval_s``, read off the loop into model records),
``rounds.py`` (a round of per-engine checks started a batch per pass of the loop, by the pass
itself, so no round delays the heartbeat or wakes the process between passes), ``discovery/``
(docs/behaviour.md "Engines that come and go"; ``__init__.py``: sources read off the loop, the last
good set per source, and the decisions from it against the running fleet it reads through
``Running``: engines joined through the table PROBING (deferred while no slot or name is free),
vanished ones drained then forgotten; ``sources.py`` the watched file, DNS; ``wanted.py`` the wanted
fleet, pure: static wins, a taken name or no slot refused), ``kv_events/`` (the engines' KV-cache
events: ``hub.py`` a ZMQ subscription per engine from its ``/kv_event_sources``, gaps replayed,
resets dropping learned holdings; ``stream.py`` one publisher's sequence and exact block set, pure;
``decode.py`` a batch's payload in either of vLLM's shapes, nothing trusted), ``probes.py``,
``transitions.py`` (one log line per breaker transition, reachability change and charge, written as
they are published)
"""
