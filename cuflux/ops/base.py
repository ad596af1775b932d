"""CommOp: what every collective op owns, written once.

An op holds a World, an error record that its kernels and watchdogs write on timeout, a
symmetric buffer (allocated by the op once it knows its layout), an open/closed state and the
timeout that bounds every wait. This base owns all of that and the call-path steps every op
takes in the same order:

  1. `_check_open()`           closed? a failed wait recorded? (a host-memory read: no sync)
  2. the op's argument checks  (its own module; clear errors before any launch)
  3. `_no_capture(stream)`     only for paths that cannot be captured in a CUDA graph
  4. the launch                (cuflux.launch: argument blocks cached, ~4-5 us a launch)

A call the op has checked and launched before, with the same arguments (the same arrays at
the same addresses, shapes, strides and dtypes; the same other arguments), skips steps 2-3 and
replays what it launched (`CallMemo`): the checks read nothing else, so they would pass again.

Kernels take the error record as four trailing arguments (`self.err_args`: record pointer,
claim word, timeout in ns, op code); they never change, so they are built once here.

At W > 1 the op also holds a failure board (cuflux.errors.FailureBoard: a word per rank in host
memory the op's ranks share, its pointers in the error record's words): whoever fails the op
first, a kernel's wait, a host exchange, the stream-wait watchdog or abort(), writes it on every
rank. Waits everywhere then give up at their next check, and every rank's next call and
synchronize() raise (PeerFailedError on the ranks that were told), so a late but alive rank
never returns outputs that its peers' queued work may have half overwritten.
"""
from __future__ import annotations

import contextlib
import functools
import sys
import time
import warnings
import weakref
from threading import get_ident

import numpy as np

from cuflux.arrays import _ndarray, empty_on, stream_of, torch_empty, torch_tensor_type
from cuflux.arrays import torch_strided as _strided  # (tests put a stand-in here)
from cuflux.errors import (OP_CODES, CaptureError, CommTimeoutError, CufluxError, ErrorRecord,
                           FailureBoard, NoDeviceError)
from cuflux.launch import current_device
from cuflux.nodes import require_one_node
from cuflux.resource import Closeable
# one check for every timeout_s (ops and World); the ranks sharing this GPU, as the World counts
from cuflux.world import check_timeout, ranks_on_my_gpu

__all__ = ["CommOp", "DEFAULT_TIMEOUT_S", "check_timeout", "refuse_capture", "ranks_on_my_gpu",
           "sm_count", "on_world_device", "on_op_device", "require_world_device",
           "check_no_alias", "ROUTES", "UNFUSED_BELOW_M", "check_route", "fused_route",
           "max_unfused_m", "CallMemo", "IndexCache", "MEMO_MAX", "INDEX_CACHE_BYTES",
           "OUTPUTS_KEPT", "OUTPUT_KEPT_BYTES", "OUTPUTS_KEPT_BYTES"]

# Bound of every wait of an op, unless its constructor is given another. Long enough for a
# peer that is compiling kernels on first use (up to ~40 s a file, once per machine) to be
# reported as late rather than dead only when it truly is; short enough to surface a hang.
DEFAULT_TIMEOUT_S = 30.0

_SM_COUNTS: dict[int, int] = {}

# A fused GEMM + collective op (GemmReduceScatter, AllGatherGemm) runs one of two routes:
# "fused" (its own kernel: the GEMM core with the communication in its prologue or epilogue) or
# "unfused" (cuflux.gemm, which takes cuBLAS at small M, then the op's own collective through the
# same buffers). GemmReduceScatter's route="auto" runs unfused below UNFUSED_BELOW_M rows of the
# GEMM: there cuflux's GEMM core loses to cuBLAS (gemm's own untuned rule, CUBLAS_BELOW_M) and
# there is too little GEMM time to hide the communication under. Its two routes use different
# flag protocols, so every rank must take the same one without asking: the rule is a function of
# M alone, never of the tuner's per-machine table. AllGatherGemm's routes share one gather
# protocol (each rank only consumes what it gathered), so its "auto" follows the GEMM tuner's
# winner for the shape (gemm_tuner.fastest: fused where our core was the faster; ops/ag_gemm.py).
ROUTES = ("auto", "fused", "unfused")

