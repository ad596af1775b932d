"""NumPy golden models of the ops (float64 where arithmetic happens), for tests and users.

Each takes the per-rank inputs as a list indexed by rank and returns the per-rank outputs.
Op families that own their reference (all2all, allreduce) re-export it here.
"""
from __future__ import annotations

import numpy as np

__all__ = ["allgather"]


def allgather(shards: list[np.ndarray]) -> list[np.ndarray]:
    """[rows, cols] per rank -> the same [W * rows, cols] on every rank (exact copy)."""
    full = np.concatenate(shards, axis=0)
    return [full.copy() for _ in shards]
