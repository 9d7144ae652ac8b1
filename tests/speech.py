"""Test audio: real speech synthesized with espeak-ng, resampled to the rates and encodings clients send."""

from __future__ import annotations

import functools
import shutil
import subprocess
import tempfile
import wave
from pathlib import Path

import numpy as np
import pytest
import soxr

from cosystream.audio.codecs import encode_alaw, encode_mulaw

needs_espeak = pytest.mark.skipif(
    shutil.which("espeak-ng") is None, reason="needs espeak-ng (apt-get install espeak-ng)"
)


@functools.lru_cache(maxsize=64)
def speech(text: str, voice: str = "en-us", rate_hz: int = 16000) -> np.ndarray:
    """``text`` spoken by espeak-ng, float32 mono at ``rate_hz``."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "speech.wav"
        subprocess.run(["espeak-ng", "-v", voice, "-w", str(path), text], check=True, capture_output=True)
        with wave.open(str(path)) as wav:
            source_hz = wav.getframerate()
            audio = np.frombuffer(wav.readframes(wav.getnframes()), "<i2").astype(np.float32) / 32768
    return soxr.resample(audio, source_hz, rate_hz).astype(np.float32)


def silence(seconds: float, rate_hz: int = 16000) -> np.ndarray:
    return np.zeros(int(seconds * rate_hz), dtype=np.float32)


def encode(audio: np.ndarray, encoding: str) -> bytes:
    if encoding == "LINEAR16":
        return (np.clip(audio, -1, 1 - 1 / 32768) * 32768).astype("<i2").tobytes()
    if encoding == "MULAW":
        return encode_mulaw(audio)
    if encoding == "ALAW":
        return encode_alaw(audio)
    raise ValueError(encoding)


def two_speakers(first: str, second: str, rate_hz: int = 16000, encoding: str = "LINEAR16") -> bytes:
    """A two-channel recording, interleaved: ``first`` spoken on channel 1 from 0.3 s, ``second`` on
    channel 2 from 0.8 s (a caller and an agent), each followed by a second of silence."""
    one = np.concatenate([silence(0.3, rate_hz), speech(first, rate_hz=rate_hz), silence(1.0, rate_hz)])
    two = np.concatenate([silence(0.8, rate_hz), speech(second, rate_hz=rate_hz), silence(1.0, rate_hz)])
    n = max(len(one), len(two))
    dtype = np.dtype("<i2") if encoding == "LINEAR16" else np.dtype(np.uint8)
    channels = [np.frombuffer(encode(np.pad(x, (0, n - len(x))), encoding), dtype) for x in (one, two)]
    return np.stack(channels, axis=1).tobytes()


def closer_to(text: str, sentences: list[str]) -> str:
    """Which of ``sentences`` ``text`` shares the most words with."""
    words = set(text.lower().split())
    return max(sentences, key=lambda sentence: len(words & set(sentence.split())))


def compress(audio: np.ndarray, rate_hz: int, container: str, channels: int = 1) -> bytes:
    """``audio`` as an Ogg or WebM Opus, or a FLAC file (:func:`benchmarks.codecs.encode_compressed`)."""
    from benchmarks.codecs import encode_compressed

    return encode_compressed(audio, rate_hz, container, channels)
