"""``narwhal fake-engine``: one process hosting several fake engines and a control server.

Why several engines in one process: crossed P→D handoffs between engines of one fleet go through
the process-local registry (no HTTP side channel), so a perf run on a small machine spends its CPU
in the router, not in fake engines talking to each other. Each engine still listens on its own port
and looks like its own vLLM server to the router.

Start-up contract (what test harnesses parse): once every engine and the control server listen,
exactly one JSON line goes to stdout, ``{"control": URL, "engines": {name: URL}}``, and, with
``--ready-file``, the same JSON is written atomically (temp file + rename) so a poller never reads
half a file. SIGTERM or SIGINT stops everything and the process exits 0 without a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import ssl
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import orjson
from aiohttp import web
from pydantic import ValidationError

from narwhal.fake_engine.control import build_control_app
from narwhal.fake_engine.engine import FakeEngine
from narwhal.fake_engine.release import DEFAULT_VERSION
from narwhal.fake_engine.state import EngineModel

CLOSE_TIMEOUT_S = 10.0


class Fleet:
    """Engines plus their control server, started and stopped together."""

    def __init__(
        self,
        names: Sequence[str],
        *,
        host: str = "127.0.0.1",
        base_port: int = 0,
        control_port: int = 0,
        models: Mapping[str, EngineModel] | None = None,
        **engine_kwargs: Any,
    ) -> None:
        """``models``: an engine's own load and cache models (e.g. a slower GPU's prefill cost),
        instead of ``engine_kwargs``' ``load_model``."""
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"engine names must be unique and non-empty: {list(names)}")
        self.host = host
        # A wildcard bind is not an address a consumer (or a test) can dial.
        self.advertise_host = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
        self.base_port = base_port
        self.control_port = control_port
        engine_kwargs.setdefault("advertise_host", self.advertise_host)
        own = models or {}
        self.engines: dict[str, FakeEngine] = {
            name: FakeEngine(name, **{**engine_kwargs, **({"load_model": own[name]} if name in own else {})})
            for name in names
        }
        self._control: web.AppRunner | None = None
        self.control_url: str | None = None

    async def start(self) -> dict[str, Any]:
        """Listen everywhere; return the ready document ``{"control", "engines"}``."""
        urls: dict[str, str] = {}
        for i, (name, engine) in enumerate(self.engines.items()):
            urls[name] = await engine.start(self.host, self.base_port + i if self.base_port else 0)
        self._control = web.AppRunner(build_control_app(self.engines), access_log=None, shutdown_timeout=1.0)
        await self._control.setup()
        site = web.TCPSite(self._control, self.host, self.control_port)
        await site.start()
        self.control_url = f"http://{self.advertise_host}:{site.port}"
        return {"control": self.control_url, "engines": urls}

    async def close(self) -> None:
        """Close every engine and then the control server; open streams are aborted, not waited for."""
        # Engines first: their open streams are aborted, so nothing waits on a shutdown timeout.
        for engine in self.engines.values():
            await engine.close()
        if self._control is not None:
            await self._control.cleanup()
            self._control = None


