"""The chaos suite's verdict on one reply (perf.chaos.faults.judge): a fault's exact outcome is
held to the letter unless an engine or process fault it overlapped explains another one."""

from __future__ import annotations

from perf.chaos.faults import Expectation, Result, Window, judge


def _close_after_five() -> Expectation:
    # A stream the fake closes after 5 tokens: the client must see 5 tokens, then the disconnect.
    return Expectation("close_mid_stream", {"decode": {"close_after": 5}}, 16, None,
                       allowed={"term:502:engine_disconnect"}, term_tokens=5)


def _cut_after(tokens: int) -> Result:
    return Result(idx=1, kind="close_mid_stream", outcome="term:502:engine_disconnect", tokens=tokens,
                  start=6.375, end=6.594)


def test_a_stream_cut_early_with_no_fault_to_explain_it_is_a_violation() -> None:
    res = _cut_after(2)
    judge(res, _close_after_five(), [], strict=False)
    assert (res.verdict, res.problem) == ("violation", "2 tokens before terminal, expected 5")


def test_a_consumer_stopped_mid_stream_explains_fewer_tokens_and_a_continuation_cut_again() -> None:
    stop = [Window("stop_consumer", "cd1", start=6.59, end=9.1)]
    fewer = _cut_after(2)
    judge(fewer, _close_after_five(), stop, strict=False)
    assert fewer.verdict == "allowed"
    more = _cut_after(7)  # continued after the cut at 5 (a migration), then cut by the stop
    judge(more, _close_after_five(), stop, strict=False)
    assert more.verdict == "allowed"
    unexplained = _cut_after(7)
    judge(unexplained, _close_after_five(), [], strict=False)
    assert (unexplained.verdict, unexplained.problem) == ("violation", "7 tokens before terminal, expected 5")
    too_many = _cut_after(17)  # never more than asked
    judge(too_many, _close_after_five(), stop, strict=False)
    assert too_many.verdict == "violation"
    exact = _cut_after(5)
    judge(exact, _close_after_five(), [], strict=False)
    assert exact.verdict == "allowed"
