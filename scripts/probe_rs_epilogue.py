"""Probe: where does GemmReduceScatter's fused kernel lose time against the plain GEMM at W = 1?

Times, interleaved, on one GemmReduceScatter case at W = 1 (bf16, nk, 256x128s4c1, deterministic):
  gemm      the plain GEMM of the same configuration (cuflux.gemm)
  fused     the fused kernel as shipped (phase A: tile into the slot; barrier; signal/wait;
            barrier; phase B: sum the slots + bias into the output)
  probe1    phase A and one barrier only (kernel compiled with -DCUFLUX_RS_PROBE=1)
  probe2    phase A only (-DCUFLUX_RS_PROBE=2)
The probe kernels skip phase B, so their outputs are wrong: timing only.
  PYTHONPATH=. python scripts/probe_rs_epilogue.py [--compile-only] [M N K]
--compile-only fills the kernel cache (CUFLUX_CACHE_DIR) without a GPU; scripts/precompile.sh
calls it so a device call does not compile the probe variants.
"""
import sys

ARCH = "sm_90a"
CONFIG = "256x128s4c1"


def _names():
    from cuflux.ops import gemm_rs as R

    return [R.sm90_kernel("__nv_bfloat16", CONFIG, transposed, False)
            for transposed in (False, True)]


def _compile(level):
    from cuflux import kernels

    fam = kernels.families()["gemm_rs.cu"]
    return kernels.compile_source(fam.source, _names(), ARCH, defines=[f"CUFLUX_RS_PROBE={level}"])


class _Module:  # what GemmReduceScatter needs of a loaded module: module[name]
    def __init__(self, level):
        import tempfile

        import cupy

        cubin, lowered = _compile(level)
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(cubin)
        self._raw = cupy.RawModule(path=f.name)
        self.functions = {n: self._raw.get_function(lowered[n]) for n in _names()}

    def __getitem__(self, name):
        return self.functions[name]


def main(argv):
    if "--compile-only" in argv:
        for level in (1, 2):
            _compile(level)
        return
    import cupy

    import cuflux
    import cuflux.ops.gemm as G
    from cuflux.arrays import dtype_info
    from cuflux.bench.common import time_interleaved
    from cuflux.ops.gemm_rs import GemmReduceScatter

    M, N, K = (int(x) for x in argv[:3]) if len(argv) >= 3 else (8192, 4096, 14336)
    world = cuflux.init()
    bf16 = dtype_info("bfloat16").storage
    rs = cupy.random.RandomState(7)
    sets = [(rs.standard_normal((M, K), dtype=cupy.float32).astype(bf16),
             rs.standard_normal((N, K), dtype=cupy.float32).astype(bf16)) for _ in range(3)]
    out, c = cupy.empty((M, N), dtype=bf16), cupy.empty((M, N), dtype=bf16)
    ops = {}
    for name, level in (("fused", 0), ("probe1", 1), ("probe2", 2)):
        op = GemmReduceScatter(world, M, N, K, "bfloat16", b_layout="nk", config=CONFIG)
        op._plain_w1 = False  # the fused kernel, not the W = 1 shortcut
        if level:
            op.module = _Module(level)
        ops[name] = op
    state = {"i": 0}

    def pick():
        state["i"] += 1
        return sets[state["i"] % len(sets)]

    fns = {"gemm": lambda: G.gemm(*pick(), out=c, b_layout="nk", impl="sm90", config=CONFIG)}
    for name, op in ops.items():
        fns[name] = lambda op=op: op(*pick(), out=out)
    t = time_interleaved(fns, rounds=7, iters=5, warmup=3)
    tiles = -(-M // 256) * -(-N // 128)
    waves = -(-tiles // cupy.cuda.Device().attributes["MultiProcessorCount"])
    print(f"{M}x{N}x{K} nk bf16 {CONFIG}, W = 1, {tiles} tiles, {waves} waves")
    for name, ms in t.items():
        extra = (ms - t["gemm"]) * 1e3 / waves
        print(f"{name:8s} {ms:8.4f} ms  {ms / t['gemm']:6.3f} x gemm  {extra:+7.2f} us a wave")
    for op in ops.values():
        op.close()


if __name__ == "__main__":
    main(sys.argv[1:])
