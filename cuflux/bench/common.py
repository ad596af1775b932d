"""Shared benchmark plumbing: event timing (median of many), ceilings, JSON results.

Results go to <outdir>/<op>-<machine>-W<world size>-<date>.json (outdir: the command's
--outdir, ./cuflux-results by default; never inside the package) in one shape for every op:
{"op", "machine", "date", "command", "world_size", "rows": [{"case", "cuflux_ms", "baseline",
 "baseline_ms", "speedup", ...}]}, speedup = baseline_ms / cuflux_ms.
"""
from __future__ import annotations

import datetime
import json
import pathlib
import socket
import sys

import numpy as np

def time_ms(fn, warmup: int = 5, iters: int = 50, stream=None) -> float:
    """Median milliseconds of fn() over `iters` runs, timed with CUDA events on `stream`."""
    import cupy

    s = stream or cupy.cuda.get_current_stream()
    for _ in range(warmup):
        fn()
    s.synchronize()
    # Enqueue every run before waiting on any: the host runs ahead, so each [start, end] event
    # pair brackets the GPU time of one call and not the host's time to issue it (a per-call
    # synchronize would leave the GPU idle while Python issues the next call).
    events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(iters)]
    for a, b in events:
        a.record(s)
        fn()
        b.record(s)
    events[-1][1].synchronize()
    return float(np.median([cupy.cuda.get_elapsed_time(a, b) for a, b in events]))


def time_interleaved(fns: dict, *, rounds: int = 5, iters: int = 10, warmup: int = 3,
                     stream=None, before=None, after=None, gaps: bool = False) -> dict:
    """Median milliseconds per call of each fn, measured in `rounds` interleaved rounds (each
    round times every fn for `iters` calls, starting one fn later than the round before).

    Timing A then B in one block each lets clock and power drift between the blocks pass for a
    difference between A and B: on the H200 one GEMM timed twice that way differed by up to
    14 %. Interleaving spreads the drift over every fn alike. Every call of every round is
    enqueued before the host waits once, so the GPU never idles between blocks: with a host
    wait after each block (`gaps=True`, forced by `before` / `after`) the H200 ran the same GEMM
    up to 19 % slower than back to back (scripts/results/gemm-h200-W1-2026-11-29.json), as if
    each block started from lower clocks. `before()` runs before each block (a barrier across
    ranks), `after()` after it (raise pending errors)."""
    import cupy

    s = stream or cupy.cuda.get_current_stream()
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    s.synchronize()
    gaps = gaps or before is not None or after is not None
    events = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if before is not None:
                before()
            block = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(iters)]
            for a, b in block:
                a.record(s)
                fns[name]()
                b.record(s)
            events[name] += block
            if gaps:
                block[-1][1].synchronize()
            if after is not None:
                after()
    s.synchronize()
    return {name: float(np.median([cupy.cuda.get_elapsed_time(a, b) for a, b in ev]))
            for name, ev in events.items()}


