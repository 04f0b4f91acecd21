"""``narwhal preflight``: the pinned engine contract and every permitted KV transfer, checked
with real requests; also what the supervisor runs at start and before readmission."""
