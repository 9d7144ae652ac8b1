"""The shapes a model step is padded to: frames per row (T) and rows per step. Standard library only, so the
scheduler can plan with the same buckets the runner captures, without importing torch."""

FRAME_BUCKETS = (1, 2, 4, 16)
"""Frames per row a step may take (T). 1 steps a live stream as each frame arrives; 4 lets a session that
fell behind catch up; 16 carries a speech onset's pre-roll, and BATCH work, in one step."""


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """Rows per step a batch is padded to: powers of two below ``max_batch``, then ``max_batch`` itself."""
    buckets = []
    size = 1
    while size < max_batch:
        buckets.append(size)
        size *= 2
    buckets.append(max_batch)
    return tuple(buckets)
