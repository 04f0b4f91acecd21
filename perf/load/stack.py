"""The processes under test: two fake-engine fleets, Narwhal routers under gunicorn, an optional peer.

Why two fleet processes: the peer's reference command is PD mode with one producer and one
consumer, so Narwhal gets the same topology; and on a 2-core host a single fleet process
serving both legs would be the bottleneck, so producer and consumer are separate OS processes
(the consumer then reads the producer's KV over the fake's HTTP side channel, as a real NIXL
consumer reads over the network). The direct baseline sends the same bodies to that consumer.

Every process is started in its own session (process group) and stopped in ``close()``, which
the caller runs in ``finally``: gunicorn through the harness' ``stop_gunicorn``, the fleets
through ``FakeFleet.stop``, the peer with SIGTERM to its group and SIGKILL after a grace period.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from narwhal.supervisor.process import set_parent_death_signal
from narwhal.testing.harness import FakeFleet, RouterProcess, write_config
from perf.load.generator import COMPLETIONS, MODEL, Workload

# The issue's reference peer: the Rust vllm-router 0.1.17 in PD mode (``--peer vllm-router``).
VLLM_ROUTER = (
    "vllm-router --vllm-pd-disaggregation --prefill {producer_url} --decode {consumer_url} "
    "--host 127.0.0.1 --port {port} --policy round_robin --prometheus-port {free_port}"
)
PEER_READY_TIMEOUT_S = 90.0
PEER_STOP_GRACE_S = 5.0


@dataclass(slots=True)
class Target:
    """Where a round sends its load, and which process trees are "the router" for CPU/memory."""

    name: str
    kind: str  # "narwhal", "direct" or "peer"
    url: str
    pids: list[int] = field(default_factory=list)
    alive: Callable[[], bool] = lambda: True
    detail: dict[str, object] = field(default_factory=dict)
    prefill_url: str | None = None  # "direct-pd": the load generator runs the prefill leg itself


def _knows(root: str | None, key: str) -> bool:
    """Do the settings of the ``narwhal`` package under ``root`` (this checkout's by default) have ``key``?"""
    base = Path(root) if root else Path(__file__).resolve().parents[2]
    return any(key in path.read_text() for path in (base / "narwhal" / "settings").glob("*.py"))


def router_sections(workers: int, access_log: str, root: str | None = None) -> dict[str, dict[str, object]]:
    """Narwhal settings for perf: no preflight, quiet logs, timeouts that never fire; every request
    through a pair (``skip_prefill_share`` 0, where the router at ``root`` has it: a repeated
    system prompt would otherwise be decoded on the consumer that holds it, and these scenarios
    measure P/D; ``perf.multiturn`` measures the skip)."""
    placement: dict[str, object] = {"queue_timeout_s": 30, "max_queue": 100000}
    if _knows(root, "skip_prefill_share"):
        placement["skip_prefill_share"] = 0
    return {
        # No graceful_timeout_s: a float reaches gunicorn as "5.0", which it refuses (see the report).
        "server": {"workers": workers},
        "request": {"deadline_s": 600},
        "engine": {"prefill_timeout_s": 60, "first_token_timeout_s": 60, "decode_read_timeout_s": 60},
        # Below the default handoff.lease_s (30): a setting a baseline router of before lease_s also reads.
        "handoff": {"max_age_s": 25},
        "placement": placement,
        "preflight": {"on_start": False},
        "log": {"level": "warning", "access_log": access_log},
    }


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def expand_peer(template: str) -> str:
    return VLLM_ROUTER if template.strip() == "vllm-router" else template


def _resolve(argv: list[str]) -> list[str]:
    """Find a bare executable on PATH or next to this interpreter (a venv's bin/)."""
    if argv and os.sep not in argv[0] and shutil.which(argv[0]) is None:
        beside = Path(sys.executable).parent / argv[0]
        if beside.exists():
            argv = [str(beside), *argv[1:]]
    return argv


def _completion_ok(url: str) -> tuple[bool, str]:
    req = urllib.request.Request(url + COMPLETIONS, data=Workload(stream=False, tokens=1).body(), method="POST")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            resp.read()
            return resp.status == 200, str(resp.status)
    except urllib.error.HTTPError as exc:
        return False, str(exc.code)
    except (urllib.error.URLError, OSError) as exc:
        return False, type(exc).__name__


def _die_with_suite() -> None:
    set_parent_death_signal(signal.SIGTERM)


class Peer:
    """Another router's command line, run for comparison on the same fleet."""

    def __init__(self, template: str, producer_url: str, consumer_url: str, log_path: Path) -> None:
        self.template = expand_peer(template)
        self.port = free_port()
        extra = free_port()
        while extra == self.port:
            extra = free_port()
        try:
            self.command = self.template.format(
                producer_url=producer_url, consumer_url=consumer_url, port=self.port, free_port=extra
            )
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(
                f"--peer: bad template ({exc!r}); use {{producer_url}}, {{consumer_url}}, {{port}}, {{free_port}}"
            ) from None
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        argv = _resolve(shlex.split(self.command))
        with open(log_path, "ab") as log:
            # The peer (or the aiohttp floor) dies with the suite: a suite killed by a test's
            # timeout used to leave its gunicorn behind, serving nobody, for hours.
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=_die_with_suite,
            )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_serving(self, timeout_s: float = PEER_READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"peer exited with {self.proc.returncode} (log: {self.log_path})")
            ok, last = _completion_ok(self.url)
            if ok:
                return
            time.sleep(0.25)
        raise TimeoutError(f"peer gave no 200 within {timeout_s:g}s (last: {last}; log: {self.log_path})")

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, PEER_STOP_GRACE_S), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


