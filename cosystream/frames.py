"""The frame every layer agrees on: 10 ms at 16 kHz. Stated once here; everything imports it.

No imports, so the lightest module (the decoder, a client, a benchmark) can use it without pulling in torch,
soxr or grpc.
"""

SAMPLE_RATE_HZ = 16000
"""The model's sample rate: every session is resampled to it."""
FRAME_MS = 10
"""One frame: the unit of VAD, of the model step and of every time offset the server reports."""
FRAME_SAMPLES = SAMPLE_RATE_HZ * FRAME_MS // 1000
"""160 samples per frame."""
