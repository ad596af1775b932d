"""CPU tests of the benchmark helpers (a fake CuPy stands in for the device)."""
import sys
import types

from cuflux.bench.common import time_interleaved


class _Clock:
    """Fake device clock: each call of a timed fn advances it by that fn's cost (ms)."""
    now = 0.0


class _Event:
    def record(self, stream=None):
        self.t = _Clock.now

    def synchronize(self):
        pass


class _Stream:
    def synchronize(self):
        pass


def _fake_cupy(monkeypatch):
    cuda = types.SimpleNamespace(Event=_Event, get_current_stream=_Stream,
                                 get_elapsed_time=lambda a, b: b.t - a.t)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))


def test_time_interleaved_rotates_and_takes_each_fns_own_median(monkeypatch):
    _fake_cupy(monkeypatch)
    order, cost = [], {"a": 1.0, "b": 2.0, "c": 3.0}
    drift = {"d": 0.0}

    def make(name):
        def fn():
            order.append(name)
            _Clock.now += cost[name] + drift["d"]  # a slow drift, as clocks warm up
        return fn

    blocks = []
    got = time_interleaved({n: make(n) for n in cost}, rounds=4, iters=3, warmup=2,
                           before=lambda: blocks.append(len(order)),
                           after=lambda: drift.__setitem__("d", drift["d"] + 0.01))
    # warm-up: every fn twice; then 4 rounds x 3 fns, each a block of 3 calls
    assert order[:6] == ["a", "a", "b", "b", "c", "c"]
    timed = order[6:]
    assert len(timed) == 4 * 3 * 3 and len(blocks) == 12
    firsts = [timed[i] for i in range(0, len(timed), 9)]
    assert firsts == ["a", "b", "c", "a"]  # each round starts one fn later
    for name, c in cost.items():
        assert c <= got[name] < c + 0.12, (name, got[name])
    assert got["a"] < got["b"] < got["c"]


def test_all2all_back_to_back_alternates_the_op_and_its_twin(monkeypatch):
    from cuflux.bench.all2all import _back_to_back_ms

    _fake_cupy(monkeypatch)
    order = []
    # every timed block starts behind a hold of the stream (the host queues the block first)
    monkeypatch.setattr("cuflux.bench.all2all.hold_stream",
                        lambda stream, us: order.append(("hold", us >= 100)))

    def make(name, cost):
        def fn(i):
            order.append(name)
            _Clock.now += cost
        return fn

    ms, host_us, twin_ms = _back_to_back_ms(make("op", 2.0), _Stream(), calls=4, reps=3,
                                            warmup=1, twin=make("copy", 1.5))
    hold = ("hold", True)
    assert order == ["op", "copy"] + ([hold] + ["op"] * 4 + [hold] + ["copy"] * 4) * 3
    assert abs(ms - 2.0) < 1e-9 and abs(twin_ms - 1.5) < 1e-9 and host_us >= 0
    order.clear()
    assert _back_to_back_ms(make("op", 1.0), _Stream(), calls=2, reps=2, warmup=0)[2] is None
    assert order == [hold] + ["op"] * 2 + [hold] + ["op"] * 2


def test_ranks_share_gpu_ignores_the_self_link_and_agrees_across_ranks():
    from cuflux.bench.common import ranks_share_gpu
    from cuflux.topology import PeerLink, Topology

    def world(rank, size, same_gpu_peers, others_say=()):
        links = tuple(PeerLink(p, True, p == rank or p in same_gpu_peers, True,
                               "self" if p == rank else "nvlink") for p in range(size))
        return types.SimpleNamespace(
            rank=rank, size=size, topology=Topology(rank, links),
            allgather=lambda mine: [mine, *others_say])

    # the self link always says same_gpu: distinct GPUs must still read as not shared
    assert ranks_share_gpu(world(0, 2, (), others_say=(False,))) is False
    assert ranks_share_gpu(world(0, 2, (1,), others_say=(True,))) is True
    # one rank seeing a shared GPU decides for all (NCCL set up everywhere or nowhere)
    assert ranks_share_gpu(world(0, 3, (), others_say=(False, True))) is True
    assert ranks_share_gpu(world(0, 1, ())) is False
