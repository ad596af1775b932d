"""cuflux: communication hidden inside computation for tensor- and sequence-parallel models.

CuPy + CUDA kernels compiled at run time, an mpi4py bootstrap and CUDA IPC symmetric memory.
"""
import os as _os

# Kernels that spin on flags deadlock under lazy module loading (a module loaded while a stream
# is blocked): ask for eager loading before CUDA starts in this process.
_os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
# Host-driven paths keep several streams per process (copy lanes, the watchdog's release
# stream); with CUDA's default of 8 hardware queues a stream blocked in cuStreamWaitValue32 can
# hold up an unrelated stream aliased onto its queue (the watchdog's release among them). A user
# who set this (Megatron sets 1) keeps their value.
_os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
# NVLink multicast is forbidden on the machines this project uses.
_os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

from cuflux.errors import CommTimeoutError, CudaError, CufluxError  # noqa: E402
from cuflux.world import World, init, device_count  # noqa: E402
from cuflux.symmetric import Layout, SymmetricBuffer  # noqa: E402
from cuflux.ops.allgather import AllGather  # noqa: E402
from cuflux.ops.gemm import gemm  # noqa: E402
from cuflux.ops.ag_gemm import AllGatherGemm, reference_ag_gemm  # noqa: E402
from cuflux.ops.gemm_rs import GemmReduceScatter, reference_gemm_rs  # noqa: E402
from cuflux.ops.all2all import (All2AllHeads, reference_gather_heads,  # noqa: E402
                                reference_scatter_heads)
from cuflux.ops.allreduce import (AllReduce, AllReduceRMSNorm, rmsnorm_residual,  # noqa: E402
                                  reference_allreduce, reference_allreduce_rmsnorm)

__version__ = "0.1.0"
__all__ = ["init", "World", "device_count", "Layout", "SymmetricBuffer", "AllGather", "gemm",
           "AllGatherGemm", "reference_ag_gemm", "GemmReduceScatter", "reference_gemm_rs",
           "All2AllHeads", "reference_scatter_heads", "reference_gather_heads",
           "AllReduce", "AllReduceRMSNorm", "rmsnorm_residual", "reference_allreduce",
           "reference_allreduce_rmsnorm",
           "CommTimeoutError", "CudaError", "CufluxError", "__version__"]
