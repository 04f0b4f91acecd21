"""Let an idle NIXL agent sleep: installed into the real tier's venv only, never the project's.

Why: on a CPU host an idle vLLM engine with NixlConnector kept one core busy per engine, and
two engines on a 2-core host starved the router beside them (the supervisor's ``/metrics``
reads timed out, the keeper replaced a live supervisor). The busy thread is NIXL's UCX progress
thread (``nixlUcxSharedThread::run``, seen with gdb): it waits for UCX events with ``poll()``
whose timeout is the agent's ``pthrDelay`` rounded up to milliseconds, and NIXL's Python API
(``nixl_cu12._api.nixl_agent``) hard-codes ``pthrDelay = 0``, so the thread polls with a zero
timeout in a loop. vLLM builds the agent through that API and offers no setting for it;
``OMP_WAIT_POLICY``, UCX's spin settings and ``kv_connector_extra_config.num_threads`` do not
touch it.

What: when ``nixl_cu12._bindings`` is first imported, its ``nixlAgent`` is wrapped so that an
agent built with a zero ``pthrDelay`` gets :data:`DELAY_US` instead. The thread still wakes at
once on every UCX event (it polls the worker's event fd); only its idle timeout changes, from a
spin to 5 ms. Nothing else of vLLM or NIXL is touched. The venv's ``narwhal_nixl_idle.pth``
imports this module at interpreter start (each engine's processes are spawned interpreters).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any

TARGET = "nixl_cu12._bindings"
DELAY_US = 5000


def _patch(module: ModuleType) -> None:
    real = module.nixlAgent

    def agent(name: str, config: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(config, "pthrDelay", None) == 0:
            config.pthrDelay = DELAY_US
        return real(name, config, *args, **kwargs)

    module.nixlAgent = agent


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)  # find the real spec, once
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()
