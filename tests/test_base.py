"""What every op inherits from CommOp (cuflux/ops/base.py). GPU tests: an output overlapping
an input refused, per-call arguments compared across ranks, abort after a timeout; each runs the
rank body beside it (@on_ranks) on W ranks sharing the GPU under mpiexec (W from
CUFLUX_TEST_WORLD_SIZES) and skips without a GPU ("no CUDA device"). CPU tests (no GPU): the
shared checks (aliasing, timeouts, capture refusal, the fused route's boundary) and the epoch
re-arm of host-counted ops."""
import math
import sys
import time

import numpy as np
import pytest

from cuflux.arrays import dtype_info
from cuflux.errors import CaptureError, CommTimeoutError
from cuflux.ops import base
from tests.fakes import FakeArray
from tests.mpi import on_ranks, world_sizes

WS = world_sizes()


# ---- GPU: each rank body, then its test(s) -------------------------------------------------------
@on_ranks
def aliasing(world):
    """An output overlapping an input is refused before any launch, and the op still works."""
    import cupy as cp

    from cuflux.ops.all2all import All2AllHeads
    from cuflux.ops.allreduce import AllReduceRMSNorm
    from cuflux.ops.gemm_rs import GemmReduceScatter
    W = world.size
    st = dtype_info("bfloat16").storage
    refused = 0
    with GemmReduceScatter(world, 64 * W, 64, 64, "bfloat16", timeout_s=30) as rs:
        a = cp.ones((64 * W, 64), st)
        b = cp.ones((64, 64), st)
        try:
            rs(a, b, out=a[:64])
        except ValueError as e:
            assert "overlaps a" in str(e), e
            refused += 1
        out = rs(a, b)
        rs.synchronize()
        assert float(out.astype(cp.float32).max()) == 64.0 * W
    with AllReduceRMSNorm(world, 16, 256, "bfloat16", timeout_s=30) as norm:
        x, res, w = cp.ones((4, 256), st), cp.ones((4, 256), st), cp.ones(256, st)
        try:
            norm(x, res, w, out=res)
        except ValueError as e:
            assert "overlaps residual" in str(e), e
            refused += 1
    with All2AllHeads(world, 8, 2 * W, 64, "bfloat16", timeout_s=30) as a2a:
        y = cp.ones((1, 8 * W, 2, 64), st)
        try:
            a2a.gather_heads(y, [8] * W, out=y.reshape(-1)[:8 * 2 * W * 64].reshape(
                1, 8, 2 * W, 64))
        except ValueError as e:
            assert "overlaps input" in str(e), e
            refused += 1
    return refused


test_outputs_overlapping_inputs_are_refused = aliasing.test(expect=3, sizes=WS[:2], timeout_s=300)


@on_ranks
def mismatched_m(world):
    """Ranks passing different M to GemmReduceScatter: ValueError on every rank (the first time
    a call's M is seen it is compared across ranks), nothing launched, the op still usable."""
    import cupy as cp

    from cuflux.ops.gemm_rs import GemmReduceScatter
    W, me = world.size, world.rank
    st = dtype_info("bfloat16").storage
    with GemmReduceScatter(world, 64 * W, 64, 64, "bfloat16", timeout_s=30) as rs:
        b = cp.ones((64, 64), st)
        M = 32 * W if me == 0 else 64 * W
        try:
            rs(cp.ones((M, 64), st), b)
            raised = False
        except ValueError as e:
            assert "differs between ranks" in str(e), e
            raised = True
        out = rs(cp.ones((64 * W, 64), st), b)
        rs.synchronize()
        assert float(out.astype(cp.float32).min()) == 64.0 * W
    return raised


test_mismatched_m_raises_on_every_rank = mismatched_m.test(
    expect=True, sizes=[w for w in WS if w > 1][:2], timeout_s=300)


