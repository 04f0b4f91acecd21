"""gunicorn's ``child_exit`` in the master (``narwhal.master.gunicorn_hooks``): a worker gone frees
its slot and, with the holdings, the prefill work it had queued on producers (the
work stayed counted, since the master frees the slot before the supervisor's sweep could)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from narwhal import shm
from narwhal.master import gunicorn_hooks
from narwhal.shm.holdings import Holdings, HoldingsLayout
from narwhal.shm.holdings_view import WorkerHoldings
from narwhal.shm.shared import SharedFleet

P0 = 7


def test_a_gone_worker_leaves_no_queued_prefill_work_on_a_producer(monkeypatch: pytest.MonkeyPatch) -> None:
    shared = SharedFleet.create(engines=2, slots=2)
    holdings = Holdings.create(HoldingsLayout(sections=2, keys=8, slots=2, ring=4, entry_keys=4))
    monkeypatch.setattr(shm, "SHARED", shared)
    monkeypatch.setattr(shm, "POLICY_REGION", holdings)
    try:
        gone_pid = 999_999  # not a live process: the worker that died
        slot = shared.claim_slot(gone_pid)
        assert slot is not None
        WorkerHoldings(holdings, [P0, 0], slot=slot).add_work(0, 400)  # a prefill it had in flight
        other = WorkerHoldings(holdings, [P0, 0], slot=1 - slot)
        assert other.work() == [400, 0]
        gunicorn_hooks.child_exit(SimpleNamespace(), SimpleNamespace(pid=gone_pid))
        assert other.work() == [0, 0]
        assert shared.slot_pid(slot) == 0
    finally:
        shared.close()
