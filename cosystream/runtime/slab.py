"""The state slab: every live session's model caches in preallocated device memory, one slot each.

For each cache spec, one tensor ``[max_sessions + 1, *shape]``; the last slot is scratch, the target of
padding rows in a batch. A free list hands out slots in O(1); freeing or resetting a slot zeroes it, so a
new session or utterance always starts from clean caches. Nothing is allocated per session after start-up.
(An engine with several models numbers its slots across them: it gives each model a slab of the same size
and only zeroes rows of it, ``reset``, handing out the slots itself.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cosystream.models.contract import CacheSpec

SLAB_MARGIN_BYTES = 2 << 30
"""Device memory a CUDA engine leaves free beyond its slabs, at least: CUDA graphs' pool, the step's
activations, cuBLAS's workspace, a model loaded while serving (``SLAB_MARGIN_SHARE`` of the device if more)."""
SLAB_MARGIN_SHARE = 0.1


def slot_bytes(specs: list[CacheSpec]) -> int:
    """One slot's caches, in bytes."""
    return sum(math.prod(spec.shape) * spec.dtype.itemsize for spec in specs)


@dataclass(frozen=True, slots=True)
class SlabPlan:
    """How many slots a device's free memory holds (:func:`plan_slab`)."""

    slots: int  # what the engine allocates: the slots asked, or fewer where they do not fit
    asked: int
    slot_bytes: int  # per slot, every slab counted (one per model, and one more for a model loaded beside)
    free_bytes: int
    total_bytes: int
    margin_bytes: int

    @property
    def fits(self) -> bool:
        return self.slots == self.asked

    @property
    def slab_bytes(self) -> int:
        return self.slots * self.slot_bytes


def plan_slab(asked: int, slot_bytes: int, free_bytes: int, total_bytes: int) -> SlabPlan:
    """The slots to allocate on a device with ``free_bytes`` of ``total_bytes`` free: ``asked`` (``--max-sessions``)
    where they fit beside the margin, else as many as do (at least 1: a device with no room at all fails
    where the allocation does, with CUDA's own message)."""
    margin = max(SLAB_MARGIN_BYTES, int(SLAB_MARGIN_SHARE * total_bytes))
    room = max(0, free_bytes - margin)
    fit = room // slot_bytes if slot_bytes else asked
    return SlabPlan(max(1, min(asked, fit)), asked, slot_bytes, free_bytes, total_bytes, margin)


class SlabFullError(RuntimeError):
    """Every slot is in use."""


class StateSlab:
    def __init__(self, specs: list[CacheSpec], max_sessions: int, device: str | torch.device = "cpu"):
        if max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        self.specs = list(specs)
        self.max_sessions = max_sessions
        self.scratch_slot = max_sessions
        self.device = torch.device(device)
        self.tensors = [
            torch.zeros((max_sessions + 1, *spec.shape), dtype=spec.dtype, device=self.device) for spec in specs
        ]
        # Popped from the end: slot 0 is handed out first.
        self._free = list(range(max_sessions - 1, -1, -1))
        self._in_use = bytearray(max_sessions)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def used_slots(self) -> int:
        return self.max_sessions - len(self._free)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def is_allocated(self, slot: int) -> bool:
        return 0 <= slot < self.max_sessions and bool(self._in_use[slot])

    def alloc(self) -> int:
        """A clean slot for a new session; raises ``SlabFullError`` when all are taken."""
        if not self._free:
            raise SlabFullError(f"all {self.max_sessions} session slots are in use")
        slot = self._free.pop()
        self._in_use[slot] = 1
        return slot

    def free(self, slot: int) -> None:
        """Return ``slot`` to the free list, zeroed."""
        self._check(slot)
        self.reset(slot)
        self._in_use[slot] = 0
        self._free.append(slot)

    def reset(self, slot: int) -> None:
        """Zero every cache of ``slot`` (a new utterance starts from silence)."""
        for tensor in self.tensors:
            tensor[slot].zero_()

    def _check(self, slot: int) -> None:
        if not self.is_allocated(slot):
            raise ValueError(f"slot {slot} is not allocated")
