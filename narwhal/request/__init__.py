"""One client request: admission, the attempts and their retries, outcomes, the access log.

Imports the fleet (placement) and the engines (legs); never the front."""
