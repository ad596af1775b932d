"""The one rule for size arguments (buffer bounds, dimensions, chunk and group sizes).

A size is an int (a Python int or a NumPy integer; not a bool, not a float even when it is
integral, not a str), >= its minimum, <= its maximum where it has one, a multiple of its unit
where it has one, and named for what it counts (`max_rows` rows per rank, `max_m` the GEMM's
M, `max_elems` elements, `max_tokens_per_rank` tokens per rank). Every constructor checks its
sizes through `count`, so a wrong size reads the same in every op:

    AllGather: max_rows must be an integer >= 1 (rows per rank), got '4096' (str)
    AllGatherGemm: n must be an integer in [8, 2147483640], a multiple of 8 (this rank's output
      columns; rows move in 16-byte pieces), got 100 (int)

`count` returns a Python int, so what a constructor stores, and what World.check_same compares
across ranks, does not depend on whether the caller passed an int or an np.int64.
"""
from __future__ import annotations

import numpy as np

__all__ = ["count", "optional_count", "is_count"]


def is_count(value) -> bool:
    """A Python int or a NumPy integer, not a bool (True is an int to Python, never a size)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _rule(minimum: int, maximum: int | None, multiple_of: int) -> str:
    rule = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    return rule if multiple_of == 1 else f"{rule}, a multiple of {multiple_of}"


def count(op: str, name: str, value, minimum: int = 1, maximum: int | None = None,
          what: str = "", multiple_of: int = 1) -> int:
    """`value` as an int, or ValueError naming the op, the argument, the rule and what came.

    op: the op named in the message ("AllGather"); name: the argument ("max_rows");
    minimum / maximum: inclusive bounds (maximum None: none); what: what the size counts, said
    in the message ("rows per rank"); multiple_of: the value must be a multiple of it.
    """
    return _check(op, name, value, minimum, maximum, what, multiple_of, none_ok=False)


def optional_count(op: str, name: str, value, minimum: int = 1, maximum: int | None = None,
                   what: str = "", multiple_of: int = 1) -> int | None:
    """count(...) for a size that may be None (the op then picks it): None or an int."""
    if value is None:
        return None
    return _check(op, name, value, minimum, maximum, what, multiple_of, none_ok=True)


def _check(op, name, value, minimum, maximum, what, multiple_of, none_ok):
    if (not is_count(value) or value < minimum or (maximum is not None and value > maximum)
            or value % multiple_of):
        rule = _rule(minimum, maximum, multiple_of) + (" or None" if none_ok else "")
        raise ValueError(f"{op}: {name} must be an integer {rule}"
                         + (f" ({what})" if what else "")
                         + f", got {value!r} ({type(value).__name__})")
    return int(value)
