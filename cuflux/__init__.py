"""cuflux: communication hidden inside computation for tensor- and sequence-parallel models.

CuPy + CUDA kernels compiled at run time, an mpi4py bootstrap and CUDA IPC symmetric memory.
"""
import os as _os

# Process-wide environment. Importing cuflux sets only what cuflux's own correctness needs; the
# caller's torch, kernels and libraries run as they would without it.
#
# NCCL_NVLS_ENABLE=0 (a default: a value the caller set is kept). NVLink multicast must stay off
# on the machines this project runs on; the project's scripts, tests and benchmarks set it too.
_os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
#
# CUDA_MODULE_LOADING: not touched. EAGER would make every CUDA library in the process (torch,
# cuBLAS, ...) load all of its kernels when CUDA starts: seconds and hundreds of MB per process.
# cuflux's hazard under lazy loading is a kernel of its own loaded at first launch (which may
# need the context to synchronise) while one of its waits blocks a stream. Its kernels are
# loaded when an op is built instead: kernels.load fetches every function of a module
# (cuModuleGetFunction loads the kernel it returns), and ops warm up in their constructors.
#
# CUDA_DEVICE_MAX_CONNECTIONS: not touched (Megatron sets 1; CUDA's default is 8). A timed-out
# stream wait on a host-mapped flag is released by a CPU store (watchdog.py), which needs no
# hardware queue. With 1, a waiting stream holds back every later-queued stream of the process:
# watchdog.StreamWaiter warns once and says what that costs.
#
# cuflux's own settings (CUFLUX_*): all declared in cuflux/knobs.py, listed in docs/knobs.md.

from cuflux.errors import (CaptureError, CommTimeoutError, CudaError, CufluxError,  # noqa: E402
                           NoDeviceError, PeerFailedError)
from cuflux import reference  # noqa: E402,F401  (cuflux.reference: every op's NumPy model)
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
           "CommTimeoutError", "PeerFailedError", "CudaError", "CufluxError", "CaptureError",
           "NoDeviceError",
           "reference", "__version__"]
