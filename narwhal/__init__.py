"""Narwhal: a router for disaggregated (prefill/decode) vLLM serving.

The version is written once, in ``pyproject.toml``, and read here from the installed
distribution's metadata (``narwhal-router``): ``narwhal --version``, ``GET /version`` and the
``narwhal_build_info`` metric all show this value, so none of them can drift from what pip
installed. The import name and the command stay ``narwhal``; the distribution is
``narwhal-router`` because ``narwhal`` on the package registry is someone else's project.

The base layer, below every package (each module says more): ``settings/`` (``__init__.py`` a model
per section (each key's docstring is its description) and the loading; ``reference.py``
docs/settings.md's table rendered from the models; ``section.py`` what every section is, frozen and
strict; ``placement.py`` ``[placement]`` and a policy's own table within it, ``[placement.held]``
(its keys of before still read from ``[placement]``, said once); ``engines.py`` an ``[[engines]]``
entry and ``[engine_contract]``, its version pin parsed; ``discovery.py`` the ``[discovery]``
section; ``env.py``: each ``NARWHAL_`` variable's name and form; ``hints.py``: the error line says
what was meant, ``[[engines]]``, a "did you mean"), ``errors.py``, ``reasons.py``,
``fault_table.py``, ``rendered_docs.py`` (a rendered table's markers and command, shared with
``settings/reference.py``), ``metrics.py``, ``metric_tally.py``, ``logs.py``. Together: settings
(one-line errors), the error hierarchy, the one table of reasons and the fault table the docs show
rendered from it, metric objects, the request path's metric updates added up and written in bulk
every 0.25 s
"""

from __future__ import annotations

from importlib import metadata as _metadata

DISTRIBUTION = "narwhal-router"

try:
    __version__ = _metadata.version(DISTRIBUTION)
except _metadata.PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"

__all__ = ["DISTRIBUTION", "__version__"]
