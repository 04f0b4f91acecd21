"""A consumer's learned holdings and the answer it wrote (docs/behaviour.md "Placement": follow-up
turns skip the prefill, without KV-cache events). The consumer that decoded a turn holds, right
after that prompt, the answer it wrote; the next turn sends that answer back, so a consumer whose
learned run reaches the answer's start is counted as holding the answer too. Also: a turn decoded
on the consumer alone is reported, so the turn after it follows."""

from __future__ import annotations

from typing import Any

import pytest

from narwhal.engines.endpoints import CHAT, MESSAGES, RESPONSES
from narwhal.fleet.placement.blocks import PrefixBlocks
from narwhal.request.affinity import Prompt
from narwhal.shm.holdings import Held
from tests.unit.fleet.held_support import PREFIX, PRODUCERS, build_held, place_blocks

D0 = len(PRODUCERS)  # the consumer's engine index
ANSWER = " t1" * 300  # 900 characters: long against the question, short against the prefix
LIMIT = 65537  # what the held policy reads of a prompt: max_prefix_chars + 1


def _turns(*answers: str) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": PREFIX}, {"role": "user", "content": "q0"}]
    for i, answer in enumerate(answers):
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"q{i + 1}"}]
    return messages


def _note(placement: Any, messages: list[dict[str, Any]]) -> PrefixBlocks:
    note = placement.policy.prepare(Prompt(CHAT, {"messages": messages}))
    assert isinstance(note, PrefixBlocks)
    return note


def _learned(holdings: Any, note: PrefixBlocks) -> None:
    """The consumer decoded ``note``'s prompt: its learned keys, as the supervisor publishes them."""
    keys = note.keys()
    holdings.held[D0] = Held(frozenset(keys), len(keys), None, None, None, 0.0, 0)


def test_the_consumer_that_decoded_the_turn_before_holds_its_answer_and_takes_the_follow_up_alone() -> None:
    placement, holdings, *_ = build_held(skip_prefill_share=0.9)
    _learned(holdings, _note(placement, _turns()))
    follow = _note(placement, _turns(ANSWER))
    before = PrefixBlocks(CHAT.dialect.affinity_text({"messages": _turns()}, LIMIT) or "", 256, 65536).count
    assert before / follow.count < 0.9  # the prompt alone would not do: the answer is what tips it
    found = place_blocks(placement, follow)
    assert (found.local, found.consumer.name, found.choice) == (True, "d0", "consumer_holds")


def test_a_consumer_that_never_reached_the_answer_is_not_credited_with_it() -> None:
    placement, holdings, *_ = build_held(skip_prefill_share=0.9)
    # It holds only the system prompt's first blocks: some other conversation's turn.
    keys = _note(placement, _turns()).keys()[:3]
    holdings.held[D0] = Held(frozenset(keys), len(keys), None, None, None, 0.0, 0)
    found = place_blocks(placement, _note(placement, _turns(ANSWER)))
    assert not found.local and found.choice != "consumer_holds"


def test_a_turn_decoded_alone_is_reported_so_the_turn_after_it_follows_too() -> None:
    placement, holdings, *_ = build_held(skip_prefill_share=0.9)
    _learned(holdings, _note(placement, _turns()))
    second = _note(placement, _turns(ANSWER))
    resv = place_blocks(placement, second)
    assert resv.local
    resv.decoded(5.0)
    (report,) = holdings.reports
    assert report[0] == D0 and report[6] == second.keys()  # its whole prompt, answer included
    _learned(holdings, second)
    third = place_blocks(placement, _note(placement, _turns(ANSWER, ANSWER)))
    assert (third.local, third.choice) == (True, "consumer_holds")


def test_without_the_follow_up_rule_nothing_is_asked_of_the_prompt() -> None:
    placement, holdings, *_ = build_held(skip_prefill_share=0)
    _learned(holdings, _note(placement, _turns()))
    note = _note(placement, _turns(ANSWER))
    assert not place_blocks(placement, note).local
    assert callable(note.answer)  # never asked


@pytest.mark.parametrize(("endpoint", "body", "answer"), [
    (CHAT, {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                         {"role": "assistant", "content": "the answer"}, {"role": "user", "content": "next"}]},
     "assistant\nthe answer\n"),
    (CHAT, {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "text", "text": "the "}, {"type": "text", "text": "answer"}]}, {"role": "user", "content": "n"}]},
     "assistant\nthe answer\n"),
    (MESSAGES, {"system": "s", "messages": [{"role": "user", "content": "q"},
                                            {"role": "assistant", "content": [{"type": "text", "text": "the answer"}]},
                                            {"role": "user", "content": "next"}]}, "assistant: the answer"),
    (MESSAGES, {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "the answer"},
                             {"role": "user", "content": "next"}]}, "assistant: the answer"),
    (RESPONSES, {"instructions": "be brief", "input": [
        {"role": "user", "content": "q"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "the answer"}]},
        {"role": "user", "content": "next"}]}, "assistant: the answer"),
])
def test_the_answers_place_is_where_the_affinity_text_writes_it(
    endpoint: Any, body: dict[str, Any], answer: str
) -> None:
    text = endpoint.dialect.affinity_text(body, LIMIT)
    span = endpoint.dialect.answer_span(body, LIMIT)
    assert span is not None and text[span[0]:span[1]] == answer


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "q"}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a final assistant turn: no answer yet"}],
])
def test_a_prompt_without_an_answer_followed_by_a_turn_has_none(messages: list[dict[str, Any]]) -> None:
    assert CHAT.dialect.answer_span({"messages": messages}, LIMIT) is None
    assert MESSAGES.dialect.answer_span({"messages": messages}, LIMIT) is None


def test_consumers_that_hold_as_much_take_it_least_loaded_first() -> None:
    # A long system prompt both consumers hold, a short new question: either may decode it alone;
    # the one with fewer decodes in flight does, not always the first of the list.
    placement, holdings, _, _, inflight = build_held(skip_prefill_share=0.9, consumers=2)
    system = _note(placement, _turns())
    for index in (D0, D0 + 1):
        _learned(holdings, system)
        holdings.held[index] = holdings.held[D0]
    d0, d1 = (e for e in placement.fleet.engines if e.name in ("d0", "d1"))
    assert inflight.try_reserve(d0, "decode", None)  # d0 busy with one decode
    found = place_blocks(placement, _note(placement, _turns()))
    assert (found.local, found.consumer.name) == (True, "d1")
    inflight.release(d0, "decode")
    assert inflight.try_reserve(d1, "decode", None) and inflight.try_reserve(d1, "decode", None)
    found = place_blocks(placement, _note(placement, _turns()))
    assert (found.local, found.consumer.name) == (True, "d0")
