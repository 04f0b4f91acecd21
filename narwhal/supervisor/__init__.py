"""The supervisor process: breaker state, probes and readmission (``main``), its process
lifecycle under gunicorn (``process``) and its readmission checks (``probes``)."""