@on_ranks
def abort_after_timeout(world, timeout_s=2.0):
    """The last rank never calls: the others raise CommTimeoutError within timeout + 2 s, and
    leaving the `with` block aborts at once instead of waiting at close()'s barrier."""
    import cupy as cp

    from cuflux.ops.allreduce import AllReduce
    W, me = world.size, world.rank
    st = dtype_info("bfloat16").storage
    late = me == W - 1
    op = AllReduce(world, 1 << 16, "bfloat16", timeout_s=timeout_s)
    x = cp.ones(1 << 16, st)
    if late:  # never calls; gives up its side locally once the others have
        time.sleep(timeout_s + 1.0)
        t1 = time.monotonic()
        op.abort()
        assert time.monotonic() - t1 < 1.0
        return None
    t0 = time.monotonic()
    waited = None
    try:
        with op:
            op(x)
            op.synchronize()
    except CommTimeoutError:
        waited = time.monotonic() - t0
    assert op.closed  # the with block aborted it
    t1 = time.monotonic()
    op.abort()  # idempotent
    assert time.monotonic() - t1 < 1.0
    assert waited is not None and waited < timeout_s + 2.0, waited
    return round(waited, 2)


@pytest.mark.gpu
@pytest.mark.parametrize("W", [w for w in WS if w > 1][:1])
def test_late_rank_times_out_and_abort_returns_at_once(W):
    res = abort_after_timeout.run(W, timeout_s=120)
    assert all(r is not None for r in res[:-1]) and res[-1] is None


# ---- CPU -----------------------------------------------------------------------------------------
def _arr(ptr, nbytes):
    a = FakeArray((nbytes // 2,), "float16", ptr=ptr)
    a.nbytes = nbytes
    return a


@pytest.mark.parametrize("out_ptr,overlap", [(0, True), (100, True), (4094, True),
                                             (4096, False), (8192, False), (-4096, False),
                                             (-4094, True)])
def test_output_overlapping_an_input_is_refused(out_ptr, overlap):
    base_ptr = 1 << 30
    x = _arr(base_ptr, 4096)
    out = _arr(base_ptr + out_ptr, 4096)
    if overlap:
        with pytest.raises(ValueError, match="out overlaps x"):
            base.check_no_alias("Op", out, x=x, w=None)
    else:
        base.check_no_alias("Op", out, x=x, w=None)


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), -math.inf, "30", True, None])
def test_timeouts_must_be_finite_positive_numbers(bad):
    with pytest.raises(ValueError, match="finite number of seconds > 0"):
        base.check_timeout("Op", bad)


@pytest.mark.parametrize("good", [1, 0.5, np.float64(2.0), 1e-3])
def test_good_timeouts(good):
    assert base.check_timeout("Op", good) == float(good)


def test_capture_refusal_names_the_op_and_why(monkeypatch):
    from cuflux import launch

    monkeypatch.setattr(launch, "capturing", lambda s: True)
    with pytest.raises(CaptureError, match="Op: cannot be captured in a CUDA graph: because"):
        base.refuse_capture("Op", 0, "because")
    monkeypatch.setattr(launch, "capturing", lambda s: False)
    base.refuse_capture("Op", 0, "because")


def test_index_cache_uploads_on_the_reading_stream_and_stays_bounded(monkeypatch):
    """IndexCache (an op's device index arrays per token count): put() uploads each array
    inside the reading stream's context and keeps them under the key; a put that would take
    the kept bytes past INDEX_CACHE_BYTES empties the cache first, once the call's stream is
    done (its arrays go back to the pool of the stream they were uploaded on)."""
    import contextlib

    import cupy

    uploads, current = [], [None]

    def asarray(a):
        uploads.append((current[0], a.nbytes))
        return a.copy()

    class On(contextlib.AbstractContextManager):  # a stand-in stream: current while entered
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            current[0] = self.name

        def __exit__(self, *exc):
            current[0] = None

        def synchronize(self):
            uploads.append((self.name, "synchronized"))

    monkeypatch.setattr(cupy, "asarray", asarray)
    monkeypatch.setattr(base, "INDEX_CACHE_BYTES", 1000)
    cache = base.IndexCache()
    q = np.arange(50, dtype=np.int64)  # 400 bytes
    got = cache.put((3, 4), (q, q[::-1].copy()), On("s1"))
    assert uploads == [("s1", 400), ("s1", 400)] and cache.nbytes == 800
    assert cache[(3, 4)] is got and (got[1] == q[::-1]).all()
    cache.put(7, (q[:20],), On("s2"))  # 160 bytes: 960 in all, kept
    assert sorted(cache, key=str) == [(3, 4), 7] and cache.nbytes == 960
    cache.put(8, (q[:10],), On("s2"))  # 80 more would pass 1000: emptied first, once s2
    assert list(cache) == [8] and cache.nbytes == 80  # (ordered after every call) is done
    assert uploads[-2:] == [("s2", "synchronized"), ("s2", 80)] and len(uploads) == 5