# Host-counted call epochs (AllGather, AllGatherGemm) reach the kernels (and stream waits) as
# 32-bit flag values compared with wrap-around (sync.cuh epoch_reached): a slot left unwritten
# for 2^31 calls (a tile or chunk beyond the M of every recent call) would read as reached. Long
# before that the op re-arms (CommOp._next_epoch): each rank drains its work, zeroes its own
# flags between two bounded barriers and counts again from 1; every rank makes the same calls,
# so every rank re-arms at the same call.
EPOCH_REARM_AT = 1 << 30
UNFUSED_BELOW_M = 256  # = cuflux.gemm_tuner.CUBLAS_BELOW_M (tests/test_base.py checks it)



def sm_count(device: int) -> int:
    """Multiprocessors of a device (cached: the attribute query costs microseconds)."""
    n = _SM_COUNTS.get(device)
    if n is None:
        from cupy.cuda import runtime

        n = _SM_COUNTS[device] = runtime.deviceGetAttribute(
            runtime.cudaDevAttrMultiProcessorCount, device)
    return n


def check_route(op: str, route, routes: tuple = ROUTES) -> str:
    if route not in routes:
        raise ValueError(f"{op}: route must be one of {routes}, got {route!r}")
    return route


def fused_route(route: str, M: int) -> str:
    """"fused" or "unfused": what a call whose GEMM has M rows runs (see ROUTES)."""
    if route != "auto":
        return route
    return "unfused" if M < UNFUSED_BELOW_M else "fused"


def max_unfused_m(route: str, max_m: int) -> int:
    """The largest M (<= max_m) for which fused_route(route, M) is "unfused"; 0 if none."""
    if route == "fused":
        return 0
    return max_m if route == "unfused" else min(max_m, UNFUSED_BELOW_M - 1)


def refuse_capture(op: str, stream, why: str) -> None:
    """Refuse, before anything is enqueued, a path that cannot run inside a CUDA graph."""
    from cuflux.launch import capturing

    if capturing(stream):
        raise CaptureError(f"{op}: cannot be captured in a CUDA graph: {why}")


def on_world_device(init):
    """Constructor decorator: the body runs with the World's GPU current (the caller's current
    device restored after), so every stream, module and allocation lands on the op's device."""
    @functools.wraps(init)
    def wrapper(self, world, *args, **kwargs):
        ctx = getattr(world, "device_context", None)  # test doubles of a World have none
        with ctx() if ctx is not None else contextlib.nullcontext():
            return init(self, world, *args, **kwargs)
    return wrapper


