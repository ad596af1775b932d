"""cuflux.gemm: C = A @ B (+ bias) on the project's own GEMM cores (kernels_cu/gemm.cu).

a [M, K]; b [K, N] (b_layout="kn") or [N, K] ("nk", a Linear layer's weight); bias [N] in the
input dtype; bf16 or fp16 in, fp32 accumulation, out in bf16 / fp16 / fp32. Any M, N, K with
K % 8 == 0 and N % 8 == 0 (16-byte rows: TMA and cp.async move 16-byte pieces).

Two implementations behind one call: "sm90" (Hopper, sm_90a: TMA + mbarrier pipeline, wgmma,
warp-specialised, persistent, optional 2-CTA clusters) and "sm80" (mma.sync + cp.async,
sm_80 and later). impl="auto" takes sm90 where the device is sm_90a.

Tile shape, pipeline depth and cluster size of the Hopper path come from a small tuner
(cuflux/gemm_tuner.py): on the first call of a (GPU, dtype, layout, shape class) it times the
candidate configurations for at most CUFLUX_GEMM_TUNE_BUDGET_S seconds (default 2) on the
caller's own operands and keeps the winner in <cache dir>/gemm_tuner.json (at most 512
entries). CUFLUX_GEMM_TUNE=0 disables it (a fixed heuristic is used instead).

This module holds the public call and its argument checks. The cores' host side (tile
configurations, TMA descriptors, launches, cuBLAS) is cuflux/gemm_core.py and the choice of
configuration cuflux/gemm_tuner.py; their public names used here are re-exported below, so
`cuflux.ops.gemm.plan`, `SM90_CONFIGS`, `tensor_map`, ... keep working.
"""
from __future__ import annotations

import contextlib
import functools

from cuflux.arrays import (_ndarray, as_cupy, check_array, dtype_info, storage_dtype, stream_of,
                           to_caller, torch_tensor_type)
from cuflux.errors import CaptureError
from cuflux.gemm_core import (CUDA_TYPE, FAMILY, IN_DTYPES, OUT_KIND, SM80, SM80_CONFIG,
                              SM90_CONFIGS, SM90_DEFAULT, WORKSPACE_BYTES, Sm80Config,
                              Sm90Config, check_aligned, check_b_layout, check_bias,
                              check_group_m, cupy_module, device_props, grouped_tile,
                              launch_cublas, launch_sm80, launch_sm90, tensor_map)
from cuflux.gemm_tuner import (CUBLAS, CUBLAS_BELOW_M, TUNER_CANDIDATES, choice, core_heuristic,
                               heuristic, load_tuner, plan, shape_class, tune_key, tuned_config,
                               tuner_path)
from cuflux.launch import capturing, current_device
from cuflux.ops.base import CallMemo

# The call, plus the core's and the tuner's public names that callers have imported from here.
__all__ = ["gemm", "gemm_replay", "clear_memo", "plan", "IMPLS", "tensor_map", "Sm90Config",
           "SM90_CONFIGS", "SM90_DEFAULT",
           "Sm80Config", "SM80", "SM80_CONFIG", "CUDA_TYPE", "FAMILY", "WORKSPACE_BYTES",
           "check_aligned", "check_bias", "grouped_tile", "CUBLAS", "CUBLAS_BELOW_M",
           "TUNER_CANDIDATES", "core_heuristic", "heuristic", "load_tuner", "shape_class",
           "tune_key", "tuned_config", "tuner_path"]

_OP = "cuflux.gemm"
IMPLS = ("auto", "sm90", "sm80", CUBLAS)


