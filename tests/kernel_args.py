"""Check launch arguments against a kernel's C signature, on the CPU (a wrong order or type
would silently corrupt memory on the GPU). Used by the ops' CPU tests."""
from __future__ import annotations

import re

import numpy as np

from cuflux import kernels

_QUALIFIERS = ("__restrict__", "__grid_constant__", "const ")


class DeviceArray:
    """Stands for a CuPy array argument (a device pointer) in captured launches."""


def params(source: str, kernel: str) -> list[str]:
    """Parameters ("type name", qualifiers dropped) of the definition of `kernel` in
    kernels_cu/<source>."""
    src = (kernels.KERNEL_DIR / source).read_text()
    m = re.search(r"\b" + re.escape(kernel) + r"\s*\(([^)]*)\)\s*\{", src)
    assert m, f"{source}: no definition of {kernel}"
    text = m.group(1)
    for q in _QUALIFIERS:
        text = text.replace(q, " ")
    return [" ".join(p.split()) for p in text.split(",") if p.strip()]


def signature(source: str, kernel: str) -> list[str]:
    """The type of each parameter of `kernel`."""
    return [p.rsplit(" ", 1)[0] for p in params(source, kernel)]


def names(source: str, kernel: str) -> list[str]:
    return [p.rsplit(" ", 1)[-1] for p in params(source, kernel)]


def expected(ctype: str) -> tuple:
    if ctype.endswith("*"):
        return (np.uint64, DeviceArray)
    if ctype.endswith("TmaDesc"):
        return (np.void,)
    return {"u64": (np.uint64,), "unsigned long long": (np.uint64,), "u32": (np.uint32,),
            "unsigned int": (np.uint32,), "int": (np.int32,), "long long": (np.int64,),
            "float": (np.float32,)}[ctype]


def check_args(source: str, kernel: str, args) -> None:
    """Count and numpy type of every argument against the kernel's parameters."""
    sig = signature(source, kernel)
    assert len(args) == len(sig), f"{kernel}: {len(args)} arguments for {len(sig)} parameters"
    for i, (ctype, a) in enumerate(zip(sig, args)):
        assert isinstance(a, expected(ctype)), f"{kernel} argument {i} ({ctype}): {a!r}"
