"""Local decode and the placement policy's note, decided once at admission from the parsed body (docs/behaviour.md
"Placement"): the request path hands the policy the prompt and carries what it keeps."""

from __future__ import annotations

from typing import Any

import pytest

from narwhal.engines import endpoints
from narwhal.engines.endpoints import CHAT, COMPLETIONS
from narwhal.fleet.placement.affinity import key_hash
from narwhal.fleet.placement.blocks import PrefixBlocks
from narwhal.fleet.placement.registry import build
from narwhal.request.affinity import prepared, prompt_head
from narwhal.settings import PlacementSettings

LONG = "You are a careful assistant who answers in French. " * 40  # ~2 KiB


def _settings(**values: Any) -> PlacementSettings:
    return PlacementSettings(**{"policy": "affinity", **values})


def placement_hints(endpoint: Any, body: dict[str, Any], settings: PlacementSettings) -> tuple[Any, bool]:
    """(the note, local decode), as the request path gets them (policy ``affinity`` unless told)."""
    local, note = prepared(endpoint, body, settings, build(settings))
    return note, local


def block_hints(endpoint: Any, body: dict[str, Any], settings: PlacementSettings, policy: Any = None) -> Any:
    """(the key, local decode, the blocks) under policy ``held``: its note is one or the other."""
    held = settings.model_copy(update={"policy": "held"})
    local, note = prepared(endpoint, body, held, policy or build(held))
    blocks = note if isinstance(note, PrefixBlocks) else None
    return (None if blocks is not None else note), local, blocks


def test_completions_prompt_forms_the_key_cut_to_affinity_chars() -> None:
    key, local = placement_hints(COMPLETIONS, {"prompt": LONG + "question one"}, _settings())
    assert (key, local) == (key_hash(LONG[:1024]), False)
    # Prompts that share their first affinity_chars characters share the key.
    assert placement_hints(COMPLETIONS, {"prompt": LONG + "question two"}, _settings())[0] == key


def test_the_forms_of_a_completions_prompt() -> None:
    assert prompt_head(COMPLETIONS, {"prompt": ["first", "second"]}, 100) == "first"
    assert prompt_head(COMPLETIONS, {"prompt": [1, 22, 333]}, 100) == "1 22 333"
    assert prompt_head(COMPLETIONS, {"prompt": [[7, 8], [9]]}, 100) == "7 8"
    assert prompt_head(COMPLETIONS, {"prompt": list(range(10_000))}, 10) == "0 1 2 3 4 "


def test_chat_key_is_roles_and_text_content_in_order() -> None:
    body = {"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "image_url", "image_url": {}},
                                     {"type": "text", "text": " there"}]},
    ]}
    assert prompt_head(CHAT, body, 1000) == "system\nbe brief\nuser\nhello there\n"
    assert prompt_head(CHAT, body, 10) == "system\nbe "


def test_short_prompts_have_no_key() -> None:
    assert placement_hints(COMPLETIONS, {"prompt": "x" * 63}, _settings()) == (None, False)
    assert placement_hints(COMPLETIONS, {"prompt": "x" * 64}, _settings())[0] == key_hash("x" * 64)


def test_affinity_off_no_key_and_nothing_read(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_: Any) -> None:
        raise AssertionError("the prompt was read")

    monkeypatch.setattr(type(COMPLETIONS.dialect), "affinity_text", boom)
    for settings in (_settings(prefix_affinity=False), _settings(policy="least_loaded")):
        assert prepared(COMPLETIONS, {"prompt": LONG}, settings, build(settings)) == (False, None)


def test_local_decode_below_local_prefill_chars() -> None:
    settings = _settings(local_prefill_chars=2000)
    assert placement_hints(COMPLETIONS, {"prompt": "short question"}, settings) == (None, True)
    assert placement_hints(COMPLETIONS, {"prompt": "x" * 1999}, settings) == (None, True)
    key, local = placement_hints(COMPLETIONS, {"prompt": "x" * 2000}, settings)
    assert (key, local) == (key_hash("x" * 1024), False)


def test_an_endpoint_without_prompt_text_has_no_key_and_no_local_decode() -> None:
    tokenize = endpoints.BY_PATH["/tokenize"]
    assert placement_hints(tokenize, {"prompt": LONG}, _settings(local_prefill_chars=10)) == (None, False)


@pytest.mark.parametrize(
    ("endpoint", "body", "text"),
    [
        ("/v1/responses", {"instructions": LONG, "input": "hi"}, LONG + "\nhi"),
        ("/v1/messages", {"system": LONG, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
         LONG + "\nuser: hi"),
        ("/inference/v1/generate", {"token_ids": list(range(600))}, " ".join(map(str, range(600)))),
    ],
)
def test_the_other_pd_endpoints_key_on_their_dialects_text(endpoint: str, body: dict[str, Any], text: str) -> None:
    registered = endpoints.BY_PATH[endpoint]
    key, local = placement_hints(registered, body, _settings())
    assert (key, local) == (key_hash(text[:1024]), False)
    assert placement_hints(registered, body, _settings(local_prefill_chars=len(text) + 1)) == (None, True)


def test_held_keeps_the_prompts_blocks_else_its_key_and_local_decode_comes_first() -> None:
    completions = COMPLETIONS
    key, local, blocks = block_hints(completions, {"prompt": LONG}, _settings())
    assert (key, local) == (None, False) and blocks is not None  # blocks place it: no key needed
    assert (blocks.count, blocks.cut, blocks.text) == (len(LONG) // 256, False, LONG)
    medium = LONG[:100]  # under a block, over affinity_min_chars: the affinity rule's key
    assert block_hints(completions, {"prompt": medium}, _settings()) == (key_hash(medium), False, None)
    assert block_hints(completions, {"prompt": "hi"}, _settings()) == (None, False, None)
    assert block_hints(completions, {"prompt": LONG}, _settings(local_prefill_chars=5000)) == (None, True, None)
    cut = block_hints(completions, {"prompt": LONG}, _settings(max_prefix_chars=512))[2]
    assert cut is not None and (cut.count, cut.cut, len(cut.text)) == (2, True, 513)
    assert block_hints(endpoints.BY_PATH["/tokenize"], {"prompt": LONG}, _settings()) == (None, False, None)


def test_block_hints_with_the_workers_memo_give_the_same_keys() -> None:
    body = {"messages": [{"role": "system", "content": LONG}, {"role": "user", "content": "and now?"}]}
    plain = block_hints(CHAT, body, _settings())[2]  # a policy of its own: a memo of its own
    policy = build(_settings(policy="held"))  # the worker's: its memo kept across requests
    for _ in range(2):  # the second from the memo
        blocks = block_hints(CHAT, body, _settings(), policy)[2]
        assert plain is not None and blocks is not None and blocks.keys() == plain.keys()
    assert len(policy._memo.table) == plain.count
