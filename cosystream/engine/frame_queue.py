"""The audio the engine holds for its sessions: per slot, a ring of 10 ms frames waiting for a step."""

from __future__ import annotations

import logging

import numpy as np

from cosystream.frames import FRAME_SAMPLES

log = logging.getLogger(__name__)


class FrameQueue:
    """One preallocated ``[slots, capacity, 160]`` float32 ring; per slot, head = next frame to step and
    tail = next free place. Nothing is allocated per frame: ``push`` copies frames in, ``take`` gathers a
    step's rows into one new array (the copy the model input needs anyway)."""

    __slots__ = ("_frames", "_head", "_offsets", "_tail", "capacity")

    def __init__(self, slots: int, capacity: int, max_take: int) -> None:
        self.capacity = capacity
        self._frames = np.zeros((slots, capacity, FRAME_SAMPLES), dtype=np.float32)
        self._head = np.zeros(slots, dtype=np.int64)
        self._tail = np.zeros(slots, dtype=np.int64)
        self._offsets = np.arange(max_take)

    def queued(self, slot: int) -> int:
        return int(self._tail[slot] - self._head[slot])

    def push(self, slot: int, frames: np.ndarray) -> int:
        """Queue ``[n, 160]`` frames for ``slot``; returns how many fit (all, unless the frontend sent more
        than it may keep in flight: the excess is dropped and logged, that session's transcript suffers,
        and no other session waits)."""
        count = len(frames)
        room = self.capacity - self.queued(slot)
        if count > room:
            log.error(
                "slot %d: %d frames queued, %d more do not fit; dropping them",
                slot,
                self.queued(slot),
                count - room,
            )
            frames, count = frames[:room], room
        index = (self._tail[slot] + np.arange(count)) % self.capacity
        self._frames[slot, index] = frames
        self._tail[slot] += count
        return count

    def take(self, slots: list[int], frames: int, out: np.ndarray | None = None) -> np.ndarray:
        """The next ``frames`` frames of each slot as one ``[len(slots), frames * 160]`` array (written into
        ``out`` when given: the runner's input buffer), and dequeue them."""
        rows = np.asarray(slots)
        index = (self._head[rows][:, None] + self._offsets[:frames]) % self.capacity
        if out is None:
            pcm = self._frames[rows[:, None], index].reshape(len(rows), frames * FRAME_SAMPLES)
        else:
            pcm = out
            np.take(
                self._frames.reshape(-1, FRAME_SAMPLES),
                rows[:, None] * self.capacity + index,
                axis=0,
                out=out.reshape(len(rows), frames, FRAME_SAMPLES),
                mode="clip",  # (the indices are in range; "raise" would gather into a temporary first)
            )
        self._head[rows] += frames
        return pcm

    def clear(self, slot: int) -> None:
        self._head[slot] = self._tail[slot] = 0
