"""The tests' own kernels: .cu files here, compiled and loaded by the package's loader
(cuflux.kernels, registered with this directory) against the package's headers, and never
shipped with the package.

gemm_hooks.cu: the two GEMM cores with the fused ops' hooks (tests/test_gemm.py drives them).
"""
import pathlib

from cuflux import kernels

HERE = pathlib.Path(__file__).resolve().parent

GEMM_HOOKS_SRC = "gemm_hooks.cu"
GEMM_HOOKS = {"sm90": "gemm_hooks_sm90<__nv_bfloat16>", "sm80": "gemm_hooks_sm80<__nv_bfloat16>"}
GEMM_HOOKS_FAMILY = kernels.register(GEMM_HOOKS_SRC, tuple(GEMM_HOOKS.values()), min_arch=80,
                                     directory=HERE)
