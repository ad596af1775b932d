"""NumPy golden models of the ops (float64 where arithmetic happens), for tests and users.

Each takes the per-rank inputs as a list indexed by rank and returns the per-rank outputs.
Op families that own their reference (all2all, allreduce) re-export it here.
"""
from __future__ import annotations

import numpy as np

__all__ = ["allgather", "allreduce", "allreduce_rmsnorm", "scatter_heads", "gather_heads",
           "ag_gemm", "gemm_rs"]


def allgather(shards: list[np.ndarray]) -> list[np.ndarray]:
    """[rows, cols] per rank -> the same [W * rows, cols] on every rank (exact copy)."""
    full = np.concatenate(shards, axis=0)
    return [full.copy() for _ in shards]


def __getattr__(name):
    """The op families' own models, re-exported lazily (they import their op modules)."""
    table = {"allreduce": ("cuflux.ops.allreduce", "reference_allreduce"),
             "allreduce_rmsnorm": ("cuflux.ops.allreduce", "reference_allreduce_rmsnorm"),
             "scatter_heads": ("cuflux.ops.all2all", "reference_scatter_heads"),
             "gather_heads": ("cuflux.ops.all2all", "reference_gather_heads"),
             "ag_gemm": ("cuflux.ops.ag_gemm", "reference_ag_gemm"),
             "gemm_rs": ("cuflux.ops.gemm_rs", "reference_gemm_rs")}
    if name not in table:
        raise AttributeError(f"module 'cuflux.reference' has no attribute {name!r}")
    import importlib

    module, attr = table[name]
    return getattr(importlib.import_module(module), attr)
