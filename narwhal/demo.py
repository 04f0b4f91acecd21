"""``narwhal demo``: a fake fleet (2 producers, 2 consumers) and the router on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import sys
import threading

from narwhal.harness import FakeFleet, RouterProcess, write_config

MODEL = "fake-model"


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


def run_demo(port: int = 8000, workers: int = 2) -> int:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    fleet = FakeFleet.start(["p0", "p1", "d0", "d1"], args=["--model", MODEL, "--token-delay-s", "0.02"])
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
        router = RouterProcess.start(config, port=port, log_path="-")
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
