"""Probe: what one kernel launch costs the host, by kernel and by path, with the GPU held busy
(host time alone): an empty kernel and AllReduceRMSNorm's W = 1 kernel, each through bare
ctypes with its argument block built once, through cuflux.launch, and through CuPy; then the
op's whole call. Every variant is timed in each of ROUNDS rounds, in a rotated order (the
host's speed drifts between blocks of timing), and the median is printed.

CALLS per block stays well below the launch queue (~1,000 entries): a full queue blocks the
host until the hold ends, which reads as host time (the 2,000-call blocks of this probe's
first version, scripts/results/probe_launch-h200-2026-12-01.txt, put a bare launch at
13.6 us; 500-call blocks read 6-8 us on the same kind of machine).
  PYTHONPATH=. python scripts/probe_launch.py
"""
import statistics

import numpy as np

CALLS, ROUNDS = 400, 5


def host_us(fn, stream, calls=CALLS):
    from cuflux.bench.common import held_host_us

    return held_host_us(fn, stream, calls)


def main():
    import cupy

    import cuflux
    from cuflux import launch as L

    world = cuflux.init()
    cupy.cuda.Device(world.device).use()
    s = cupy.cuda.Stream(non_blocking=True)
    mod = cupy.RawModule(code=r'''
    extern "C" __global__ void k7(unsigned long long a, unsigned long long b,
        unsigned long long c, unsigned long long d, int e, int f, float g) {}''')
    k7 = mod.get_function("k7")
    H = 4096
    with s:
        x = cupy.ones((1, H), dtype=cupy.float16)
        res, wt, out = cupy.ones_like(x), cupy.ones((H,), cupy.float16), cupy.empty_like(x)
    args7 = (x, out, res, wt, np.int32(1), np.int32(H), np.float32(1e-6))
    arn = cuflux.AllReduceRMSNorm(world, 64, H, "float16")
    plan, prepared = arn._plan(H, H, "auto", True)
    fn = arn.module[plan.kernel]
    print("op kernel:", plan.kernel, "grid", plan.grid, "block", plan.block, "smem",
          plan.shared_mem, flush=True)
    def pack(packer):  # part of kernel()'s per-call work: the pointers read, pack_into
        packer.struct.pack_into(packer.buf, 0, *[a.data.ptr if isinstance(a, cupy.ndarray)
                                                 else a for a in args7])

    p = L._Packer(tuple(map(type, args7)))
    pack(p)  # the argument block of args7 built once, as a per-call cache would hold it
    lib, sptr, cy = L.driver_lib(), s.ptr, L.launcher()
    f_rms, f_empty = L._function(fn), k7.kernel.ptr
    variants = {
        "empty kernel, bare ctypes, block built once": lambda: lib.cuLaunchKernel(
            f_empty, 1, 1, 1, 128, 1, 1, 0, sptr, p.params, None),
        "rmsnorm kernel, bare ctypes, block built once": lambda: lib.cuLaunchKernel(
            f_rms, plan.grid, 1, 1, plan.block, 1, 1, 0, sptr, p.params, None),
        # the binding cuflux.launch calls (CuPy's Cython cuLaunchKernel: integers in)
        "empty kernel, bare CuPy binding, block built once": lambda: cy(
            f_empty, 1, 1, 1, 128, 1, 1, 0, sptr, p.params_addr, 0),
        "rmsnorm kernel, bare CuPy binding, block built once": lambda: cy(
            f_rms, plan.grid, 1, 1, plan.block, 1, 1, 0, sptr, p.params_addr, 0),
        "empty kernel, cuflux.launch": lambda: L.kernel(k7, 1, 128, args7, s, op="p",
                                                        name="k7"),
        "rmsnorm kernel, cuflux.launch": lambda: L.kernel(fn, plan.grid, plan.block, args7, s,
                                                          op="p", name="rms"),
        "rmsnorm kernel, CuPy": lambda: fn((plan.grid,), (plan.block,), args7, stream=s),
        "rmsnorm kernel, the op's prepared launch": lambda: prepared(
            s, x.data.ptr, out.data.ptr, res.data.ptr, wt.data.ptr),
        "op call out=, stream=s": lambda: arn(x, res, wt, out=out, stream=s),
        # (labelled "tuple(map(type, args7)) + pack_into" in probe_launch-h200-2026-12-02.txt,
        # which timed this: no type tuple)
        "packing alone: pointers + pack_into": lambda: pack(p),
    }
    names = list(variants)
    got = {n: [] for n in names}
    for r in range(ROUNDS):
        for n in names[r % len(names):] + names[:r % len(names)]:
            got[n].append(host_us(variants[n], s))
    for n in names:
        print(f"{n:64s} {statistics.median(got[n]):8.2f} us  (rounds: "
              f"{', '.join(f'{v:.1f}' for v in got[n])})", flush=True)
    arn.close()


if __name__ == "__main__":
    main()
