"""Unit tests: the wire to the engines: HTTP/1.1, SSE, descriptors, control plane."""
