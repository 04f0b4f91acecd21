"""One request's share of the engine's models: its batch slot, its prefix-cache lookup, its prefill.

Why a module of its own: every route that generates (completions, chat, and whatever routes come
next) goes through the same three steps, and keeping them here keeps the completion path in
``generate`` a matter of ordering events. With every model off (the default) ``Work`` costs an
uncontended slot and nothing else: no prompt text is built, nothing is hashed.

The steps, in vLLM's order:

1. ``Work.prepare`` (after validation): with the prefix cache on, the prompt text as the engine
   sees it is cut into 4-character tokens, which become the request's ``prompt_tokens``, and its
   chained block hashes are computed once;
2. ``run`` (when generation starts: after the headers of a stream, after the consumer's KV pull):
   wait for a batch slot in FIFO order, then, unless the KV came from a producer (a decode with
   ``do_remote_prefill``), look the blocks up, spend the prefill cost of the uncached tokens on the
   engine's prefill lane; cache the blocks (the ones a producer sent too, as vLLM's scheduler does
   once they are received: a consumer then holds, and publishes, the prompts it decoded); returns
   the cached tokens for ``usage``. As vLLM's
   ``RequestStateStats``: the wait for the slot is the request's ``vllm:request_queue_time_seconds``,
   from the slot (scheduled) to its prefill done its ``vllm:request_prefill_time_seconds``;
3. ``end`` (always, in the handler's ``finally``): give the slot back.

KV usage is vLLM's block pool (``prefix.PrefixCache``): a prompt's full blocks are hashed and
shared by every running request whose prefix has them (one block each in
``kv_cache_usage_perc``), its partial tail is its own; a block in use cannot be evicted.

Invariant: a ``Work`` holds at most one slot and ``end`` releases exactly what ``run`` took, on
every path (abort mid-wait, mid-prefill or mid-stream included), so ``vllm:num_requests_running``
and ``kv_cache_usage_perc`` return to their idle values. It sits above ``state`` and ``parse`` and
below ``generate``.
"""

from __future__ import annotations

import time
from typing import Any

from narwhal.fake_engine.chunks import token_text
from narwhal.fake_engine.parse import ParsedRequest
from narwhal.fake_engine.prefix import prompt_text, text_tokens
from narwhal.fake_engine.state import EngineState


class Work:
    """The slot, blocks and cache hashes of one request."""

    __slots__ = ("hashes", "computes", "slot", "blocks", "announce", "text")

    def __init__(self, hashes: list[int] | None, computes: bool, announce: str | None = None,
                 text: str | None = None) -> None:
        self.hashes = hashes
        self.computes = computes  # False: the KV was computed elsewhere (a remote prefill)
        self.slot = False
        self.blocks = 0  # blocks of this request alone (its hashed blocks are shared, while it has a slot)
        self.announce = announce  # the prompt text, when its reused blocks are to be re-announced (full report)
        self.text = text  # the prompt text, which the output's blocks extend (generated)

    @classmethod
    def prepare(cls, engine: EngineState, req: ParsedRequest, body: dict[str, Any]) -> Work:
        """Before any wait: the prompt's tokens and block hashes when the prefix cache is on, else nothing."""
        computes = not (req.kv_params is not None and req.kv_params.get("do_remote_prefill") is True)
        cache = engine.cache
        if cache is None:
            return cls(None, computes)
        text = prompt_text(body, req.chat, req.kind)
        req.prompt_tokens = text_tokens(text)
        full = engine.release.minor >= (0, 26) and _report_mode(body) == "full"
        return cls(cache.block_hashes(text), computes, text if full else None, text)

    async def run(self, engine: EngineState, req: ParsedRequest) -> int:
        """Wait for a slot, then prefill what the cache lacks; the cached prompt tokens."""
        sched = engine.scheduler
        queued = time.monotonic()
        await sched.acquire()
        self.slot = True
        scheduled = time.monotonic()
        engine.queue_time.observe(scheduled - queued)
        blocks = req.prompt_tokens // engine.kv.block_size
        cache = engine.cache
        if cache is not None and self.hashes:  # a cached block is one block however many use it
            cache.acquire(self.hashes)
            blocks = max(blocks - len(self.hashes), 0)
        self.blocks = blocks
        sched.running_blocks += blocks
        if cache is not None:
            cache.trim(sched.running_blocks)  # this request's blocks were allocated
        if not self.computes:
            if cache is not None and self.hashes:  # the loaded blocks are cached, as vLLM's scheduler caches
                cache.insert(self.hashes, sched.running_blocks)  # them once received (_update_waiting_for_remote_kv)
            engine.prefill_time.observe(time.monotonic() - scheduled)  # nothing to compute: its first token is now
            return 0
        cached = 0
        if cache is not None and self.hashes is not None:
            cached = cache.lookup(self.hashes, req.prompt_tokens)
            engine.prefix_queries += req.prompt_tokens
            engine.prefix_hits += cached
            if cached and self.announce is not None:  # kv_cache_report_mode "full": the reused prefix again
                cache.announce(self.announce, cached // cache.block_size)
        cost = engine.load_model.prefill_s_per_token * (req.prompt_tokens - cached)
        if cost > 0:
            await sched.prefill(cost)
        if cache is not None and self.hashes:
            cache.insert(self.hashes, sched.running_blocks)
        # Scheduled until its prefill is done, the wait on the prefill lane behind the prefills
        # booked before it included (on a GPU they share its steps), the batch queue not.
        engine.prefill_time.observe(time.monotonic() - scheduled)
        return cached

    def generated(self, engine: EngineState, req: ParsedRequest, n: int) -> None:
        """The request generated ``n`` tokens: the blocks they filled are cached too, as vLLM
        caches a request's full blocks as its decode fills them (``BlockStored`` with the output's
        token ids): prompt, the chat template's generation prompt, then the output. A follow-up
        turn whose prompt carries the answer finds them. A continuation's (its prompt holds earlier
        output already) and generate's (token ids, no text) are left out."""
        cache = engine.cache
        if cache is None or self.text is None or self.hashes is None or n <= 0 or req.start or req.kind == "generate":
            return
        # The generation prompt of the fake's template, after a prompt rendered from roles.
        header = "assistant\n" if req.kind in ("chat", "messages", "responses") and self.text.endswith("\n") else ""
        output = "".join([token_text(i) for i in range(n)])
        hashes = cache.block_hashes(self.text + header + output)
        if len(hashes) > len(self.hashes):
            cache.insert(hashes[len(self.hashes):], engine.scheduler.running_blocks)

    def end(self, engine: EngineState) -> None:
        """Give back the slot and blocks :meth:`run` took; idempotent, called on every path."""
        if self.slot:
            self.slot = False
            engine.scheduler.running_blocks -= self.blocks
            cache = engine.cache
            if cache is not None and self.hashes:
                cache.release(self.hashes)
            engine.scheduler.release()


def _report_mode(body: dict[str, Any]) -> Any:
    """``kv_cache_report_mode`` as vLLM reads it: ``SamplingParams.extra_args`` (``vllm_xargs``, or
    generate's ``sampling_params.extra_args``)."""
    xargs = body.get("vllm_xargs")
    if not isinstance(xargs, dict):
        params = body.get("sampling_params")
        xargs = params.get("extra_args") if isinstance(params, dict) else None
    return xargs.get("kv_cache_report_mode") if isinstance(xargs, dict) else None