def write_ready_file(path: str, document: dict[str, Any]) -> None:
    """Write the ready document by temp file and rename, so a poller never reads half of it."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".ready-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(orjson.dumps(document) + b"\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


async def run_fleet(
    names: Sequence[str],
    *,
    host: str = "127.0.0.1",
    base_port: int = 0,
    control_port: int = 0,
    ready_file: str | None = None,
    stop_event: asyncio.Event | None = None,
    on_ready: Callable[[dict[str, Any]], None] | None = None,
    **engine_kwargs: Any,
) -> None:
    """Run a fleet until ``stop_event`` is set (by default: until SIGTERM or SIGINT).

    ``on_ready`` receives the ready document once everything listens (``main`` prints it).
    ``engine_kwargs`` go to every ``FakeEngine`` (model, version, lease_s, block_size, …).
    """
    loop = asyncio.get_running_loop()
    handled: list[signal.Signals] = []
    if stop_event is None:
        stop_event = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop_event.set)
            handled.append(sig)
    fleet = Fleet(names, host=host, base_port=base_port, control_port=control_port, **engine_kwargs)
    try:
        document = await fleet.start()
        if ready_file:
            write_ready_file(ready_file, document)
        if on_ready is not None:
            on_ready(document)
        # Poll as well as wait: stopping must not hinge on a single loop wakeup.
        while not stop_event.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop_event.wait(), 0.5)
    finally:
        # Bounded: a test harness that sent SIGTERM must never need SIGKILL.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(fleet.close(), CLOSE_TIMEOUT_S)
        for sig in handled:
            loop.remove_signal_handler(sig)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="narwhal fake-engine",
        description="Run fake vLLM engines (disaggregated P/D wire format) plus a control server.",
    )
    p.add_argument(
        "--engine", action="append", dest="engines", metavar="NAME", help="engine name (repeatable)"
    )
    p.add_argument("--count", type=int, default=None, help="run N engines named e0..eN-1")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--port", type=int, default=0, dest="base_port", help="base port: engine i listens on port+i (0 = ephemeral)"
    )
    p.add_argument("--control-port", type=int, default=0)
    p.add_argument("--model", default="fake-model")
    p.add_argument("--vllm-version", "--version", dest="version", default=DEFAULT_VERSION,
                   help="the vLLM release imitated (its /version, descriptor, metrics labels; fake_engine.release)")
    p.add_argument("--transfer-mode", choices=("pull", "push"), default="pull",
                   help="NIXL transfer mode in descriptors; decodes across modes fail their handshake")
    p.add_argument("--enable-scale-out", action="store_true",
                   help="serve /inference/v1/generate (a current release answers 403 without it)")
    p.add_argument("--lease-s", type=float, default=30.0, help="KV block lease of a prefill (seconds)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=8192,
                   help="context length: a request whose prompt and max_tokens exceed it gets vLLM's 400")
    p.add_argument(
        "--tokens", type=int, default=16, dest="default_tokens",
        help="tokens generated when a request sets no max_tokens",
    )
    p.add_argument("--token-delay-s", type=float, default=0.0)
    p.add_argument("--coalesce", action="store_true", help="write a zero-delay stream in one write")
    p.add_argument("--flat-block-ids", action="store_true", help="flat remote_block_ids (older vLLM)")
    p.add_argument("--records-max", type=int, default=2000,
                   help="request records kept per engine (older ones dropped, counted in stats)")
    _add_model_options(p)
    p.add_argument("--ready-file", default=None, help="also write the ready JSON here (atomically)")
    p.add_argument("--tls-cert", default=None, metavar="PEM", help="serve https with this certificate chain")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="the certificate's private key")
    return p


def _add_model_options(p: argparse.ArgumentParser) -> None:
    """The load and cache models (docs/behaviour.md "Fake engines") for every engine of the fleet;
    all off by default.
    """
    p.add_argument("--max-num-seqs", type=int, default=0, help="batch limit; beyond it FIFO waiting (0: none)")
    p.add_argument(
        "--prefill-s-per-token", type=float, default=0.0, help="prefill compute per uncached prompt token (seconds)"
    )
    p.add_argument(
        "--prefill-us-per-token", action="append", default=[], metavar="[NAME=]US",
        help="prefill compute per uncached prompt token in microseconds, for every engine or for engine NAME "
        "(repeatable: engines may differ, as GPU kinds do)",
    )
    p.add_argument(
        "--prefix-cache", action="store_true", help="LRU prefix cache of 16-token blocks (a token = 4 characters)"
    )
    p.add_argument("--kv-blocks", type=int, default=10000, help="KV capacity in blocks (cache bound, usage base)")
    p.add_argument(
        "--kv-events", action="store_true",
        help="publish KV-cache events as vLLM's ZMQ publisher does (implies --prefix-cache): GET /kv_event_sources",
    )
    p.add_argument(
        "--kv-buffer-steps", type=int, default=10_000,
        help="batches the KV-event replay keeps (vLLM's buffer_steps): a subscriber further behind loses the rest",
    )
    p.add_argument(
        "--tensor-parallel-size", type=int, default=1,
        help="the descriptors' tp_size; a consumer fails pulls from a producer whose TP does not divide its own",
    )


def _tls(args: argparse.Namespace) -> ssl.SSLContext | None | str:
    """The server's TLS context from the options (None: plain http), or why it cannot be had."""
    if not (args.tls_cert or args.tls_key):
        return None
    if not (args.tls_cert and args.tls_key):
        return "--tls-cert and --tls-key go together"
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        tls.load_cert_chain(args.tls_cert, args.tls_key)
    except (OSError, ssl.SSLError) as exc:
        return f"cannot load the TLS certificate: {exc}"
    return tls


