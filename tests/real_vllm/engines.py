"""Real vLLM engines on 127.0.0.1 for the real tier: a producer and a consumer, NixlConnector on CPU.

Each engine is ``python -m vllm.entrypoints.openai.api_server`` from the tier's own venv (the CPU
build's ``vllm`` command fails at start: it asks for a distribution named ``vllm``), with
``--kv-transfer-config`` for NixlConnector (``kv_buffer_device: "cpu"``, NIXL's UCX backend
moving DRAM to DRAM on loopback), its own ``VLLM_NIXL_SIDE_CHANNEL_PORT``, ``--enforce-eager``,
a small context and KV cache, and one OpenMP thread bound to its own core: two engines and the
router share the 2 cores. Both start together (about 35 s on 2 cores) and each is then warmed
with one ordinary request: a fresh CPU consumer whose *first* forward is a P/D decode died with
SIGILL in vLLM's CPU attention kernel (twice, on a host with AMX), and after one ordinary
request it served dozens.

An engine is its own process group (``start_new_session``), stopped by PID: SIGTERM, then
SIGKILL after a bound. Its log is kept beside the test's temporary folder and its tail is
quoted in any failure to start.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODEL = "tiny"
CONTEXT = 2048
START_BOUND_S = 240.0  # the first start on a cold page cache; ~35 s warm on 2 cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RealEngine:
    """One vLLM API server process group."""

    name: str
    role: str  # "producer" or "consumer"
    port: int
    side_port: int
    core: int
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kv_events_config(self) -> dict[str, object]:
        """The engine's ``--kv-events-config``: PUB and replay on Unix sockets beside its log."""
        base = self.log_path.parent / f"kv-{self.name}"
        return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{base}.pub",
                "replay_endpoint": f"ipc://{base}.replay", "topic": "kv", "buffer_steps": 1000}

    def start(self, python: Path, model_dir: Path) -> None:
        kv = {"kv_connector": "NixlConnector", "kv_role": "kv_" + self.role, "kv_buffer_device": "cpu"}
        argv = [
            str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(self.port),
            "--enforce-eager", "--max-model-len", str(CONTEXT), "--dtype", "bfloat16",
            "--kv-transfer-config", json.dumps(kv), "--enable-request-id-headers",
            "--enable-prompt-tokens-details",  # cached tokens in usage: what placement's prediction is judged by
        ]
        # Its KV-cache events, on a local socket (a wildcard tcp:// binds every interface): a
        # producer's for placement, a consumer's for a follow-up turn decoded where it is held.
        argv += ["--kv-events-config", json.dumps(self.kv_events_config())]
        env = {
            **os.environ,
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_port),
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
            "VLLM_CPU_OMP_THREADS_BIND": str(self.core),
            "OMP_NUM_THREADS": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            **self.env,
        }
        for key in [k for k in env if k.startswith(("NARWHAL_", "PROMETHEUS_MULTIPROC"))]:
            del env[key]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        out = self.log_path.open("ab")
        self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        out.close()

    def wait_ready(self, bound_s: float = START_BOUND_S) -> None:
        end = time.monotonic() + bound_s
        while time.monotonic() < end:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM {self.name} exited ({self.proc.returncode}) while starting:\n{self.tail()}")
            try:
                if get(self.url + "/health", 2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vLLM {self.name} not healthy after {bound_s:g}s:\n{self.tail()}")

    def warm(self) -> None:
        """One ordinary request (the module's text: the CPU kernel's first forward)."""
        status, body = post(self.url + "/v1/completions", {"model": MODEL, "prompt": "warm up", "max_tokens": 2}, 120)
        if status != 200:
            raise RuntimeError(f"vLLM {self.name}'s warm-up answered {status}: {body[:300]!r}")

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def stop(self, bound_s: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(bound_s)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait(10)

    def kill(self) -> None:
        """SIGKILL to the whole group, as the OOM killer or a lost host would."""
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(10)

    def tail(self, lines: int = 40) -> str:
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
        except OSError:
            return "(no log)"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> str:
        status, body = get(self.url + "/metrics", 10)
        assert status == 200, status
        return body.decode()


def get(url: str, timeout: float) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def post(url: str, body: Any, timeout: float) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 when there is none)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        series, _, rest = head.partition("{")
        if series != name or any(f'{k}="{v}"' not in rest for k, v in labels.items()):
            continue
        total += float(value)
    return total


def start_pair(python: Path, model_dir: Path, logs: Path) -> tuple[RealEngine, RealEngine]:
    """A producer on core 0 and a consumer on core 1, started together, each warmed."""
    producer = RealEngine("rp0", "producer", free_port(), free_port(), 0, logs / "rp0.log")
    consumer = RealEngine("rd0", "consumer", free_port(), free_port(), 1, logs / "rd0.log")
    started: list[RealEngine] = []
    try:
        for engine in (producer, consumer):
            engine.start(python, model_dir)
            started.append(engine)
        for engine in (producer, consumer):
            engine.wait_ready()
            engine.warm()
    except BaseException:
        for engine in started:
            engine.stop()
        raise
    return producer, consumer