class Stack:
    """Starts what the scenarios need, lazily, and stops everything in ``close()``."""

    def __init__(
        self, out_dir: Path, *, workers: int, coalesce: bool = False, lease_s: float = 120.0, fleet: str = "split"
    ) -> None:
        self.out_dir = out_dir
        self.fleet = fleet
        self.workers = workers
        self.coalesce = coalesce
        self.lease_s = lease_s
        self.producer: FakeFleet | None = None
        self.consumer: FakeFleet | None = None
        self.routers: dict[str, RouterProcess] = {}
        self.configs: list[str] = []
        self.access_logs: list[Path] = []
        self.peers: dict[str, Peer] = {}
        self.peer_template: str | None = None
        self.peer_error: str | None = None
        self.floor_error: str | None = None
        self.baseline_root: str | None = None  # --baseline: another commit's narwhal/ lives here
        self.baseline_error: str | None = None
        self.targets: dict[str, Target] = {}

    # -- fleets --------------------------------------------------------------------------------

    def start_fleets(self) -> None:
        args = ["--model", MODEL, "--lease-s", str(self.lease_s), "--tokens", "16"]
        if self.coalesce:
            args.append("--coalesce")
        if self.fleet == "single":
            # One process for both: the KV read is an in-process lookup, but one core at most.
            self.producer = self.consumer = FakeFleet.start(["p0", "d0"], args=args)
        else:
            self.producer = FakeFleet.start(["p0"], args=args)
            self.consumer = FakeFleet.start(["d0"], args=args)
        self.targets["direct"] = Target(
            "direct",
            "direct",
            self.consumer_url,
            [],
            alive=lambda: self.consumer is not None and self.consumer.proc.poll() is None,
        )
        self.targets["direct-pd"] = Target(
            "direct-pd",
            "direct",
            self.consumer_url,
            [],
            alive=lambda: self.consumer is not None and self.consumer.proc.poll() is None,
            prefill_url=self.producer_url,
        )

    @property
    def producer_url(self) -> str:
        assert self.producer is not None
        return self.producer.engines["p0"]

    @property
    def consumer_url(self) -> str:
        assert self.consumer is not None
        return self.consumer.engines["d0"]

    def engine_groups(self) -> dict[str, list[int]]:
        assert self.producer is not None and self.consumer is not None
        if self.producer is self.consumer:
            return {"producer": [], "consumer": [self.consumer.proc.pid]}
        return {"producer": [self.producer.proc.pid], "consumer": [self.consumer.proc.pid]}

    def groups(self) -> dict[str, list[int]]:
        """Every process tree this suite started, by group: engines and each router target."""
        out = self.engine_groups()
        for target in self.targets.values():
            if target.pids:
                out[target.name] = target.pids
        return out

    # -- routers -------------------------------------------------------------------------------

    def narwhal(
        self, name: str, workers: int | None = None, access_log: bool = False, root: str | None = None
    ) -> Target:
        """A Narwhal router under gunicorn (1 producer + 1 consumer), started once per name;
        with ``root``, the ``narwhal`` package found there (``--baseline``)."""
        if name in self.targets:
            return self.targets[name]
        workers = workers or self.workers
        log_target = ""
        if access_log:
            path = self.out_dir / f"access-{name}.log"
            self.access_logs.append(path)
            log_target = str(path)
        engines = [
            {"name": "p0", "url": self.producer_url, "role": "producer"},
            {"name": "d0", "url": self.consumer_url, "role": "consumer"},
        ]
        config = write_config(engines, router_sections(workers, log_target, root))
        self.configs.append(config)
        router = RouterProcess.start(
            config, log_path=str(self.out_dir / f"router-{name}.log"), timeout=60, root=root, workers=workers
        )
        self.routers[name] = router
        target = Target(
            name,
            "narwhal",
            router.url,
            [router.proc.pid],
            alive=lambda: router.proc.poll() is None,
            detail={"workers": workers, "access_log": bool(access_log)},
        )
        self.targets[name] = target
        return target

    def baseline(self) -> Target | None:
        """The ``--baseline`` router, started once; on failure remember why and carry on."""
        if self.baseline_root is None or self.baseline_error is not None:
            return None
        try:
            return self.narwhal("baseline", root=self.baseline_root)
        except (RuntimeError, TimeoutError, OSError) as exc:
            self.baseline_error = f"the baseline router did not start: {exc}"
            return None

    def stop_router(self, name: str) -> None:
        router = self.routers.pop(name, None)
        self.targets.pop(name, None)
        if router is not None:
            router.stop(timeout=10)

    # -- peer ----------------------------------------------------------------------------------

    def start_peer(self, template: str, name: str = "peer") -> Target | None:
        """Start the peer router; on failure remember why and carry on without it."""
        self.peer_template = template
        try:
            return self._launch(template, name)
        except (ValueError, OSError, RuntimeError, TimeoutError) as exc:
            self.peer_error = str(exc)
            return None

    def floor(self, name: str = "aiohttp-floor") -> Target | None:
        """The aiohttp floor (``perf/load/floor_proxy.py``) under gunicorn with Narwhal's worker
        count, started once; a failure is remembered and the run goes on without it."""
        if name in self.targets:
            return self.targets[name]
        if self.floor_error is not None:
            return None
        root = Path(__file__).resolve().parent.parent
        template = (
            "env FLOOR_PRODUCER={producer_url} FLOOR_CONSUMER={consumer_url} "
            f"{shlex.quote(sys.executable)} -m gunicorn -c /dev/null --chdir {shlex.quote(str(root))} "
            f"-w {self.workers} -k aiohttp.GunicornUVLoopWebWorker -b 127.0.0.1:{{port}} perf.load.floor_proxy:app"
        )
        try:
            return self._launch(template, name)
        except (ValueError, OSError, RuntimeError, TimeoutError) as exc:
            self.floor_error = str(exc)
            return None

    def _launch(self, template: str, name: str) -> Target:
        """A command line on this fleet as a target, once it answers a completion."""
        peer = Peer(template, self.producer_url, self.consumer_url, self.out_dir / f"{name}.log")
        self.peers[name] = peer
        try:
            peer.wait_serving()
        except BaseException:
            self.stop_peer(name)
            raise
        target = Target(name, "peer", peer.url, [peer.proc.pid], alive=peer.alive, detail={"command": peer.command})
        self.targets[name] = target
        return target

    def stop_peer(self, name: str) -> None:
        peer = self.peers.pop(name, None)
        self.targets.pop(name, None)
        if peer is not None:
            peer.stop()

    # -- teardown ------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop everything; each step guarded so one failure never leaves the rest running."""
        for name in list(self.routers):
            with contextlib.suppress(Exception):
                self.stop_router(name)
        for name in list(self.peers):
            with contextlib.suppress(Exception):
                self.stop_peer(name)
        for fleet in {id(f): f for f in (self.consumer, self.producer) if f is not None}.values():
            if fleet is not None:
                with contextlib.suppress(Exception):
                    fleet.stop()
        self.consumer = self.producer = None
        for path in self.configs:
            with contextlib.suppress(OSError):
                os.unlink(path)
        for log in self.access_logs:  # megabytes of request lines: only their cost was wanted
            with contextlib.suppress(OSError):
                log.unlink()
        self.configs.clear()
        self.targets.clear()