def test_unfused_below_m_is_gemms_cublas_boundary():
    """route="auto" runs a fused op unfused exactly where cuflux.gemm's untuned rule takes
    cuBLAS: below that the fused kernel (cuflux's GEMM core) loses to cuBLAS."""
    from cuflux.gemm_tuner import CUBLAS, CUBLAS_BELOW_M, heuristic

    assert base.UNFUSED_BELOW_M == CUBLAS_BELOW_M
    for M in (1, 16, 255, 256, 257, 4096):
        assert (base.fused_route("auto", M) == "unfused") == (heuristic(M, 8192, 8192) == CUBLAS)
    assert (base.fused_route("fused", 1) == "fused"
            and base.fused_route("unfused", 8192) == "unfused")
    with pytest.raises(ValueError, match="Op: route must be one of"):
        base.check_route("Op", "sometimes")


# ---- epoch re-arm (host-counted ops) -------------------------------------------------------------
class _Stream:
    done = True  # idle (CommOp._drain polls it)

    def __init__(self, log):
        self.log = log

    def synchronize(self):
        self.log.append("sync")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Comm:
    def __init__(self, log, silent_peer=None):
        self.log, self.silent_peer = log, silent_peer

    def barrier(self, timeout_s, what):
        from cuflux.errors import CommTimeoutError

        if self.silent_peer is not None:
            raise CommTimeoutError("OpComm", 0, self.silent_peer, timeout_s, what)
        self.log.append("barrier")


class _Record:
    def __init__(self):
        self.failures = []

    def check(self):
        pass

    def record_host_failure(self, code, peer, detail):
        self.failures.append((peer, detail))


def _counting_op(log, silent_peer=None):
    from types import SimpleNamespace

    op = object.__new__(base.CommOp)
    op.op, op.timeout_s, op.world = "GemmReduceScatter", 5.0, SimpleNamespace(rank=0)
    op.comm, op.err = _Comm(log, silent_peer), _Record()
    flags = {"flags": np.full(16, 7, np.uint32), "chunk_flags": np.full(4, 9, np.uint32)}
    op.buf = SimpleNamespace(local=lambda name: flags[name])
    op.epoch, op._epoch_regions = 0, ("flags", "chunk_flags")
    return op, flags


def test_epochs_count_up_then_rearm_before_the_32_bit_wrap():
    """No flag slot can stay unwritten for 2^31 calls: at EPOCH_REARM_AT calls the op drains,
    zeroes its flags between two barriers and counts from 1 again."""
    log = []
    op, flags = _counting_op(log)
    assert [op._next_epoch(_Stream(log)) for _ in range(3)] == [1, 2, 3] and log == []
    op.epoch = base.EPOCH_REARM_AT - 1
    assert op._next_epoch(_Stream(log)) == base.EPOCH_REARM_AT and log == []
    assert base.EPOCH_REARM_AT < 2**31  # distances below 2^31 compare correctly in sync.cuh
    assert op._next_epoch(_Stream(log)) == 1
    assert log == ["sync", "barrier", "sync", "barrier"]
    assert not flags["flags"].any() and not flags["chunk_flags"].any()


