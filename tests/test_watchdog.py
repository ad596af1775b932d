"""The stream-wait watchdog's bookkeeping, with fake events and streams (no GPU needed)."""
import threading
import time

from cuflux import errors as E
from cuflux import watchdog
from tests.fakes import FakeErrorRecord


class FakeEvent:
    def __init__(self, *a, **k):
        self.done = False

    def record(self, stream):
        pass


def _waiter(monkeypatch, timeout_s):
    import cupy

    monkeypatch.setattr(cupy.cuda, "Event", FakeEvent)
    monkeypatch.setattr(watchdog.driver, "stream_wait_value32", lambda *a, **k: None)
    w = watchdog.StreamWaiter.__new__(watchdog.StreamWaiter)
    w.err, w.device, w.op_code = FakeErrorRecord(timeout_s, rank=0), None, 1
    w._pending, w._lock, w._thread, w._stop = {}, threading.Lock(), None, threading.Event()
    w.expired = []

    def expire(item, status, release=True, record=True):
        w.expired.append((item.peer, time.monotonic()))
        if int(w.err.words[E.STATUS]) == 0:
            w.err.words[E.PEER], w.err.words[E.STATUS] = item.peer, status
    w._expire = expire
    return w


def _items(w, stream):
    return list(w._pending[stream])


def test_budget_starts_when_the_stream_reaches_the_wait(monkeypatch):
    w = _waiter(monkeypatch, timeout_s=0.1)
    try:
        w.wait(7, 0x1000, 5, peer=1)
        w.wait(7, 0x1004, 5, peer=2)
        first, second = _items(w, 7)
        time.sleep(0.3)  # queued long ago but never reached: no timeout
        assert w.expired == []
        first.reached.done = True  # the stream reaches the first wait
        t0 = time.monotonic()
        time.sleep(0.3)
        assert [p for p, _ in w.expired] == [1]
        assert 0.1 <= w.expired[0][1] - t0 < 0.2
        assert int(w.err.words[E.STATUS]) == E.STATUS_TIMEOUT and int(w.err.words[E.PEER]) == 1
        # Released: the stream passes it and reaches the next wait, which the failed op releases
        # at once instead of spending another timeout.
        first.passed.done = True
        second.reached.done = True
        t1 = time.monotonic()
        time.sleep(0.05)
        assert [p for p, _ in w.expired] == [1, 2]
        assert w.expired[1][1] - t1 < 0.03
        second.passed.done = True
        time.sleep(0.01)
        assert 7 not in w._pending  # its queue passed: gone
    finally:
        w.close()


def test_waits_that_pass_are_dropped_and_streams_are_independent(monkeypatch):
    w = _waiter(monkeypatch, timeout_s=0.05)
    try:
        w.wait(1, 0x10, 1, peer=3)
        w.wait(2, 0x20, 1, peer=4)
        (a,), (b,) = _items(w, 1), _items(w, 2)
        a.reached.done = a.passed.done = True  # passed at once
        b.reached.done = True  # stream 2 blocked
        time.sleep(0.2)
        assert [p for p, _ in w.expired] == [4] and list(w._pending) == [2]  # 1's queue gone
    finally:
        w.close()


def test_failed_op_does_not_queue_new_waits(monkeypatch):
    w = _waiter(monkeypatch, timeout_s=1)
    w.err.words[E.STATUS] = E.STATUS_TIMEOUT
    w.wait(1, 0x10, 1, peer=0)
    assert w._pending == {} and w._thread is None
