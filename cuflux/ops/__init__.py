"""Op families; importing this registers every kernel family with cuflux.kernels."""
from cuflux.ops import signal  # noqa: F401
from cuflux.ops import allgather  # noqa: F401
from cuflux.ops import allreduce  # noqa: F401
from cuflux.ops import all2all  # noqa: F401
from cuflux.ops import gemm  # noqa: F401
from cuflux.ops import ag_gemm  # noqa: F401
from cuflux.ops import gemm_rs  # noqa: F401