def test_a_silent_peer_at_the_rearm_fails_the_op_naming_it():
    from cuflux.errors import CommTimeoutError

    op, flags = _counting_op([], silent_peer=3)
    op.epoch = base.EPOCH_REARM_AT
    with pytest.raises(CommTimeoutError, match="rank 0 timed out .* waiting for rank 3"):
        op._next_epoch(_Stream([]))
    assert op.err.failures and op.err.failures[0][0] == 3
    assert flags["flags"].all()  # nothing zeroed while a peer may still write


# ---- a constructor that fails after CommOp.__init__ frees what it made -------------------------
def _fake_init_env(monkeypatch, log, fail_at=None):
    """A World, error record and failure board that log what is made and freed (no GPU)."""
    import contextlib
    from types import SimpleNamespace

    class Record:
        def __init__(self, op, rank, timeout_s):
            log.append("err")
            self.ptr, self.claim, self.timeout_ns = 1 << 40, None, 10**9

        def attach_board(self, board):
            log.append("attach")

        def close(self):
            log.append("err.close")

    def closer(name):
        return SimpleNamespace(close=lambda abort=False, streams=None: log.append(
            (f"{name}.close", abort, streams)))

    def sm_count(device):
        if fail_at == "sm_count":
            raise RuntimeError("sm_count")
        return 132

    monkeypatch.setattr(base, "ErrorRecord", Record)
    monkeypatch.setattr(base, "failure_board", lambda world, comm: (closer("board"), object()))
    monkeypatch.setattr(base, "sm_count", sm_count)
    monkeypatch.setattr(base, "ranks_on_my_gpu", lambda world: 1)
    comm = SimpleNamespace(free=lambda: log.append("comm.free"))
    return SimpleNamespace(rank=0, size=2, device=0, sub_comm=lambda op, t: comm,
                           device_context=contextlib.nullcontext,
                           alloc_layout=lambda layout, group=None: closer("buf"))


class _FailingOp(base.CommOp):
    def __init__(self, world, where):
        super().__init__(world, "AllReduce", 5.0)
        if where == "after_alloc":
            self._alloc(None)
        raise ValueError(where)


class _FailingChild(_FailingOp):  # a guarded constructor inside a guarded one: undone once
    def __init__(self, world, where):
        super().__init__(world, where)


@pytest.mark.parametrize("cls", [_FailingOp, _FailingChild])
@pytest.mark.parametrize("where", ["after_init", "after_alloc"])
def test_a_constructor_failing_after_commop_init_frees_everything_once(monkeypatch, cls, where):
    log = []
    world = _fake_init_env(monkeypatch, log)
    with pytest.raises(ValueError, match=where):
        cls(world, where)
    made = ["err", "attach"] + ([("buf.close", True, None)] if where == "after_alloc" else [])
    assert log == made + [("board.close", True, None), "err.close", "comm.free"], log


def test_a_failure_inside_commop_init_frees_what_it_made(monkeypatch):
    log = []
    world = _fake_init_env(monkeypatch, log, fail_at="sm_count")
    with pytest.raises(RuntimeError, match="sm_count"):
        _FailingOp(world, "never")
    assert log == ["err", "attach", ("board.close", True, None), "err.close", "comm.free"], log


class _ScratchOp(base.CommOp):
    _scratch = ("_big", "_other")

    def __init__(self, world):
        super().__init__(world, "AllReduce", 5.0)
        self._alloc(None)
        self._big, self._other, self._kept = object(), object(), object()


def _closing_env(monkeypatch, log):
    world = _fake_init_env(monkeypatch, log)
    world.sub_comm(None, None).check_close = lambda timeout_s: log.append("check_close")
    monkeypatch.setattr(base.ErrorRecord, "leave", lambda self: log.append("err.leave"),
                        raising=False)
    monkeypatch.setattr(base.ErrorRecord, "detach_board", lambda self: None, raising=False)
    monkeypatch.setattr(base.ErrorRecord, "abort", lambda self: log.append("err.abort"),
                        raising=False)
    return world


