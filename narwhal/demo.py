"""``narwhal demo``: a fake fleet (2 producers, 2 consumers) and the router on 127.0.0.1.

The router listens on 8080 by default, not 8000: 8000 is vLLM's own default port, so a demo
started next to a local vLLM would collide with it. A port that is taken ends the demo with one
line before anything is started (and again if another program takes it in the meantime).
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import sys
import threading

from narwhal.testing.harness import FakeFleet, RouterProcess, write_config

MODEL = "fake-model"
DEFAULT_PORT = 8080
HOST = "127.0.0.1"


def _port_in_use(port: int) -> bool:
    """Whether binding the router's socket would fail with EADDRINUSE (as harness binds it)."""
    if port == 0:
        return False
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def _busy(port: int) -> int:
    print(f"narwhal demo: {HOST}:{port} is already in use; pick another port with --port N "
          "(0 picks a free one)", file=sys.stderr)
    return 1


def _banner(url: str) -> str:
    return f"""
Narwhal is routing on {url} (2 producers p0,p1 -> 2 consumers d0,d1, all fake vLLM engines).

Try it:

  curl -N {url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "Hello"}}], "stream": true, "max_tokens": 8}}'

Or with the openai SDK (pip install openai):

  from openai import OpenAI
  client = OpenAI(base_url="{url}/v1", api_key="unused")
  for chunk in client.chat.completions.create(
      model="{MODEL}", messages=[{{"role": "user", "content": "Hello"}}], stream=True, max_tokens=8
  ):
      print(chunk.choices[0].delta.content or "", end="", flush=True)

Metrics: {url}/metrics   Ready: {url}/ready
Press Ctrl-C to stop everything.
"""


def run_demo(port: int = DEFAULT_PORT, workers: int = 2) -> int:
    """``narwhal demo``: fake fleet and router on ``port`` until a signal (0); 1: the port is busy, the router died."""
    if _port_in_use(port):
        return _busy(port)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    # vLLM 0.33 as the fake imitates it by default, with its prefix cache (a benchmark client
    # pointed at the demo sees cached tokens) and /inference/v1/generate served.
    fleet = FakeFleet.start(["p0", "p1", "d0", "d1"], args=["--model", MODEL, "--token-delay-s", "0.02",
                                                            "--prefix-cache", "--enable-scale-out"])
    config = None
    router = None
    try:
        engines = [
            {"name": name, "url": url, "role": "producer" if name.startswith("p") else "consumer"}
            for name, url in fleet.engines.items()
        ]
        config = write_config(
            engines,
            {"server": {"workers": workers}, "preflight": {"on_start": False}, "log": {"format": "text"}},
        )
        try:
            router = RouterProcess.start(config, port=port, log_path="-")
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            return _busy(port)  # taken after the check above
        print(_banner(router.url), flush=True)
        while not stop.wait(0.5):
            if router.proc.poll() is not None:
                print("narwhal demo: the router exited", file=sys.stderr)
                return 1
        print("\nstopping…", flush=True)
        return 0
    finally:
        if router is not None:
            router.stop()
        fleet.stop()
        if config is not None:
            os.unlink(config)