def on_op_device(method):
    """Call decorator: where the caller's current device is not the op's, the call runs with the
    op's device current (0.1 us to ask when it already is)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        world = self.world
        if (getattr(world, "device_context", None) is not None
                and current_device() != world.device):
            with world.device_context():
                return method(self, *args, **kwargs)
        return method(self, *args, **kwargs)
    return wrapper


def require_world_device(world, op: str) -> int:
    """world.device, or NoDeviceError "{op}: needs a CUDA device; <why>": the one message every
    op gives on a machine (or a rank) without a GPU."""
    if world.device is None:
        from cuflux.world import require_device

        require_device(op)  # no GPU on this machine: says why (no driver, CUDA sees none)
        raise NoDeviceError(f"{op}: needs a CUDA device; rank {world.rank}'s World has none "
                            f"(it was built when CUDA saw no device)")
    return world.device


def check_no_alias(op: str, out, **inputs) -> None:
    """Refuse an output whose memory overlaps an input's (GemmReduceScatter's out over a,
    All2AllHeads' out over y, AllReduceRMSNorm's out over residual, ...): the kernels read an
    input after other blocks wrote their output, so an overlap is a silent race."""
    lo = out.data.ptr
    hi = lo + out.nbytes
    for name, x in inputs.items():
        if x is not None and x.data.ptr < hi and lo < x.data.ptr + x.nbytes:
            raise ValueError(f"{op}: out overlaps {name} in memory; pass a separate output")


MEMO_MAX = 256  # calls an op remembers (CallMemo); a full memo is emptied
INDEX_CACHE_BYTES = 64 << 20  # an op's index arrays kept on the device (IndexCache)
OUTPUTS_KEPT = 4  # (shape, dtype, stream)s whose outputs a CallMemo keeps (CallMemo.output),
OUTPUT_KEPT_BYTES = 64 << 20  # each output at most this big (larger: cupy.empty per call),
OUTPUTS_KEPT_BYTES = 256 << 20  # all of a memo's kept outputs together at most this
_PER_THREAD_STREAM = 2  # cudaStreamPerThread: one handle, a stream per thread
# CallMemo.output reads "nothing holds it" from reference counts as CPython up to 3.13 keeps
# them (every reference a caller can hold is counted); elsewhere (3.14's borrowed stack
# references, free-threaded builds, other interpreters: untried) every output is new.
_COUNTS_HOLD = (sys.implementation.name == "cpython" and sys.version_info < (3, 14)
                and getattr(sys, "_is_gil_enabled", lambda: True)())


class IndexCache(dict):
    """Index arrays an op keeps on the device per key (row orders per token count, ...),
    emptied once a new one would take them past INDEX_CACHE_BYTES (keys follow token counts:
    a server's changing batches must not pile them up). put() uploads on the stream that
    reads them; emptying waits for the call's stream first, which the op orders after every
    earlier call (a later call on another stream may have read an array: the pool would
    reuse it in the order of the stream it was uploaded on alone)."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0

    def put(self, key, arrays: tuple, stream) -> tuple:
        """(cupy.asarray(a) for a in arrays), uploaded on `stream` and kept under key."""
        import cupy

        n = sum(a.nbytes for a in arrays)
        if self.nbytes + n > INDEX_CACHE_BYTES:
            stream.synchronize()  # (rare: once per INDEX_CACHE_BYTES of new arrays)
            self.clear()
            self.nbytes = 0
        with stream:
            got = self[key] = tuple(cupy.asarray(a) for a in arrays)
        self.nbytes += n
        return got


class CallMemo:
    """The calls an op has checked and launched, by what its checks and its plan read of
    them, each with what it launched bound to the call's pointers (launch.Bound, or any
    callable taking the stream handle): a call seen before replays that, no check, no plan,
    no argument packing (AllReduceRMSNorm at W = 1: 7.3 us a call against 10.6 for the full
    path, scripts/results/probe_call_path-h200-2026-12-02d.txt).

    key(): per array argument (all CuPy arrays or all torch tensors, none of them None: the
    caller leaves out the absent ones, and their absence shows in the key's length or in
    `extra`) its device pointer, device, shape, dtype and C-contiguity (or, where not
    contiguous, its strides), and for a tensor whether it requires grad: what contiguity,
    shape, dtype, device, alignment and overlap checks read; then `extra` (the call's other
    arguments, each of a type whose equality is the full path's: an int stands for an int,
    never for a float or a bool that equals it); None, the full path, where the arguments
    are of mixed or other kinds, or the caller's current device is not the op's. Memory
    freed and reallocated at the same address under the same key passes the same checks,
    so a hit stays right. A torch caller's hit returns the caller's own tensors (out=) or
    ones torch's allocator made (output(like=)): torch in, torch out, no DLPack (which cost
    a torch call 100-250 us: scripts/results/probe_torch_path-h200-2026-12-02.txt).

    An output the op allocates (out=None) is made before the key (owns() says where it may
    be; output() makes it), so a loop that drops its outputs gets the same memory again and
    its calls hit too. put() binds a key at its second call only: a caller whose pointers
    never repeat pays one dict insert a call, not a bind. Keys seen once are kept apart from
    bound ones (`seen`), so such a caller never evicts the bound calls. Each bounded
    (MEMO_MAX; a full one is emptied)."""

    __slots__ = ("device", "entries", "seen", "ndarray", "outputs", "kept_bytes")

    def __init__(self, device):
        self.device = device
        self.entries: dict = {}  # key -> its bound replay
        self.seen: dict = {}  # keys seen once (bound at their second call)
        self.ndarray = None
        self.outputs: dict = {}  # (shape, dtype, stream, thread) -> [[array, its references]]
        self.kept_bytes = 0  # of the arrays in self.outputs

    def output(self, shape, dtype, stream=None, like=None):
        """An output the op owns (a call with out=None), on the current device, for a call
        on `stream` (any stream_of takes; None: the current one): one this memo handed out
        before for (shape, dtype, stream) again where nothing but the memo holds it any more
        (the caller dropped it: the array, its pointer and its memory objects referenced as
        often as when it was made and no weak reference to the array, so no view, pointer,
        DLPack capsule or consumer of it is alive), else a new one from the pool arena of
        that stream (cupy.empty: 3-5 us of host time on the H200 machine). Its memory is
        reused only in that stream's order, as CuPy's pool would reuse it, at no allocation,
        and the call's key repeats (on the per-thread default stream, in the calling thread's
        order: each thread's outputs apart, as CuPy's pool keeps them). Two are kept per
        (shape, dtype, stream): `y = op(x)` holds the last output while the next call is
        made. A caller that keeps its outputs gets a new array each call, as from
        cupy.empty. Kept: the outputs of the OUTPUTS_KEPT (shape, dtype, stream) used last,
        each at most OUTPUT_KEPT_BYTES, all together at most OUTPUTS_KEPT_BYTES (memory
        CuPy's pool would cache for reuse anyway); clear() (the op's close()) lets them go.

        like: the call's input, where owns() said TORCH a torch tensor: the output is then
        one from torch's caching allocator instead (arrays.torch_empty), which hands a dropped
        block back by itself (nothing kept here: the allocator sees every holder, views
        included)."""
        if like is not None and type(like) is not self._nd():
            return torch_empty(shape, dtype, stream, like)
        s = stream_of(stream)
        if not _COUNTS_HOLD:
            return _new_output(shape, dtype, s)
        p = s.ptr
        k = (shape, dtype, p, get_ident() if p == _PER_THREAD_STREAM else 0)
        outputs = self.outputs
        kept = outputs.get(k)
        if kept is not None:
            for arr, refs in kept:
                if arr.shape == shape and _references(arr) == refs:
                    if len(outputs) > 1:
                        outputs[k] = outputs.pop(k)  # used last: evicted last
                    return arr
        arr = _new_output(shape, dtype, s)
        n = arr.nbytes
        if n <= OUTPUT_KEPT_BYTES:
            if kept is not None and len(kept) >= 2:
                self.kept_bytes -= kept.pop(0)[0].nbytes  # both held: keep the newer two
            while outputs and (self.kept_bytes + n > OUTPUTS_KEPT_BYTES
                               or (kept is None and len(outputs) >= OUTPUTS_KEPT)):
                oldest = next(iter(outputs))  # the (shape, dtype, stream) used longest ago
                self.kept_bytes -= sum(a.nbytes for a, _ in outputs.pop(oldest))
                if oldest == k:
                    kept = None
            if kept is None:
                kept = outputs[k] = []
            kept.append([arr, None])
            kept[-1][1] = _references(arr)  # counted while kept as output() counts above
            self.kept_bytes += n
        return arr

    def _nd(self):
        return self.ndarray or _ndarray()  # (a stand-in class where tests set one)

    def owns(self, *arrays) -> int:
        """Whether a call on these arrays (None: absent) may be keyed, and in which framework:
        CUPY (every one a CuPy array), TORCH (every one a torch.Tensor on the op's device that
        does not require grad), else 0; and the op's device current (the types first: any
        other array never costs the device query). An op allocates its output before the key
        only where this holds (TORCH: output(like=a tensor) of torch's allocator)."""
        kind = _kind(self._nd(), arrays, self.device)
        return kind if kind and current_device() == self.device else 0

    def key(self, arrays: tuple, extra=None):
        nd = self._nd()
        k = [extra]
        if type(arrays[0]) is nd:
            for a in arrays:
                if type(a) is not nd:
                    return None
                d = a.data
                # CuPy's C-contiguity flag (an attribute read) stands for the strides, whose
                # tuple costs as much as the shape's; a non-contiguous array keeps its strides
                k += (d.ptr, d.device_id, a.shape, a.dtype, a._c_contiguous or a.strides)
        else:
            tensor = torch_tensor_type()
            if tensor is None:
                return None
            for a in arrays:
                if type(a) is not tensor:
                    return None
                # what the full path's intake reads (arrays._torch_as_cupy): a tensor that
                # requires grad is refused there, so it never hits a key bound without
                k += (a.data_ptr(), a.get_device(), a.shape, a.dtype,
                      a.is_contiguous() or a.stride(), a.requires_grad)
        if current_device() != self.device:
            return None
        return tuple(k)

    def get(self, key):
        """The bound call of `key` (None: not bound yet, or key None)."""
        return self.entries.get(key) if key is not None else None

    def wants(self, key) -> bool:
        """Whether the full path should bind this call: its key's second sighting (not a
        key already bound, whose replay declined the call: it stays)."""
        if key is None or key in self.entries:
            return False
        seen = self.seen
        if seen.pop(key, None) is not None:
            return True
        if len(seen) >= MEMO_MAX:
            seen.clear()
        seen[key] = True
        return False

    def put(self, key, bound) -> None:
        if len(self.entries) >= MEMO_MAX:
            self.entries.clear()
        self.entries[key] = bound

    def clear(self) -> None:
        self.entries.clear()
        self.seen.clear()
        self.outputs.clear()
        self.kept_bytes = 0


_new_output = empty_on  # CallMemo.output's allocation (tests put a stand-in here)
CUPY, TORCH = 1, 2  # CallMemo.owns: the framework of a call's arrays


def _kind(nd, arrays, device) -> int:
    """CUPY, TORCH or 0 for CallMemo.owns (the device is the caller's)."""
    kind = 0
    tensor = None
    for a in arrays:
        if a is None:
            continue
        if type(a) is nd:
            if kind == TORCH:
                return 0
            kind = CUPY
            continue
        if tensor is None:
            tensor = torch_tensor_type()
        if (tensor is None or type(a) is not tensor or kind == CUPY or a.requires_grad
                or a.get_device() != device or a.layout is not _strided()):
            return 0  # (a sparse tensor has no data_ptr for the key)
        kind = TORCH
    return kind


def _references(arr) -> tuple:
    """How often an array, its MemoryPointer and its memory object are referenced, and its
    weak references: a view holds the array (its base), a pointer made from it or an array
    over it the others; a cache keyed weakly by the array must not see it come back."""
    d = arr.data
    return (sys.getrefcount(arr), sys.getrefcount(d), sys.getrefcount(d.mem),
            weakref.getweakrefcount(arr))


def failure_board(world, comm):
    """(buffer, FailureBoard) of a new op: one uint32 per rank in host memory shared by the op's
    ranks (collective over the op's communicator, bounded); (None, None) at W = 1."""
    if world.size == 1:
        return None, None
    from cuflux.symmetric import Layout

    layout = Layout()
    layout.add("failed", (1,), np.uint32)
    # At offset 0, so the buffer's table of base pointers (ptrs_dev) is the table of every
    # rank's word that kernels tell through.
    assert layout.regions["failed"].offset == 0
    layout.add("left", (1,), np.uint32)  # the rank has left the op (FailureBoard.gone)
    layout.add("pid", (2,), np.uint32)   # its process: pid, pid namespace
    buf = world.alloc_layout(layout, group=comm, memory="host")
    try:
        ranks = range(world.size)
        board = FailureBoard(world.rank, [buf.host_ptr(r, "failed") for r in ranks],
                             buf.ptr(world.rank, "failed"), buf.ptrs_dev.data.ptr,
                             left_addrs=[buf.host_ptr(r, "left") for r in ranks],
                             pid_addrs=[buf.host_ptr(r, "pid") for r in ranks])
    except BaseException:
        buf.close(abort=True, streams=())
        raise
    return buf, board


class CommOp(Closeable):
    """Base of the collective ops. Subclasses set `self.buf` (a SymmetricBuffer, or None) and
    free whatever else they own in `_free()`; `close()` is collective (every rank calls it)."""

    board_buf = None  # the failure board's symmetric buffer (W > 1; failure_board)
    # Attributes holding device memory that only this op's own kernels and copies touch
    # (scratch, staging): let go at a clean close(), after buf.close() synchronized the device,
    # so a closed op the caller keeps holds none of it; abort() keeps them (work may be queued).
    _scratch: tuple[str, ...] = ()
    # The class of cuflux.ops.across that runs this op on a World of several nodes (issue 20):
    # constructing the op on such a World builds that instead, with the same arguments.
    ACROSS: str | None = None

    def __new__(cls, *args, **kwargs):
        world = args[0] if args else kwargs.get("world")
        nodes = getattr(world, "nodes", None)  # test doubles of a World may have none
        # The class's own ACROSS only: a user's subclass of an op is not silently replaced by
        # the cross-node form (it gets require_one_node's error instead).
        across_name = cls.__dict__.get("ACROSS")
        if across_name is not None and nodes is not None and nodes.num_nodes > 1:
            from cuflux.ops import across

            return getattr(across, across_name)(*args, **kwargs)  # not a cls: no __init__
        return super().__new__(cls)

    def __init__(self, world, op: str, timeout_s: float):
        """Collective: every rank builds its ops in the same order (World.sub_comm checks it).
        Subclasses call it before their own collectives and allocate inside
        `with world.device_context():` (the caller's current device is never moved)."""
        self.op = op
        timeout_s = check_timeout(op, timeout_s)
        require_world_device(world, op)
        require_one_node(world, op)
        self.world = world
        self.timeout_s = timeout_s
        self.buf = None
        self.comm = world.sub_comm(op, timeout_s)  # the op's own communicator, agreed id
        self.err = None
        self._ready = True  # from here on a failure undoes what was made (_undo_init)
        try:
            with world.device_context():
                self.err = ErrorRecord(op, world.rank, timeout_s)
                self.board_buf, board = failure_board(world, self.comm)
            if board is not None:
                self.err.attach_board(board)
            self.num_sms = sm_count(world.device)
            self.sharers = ranks_on_my_gpu(world)
        except BaseException:
            self._undo_init()
            raise
        self.err_args = (np.uint64(self.err.ptr), self.err.claim, np.uint64(self.err.timeout_ns),
                         np.uint32(OP_CODES[op]))
        self._agreed: set = set()
        self._memo = CallMemo(world.device)  # calls checked and launched before
        self._last_stream = None  # where this rank's latest call was queued (abort, close)
        self.epoch = 0  # host-counted ops: the latest call's epoch (see EPOCH_REARM_AT)
        self._epoch_regions: tuple[str, ...] = ()  # their flag regions in self.buf

    def __init_subclass__(cls, **kwargs):
        """Every op's constructor is guarded: an exception after CommOp.__init__ (a check, a
        collective, a kernel load, an allocation of the subclass) frees the communicator, the
        error record, the failure board and the symmetric buffer before it goes up."""
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None:
            return

        @functools.wraps(init)
        def guarded(self, *args, **kw):
            try:
                init(self, *args, **kw)
            except BaseException:
                self._undo_init()
                raise

        cls.__init__ = guarded

    def _alloc(self, layout):
        """The op's symmetric buffer, agreed over its own communicator (bounded); a failure
        goes up through the guarded constructor, which undoes the rest (_undo_init)."""
        with self.world.device_context():
            self.buf = self.world.alloc_layout(layout, group=self.comm)
        return self.buf

    _ready = False  # between CommOp.__init__ taking the communicator and an undo

    def _undo_init(self) -> None:
        """A constructor failing after CommOp.__init__ took the op's communicator: close the
        symmetric buffer and the failure board locally (kept mapped, leaked: work the subclass
        queued, or a watchdog thread it started, may still touch them), then free the error
        record and the communicator. Idempotent; a no-op before CommOp.__init__ got that far."""
        if not self._ready:
            return
        self._ready = False
        if self.buf is not None:
            self.buf.close(abort=True, streams=None)
        if self.board_buf is not None:
            self.board_buf.close(abort=True, streams=None)
        if self.err is not None:
            self._close_err()
        self.comm.free()

    # ---- the call path -----------------------------------------------------------------------
    def _replayed(self, run, stream, like=None) -> bool:
        """A memo hit (CallMemo): `run`, the call's bound replay, on its stream (None: the
        current one of like's framework, as stream_of), once the caller checked the op's
        state; False where the replay declined (nothing enqueued: the full path)."""
        s = stream_of(stream, like)
        self._last_stream = s
        return run(s.ptr) is not False

    def _check_open(self) -> None:
        if self._closed:
            raise CufluxError(f"{self.op}: the op is closed")
        self.err.check()  # host memory read: no synchronisation, capture-safe

    def _agree(self, key, what: str) -> None:
        """The first time this rank sees `key` (a call's collective arguments: token counts,
        M, ...), check every rank passes the same (bounded, over the op's communicator); known
        keys cost a set lookup. Ranks making the same calls see new keys at the same calls. A
        rank whose key is new while a peer's is not times out (CommTimeoutError) rather than
        hang."""
        if key in self._agreed:
            return
        try:
            self.comm.check_same(key, f"{self.op}: {what}")
        except CommTimeoutError as e:
            self._host_failure(e, f"comparing the call's {what} with every rank")
        if len(self._agreed) < 4096:
            self._agreed.add(key)

    def _agreed_bind(self, agree_key, what: str, memo_key) -> bool:
        """_agree(agree_key) at W > 1, then whether the full path binds this call for the memo
        (CallMemo.wants): never a call whose agreement is not remembered (a full `_agreed`),
        as a hit would skip it."""
        if self.world.size > 1 and agree_key not in self._agreed:
            self._agree(agree_key, what)
            if agree_key not in self._agreed:
                return False
        return self._memo.wants(memo_key)

    def _host_failure(self, e: CommTimeoutError, doing: str):
        """A bounded host exchange of the op timed out: the op is failed, as if a kernel's wait
        had expired (every later call raises), and the error names the silent peer."""
        detail = f"{doing}: no answer from rank {e.peer}"
        self.err.record_host_failure(OP_CODES[self.op], e.peer, detail)
        raise CommTimeoutError(self.op, self.world.rank, e.peer, self.timeout_s, detail) from e

    def _next_epoch(self, stream) -> int:
        """The next call's epoch (1, 2, ...; 32-bit in the kernels), re-arming first when the
        count reaches EPOCH_REARM_AT (collective: every rank reaches it at the same call)."""
        if self.epoch >= EPOCH_REARM_AT:
            self._rearm(stream)
        self.epoch += 1
        return self.epoch

    def _rearm(self, stream) -> None:
        """Every flag of this rank's in self._epoch_regions back to 0, and the count to 0. The
        first barrier: every rank's earlier calls are done (they write into this rank's flags);
        the second: no rank starts a call (and writes here) before every rank has zeroed."""
        what = f"re-arming the call epochs after {self.epoch} calls"
        # Polled: an op's own stream (a copy lane) may stay held by a guarded copy after a
        # failure, and a stream sharing its hardware queue with it too; err.check() raises it.
        self._drain(self._streams() or ())
        self.err.check()
        stream.synchronize()
        try:
            self.comm.barrier(self.timeout_s, f"{self.op}: {what}")
            with stream:
                for name in self._epoch_regions:
                    self.buf.local(name).fill(0)
            stream.synchronize()
            self.comm.barrier(self.timeout_s, f"{self.op}: {what}")
        except CommTimeoutError as e:
            self._host_failure(e, what)
        self.epoch = 0

    def _grid_cap(self, limit: int) -> int:
        """Blocks a grid that spins on its peers may have: `limit`, and no more than this GPU's
        SMs split among the ranks on it (their grids run side by side and must all stay
        resident); the smallest over the op's ranks, so that every rank launches the same grid
        (collective, bounded)."""
        cap = min(limit, max(1, self.num_sms // self.sharers))
        return min(self.comm.allgather(cap, what=f"{self.op} grid cap"))

    def _no_capture(self, stream, why: str) -> None:
        refuse_capture(self.op, stream, why)

    # ---- lifetime ----------------------------------------------------------------------------
    def _drain(self, streams, bound_s: float | None = None, stop_on_failure: bool = True) -> bool:
        """Wait until every stream in `streams` is idle (True), polling: until the op has failed
        (a copy lane may then stay held by a guarded copy until its peer leaves the op: see
        watchdog.StreamWaiter.wait(guard=True)) unless not stop_on_failure, and at most bound_s
        seconds when given (False). Spins for the first millisecond (a healthy synchronize
        costs no sleep granularity), then sleeps 0.1 ms a poll; sleep releases the GIL, which
        the stream-wait watchdog's thread needs."""
        t0 = time.monotonic()
        for st in streams:
            while not st.done:
                if stop_on_failure and self.err.failed():
                    return False
                waited_s = time.monotonic() - t0
                if bound_s is not None and waited_s > bound_s:
                    return False
                time.sleep(0 if waited_s < 1e-3 else 1e-4)
        return True

    def synchronize(self, stream=None) -> None:
        """Wait for this rank's work on `stream` (default: the current stream); raise
        CommTimeoutError if a wait of this op failed."""
        with self.world.device_context():  # the op's device: its calls ran there
            stream_of(stream).synchronize()
        self.err.check()

    def _free(self) -> None:
        """Subclasses: free what they own beyond the buffer and the error record."""

    def _release(self) -> None:
        """Collective (bounded) and idempotent. After a CommTimeoutError the op cannot run again
        (its epochs disagree across ranks): close it (or `abort()` it) and build a new one. A
        failed op tries the same collective close, bounded by its own timeout, and aborts where a
        peer does not come (leaving a `with` block on CommTimeoutError aborts at once)."""
        self._memo.clear()  # its bound launches point into the buffer freed here
        try:
            self.comm.check_close(self.timeout_s)
            self._free()  # an op with guarded copies leaves the op in there (CopyGather._quiet)
            self.err.leave()
            with self.world.device_context():
                if self.buf is not None:
                    self.buf.close()
                if self.board_buf is not None:  # every kernel of the op is done (buf.close)
                    self.err.detach_board()
                    self.board_buf.close()
            for name in self._scratch:  # the device idle since buf.close (every op has a buf)
                setattr(self, name, None)
        except CufluxError as e:  # a peer is dead or late, or the op's communicator failed
            warnings.warn(f"{self.op}: close() could not meet every rank ({e}); closed this "
                          f"rank's side locally (abort)", RuntimeWarning, stacklevel=3)
            self._abort()
            return
        self.comm.free()
        self._close_err()

    def _close_err(self) -> None:
        """The error record's pinned memory freed with the rank's GPU current (cudaFreeHost on
        another GPU would make a context there, ~0.5 GB under eager module loading)."""
        ctx = getattr(self.world, "device_context", None)
        with ctx() if ctx is not None else contextlib.nullcontext():
            self.err.close()

    def abort(self) -> None:
        """Local, returns at once (no collective): for a peer that is dead or late. Every wait
        of this op gives up, its peers' mappings are closed where this rank's streams are idle,
        and memory a late peer might still write is kept (leaked) rather than freed."""
        if self._closed:
            return
        self._closed = True
        self._abort()

    def _abort(self) -> None:
        self._memo.clear()
        self.err.abort()
        try:
            self._free()
        finally:
            if self.buf is not None:
                self.buf.close(abort=True, streams=self._streams())
            if self.board_buf is not None:
                # Kept mapped (a page, leaked till exit): a kernel still queued, or a stream-wait
                # watchdog thread still running, reads it through the error record, which stays
                # allocated for the same reason.
                self.board_buf.close(abort=True, streams=None)
            self.comm.free()

    def _streams(self):
        """Streams this op's work may still be queued on: abort closes the peers' mappings only
        when every one of them is idle. None (unknown): they stay open (leaked), never unmapped
        under a kernel that may still be spinning on them."""
        last = getattr(self, "_last_stream", None)
        return None if last is None else (last,)
