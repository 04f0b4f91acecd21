"""What a perf run reports: ``summary`` pools rounds into figures, ``results`` judges the targets
and writes results.json/results.md from ``tables``, ``plots`` the PNGs, ``notes`` what other than
the router set a limit, ``placement`` the placement scenarios' table and targets."""
