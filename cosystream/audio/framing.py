"""Exact 10 ms frames out of a stream of samples, and the ring of recent frames kept for pre-roll."""

from __future__ import annotations

import numpy as np

from cosystream.frames import FRAME_SAMPLES


class Framer:
    """Cuts a stream of samples into exact frames of ``frame_samples`` (default 10 ms at 16 kHz).

    Only the partial frame (< ``frame_samples`` samples) is kept between calls, in a buffer
    allocated once. ``push`` returns a new ``[n, frame_samples]`` array owned by the caller:
    the frames usually outlive the call (queued for the model). A caller that hands over its
    samples (``owned=True``: nobody writes them afterwards) gets, when no partial frame is
    pending, a view of them instead of a copy.
    """

    __slots__ = ("_buf", "_empty", "_pending", "frame_samples")

    def __init__(self, frame_samples: int = FRAME_SAMPLES) -> None:
        if frame_samples <= 0:
            raise ValueError(f"frame_samples must be positive, got {frame_samples}")
        self.frame_samples = frame_samples
        self._buf = np.zeros(frame_samples, dtype=np.float32)
        self._pending = 0
        self._empty = np.zeros((0, frame_samples), dtype=np.float32)
        self._empty.flags.writeable = False

    @property
    def pending_samples(self) -> int:
        """Samples waiting for the rest of their frame."""
        return self._pending

    def push(self, x: np.ndarray, owned: bool = False) -> np.ndarray:
        """Add samples; return the ``[n, frame_samples]`` complete frames now available (n may be 0)."""
        size = self.frame_samples
        pending = self._pending
        total = pending + len(x)
        n = total // size
        if n == 0:
            self._buf[pending:total] = x
            self._pending = total
            return self._empty
        if owned and pending == 0 and x.dtype == np.float32 and x.flags.c_contiguous:
            used = n * size
            rest = len(x) - used
            self._buf[:rest] = x[used:]
            self._pending = rest
            return x[:used].reshape(n, size)
        frames = np.empty((n, size), dtype=np.float32)
        flat = frames.reshape(-1)
        flat[:pending] = self._buf[:pending]
        used = n * size - pending
        flat[pending:] = x[:used]
        rest = len(x) - used
        self._buf[:rest] = x[used:]
        self._pending = rest
        return frames

    def flush_padded(self) -> np.ndarray:
        """Return the pending samples zero-padded to one frame (``[1, size]``), or ``[0, size]``."""
        if self._pending == 0:
            return self._empty
        frame = np.zeros((1, self.frame_samples), dtype=np.float32)
        frame[0, : self._pending] = self._buf[: self._pending]
        self._pending = 0
        return frame


class FrameRing:
    """The last ``capacity`` frames, so pre-roll can be forwarded once speech is confirmed.

    Storage is one ``[capacity, frame_samples]`` array allocated up front; ``push`` copies a
    frame into the next slot. Size it with :attr:`Endpointer.max_forward_frames`.
    """

    __slots__ = ("_buf", "_count", "_head", "_offsets", "capacity")

    def __init__(self, capacity: int, frame_samples: int = FRAME_SAMPLES) -> None:
        if capacity <= 0:
            raise ValueError(f"FrameRing capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._buf = np.zeros((capacity, frame_samples), dtype=np.float32)
        self._offsets = np.arange(capacity)
        self._head = 0  # slot the next push writes
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def push(self, frame: np.ndarray) -> None:
        """Store one frame, overwriting the oldest when full."""
        self._buf[self._head] = frame
        self._head = (self._head + 1) % self.capacity
        self._count = min(self._count + 1, self.capacity)

    def last(self, k: int) -> np.ndarray:
        """Copy of the ``k`` most recent frames, oldest first, as ``[k, frame_samples]``."""
        if not 0 <= k <= self._count:
            raise ValueError(f"asked for the last {k} frames but the ring holds {self._count}")
        if k == 1:
            return self._buf[self._head - 1][None].copy()
        return self._buf[(self._head - k + self._offsets[:k]) % self.capacity]

    def clear(self) -> None:
        self._head = 0
        self._count = 0
