"""``narwhal preflight``: the pinned engine contract and every permitted KV transfer, checked
with real requests; also what the supervisor runs at start and before readmission.

Its modules: ``check.py`` (contract + every permitted transfer, real requests), ``causes.py`` (why a
transfer failed when the engines do not say: a ``localhost`` side channel across hosts,
tensor-parallel sizes), ``report.py`` (the verdicts as data and table)
"""
