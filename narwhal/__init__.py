"""Narwhal: a router for disaggregated (prefill/decode) vLLM serving.

The version is written once, in ``pyproject.toml``, and read here from the installed
distribution's metadata (``narwhal-router``): ``narwhal --version``, ``GET /version`` and the
``narwhal_build_info`` metric all show this value, so none of them can drift from what pip
installed. The import name and the command stay ``narwhal``; the distribution is
``narwhal-router`` because ``narwhal`` on the package registry is someone else's project.
"""

from __future__ import annotations

from importlib import metadata as _metadata

DISTRIBUTION = "narwhal-router"

try:
    __version__ = _metadata.version(DISTRIBUTION)
except _metadata.PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"

__all__ = ["DISTRIBUTION", "__version__"]
