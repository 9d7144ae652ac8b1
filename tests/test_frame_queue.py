"""The engine's per-slot frame ring: order, wrap-around, overflow, and gathering into a caller's buffer."""

from __future__ import annotations

import numpy as np
import torch

from cosystream.engine.frame_queue import FrameQueue
from cosystream.frames import FRAME_SAMPLES
from cosystream.models import load_model
from cosystream.runtime.runner import Runner, RunnerConfig
from cosystream.runtime.slab import StateSlab


def frames(n: int, start: float) -> np.ndarray:
    return (start + np.arange(n * FRAME_SAMPLES, dtype=np.float32).reshape(n, FRAME_SAMPLES)) / 1e4


def test_frames_come_out_in_order_across_the_wrap():
    queue = FrameQueue(slots=3, capacity=8, max_take=4)
    sent = {0: [], 2: []}
    for round_ in range(6):  # 6 x (3 in, 3 out) on a ring of 8: the tail wraps twice
        for slot in sent:
            batch = frames(3, 1000 * slot + 10 * round_)
            assert queue.push(slot, batch) == 3
            sent[slot].append(batch)
        for t, slots in ((1, [0, 2]), (2, [2, 0])):
            got = queue.take(slots, t)
            for row, slot in enumerate(slots):
                expected = np.concatenate(sent[slot]).reshape(-1)[: t * FRAME_SAMPLES]
                assert np.array_equal(got[row], expected)
                sent[slot] = [np.concatenate(sent[slot])[t:]]
    assert queue.queued(0) == queue.queued(2) == 0 and queue.queued(1) == 0


def test_overflow_keeps_what_fits_and_clear_empties_the_slot():
    queue = FrameQueue(slots=1, capacity=4, max_take=4)
    assert queue.push(0, frames(3, 0)) == 3
    assert queue.push(0, frames(3, 5)) == 1  # a frontend over its in-flight limit: the rest is dropped
    assert queue.queued(0) == 4
    queue.clear(0)
    assert queue.queued(0) == 0 and queue.push(0, frames(2, 9)) == 2


def test_take_into_a_buffer_equals_take_and_the_runner_reads_it_in_place():
    rng = np.random.default_rng(0)
    a, b = FrameQueue(4, 16, 4), FrameQueue(4, 16, 4)
    for slot in range(4):
        data = rng.standard_normal((7, FRAME_SAMPLES)).astype(np.float32)
        a.push(slot, data)
        b.push(slot, data)
    model = load_model()
    runner = Runner(model, StateSlab(model.cache_specs(), 4), RunnerConfig(max_batch=4, frame_buckets=(1, 4)))
    buffer = runner.input_buffer(3, 4)
    assert buffer is not None and buffer.shape == (3, 4 * FRAME_SAMPLES)
    filled = b.take([3, 0, 1], 4, out=buffer)
    assert filled is buffer and np.array_equal(filled, a.take([3, 0, 1], 4))
    reference = Runner(model, StateSlab(model.cache_specs(), 4), RunnerConfig(max_batch=4, frame_buckets=(1, 4)))
    with torch.no_grad():
        in_place = runner.run([3, 0, 1], buffer)
        copied = reference.run([3, 0, 1], filled.copy())
    assert np.array_equal(in_place.ids, copied.ids) and np.allclose(in_place.logprobs, copied.logprobs)
