"""Probe: the host time of one All2AllHeads W = 1 call, against the GPU's ~33 us a call.

At W = 1 the op is one 64 MiB copy; when the host path of a call outlasts it, back-to-back calls
leave the GPU idle and the op's rate measures Python. Prints host us a call (no sync inside the
loop) for: bare cudaMemcpyAsync, bare PDL launch of the op's copy kernel, the op's memcpy path,
the op's PDL path; then where the op's PDL path spends its time (cProfile, top functions).
  PYTHONPATH=. CUDA_MODULE_LOADING=EAGER python scripts/probe_a2a_host.py
"""
import cProfile
import pstats
import time

import numpy as np


def main():
    import cupy

    import cuflux
    from cuflux import kernels
    from cuflux.ops.all2all import All2AllHeads

    world = cuflux.init()
    B, T, H, D = 1, 8192, 32, 128
    s = cupy.cuda.Stream(non_blocking=True)
    calls = 2000
    with All2AllHeads(world, T, H, D, "bfloat16") as op, s:
        storage = op.spec.dtype.storage
        x = cupy.random.standard_normal((B, T, H, D), dtype=cupy.float32).astype(storage)
        out = cupy.empty_like(x)
        tokens = (T,)
        nbytes = x.nbytes
        n_vec = nbytes // 16

        def bare_memcpy():
            cupy.cuda.runtime.memcpyAsync(out.data.ptr, x.data.ptr, nbytes, 3, s.ptr)

        def bare_pdl():
            kernels.launch(op._copy_w1, (-(-n_vec // 256),), (256,),
                           (x, out, np.uint64(n_vec)), s, op="probe",
                           name="a2a_copy_w1", pdl=True)

        def op_call():
            op.scatter_heads(x, tokens, out=out, stream=s)

        def op_owned():
            op.scatter_heads(x, tokens, stream=s)

        rows = []
        for label, fn, pdl in (("bare memcpyAsync", bare_memcpy, False),
                               ("bare PDL launch", bare_pdl, True),
                               ("op out= memcpy", op_call, False),
                               ("op out= pdl", op_call, True),
                               ("op owned memcpy", op_owned, False),
                               ("op owned pdl", op_owned, True)):
            op.w1 = "pdl" if pdl else "memcpy"
            for _ in range(20):
                fn()
            s.synchronize()
            host = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(calls // 5):
                    fn()
                host.append((time.perf_counter() - t0) * 1e6 / (calls // 5))
                s.synchronize()
            rows.append((label, float(np.median(host))))
        for label, us in rows:
            print(f"{label:20s} host {us:6.1f} us a call")
        op.w1 = "pdl"
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            op_call()
        prof.disable()
        s.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        # the copy kernel's result, once: a probe whose copy is wrong measures nothing
        out[...] = 0
        op_call()
        s.synchronize()
        assert bool((out.view(cupy.uint16) == x.view(cupy.uint16)).all()), "PDL copy wrong"
        print("copy checked")


if __name__ == "__main__":
    main()
