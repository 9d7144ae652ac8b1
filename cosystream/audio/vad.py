"""Voice activity per 10 ms frame: webrtcvad on the CPU."""

from __future__ import annotations

import numpy as np
import webrtcvad

from cosystream.frames import FRAME_SAMPLES, SAMPLE_RATE_HZ


class Vad:
    """webrtcvad on one 10 ms frame of 16 kHz float32 audio.

    webrtcvad takes only 10/20/30 ms of 16-bit mono PCM, as a bytes-like object whose
    ``len`` is the byte count (a numpy array or int16 memoryview is rejected), so frames are
    converted into one preallocated ``bytearray`` through an int16 view of it.
    """

    __slots__ = ("_int16_levels", "_pcm", "_pcm_bytes", "_scaled", "_vad")

    def __init__(self, aggressiveness: int = 2, int16_levels: bool = False) -> None:
        """``int16_levels``: every frame holds int16 levels / 32768 (decoded PCM or G.711 that was not
        resampled), so it goes back to int16 by one multiply with nothing to clip (the same bytes; half
        the conversion's cost, which was 3x webrtcvad's own). Resampled audio can overshoot [-1, 1]."""
        if not 0 <= aggressiveness <= 3:
            raise ValueError(f"VAD aggressiveness must be 0..3, got {aggressiveness}")
        self._vad = webrtcvad.Vad(aggressiveness)
        self._int16_levels = int16_levels
        self._pcm_bytes = bytearray(FRAME_SAMPLES * 2)
        self._pcm = np.frombuffer(self._pcm_bytes, dtype="<i2")
        self._scaled = np.zeros(FRAME_SAMPLES, dtype=np.float32)

    def is_speech(self, frame: np.ndarray) -> bool:
        """True if webrtcvad classifies this ``[160]`` float32 frame (values in [-1, 1]) as speech."""
        if frame.shape != (FRAME_SAMPLES,):
            raise ValueError(f"expected one frame of shape ({FRAME_SAMPLES},), got {frame.shape}")
        if self._int16_levels:
            np.multiply(frame, 32768.0, out=self._pcm, casting="unsafe")  # exact: a power-of-two scale
        else:
            np.multiply(frame, 32768.0, out=self._scaled)
            np.clip(self._scaled, -32768.0, 32767.0, out=self._scaled)
            np.copyto(self._pcm, self._scaled, casting="unsafe")
        return self._vad.is_speech(self._pcm_bytes, SAMPLE_RATE_HZ)