def regimes(fn, stream, *, calls: int = 100, graph: bool = True, warmup: int = 5,
            barrier=None, host_calls: int | None = None) -> dict:
    """The three ways users run an op, for one callable (no arguments, enqueues one call on
    `stream`):

      user_loop_ms  calls back to back from Python with nothing held on the GPU, wall time per
                    call (the host's launch path included): what a decode step or a small layer
                    gets when it calls the op the obvious way;
      host_us       the host's time per call alone: the same loop issued while the GPU is held
                    busy (hold_stream), so no call waits for the GPU;
      graph_ms      one CUDA graph of `calls` calls, replayed; GPU time per call (None when the
                    op refuses capture: CaptureError).

    `host_calls`: the host_us loop's calls (default `calls`; the same on every rank: a rank
    issuing more calls than its peers would pair them with the peers' next loop).
    `barrier` (multi-rank): called before each timed loop so ranks start together. The GPU-
    queued regime (calls queued behind a hold, GPU time per call) is each benchmark's own
    cuflux_ms / baseline_ms column."""
    import contextlib
    import time

    import cupy

    from cuflux.errors import CaptureError

    # fn from on_stream(f, stream): the stream made current once around each loop, f called
    # (the per-call `with` is the benchmark's host time, not the op's)
    current = contextlib.nullcontext()
    if getattr(fn, "stream", None) is stream and getattr(fn, "inner", None) is not None:
        fn, current = fn.inner, stream
    for _ in range(warmup):
        with current:
            fn()
    stream.synchronize()
    if barrier is not None:
        barrier()
    with current:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        stream.synchronize()
        user_loop_ms = (time.perf_counter() - t0) * 1e3 / calls
    if barrier is not None:
        barrier()
    host_calls = host_calls or calls
    with current:  # a hold of twice the loop's GPU time (clamped to hold_stream's maximum)
        host_us = held_host_us(fn, stream, host_calls, warmup=0,
                               hold_us=2 * user_loop_ms * 1e3 * host_calls + 200)
    graph_ms = None
    if graph:
        try:
            if barrier is not None:
                barrier()
            stream.begin_capture()
            try:
                with current:
                    for _ in range(calls):
                        fn()
            finally:
                g = stream.end_capture()
            g.launch(stream)  # warm-up replay
            stream.synchronize()
            if barrier is not None:
                barrier()
            a, b = cupy.cuda.Event(), cupy.cuda.Event()
            a.record(stream)
            g.launch(stream)
            b.record(stream)
            b.synchronize()
            graph_ms = cupy.cuda.get_elapsed_time(a, b) / calls
        except CaptureError:  # not capturable: no graph figure
            pass
    return {"user_loop_ms": user_loop_ms, "host_us": host_us, "graph_ms": graph_ms}


_HOLD_SRC = r"""
extern "C" __global__ void cuflux_bench_hold(unsigned long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < ns);
}
extern "C" __global__ void cuflux_bench_empty(unsigned long long unused) {}
"""
_HOLD_MAX_US = 20_000.0
# the fewest calls of a host_us loop where speed is measured (__main__.host_loop_calls)
HOST_CALLS = 200
_hold_kernel = None
# This host's floor for enqueueing GPU work from Python (measure_host_floor), written into
# every results JSON of the run: the issues' host bars read against it.
HOST_FLOOR: dict = {}


def hold_stream(stream, us: float, max_us: float = _HOLD_MAX_US) -> None:
    """Keep `stream` busy for `us` microseconds (at most max_us, 20 ms by default: one thread
    sleeping on the global timer), so a block of calls enqueued behind it is all queued before
    the GPU reaches the first. Events recorded after the hold then time the calls back to back,
    not the host's time to issue the first of them (for a 25-call block of a 35 us op whose host
    path takes 20 us, that start alone is 2 % of the block). The tests hold a rank's GPU for
    seconds with a larger max_us (a late GPU)."""
    global _hold_kernel
    import cupy

    if _hold_kernel is None:
        _hold_kernel = cupy.RawKernel(_HOLD_SRC, "cuflux_bench_hold")
    ns = int(min(max(us, 0.0), max_us) * 1e3)
    _hold_kernel((1,), (1,), (np.uint64(ns),), stream=stream)


def held_host_us(fn, stream, calls: int = 500, warmup: int = 20,
                 hold_us: float = _HOLD_MAX_US) -> float:
    """Host microseconds per call of `calls` back-to-back fn() issued while `stream` is held
    busy (hold_stream, hold_us), so no call waits for the GPU: the host's time alone (stream
    None: no hold, for what enqueues nothing). `calls` stays well below the launch queue
    (~1,000 entries): a full queue blocks the host until the hold ends, which would read as
    host time (500 calls of ~10 us also fit behind the 20 ms hold)."""
    import time

    for _ in range(warmup):
        fn()
    if stream is not None:
        stream.synchronize()
        hold_stream(stream, hold_us)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) * 1e6 / calls
    if stream is not None:
        stream.synchronize()
    return us


