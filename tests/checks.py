"""Accuracy checks shared by the GEMM-family GPU tests (plain GEMM, AllGatherGemm,
GemmReduceScatter): one tolerance table and one float64 comparison."""
import numpy as np

# Relative Frobenius error allowed against the float64 reference, by output dtype; the worst
# single element may be off by 10x that, in units of the reference's rms.
GEMM_TOL = {"bfloat16": 8e-3, "float16": 2e-3, "float32": 1e-4}


def f64(x) -> np.ndarray:
    """A device array on the host, in float64."""
    import cupy

    return cupy.asnumpy(x).astype(np.float64)


def check_close(got, ref, out_dtype, what) -> float:
    """Every element written (poisoned outputs are NaN), relative error and worst element under
    the dtype's tolerance; returns the relative error."""
    g = f64(got)
    assert np.isfinite(g).all(), f"{what}: {int((~np.isfinite(g)).sum())} elements not written"
    rms = np.sqrt(np.mean(ref ** 2)) + 1e-30
    rel = np.linalg.norm(g - ref) / (np.linalg.norm(ref) + 1e-30)
    worst = np.abs(g - ref).max() / rms
    tol = GEMM_TOL[out_dtype]
    assert rel < tol, f"{what}: relative error {rel:.3g} >= {tol}"
    assert worst < 10 * tol, f"{what}: worst element off by {worst:.3g} x rms"
    return float(rel)
