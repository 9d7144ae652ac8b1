"""Shared test fixtures: speech-like audio, small model instances, and a stub on a module's server."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import grpc
import numpy as np
import pytest
import torch

from cosystream.models import load_model

# Compiled steps found in a developer's cache would change what every engine under test runs (and cost each
# start seconds to load): the tests' servers, in process or not, get a cache of their own, empty at start.
os.environ["COSYSTREAM_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="cosystream-test-compiled-")
atexit.register(shutil.rmtree, os.environ["COSYSTREAM_COMPILE_CACHE"], ignore_errors=True)


def speech_like(seconds: float, seed: int, rate_hz: int = 16000) -> np.ndarray:
    """Voiced-speech-like audio: a wandering pitch with harmonics, syllable-rate amplitude, breath noise."""
    rng = np.random.default_rng(seed)
    n = int(seconds * rate_hz)
    t = np.arange(n) / rate_hz
    pitch_hz = 120 + 30 * np.sin(2 * np.pi * 0.7 * t + rng.uniform(0, 6)) + rng.uniform(-20, 20)
    phase = 2 * np.pi * np.cumsum(pitch_hz) / rate_hz
    voiced = sum(np.sin(h * phase) / h for h in range(1, 12))
    syllables = np.clip(np.sin(2 * np.pi * 4.0 * t + rng.uniform(0, 6)), 0, None) ** 2
    audio = 0.25 * syllables * voiced + 0.01 * rng.standard_normal(n)
    return np.clip(audio, -1, 1).astype(np.float32)


@pytest.fixture(scope="session")
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return load_model()


@pytest.fixture(scope="module")
def stub(server):
    """A CosyStream stub on the module's ``server`` fixture (a ``local_server``), closed after the module."""
    from cosystream.v1 import cosystream_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel(server.address)
    yield pb_grpc.CosyStreamStub(channel)
    channel.close()
