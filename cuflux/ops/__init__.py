"""Op families; importing this registers every op's kernel family with cuflux.kernels (and,
through allgather, the transport's signal.cu: cuflux/signal.py)."""
from cuflux.ops import allgather  # noqa: F401
from cuflux.ops import allreduce  # noqa: F401
from cuflux.ops import all2all  # noqa: F401
from cuflux.ops import gemm  # noqa: F401
from cuflux.ops import ag_gemm  # noqa: F401
from cuflux.ops import gemm_rs  # noqa: F401
