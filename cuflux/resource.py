"""Lifetime of objects that own collective resources (symmetric buffers, flags, streams)."""
from __future__ import annotations

__all__ = ["Closeable"]


class Closeable:
    """`close()` is idempotent and also runs on context exit; subclasses free in `_release()`.

    For ops, close() is collective: every rank must call it (symmetric buffers are freed after a
    barrier so no peer still reads or writes them).
    """

    _closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._release()

    def _release(self) -> None:  # pragma: no cover - every subclass overrides it
        raise NotImplementedError

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        """Leaving a `with` block on a CommTimeoutError aborts (local, returns at once) where
        the object can: a dead peer would never come to close()'s barrier."""
        from cuflux.errors import CommTimeoutError

        if isinstance(exc, CommTimeoutError) and hasattr(self, "abort"):
            self.abort()
        else:
            self.close()