# ---- argument checks ------------------------------------------------------------------------------
def _check_args(a, b, bias, out, out_dtype, b_layout, impl, alloc_stream=None):
    cupy = cupy_module()
    check_b_layout(b_layout, _OP)
    if impl not in IMPLS:
        raise ValueError(f"{_OP}: impl must be one of {IMPLS}, got {impl!r}")
    a = as_cupy(a, "a", _OP)
    b = as_cupy(b, "b", _OP)
    dt = dtype_info(a.dtype, IN_DTYPES, _OP)
    dev = cupy.cuda.runtime.getDevice()
    check_array(a, name="a", op=_OP, ndim=2, dtype=dt, device=dev)
    check_array(b, name="b", op=_OP, ndim=2, dtype=dt, device=dev)
    M, K = a.shape
    if b_layout == "kn":
        if b.shape[0] != K:
            raise ValueError(f"{_OP}: b (layout 'kn') must be [K={K}, N], got {tuple(b.shape)}")
        N = b.shape[1]
    else:
        if b.shape[1] != K:
            raise ValueError(f"{_OP}: b (layout 'nk') must be [N, K={K}], got {tuple(b.shape)}")
        N = b.shape[0]
    if K % 8 or K == 0:
        raise ValueError(f"{_OP}: K must be a positive multiple of 8 (rows of a and b move in "
                         f"16-byte pieces), got K={K}")
    if N % 8 or N == 0:
        raise ValueError(f"{_OP}: N must be a positive multiple of 8 (rows of b and of the output "
                         f"move in 16-byte pieces), got N={N}")
    if max(M, N, K) >= 2**31:
        raise ValueError(f"{_OP}: dimensions must be < 2**31, got M={M}, N={N}, K={K}")
    check_aligned(_OP, a=a, b=b)
    bias = check_bias(_OP, bias, N, dt, dev)
    if out is not None:
        out = as_cupy(out, "out", _OP)
        odt = dtype_info(out_dtype if out_dtype is not None else out.dtype, OUT_KIND, _OP)
        check_array(out, name="out", op=_OP, shape=(M, N), dtype=odt, device=dev)
        if out.data.ptr % 16:
            raise ValueError(f"{_OP}: out must start at a 16-byte aligned address")
    else:
        odt = dtype_info(out_dtype if out_dtype is not None else dt.name, OUT_KIND, _OP)
        # From the pool arena of the stream that writes it (torch's stream may not be CuPy's
        # current one): a block is only reused after the work queued on its stream.
        with alloc_stream() if alloc_stream is not None else contextlib.nullcontext():
            out = cupy.empty((M, N), dtype=odt.storage)
    return a, b, bias, out, dt, odt, M, N, K


# ---- public API ------------------------------------------------------------------------------------
def gemm(a, b, bias=None, out=None, out_dtype=None, b_layout: str = "kn", impl: str = "auto",
         stream=None, config: str | None = None, group_m: int = 8):
    """C = a @ b (+ bias) with fp32 accumulation; returns C (a torch tensor for a torch a,
    else a CuPy array).

    Args:
      a: [M, K], bfloat16 or float16 (any array CuPy takes without a copy), C-contiguous.
      b: [K, N] for b_layout="kn", [N, K] for "nk" (a Linear weight), a's dtype.
      bias: [N] in a's dtype, added to every row, or None.
      out: [M, N] output to write, or None (allocated). out_dtype: bfloat16 / float16 /
        float32 (default: out's dtype, else a's dtype).
      impl: "auto" (the faster of our Hopper core and cuBLAS for this shape class, as the tuner
        measured it, on sm_90a; elsewhere the portable core, or cuBLAS below CUBLAS_BELOW_M
        rows), "sm90", "sm80" or "cublas". `plan(M, N, K, ...)` says what "auto" runs.
      stream: CuPy stream, raw handle or torch stream (default: the current stream of a's
        framework, CuPy's or torch's).
      config: a Hopper configuration name from SM90_CONFIGS (skips the tuner).
      group_m: tile rows per L2 group of the tile order (1: row-major order).
    K and N must be multiples of 8 (16-byte rows). Capturable in a CUDA graph once the shape
    class has been tuned (under capture an untuned shape takes the heuristic: no timing).
    Without bias (CuPy arrays or torch tensors; out= given or left to the op), a call seen
    before replays its launch (ops.base.CallMemo): no check, no plan, no tuner lookup. The
    replay is the route and configuration the call took when it was bound (the tuner's
    winner then; a later change of the tuner's table or of CUFLUX_GEMM_* knobs reaches calls
    not yet bound).
    """
    memo = key = None
    # keyed: no bias, an int group_m (a bool equals an int: the full path's error), CuPy
    # arrays or torch tensors (asked before the device: the memo is the current device's)
    t = type(a)
    if (bias is None and type(group_m) is int and (t is _ndarray() or t is torch_tensor_type())
            and type(b) is t and (out is None or type(out) is t)):
        memo = _memo()
        if out is None and out_dtype is None and memo.owns(a, b):  # before the key: CallMemo
            out = _owned_out(memo, a, b, b_layout, stream)
        if out is not None:
            key = memo.key((a, b, out), (out_dtype, b_layout, impl, config, group_m))
            run = memo.get(key)
            if run is not None and run(stream_of(stream, a).ptr) is not False:
                return out
    return _gemm(a, b, bias, out, out_dtype, b_layout, impl, stream, config, group_m, memo, key)


def _owned_out(memo, a, b, b_layout, stream):
    """gemm's output [M, N] in a's dtype for a call that leaves it to the op
    (CallMemo.output, in a's framework); None (the full path, which names what is wrong
    before it allocates) where a or b is not a matrix of an input dtype, the layout is not
    one, or K differs."""
    st = storage_dtype(a)
    if (a.ndim != 2 or b.ndim != 2 or a.dtype != b.dtype or st is None
            or st not in _in_storage() or b_layout not in ("kn", "nk")):
        return None
    kn = b_layout == "kn"
    if a.shape[1] != b.shape[0 if kn else 1]:
        return None
    return memo.output((a.shape[0], b.shape[1] if kn else b.shape[0]), st, stream, like=a)