def test_close_lets_go_of_the_ops_scratch_once_the_buffer_is_closed(monkeypatch):
    """A closed op the caller keeps holds no scratch memory (GemmReduceScatter's partial can
    be max_m x n): let go after buf.close(), which synchronizes the device; the rest stays."""
    log = []
    op = _ScratchOp(_closing_env(monkeypatch, log))
    seen = []
    op.buf.close = lambda abort=False, streams=None: seen.append((op._big, op._other))
    op.close()
    assert seen and seen[0][0] is not None and seen[0][1] is not None  # still held at buf.close
    assert op._big is None and op._other is None and op._kept is not None
    op.close()  # idempotent


def test_abort_keeps_the_scratch_work_may_still_be_queued_on(monkeypatch):
    log = []
    op = _ScratchOp(_closing_env(monkeypatch, log))
    big = op._big
    op.abort()
    assert op._big is big and op._other is not None and "err.abort" in log


# ---- CPU: the call memo ------------------------------------------------------------------------
class _Nd:
    """Stands for a cupy.ndarray: what CallMemo.key reads (data.ptr, data.device_id, shape,
    dtype, _c_contiguous, strides)."""

    def __init__(self, ptr, shape=(4, 8), strides=(32, 4), dtype=np.float32, device=0):
        from types import SimpleNamespace

        self.data = SimpleNamespace(ptr=ptr, device_id=device)
        self.shape, self.strides, self.dtype = shape, strides, np.dtype(dtype)
        c_strides = tuple(int(np.prod(shape[i + 1:])) * self.dtype.itemsize
                          for i in range(len(shape)))
        self._c_contiguous = strides == c_strides  # CuPy's flag (CallMemo.key reads it)


def _memo(monkeypatch, current=0):
    monkeypatch.setattr(base, "current_device", lambda: current)
    m = base.CallMemo(0)
    m.ndarray = _Nd
    return m


def test_memo_keys_change_with_anything_a_check_reads(monkeypatch):
    """Two calls share a key only when every array argument has the same pointer, device,
    shape, strides and dtype, the arrays are as many, and the other arguments are equal."""
    m = _memo(monkeypatch)
    k = m.key((_Nd(0x1000), _Nd(0x2000)), "auto")
    assert k == m.key((_Nd(0x1000), _Nd(0x2000)), "auto")
    others = [((_Nd(0x1010), _Nd(0x2000)), "auto"),
              ((_Nd(0x1000, device=1), _Nd(0x2000)), "auto"),
              ((_Nd(0x1000, shape=(2, 16)), _Nd(0x2000)), "auto"),
              ((_Nd(0x1000, strides=(64, 4)), _Nd(0x2000)), "auto"),
              ((_Nd(0x1000, strides=(128, 4)), _Nd(0x2000)), "auto"),
              ((_Nd(0x1000, strides=(4, 16)), _Nd(0x2000)), "auto"),
              ((_Nd(0x1000, dtype=np.int32), _Nd(0x2000)), "auto"),
              ((_Nd(0x1000), _Nd(0x2000), _Nd(0x3000)), "auto"),
              ((_Nd(0x2000), _Nd(0x1000)), "auto"),
              ((_Nd(0x1000), _Nd(0x2000)), "one_shot")]
    keys = {m.key(a, e) for a, e in others}
    assert len(keys) == len(others) and k not in keys


def test_memo_takes_the_full_path_for_foreign_arrays_and_another_device(monkeypatch):
    m = _memo(monkeypatch)
    assert m.key((_Nd(0x1000), FakeArray((4, 8), "float32")), None) is None
    assert m.key((_Nd(0x1000), None), None) is None  # absent arrays are left out by callers
    assert m.get(None) is None and not m.wants(None)
    m = _memo(monkeypatch, current=1)  # the caller's current device is not the op's
    assert m.key((_Nd(0x1000),), None) is None


