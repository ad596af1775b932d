"""Test doubles for the CPU tests: what the argument checks read from a CuPy array."""
from types import SimpleNamespace

import numpy as np

from cuflux.arrays import dtype_info


class FakeArray:
    """shape, dtype (a cuflux dtype name or anything numpy takes), contiguity, device and a
    data pointer: enough for check_array and the alignment checks, no GPU needed."""

    def __init__(self, shape, dtype="bfloat16", contiguous=True, device=0, ptr=1 << 20):
        self.shape, self.ndim = tuple(shape), len(shape)
        try:
            self.dtype = dtype_info(dtype).storage
        except TypeError:
            self.dtype = np.dtype(dtype)
        self.size = int(np.prod(shape))
        self.flags = SimpleNamespace(c_contiguous=contiguous)
        self._c_contiguous = contiguous
        self.strides = (0,) * len(shape)
        self.device = SimpleNamespace(id=device)
        self.data = SimpleNamespace(ptr=ptr, device_id=device)


class FakeErrorRecord:
    """What the stream-wait watchdog reads and writes of an ErrorRecord: its words, timeout
    and rank (no pinned memory, no GPU)."""

    def __init__(self, timeout_s, rank=0):
        from cuflux import errors as E

        self.words = np.zeros(E.NUM_WORDS, dtype=np.uint32)
        self.timeout_s, self.rank = timeout_s, rank

    def failed(self):
        from cuflux import errors as E

        return int(self.words[E.STATUS]) != 0

    def tell(self):
        """ErrorRecord.tell: this fake has no failure board (W = 1)."""

    gone: set | None = None  # ranks that left the op (None: no board, every rank reads gone)

    def peer_gone(self, rank):
        """ErrorRecord.peer_gone: without a board (W = 1) every peer reads as gone."""
        return self.gone is None or rank in self.gone