def measure_host_floor(calls: int = 500) -> dict:
    """What enqueueing GPU work from Python costs this host with nothing of cuflux in the way,
    per call, the GPU held (held_host_us): `launch_us`, cuLaunchKernel of an empty
    one-argument kernel with its argument block built once, through the binding cuflux.launch
    calls (`launch_binding`: CuPy's Cython one, or ctypes where it is missing; a file without
    the key timed ctypes, 1.5-2 us more a launch on the H200 machine:
    scripts/results/probe_launch-h200-2026-12-02e.txt); `copy_us`, an 8-byte
    cudaMemcpyAsync through CuPy. No op that launches a kernel (or a copy) per call can spend
    less host time than these; the host bars of the issues are read against them (a bare
    launch took 5.6-8.6 us through ctypes on the lent H200 machine on 2026-12-02, where 2-4 us
    is common). Kept in HOST_FLOOR for write_results."""
    import cupy
    from cupy.cuda import runtime

    from cuflux import launch as L

    s = cupy.cuda.Stream(non_blocking=True)
    func = cupy.RawKernel(_HOLD_SRC, "cuflux_bench_empty").kernel.ptr
    block = L._Packer((np.uint64,))  # the kernel's one argument, packed once
    block.struct.pack_into(block.buf, 0, 0)
    params_addr, launch_kernel = block.params_addr, L.launcher()
    src, dst = cupy.zeros(2, cupy.uint32), cupy.zeros(2, cupy.uint32)

    def launch():
        launch_kernel(func, 1, 1, 1, 32, 1, 1, 0, s.ptr, params_addr, 0)

    try:  # a failing launch returns at once: it would read as a low floor
        launch()
    except L._DriverError as e:
        from cuflux.errors import CudaError

        raise CudaError(f"measure_host_floor: launching an empty kernel failed: "
                        f"{L.error_name(e.status)}") from None

    def copy():
        runtime.memcpyAsync(dst.data.ptr, src.data.ptr, 8, runtime.memcpyDeviceToDevice, s.ptr)

    floor = {name: held_host_us(fn, s, calls, warmup=50)
             for name, fn in (("launch_us", launch), ("copy_us", copy))}
    HOST_FLOOR.clear()
    HOST_FLOOR.update(floor, calls=calls, launch_binding="ctypes" if launch_kernel is
                      L._ctypes_launch else "cupy_backends launchKernel")
    return dict(HOST_FLOOR)


def ranks_share_gpu(world) -> bool:
    """True when any two ranks of the world run on one device (collective: every rank must
    call it, and every rank gets the same answer, so all set up NCCL baselines or none do)."""
    me = world.rank
    mine = any(link.same_gpu for link in world.topology.links if link.peer != me)
    return world.size > 1 and any(world.allgather(mine))


def nccl_comm(world, shared_gpu: bool):
    """(cupy.cuda.nccl, a communicator over the world's ranks), or None where ranks share a GPU
    (NCCL refuses two ranks on one GPU) or NCCL is missing on any rank (decided together: no
    rank waits alone). Collective. W = 1 too: a one-rank all-reduce is a copy, and a one-GPU
    run then exercises the baselines' code."""
    if shared_gpu:
        return None
    try:
        from cupy.cuda import nccl

        ok = bool(nccl.available)
    except Exception:
        ok = False
    if not all(world.allgather(ok)):
        if world.rank == 0:
            print("NCCL baseline unavailable in this CuPy build")
        return None
    # NcclRail's set-up, bounded: the id through the World's allgather, ncclCommInitRank (which
    # waits for every rank, without a deadline) in a thread joined against the World's timeout,
    # every call kind connected there, and the ranks agreeing that each got its communicator.
    from cuflux.rail import NcclRail

    return nccl, NcclRail(world, world.device, world.timeout_s).comm