def test_memo_binds_a_key_at_its_second_call_and_stays_bounded(monkeypatch):
    m = _memo(monkeypatch)
    k = m.key((_Nd(0x1000),), None)
    assert m.get(k) is None and not m.wants(k)   # first call: only seen
    assert m.get(k) is None and m.wants(k)       # second: the full path binds it
    run = lambda stream: None  # noqa: E731
    m.put(k, run)
    assert m.get(k) is run and not m.wants(k)  # bound: a call its replay declined keeps it
    for i in range(3 * base.MEMO_MAX):  # a caller whose pointers never repeat ...
        m.wants(m.key((_Nd(0x10000 + 16 * i),), None))
    assert m.get(k) is run  # ... never evicts a bound call
    assert len(m.seen) <= base.MEMO_MAX  # the keys seen once stay bounded
    for i in range(base.MEMO_MAX):
        m.put(m.key((_Nd(0x100000 + 16 * i),), None), run)
    assert len(m.entries) <= base.MEMO_MAX and m.get(k) is None  # full: emptied
    m.clear()
    assert not m.entries and not m.seen


def test_memo_owns_only_cupy_arrays_on_the_op_device(monkeypatch):
    m = _memo(monkeypatch)
    assert m.owns(_Nd(0x1000), None, _Nd(0x2000))  # None: an absent argument
    assert not m.owns(_Nd(0x1000), FakeArray((4, 8), "float32"))
    assert not _memo(monkeypatch, current=1).owns(_Nd(0x1000))


class _Tensor:
    """Stands for a torch.Tensor: what CallMemo.owns and key read (data_ptr, get_device,
    shape, dtype, is_contiguous, stride, requires_grad, layout)."""

    def __init__(self, ptr, shape=(4, 8), strides=(8, 1), dtype="bfloat16", device=0,
                 requires_grad=False, layout="strided"):
        self.ptr, self.shape, self.strides, self.dtype = ptr, shape, strides, dtype
        self.device, self.requires_grad, self.layout = device, requires_grad, layout

    def data_ptr(self):
        return self.ptr

    def get_device(self):
        return self.device

    def is_contiguous(self):
        return self.strides == tuple(int(np.prod(self.shape[i + 1:]))
                                     for i in range(len(self.shape)))

    def stride(self):
        return self.strides


def _torch_memo(monkeypatch, current=0):
    monkeypatch.setattr(base, "torch_tensor_type", lambda: _Tensor)
    monkeypatch.setattr(base, "_strided", lambda: "strided")
    return _memo(monkeypatch, current)


def test_memo_owns_torch_tensors_that_a_replay_may_take(monkeypatch):
    """owns(): CUPY for CuPy arrays, TORCH for torch tensors on the op's device that do not
    require grad and are strided; 0 for a mix, anything else, or another current device."""
    m = _torch_memo(monkeypatch)
    assert m.owns(_Tensor(0x1000), None, _Tensor(0x2000)) == base.TORCH
    assert m.owns(_Nd(0x1000), _Nd(0x2000)) == base.CUPY
    for arrays in [(_Tensor(0x1000), _Nd(0x2000)), (_Nd(0x1000), _Tensor(0x2000)),
                   (_Tensor(0x1000, requires_grad=True),), (_Tensor(0x1000, device=1),),
                   (_Tensor(0x1000, device=-1),), (_Tensor(0x1000, layout="sparse_coo"),),
                   (_Tensor(0x1000), FakeArray((4, 8), "float32"))]:
        assert m.owns(*arrays) == 0, arrays
    assert _torch_memo(monkeypatch, current=1).owns(_Tensor(0x1000)) == 0
    # without torch imported nothing is a tensor
    monkeypatch.setattr(base, "torch_tensor_type", lambda: None)
    assert m.owns(_Tensor(0x1000)) == 0 and m.key((_Tensor(0x1000),)) is None


