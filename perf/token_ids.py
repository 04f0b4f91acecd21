"""What the prompt's token ids cost (docs/decisions.md "Token ids from the engine"): ``/tokenize`` on a
producer against a tokenizer in the router.

Placement by the engines' KV-cache events needs each prompt's token ids as the engine makes them.
Two ways were measured, on the same chat prompts (a system prompt and a question, about
``--chars`` characters):

* **from the engine**: two routers under real gunicorn (one worker each) over one fake fleet
  (a producer and a consumer, publishing KV events): one follows the events (and so asks the
  producer's ``/tokenize`` before placement), the other has ``placement.kv_events = false``.
  Requests go one at a time, interleaved; per request: the router workers' CPU (from
  ``/proc/<pid>/task/*/schedstat``) and the time to the answer's first byte.
* **in the router**: ``transformers``' ``apply_chat_template`` (``tokenize=True``, the path vLLM
  itself runs, Jinja and ``tokenizers``) on a tokenizer folder, timed in ``--tokenizer-python``
  (an interpreter that has ``transformers``: the real tier's venv, docs/testing.md).

Usage: ``python -m perf.token_ids [--requests 300] [--chars 4000] [--tokenizer DIR
--tokenizer-python PY]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp

from narwhal.testing.harness import FakeFleet, RouterProcess, router_roles, write_config

MODEL = "fake-model"


def cpu_ns(pids: list[int]) -> int:
    """The CPU time, in ns, every thread of ``pids`` ran so far (``/proc/<pid>/task/*/schedstat``)."""
    total = 0
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            total += int((task / "schedstat").read_text().split()[0])
    return total


def _router(fleet: FakeFleet, tmp: str, follow: bool) -> RouterProcess:
    engines = [{"name": "p0", "role": "producer", "url": fleet.engines["p0"]},
               {"name": "d0", "role": "consumer", "url": fleet.engines["d0"]}]
    conf = {"server": {"workers": 1}, "preflight": {"on_start": False},
            "log": {"access_log": os.path.join(tmp, f"access-{follow}.log"), "level": "warning"},
            "placement": {"kv_events": follow}}
    return RouterProcess.start(write_config(engines, conf), log_path=os.path.join(tmp, f"router-{follow}.log"),
                               workers=1)


def _prompt(i: int, chars: int) -> dict[str, object]:
    system = f"conversation {i}: " + "".join(f"house rule {k}: answer plainly. " for k in range(chars // 30))
    return {"model": MODEL, "max_tokens": 2, "stream": True,
            "messages": [{"role": "system", "content": system[:chars]}, {"role": "user", "content": f"question {i}"}]}


async def first_byte(session: aiohttp.ClientSession, url: str, body: dict[str, object]) -> float:
    """One streamed chat completion through ``url``: seconds to its first body byte (read whole)."""
    start = time.perf_counter()
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.read()
        await resp.content.readany()
        first = time.perf_counter() - start
        await resp.read()
    return first


async def _measure(routers: dict[str, RouterProcess], requests: int, chars: int) -> dict[str, tuple[float, float]]:
    pids = {name: router_roles(r.proc.pid)["worker"] for name, r in routers.items()}
    cpu = dict.fromkeys(routers, 0)
    ttft: dict[str, list[float]] = {name: [] for name in routers}
    async with aiohttp.ClientSession() as session:
        for router in routers.values():  # warm: connections, the events followed
            for i in range(20):
                await first_byte(session, router.url, _prompt(-1 - i, chars))
        for i in range(requests):
            for name, router in routers.items():
                before = cpu_ns(pids[name])
                ttft[name].append(await first_byte(session, router.url, _prompt(i, chars)))
                cpu[name] += cpu_ns(pids[name]) - before
    return {name: (cpu[name] / requests / 1e3, statistics.median(ttft[name]) * 1e3) for name in routers}


def _in_process(python: str, tokenizer: str, chars: int, calls: int = 200) -> float:
    code = f"""
import time, transformers
tok = transformers.AutoTokenizer.from_pretrained({tokenizer!r})
system = "".join(f"house rule {{k}}: answer plainly. " for k in range({chars} // 30))[:{chars}]
msgs = lambda i: [{{"role": "system", "content": f"conversation {{i}}: " + system}},
                  {{"role": "user", "content": f"question {{i}}"}}]
for i in range(20):
    tok.apply_chat_template(msgs(i), tokenize=True, add_generation_prompt=True)
start = time.process_time()
for i in range({calls}):
    tok.apply_chat_template(msgs(i), tokenize=True, add_generation_prompt=True)
print((time.process_time() - start) / {calls} * 1e6)
"""
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--chars", type=int, default=4000)
    parser.add_argument("--tokenizer", help="a tokenizer folder (tokenizer.json, chat template)")
    parser.add_argument("--tokenizer-python", help="an interpreter with transformers")
    args = parser.parse_args()
    fleet = FakeFleet.start(["p0", "d0"], args=["--model", MODEL, "--kv-events", "--lease-s", "60"])
    tmp = tempfile.mkdtemp(prefix="narwhal-token-ids-")
    routers: dict[str, RouterProcess] = {}
    try:
        routers = {"events (/tokenize)": _router(fleet, tmp, True), "no events": _router(fleet, tmp, False)}
        figures = asyncio.run(_measure(routers, args.requests, args.chars))
    finally:
        for router in routers.values():
            router.stop()
        fleet.stop()
    print(f"chat prompts of ~{args.chars} characters, {args.requests} requests each, c=1, one worker")
    print(f"{'router':<22}{'worker CPU µs/request':>24}{'TTFT p50 ms':>14}")
    for name, (cpu_us, ttft_ms) in figures.items():
        print(f"{name:<22}{cpu_us:>24.0f}{ttft_ms:>14.2f}")
    if args.tokenizer and args.tokenizer_python:
        print(f"in the router (apply_chat_template, tokenize=True): "
              f"{_in_process(args.tokenizer_python, args.tokenizer, args.chars):.0f} µs CPU per prompt")


if __name__ == "__main__":
    main()