def peer_copy_gbps(world, num_bytes: int = 256 << 20) -> float | None:
    """Measured one-way copy rate from each rank's GPU to the next rank's (cudaMemcpyPeer), in
    GB/s, the highest over the ranks: the link figure the collectives' link fractions divide
    by. Collective. None where some rank's next rank has its own device number (each process
    sees only its own GPU, CUDA_VISIBLE_DEVICES): one process cannot time that link, and a copy
    inside one GPU would pass for it.

    Peer access is enabled first: without it the driver stages the copy through the host
    (35 GB/s between two H200s against 395 GB/s direct)."""
    import cupy
    from cupy.cuda import runtime

    peer_dev = world.allgather(world.device)[(world.rank + 1) % world.size]
    if any(world.allgather(peer_dev == world.device)):
        return None
    try:
        runtime.deviceEnablePeerAccess(peer_dev)
    except runtime.CUDARuntimeError as e:  # already enabled (by this process) is fine
        if "PeerAccessAlreadyEnabled" not in str(e):
            raise
    src = cupy.empty(num_bytes, dtype=cupy.uint8)
    with cupy.cuda.Device(peer_dev):
        dst = cupy.empty(num_bytes, dtype=cupy.uint8)
    s = cupy.cuda.get_current_stream()
    ms = time_ms(lambda: runtime.memcpyPeerAsync(dst.data.ptr, peer_dev, src.data.ptr,
                                                 world.device, num_bytes, s.ptr), iters=10)
    src = dst = None
    with cupy.cuda.Device(peer_dev):  # not kept in the neighbour's pool for the whole run
        cupy.get_default_memory_pool().free_all_blocks()
    return max(world.allgather(num_bytes / (ms * 1e-3) / 1e9))


def sends_ms(bytes_per_peer: int, world_size: int, link_gbps: float) -> float:
    """The time of a rank's W - 1 sends of bytes_per_peer each at the one-pair peer copy rate
    (peer_copy_gbps: over NVSwitch one copy nearly fills a GPU's outgoing NVLink, so the sends
    share it; exact at W = 2): the communication an overlapped op's ideal hides."""
    return (world_size - 1) * bytes_per_peer / (link_gbps * 1e9) * 1e3


def copy_bandwidth_gbps(num_bytes: int = 2 << 30) -> float:
    """Measured device-to-device copy rate, counting bytes read plus bytes written."""
    import cupy

    a = cupy.empty(num_bytes, dtype=cupy.uint8)
    b = cupy.empty_like(a)
    a.fill(1)
    ms = time_ms(lambda: b.__setitem__(Ellipsis, a), warmup=3, iters=20)
    a = b = None  # freed before the caller's next allocation (the lambda holds the names)
    return 2 * num_bytes / (ms * 1e-3) / 1e9


def machine_name() -> str:
    try:
        import cupy

        name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
        name = name.decode() if isinstance(name, bytes) else name
        count = cupy.cuda.runtime.getDeviceCount()
        return (name.replace("NVIDIA ", "").replace(" ", "-").lower()
                + (f"x{count}" if count > 1 else ""))  # h200x2: ranks may sit on distinct GPUs
    except Exception:
        return socket.gethostname()


def write_results(op: str, world_size: int, rows: list[dict], extra: dict | None = None,
                  *, outdir: str) -> pathlib.Path:
    date = datetime.date.today().isoformat()
    doc = {"op": op, "machine": machine_name(), "date": date,
           "command": " ".join(["python -m cuflux.bench"] + sys.argv[1:]),
           "world_size": world_size, "rows": rows}
    if HOST_FLOOR:
        doc["host_floor_us"] = dict(HOST_FLOOR)
    doc["host_calls_min"] = HOST_CALLS  # every host_us loop (speed measured): at least this many
    if extra:
        doc.update(extra)
    d = pathlib.Path(outdir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{op}-{doc['machine']}-W{world_size}-{date}.json"
    path.write_text(json.dumps(doc, indent=1))
    return path


def print_table(rows: list[dict], cols: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(cols, widths)))
    sys.stdout.flush()


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)