def test_memo_keys_torch_calls_by_what_their_checks_read(monkeypatch):
    """A torch call's key changes with pointer, device, shape, dtype, strides and
    requires_grad; a mix of CuPy arrays and tensors has none; a torch key never equals a
    CuPy key."""
    m = _torch_memo(monkeypatch)
    k = m.key((_Tensor(0x1000), _Tensor(0x2000)), "auto")
    assert k is not None and k == m.key((_Tensor(0x1000), _Tensor(0x2000)), "auto")
    others = [(_Tensor(0x1010), _Tensor(0x2000)), (_Tensor(0x1000, device=1), _Tensor(0x2000)),
              (_Tensor(0x1000, shape=(2, 16), strides=(16, 1)), _Tensor(0x2000)),
              (_Tensor(0x1000, strides=(1, 4)), _Tensor(0x2000)),
              (_Tensor(0x1000, dtype="float16"), _Tensor(0x2000)),
              (_Tensor(0x1000, requires_grad=True), _Tensor(0x2000)),
              (_Tensor(0x1000),)]
    keys = {m.key(a, "auto") for a in others}
    assert len(keys) == len(others) and k not in keys and None not in keys
    assert m.key((_Tensor(0x1000), _Nd(0x2000)), "auto") is None
    assert m.key((_Nd(0x1000), _Tensor(0x2000)), "auto") is None
    assert m.key((_Nd(0x1000), _Nd(0x2000)), "auto") != k
    assert _torch_memo(monkeypatch, current=1).key((_Tensor(0x1000),)) is None


def test_memo_outputs_of_torch_calls_come_from_torch(monkeypatch):
    """output(like=): torch's allocator (arrays.torch_empty) with the call's stream and the
    input to take the device and dtype from; the memo keeps none of them (the allocator hands
    a dropped block back by itself)."""
    m = _torch_memo(monkeypatch)
    asked = []
    monkeypatch.setattr(base, "torch_empty", lambda *a: asked.append(a) or ("tensor", a))
    like = _Tensor(0x1000)
    got = m.output((4, 8), np.float32, "stream", like=like)
    assert got == ("tensor", ((4, 8), np.float32, "stream", like))
    assert asked == [((4, 8), np.float32, "stream", like)]
    assert not m.outputs and m.kept_bytes == 0