def _load_model(args: argparse.Namespace, prefill_s_per_token: float) -> EngineModel | str:
    """The models from the options, or the one-line reason they are refused."""
    try:
        return EngineModel(
            max_num_seqs=args.max_num_seqs,
            prefill_s_per_token=prefill_s_per_token,
            prefix_cache=args.prefix_cache or args.kv_events,
            kv_blocks=args.kv_blocks,
            tensor_parallel_size=args.tensor_parallel_size,
        )
    except ValidationError as exc:
        err = exc.errors()[0]
        option = "--" + str(err["loc"][0]).replace("_", "-") if err["loc"] else "model"
        return f"{option}: {err['msg']}"


def _prefill_costs(args: argparse.Namespace, names: Sequence[str]) -> dict[str | None, float] | str:
    """Seconds per token by engine name (None: every engine), or why an entry is refused."""
    costs: dict[str | None, float] = {None: args.prefill_s_per_token}
    for entry in args.prefill_us_per_token:
        name, _, value = entry.rpartition("=")
        if name and name not in names:
            return f"--prefill-us-per-token {entry}: no engine named {name!r}"
        try:
            costs[name or None] = float(value) / 1e6
        except ValueError:
            return f"--prefill-us-per-token {entry}: not a number of microseconds"
    return costs


def _models(args: argparse.Namespace, names: Sequence[str]) -> tuple[EngineModel, dict[str, EngineModel]] | str:
    """The fleet's models and each engine's own, or the one-line reason they are refused."""
    costs = _prefill_costs(args, names)
    if isinstance(costs, str):
        return costs
    base = _load_model(args, costs[None])
    if isinstance(base, str):
        return base
    own: dict[str, EngineModel] = {}
    for name, cost in costs.items():
        if name is not None:
            model = _load_model(args, cost)
            if isinstance(model, str):
                return model.replace("--prefill-s-per-token", f"--prefill-us-per-token {name}")
            own[name] = model
    return base, own


# The flags whose destination is a ``run_fleet`` keyword of the same name (the fleet's own, then
# what goes to every ``FakeEngine``), passed as parsed.
_RUN_FLEET_OPTIONS = ("host", "base_port", "control_port", "ready_file", "model", "version", "lease_s", "block_size",
                      "default_tokens", "token_delay_s", "coalesce", "flat_block_ids", "records_max",
                      "transfer_mode", "enable_scale_out", "max_model_len", "kv_events", "kv_buffer_steps")


def main(argv: list[str] | None = None) -> int:
    """``narwhal fake-engine``: check the arguments (2 and one line if wrong), serve until a signal; 0 then."""
    args = _parser().parse_args(argv)
    if args.engines and args.count is not None:
        print("narwhal fake-engine: use --engine or --count, not both", file=sys.stderr)
        return 2
    names = args.engines or [f"e{i}" for i in range(args.count if args.count is not None else 1)]
    if not names or len(set(names)) != len(names):
        print(f"narwhal fake-engine: engine names must be unique and non-empty: {names}", file=sys.stderr)
        return 2

    if args.records_max < 1:
        print("narwhal fake-engine: --records-max must be at least 1", file=sys.stderr)
        return 2
    tls = _tls(args)
    models = _models(args, names)
    for refused in (tls, models):
        if isinstance(refused, str):
            print(f"narwhal fake-engine: {refused}", file=sys.stderr)
            return 2
    assert not isinstance(tls, str) and not isinstance(models, str)
    load_model, own_models = models

    def announce(document: dict[str, Any]) -> None:
        sys.stdout.write(orjson.dumps(document).decode() + "\n")
        sys.stdout.flush()

    options = {option: getattr(args, option) for option in _RUN_FLEET_OPTIONS}
    fleet = run_fleet(names, on_ready=announce, ssl_context=tls, load_model=load_model, models=own_models, **options)
    try:
        import uvloop

        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop is a declared dependency
        loop_factory = None
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(fleet)
    except OSError as exc:
        print(f"narwhal fake-engine: {exc}", file=sys.stderr)
        return 1
    return 0