@functools.cache
def _in_storage() -> tuple:
    """The storage dtypes of IN_DTYPES."""
    return tuple(dtype_info(n).storage for n in IN_DTYPES)


def clear_memo() -> None:
    """Forget every call gemm has bound and let go of the outputs it keeps for reuse
    (CallMemo.output: up to ops.base.OUTPUTS_KEPT_BYTES a device), on every device: for a
    process that is done with gemm, or wants that memory back in CuPy's pool."""
    for memo in list(_MEMOS.values()):
        memo.clear()


_MEMOS: dict = {}  # device -> CallMemo of gemm's calls there


def gemm_replay(a, b, out, b_layout: str = "kn", impl: str = "auto", config=None,
                group_m: int = 8, out_dtype=None):
    """The replay gemm's memo bound for this call (no bias), or None: for an op whose call is
    this GEMM alone (GemmReduceScatter at W = 1) to keep in its own memo."""
    memo = _memo()
    return memo.get(memo.key((a, b, out), (out_dtype, b_layout, impl, config, group_m)))


def _memo() -> CallMemo:
    dev = current_device()
    memo = _MEMOS.get(dev)
    if memo is None:
        memo = _MEMOS.setdefault(dev, CallMemo(dev))
    return memo


def _gemm(a, b, bias, out, out_dtype, b_layout, impl, stream, config, group_m, memo, key):
    """gemm's full path: checks, route, tuner; binds the launch where the memo wants it."""
    a_in, out_in = a, out  # the caller's: torch in, torch out
    a, b, bias, out, dt, odt, M, N, K = _check_args(a, b, bias, out, out_dtype, b_layout, impl,
                                                    lambda: stream_of(stream, a_in))
    if M == 0:
        return to_caller(out, a_in, out_in)
    s = stream_of(stream, a_in)
    under_capture = capturing(s)
    arch = device_props()[1]
    hopper = arch == "sm_90a"
    if impl == "sm90" and not hopper:
        raise RuntimeError(f"{_OP}: impl='sm90' needs an sm_90a device (Hopper), this one is "
                           f"{arch}")
    check_group_m(group_m, _OP)
    if config is not None and config not in SM90_CONFIGS:
        raise ValueError(f"{_OP}: config must be one of {sorted(SM90_CONFIGS)}, got {config!r}")
    # Bound at a key's second call, never under capture (the heuristic's pick there is not
    # the tuner's, and would be replayed after the capture).
    bind = memo is not None and memo.wants(key) and not under_capture
    if impl == CUBLAS or (impl == "auto" and not hopper and config is None
                          and M < CUBLAS_BELOW_M):
        done = launch_cublas(a, b, bias, out, dt, odt, M, N, K, b_layout, s, under_capture,
                             bind=bind)
        if done:
            _bound(memo, key, done, bind)
            return to_caller(out, a_in, out_in)
        if impl == CUBLAS:
            raise CaptureError(f"{_OP}: impl='cublas' under capture needs one call on this "
                               f"stream outside the capture first (it sets up cuBLAS's "
                               f"workspace for the stream, kept for the streams used last: "
                               f"gemm_core.WORKSPACES_KEPT)")
    if impl == "sm80" or (impl == "auto" and not hopper):
        _bound(memo, key, launch_sm80(a, b, bias, out, dt, odt, M, N, K, b_layout, s, group_m,
                                      bind=bind), bind)
        return to_caller(out, a_in, out_in)

    last = [None]  # the latest launch's replay: the call's own comes last (after any timing)

    def run(name):
        # (never calls itself: a closure that refers to itself is a reference cycle, which
        # would keep a, b and out alive until Python's cycle collector ran)
        if name == CUBLAS:
            done = launch_cublas(a, b, bias, out, dt, odt, M, N, K, b_layout, s, under_capture,
                                 bind=bind)
            if done:
                last[0] = done
                return
            name = core_heuristic(M, N, K)  # first cuBLAS use of this stream is a capture
        last[0] = launch_sm90(SM90_CONFIGS[name], a, b, bias, out, dt, odt, M, N, K,
                              b_layout, s, group_m, bind=bind)

    if config is None:
        config = choice(dt, b_layout, M, N, K, run, s, under_capture)
        if config == CUBLAS and impl == "sm90":  # the caller asked for our core
            config = core_heuristic(M, N, K)
    run(config)
    _bound(memo, key, last[0], bind)
    return to_caller(out, a_in, out_in)


def _bound(memo, key, replay, bind: bool) -> None:
    """Keep the call's replay where it was bound (a launch that returned True: none)."""
    if bind and callable(replay):
        memo.put(key, replay)