def test_memo_outputs_come_back_once_dropped_two_per_shape_and_bounded(monkeypatch):
    """CallMemo.output's bookkeeping (CPU, stand-in arrays): a dropped output comes back; one
    held gets a new one, two kept per (shape, dtype, stream), the oldest shape evicted past
    OUTPUTS_KEPT, outputs over OUTPUT_KEPT_BYTES never kept, clear() lets all go."""
    from types import SimpleNamespace

    made = []  # how many were made (the outputs themselves are not held here)

    class Out:
        def __init__(self, shape, nbytes):
            self.shape, self.nbytes = shape, nbytes
            self.data = SimpleNamespace(mem=object(), ptr=len(made))

    def new(shape, dtype, stream):
        made.append(1)
        return Out(shape, 8 * int(np.prod(shape)))

    monkeypatch.setattr(base, "_new_output", new)
    monkeypatch.setattr(base, "stream_of", lambda s=None: SimpleNamespace(ptr=s or 0))
    m = _memo(monkeypatch)
    f = np.dtype(np.float64)
    a = m.output((4,), f)
    pa = a.data.ptr
    del a, made[:]
    assert m.output((4,), f).data.ptr == pa and not made  # dropped: back, nothing made
    y = m.output((4,), f)
    z = m.output((4,), f)  # y held: a second one
    assert z is not y and len(made) == 1
    del y
    assert m.output((4,), f).data.ptr == pa
    w = m.output((4,), f)  # both held (z, and the one just returned is dropped: ...)
    assert w.data.ptr == pa  # ... so it comes back
    v = m.output((4,), f)  # w and z held: a third, the oldest kept one let go
    assert v is not w and v is not z and len(m.outputs[((4,), f, 0, 0)]) == 2
    assert m.output((4,), f, stream=7) is not v  # another stream: its own
    for n in range(5, 5 + base.OUTPUTS_KEPT):
        m.output((n,), f)
    assert ((4,), f, 0, 0) not in m.outputs and len(m.outputs) == base.OUTPUTS_KEPT
    m.output((base.OUTPUT_KEPT_BYTES // 8 + 1,), f)
    assert all(k[0][0] != base.OUTPUT_KEPT_BYTES // 8 + 1 for k in m.outputs)
    m.clear()
    assert not m.outputs and m.kept_bytes == 0


def test_memo_outputs_are_all_new_where_reference_counts_are_not_trusted(monkeypatch):
    """Where reference counts may not show every holder (_COUNTS_HOLD false: Python 3.14+,
    free-threaded builds, other interpreters), CallMemo.output never hands an output back and
    keeps none."""
    from types import SimpleNamespace

    if sys.implementation.name == "cpython":  # the CPython builds it trusts: up to 3.13, GIL
        assert base._COUNTS_HOLD is (sys.version_info < (3, 14)
                                     and getattr(sys, "_is_gil_enabled", lambda: True)())
    made = []
    monkeypatch.setattr(base, "_COUNTS_HOLD", False)
    monkeypatch.setattr(base, "_new_output", lambda shape, dtype, s: made.append(1) or
                        SimpleNamespace(shape=shape, nbytes=8, data=SimpleNamespace(mem=None)))
    monkeypatch.setattr(base, "stream_of", lambda s=None: SimpleNamespace(ptr=0))
    m = _memo(monkeypatch)
    for _ in range(3):
        m.output((4,), np.dtype(np.float64))
    assert len(made) == 3 and not m.outputs and m.kept_bytes == 0


def test_memo_outputs_weak_refs_threads_lru_and_bytes(monkeypatch):
    """CallMemo.output (CPU, stand-in arrays): an output with a live weak reference does not
    come back (a weakly keyed cache would see it again); on the per-thread default stream
    each thread has its own outputs (one handle, a stream per thread: CuPy's pool keeps them
    apart too); a hit makes its shape the last evicted; the kept bytes stay within
    OUTPUTS_KEPT_BYTES."""
    import threading
    import weakref
    from types import SimpleNamespace

    class Out:
        def __init__(self, shape, nbytes):
            self.shape, self.nbytes = shape, nbytes
            self.data = SimpleNamespace(mem=object(), ptr=id(self))

    monkeypatch.setattr(base, "_new_output",
                        lambda shape, dtype, s: Out(shape, 8 * int(np.prod(shape))))
    monkeypatch.setattr(base, "stream_of", lambda s=None: SimpleNamespace(ptr=s or 0))
    m = _memo(monkeypatch)
    f = np.dtype(np.float64)
    y = m.output((4,), f)
    ref = weakref.ref(y)
    del y
    assert m.output((4,), f) is not ref()  # weakly held: not handed out again
    del ref
    mine = m.output((4,), f, stream=2)
    p = mine.data.ptr
    del mine
    theirs = []
    t = threading.Thread(target=lambda: theirs.append(m.output((4,), f, stream=2).data.ptr))
    t.start()
    t.join()
    assert theirs[0] != p and m.output((4,), f, stream=2).data.ptr == p
    m.clear()
    for n in (1, 2, 3, 4):
        m.output((n,), f)
    m.output((1,), f)  # a hit: (1,) used last
    m.output((5,), f)  # a fifth shape: (2,), used longest ago, goes
    assert [k[0] for k in m.outputs] == [(3,), (4,), (1,), (5,)]
    big = base.OUTPUT_KEPT_BYTES // 8
    for n in range(6):
        m.output((big - n,), f)
        assert m.kept_bytes <= base.OUTPUTS_KEPT_BYTES
    assert m.kept_bytes == sum(a.nbytes for v in m.outputs.values() for a, _ in v)
